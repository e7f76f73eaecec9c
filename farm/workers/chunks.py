"""Running one chunk on the compute thread: its input read, its outputs computed, the reply.

A chunk's items come in the TASK (pixels or image files) or lie on shared storage
(``farm.wire.storage``), which the worker reads itself; a chunk it cannot read fails
uncharged as ``unshared`` (the broker then sends it the bytes).  On a GPU engine that
``feeds_ahead``, the next queued chunk's first batches are launched while the current
one's last batches compute.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from farm.engines.engine import Engine, RunStats, Stopped
from farm.modelrepo.repository import ModelError, ModelSpec
from farm.wire import messages, protocol
from farm.wire.protocol import Command, Message, ProtocolError
from farm.wire.storage import ArrayFiles, UnsharedError, read_files
from farm.workers.engines import LoadedEngines
from farm.workers.fetching import ModelFetches

if TYPE_CHECKING:
    from farm.engines.images import ImageDecoder

log = logging.getLogger("farm.worker")

#: Cancelled job ids a worker remembers (its chunks of them are not run).
CANCELLED_MEMORY = 1000

#: Longest reason a worker gives for one image file that failed.
MAX_REASON = 500

#: Why a float32 item with a NaN or infinite pixel fails (its outputs are NaN).
NON_FINITE = "NaN or infinite pixels"

#: Longest a throttle's wait (``--slow``) goes without asking whether its chunk was cancelled.
THROTTLE_SLICE = 0.01

Reply = list[Any]
Failures = list[tuple[int, int, str]]  # runs of failed items: (offset, count, reason)


@dataclass
class QueuedMessage:
    """A message for the compute thread, from connection ``generation``; ``message`` None:
    a new connection began."""

    generation: int
    message: Message | None
    received: float


@dataclass
class Cancellations:
    """Jobs and attempts the broker cancelled, oldest first: written by the I/O thread,
    read by the compute thread."""

    jobs: dict[str, None] = field(default_factory=dict)
    chunks: dict[int, None] = field(default_factory=dict)  # attempts

    def cancel(self, job: str) -> None:
        """Remember a cancelled job: its queued chunks are not run, its running one stops."""
        remember(self.jobs, job)

    def cancel_chunk(self, chunk: int) -> None:
        """Remember an attempt the broker no longer wants (kept results answered it)."""
        remember(self.chunks, chunk)

    def stopped(self, task: messages.Task) -> bool:
        """Whether the task's job, or the task itself, was cancelled."""
        return task.job in self.jobs or task.chunk in self.chunks


def remember(memory: dict[Any, None], key: Any) -> None:
    """Add ``key``, forgetting the oldest beyond ``CANCELLED_MEMORY``."""
    memory[key] = None
    if len(memory) > CANCELLED_MEMORY:
        del memory[next(iter(memory))]


@dataclass
class Throttle:
    """``farm worker --slow FACTOR@AFTER``, for tests and benchmarks: a straggler stand-in on
    CPU machines.  From ``after`` seconds past the worker's first chunk, each compute batch
    is followed by a wait of ``factor - 1`` times its compute time, counted as compute (and
    device) time, as on a device ``factor`` times slower."""

    factor: float
    after: float = 0.0
    started: float | None = None  # perf_counter when the worker's first chunk began

    def begin(self) -> None:
        """A chunk begins: the first one starts the clock of ``after``."""
        if self.started is None:
            self.started = time.perf_counter()

    def wait(self, compute_seconds: float, stop: Callable[[], bool]) -> float:
        """After a batch that computed ``compute_seconds``: wait ``factor - 1`` times that
        (nothing before ``after``), in slices that end at once when ``stop`` says yes (its
        chunk was cancelled); the seconds waited."""
        now = time.perf_counter()
        if self.started is None or now - self.started < self.after:
            return 0.0
        until = now + (self.factor - 1) * compute_seconds
        while (left := until - time.perf_counter()) > 0 and not stop():
            time.sleep(min(left, THROTTLE_SLICE))
        return time.perf_counter() - now


@dataclass
class Computed:
    """A chunk's outputs, and where its time went: ``load`` the seconds it waited for its
    model's files and engine, ``received`` when its receive began (loading excluded),
    ``decoded`` when its input was ready and its compute began (``time.perf_counter``)."""

    outputs: np.ndarray
    failures: Failures
    oriented: int  # image files with an EXIF orientation
    run: RunStats
    load: float
    received: float
    decoded: float


def in_chunk(run: RunStats, places: np.ndarray) -> None:
    """Turn the indices of the images a run re-ran (``RunStats.rerun``) into the chunk's
    items: ``places[i]`` is the item of the run's i-th image (an oversampled model's
    crops map to their file)."""
    if run.rerun:
        run.rerun = tuple(sorted(set(places[list(run.rerun)].tolist())))


@dataclass
class ChunkRunner:
    """Runs chunks on the worker's engines (compute thread), counting what it computed.

    ``computed_images`` and ``computed_seconds`` are counted batch by batch and sent with
    every heartbeat (I/O thread): the broker's live view.  ``speeds``: model -> (images,
    compute seconds) of the chunks run, sent with READY, so a broker that (re)starts
    knows this worker's speed before its first chunk.
    """

    engines: LoadedEngines
    fetches: ModelFetches
    cancels: Cancellations
    fail_items: tuple[int, int] | None = None  # fault injection: chunks touching [a, b) fail
    throttle: Throttle | None = None  # tests, benchmarks: a slower device (``--slow``)
    throttled: float = 0.0  # seconds the throttle waited in the current chunk
    tasks_done: int = 0
    computed_images: int = 0
    computed_seconds: float = 0.0
    speeds: dict[str, tuple[int, float]] = field(default_factory=dict)
    decoders: dict[str, ImageDecoder] = field(default_factory=dict)  # by model digest
    arrays: ArrayFiles = field(default_factory=ArrayFiles)  # shared .npy files
    # the compute thread's queue, and the connection of the message it runs: a GPU engine
    # launches the next queued chunk before the current one's last batches are in
    upcoming: queue.Queue[QueuedMessage | None] | None = None
    serving: int = 0
    # the next chunk's message and pixels, launched ahead: its run_task takes these pixels
    prefetched: tuple[Message, np.ndarray] | None = None

    def run_task(
        self, message: Message, received: float, spec: ModelSpec | None = None, waited: float = 0.0
    ) -> Reply:
        """Run one chunk: RESULT, or FAILED with the reason when it cannot run.

        Timings: ``load`` the seconds the chunk waited for its model's files
        (``waited``) and engine (a fresh worker's first chunk of a model: ``auto``
        times the engines then), ``receive`` from the start of the receive to the
        decoded input (model loading excluded), ``compute`` the forward passes (and the
        decoding of image files: the policies see a worker's whole cost per image),
        ``send`` the building of the reply (the socket send itself is asynchronous);
        ``device`` the part of ``compute`` the device spent computing (a GPU's, from CUDA
        events) and ``copy`` the host-device copies (a trace's GPU busy share comes from
        these).
        """
        task = message.header
        assert isinstance(task, messages.Task)
        if self.throttle is not None:
            self.throttle.begin()
        try:
            computed = self.compute(message, task, received, spec, waited)
        except Stopped as exc:
            return failed(message, f"job cancelled ({exc})", fatal=False, charge=False)
        except UnsharedError as exc:  # the broker sends this worker the bytes instead
            return failed(message, str(exc), fatal=False, charge=False, unshared=True)
        except (ModelError, ValueError, ProtocolError) as exc:
            return failed(message, str(exc))
        except Exception as exc:  # backend errors and anything unforeseen: worth a retry
            log.exception("chunk %d of job %s failed", task.chunk, task.job)
            return failed(message, f"{type(exc).__name__}: {exc}", fatal=False)
        return self.result(task, computed)

    def compute(
        self,
        message: Message,
        task: messages.Task,
        received: float,
        spec: ModelSpec | None,
        waited: float,
    ) -> Computed:
        """A chunk's outputs, its engine loaded first if need be."""
        key = self.engines.key(task)
        if key not in self.engines.loaded:
            loading = time.perf_counter()
            self.engines.load(spec, key)
            loaded = time.perf_counter() - loading
            waited, received = waited + loaded, received + loaded
        engine = self.engines.loaded[key]
        engine.last_run = RunStats()  # a chunk whose every file fails computes nothing
        self.throttled = 0.0
        oriented = 0
        if task.dtype == protocol.ENCODED:
            files, unread = self.chunk_files(message, task)
            decoded = time.perf_counter()  # decoding the files counts as compute
            outputs, failures, oriented = self.run_files(engine, files, unread, task)
        else:
            if task.item_shape != engine.spec.item_shape:
                raise ValueError(
                    f"item shape {task.item_shape} does not match model "
                    f"{engine.spec.name!r} input {engine.spec.item_shape}"
                )
            images = self.chunk_array(message, task)
            compiled = engine.prepare(images.dtype)  # a graph for a new dtype: loading
            waited, received = waited + compiled, received + compiled
            decoded = time.perf_counter()
            outputs, failures = self.run_array(engine, images, task)
        log.debug(
            "computed items %d..%d of job %s in %.3f s",
            task.start,
            task.start + task.count - 1,
            task.job,
            time.perf_counter() - decoded,
        )
        self.inject_fault(task.start, task.count)  # after the compute, which it wastes
        run = engine.last_run
        if self.throttled:  # a throttled device is busy while it waits
            run = dataclasses.replace(run, device=run.device + self.throttled)
        return Computed(outputs, failures, oriented, run, waited, received, decoded)

    def result(self, task: messages.Task, computed: Computed) -> Reply:
        """The RESULT of a chunk computed, with its timings; counts it in ``speeds``."""
        finished = time.perf_counter()
        self.tasks_done += 1
        done, spent = self.speeds.get(task.model, (0, 0.0))
        self.speeds[task.model] = (done + task.count, spent + finished - computed.decoded)
        frames = protocol.array_frames(computed.outputs)
        if computed.failures:
            frames.append(protocol.failures_frame(computed.failures))
        timings = {
            "load": computed.load,
            "receive": computed.decoded - computed.received,
            "compute": finished - computed.decoded,
            "device": computed.run.device,
            "copy": computed.run.copy,
            "send": time.perf_counter() - finished,
        }
        header = messages.Result(
            job=task.job,
            chunk=task.chunk,
            start=task.start,
            count=task.count,
            dtype="float32",
            item_shape=computed.outputs.shape[1:],
            timings=timings,
            failed=sum(count for _, count, _ in computed.failures),
            oriented=computed.oriented,
            rerun=len(computed.run.rerun),
        )
        return protocol.encode(Command.RESULT, header, frames)

    def chunk_files(
        self, message: Message, task: messages.Task
    ) -> tuple[list[Any], dict[int, str]]:
        """A chunk's image files: sent, or read here from shared storage; with the reasons of
        those that could not be read (UnsharedError if none could)."""
        if task.stored is None:
            return message.files(), {}
        files, unread = read_files(memoryview(message.payload[0]), memoryview(message.payload[1]))
        return files, dict(unread)

    def chunk_array(self, message: Message, task: messages.Task) -> np.ndarray:
        """A chunk's pixels: sent, or read here from a shared `.npy` file."""
        prefetched, self.prefetched = self.prefetched, None
        if prefetched is not None and prefetched[0] is message:
            return prefetched[1]  # read already, and launched ahead
        if task.place is None:
            return message.array(task.dtype, task.item_shape)
        item_bytes = protocol.check_array_spec(task.dtype, task.item_shape)
        rows = self.arrays.read_rows(task.place, memoryview(message.payload[0]), item_bytes)
        images = np.frombuffer(rows, dtype=task.dtype).reshape(-1, *task.item_shape)
        if len(images) != task.count:
            raise ProtocolError(
                f"the chunk's row ranges hold {len(images)} items, not {task.count}"
            )
        return images

    def run_files(
        self, engine: Engine, files: list[Any], unread: dict[int, str], task: messages.Task
    ) -> tuple[np.ndarray, Failures, int]:
        """Decode a chunk of image files and run the ones that decode: their outputs (NaN
        for the others; the mean over the crops when the model oversamples), the runs
        of files that failed, with their reasons (``unread``: read failures, by index), and
        how many had an EXIF orientation (applied unless the job said not to)."""
        decoder = self.decoders.get(task.digest)
        if decoder is None:
            from farm.engines.images import ImageDecoder

            decoder = self.decoders[task.digest] = ImageDecoder(engine.spec)
        batch = decoder.decode(files, task.exif_rotate)
        outputs = np.full((task.count, *engine.output_shape), np.nan, dtype=np.float32)
        if len(batch.ok):
            computed = engine.run(
                batch.images,
                stop=lambda: self.cancels.stopped(task),
                tally=self.tally_for(task),
                then=self.ahead_of(engine),
            )
            if batch.crops > 1:
                computed = computed.reshape(len(batch.ok), batch.crops, *engine.output_shape).mean(
                    axis=1
                )
            outputs[batch.ok] = computed
            in_chunk(engine.last_run, np.repeat(batch.ok, batch.crops))
        failures = [(index, unread.get(index, reason)) for index, reason in batch.failures]
        return outputs, failure_runs(failures), batch.oriented

    def run_array(
        self, engine: Engine, images: np.ndarray, task: messages.Task
    ) -> tuple[np.ndarray, Failures]:
        """Run a chunk of pixels: the outputs of its finite items (NaN for the others), and
        the runs of float32 items that hold a NaN or an infinite pixel."""
        finite = finite_items(images)
        if finite.all():
            return (
                engine.run(
                    images,
                    stop=lambda: self.cancels.stopped(task),
                    tally=self.tally_for(task),
                    then=self.ahead_of(engine),
                ),
                [],
            )
        outputs = np.full((task.count, *engine.output_shape), np.nan, dtype=np.float32)
        if finite.any():
            outputs[finite] = engine.run(
                images[finite],
                stop=lambda: self.cancels.stopped(task),
                tally=self.tally_for(task),
            )
            in_chunk(engine.last_run, np.flatnonzero(finite))
        bad = np.flatnonzero(~finite).tolist()
        return outputs, failure_runs([(index, NON_FINITE) for index in bad])

    def ahead_of(self, engine: Engine) -> Callable[[], None] | None:
        """What ``engine.run`` calls once a chunk's batches are launched, for an engine that
        ``feeds_ahead``: launch the next chunk's first batches behind them."""
        return (lambda: self.launch_ahead(engine)) if engine.feeds_ahead else None

    def launch_ahead(self, engine: Engine) -> None:
        """Launch the next queued chunk's first batches on ``engine`` while the current
        chunk's last ones compute, when that chunk is ready to run there; its ``run_task``
        goes on from them.  Anything else waits for its turn, and is reported then."""
        found = self.next_array_chunk(engine)
        if found is None:
            return
        message, task, images = found
        try:
            engine.start_ahead(images, stop=lambda: self.cancels.stopped(task))
        except Exception as exc:  # its own run_task tries again, and reports
            log.warning("could not launch chunk %d ahead: %s", task.chunk, exc)
            return
        self.prefetched = (message, images)

    def next_array_chunk(self, engine: Engine) -> tuple[Message, messages.Task, np.ndarray] | None:
        """The next queued message, when it is a chunk of pixels from the connection being
        served, for ``engine``, not cancelled, and read without a problem: with its pixels.
        Its pixels are not checked for NaNs here (``run_array`` does, once): a chunk that
        holds some runs its finite items afresh, and the batches launched ahead are lost."""
        if self.upcoming is None:
            return None
        with self.upcoming.mutex:
            queued = self.upcoming.queue[0] if self.upcoming.queue else None
        if queued is None or queued.message is None or queued.generation != self.serving:
            return None
        task = queued.message.header
        if (
            not isinstance(task, messages.Task)
            or task.dtype == protocol.ENCODED
            or task.item_shape != engine.spec.item_shape
            or task.digest in self.fetches.waiting
            or self.cancels.stopped(task)
            or self.engines.loaded.get(self.engines.key(task)) is not engine
        ):
            return None
        try:
            images = self.chunk_array(queued.message, task)
        except Exception:  # a bad chunk: its run_task reports it
            return None
        return queued.message, task, images

    def tally(self, images: int, seconds: float) -> None:
        """One compute batch done."""
        self.computed_images += images
        self.computed_seconds += seconds

    def tally_for(self, task: messages.Task) -> Callable[[int, float], None]:
        """What ``engine.run`` calls after each batch of ``task``: ``tally``; with a
        ``throttle``, its wait first, counted as compute.  A wait cut short because the
        chunk was cancelled raises ``Stopped`` (its outputs are not wanted)."""
        throttle = self.throttle
        if throttle is None:
            return self.tally

        def stop() -> bool:
            return self.cancels.stopped(task)

        def throttled(images: int, seconds: float) -> None:
            waited = throttle.wait(seconds, stop)
            self.throttled += waited
            self.tally(images, seconds + waited)
            if stop():
                raise Stopped(f"stopped while throttled (--slow {throttle.factor:g})")

        return throttled

    def inject_fault(self, start: int, count: int) -> None:
        """Fail a chunk that touches ``fail_items`` (chaos tests: a poison chunk)."""
        if self.fail_items:
            low, high = self.fail_items
            if start < high and low < start + count:
                raise RuntimeError(f"injected fault on items {low}..{high - 1}")


def failed(
    message: Message,
    error: str,
    fatal: bool = True,
    charge: bool = True,
    unshared: bool = False,
) -> Reply:
    """FAILED for a TASK's chunk: ``fatal`` when no worker could run it (the model is
    unusable), not fatal when another attempt may succeed; ``charge`` False when the
    chunk's items are not to blame (a cancelled job, a fetch that timed out);
    ``unshared`` when this worker cannot read the chunk's shared inputs."""
    task = message.header
    assert isinstance(task, messages.Task)  # only a TASK names a chunk to run
    return protocol.encode(
        Command.FAILED,
        messages.Failed(
            job=task.job,
            chunk=task.chunk,
            start=task.start,
            count=task.count,
            error=error,
            fatal=fatal,
            charge=charge,
            unshared=unshared,
        ),
    )


def finite_items(images: np.ndarray) -> np.ndarray:
    """Which items of a chunk hold finite pixels only (uint8 ones always do): one pass."""
    if images.dtype.kind != "f":
        return np.ones(len(images), dtype=bool)
    return np.isfinite(images.reshape(len(images), -1)).all(axis=1)


def failure_runs(failures: list[tuple[int, str]]) -> Failures:
    """Per-item failures ``(index, reason)``, in index order, as runs ``(offset, count,
    reason)`` of consecutive items with the same reason (reasons cut to ``MAX_REASON``)."""
    runs: Failures = []
    for index, reason in failures:
        reason = reason[:MAX_REASON]
        if runs and runs[-1][0] + runs[-1][1] == index and runs[-1][2] == reason:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, reason)
        else:
            runs.append((index, 1, reason))
    return runs
