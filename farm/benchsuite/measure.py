"""Farm jobs the suite times: standalone speeds, Table 2, every policy at the paper's values.

Every farm here is a real local farm (``farm.ops.local.LocalFarm``: a broker and
pinned worker processes on loopback).  The broker keeps each policy's own
chunks (``--max-chunk-seconds 0``), so the paper's policies run as docs/scheduling.md
defines them; each job names its policy, so one warm farm runs them all.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from farm.benchsuite.setups import FarmSetup, WorkerSpec, make_images
from farm.client.client import Client, FarmError, JobResult
from farm.client.trace import idle_share
from farm.engines.autoselect import choose, load_engine
from farm.engines.engine import AUTO
from farm.modelrepo.repository import find
from farm.ops.local import LocalFarm
from farm.policies import PAPER_PARAMETERS, POLICIES
from farm.workers.worker import Device, prepare_process

#: Broker options of every benchmark farm: the policies' own chunks, uncapped.
BROKER_OPTIONS = ("--max-chunk-seconds", "0")
#: Chunk of the standalone jobs: big enough that one worker never waits for the broker.
STANDALONE_CHUNK = 2000
#: Share of a policy job's images that each worker computes alone, per worker of the
#: farm, in each standalone measurement around the job (see ``bracket_images``).
BRACKET_SHARE = 0.1
#: Seconds a benchmark job may take before the client gives up.
JOB_TIMEOUT = 900.0
#: Table 2's column: how many images are submitted at once.
TABLE2_SIZES = (10_000, 1000, 100, 10, 1)
#: Compute batches tried for each worker kind, as the peers try theirs.
BATCH_CANDIDATES = {"cpu": (16, 64, 256), "gpu": (64, 256, 1024)}


@dataclass(frozen=True)
class Configuration:
    """A policy and its parameters, as one job asks for it."""

    algo: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def parameter(self) -> str:
        return next(iter(self.params), "")

    @property
    def value(self) -> str:
        value = self.params.get(self.parameter, "")
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    @property
    def label(self) -> str:
        return f"{self.algo} {self.parameter}={self.value}" if self.params else self.algo


def paper_configurations(quick: bool = False) -> list[Configuration]:
    """Every policy at each of the paper's parameter values (only the first when quick);
    ours, which has none, once."""
    configs = []
    for name in POLICIES:
        parameter, values = PAPER_PARAMETERS.get(name, ("", (None,)))
        for value in values[:1] if quick else values:
            use = parameter and value is not None and value != ()
            configs.append(Configuration(name, {parameter: value} if use else {}))
    return configs


def in_fresh_process(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` in a new spawned process (nothing inherited from this one).

    An interrupt here (bench/gpu.sh's time limit) ends that process at once: a process
    pool interrupted before its shutdown leaves its worker waiting for more work, and
    Python's exit then waits for that worker forever.
    """
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=run_and_send, args=(sender, function, args))
    process.start()
    sender.close()
    try:
        outcome, value = receiver.recv()
        process.join()
    except EOFError:
        process.join()
        raise RuntimeError(
            f"{function.__name__} died in its process (exit code {process.exitcode})"
        ) from None
    finally:
        if process.is_alive():
            process.terminate()
            process.join()
        receiver.close()
    if outcome == "error":
        raise value
    return value


def run_and_send(sender: Any, function: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """In the fresh process: send back ``("ok", result)`` or ``("error", exception)``."""
    try:
        sender.send(("ok", function(*args)))
    except BaseException as exc:  # KeyboardInterrupt too: the caller decides
        try:
            sender.send(("error", exc))
        except Exception:  # an exception that cannot be pickled: its text
            sender.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))


@contextlib.contextmanager
def bench_farm(workers: Sequence[WorkerSpec], model: str, images: np.ndarray) -> Iterator[Client]:
    """A fresh local farm of ``workers`` with ``model`` loaded, warmed up by one job of
    the first ``STANDALONE_CHUNK`` of ``images``; a client connected to it."""
    with (
        LocalFarm(
            devices=[w.device for w in workers],
            algo="fifo",
            broker_options=BROKER_OPTIONS,
            device_options=[w.options() for w in workers],
            preload=[model],
        ) as local,
        local.client(timeout=JOB_TIMEOUT) as client,
    ):
        timed_job(
            client,
            images[:STANDALONE_CHUNK],
            model,
            Configuration("fifo", {"chunk": STANDALONE_CHUNK}),
        )
        yield client


def timed_job(
    client: Client, images: np.ndarray, model: str, config: Configuration, trace: bool = False
) -> JobResult:
    """One whole job under ``config`` (``trace``: with every chunk's timings); a job that
    lost images is an error, not a figure."""
    result = client.run(images, model, algo=config.algo, params=config.params, trace=trace)
    if result.failed:
        first = result.failed[0]
        raise FarmError(
            f"{config.label}: {len(result.failed)} ranges of images failed, "
            f"first {first.start}+{first.count}: {first.error}"
        )
    return result


def standalone_rate(worker: WorkerSpec, model: str, images: np.ndarray) -> float:
    """Images/s of ``worker`` alone: a one-worker farm, big fifo chunks, after a warm-up."""
    with bench_farm([worker], model, images) as client:
        return alone_rate(client, model, images)


def alone_rate(client: Client, model: str, images: np.ndarray) -> float:
    """Images/s of the one worker of ``client``'s farm: one job of big fifo chunks."""
    fifo = Configuration("fifo", {"chunk": STANDALONE_CHUNK})
    return timed_job(client, images, model, fifo).summary.rate


#: Measures every worker of a setup alone, now, into its list of standalone speeds.
Bracket = Callable[[], None]


@contextlib.contextmanager
def standalone_farms(
    workers: Sequence[WorkerSpec],
    model: str,
    images: np.ndarray,
    into: dict[str, list[float]],
) -> Iterator[Bracket]:
    """A warm one-worker farm per worker (same device, backend and batch), kept beside
    the sweep's farm, whose workers idle meanwhile; yields a function that appends each
    worker's speed alone on ``images``, now, to ``into[worker.label]``."""
    with contextlib.ExitStack() as stack:
        clients = [(w.label, stack.enter_context(bench_farm([w], model, images))) for w in workers]

        def measure() -> None:
            for label, client in clients:
                into.setdefault(label, []).append(alone_rate(client, model, images))

        yield measure


def table2(
    worker: WorkerSpec, model: str, images: np.ndarray, sizes: Sequence[int] = TABLE2_SIZES
) -> list[tuple[int, float]]:
    """The paper's Table 2 for one device: images/s of ``images`` cut into chunks of each
    size (how many are submitted at once), the worker computing at its own batch."""
    rows = []
    with bench_farm([worker], model, images) as client:
        for size in sizes:
            job = timed_job(client, images, model, Configuration("fifo", {"chunk": size}))
            rows.append((size, job.summary.rate))
    return rows


def best_batch(worker: WorkerSpec, model: str, count: int) -> list[tuple[int, float]]:
    """Images/s of the worker's engine at each candidate batch, in a fresh process set up
    as the worker sets itself up (pinned, one thread), on ``count`` images; a worker on
    ``auto`` is timed on the backend auto chose for it."""
    candidates = BATCH_CANDIDATES["gpu" if worker.device.startswith("gpu") else "cpu"]
    return in_fresh_process(_engine_rates, worker, model, candidates, count)


def _engine_rates(
    worker: WorkerSpec, model: str, candidates: Sequence[int], count: int
) -> list[tuple[int, float]]:
    device = Device.parse(worker.device)
    prepare_process(device)
    threads = 1 if device.pinned else None
    if worker.library == AUTO:
        # pick (or recall) the backend as a worker started without --batch would, over
        # autoselect's own batches; each candidate below then loads that remembered choice
        # at its batch, as the bench's workers do with --batch
        choose(find(model), device.engine_device, threads)
    return engine_rates(
        model, worker.library, device.engine_device, threads, candidates, make_images(model, count)
    )


def engine_rates(
    model: str,
    backend: str,
    engine_device: str,
    threads: int | None,
    candidates: Sequence[int],
    images: np.ndarray,
    repeats: int = 1,
) -> list[tuple[int, float]]:
    """In this process: (batch, images/s of the engine on ``images``) for each candidate
    batch, after a warm-up batch; the best of ``repeats`` runs each."""
    rates = []
    for batch in candidates:
        engine = load_engine(find(model), backend, batch, engine_device, threads)
        engine.run(images[:batch])
        best = 0.0
        for _ in range(repeats):
            started = time.perf_counter()
            engine.run(images)
            best = max(best, len(images) / (time.perf_counter() - started))
        rates.append((batch, best))
    return rates


@dataclass(frozen=True)
class PolicyRun:
    """One measured job of the policy sweep."""

    setup: str
    model: str
    config: Configuration
    round_: int
    rate: float  # images/s, submit to last result, as the client saw it
    seconds: float
    in_job_theoretical: float  # sum of the workers' speeds measured inside this job
    chunks: int
    idle: float  # the waste from the job's trace: idle worker time / (workers x span)
    bracket: int  # index of its setup's standalone measurement just before it (+1: after)


def bracket_images(images: int, workers: int) -> int:
    """Images of each standalone measurement around a policy job of ``images`` on
    ``workers`` workers: ``BRACKET_SHARE`` of the job split among its workers (so that
    measuring them all, one after the other, costs about ``BRACKET_SHARE`` of the job's
    images on one worker), at least one standalone chunk and at most the job."""
    return min(images, max(STANDALONE_CHUNK, round(images * BRACKET_SHARE / max(1, workers))))


@dataclass(frozen=True)
class Sweep:
    """What one round of the policy sweep runs on."""

    setup: FarmSetup
    model: str
    images: np.ndarray  # every job's
    alone: np.ndarray  # each standalone measurement's
    standalone: dict[str, list[float]]  # worker label -> the setup's standalone speeds


def policy_sweep(
    sweep: Sweep,
    configs: Sequence[Configuration],
    round_: int,
    on_run: Callable[[PolicyRun], None],
) -> tuple[list[PolicyRun], np.ndarray]:
    """One round: every configuration once, on one fresh, warm farm, each job bracketed by
    its workers' standalone speeds (measured before the first job and after each one, the
    sweep's farm idle meanwhile); the first job's outputs (to check the peers' against)."""
    runs: list[PolicyRun] = []
    reference: np.ndarray | None = None
    setup, model, images = sweep.setup, sweep.model, sweep.images
    with (
        bench_farm(setup.workers, model, images) as client,
        standalone_farms(setup.workers, model, sweep.alone, sweep.standalone) as bracket,
    ):
        bracket()
        for config in configs:
            before = len(sweep.standalone[setup.workers[0].label]) - 1
            result = timed_job(client, images, model, config, trace=True)
            bracket()
            if reference is None:
                reference = result.outputs
            run = policy_run(setup.name, model, config, round_, result, before)
            runs.append(run)
            on_run(run)
    if reference is None:
        raise FarmError(f"{setup.name}: no policy job returned outputs to check the peers with")
    return runs, reference


def policy_run(
    setup: str, model: str, config: Configuration, round_: int, result: JobResult, bracket: int
) -> PolicyRun:
    """The sweep's record of one traced job."""
    summary = result.summary
    if result.trace is None:
        raise FarmError(f"{config.label}: the job came back without its trace")
    return PolicyRun(
        setup,
        model,
        config,
        round_,
        summary.rate,
        summary.seconds,
        summary.theoretical_rate,
        sum(share.chunks for share in summary.workers),
        idle_share(result.trace),
        bracket,
    )


def farm_rate(setup: FarmSetup, model: str, images: np.ndarray, config: Configuration) -> float:
    """Images/s of one job under ``config`` on a fresh, warm farm of ``setup``."""
    with bench_farm(setup.workers, model, images) as client:
        return timed_job(client, images, model, config).summary.rate
