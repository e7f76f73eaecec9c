"""CPU cores and a GPU in one farm: every GPU measurement in one go (run by bench/gpu.sh, or
by bench/gpu-run.sh after its smoke test).

    bench/gpu.sh RESULTS_DIR                # on a machine with a CUDA GPU
    bench/gpu.sh RESULTS_DIR --stand-in     # anywhere: a CPU worker stands in for the GPU

The farm is laid out as ``farm deploy supervisord --gpus 0`` lays it out: one worker
pinned to each core but the last, and the GPU worker on the last core, which feeds it.
With ``--stand-in`` that worker is ``--device cpu`` on the torch backend, pinned to the
last core: the same code path without CUDA (the tests run it so).

For each model in turn, big nets first, within ``--budget`` seconds (a model with less
than its floor left is "not started"; one that runs out of time keeps what it measured, and
the report names the steps left out):

1. **engines**: the backend and compute batch ``auto`` picks for the GPU worker (in f32,
   f16 and bf16, in one process: one CUDA start), each checked against f32 by ``auto``'s
   agreement check (a refusal is a result), and for one pinned core;
2. **standalone speeds**: every worker alone in a one-worker farm (all the farms start at
   once, then run one at a time);
3. **Tables 4/5, Figure 5**: every policy at the paper's values (only the first value of
   each for the ImageNet-sized nets) on the whole farm, each job traced: its waste from
   the trace (idle worker time, ``farm.client.trace.idle_share``), and, secondary, against
   the standalone speeds of step 2 and against the speeds measured inside the job, the
   GPU's busy share (seconds its CUDA events timed over the job's span), its copy
   seconds and the gaps between its chunks, and the CPU time of the core feeding it;
4. **peers**: torch alone on the GPU at its best batch, and ONNX Runtime and OpenCV on
   every core in one process, at theirs (a larger batch that fails, out of GPU memory,
   is a note beside the smaller batches' figures);
5. **Table 2's GPU column**: one GPU worker and one pinned CPU worker, images/s by chunk
   size (a size whose one chunk would take longer than ``MAX_CHUNK_SECONDS`` is skipped).

Writes into RESULTS_DIR: report.md, results.json (everything), engines.csv, table2.csv,
policies.csv, peers.csv and traces.jsonl (each model's best job, as ``farm report``
reads one per line); bench/gpu.sh adds log.txt.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import csv
import gc
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from farm.benchsuite.measure import (
    BROKER_OPTIONS,
    Configuration,
    in_fresh_process,
    paper_configurations,
    timed_job,
)
from farm.benchsuite.setups import describe_machine, make_images
from farm.client.client import FarmError
from farm.client.report import analyse
from farm.client.trace import Trace, idle_share
from farm.engines.tolerances import relative_difference
from farm.modelrepo.repository import find
from farm.ops.local import LocalFarm, cores
from farm.wire.protocol import MAX_TASK_BYTES

ROOT = Path(__file__).resolve().parents[1]
#: Where googlenet (and the other public nets) are found, for this process and its children.
NETS = ROOT / "bench" / "nets"
#: Big nets first: a budget that runs short leaves out the small nets, measured sooner.
MODELS = ("googlenet", "caffenet", "cifar10_quick", "lenet")
#: Nets whose sweep runs 100 000 images and every paper value (the paper's small nets).
SMALL = ("lenet", "cifar10_quick")
SWEEP_IMAGES_SMALL = 100_000
#: Seconds of work the other jobs are sized for, at the speeds step 1 measured.
STANDALONE_SECONDS, SWEEP_SECONDS, TABLE2_SECONDS = 1.0, 4.0, 1.0
#: What --quick (a smoke run) sizes them and Table 2's most chunks for: a quarter.
QUICK_SHARE = 0.25
#: Table 2's chunk sizes, and the longest one chunk may take there.
TABLE2_SIZES = (1, 10, 100, 1000, 10_000)
MAX_CHUNK_SECONDS = 5.0
#: Most chunks one Table 2 row sends (chunks of 1 image cost the broker a round trip each).
MAX_TABLE2_CHUNKS = 2000
#: The GPU worker's precisions, measured in one process (f32 first: the others' reference).
GPU_PRECISIONS = ("f32", "f16", "bf16")
#: Compute batches tried for torch alone on the GPU (the peer).
GPU_PEER_BATCHES = (64, 256, 1024, 4096)
CPU_PEER_BATCHES = (16, 64, 256)
#: Pins the GPU worker to its feeding core, as ``farm deploy supervisord`` does.
TASKSET = shutil.which("taskset") is not None
#: Seconds a model needs left to be started: a small net, an ImageNet-sized one.
MODEL_FLOOR, LARGE_MODEL_FLOOR = 45.0, 120.0
#: Seconds a step (or a job) needs left to be started, beyond what it is expected to take.
STEP_FLOOR = 15.0
JOB_TIMEOUT = 600.0


@dataclass(frozen=True)
class Layout:
    """The farm: CPU workers pinned one per core, the GPU worker and the core feeding it."""

    cpus: tuple[int, ...]
    gpu: str  # gpu:0, or cpu for the stand-in
    feeder: int
    stand_in: bool

    @classmethod
    def here(cls, stand_in: bool, cpu_workers: int | None) -> Layout:
        available = cores()
        if len(available) < 2:
            raise SystemExit("needs two cores at least: one CPU worker and one feeding the GPU")
        feeder = available[-1]
        cpus = tuple(available[:-1][:cpu_workers] if cpu_workers else available[:-1])
        return cls(cpus, "cpu" if stand_in else "gpu:0", feeder, stand_in)

    @property
    def gpu_options(self) -> list[str]:
        """The GPU worker's options: the stand-in runs torch, the GPU worker's engine."""
        return ["--backend", "torch"] if self.stand_in else []

    @property
    def engine_device(self) -> str:
        return "cpu" if self.stand_in else "cuda:0"

    def workers(self) -> list[str]:
        return [f"cpu:{core}" for core in self.cpus] + [self.gpu]


@dataclass
class Clock:
    """The run's time budget."""

    budget: float
    started: float = field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.started)

    def check(self, what: str, needs: float = STEP_FLOOR) -> None:
        """OutOfTime when less than ``needs`` seconds are left for ``what``."""
        if self.left() < needs:
            raise OutOfTime(f"{what}: not run, {self.left():.0f} s of the budget left")


class OutOfTime(Exception):
    """The budget ran out before a step or a job."""


@dataclass
class ModelRun:
    """Everything measured on one model."""

    model: str
    engines: list[dict[str, Any]] = field(default_factory=list)
    batches: dict[str, int] = field(default_factory=dict)  # worker kind -> compute batch
    rates: dict[str, float] = field(default_factory=dict)  # worker kind -> engine images/s
    standalone: dict[str, float] = field(default_factory=dict)  # device -> images/s alone
    policies: list[dict[str, Any]] = field(default_factory=list)
    peers: list[dict[str, Any]] = field(default_factory=list)
    table2: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    best_trace: Trace | None = None

    @property
    def theoretical(self) -> float:
        return sum(self.standalone.values())


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


#: What begins a progress line (one per model and step): bench/gpu-run.sh shows only these.
PROGRESS = "-- "


def progress(text: str) -> None:
    say(PROGRESS + text)


# ---- step 1: engines ------------------------------------------------------------------------


def engines(
    layout: Layout, model: str, run: ModelRun, args: argparse.Namespace, clock: Clock
) -> None:
    """The GPU worker's engine choice in each precision (one fresh process: one CUDA start)
    and a pinned core's, remembered for their workers."""
    for kind, device, threads, backend, precisions, core in (
        (
            "gpu",
            layout.engine_device,
            None,
            "torch" if layout.stand_in else "auto",
            GPU_PRECISIONS,
            layout.feeder,
        ),
        ("cpu", "cpu", 1, "auto", ("f32",), layout.cpus[0]),
    ):
        clock.check(f"{model}: engines: the {kind} engine")
        rows = in_fresh_process(engine_choices, model, device, threads, backend, precisions, core)
        for row in rows:
            row["kind"] = kind
            run.engines.append(row)
            say(f"{model}: {kind} {row['precision']}: {engine_text(row)}")
        if rows[0]["problem"]:
            raise FarmError(f"{model} cannot run on the {kind} worker: {rows[0]['problem']}")
        run.batches[kind], run.rates[kind] = rows[0]["batch"], rows[0]["rate"]


def engine_text(row: dict[str, Any]) -> str:
    if row["problem"]:
        return row["problem"]
    text = f"{row['backend']} batch {row['batch']}, {row['rate']:,.0f}/s"
    if row["difference"] is not None:
        text += f", differs from the f32 reference by {row['difference']:.1e}"
    cascade = row.get("cascade")
    if cascade:
        text += (
            f"; +f32 cascade: {cascade['rate']:,.0f}/s, {cascade['rerun']:.1%} re-run, "
            f"top-1 agrees {cascade['agreement']:.1%}, {cascade['non_finite']} non-finite"
        )
    return text


def engine_choices(
    model: str,
    device: str,
    threads: int | None,
    backend: str,
    precisions: tuple[str, ...],
    core: int,
) -> list[dict[str, Any]]:
    """In a fresh process pinned to ``core``: ``engine_choice`` in each precision."""
    os.sched_setaffinity(0, {core})
    rows = []
    for precision in precisions:
        rows.append(engine_choice(model, device, threads, backend, precision))
        release_memory()
    return rows


def release_memory() -> None:
    """Free the engines gone out of use, and their GPU memory (for the next precision)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def engine_choice(
    model: str, device: str, threads: int | None, backend: str, precision: str
) -> dict[str, Any]:
    """What ``auto`` (or ``backend``) chooses, its speed on a chunk run as a worker runs it,
    and how far it is from f32; a refusal or an error (out of GPU memory) is its problem."""
    from farm.modelrepo.repository import ModelError

    row: dict[str, Any] = {
        "model": model,
        "device": device,
        "precision": precision,
        "backend": backend,
        "batch": 0,
        "rate": 0.0,
        "difference": None,
        "problem": None,
        "cascade": None,
    }
    try:
        engine, row["difference"] = chosen_engine(model, device, threads, backend, precision)
        images = make_images(model, max(engine.batch * 4, 256))
        engine.run(images[: engine.batch])
        started = time.perf_counter()
        engine.run(images)
        rate = len(images) / (time.perf_counter() - started)
        if precision != "f32" and device != "cpu":
            row["cascade"] = cascade_figures(engine, model, device, threads, images)
    except ModelError as exc:
        row["problem"] = str(exc)
        return row
    except Exception as exc:  # the library's own errors: out of GPU memory, ...
        row["problem"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return row
    row.update(backend=engine.backend, batch=engine.batch, rate=rate)
    return row


def cascade_figures(
    engine: Any, model: str, device: str, threads: int | None, images: np.ndarray
) -> dict[str, Any]:
    """The GPU's cascade in this precision (``f16+f32``: ``farm.engines.cascade``) on
    ``images``: the margin fitted on each half and checked on the other, the share run
    again in f32, images/s of a whole run, agreement with f32 and the non-finite outputs
    the fast precision gave (an f16 overflow goes to f32)."""
    from farm.engines.autoselect import load_engine
    from farm.engines.cascade import CascadeEngine, changed, relative, split_check, top_margins

    exact = load_engine(find(model), engine.backend, engine.batch, device, threads, "f32")
    fast_out, exact_out = engine.run(images), exact.run(images)
    margin, splits = split_check(fast_out, exact_out, relative(engine.precision))
    cascade = CascadeEngine(engine, exact, margin, f"{engine.precision}+f32")
    cascade.run(images[: engine.batch])
    started = time.perf_counter()
    answered = cascade.run(images)
    seconds = time.perf_counter() - started
    return {
        "margin": margin,
        "rerun": round(len(cascade.last_run.rerun) / len(images), 4),
        "rate": round(len(images) / seconds, 1),
        "agreement": round(1 - float(changed(answered, exact_out).mean()), 4),
        "missed_held_out": sum(split.missed for split in splits),
        "non_finite": int(np.isnan(top_margins(fast_out)).sum()),
    }


def chosen_engine(
    model: str, device: str, threads: int | None, backend: str, precision: str
) -> tuple[Any, float | None]:
    """The engine ``auto`` (or ``backend``, at its best batch) loads, and its difference
    from f32 (None in f32)."""
    from farm.engines.autoselect import choose, load_engine

    spec = find(model)
    if backend == "auto":
        choice = choose(spec, device, threads, precision)
        difference = next(t.difference for t in choice.trials if t.backend == choice.backend)
        return choice.loaded(), difference
    engine = load_engine(spec, backend, None, device, threads, precision)
    engine.batch = best_batch(engine, make_images(model, 256))
    if precision == "f32":
        return engine, None
    reference = load_engine(spec, backend, None, device, threads, "f32")
    images = make_images(model, 64)
    return engine, relative_difference(engine.run(images), reference.run(images))


def best_batch(engine: Any, images: np.ndarray) -> int:
    """The compute batch, of ``GPU_PEER_BATCHES``, at which ``engine.run`` is fastest."""
    rates = {}
    for batch in GPU_PEER_BATCHES[:2]:
        engine.batch = batch
        engine.run(images[:batch])
        started = time.perf_counter()
        engine.run(images)
        rates[batch] = len(images) / (time.perf_counter() - started)
    return max(rates, key=lambda batch: rates[batch])


# ---- farms ----------------------------------------------------------------------------------


def farm_for(layout: Layout, devices: list[str], model: str, run: ModelRun) -> LocalFarm:
    """A local farm of ``devices`` (of the layout), each on the engine step 1 chose for its
    kind; the GPU worker started under ``taskset`` on its feeding core."""
    options, launchers = [], []
    for device in devices:
        on_gpu = device == layout.gpu
        # auto remembers its batch with its backend; a backend named needs its batch named
        options.append(
            [*layout.gpu_options, "--batch", str(run.batches["gpu"])]
            if on_gpu and layout.stand_in
            else []
        )
        launchers.append(["taskset", "-c", str(layout.feeder)] if on_gpu and TASKSET else [])
    return LocalFarm(
        devices=devices,
        algo="fifo",
        broker_options=BROKER_OPTIONS,
        device_options=options,
        device_launchers=launchers,
        preload=[model],
        ready_timeout=300.0,
    )


@contextlib.contextmanager
def started(farms: list[LocalFarm]) -> Iterator[list[LocalFarm]]:
    """Start every farm at once (their start costs one farm's), stop them all after."""
    # the stops run before the pool waits for its threads: an interrupt while farms start
    # stops them, and the threads starting them give up at once
    with concurrent.futures.ThreadPoolExecutor(len(farms)) as pool, contextlib.ExitStack() as stack:
        for farm in farms:  # first: one farm failing to start stops the others too
            stack.callback(farm.stop)
        yield list(pool.map(lambda farm: farm.__enter__(), farms))


def sized(rate: float, seconds: float, least: int, most: int) -> int:
    return int(min(most, max(least, rate * seconds)))


def time_share(args: argparse.Namespace) -> float:
    """The share of its usual seconds each measurement is sized for: ``QUICK_SHARE`` in a
    smoke run (--quick), else all."""
    return QUICK_SHARE if args.quick else 1.0


# ---- step 2: standalone speeds --------------------------------------------------------------


def standalone(
    layout: Layout, model: str, run: ModelRun, args: argparse.Namespace, clock: Clock
) -> None:
    """Each worker alone: one-worker farms started together, then run one at a time."""
    devices = layout.workers()
    farms = [farm_for(layout, [device], model, run) for device in devices]
    with started(farms):
        for device, farm in zip(devices, farms):
            clock.check(f"{model}: standalone speeds: {device} alone")
            kind = "gpu" if device == layout.gpu else "cpu"
            count = sized(run.rates[kind], STANDALONE_SECONDS * time_share(args), 16, 200_000)
            chunk = Configuration("fifo", {"chunk": max(1, count // 4)})
            images = make_images(model, count)
            with farm.client(timeout=JOB_TIMEOUT) as client:
                timed_job(client, images[: max(1, count // 4)], model, chunk)  # warm-up
                run.standalone[device] = timed_job(client, images, model, chunk).summary.rate
    say(
        f"{model}: alone: gpu {run.standalone[layout.gpu]:,.0f}/s, cores "
        f"{sum(v for d, v in run.standalone.items() if d != layout.gpu):,.0f}/s in all"
    )


# ---- step 3: every policy on the whole farm -------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sweep(
    layout: Layout, model: str, run: ModelRun, args: argparse.Namespace, clock: Clock
) -> None:
    """Every policy at the paper's values on the whole farm, each job traced."""
    small = model in SMALL
    count = args.images or (
        SWEEP_IMAGES_SMALL
        if small
        else sized(run.theoretical, SWEEP_SECONDS * time_share(args), 2000, 50_000)
    )
    configs = paper_configurations(args.quick or not small)
    images = make_images(model, count)
    farm = farm_for(layout, layout.workers(), model, run)
    with started([farm]), farm.client(timeout=JOB_TIMEOUT) as client:
        warm = max(1, int(run.rates["cpu"] * 0.5))  # about half a second a CPU worker
        timed_job(
            client,
            images[: min(count, warm * len(layout.workers()))],
            model,
            Configuration("fifo", {"chunk": warm}),
        )
        gpu_process = farm.workers[-1]
        best_rate = 0.0
        for config in configs:
            clock.check(
                f"{model}: policies: {config.label} and those after it",
                STEP_FLOOR + 1.5 * expected_seconds(config, count, run),
            )
            before = cpu_seconds(gpu_process.pid)
            result = timed_job(client, images, model, config, trace=True)
            feeder = cpu_seconds(gpu_process.pid) - before
            row = policy_row(layout, model, config, result, run, feeder)
            run.policies.append(row)
            if row["images_per_s"] > best_rate:
                best_rate, run.best_trace = row["images_per_s"], result.trace
            say(
                f"{model}: {config.label}: {row['images_per_s']:,.0f}/s, waste "
                f"{row['waste']:.1%}, gpu busy {row['gpu_busy']:.1%}"
            )


def expected_seconds(config: Configuration, count: int, run: ModelRun) -> float:
    """About how long a job takes: its images at the farm's speed, or the largest chunk the
    policy gives a CPU worker (``chunk``, ``slice``, ``probe``: images) at a core's speed."""
    value = config.params.get(config.parameter)
    largest = value if isinstance(value, int) else 0
    return max(count / max(run.theoretical, 1.0), largest / max(run.rates["cpu"], 1.0))


def policy_row(
    layout: Layout, model: str, config: Configuration, result: Any, run: ModelRun, feeder_cpu: float
) -> dict[str, Any]:
    summary = result.summary
    breakdown = analyse(result.trace)
    gpu = next((w for w in breakdown.workers if w.name.endswith("/" + layout.gpu)), None)
    span = breakdown.seconds
    gpu_items = gpu.items if gpu else 0
    return {
        "model": model,
        "policy": config.algo,
        "parameter": config.parameter,
        "value": config.value,
        "images": summary.total,
        "seconds": summary.seconds,
        "images_per_s": summary.rate,
        "theoretical": run.theoretical,
        "waste": idle_share(result.trace),
        "standalone_waste": 1 - summary.rate / run.theoretical if run.theoretical else 0.0,
        "in_job_theoretical": summary.theoretical_rate,
        "in_job_waste": summary.waste,
        "gpu_images": gpu_items / summary.total if summary.total else 0.0,
        "gpu_busy": (gpu.device_share(span) or 0.0) if gpu else 0.0,
        "gpu_compute": gpu.busy_s / span if gpu and span else 0.0,
        "gpu_copy": (gpu.copy_s or 0.0) / span if gpu and span else 0.0,
        "gpu_gaps_s": (gpu.barrier_s + gpu.messaging_s) if gpu else 0.0,
        "gpu_chunks": gpu.chunks if gpu else 0,
        "feeder_cpu": feeder_cpu / summary.seconds if summary.seconds else 0.0,
    }


# ---- step 4: peers --------------------------------------------------------------------------


def peers(
    layout: Layout, model: str, run: ModelRun, args: argparse.Namespace, clock: Clock
) -> None:
    """torch alone on the GPU; ONNX Runtime and OpenCV on every core, in one process each."""
    seconds = 2 * STANDALONE_SECONDS * time_share(args)
    count = sized(run.standalone[layout.gpu], seconds, 256, 200_000)
    run.peers.append(
        in_fresh_process(
            alone,
            model,
            "torch",
            layout.engine_device,
            None,
            GPU_PEER_BATCHES,
            count,
            (layout.feeder,),
            "torch, GPU alone",
        )
    )
    every = (*layout.cpus, layout.feeder)
    cpu_total = sum(v for d, v in run.standalone.items() if d != layout.gpu)
    count = sized(cpu_total, seconds, 64, 100_000)
    for backend in ("onnxruntime", "opencv"):
        clock.check(f"{model}: peers: {backend} on every core")
        run.peers.append(
            in_fresh_process(
                alone,
                model,
                backend,
                "cpu",
                len(every),
                CPU_PEER_BATCHES,
                count,
                every,
                f"{backend}, every core",
            )
        )
    for peer in run.peers:
        say(f"{model}: {peer['peer']}: {peer_text(peer)}")


def peer_text(peer: dict[str, Any]) -> str:
    if peer["problem"]:
        return peer["problem"]
    text = f"{peer['images_per_s']:,.0f}/s at batch {peer['batch']}"
    return text + (f" ({peer['note']})" if peer["note"] else "")


def alone(
    model: str,
    backend: str,
    device: str,
    threads: int | None,
    batches: tuple[int, ...],
    count: int,
    allowed: tuple[int, ...],
    name: str,
) -> dict[str, Any]:
    """In a fresh process on ``allowed`` cores: the engine at each batch on ``count`` images
    (after a warm-up batch), the best kept.  A batch that fails (out of GPU memory, a
    refusal) ends the tries: after a batch that ran, as the row's ``note`` (the figures
    stand); before any, as its ``problem``."""
    from farm.modelrepo.repository import ModelError

    os.sched_setaffinity(0, set(allowed))
    images = make_images(model, count)
    row: dict[str, Any] = {
        "model": model,
        "peer": name,
        "batch": 0,
        "images": count,
        "images_per_s": 0.0,
        "problem": None,
        "note": None,
    }
    for batch in batches:
        try:
            rate = batch_rate(model, backend, device, threads, batch, images)
        except Exception as exc:  # out of GPU memory at a larger batch, a refusal, ...
            text = str(exc) if isinstance(exc, ModelError) else f"{type(exc).__name__}: {exc}"
            row["note" if row["images_per_s"] else "problem"] = f"batch {batch}: {text[:200]}"
            break
        finally:
            release_memory()
        if rate > row["images_per_s"]:
            row.update(batch=batch, images_per_s=rate)
    return row


def batch_rate(
    model: str, backend: str, device: str, threads: int | None, batch: int, images: np.ndarray
) -> float:
    """Images/s of the engine at ``batch`` on ``images``, after a warm-up batch."""
    from farm.engines.autoselect import load_engine

    engine = load_engine(find(model), backend, batch, device, threads)
    engine.run(images[:batch])
    started = time.perf_counter()
    engine.run(images)
    return len(images) / (time.perf_counter() - started)


# ---- step 5: Table 2 ------------------------------------------------------------------------


def table2(
    layout: Layout, model: str, run: ModelRun, args: argparse.Namespace, clock: Clock
) -> None:
    """One GPU worker and one pinned core, alone each, images/s by chunk size."""
    devices = [layout.gpu, f"cpu:{layout.cpus[0]}"]
    farms = [farm_for(layout, [device], model, run) for device in devices]
    capped = MAX_TASK_BYTES // int(np.prod(find(model).item_shape))  # uint8 images
    with started(farms):
        for device, farm in zip(devices, farms):
            rate = run.standalone[device]
            with farm.client(timeout=JOB_TIMEOUT) as client:
                for size in TABLE2_SIZES:
                    row = {
                        "model": model,
                        "device": device,
                        "chunk": size,
                        "images": 0,
                        "images_per_s": None,
                        "note": f"chunks capped at {capped} images (64 MiB of input)"
                        if size > capped
                        else "",
                    }
                    if size / rate > MAX_CHUNK_SECONDS:
                        row["note"] = f"one chunk takes {size / rate:.0f} s here: not run"
                    elif clock.left() < STEP_FLOOR:
                        row["note"] = "out of time: not run"
                    else:
                        most = min(100_000, size * int(MAX_TABLE2_CHUNKS * time_share(args)))
                        seconds = TABLE2_SECONDS * time_share(args)
                        count = sized(rate, seconds, size, most) // size * size
                        result = timed_job(
                            client,
                            make_images(model, count),
                            model,
                            Configuration("fifo", {"chunk": size}),
                        )
                        row.update(images=count, images_per_s=result.summary.rate)
                    run.table2.append(row)
    say(
        f"{model}: Table 2: "
        + ", ".join(
            f"{r['device']} chunk {r['chunk']}: {r['images_per_s'] or 0:,.0f}/s" for r in run.table2
        )
    )


# ---- the whole run --------------------------------------------------------------------------

Step = Callable[[Layout, str, ModelRun, argparse.Namespace, Clock], None]
#: The steps, in order; the first two are what the others are measured against.
STEPS: tuple[tuple[str, Step], ...] = (
    ("engines", engines),
    ("standalone speeds", standalone),
    ("policies", sweep),
    ("peers", peers),
    ("table 2", table2),
)
NEEDED = ("engines", "standalone speeds")


def measure_model(
    layout: Layout, run: ModelRun, args: argparse.Namespace, clock: Clock, save: Callable[[], None]
) -> None:
    """Every step on one model, saved after each; a step that fails or runs out of time is
    named in the report, and the steps after a needed one that did are not run."""
    model = run.model
    for name, step in STEPS:
        began, outcome = time.perf_counter(), "done"
        try:
            clock.check(f"{model}: {name}")
            step(layout, model, run, args, clock)
        except OutOfTime as exc:
            run.skipped.append(str(exc))
            outcome = "out of time"
        except Exception as exc:  # a farm that would not start, a job that failed, ...
            run.skipped.append(f"{model}: {name} failed: {type(exc).__name__}: {exc}")
            say(run.skipped[-1])
            outcome = "failed"
        save()
        progress(
            f"{model}: {name}: {outcome} in {time.perf_counter() - began:.0f} s, "
            f"{clock.left():.0f} s of the budget left"
        )
        if run.skipped and name in NEEDED:
            run.skipped.append(f"{model}: the steps after {name}: not run without it")
            break


def summary_rows(layout: Layout, runs: list[ModelRun]) -> list[dict[str, Any]]:
    """Per model started: the best policy, its waste, the GPU's busy share, farm against the
    GPU alone, and the goals; None where a step did not measure it (out of time, failed)."""
    return [summary_row(layout, run) for run in runs]


def summary_row(layout: Layout, run: ModelRun) -> dict[str, Any]:
    best = max(run.policies, key=lambda row: row["images_per_s"], default=None)
    gpu_alone = next(
        (p["images_per_s"] for p in run.peers if p["peer"].endswith("GPU alone")), None
    )
    gpu_alone = gpu_alone or None  # 0.0: no batch ran
    gpu_standalone = run.standalone.get(layout.gpu)
    cores_add = (
        sum(v for d, v in run.standalone.items() if d != layout.gpu) / gpu_standalone
        if gpu_standalone
        else None
    )
    beats = best["images_per_s"] / gpu_alone if best and gpu_alone else None
    waste = best["waste"] if best else None
    return {
        "model": run.model,
        "best": policy_label(best) if best else None,
        "images_per_s": best["images_per_s"] if best else None,
        "waste": waste,
        "in_job_waste": best["in_job_waste"] if best else None,
        "gpu_busy": best["gpu_busy"] if best else None,
        "feeder_cpu": best["feeder_cpu"] if best else None,
        "gpu_alone": gpu_alone,
        "vs_gpu_alone": beats,
        "cores_add": cores_add,
        "goal_waste": None if waste is None else waste <= 0.03,
        "goal_busy": None if best is None else best["gpu_busy"] >= 0.95,
        "goal_beats_gpu": None
        if cores_add is None or cores_add <= 0.05 or beats is None
        else beats > 1.0,
    }


def policy_label(row: dict[str, Any]) -> str:
    return (
        f"{row['policy']} {row['parameter']}={row['value']}" if row["parameter"] else row["policy"]
    )


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        path.write_text("")
        return
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def core_range(ids: tuple[int, ...]) -> str:
    return f"core {ids[0]}" if len(ids) == 1 else f"cores {ids[0]}-{ids[-1]}"


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def goal(value: bool | None) -> str:
    return "n/a" if value is None else "met" if value else "missed"


def goals_text(row: dict[str, Any]) -> str:
    return (
        f"waste {goal(row['goal_waste'])}; busy {goal(row['goal_busy'])}; "
        f"beats GPU: {goal(row['goal_beats_gpu'])}"
    )


def rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)] + [
        "| " + " | ".join(row) + " |" for row in rows
    ]


def report(
    layout: Layout,
    machine: dict[str, Any],
    runs: list[ModelRun],
    skipped: list[str],
    command: str,
    seconds: float,
) -> str:
    """report.md: the summary with the goals, then each model's tables."""
    gpu_name = (
        f"a CPU stand-in (--device cpu on torch, core {layout.feeder})"
        if layout.stand_in
        else ", ".join(machine["gpus"]) or "none found"
    )
    lines = [
        f"# CPU cores and a GPU in one farm, {machine['date']}",
        "",
        f"- machine: {machine['cpu']}, {machine['cores']} cores, "
        f"{machine['memory_gib']} GiB; GPU: {gpu_name}",
        f"- farm: {plural(len(layout.cpus), 'pinned CPU worker')} ("
        f"{core_range(layout.cpus)}) and the GPU worker, fed by core {layout.feeder}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in machine["versions"].items()),
        f"- command: `{command}` ({seconds:.0f} s)",
        "",
        "Waste: the workers' idle time between the job's start and end over workers x span, "
        "from the job's trace (a worker is busy while it computes a chunk; it cannot go "
        "negative). In-job: 1 - images/s over the speeds the workers showed inside the "
        "job; standalone: over the sum of their speeds measured alone in this run, which "
        "drift with the machine. GPU busy: the seconds its CUDA events timed over the "
        "job's span. Goals: waste at most 3%, GPU busy at least 95%, the farm above the "
        "GPU alone where the cores add more than 5% of the GPU's speed.",
        "",
        "## Summary",
        "",
    ]
    rows = summary_rows(layout, runs)
    lines += table(
        [
            "model",
            "best policy",
            "images/s",
            "waste",
            "waste, in-job",
            "GPU busy",
            "feeding core",
            "GPU alone/s",
            "farm / GPU alone",
            "cores add",
            "goals",
        ],
        [
            [
                r["model"],
                r["best"] or "not measured",
                rate(r["images_per_s"]),
                percent(r["waste"]),
                percent(r["in_job_waste"]),
                percent(r["gpu_busy"]),
                percent(r["feeder_cpu"]),
                rate(r["gpu_alone"]),
                ratio(r["vs_gpu_alone"]),
                percent(r["cores_add"]),
                goals_text(r),
            ]
            for r in rows
        ],
    )
    for run in runs:
        lines += ["", f"## {run.model}", "", "Engines:", ""]
        lines += table(
            ["worker", "precision", "backend", "batch", "images/s", "vs f32", "problem"],
            [
                [
                    e["kind"],
                    e["precision"],
                    e["backend"],
                    str(e["batch"]),
                    f"{e['rate']:,.0f}",
                    "-" if e["difference"] is None else f"{e['difference']:.1e}",
                    e["problem"] or "",
                ]
                for e in run.engines
            ],
        )
        gpu_alone = run.standalone.get(layout.gpu, 0.0)
        lines += [
            "",
            f"Standalone: GPU worker {gpu_alone:,.0f}/s; CPU workers "
            + ", ".join(f"{v:,.0f}" for d, v in run.standalone.items() if d != layout.gpu)
            + f" (sum {run.theoretical:,.0f}/s)",
            "",
            "Every policy:",
            "",
        ]
        lines += table(
            [
                "policy",
                "images",
                "images/s",
                "waste",
                "in-job",
                "standalone",
                "GPU share",
                "GPU busy",
                "GPU copies",
                "GPU gaps (s)",
                "feeding core",
            ],
            [
                [
                    policy_label(p),
                    f"{p['images']:,}",
                    f"{p['images_per_s']:,.0f}",
                    percent(p["waste"]),
                    percent(p["in_job_waste"]),
                    percent(p["standalone_waste"]),
                    percent(p["gpu_images"]),
                    percent(p["gpu_busy"]),
                    percent(p["gpu_copy"]),
                    f"{p['gpu_gaps_s']:.3f}",
                    percent(p["feeder_cpu"]),
                ]
                for p in run.policies
            ],
        )
        lines += ["", "Peers:", ""]
        lines += table(
            ["peer", "batch", "images", "images/s", "problem", "note"],
            [
                [
                    p["peer"],
                    str(p["batch"]),
                    f"{p['images']:,}",
                    f"{p['images_per_s']:,.0f}",
                    p["problem"] or "",
                    p["note"] or "",
                ]
                for p in run.peers
            ],
        )
        lines += ["", "Table 2 (one worker alone, images/s by chunk size):", ""]
        lines += table(
            ["device", "chunk", "images", "images/s", "note"],
            [
                [
                    t["device"],
                    f"{t['chunk']:,}",
                    f"{t['images']:,}",
                    "-" if t["images_per_s"] is None else f"{t['images_per_s']:,.0f}",
                    t["note"],
                ]
                for t in run.table2
            ],
        )
    notes = skipped + [line for run in runs for line in run.skipped]
    if notes:
        lines += ["", "## Not measured", ""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def write_results(
    out: Path,
    layout: Layout,
    machine: dict[str, Any],
    runs: list[ModelRun],
    skipped: list[str],
    command: str,
    seconds: float,
) -> None:
    """Every file of the results folder (written again after each model)."""
    out.mkdir(parents=True, exist_ok=True)
    document = {
        "machine": machine,
        "layout": asdict(layout),
        "command": command,
        "seconds": seconds,
        "skipped": skipped,
        "summary": summary_rows(layout, runs),
        "models": [{k: v for k, v in asdict(run).items() if k != "best_trace"} for run in runs],
    }
    (out / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    write_csv(out / "engines.csv", [e for run in runs for e in run.engines])
    write_csv(out / "policies.csv", [p for run in runs for p in run.policies])
    write_csv(out / "peers.csv", [p for run in runs for p in run.peers])
    write_csv(out / "table2.csv", [t for run in runs for t in run.table2])
    traces = [msgspec.json.encode(run.best_trace).decode() for run in runs if run.best_trace]
    (out / "traces.jsonl").write_text("".join(line + "\n" for line in traces))
    (out / "report.md").write_text(report(layout, machine, runs, skipped, command, seconds))


def add_nets() -> None:
    """bench/nets (googlenet) among the model folders of this process and its children."""
    folders = [folder for folder in os.environ.get("FARM_MODELS", "").split(os.pathsep) if folder]
    if str(NETS) not in folders:
        os.environ["FARM_MODELS"] = os.pathsep.join([*folders, str(NETS)])


def interrupt_on_term() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt, on which the results so far are written:
    SIGTERM is how a machine's own time limit ends a run, and a shell starts a background
    command with SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the results folder")
    parser.add_argument(
        "--stand-in",
        action="store_true",
        help="no GPU: a torch worker on the last core stands in for it",
    )
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument(
        "--images",
        type=int,
        help="images per policy job [default: 100 000 for the small nets, "
        "about 4 s of the farm's work for the others]",
    )
    parser.add_argument(
        "--cpu-workers",
        type=int,
        help="CPU workers [default: every core but the one feeding the GPU]",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run: one value per policy, each job sized for {QUICK_SHARE:g} of its "
        "seconds",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=520.0,
        help="seconds; a model is not started with less than "
        f"{MODEL_FLOOR:.0f} s left ({LARGE_MODEL_FLOOR:.0f} for an "
        f"ImageNet-sized one), a step or job with less than it needs",
    )
    parser.add_argument(
        "--copy-report",
        type=Path,
        help="also write report.md here each time the results are saved (bench/gpu-run.sh: "
        "into what comes back even if the run is killed)",
    )
    args = parser.parse_args()
    clock = Clock(args.budget)
    interrupt_on_term()
    add_nets()
    layout = Layout.here(args.stand_in, args.cpu_workers)
    if not args.stand_in:
        try:
            import torch
        except ImportError as exc:
            raise SystemExit(
                f"the GPU worker needs torch ({exc}): install it, or add "
                f"--stand-in for the CPU dry run"
            ) from None
        if not torch.cuda.is_available():
            raise SystemExit(
                f"torch {torch.__version__} sees no CUDA device: run on a GPU "
                f"machine, or add --stand-in for the CPU dry run"
            )
    machine = describe_machine()
    command = "bench/gpu.sh " + " ".join(sys.argv[1:])
    say(f"farm: {layout.workers()}, GPU worker fed by core {layout.feeder}")
    runs: list[ModelRun] = []
    skipped: list[str] = []

    def save() -> None:
        write_results(
            args.out, layout, machine, runs, skipped, command, time.perf_counter() - clock.started
        )
        if args.copy_report:
            shutil.copyfile(args.out / "report.md", args.copy_report)

    try:
        for model in (name.strip() for name in args.models.split(",") if name.strip()):
            floor = MODEL_FLOOR if model in SMALL else LARGE_MODEL_FLOOR
            if clock.left() < floor:
                skipped.append(
                    f"{model}: not started, {clock.left():.0f} s of the budget "
                    f"left (it needs {floor:.0f})"
                )
                progress(skipped[-1])
                continue
            runs.append(ModelRun(model))  # saved as it goes, interrupted or not
            measure_model(layout, runs[-1], args, clock, save)
    except KeyboardInterrupt:  # bench/gpu.sh's time limit (SIGINT), or Ctrl-C
        skipped.append("interrupted: the time limit was reached (or Ctrl-C)")
        progress(skipped[-1])
    save()
    say(f"results in {args.out}")
    print((args.out / "report.md").read_text())


if __name__ == "__main__":
    main()
