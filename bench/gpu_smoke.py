"""A short smoke test of farm's GPU path, before bench/gpu.py (bench/gpu-run.sh runs both).

    python bench/gpu_smoke.py SMOKE_TXT SMOKE_JSON [--stand-in] [--models M,...] [--budget S]

Appends to SMOKE_TXT as it goes, so that a run killed at its limit loses only the step it
was in: first the machine (versions, ``nvidia-smi -L``, cores, ONNX Runtime's providers,
torch's threads on the GPU worker's core alone), then for each model, once done, a table
and a line of JSON:

- the torch engine on ``cuda:0`` in f32, f16 and bf16 (``load_engine`` as a worker loads
  it), on one chunk as a worker runs it: images/s, the device and copy seconds of that run,
  peak GPU memory, and the largest difference from the CPU's f32 outputs;
- ``auto``'s choice on the GPU in f32 (backend, batch, each trial's speed or problem),
  remembered as a GPU worker remembers it, so the bench's workers start without timing;
- a two-worker farm (one pinned core and the GPU worker, on the core that feeds it, as
  bench/gpu.py lays it out) running one traced job of the default policy: images/s, the
  GPU worker's share of the images and its busy share (CUDA-timed seconds over the span).

Each step is time-boxed and its failure is a result, not the end of the smoke. SMOKE_JSON
holds everything, rewritten after each model. Exit status: 0, the GPU ran (some run
worked); 3, the bench would be pointless (torch missing, no CUDA device, no run worked).
With ``--stand-in`` a torch engine on the CPU stands in for the GPU everywhere (it refuses
f16 and bf16: that refusal is reported as a result).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import gpu
import numpy as np

from farm import defaults
from farm.benchsuite.measure import Configuration, timed_job
from farm.benchsuite.setups import make_images, package_version
from farm.engines.autoselect import NOT_INSTALLED
from farm.ops.local import cores

SMOKE_MODELS = ("lenet", "caffenet", "googlenet")
#: Every core this process may use, read before it pins itself to the GPU worker's.
ALLOWED = set(cores())
#: Exit status when the bench would be pointless.
POINTLESS = 3
#: The most seconds each step may take; a step with less than MIN_STEP left is not run.
ENGINE_BOX, AUTO_BOX, FARM_BOX, MIN_STEP = 60.0, 90.0, 120.0, 5.0
#: Seconds of the GPU's f32 speed the farm's job is sized for, and its most images.
FARM_SECONDS, FARM_MOST = 2.0, 20_000
#: Longest problem text in the table (the JSON keeps 300 characters).
SHOWN = 100
VERSIONS = ("torch", "torchvision", "numpy", "onnxruntime", "pyzmq", "msgspec")

T = TypeVar("T")


@dataclass(frozen=True)
class Settings:
    """Where the smoke runs: the GPU (or the CPU standing in for it), batch and chunk."""

    device: str  # cuda:0, or cpu for the stand-in
    stand_in: bool
    batch: int  # compute batch of every engine run
    chunk: int  # images of the timed run (as one chunk of a job)
    reference: int  # images compared with the CPU's f32 outputs
    farm_least: int  # images of the farm's job, at least

    @classmethod
    def for_run(cls, stand_in: bool) -> Settings:
        if stand_in:  # a CPU core: small enough for GoogLeNet in seconds
            return cls("cpu", True, 16, 64, 16, 64)
        return cls("cuda:0", False, 256, 2048, 64, 1024)


class Budget(gpu.Clock):
    """The smoke's seconds (the bench's clock); each step gets its own box within what is
    left."""

    def box(self, most: float) -> float:
        return min(most, self.left())


class StepTimeout(BaseException):
    """A step ran past its box (a BaseException: the steps' own ``except Exception`` let it
    through)."""


@contextlib.contextmanager
def time_box(seconds: float) -> Iterator[None]:
    """StepTimeout in this (main) thread after ``seconds``."""

    def expire(signum: int, frame: Any) -> None:
        raise StepTimeout(f"stopped after its {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def boxed(
    budget: Budget, most: float, step: Callable[..., T], *args: Any
) -> tuple[T | None, str | None]:
    """``step(*args)``'s result, or None and why not: out of the smoke's time, past its box, or
    its error, on one line."""
    seconds = budget.box(most)
    if seconds < MIN_STEP:
        return None, f"not run: {budget.left():.0f} s of the smoke's budget left"
    try:
        with time_box(seconds):
            return step(*args), None
    except StepTimeout as exc:
        return None, f"time box: {exc}"
    except Exception as exc:
        return None, problem_text(exc)


def problem_text(exc: BaseException) -> str:
    from farm.modelrepo.repository import ModelError

    text = str(exc) if isinstance(exc, ModelError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:300]


# ---- results ---------------------------------------------------------------------------


@dataclass
class EngineRun:
    """The torch engine in one precision on the GPU, one chunk."""

    precision: str
    batch: int
    images: int = 0
    images_per_s: float | None = None
    device_s: float | None = None  # engine.last_run.device
    copy_s: float | None = None  # engine.last_run.copy
    peak_mib: float | None = None  # torch.cuda.max_memory_allocated, from the load on
    difference: float | None = None  # from the CPU's f32 outputs, relative
    problem: str | None = None


@dataclass
class AutoRun:
    """``auto``'s choice on the GPU in f32."""

    backend: str | None = None
    batch: int | None = None
    remembered: bool = False
    trials: list[dict[str, Any]] = field(default_factory=list)
    problem: str | None = None


@dataclass
class FarmRun:
    """One traced job on a pinned core and the GPU worker."""

    workers: list[str]
    policy: str = defaults.POLICY
    images: int = 0
    images_per_s: float | None = None
    gpu_share: float | None = None  # of the images
    gpu_busy: float | None = None  # CUDA-timed seconds over the job's span
    gpu_copy: float | None = None
    waste: float | None = None
    feeder_cpu: float | None = None
    problem: str | None = None


@dataclass
class ModelSmoke:
    model: str
    device: str
    reference_problem: str | None = None
    engines: list[EngineRun] = field(default_factory=list)
    auto: AutoRun | None = None
    farm: FarmRun | None = None
    seconds: float = 0.0

    @property
    def worked(self) -> int:
        return sum(run.problem is None for run in self.engines)


# ---- the machine ---------------------------------------------------------------------------


def nvidia_smi() -> list[str]:
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return ["not found"]
    except subprocess.TimeoutExpired:
        return ["no answer in 30 s"]
    return (done.stdout + done.stderr).strip().splitlines() or [f"exit status {done.returncode}"]


def providers() -> str:
    try:
        import onnxruntime
    except Exception as exc:
        return f"none ({problem_text(exc)})"
    return ", ".join(onnxruntime.get_available_providers())


def torch_state(settings: Settings) -> tuple[dict[str, Any], str | None]:
    """torch's threads here (pinned to one core before its import) and what it sees of CUDA;
    the reason the bench would be pointless, if any."""
    try:
        import torch
    except Exception as exc:
        return {"torch": problem_text(exc)}, f"torch cannot be imported: {problem_text(exc)}"
    state: dict[str, Any] = {
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    if settings.stand_in or torch.cuda.is_available():
        return state, None
    return state, f"torch {torch.__version__} sees no CUDA device"


def header(settings: Settings, layout: gpu.Layout, torch_info: dict[str, Any]) -> list[str]:
    feeder = layout.feeder
    cuda = (
        f"CUDA {torch_info.get('cuda')}, cuDNN {torch_info.get('cudnn')}, devices: "
        + (", ".join(torch_info.get("gpus", [])) or "none")
        if "torch_threads" in torch_info
        else f"torch: {torch_info.get('torch')}"
    )
    return [
        f"# farm GPU smoke, {datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.node()}: "
        + ("a CPU stand-in for the GPU" if settings.stand_in else settings.device),
        f"python {platform.python_version()}; "
        + "; ".join(f"{name} {package_version(name)}" for name in VERSIONS),
        "nvidia-smi -L: " + "; ".join(nvidia_smi()),
        f"cores: {os.cpu_count()} ({len(layout.cpus) + 1} usable); the GPU worker's core: {feeder}",
        f"onnxruntime providers: {providers()}",
        f"torch threads on core {feeder} alone (as under taskset -c {feeder}): "
        f"{torch_info.get('torch_threads', '-')}; {cuda}",
    ]


# ---- the steps -------------------------------------------------------------------------------


def reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_mib(settings: Settings) -> float | None:
    import torch

    if settings.stand_in:
        return None
    return torch.cuda.max_memory_allocated() / 2**20


def cpu_reference(model: str, settings: Settings) -> np.ndarray:
    """The CPU's f32 outputs of the chunk's first images (the seeded weights made first)."""
    from farm.engines.autoselect import load_engine
    from farm.modelrepo.repository import find

    count = settings.reference
    engine = load_engine(find(model), "torch", count, "cpu", None, "f32")
    return engine.run(make_images(model, settings.chunk)[:count])


def engine_run(
    model: str, precision: str, settings: Settings, reference: np.ndarray | None
) -> EngineRun:
    """The torch engine on the GPU in ``precision``: one warm-up batch, then one chunk."""
    from farm.engines.autoselect import load_engine
    from farm.engines.tolerances import relative_difference
    from farm.modelrepo.repository import find

    run = EngineRun(precision, settings.batch, settings.chunk)
    reset_peak()
    engine = load_engine(find(model), "torch", settings.batch, settings.device, None, precision)
    images = make_images(model, settings.chunk)
    engine.run(images[: settings.batch])
    started = time.perf_counter()
    outputs = engine.run(images)
    run.images_per_s = len(images) / (time.perf_counter() - started)
    run.device_s, run.copy_s = engine.last_run.device, engine.last_run.copy
    run.peak_mib = peak_mib(settings)
    if reference is not None:
        run.difference = relative_difference(outputs[: len(reference)], reference)
    return run


def auto_run(model: str, settings: Settings) -> AutoRun:
    """What ``auto`` picks on the GPU in f32, as a GPU worker would (and remembers it)."""
    from farm.engines.autoselect import choose
    from farm.modelrepo.repository import find

    choice = choose(find(model), settings.device, None, "f32")
    return AutoRun(
        choice.backend,
        choice.batch,
        choice.cached,
        [
            {
                "backend": trial.backend,
                "batch": trial.best_batch if trial.rates else None,
                "images_per_s": trial.best_rate,
                "difference": trial.difference,
                "problem": trial.problem,
            }
            for trial in choice.trials
        ],
    )


@contextlib.contextmanager
def every_core() -> Iterator[None]:
    """This thread on every core while the farm's processes start (they inherit it)."""
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, ALLOWED)
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)


def farm_run(model: str, settings: Settings, layout: gpu.Layout, f32: EngineRun) -> FarmRun:
    """One pinned core and the GPU worker (on the core feeding it), one traced job."""
    bench_run = gpu.ModelRun(model, batches={"gpu": settings.batch})
    result = FarmRun(layout.workers())
    count = int(min(FARM_MOST, max(settings.farm_least, (f32.images_per_s or 0) * FARM_SECONDS)))
    images = make_images(model, count)
    config = Configuration(defaults.POLICY)
    with every_core(), gpu.farm_for(layout, layout.workers(), model, bench_run) as farm:
        with farm.client(timeout=FARM_BOX) as client:
            timed_job(client, images[: min(count, 2 * settings.batch)], model, config)
            before = gpu.cpu_seconds(farm.workers[-1].pid)
            job = timed_job(client, images, model, config, trace=True)
            feeder = gpu.cpu_seconds(farm.workers[-1].pid) - before
    row = gpu.policy_row(layout, model, config, job, bench_run, feeder)
    result.images, result.images_per_s = row["images"], row["images_per_s"]
    result.gpu_share, result.gpu_busy = row["gpu_images"], row["gpu_busy"]
    result.gpu_copy, result.waste, result.feeder_cpu = (
        row["gpu_copy"],
        row["waste"],
        row["feeder_cpu"],
    )
    return result


def smoke_model(smoke: ModelSmoke, settings: Settings, layout: gpu.Layout, budget: Budget) -> None:
    """Every step on one model, into ``smoke`` as each is done; a step that fails says why
    in its place."""
    model = smoke.model
    reference, smoke.reference_problem = boxed(budget, ENGINE_BOX, cpu_reference, model, settings)
    for precision in gpu.GPU_PRECISIONS:
        run, problem = boxed(budget, ENGINE_BOX, engine_run, model, precision, settings, reference)
        smoke.engines.append(run or EngineRun(precision, settings.batch, problem=problem))
        gpu.release_memory()
    auto, problem = boxed(budget, AUTO_BOX, auto_run, model, settings)
    smoke.auto = auto or AutoRun(problem=problem)
    gpu.release_memory()
    f32 = smoke.engines[0]
    if f32.problem is None:
        farm, problem = boxed(budget, FARM_BOX, farm_run, model, settings, layout, f32)
    else:
        farm, problem = None, "not run: the GPU's f32 engine failed"
    smoke.farm = farm or FarmRun(layout.workers(), problem=problem)


# ---- the report -----------------------------------------------------------------------------


def number(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


def share(value: float | None) -> str:
    return number(value, ".0%")


def shown(problem: str | None) -> str:
    return "" if problem is None else problem[:SHOWN] + ("..." if len(problem) > SHOWN else "")


def model_table(smoke: ModelSmoke, settings: Settings) -> list[str]:
    """The model's block of smoke.txt: its engines, auto's choice and the farm's job."""
    lines = [
        f"## {smoke.model} on {smoke.device}: torch, batch {settings.batch}, chunk "
        f"{settings.chunk} images ({smoke.seconds:.0f} s)",
        f"  {'precision':<9} {'images/s':>10} {'device s':>9} {'copy s':>7} {'peak MiB':>9} "
        f"{'vs CPU f32':>10}  problem",
    ]
    for run in smoke.engines:
        lines.append(
            f"  {run.precision:<9} {number(run.images_per_s, ',.0f'):>10} "
            f"{number(run.device_s, '.3f'):>9} {number(run.copy_s, '.3f'):>7} "
            f"{number(run.peak_mib, ',.0f'):>9} {number(run.difference, '.1e'):>10}  "
            f"{shown(run.problem)}"
        )
    if smoke.reference_problem:
        lines.append(f"  CPU f32 reference: {shown(smoke.reference_problem)}")
    lines.append("  auto: " + (auto_text(smoke.auto) if smoke.auto else "-"))
    lines.append("  farm: " + farm_text(smoke.farm))
    return lines


def auto_text(auto: AutoRun) -> str:
    if auto.problem:
        return shown(auto.problem)
    trials = "; ".join(trial_text(trial) for trial in auto.trials)
    remembered = ", remembered" if auto.remembered else ""
    return f"{auto.backend} batch {auto.batch}{remembered} (trials: {trials})"


def trial_text(trial: dict[str, Any]) -> str:
    problem = trial["problem"]
    if problem is None:
        return f"{trial['backend']} {trial['images_per_s']:,.0f}/s at {trial['batch']}"
    if problem.startswith(NOT_INSTALLED):
        return f"{trial['backend']} not installed"
    return f"{trial['backend']}: {problem[:60]}" + ("..." if len(problem) > 60 else "")


def farm_text(farm: FarmRun | None) -> str:
    if farm is None:
        return "-"
    workers = " + ".join(farm.workers)
    if farm.problem:
        return f"{workers}: {shown(farm.problem)}"
    return (
        f"{workers}, {farm.policy}, {farm.images:,} images: {farm.images_per_s or 0:,.0f}/s; "
        f"GPU share {share(farm.gpu_share)}, busy {share(farm.gpu_busy)}, copies "
        f"{share(farm.gpu_copy)}; waste {share(farm.waste)}; feeding core "
        f"{share(farm.feeder_cpu)}"
    )


@dataclass
class Report:
    """smoke.txt (appended) and the JSON (rewritten), kept current after each model."""

    text: Path
    json_path: Path
    document: dict[str, Any]

    def add(self, lines: list[str], json_line: dict[str, Any] | None = None) -> None:
        with open(self.text, "a") as handle:
            handle.write("\n".join(lines) + "\n")
            if json_line is not None:
                handle.write("json " + json.dumps(json_line) + "\n")
        print("\n".join(lines), flush=True)
        self.json_path.write_text(json.dumps(self.document, indent=1) + "\n")


# ---- the whole smoke ------------------------------------------------------------------------


def pin_to(core: int) -> None:
    """This process on the GPU worker's core, before torch is imported: as the GPU worker
    runs (``taskset -c CORE``), with the threads torch then picks."""
    os.sched_setaffinity(0, {core})


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text", type=Path, help="smoke.txt: appended to")
    parser.add_argument("json", type=Path, help="the whole smoke as JSON")
    parser.add_argument("--stand-in", action="store_true", help="a CPU core for the GPU")
    parser.add_argument("--models", default=",".join(SMOKE_MODELS))
    parser.add_argument("--budget", type=float, default=150.0, help="seconds in all")
    return parser.parse_args()


def main() -> int:
    args = parse()
    gpu.interrupt_on_term()
    gpu.add_nets()
    budget, settings = Budget(args.budget), Settings.for_run(args.stand_in)
    layout = gpu.Layout.here(args.stand_in, 1)
    pin_to(layout.feeder)
    document: dict[str, Any] = {
        "settings": asdict(settings),
        "models": [],
        "worked": 0,
        "tried": 0,
        "stopped": None,
    }
    report = Report(args.text, args.json, document)
    torch_info, fatal = torch_state(settings)
    document["torch"] = torch_info
    report.add(header(settings, layout, torch_info))
    if fatal:
        return stop(report, fatal)
    for model in (name.strip() for name in args.models.split(",") if name.strip()):
        smoke, began = ModelSmoke(model, settings.device), time.perf_counter()
        try:
            smoke_model(smoke, settings, layout, budget)
        except KeyboardInterrupt:  # the caller's limit: what is done is written
            document["stopped"] = "interrupted"
            add_model(report, smoke, settings, began)
            report.add([f"smoke: interrupted during {model}; its steps above are those done"])
            return 130
        add_model(report, smoke, settings, began)
    if not document["worked"]:
        return stop(report, f"none of the {document['tried']} GPU engine runs worked")
    report.add(
        [
            f"smoke: {document['worked']} of {document['tried']} GPU engine runs worked "
            f"({budget.budget - budget.left():.0f} s)"
        ]
    )
    return 0


def add_model(report: Report, smoke: ModelSmoke, settings: Settings, began: float) -> None:
    smoke.seconds = time.perf_counter() - began
    report.document["models"].append(asdict(smoke))
    report.document["worked"] += smoke.worked
    report.document["tried"] += len(smoke.engines)
    report.add(model_table(smoke, settings), asdict(smoke))


def stop(report: Report, reason: str) -> int:
    report.document["stopped"] = reason
    report.add([f"smoke: the bench would be pointless: {reason}"])
    return POINTLESS


if __name__ == "__main__":
    sys.exit(main())
