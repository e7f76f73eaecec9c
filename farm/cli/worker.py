"""``farm worker``: one worker process, on one core or one GPU."""

from __future__ import annotations

import math
from typing import Any

import click

from farm import defaults
from farm.cli.options import (
    backend_option,
    broker_option,
    curve_option,
    heartbeat_options,
    models_dir_option,
    worker_precision,
)


class ItemRange(click.ParamType):
    """``A-B``: items A to B inclusive, as ``(A, B + 1)``."""

    name = "A-B"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[int, int]:
        if isinstance(value, tuple):
            return value
        low, _, high = str(value).partition("-")
        if not (low.isdigit() and high.isdigit() and int(low) <= int(high)):
            self.fail(f"{value!r} is not a range A-B", param, ctx)
        return int(low), int(high) + 1


class SlowDown(click.ParamType):
    """``FACTOR[@SECONDS]``: compute FACTOR (>= 1) times slower from SECONDS (>= 0, default
    0) after the first chunk began, as ``(FACTOR, SECONDS)``."""

    name = "FACTOR[@SECONDS]"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[float, float]:
        if isinstance(value, tuple):
            return value
        factor_text, at, after_text = str(value).partition("@")
        try:
            factor = float(factor_text)
            after = float(after_text) if at else 0.0
        except ValueError:
            self.fail(f"{value!r} is not FACTOR or FACTOR@SECONDS (3, 2.5@30)", param, ctx)
        if not (math.isfinite(factor) and factor >= 1):
            self.fail(f"FACTOR must be a number >= 1, not {factor_text!r}", param, ctx)
        if not (math.isfinite(after) and after >= 0):
            self.fail(f"SECONDS must be a number >= 0, not {after_text!r}", param, ctx)
        return factor, after


@click.command()
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    help="cpu (all cores, all threads), cpu:N (pinned to core N, one thread), "
    "cpu:bound (pinned to the core srun or taskset bound it to) or gpu:N (CUDA "
    "device N, torch backend).",
)
@broker_option
@backend_option(
    "Inference library; auto times each installed one on each model when it "
    "loads and keeps the fastest whose outputs agree (remembered on disk).",
    defaults.BACKEND,
)
@click.option(
    "--precision",
    default=defaults.PRECISION,
    show_default=True,
    callback=worker_precision,
    help="Compute precision: f32, f16, bf16 or int8 where the engine and device offer it; "
    "or the precision gate's list (openvino:int8,bf16,f32): on a CPU, the first it offers.",
)
@click.option(
    "--model",
    "preload",
    multiple=True,
    help="Load this model at start (repeatable); one this host lacks is fetched from "
    "the broker once connected.",
)
@models_dir_option(
    "Local model folder used when its files match the job's (repeatable; also "
    "$FARM_MODELS); other models are fetched from the broker."
)
@click.option(
    "--cache",
    "cache_dir",
    type=click.Path(file_okay=False),
    envvar="FARM_CACHE_MODELS",
    show_envvar=True,
    help="Where fetched models are kept [default: ~/.cache/farm/models].",
)
@click.option(
    "--batch",
    type=click.IntRange(1),
    help="Compute batch: chunks run in batches of this many images "
    "[default: the batch size in each model's prototxt].",
)
@click.option(
    "--slots",
    type=click.IntRange(1),
    help=f"Chunks the broker may keep in flight to this worker [default: "
    f"{defaults.SLOTS} on a core, {defaults.GPU_SLOTS} on a GPU].",
)
@click.option("--max-tasks", type=click.IntRange(1), help="Exit after this many chunks.")
@heartbeat_options
@curve_option("the broker's public key and this worker's secret key", defaults.WORKER_KEY)
@click.option(
    "--fail-items",
    hidden=True,
    type=ItemRange(),
    help="Fault injection for chaos tests: chunks touching items A-B fail.",
)
@click.option(
    "--slow",
    type=SlowDown(),
    help="For tests and benchmarks (a straggler stand-in): from SECONDS (default 0) after "
    "the first chunk began, compute FACTOR (>= 1) times slower: after each batch wait "
    "FACTOR - 1 times its compute time, counted as compute (3, 2@30).",
)
def worker(
    device: str,
    broker_address: str,
    backend: str,
    precision: str,
    preload: tuple[str, ...],
    models_dir: tuple[str, ...],
    cache_dir: str | None,
    batch: int | None,
    slots: int | None,
    max_tasks: int | None,
    heartbeat: float,
    liveness: int,
    curve: str | None,
    curve_name: str,
    fail_items: tuple[int, int] | None,
    slow: tuple[float, float] | None,
) -> None:
    """Run one worker: one per pinned core, one per GPU.

    \b
    Examples:
      farm worker --device cpu:3 --broker tcp://10.0.0.1:5555
      farm worker --device gpu:0 --broker tcp://10.0.0.1:5555 --batch 256
      farm worker --device cpu:1 --backend openvino --precision bf16
      farm worker --device cpu:0 --curve keys/ --curve-name rack2 --broker tcp://10.0.0.1:5555
    Under supervisord, one per core: farm deploy supervisord --help
    """
    from farm.ops.roles import serve_worker
    from farm.workers.worker import Device, WorkerConfig

    try:
        parsed = Device.parse(device)
        config = WorkerConfig(
            broker=broker_address,
            device=parsed,
            batch=batch,
            model_dirs=models_dir,
            preload=preload,
            slots=slots,
            max_tasks=max_tasks,
            backend=backend,
            cache_dir=cache_dir,
            heartbeat=heartbeat,
            liveness=liveness,
            curve=curve,
            curve_name=curve_name,
            fail_items=fail_items,
            slow=slow,
            precision=precision,
        )
        serve_worker(config)
    except (ValueError, LookupError) as exc:
        raise click.ClickException(str(exc)) from exc
