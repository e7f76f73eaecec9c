"""The client: submit images, feed the broker their input chunk by chunk, gather outputs.

    >>> import farm
    >>> scores = farm.Client("tcp://127.0.0.1:5555").map(images, model="lenet")

The broker asks for each chunk's items when it assigns the chunk (NEED), so the
client reads its input (an array, or a `.npy` file of any size through
``NpyReader``) one chunk at a time and writes outputs as they come: memory is
bounded by the chunks in flight, not by the size of the job.

If the broker goes silent for ``liveness`` heartbeats, or restarts and no
longer knows the job, the client opens a fresh socket and submits again only
the items it has not got back (the ZeroMQ guide's Lazy Pirate idea); outputs
already written stay written.  Every item comes back once, or is reported in
``JobResult.failed`` with the reason.

``cancel()`` (safe from another thread or a signal handler) stops the job: the
broker drops its queued chunks and says what finished; the images that did not
come back are listed in ``JobResult.failed`` as cancelled.  A job may also
have a ``job_timeout``, a ``priority`` among the jobs sharing the farm, and a
policy of its own (``algo``, ``params``).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np
import zmq

from farm import protocol
from farm.npy import NpyReader, NpyWriter
from farm.protocol import Command, ProtocolError
from farm.summary import JobSummary
from farm.trace import TraceRecorder

log = logging.getLogger("farm.client")

DEFAULT_BROKER = "tcp://127.0.0.1:5555"

#: Commands a client accepts from the broker.
ACCEPTED = frozenset({Command.NEED, Command.RESULT, Command.FAILED, Command.DONE, Command.ERROR,
                      Command.INFO, Command.HEARTBEAT, Command.CANCEL})


class FarmError(RuntimeError):
    """The broker refused or failed a job; the message says why."""


class FarmTimeout(FarmError):
    """Nothing came back from the broker within the timeout."""


class ImageSource:
    """A job's input, read a range at a time: an array, or a `.npy` file via ``NpyReader``."""

    def __init__(self, images: np.ndarray | NpyReader) -> None:
        self.images = images
        shape = images.shape
        if len(shape) not in (3, 4):
            raise FarmError(f"images must be N x C x H x W or N x H x W, got shape {shape}")
        self.dtype = np.dtype(images.dtype)
        self.item_shape = tuple(shape[1:]) if len(shape) == 4 else (1, *shape[1:])

    def __len__(self) -> int:
        return len(self.images)

    def read(self, start: int, count: int) -> np.ndarray:
        if isinstance(self.images, NpyReader):
            block = self.images.read(start, count)
        else:
            block = np.ascontiguousarray(self.images[start:start + count])
        return block.reshape(count, *self.item_shape)


class ResultSink(Protocol):
    """Where outputs go: ``write`` them by item index, ``fill`` failed items."""

    def write(self, start: int, values: np.ndarray) -> None: ...

    def fill(self, start: int, count: int, value: float) -> None: ...


@dataclass
class ArraySink:
    """Outputs kept in memory (``array`` is made with the first result unless given)."""

    total: int
    array: np.ndarray | None = None

    def write(self, start: int, values: np.ndarray) -> None:
        if self.array is None:
            self.array = np.empty((self.total, *values.shape[1:]), dtype=values.dtype)
        if values.shape[1:] != self.array.shape[1:]:
            raise FarmError(f"outputs of shape {values.shape[1:]} for items {start}+"
                            f"{len(values)} do not match earlier ones {self.array.shape[1:]}")
        self.array[start:start + len(values)] = values

    def fill(self, start: int, count: int, value: float) -> None:
        if self.array is not None:
            self.array[start:start + count] = value


@dataclass(frozen=True)
class FailedItems:
    """Items ``[start, start + count)`` that did not come back, and why."""

    start: int
    count: int
    error: str


@dataclass
class Submission:
    """One submission of a job: which of the job's items it holds, in order.

    The first submission holds them all; after a broker restart a new one holds
    only the items still missing, numbered from 0 in the broker's eyes.
    ``runs`` are ``(job_start, item_start, count)``: the submission's items
    ``job_start..`` are the original items ``item_start..``.
    """

    job: str
    runs: list[tuple[int, int, int]]

    @property
    def total(self) -> int:
        return sum(count for _, _, count in self.runs)

    def pieces(self, start: int, count: int) -> list[tuple[int, int, int]]:
        """``(offset in the range, original item start, count)`` for a range of this job."""
        pieces, stop = [], start + count
        for job_start, item_start, run_count in self.runs:
            low, high = max(start, job_start), min(stop, job_start + run_count)
            if low < high:
                pieces.append((low - start, item_start + low - job_start, high - low))
        return pieces


@dataclass
class Progress:
    """Which items came back (or failed): what a re-submission must still ask for."""

    total: int
    answered: np.ndarray = field(init=False)
    failed: list[FailedItems] = field(default_factory=list)
    duplicates: int = 0  # results for items already answered: ignored

    def __post_init__(self) -> None:
        self.answered = np.zeros(self.total, dtype=bool)

    @property
    def complete(self) -> bool:
        return bool(self.answered.all())

    def mark(self, start: int, count: int) -> bool:
        """Record items as answered; False (and counted) if any was answered before."""
        if self.answered[start:start + count].any():
            self.duplicates += 1
            return False
        self.answered[start:start + count] = True
        return True

    def missing_runs(self) -> list[tuple[int, int]]:
        """``(start, count)`` of each run of unanswered items."""
        edges = np.flatnonzero(np.diff(np.concatenate(([0], ~self.answered, [0])).astype(np.int8)))
        return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]


@dataclass
class JobResult:
    outputs: np.ndarray | None  # None when the outputs went to a file sink
    summary: JobSummary
    failed: list[FailedItems] = field(default_factory=list)
    resubmissions: int = 0  # times the job was submitted again after losing the broker
    duplicates: int = 0  # duplicate results received (and ignored)
    cancelled: str | None = None  # why the job stopped early (cancel, timeout), if it did
    trace: dict[str, Any] | None = None  # per-chunk timings (``run(trace=True)``)


@dataclass(frozen=True)
class SubmitOptions:
    """Per-job choices sent with SUBMIT: see ``Client.run``."""

    priority: int = 0
    job_timeout: float | None = None
    algo: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    engine: tuple[str, str] | None = None  # (backend, precision) instead of the workers' own

    def header(self, remaining: float | None) -> dict[str, Any]:
        """SUBMIT's options; ``remaining``: what is left of the job's timeout (a
        re-submission must not restart it)."""
        options: dict[str, Any] = {"client": f"{socket.gethostname()}:{os.getpid()}",
                                   "priority": self.priority}
        if remaining is not None:
            options["timeout"] = remaining
        if self.algo is not None:
            options["algo"] = self.algo
            options["params"] = {k: list(v) if isinstance(v, tuple) else v
                                 for k, v in self.params.items()}
        if self.engine is not None:
            options["engine"] = list(self.engine)
        return options


@dataclass
class JobRun:
    """One ``Client.run`` in progress: what it reads and writes, and where it stands."""

    model: str
    source: ImageSource
    sink: ResultSink
    state: Progress
    options: SubmitOptions
    progress: ProgressCallback | None
    submission: Submission | None = None  # the current one; None once the job ended
    first_id: str = ""  # the first submission's job id (the broker's id for the job)
    trace: TraceRecorder | None = None
    resubmissions: int = 0
    summary: dict[str, Any] | None = None
    cancelled: str | None = None  # the broker's reason, once the job stopped early
    cancel_sent: float | None = None  # when CANCEL went out
    deadline: float | None = None  # monotonic time the job's timeout ends

    def remaining(self) -> float | None:
        """Seconds left of the job's timeout (None: it has none)."""
        return None if self.deadline is None else self.deadline - time.monotonic()


ProgressCallback = Callable[[int], None]


class Client:
    """A connection to a broker; one job at a time per client.

    ``timeout``: seconds of broker silence after which the job is given up
    (FarmTimeout).  ``heartbeat`` and ``liveness``: the client heartbeats its
    job every ``heartbeat`` seconds, and submits again on a fresh socket when
    the broker has been silent for ``liveness`` of its heartbeat intervals.
    """

    def __init__(self, broker: str = DEFAULT_BROKER, timeout: float | None = 60.0,
                 context: zmq.Context | None = None, heartbeat: float = 1.0,
                 liveness: int = 5, curve: str | None = None,
                 curve_name: str = "client") -> None:
        self.broker = broker
        self.timeout = timeout
        self.heartbeat = heartbeat
        self.liveness = liveness
        self.curve, self.curve_name = curve, curve_name
        self.broker_heartbeat = heartbeat
        self.handshakes = None
        self._own_context = context is None
        self.context = context or zmq.Context()
        self._cancel_requested = False
        self._wake_read, self._wake_write = os.pipe()  # cancel() wakes the poll through it
        os.set_blocking(self._wake_write, False)
        try:
            self.socket = self._connect()
        except BaseException:
            self._close_pipe()
            raise

    def _connect(self) -> zmq.Socket:
        sock = self.context.socket(zmq.DEALER)
        protocol.limit_socket(sock)
        self.poller = zmq.Poller()  # made once per socket: polled for every message
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self._wake_read, zmq.POLLIN)
        if self.curve:
            from farm.keys import Handshakes, make_client

            make_client(sock, self.curve, self.curve_name)
            self.handshakes = Handshakes(sock, self.curve_name)
            self.poller.register(self.handshakes.monitor, zmq.POLLIN)
        sock.connect(self.broker)
        return sock

    def _close_socket(self) -> None:
        if self.handshakes is not None:
            self.handshakes.close()
        self.socket.close(linger=0)

    def reconnect(self) -> None:
        """A fresh socket: nothing queued for the old broker connection is sent or read."""
        self._close_socket()
        self.socket = self._connect()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the socket (and the context, if the client made it); a second call is a
        no-op."""
        if self._wake_read < 0:
            return
        self._close_socket()
        self._close_pipe()
        if self._own_context:
            self.context.term()

    def _close_pipe(self) -> None:
        read, write = self._wake_read, self._wake_write
        self._wake_read = self._wake_write = -1
        os.close(read)
        os.close(write)

    @property
    def cancel_requested(self) -> bool:
        """Whether ``cancel`` was called for the current (or next) ``run``."""
        return self._cancel_requested

    def cancel(self) -> None:
        """Cancel the job ``run`` is running, or is about to run (from another thread or a
        signal handler): the broker drops its queued chunks, and ``run`` returns what came
        back.  A no-op on a closed client."""
        write = self._wake_write
        if write < 0:
            return
        self._cancel_requested = True
        try:
            os.write(write, b"!")
        except (BlockingIOError, OSError):  # full of earlier wake-ups, or closed meanwhile
            pass

    def map(self, images: np.ndarray, model: str, **options: Any) -> np.ndarray:
        """Outputs for every image, in input order; FarmError if any image failed."""
        result = self.run(images, model, **options)
        if result.failed:
            raise FarmError(describe_failures(result.failed))
        return result.outputs

    def run(self, images: np.ndarray | NpyReader, model: str,
            out: np.ndarray | ResultSink | None = None,
            progress: ProgressCallback | None = None, *, priority: int = 0,
            job_timeout: float | None = None, algo: str | None = None,
            params: dict[str, Any] | None = None, trace: bool = False,
            backend: str | None = None, precision: str | None = None) -> JobResult:
        """Submit a job and gather its outputs (into ``out``, an array or a sink such as
        ``NpyWriter``) and a summary; failed items are NaN in the outputs and listed.

        ``priority``: jobs of higher priority get free workers first (default 0);
        ``job_timeout``: seconds after which the broker cancels the job; ``algo`` and
        ``params``: a policy for this job instead of the broker's; ``trace``: record
        every chunk's timings in ``JobResult.trace`` (see ``farm.trace``); ``backend``
        and ``precision``: the engine the workers run this job on, instead of their own
        (``auto`` and ``f32`` where only one is given).
        """
        source = ImageSource(images)
        if len(source) == 0:
            raise FarmError("no images to run")
        if params and algo is None:
            raise FarmError("policy params need algo (the job's own policy)")
        sink = out if out is not None and not isinstance(out, np.ndarray) \
            else ArraySink(len(source), out)
        engine = None if backend is None and precision is None else \
            (backend or "auto", precision or "f32")
        job = JobRun(model, source, sink, Progress(len(source)),
                     SubmitOptions(priority, job_timeout, algo, dict(params or {}), engine),
                     progress,
                     trace=TraceRecorder() if trace else None,
                     deadline=None if job_timeout is None else time.monotonic() + job_timeout)
        started = time.perf_counter()
        try:
            self._submit(job, [(0, len(source))])
            self._collect(job)
        finally:
            self._cancel_requested = False  # the next run starts afresh
        if job.cancelled:
            for start, count in job.state.missing_runs():
                job.state.failed.append(FailedItems(start, count, job.cancelled))
        for failure in job.state.failed:
            sink.fill(failure.start, failure.count, np.nan)
        elapsed = time.perf_counter() - started
        summary = job.summary or {  # the broker's last word was lost with it
            "items": len(source), "done": int(job.state.answered.sum()),
            "broker_seconds": elapsed, "workers": []}
        recorded = job.trace.document(job.first_id, model, len(source), job.summary,
                                      job.state.failed, job.cancelled) if job.trace else None
        return JobResult(sink.array if isinstance(sink, ArraySink) else None,
                         JobSummary.from_broker(summary, elapsed), job.state.failed,
                         job.resubmissions, job.state.duplicates, job.cancelled, recorded)

    def _submit(self, job: JobRun, missing: list[tuple[int, int]]) -> None:
        runs, job_start = [], 0
        for start, count in missing:
            runs.append((job_start, start, count))
            job_start += count
        job.submission = Submission(uuid.uuid4().hex, runs)
        job.first_id = job.first_id or job.submission.job
        if job.trace:
            job.trace.new_submission()
        self._send(Command.SUBMIT, {"job": job.submission.job, "model": job.model,
                                    "dtype": str(job.source.dtype),
                                    "item_shape": list(job.source.item_shape),
                                    "total": job.submission.total,
                                    "options": job.options.header(
                                        job.remaining() if job.resubmissions
                                        else job.options.job_timeout),
                                    "heartbeat": self.heartbeat})

    def _collect(self, job: JobRun) -> None:
        """Serve the broker's NEEDs and take results until the job ends; re-submit if the
        broker is lost; send CANCEL when ``cancel`` was called."""
        last_heard = next_beat = waited_since = time.monotonic()
        while job.submission is not None:
            now = time.monotonic()
            if self._cancel_requested and job.cancel_sent is None:
                self._send(Command.CANCEL, {"job": job.submission.job})
                job.cancel_sent = now
            if now >= next_beat:
                self._send(Command.HEARTBEAT, {"job": job.submission.job})
                next_beat = now + self.heartbeat
            message = self._poll(max(0.0, min(next_beat, waited_since + self.expiry,
                                              last_heard + (self.timeout or 1e9)) - now))
            now = time.monotonic()
            if message is None:
                silent = now - last_heard  # the timeout counts from the broker's last word
                if job.cancel_sent is not None and now - job.cancel_sent > self.expiry:
                    job.cancelled = "cancelled (the broker did not confirm)"
                    return
                if self.timeout is not None and silent > self.timeout:
                    raise FarmTimeout(f"no reply from broker {self.broker} in {self.timeout} s; "
                                      f"{int(job.state.answered.sum())} of {job.state.total} "
                                      f"images came back")
                if now - waited_since > self.expiry and job.cancel_sent is None:
                    log.warning("broker %s silent for %.1f s: submitting the %d missing images "
                                "again", self.broker, silent,
                                job.state.total - job.state.answered.sum())
                    self._resubmit(job)
                    waited_since = now  # give the new submission a full expiry
                continue
            waited_since = last_heard = now
            if message.command is Command.HEARTBEAT:
                self._note_interval(message.header.get("interval"))
            elif message.command is Command.ERROR and "job" not in message.header:
                raise FarmError(f"the broker refused a request: {message.header['error']}")
            elif message.header.get("job") == job.submission.job:
                self._handle(job, message)

    def _handle(self, job: JobRun, message: protocol.Message) -> None:
        """One message about the job's current submission."""
        header = message.header
        if message.command is Command.NEED:
            self._send_input(job.source, job.submission, header)
        elif message.command is Command.RESULT:
            self._take_result(message, job)
        elif message.command is Command.FAILED:
            self._take_failure(header, job.submission, job.state, job.progress)
        elif message.command is Command.DONE:
            job.summary, job.submission = message.document(), None
        elif message.command is Command.CANCEL:
            job.cancelled = str(header.get("reason", "cancelled"))
            job.summary = message.document() or None
            job.submission = None
        elif header.get("unknown_job") and job.cancel_sent is not None:
            job.cancelled, job.submission = "cancelled", None  # nothing left to cancel
        elif header.get("unknown_job"):  # a restarted broker: ask again for what is missing
            log.warning("broker %s lost the job (restarted?): submitting the missing images "
                        "again", self.broker)
            self._resubmit(job)
        else:
            raise FarmError(header["error"])

    def _resubmit(self, job: JobRun) -> None:
        """A new submission of the missing items on a fresh socket (none if none is
        missing: the broker was lost after the last result)."""
        self.reconnect()
        job.resubmissions += 1
        missing = job.state.missing_runs()
        job.submission = None
        remaining = job.remaining()
        if missing and remaining is not None and remaining <= 0:
            job.cancelled = f"the job's timeout of {job.options.job_timeout:g} s passed"
        elif missing:
            self._submit(job, missing)

    @property
    def expiry(self) -> float:
        return self.liveness * max(self.heartbeat, self.broker_heartbeat)

    def _note_interval(self, interval: Any) -> None:
        if isinstance(interval, (int, float)) and 0 < interval <= 60:
            self.broker_heartbeat = float(interval)

    def _send_input(self, source: ImageSource, submission: Submission,
                    header: dict[str, Any]) -> None:
        """DATA for a NEED: the chunk's items, read from the source now."""
        start, count = header["start"], header["count"]
        pieces = submission.pieces(start, count)
        if sum(n for _, _, n in pieces) != count:
            raise FarmError(f"the broker asked for items {start}+{count} of a job of "
                            f"{submission.total}")
        blocks = [source.read(item_start, n) for _, item_start, n in pieces]
        block = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
        self._send(Command.DATA, {"job": submission.job, "chunk": header["chunk"],
                                  "start": start, "count": count},
                   protocol.array_frames(block))

    @staticmethod
    def _take_result(message: protocol.Message, job: JobRun) -> None:
        header = message.header
        values = message.array(header["dtype"], header["item_shape"])
        if len(values) != header["count"]:
            raise FarmError(f"result for {header['count']} items holds {len(values)}")
        pieces = job.submission.pieces(header["start"], header["count"])
        for offset, item_start, count in pieces:
            if job.state.mark(item_start, count):
                job.sink.write(item_start, values[offset:offset + count])
                if job.progress:
                    job.progress(count)
        if job.trace and pieces:
            job.trace.add(header, pieces[0][1], header["count"])

    @staticmethod
    def _take_failure(header: dict[str, Any], submission: Submission, state: Progress,
                      progress: ProgressCallback | None) -> None:
        for _, item_start, count in submission.pieces(header["start"], header["count"]):
            if state.mark(item_start, count):
                state.failed.append(FailedItems(item_start, count, header["error"]))
                if progress:
                    progress(count)

    def _send(self, command: Command, header: dict[str, Any], payload: list[Any] = ()) -> None:
        """Send without blocking: with no broker to take it, the message is dropped (the
        silence that follows leads to a re-submission or a timeout)."""
        try:
            self.socket.send_multipart(protocol.encode(command, header, payload), copy=False,
                                       flags=zmq.NOBLOCK)
        except zmq.Again:
            log.debug("no connection to the broker: %s dropped", command.name)

    def _poll(self, seconds: float | None) -> protocol.Message | None:
        """The next well-formed message within ``seconds`` (None: no limit), else None;
        None at once when ``cancel`` wakes it.

        FarmError at once if the broker refused this client's CURVE key.
        """
        deadline = None if seconds is None else time.monotonic() + seconds
        while True:
            wait = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            ready = dict(self.poller.poll(wait))
            if self.handshakes is not None and (refused := self.handshakes.failure()):
                raise FarmError(refused)
            if self._wake_read in ready:
                os.read(self._wake_read, 4096)
                return None  # cancel() was called: the caller acts on it
            if self.socket not in ready:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            frames = self.socket.recv_multipart(copy=False)
            try:
                return protocol.decode(frames, allowed=ACCEPTED)
            except ProtocolError as exc:
                log.warning("dropped a malformed message from the broker: %s", exc)

    def _receive(self) -> protocol.Message:
        """The next well-formed message from the broker; FarmTimeout if none comes in time."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            message = self._poll(None if deadline is None else deadline - time.monotonic())
            if message is not None:
                return message
            if deadline is not None and time.monotonic() >= deadline:
                raise FarmTimeout(f"no reply from broker {self.broker} in {self.timeout} s")

    def info(self, wait_workers: int = 0) -> dict[str, Any]:
        """The broker's registry; with ``wait_workers``, once that many workers have joined."""
        self._send(Command.INFO, {"wait_workers": wait_workers})
        while True:
            message = self._receive()
            if message.command is Command.INFO:
                return message.document()
            if message.command is Command.ERROR and "job" not in message.header:
                raise FarmError(message.header["error"])


def describe_failures(failed: list[FailedItems]) -> str:
    """One line per failed range, for errors and the CLI."""
    count = sum(f.count for f in failed)
    lines = [f"{count} images failed:"]
    lines += [f"  items {f.start}..{f.start + f.count - 1}: {f.error}" for f in failed[:20]]
    if len(failed) > 20:
        lines.append(f"  ... and {len(failed) - 20} more ranges")
    return "\n".join(lines)


__all__ = ["ArraySink", "Client", "FailedItems", "FarmError", "FarmTimeout", "JobResult",
           "NpyReader", "NpyWriter"]
