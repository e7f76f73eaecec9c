"""``farm bench``: the paper's experiments on this machine, and farm beside its peers."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import click

from farm import defaults

#: ``--setups`` and ``--peers`` values: ``farm.benchsuite.setups.SETUP_NAMES`` and
#: ``farm.benchsuite.peers.PEERS`` (kept here so that ``farm --help`` loads no engine; a test
#: checks they match).
SETUP_CHOICES = ("cores", "mixed", "gpu")
PEER_CHOICES = (
    "opencv-threads",
    "process-pool",
    "ray-data",
    "onnxruntime-threads",
    "openvino-throughput",
)


def comma_list(
    choices: Sequence[str],
) -> Callable[[click.Context, click.Parameter, str], tuple[str, ...]]:
    """A click callback: a comma-separated subset of ``choices``."""

    def parse(_ctx: click.Context, _param: click.Parameter, text: str) -> tuple[str, ...]:
        items = tuple(item.strip() for item in text.split(",") if item.strip())
        unknown = [item for item in items if item not in choices]
        if unknown:
            raise click.BadParameter(
                f"unknown {', '.join(unknown)}; choose among {', '.join(choices)}"
            )
        return items

    return parse


@click.command()
@click.option(
    "--out",
    default="bench-results",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder that receives the results folder (DATE-CORES-cpu|gpu).",
)
@click.option(
    "--models",
    default=",".join(defaults.BENCH_MODELS),
    show_default=True,
    help="Comma-separated models (each needs a bundled sample).",
)
@click.option(
    "--images",
    default=defaults.BENCH_IMAGES,
    show_default=True,
    type=click.IntRange(1000),
    help="Images per job of the policy sweep and the peers.",
)
@click.option(
    "--repeat",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Rounds of the policy sweep; each figure is the median.",
)
@click.option(
    "--setups",
    default=",".join(SETUP_CHOICES),
    show_default=True,
    callback=comma_list(SETUP_CHOICES),
    help="Farms to build: cores (one worker per core on auto), mixed (OpenCV and "
    "torch on alternate cores), gpu (one worker per GPU, each fed by a core of its own, "
    "and the other cores); those this machine cannot build are skipped and named.",
)
@click.option(
    "--peers",
    "peer_names",
    default=",".join(PEER_CHOICES),
    show_default=True,
    callback=comma_list(PEER_CHOICES),
    help="Peers to run beside the farm ('' for none); ray-data needs ray[data].",
)
@click.option(
    "--peer-rounds",
    default=defaults.BENCH_PEER_ROUNDS,
    show_default=True,
    type=click.IntRange(1),
    help="Rounds of farm's best policy and every peer run in turn (medians).",
)
@click.option(
    "--quick",
    is_flag=True,
    help="One parameter value per policy and three Table 2 sizes (a smoke run).",
)
@click.option(
    "--policies-only",
    is_flag=True,
    help="Only the policy sweep (Figures 3/4, Tables 4/5, Figure 5: every policy at the "
    "paper's values, each job's waste from its trace, bracketed by standalone speeds): no "
    "Table 2, no peers.",
)
@click.option(
    "--render",
    type=click.Path(file_okay=False, exists=True),
    help="Measure nothing: write the report and figures again from the CSV "
    "tables of this results folder.",
)
def bench(
    out: str,
    models: str,
    images: int,
    repeat: int,
    setups: tuple[str, ...],
    peer_names: tuple[str, ...],
    peer_rounds: int,
    quick: bool,
    policies_only: bool,
    render: str | None,
) -> None:
    """The paper's experiments on this machine, and farm beside what users pick instead.

    Writes CSV tables, PNG figures and report.md: Table 2 per device kind,
    every policy at the paper's parameter values (Figures 3/4, Tables 4/5),
    waste per policy from each job's trace, its workers' idle time (Figure 5),
    with the drift of their standalone speeds measured just before and after
    each job, and farm's best policy against one OpenCV, ONNX Runtime or
    OpenVINO process on every core, a multiprocessing pool and Ray Data.  Run
    it on an otherwise idle machine: every figure but the waste is a throughput.

    \b
    Examples:
      farm bench                                  # the full suite (about an hour on 2 cores)
      farm bench --quick --images 5000            # a smoke run, a minute or two
      farm bench --policies-only --setups cores   # Tables 4/5 and Figures 3-5 alone
      farm bench --models lenet --setups cores --peers opencv-threads --repeat 3
      farm bench --render bench-results/2026-11-23-2cores-cpu   # report again from its CSV
    """
    if render:
        render_again(Path(render))
        return
    from farm.benchsuite.suite import SuiteConfig, run_suite

    config = SuiteConfig(
        out=Path(out),
        models=sampled_models(models),
        images=images,
        repeat=repeat,
        setups=setups,
        peers=peer_names,
        quick=quick,
        standalone_images=min(images, 30_000),
        table2_images=min(images, 10_000),
        tune_images=min(images, 10_000),
        peer_rounds=peer_rounds,
        policies_only=policies_only,
    )
    command = "farm bench " + " ".join(shlex.quote(arg) for arg in sys.argv[2:])
    folder = run_suite(config, command, lambda line: click.echo(line, err=True))
    click.echo(f"results in {folder}: report.md, CSV tables, PNG figures")


def render_again(folder: Path) -> None:
    """``--render``: the report and figures of a results folder, from its CSV tables."""
    from farm.benchsuite.results import read_folder, write_folder

    try:
        write_folder(folder, read_folder(folder))
    except (OSError, KeyError, ValueError) as exc:
        raise click.ClickException(
            f"{folder} is not a complete farm bench results folder: {type(exc).__name__}: {exc}"
        ) from None
    click.echo(f"report and figures written again in {folder}")


def sampled_models(text: str) -> tuple[str, ...]:
    """``--models``: the names, each a model with a bundled sample."""
    from farm.modelrepo.repository import ModelError, find

    names = tuple(name.strip() for name in text.split(",") if name.strip())
    try:
        for name in names:
            if find(name).sample is None:
                raise click.BadParameter(
                    f"model {name!r} has no bundled sample", param_hint="--models"
                )
    except ModelError as exc:
        raise click.BadParameter(str(exc), param_hint="--models") from None
    return names
