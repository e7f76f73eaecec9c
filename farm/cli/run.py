"""``farm run``: a job on this machine.  It runs on the background farm of ``farm up``
when one is up (``farm.ops.background``), else on a farm started for the job and stopped
after it (``farm.ops.local``)."""

from __future__ import annotations

import dataclasses
import functools
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import numpy as np

from farm import defaults
from farm.cli.job import (
    BrokerAccess,
    gated_precision,
    load_input,
    output_shape,
    output_spec,
    run_job,
    warn_unkept,
)
from farm.cli.options import (
    backend_option,
    batch_option,
    exif_option,
    image_out_options,
    model_option,
    models_dir_option,
    precision_option,
    shared_options,
    top_k_option,
    verify_option,
    workers_option,
)
from farm.cli.policy import policy_options, policy_params
from farm.client.answers import ModelCard
from farm.client.client import FarmError
from farm.client.inputs import repeated
from farm.startup import Timeline, breakdown
from farm.summary import plural

if TYPE_CHECKING:
    from farm.client.inputs import Source
    from farm.client.outputs import OutputSpec
    from farm.modelrepo.repository import ModelSpec
    from farm.ops.background import FarmRecord, FarmSettings


#: ``farm run --help``.
RUN_HELP = """Run IMAGES on this machine: on the farm `farm up` keeps running, else on a farm
started for the job (broker + one pinned worker per core) and stopped after it.

IMAGES are image files, folders, globs and lists, or one .npy array, as for
`farm submit`.  Without IMAGES, runs the model's bundled sample (and scores it
when the sample has labels).  Ctrl-C cancels the job (and stops the farm it
started); --out is written as `farm submit` writes it (OUT.partial and a
journal until the job is finished), so the same command with --resume
finishes an interrupted or killed job.

\b
Examples:
  farm run                                   # LeNet on its bundled sample
  farm run --repeat 40                       # ... 40 times over: the farm measured
  farm run photos/ --model squeezenet --top-k 5 --out answers.csv
  farm run images.npy --model lenet --out scores.npy --timings
  farm run images.npy --model lenet --out scores.npy --resume   # after Ctrl-C
  farm run images.npy --algo fast-split --ratio 0.5 --trace run.json
  farm run images.npy --model mynet --models-dir ~/models --backend openvino
  farm run photos/ --model squeezenet --precision auto   # bf16/int8 if they agree
  farm up --model lenet && farm run images.npy && farm down   # start once, run often
"""


@click.command(help=RUN_HELP)
@click.argument("images", nargs=-1)
@model_option
@workers_option
@image_out_options
@top_k_option
@exif_option
@verify_option
@backend_option(
    "The workers' inference library (auto: the fastest that agrees, per model).", defaults.BACKEND
)
@precision_option(
    "The workers' compute precision; auto: the fastest whose top-1 answers agree with f32's "
    "on the validation images (docs/precision.md).",
    defaults.PRECISION,
    gated=True,
)
@batch_option
@click.option(
    "--repeat",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    metavar="N",
    help="Run IMAGES N times over, as one job: long enough to measure the farm "
    "(throughput, waste) on a small input; the outputs hold every pass.",
)
@models_dir_option(
    "Model repository folder for the broker and workers (repeatable; also $FARM_MODELS).",
    exists=True,
)
@click.option(
    "--own-farm",
    is_flag=True,
    help="Start a farm for this job even when `farm up` has one running.",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Finish the interrupted or killed job writing --out: keep the rows its journal "
    "(OUT.journal) vouches for and run only the other images.",
)
@shared_options
@click.option(
    "--timings",
    is_flag=True,
    help="Print when each stage of the farm's start, the job and the stop happened.",
)
@policy_options()
def run(
    images: tuple[str, ...],
    model: str,
    workers: int | None,
    out: str | None,
    trace: str | None,
    quiet: bool,
    top_k: int | None,
    no_exif_rotate: bool,
    verify: float | None,
    backend: str,
    precision: str,
    min_agreement: float,
    validate: tuple[str, ...],
    batch: int | None,
    repeat: int,
    models_dir: tuple[str, ...],
    own_farm: bool,
    resume: bool,
    shared: bool,
    path_map: tuple[tuple[str, str], ...],
    timings: bool,
    algo: str,
    **options: object,
) -> None:
    """Run IMAGES on this machine (``RUN_HELP``)."""
    timeline = Timeline.of_this_process()
    timeline.mark("command imported")
    spec = local_model(model, models_dir)
    arguments, labels = (images, None) if images else sample_input(spec, models_dir)
    devices = local_devices(workers)
    source = repeated(load_input(arguments), repeat)
    check_model_input(source, spec)
    card, nan_shape = ModelCard(spec.labels, spec.softmax), functools.partial(output_shape, spec)
    output = output_spec(source, out, top_k, card, resume, arguments, nan_shape)  # refused now
    if images:
        warn_unkept(source, out, top_k)
    job = LocalJob(
        source=source,
        model=model,
        output=output,
        quiet=quiet,
        trace=trace,
        timeline=timeline,
        shared=shared,
        path_map=path_map,
        exif_rotate=not no_exif_rotate,
        verify=verify,
    )
    timeline.mark("input opened")
    stop_on_hangup()
    params = policy_params(algo, options)
    labelled = sample_labels(labels, repeat)
    precision = job.gate(spec, precision, validate, min_agreement, backend, labelled)
    wanted = farm_settings(devices, (model,), models_dir, backend, precision, batch)
    standing = None if own_farm else standing_farm(wanted, workers is not None)
    outputs = job.run(wanted, algo, params, standing)
    if labels is not None and outputs is not None:
        report_accuracy(outputs, labels, spec.labels, repeat)
    job.report_end(timings)


def local_model(model: str, models_dir: tuple[str, ...]) -> ModelSpec:
    """The model's files on this machine; ClickException if they are not here."""
    from farm.modelrepo.repository import ModelError, find

    try:
        return find(model, models_dir)
    except ModelError as exc:
        raise click.ClickException(str(exc)) from exc


def sample_input(
    spec: ModelSpec, models_dir: tuple[str, ...]
) -> tuple[tuple[str, ...], Path | None]:
    """The model's bundled sample, as IMAGES, and its labels (if it has them)."""
    if spec.sample is None:
        raise click.ClickException(no_sample(spec, models_dir))
    return (str(spec.sample),), spec.sample_labels


def require_int8(spec: ModelSpec) -> None:
    """One line before any farm starts when the model has no int8 version here."""
    from farm.engines.quantize import recorded

    if recorded(spec) is None:
        raise click.ClickException(
            f"model {spec.name!r} has no int8 version here: make one with `farm models "
            f"quantize {spec.name} --calibration IMAGES`, or use --precision auto"
        )


def sample_labels(path: Path | None, repeat: int) -> np.ndarray | None:
    """The bundled sample's labels, which the precision gate scores each precision on."""
    return None if path is None else np.tile(np.load(path), repeat)


def local_devices(workers: int | None) -> tuple[str, ...]:
    """One pinned CPU worker per core this process may use (the first ``workers``)."""
    from farm.ops.local import cores

    available = cores()
    if workers is not None and workers > len(available):
        raise click.UsageError(
            f"--workers {workers}: this process may use "
            f"{plural(len(available), 'core')} "
            f"({', '.join(map(str, available))}), and each worker is pinned "
            f"to a core of its own"
        )
    return tuple(f"cpu:{core}" for core in available[: workers or len(available)])


def farm_settings(
    devices: tuple[str, ...],
    models: tuple[str, ...],
    models_dir: tuple[str, ...],
    backend: str,
    precision: str,
    batch: int | None,
    idle_timeout: float = defaults.LOCAL_IDLE_TIMEOUT,
) -> FarmSettings:
    """A local farm's settings: the model folders resolved, then $FARM_MODELS's, each once."""
    from farm.modelrepo.repository import env_models_dirs
    from farm.ops.background import FarmSettings

    folders = [
        str(Path(folder).resolve()) for folder in [*map(Path, models_dir), *env_models_dirs()]
    ]
    return FarmSettings(
        devices=devices,
        models=models,
        models_dirs=tuple(dict.fromkeys(folders)),
        backend=backend,
        precision=precision,
        batch=batch,
        idle_timeout=idle_timeout,
    )


def standing_farm(wanted: FarmSettings, devices_named: bool) -> FarmRecord | None:
    """The ``farm up`` farm to run on, if one is up and runs what the job needs; what was
    seen on the way (a stale farm removed, other settings) goes to stderr."""
    from farm.ops.background import find_running

    found = find_running()
    if found.notice:
        click.echo(found.notice, err=True)
    record = found.record
    if record is None:
        return None
    differences = record.settings.differences(
        wanted if devices_named else dataclasses.replace(wanted, devices=record.settings.devices)
    )
    if differences:
        click.echo(
            f"not using the local farm of `farm up` ({record.describe()}): this job needs "
            + "; ".join(differences),
            err=True,
        )
        return None
    return record


@dataclass(kw_only=True)
class LocalJob:
    """One ``farm run`` job, and where it ran: a standing farm or one started for it."""

    source: Source
    model: str
    output: OutputSpec | None  # None: the outputs kept in memory
    quiet: bool
    trace: str | None
    timeline: Timeline
    workers: list[dict[str, Any]] | None = None  # a new farm's workers, as they registered
    stopping: float | None = None  # when a new farm began to stop
    notes: tuple[str, ...] = ()  # lines the summary ends with (the precision gate's choice)
    shared: bool = False  # the workers read the images themselves
    path_map: tuple[tuple[str, str], ...] = ()
    exif_rotate: bool = True  # image files turned upright by their EXIF orientation
    verify: float | None = None  # part of the images spot-checked on another device

    def gate(
        self,
        spec: ModelSpec,
        precision: str,
        validate: tuple[str, ...],
        min_agreement: float,
        backend: str,
        labels: np.ndarray | None,
    ) -> str:
        """The precision the job runs in (``auto``: the precision gate's choice, its line
        among the notes); ClickException for int8 where the model has no int8 version."""
        gated, summary = gated_precision(
            precision,
            spec,
            self.source,
            validate,
            min_agreement,
            backend,
            labels,
            exif_rotate=self.exif_rotate,
        )
        precision = gated or precision
        if precision == "int8" or "int8+f32" in precision:
            require_int8(spec)
        self.notes = (summary,) if summary else ()
        return precision

    def run(
        self,
        wanted: FarmSettings,
        algo: str,
        params: dict[str, Any],
        standing: FarmRecord | None,
    ) -> np.ndarray | None:
        """On the ``farm up`` farm ``standing``, else on a farm started for the job: its
        raw outputs, if kept; ClickException for a FarmError."""
        try:
            if standing is not None:
                return self.run_on(standing, wanted, algo, params)
            return self.run_on_new_farm(wanted, algo, params)
        except FarmError as exc:
            raise click.ClickException(str(exc)) from exc

    def report_end(self, timings: bool) -> None:
        """How long a farm started for the job took to stop; with ``timings``, the stages
        of the whole run."""
        if self.stopping is not None:
            click.echo(f"farm stopped in {time.time() - self.stopping:.2f} s", err=True)
        if timings:
            self.timeline.mark("done")
            print_timings(self.timeline, self.workers)

    def submit(self, endpoint: str, **job_options: Any) -> np.ndarray | None:
        return run_job(
            BrokerAccess(endpoint=endpoint),
            self.source,
            self.model,
            self.output,
            self.quiet,
            self.trace,
            timeline=self.timeline,
            notes=self.notes,
            shared=self.shared,
            path_map=self.path_map,
            exif_rotate=self.exif_rotate,
            verify=self.verify,
            **job_options,
        )

    def run_on(
        self, record: FarmRecord, wanted: FarmSettings, algo: str, params: dict[str, Any]
    ) -> np.ndarray | None:
        """On the ``farm up`` farm: this job's policy, and its engine where it differs from
        the workers' own."""
        click.echo(f"using the local farm of `farm up`: {record.describe()}", err=True)
        own = record.settings
        engine = {}
        if (wanted.backend, wanted.precision) != (own.backend, own.precision):
            engine = {"backend": wanted.backend, "precision": wanted.precision}
        return self.submit(record.endpoint, algo=algo, params=params, **engine)

    def run_on_new_farm(
        self, wanted: FarmSettings, algo: str, params: dict[str, Any]
    ) -> np.ndarray | None:
        """On a farm started for this job, stopped after it."""
        from farm.ops.local import LocalFarm

        devices = wanted.devices
        click.echo(
            f"starting a local farm: broker + {plural(len(devices), 'worker')} "
            f"({', '.join(devices)})",
            err=True,
        )
        farm = LocalFarm(
            devices=devices,
            algo=algo,
            preload=[self.model],
            params=params,
            models_dirs=wanted.models_dirs,
            backend=wanted.backend,
            precision=wanted.precision,
            batch=wanted.batch,
            timeline=self.timeline,
            fork=True,
            while_starting=import_progress_bar,
        )
        with farm as local:
            engines = local.engines(self.model)
            click.echo(
                f"farm ready in {local.start_seconds:.2f} s (not counted in the job): "
                f"{self.model} on {engines or 'its engine'}",
                err=True,
            )
            if ";" in engines:  # the workers timed the engines, each on its own core
                click.echo(ENGINES_DIFFER, err=True)
            self.workers = list(local.registered.get("workers", []))
            outputs = self.submit(local.endpoint)
            self.stopping = time.time()
            self.timeline.mark("farm stopping")
        self.timeline.mark("farm stopped")
        return outputs


#: Said when the workers of a local farm run a model on different engines.
ENGINES_DIFFER = (
    "  (each worker timed the engines on its first start of this model, and close speeds "
    "picked differently; the choice is remembered, so later starts use one engine)"
)


def import_progress_bar() -> None:
    """tqdm, imported while the farm starts rather than after."""
    import tqdm  # noqa: F401


def print_timings(timeline: Timeline, workers: list[dict[str, Any]] | None) -> None:
    """The stages of this run, on one clock from this process's start, with each worker's
    (a farm started for the job: process start, imports, models loaded)."""
    origin = timeline.stamps["process"]
    rows = timeline.rows(origin)
    for worker in workers or []:
        rows += Timeline(dict(worker.get("startup", {}))).rows(
            origin, f"worker {worker.get('device', '?')}"
        )
    click.echo("timings, seconds since `farm run`'s process started:", err=True)
    for line in breakdown(rows):
        click.echo(line, err=True)
    if workers is None:
        click.echo("  (the farm of `farm up` was up already: no start-up to show)", err=True)


def no_sample(spec: ModelSpec, models_dir: tuple[str, ...]) -> str:
    """``farm run``'s error for a model without a sample: its folder, and the model it
    shadows (which may have one)."""
    from farm.modelrepo.repository import ModelError, load_spec, model_folders, origin, shown

    text = f"model {spec.name!r} ({shown(spec.folder)}) has no sample"
    for hidden in model_folders(models_dir).get(spec.name, [])[1:2]:
        try:
            sampled = load_spec(hidden).sample is not None
        except ModelError:
            sampled = False
        text += f"; it shadows {origin(hidden)}{', which has one' if sampled else ''}"
    return f"{text}; give IMAGES"


def check_model_input(source: Source, spec: ModelSpec) -> None:
    """Refuse, before a local farm starts, what the model cannot take (its broker would
    refuse it in the same words)."""
    from farm.wire.shapes import input_mismatch

    problem = input_mismatch(
        spec.name, spec.item_shape, spec.preprocess.layout, source.dtype, tuple(source.item_shape)
    )
    if problem:
        raise click.ClickException(problem)


def stop_on_hangup() -> None:
    """SIGTERM and SIGHUP exit through Python, so the local farm's processes are stopped."""

    def stop(signum: int, _: Any) -> None:
        raise SystemExit(128 + signum)

    for hangup in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(hangup, stop)


def report_accuracy(
    outputs: np.ndarray, labels_path: Path, class_names: tuple[str, ...], passes: int = 1
) -> None:
    """Top-1 accuracy of the outputs against the sample's labels, a few predictions, and
    whether every pass over the sample answered alike."""
    labels = np.load(labels_path)
    predicted = outputs.reshape(len(outputs), -1).argmax(axis=1).reshape(passes, len(labels))
    correct = int((predicted[0] == labels).sum())
    names = class_names or tuple(map(str, range(outputs.shape[1])))
    shown = ", ".join(names[p] for p in predicted[0, :10])
    click.echo(f"first predictions: {shown} ...")
    agree = ""
    if passes > 1:
        same = int((predicted == predicted[0]).all(axis=0).sum())
        agree = (
            f"; the {passes} passes agree"
            if same == len(labels)
            else f"; the {passes} passes disagree on {len(labels) - same:,} images"
        )
    click.echo(
        f"accuracy on the bundled sample: {correct / len(labels):.2%} "
        f"({correct:,} of {len(labels):,} against {labels_path.name}{agree})"
    )
