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

``run(..., out="out.npy")`` writes the outputs to ``out.npy.partial`` with a
journal beside it, renamed to ``out.npy`` when the job ends, guarded as ``farm
submit --out`` guards it (``farm.client.outputs``): after the client was killed,
``run(..., out="out.npy", resume=True)`` asks only for the items not safely
written.  If writing an output fails (a full disk, EIO, a read-only file
system), the client cancels its job and raises ``OutputError``; what was
journaled stays valid for a resume.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

from farm.client.answers import AnswerSink, ModelCard
from farm.client.errors import (
    FarmError,
    FarmTimeout,
    NoWorker,
    OutputError,
    OutputRefused,
    ResumeRefused,
)
from farm.client.inputs import (
    ArraySource,
    FileSource,
    InputError,
    Source,
    open_input,
    stacked,
    stored_inputs,
    unshareable,
)
from farm.client.journal import (
    Journaled,
    JournalHeader,
    record_submission,
    recorded_submissions,
    submissions_path,
)
from farm.client.npy import NpyError, NpyReader, NpyWriter
from farm.client.outputs import (
    ArraySink,
    Output,
    OutputSpec,
    ResultSink,
    open_outputs,
    output_of,
)
from farm.client.trace import Trace, TraceRecorder
from farm.runtime import choose_broker
from farm.summary import FailedItems, JobSummary, plural
from farm.wire import messages, protocol
from farm.wire.engines import AUTO, EngineChoice
from farm.wire.link import BrokerLink, BrokerRefused, LinkConfig, parse_endpoint, recv_frames
from farm.wire.protocol import Command, ProtocolError

log = logging.getLogger("farm.client.client")

#: Seconds a job waits for a broker that never answered before it is given up (at most the
#: client's timeout): a wrong address or a broker not started should not cost a minute.
FIRST_CONTACT_TIMEOUT = 8.0
#: Seconds with no worker connected before the client says so, and between repeats.
NO_WORKER_NOTICE, NO_WORKER_REPEAT = 3.0, 30.0
#: Earlier submissions of a job a resubmission names (the most recent ones).
MAX_EARLIER = 100

#: Commands a client accepts from the broker.
ACCEPTED = frozenset(
    {
        Command.NEED,
        Command.RESULT,
        Command.FAILED,
        Command.DONE,
        Command.ERROR,
        Command.INFO,
        Command.HEARTBEAT,
        Command.CANCEL,
    }
)


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
    kept: int = 0  # items answered by results workers kept across a lost broker

    def __post_init__(self) -> None:
        self.answered = np.zeros(self.total, dtype=bool)

    @property
    def complete(self) -> bool:
        return bool(self.answered.all())

    def take(self, start: int, count: int, kept: bool = False) -> list[tuple[int, int]]:
        """Record items ``start..start + count`` as answered: the runs ``(first, stop)`` of
        those not answered before (what to write).  A range answered before is counted as
        a duplicate, unless ``kept``: a worker offers again what it sent a lost broker,
        delivered or not, cut into other chunks than a resubmission's."""
        seen = self.answered[start : start + count]
        if not seen.any():
            runs = [(start, start + count)]
        elif seen.all():
            self.duplicates += not kept
            return []
        else:
            edges = np.flatnonzero(np.diff(np.concatenate(([0], ~seen, [0])).astype(np.int8)))
            runs = [(start + int(a), start + int(b)) for a, b in zip(edges[::2], edges[1::2])]
        taken = sum(stop - first for first, stop in runs)
        seen[:] = True
        self.kept += taken if kept else 0
        return runs

    def missing_runs(self) -> list[tuple[int, int]]:
        """``(start, count)`` of each run of unanswered items."""
        edges = np.flatnonzero(np.diff(np.concatenate(([0], ~self.answered, [0])).astype(np.int8)))
        return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]


@dataclass
class JobResult:
    """What ``Client.run`` got back, and how the job went."""

    outputs: np.ndarray | None  # in memory, or mapped from a `.npy` written; else None
    summary: JobSummary
    failed: list[FailedItems] = field(default_factory=list)
    resubmissions: int = 0  # times the job was submitted again after losing the broker
    duplicates: int = 0  # duplicate results received (and ignored)
    cancelled: str | None = None  # why the job stopped early (cancel, timeout), if it did
    trace: Trace | None = None  # per-chunk timings (``run(trace=True)``)
    resumed: int = 0  # items taken from the journal (``run(resume=...)``), not submitted
    input_bytes: int = 0  # bytes of input the client sent (DATA payloads): files or pixels
    shared: bool = False  # the workers read the items from shared storage
    kept: int = 0  # items whose results workers kept across a lost broker, not recomputed
    oriented: int = 0  # image files with an EXIF orientation: turned upright if exif_rotate
    rerun: int = 0  # a cascade's images whose fast answer was in doubt, run again in f32
    exif_rotate: bool = True
    written: bool = False  # the output file was written (complete, or with NaN rows)
    held: bool = False  # ``cancel(hold=True)`` left it unfinished, for a resume


@dataclass(frozen=True)
class SubmitOptions:
    """Per-job choices sent with SUBMIT (``Client.run``'s keywords of the same names).

    ``priority``: jobs of higher priority get free workers first; ``job_timeout``: seconds
    after which the broker cancels the job; ``algo`` and ``params``: a policy for this
    job instead of the broker's; ``engine``: the engine the workers run it on
    (``Client.run``'s ``backend`` and ``precision``); ``exif_rotate``: image files turned
    upright by their EXIF orientation, as viewers show them (False: the pixels as
    stored; ``JobResult.oriented`` counts the files that have one).
    """

    priority: int = 0
    job_timeout: float | None = None
    algo: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    engine: EngineChoice | None = None  # instead of the workers' own
    exif_rotate: bool = True  # image files turned upright by their EXIF orientation
    verify: float | None = None  # part of the images spot-checked on another device

    def header(self, remaining: float | None) -> messages.Options:
        """SUBMIT's options; ``remaining``: what is left of the job's timeout (a
        re-submission must not restart it)."""
        return messages.Options(
            client=f"{socket.gethostname()}:{os.getpid()}",
            priority=self.priority,
            timeout=remaining,
            algo=self.algo,
            params=dict(self.params) if self.algo is not None else {},
            engine=self.engine,
            exif_rotate=self.exif_rotate,
            verify=self.verify,
        )


@dataclass
class JobRun:
    """One ``Client.run`` in progress: what it reads and writes, and where it stands.

    ``progress``: called with each count of items back (first with those resumed);
    ``trace``: every chunk's timings, for ``JobResult.trace`` (``farm.client.trace``);
    ``shared``: the workers read the items from storage they share with this client
    (image files, or a `.npy` of uint8 or float32: ``farm.wire.storage``), ``path_map``
    giving ``(client prefix, worker prefix)`` pairs where they mount it elsewhere (an
    input that cannot be shared is sent, with a notice); ``notice``: a line for the user
    while the job waits (no worker connected).
    """

    model: str
    source: Source
    sink: ResultSink
    state: Progress
    options: SubmitOptions
    progress: ProgressCallback | None
    submission: Submission | None = None  # the current one; None once the job ended
    first_id: str = ""  # the first submission's job id (the broker's id for the job)
    trace: TraceRecorder | None = None
    resubmissions: int = 0
    summary: JobSummary | None = None
    cancelled: str | None = None  # the broker's reason, once the job stopped early
    cancel_sent: float | None = None  # when CANCEL went out
    deadline: float | None = None  # monotonic time the job's timeout ends
    output_error: OSError | None = None  # writing an output failed: the job is cancelled
    input_error: Exception | None = None  # reading the input failed: the job is cancelled
    input_bytes: int = 0  # DATA payload bytes sent, and shared inputs' places
    shared: bool = False  # the workers read the items themselves (``farm.wire.storage``)
    path_map: tuple[tuple[str, str], ...] = ()  # client prefix -> worker prefix
    oriented: int = 0  # image files the workers found an EXIF orientation in
    rerun: int = 0  # a cascade's images run again in f32 (``farm.engines.cascade``)
    # earlier submissions of the job, lost with a broker (or with a killed client, when
    # resumed): results kept for them still count
    earlier: dict[str, Submission] = field(default_factory=dict)
    journal: Path | None = None  # a journaled job's journal: its submissions noted beside
    notice: Callable[[str], None] = log.warning  # what the user should hear while it waits
    started: float = field(default_factory=time.monotonic)
    no_workers_since: float | None = None  # since when the broker has reported no worker
    next_notice: float = 0.0  # when a notice about the wait may be repeated

    def remaining(self) -> float | None:
        """Seconds left of the job's timeout (None: it has none)."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def resume_journal(self) -> int:
        """Take the items a journaled sink resumed as answered (told to ``progress``) and
        name the killed client's submissions, whose kept results still count; how many."""
        sink = self.sink
        if not isinstance(sink, Journaled):
            return 0
        self.state.answered |= sink.resumed_items()
        resumed = int(self.state.answered.sum())
        if resumed and self.progress:
            self.progress(resumed)
        self.journal = sink.journal
        if sink.journal.exists():
            for earlier, runs in recorded_submissions(sink.journal).items():
                self.earlier[earlier] = Submission(earlier, runs)
        else:
            submissions_path(sink.journal).unlink(missing_ok=True)
        return resumed

    def record_failure(self, start: int, count: int, error: str) -> None:
        """Items that did not come back, and why (the client's own reason for a file it could
        not send wins over the worker's)."""
        problems = self.source.problems if isinstance(self.source, FileSource) else {}
        own = [
            (index, 1, problems[index])
            for index in sorted(problems)
            if start <= index < start + count
        ]
        for low, high, reason in split_failures(start, count, own):
            self.state.failed.append(FailedItems(low, high - low, reason or error))
            if isinstance(self.sink, AnswerSink):
                self.sink.fail(low, high - low, reason or error)

    def raise_stopped(self) -> None:
        """OutputError if writing an output stopped the job; the input's error if reading
        it did (the rows written kept for a resume)."""
        if self.output_error is not None:
            raise self.output_failure(self.output_error)
        if self.input_error is not None:
            if isinstance(self.sink, Journaled):
                self.sink.sync()
            raise self.input_error

    def fail_missing(self) -> None:
        """Report the items still missing as failed: those a stopped job did not get (not
        journaled: a resume retries them), or those the broker's early end left."""
        if self.cancelled:
            if isinstance(self.sink, Journaled):
                self.sink.stop_journal()
            reason = self.cancelled
        elif not self.state.complete:  # never silently short: the broker said done too early
            log.error("the job ended with items missing: reported as failed")
            reason = "did not come back before the job ended"
        else:
            return
        for start, count in self.state.missing_runs():
            self.record_failure(start, count, reason)

    def finish_outputs(self) -> None:
        """Fill the failed items (NaN), in input order, and finish a journaled sink;
        OutputError if writing fails."""
        failed, sink = self.state.failed, self.sink
        failed.sort(key=lambda failure: failure.start)  # in input order, not as they arrived
        try:
            for failure in failed:
                sink.fill(failure.start, failure.count, np.nan)
            if isinstance(sink, Journaled):
                sink.finish(complete=self.state.complete and not failed)
                if not sink.journal.exists():
                    submissions_path(sink.journal).unlink(missing_ok=True)
        except OSError as exc:
            raise self.output_failure(exc) from exc

    def output_failure(self, error: OSError) -> OutputError:
        """The OutputError of a job whose outputs could not be written."""
        sink, cancelled = self.sink, self.output_error is not None
        if isinstance(sink, Journaled):
            try:
                sink.sync()  # best effort: the journal's lines are checked on resume anyway
            except OSError:
                pass
            return OutputError(error, sink.safe, len(self.source), sink.journal, cancelled)
        written = int(self.state.answered.sum()) - sum(f.count for f in self.state.failed)
        return OutputError(error, written, len(self.source), None, cancelled)

    def result(self, elapsed: float, submitted: int, resumed: int) -> JobResult:
        """The job's result, its outputs left to ``JobOutputs.finished``."""
        state = self.state
        summary = self.summary or JobSummary(  # the broker's last word was lost with it
            total=submitted, items=int(state.answered.sum()) - resumed, broker_seconds=elapsed
        )
        trace = None
        if self.trace is not None:
            trace = self.trace.document(
                self.first_id,
                self.model,
                len(self.source),
                self.summary,
                state.failed,
                self.cancelled,
            )
        return JobResult(
            outputs=None,
            summary=msgspec.structs.replace(summary, seconds=elapsed),
            failed=state.failed,
            resubmissions=self.resubmissions,
            duplicates=state.duplicates,
            cancelled=self.cancelled,
            trace=trace,
            resumed=resumed,
            input_bytes=self.input_bytes,
            shared=self.shared,
            kept=state.kept,
            oriented=self.oriented,
            rerun=self.rerun,
            exif_rotate=self.options.exif_rotate,
        )

    def new_submission(
        self, missing: list[tuple[int, int]], heartbeat: float
    ) -> tuple[messages.Submit, list[Any]]:
        """A new submission of the ``missing`` ranges of items: recorded, and its SUBMIT
        (header and payload) returned (``heartbeat``: the client's interval).  It names
        the earlier submissions (lost with a broker), whose kept results still count."""
        runs, job_start = [], 0
        for start, count in missing:
            runs.append((job_start, start, count))
            job_start += count
        while len(self.earlier) > MAX_EARLIER:
            del self.earlier[next(iter(self.earlier))]
        self.submission = Submission(uuid.uuid4().hex, runs)
        if self.journal is not None:
            record_submission(self.journal, self.submission.job, runs)
        payload = []
        if self.shared or self.earlier:
            document = messages.SubmitDocument(
                inputs=stored_inputs(self.source, runs, self.path_map) if self.shared else None,
                runs=runs if self.earlier else [],
                earlier={job: list(earlier.runs) for job, earlier in self.earlier.items()},
            )
            payload = protocol.document_frames(document)
            self.input_bytes += len(payload[0])
        self.first_id = self.first_id or self.submission.job
        if self.trace:
            self.trace.new_submission()
        timeout = self.remaining() if self.earlier else self.options.job_timeout
        submit = messages.Submit(
            job=self.submission.job,
            model=self.model,
            dtype=self.source.dtype,
            item_shape=self.source.item_shape,
            total=self.submission.total,
            options=self.options.header(timeout),
            heartbeat=heartbeat,
        )
        return submit, payload


@dataclass
class Running:
    """The job ``Client.run`` is running, if any, and what the client's link says for it: on
    a fresh connection, a SUBMIT of what is still missing; every interval, a heartbeat.
    (The link holds this, not the client: no reference cycle keeps a client unclosed.)"""

    heartbeat: float  # the client's heartbeat interval, sent with every SUBMIT
    job: JobRun | None = None
    # the link calling it, once made (has the broker spoken?): weak, since the link holds
    # this; a cycle would leave a dropped client's socket open until a collection, and its
    # context's term() waiting on that socket
    link: weakref.ref[BrokerLink] | None = None

    def resubmission(self, lost: bool = True) -> tuple[messages.Submit, list[Any]] | None:
        """The SUBMIT of the items the job still misses (None: no job running, or none
        missing, or its timeout passed); ``lost``: the broker was (not: it asked for it)."""
        job = self.job
        if job is None or job.submission is None:
            return None
        job.resubmissions += lost
        missing = job.state.missing_runs()
        job.earlier[job.submission.job] = job.submission
        job.submission = None
        remaining = job.remaining()
        if missing and remaining is not None and remaining <= 0:
            job.cancelled = f"the job's timeout of {job.options.job_timeout:g} s passed"
            return None
        if not missing:
            return None  # the broker was lost after the last result
        link = self.link() if self.link is not None else None
        answered = link is not None and link.answered
        log.log(
            logging.WARNING if answered and lost else logging.DEBUG,  # never there: not news
            "submitting the %d missing images again",
            job.state.total - job.state.answered.sum(),
        )
        return job.new_submission(missing, self.heartbeat)

    def heartbeat_header(self) -> messages.Heartbeat | None:
        """The heartbeat of the job's current submission, if there is one."""
        submission = self.job.submission if self.job else None
        return None if submission is None else messages.Heartbeat(job=submission.job)


ProgressCallback = Callable[[int], None]
#: What ``Client.run`` takes as its images.
Input = np.ndarray | NpyReader | Source | Sequence[str | os.PathLike[str]] | Sequence[np.ndarray]


class Client:
    """A connection to a broker; one job at a time per client.

    ``broker``: its endpoint; None finds it as the commands do: ``$FARM_BROKER``, else
    this user's running ``farm up`` farm, else tcp://127.0.0.1:5555 (``broker_choice``
    says which).  ``timeout``: seconds of broker silence after which the job is given up
    (FarmTimeout).  ``heartbeat`` and ``liveness``: the client heartbeats its
    job every ``heartbeat`` seconds, and submits again on a fresh socket when
    the broker has been silent for ``liveness`` of its heartbeat intervals.
    """

    def __init__(
        self,
        broker: str | None = None,
        timeout: float | None = 60.0,
        context: zmq.Context | None = None,
        heartbeat: float = 1.0,
        liveness: int = 5,
        curve: str | None = None,
        curve_name: str = "client",
    ) -> None:
        self.broker_choice = choose_broker(broker)
        if self.broker_choice.found != "named":
            log.info("broker: %s", self.broker_choice.describe())
        try:
            # HOST:PORT is tcp://HOST:PORT
            self.broker = broker = parse_endpoint(self.broker_choice.endpoint)
        except ValueError as exc:
            raise FarmError(str(exc)) from None
        self.timeout = timeout
        self.heartbeat = heartbeat
        self._own_context = context is None
        self.context = context or zmq.Context()
        self._cancel_requested = self._hold_requested = False
        self._running = Running(heartbeat)
        self._wake_read, self._wake_write = os.pipe()  # cancel() wakes the poll through it
        os.set_blocking(self._wake_write, False)
        try:
            # no back-off: each new submission waits one expiry, as the first did
            self.link = BrokerLink(
                self.context,
                LinkConfig(broker, heartbeat, liveness, curve, curve_name, max_retry=0.0),
                self._running.resubmission,
                self._running.heartbeat_header,
            )
        except BaseException:
            self._close_pipe()
            raise
        self._running.link = weakref.ref(self.link)
        self.link.poller.register(self._wake_read, zmq.POLLIN)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the socket (and the context, if the client made it); a second call is a
        no-op."""
        if self._wake_read < 0:
            return
        self.link.close()
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

    def cancel(self, hold: bool = False) -> None:
        """Cancel the job ``run`` is running, or is about to run (from another thread or a
        signal handler): the broker drops its queued chunks, and ``run`` returns what came
        back.  ``hold``: leave a journaled output unfinished (``OUT.partial`` and its
        journal), as a killed job does, for a resume to finish.  A no-op on a closed
        client."""
        write = self._wake_write
        if write < 0:
            return
        self._hold_requested = self._hold_requested or hold
        self._cancel_requested = True
        try:
            os.write(write, b"!")
        except (BlockingIOError, OSError):  # full of earlier wake-ups, or closed meanwhile
            pass

    def map(self, images: Input, model: str, **options: Any) -> np.ndarray:
        """Outputs for every image, in input order; FarmError if any image failed.

        ``out="out.npy", resume=True`` (see ``run``) writes them to that file, journaled:
        after a crash, the same call computes only the items missing there, and returns
        the whole output (memory-mapped from the file).
        """
        source = as_source(images)
        result = self.run(source, model, **options)
        if result.failed:
            names = source.names if isinstance(source, FileSource) else None
            raise FarmError(describe_failures(result.failed, names))
        if result.outputs is None:
            raise FarmError("map returns raw outputs: for answers, or a sink of yours, use run")
        return result.outputs

    def run(
        self,
        images: Input,
        model: str,
        out: Output = None,
        progress: ProgressCallback | None = None,
        *,
        priority: int = 0,
        job_timeout: float | None = None,
        algo: str | None = None,
        params: dict[str, Any] | None = None,
        trace: bool = False,
        backend: str | None = None,
        precision: str | None = None,
        resume: bool | str | os.PathLike[str] = False,
        notice: Callable[[str], None] | None = None,
        shared: bool = False,
        path_map: Sequence[tuple[str, str]] = (),
        exif_rotate: bool = True,
        verify: float | None = None,
    ) -> JobResult:
        """Submit a job on ``images`` (``as_source``); its outputs in input order (failed
        items NaN, or answers' rows with the reason) and a summary.

        ``out``: None, memory; a path or an ``OutputSpec``, a file guarded and journaled
        as ``farm submit --out`` writes it, finished after a crash with ``resume=True``
        (``farm.client.outputs``); an array or a sink of the caller's, as given.  The other
        choices: ``SubmitOptions`` (``backend``, ``precision``, ``verify``) and ``JobRun``.
        OutputRefused or ResumeRefused before anything is written; OutputError if writing
        fails (the job cancelled first); FarmTimeout if no broker answers within
        ``FIRST_CONTACT_TIMEOUT`` s (or ``timeout``); NoWorker if no worker is connected
        for ``timeout`` s; FarmError if the broker refuses it.
        """
        source, notice = job_source(images, algo, params), notice or log.warning
        engine = engine_choice(backend, precision)
        options = SubmitOptions(
            priority, job_timeout, algo, dict(params or {}), engine, exif_rotate, verify
        )
        with open_outputs(
            output_of(out, resume),
            source,
            lambda: JournalHeader.of_job(model, source, engine, exif_rotate),
            lambda: self.model_card(model),
            notice,
        ) as outputs:
            job = JobRun(
                model,
                source,
                outputs.sink,
                Progress(len(source)),
                options,
                progress,
                trace=TraceRecorder() if trace else None,
                deadline=None if job_timeout is None else time.monotonic() + job_timeout,
                notice=notice,
                shared=shared and shareable(source, notice),
                path_map=tuple(path_map),
            )
            result = self._run_job(job)
        return replace(result, outputs=outputs.array(), written=outputs.written, held=outputs.held)

    def _run_job(self, job: JobRun) -> JobResult:
        """Submit what the job misses, gather it, and sum up."""
        started = time.perf_counter()
        resumed = job.resume_journal()
        missing = job.state.missing_runs()
        self._running.job = job
        try:
            if missing:
                self._send(*job.new_submission(missing, self.heartbeat))
                self._collect(job)
        finally:
            self._running.job = None
            if self._hold_requested and isinstance(job.sink, Journaled):
                job.sink.hold = True  # interrupted: left as a killed job's, for a resume
            self._cancel_requested = self._hold_requested = False  # the next run: afresh
        job.raise_stopped()
        job.fail_missing()
        job.finish_outputs()
        submitted = sum(count for _, count in missing)
        return job.result(time.perf_counter() - started, submitted, resumed)

    def _collect(self, job: JobRun) -> None:
        """Serve the broker's NEEDs and take results until the job ends; submit the missing
        items again if the broker is lost; send CANCEL when ``cancel`` was called."""
        last_heard = time.monotonic()
        self.link.restart_timers()
        while job.submission is not None:
            if self._cancel_requested and job.cancel_sent is None:
                self._send(messages.Cancel(job=job.submission.job))
                job.cancel_sent = time.monotonic()
            wait = self.link.wait()
            if self.timeout is not None:  # the timeout counts from the broker's last word
                wait = min(wait, max(0.0, last_heard + self.timeout - time.monotonic()))
            message = self._poll(wait)
            if message is not None:
                last_heard = time.monotonic()
                self._take(job, message)
            elif self._gave_up(job, last_heard):
                return
            self._check_workers(job)
            if job.submission is not None and job.cancel_sent is None:
                self.link.tick()  # after an expiry of silence: a fresh socket, a resubmission
            elif job.submission is not None:
                self.link.beat()  # a cancel waits for its answer: no resubmission

    def _gave_up(self, job: JobRun, last_heard: float) -> bool:
        """After a wait with no message: True if a cancel went unconfirmed for an expiry;
        FarmTimeout if the broker was silent for the timeout."""
        now = time.monotonic()
        if job.cancel_sent is not None and now - job.cancel_sent > self.link.expiry:
            job.cancelled = "cancelled (the broker did not confirm)"
            return True
        if (
            not self.link.answered
            and now - job.started > FIRST_CONTACT_TIMEOUT
            and (self.timeout is None or self.timeout > FIRST_CONTACT_TIMEOUT)
        ):
            raise FarmTimeout(
                f"no broker answered at {self.broker} within {FIRST_CONTACT_TIMEOUT:g} s"
            )
        if self.timeout is not None and now - last_heard > self.timeout:
            raise FarmTimeout(
                f"no reply from broker {self.broker} in {self.timeout} s; "
                f"{int(job.state.answered.sum())} of {job.state.total} "
                f"images came back"
            )
        return False

    def _check_workers(self, job: JobRun) -> None:
        """While the broker reports no worker connected: a notice after ``NO_WORKER_NOTICE``
        seconds, repeated every ``NO_WORKER_REPEAT``; NoWorker after the timeout."""
        if job.no_workers_since is None or job.submission is None:
            return
        now = time.monotonic()
        waited = now - max(job.no_workers_since, job.started)
        if self.timeout is not None and waited > self.timeout:
            raise NoWorker(
                f"no worker connected to broker {self.broker} in {self.timeout:g} "
                f"s; {int(job.state.answered.sum()):,} of {job.state.total:,} "
                f"images came back (start workers with: farm worker --broker "
                f"{self.broker} --device cpu:0)"
            )
        if waited >= NO_WORKER_NOTICE and now >= job.next_notice:
            job.notice(
                f"waiting for a worker: none is connected to {self.broker} "
                f"({waited:.0f} s so far; start one with: farm worker --broker "
                f"{self.broker} --device cpu:0)"
            )
            job.next_notice = now + NO_WORKER_REPEAT

    def _take(self, job: JobRun, message: protocol.Message) -> None:
        """One message from the broker: liveness, a refusal, or news of the current
        submission (anything about an earlier one is stale)."""
        header = message.header
        self.link.heard(header.interval if isinstance(header, messages.Heartbeat) else None)
        if isinstance(header, messages.Heartbeat) and header.workers is not None:
            if header.workers:
                job.no_workers_since = None
            elif job.no_workers_since is None:
                job.no_workers_since = time.monotonic()
        if isinstance(header, messages.Error) and header.job is None:
            raise FarmError(f"the broker refused a request: {header.error}")
        submission = job.submission
        if isinstance(header, messages.Heartbeat) or submission is None:
            return
        about = messages.job_of(header)
        if about == submission.job:
            self._handle(job, submission, message)
        elif isinstance(header, messages.Result) and about in job.earlier:
            self._take_message(job, job.earlier[about], message)  # kept from a lost broker

    def _handle(self, job: JobRun, submission: Submission, message: protocol.Message) -> None:
        """One message about the job's current submission."""
        match message.header:
            case messages.Need() as need:
                self._send_input(job, submission, need)
            case messages.Result():
                self._take_message(job, submission, message)
            case messages.Failed() as failed:
                self._take_failure(job, failed, submission)
            case messages.Done():
                job.summary, job.submission = message.document(JobSummary), None
            case messages.Cancel(reason=reason):
                job.cancelled = reason or "cancelled"
                job.summary, job.submission = message.document(JobSummary), None
            case messages.Error(resubmit=True) if job.cancel_sent is None:
                log.info("%s", message.header.error)
                resubmission = self._running.resubmission(lost=False)
                if resubmission is not None:
                    self._send(*resubmission)
            case messages.Error(unknown_job=True) if job.cancel_sent is not None:
                job.cancelled, job.submission = "cancelled", None  # nothing left to cancel
            case messages.Error(unknown_job=True):  # a restarted broker: ask again
                log.warning("broker %s lost the job (restarted?)", self.broker)
                self.link.reconnect()
            case messages.Error(error=error):
                raise FarmError(error)

    def _take_message(self, job: JobRun, submission: Submission, message: protocol.Message) -> None:
        result = message.header
        assert isinstance(result, messages.Result)
        self._take_result(
            job,
            submission,
            result,
            message.array(result.dtype, result.item_shape),
            message.failures(),
        )

    def _send_input(self, job: JobRun, submission: Submission, need: messages.Need) -> None:
        """DATA for a NEED: the chunk's items, read from the source now."""
        pieces = submission.pieces(need.start, need.count)
        if sum(n for _, _, n in pieces) != need.count:
            raise FarmError(
                f"the broker asked for items {need.start}+{need.count} of a job "
                f"of {submission.total}"
            )
        if job.input_error is not None:
            return  # the job is being cancelled
        try:
            frames = job.source.frames([(item_start, n) for _, item_start, n in pieces])
        except (NpyError, OSError) as exc:  # the `.npy` input cut short, unreadable...
            log.info("cannot read the input (%s): cancelling the job", exc)
            job.input_error = exc
            self._cancel_requested = True  # _collect sends CANCEL and waits for its answer
            return
        job.input_bytes += sum(memoryview(frame).nbytes for frame in frames)
        self._send(
            messages.Data(job=submission.job, chunk=need.chunk, start=need.start, count=need.count),
            frames,
        )

    def _take_result(
        self,
        job: JobRun,
        submission: Submission,
        header: messages.Result,
        values: np.ndarray,
        failures: list[tuple[int, int, str]],
    ) -> None:
        """Write a result's items to the sink, and record those that failed on their own
        (``failures``: offset, count, reason); if writing fails, cancel the job (and write
        nothing more).  A correction (``corrects``: the worker that computed them lost a
        spot check) overwrites its items' rows."""
        if len(values) != header.count:
            raise FarmError(f"result for {header.count} items holds {len(values)}")
        pieces = submission.pieces(header.start, header.count)
        # counted once, and not for a duplicate (no run taken)
        oriented, rerun = header.oriented, header.rerun
        for offset, item_start, count in pieces:
            if job.output_error is not None:
                break
            runs = job.state.take(item_start, count, header.kept)
            if runs:
                job.oriented, oriented = job.oriented + oriented, 0
                job.rerun, rerun = job.rerun + rerun, 0
            for first, stop in [(item_start, item_start + count)] if header.corrects else runs:
                if not self._write_run(
                    job, values, failures, first - item_start + offset, first, stop
                ):
                    job.state.answered[first : item_start + count] = False  # not written
                    break
            else:
                if job.progress and runs:
                    job.progress(sum(stop - first for first, stop in runs))
        if job.trace and pieces:
            job.trace.add(header, pieces[0][1], header.count)

    def _write_run(
        self,
        job: JobRun,
        values: np.ndarray,
        failures: list[tuple[int, int, str]],
        offset: int,
        first: int,
        stop: int,
    ) -> bool:
        """Write items ``first..stop`` (at ``offset`` in the result) and record those that
        failed on their own; False if writing failed (the job is cancelled)."""
        for low, high, error in split_failures(offset, stop - first, failures):
            start = first + low - offset
            if error is not None:
                job.record_failure(start, high - low, error)
                continue
            try:
                job.sink.write(start, values[low:high])
            except OSError as exc:
                self._output_failed(job, exc)
                return False
        return True

    def _output_failed(self, job: JobRun, error: OSError) -> None:
        """An output could not be written: cancel the job (``run`` then raises OutputError)."""
        log.info("cannot write outputs (%s): cancelling the job", error)
        job.output_error = error
        self._cancel_requested = True  # _collect sends CANCEL and waits for its answer

    def _take_failure(self, job: JobRun, header: messages.Failed, submission: Submission) -> None:
        for _, item_start, count in submission.pieces(header.start, header.count):
            for first, stop in job.state.take(item_start, count):
                job.record_failure(first, stop - first, header.error)
                if job.progress:
                    job.progress(stop - first)

    def _send(self, header: messages.Header, payload: list[Any] | None = None) -> None:
        """Send without blocking: with no broker to take it, the message is dropped (the
        silence that follows leads to a re-submission or a timeout)."""
        self.link.send(protocol.encode(protocol.command_of(header), header, payload or ()))

    def _poll(self, seconds: float | None) -> protocol.Message | None:
        """The next well-formed message within ``seconds`` (None: no limit), else None;
        None at once when ``cancel`` wakes it.

        FarmError at once if the broker refused this client's CURVE key.
        """
        deadline = None if seconds is None else time.monotonic() + seconds
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ready = self.link.poll(wait)
            except BrokerRefused as exc:
                raise FarmError(str(exc)) from None
            if self._wake_read in ready:
                os.read(self._wake_read, 4096)
                return None  # cancel() was called: the caller acts on it
            if self.link.socket not in ready:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            frames = recv_frames(self.link.socket)
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

    def model_card(self, model: str) -> ModelCard:
        """The broker's word on a model's class labels and final softmax; FarmError if the
        broker cannot use the model."""
        self._send(messages.Info(model=model))
        while True:
            message = self._receive()
            document = message.document(dict) if message.command is Command.INFO else None
            if document and isinstance(document.get("model"), dict):
                card = document["model"]
                if "error" in card:
                    raise FarmError(str(card["error"]))
                return ModelCard(
                    tuple(map(str, card.get("labels", ()))), bool(card.get("softmax", False))
                )
            header = message.header
            if isinstance(header, messages.Error) and header.job is None:
                raise FarmError(header.error)

    def info(self, wait_workers: int = 0) -> dict[str, Any]:
        """The broker's registry; with ``wait_workers``, once that many workers have joined."""
        self._send(messages.Info(wait_workers=wait_workers))
        while True:
            message = self._receive()
            if message.command is Command.INFO:
                return message.document(dict) or {}
            header = message.header
            if isinstance(header, messages.Error) and header.job is None:
                raise FarmError(header.error)


def engine_choice(backend: str | None, precision: str | None) -> EngineChoice | None:
    """The engine a job asks for (None: the workers' own): ``precision``, one or the
    precision gate's list, on ``backend`` (default auto); ValueError when malformed, or
    for ``auto``, which the precision gate resolves before a job is submitted."""
    if backend is None and precision is None:
        return None
    if precision == "auto":
        raise ValueError(
            "precision 'auto' is chosen by the precision gate before a job is submitted: "
            "pass farm.engines.gate.judge(spec, images).precision, or use `farm run` or "
            "`farm submit --precision auto`"
        )
    return EngineChoice.parse(backend or AUTO, precision or "f32")


def job_source(images: Input, algo: str | None, params: dict[str, Any] | None) -> Source:
    """A job's input (``as_source``), its notices logged; FarmError for an empty one, or
    policy ``params`` with no ``algo``."""
    source = as_source(images)
    if len(source) == 0:
        raise FarmError("no images to run")
    for line in source.notices:  # an array converted, files skipped
        log.info("%s", line)
    if params and algo is None:
        raise FarmError("policy params need algo (the job's own policy)")
    return source


def shareable(source: Source, notice: Callable[[str], None]) -> bool:
    """Whether the workers can read ``source`` from shared storage; if not, a notice why."""
    reason = unshareable(source)
    if reason:
        notice(f"inputs not shared: {reason}")
    return not reason


def as_source(images: Input) -> Source:
    """A job's input: an array or `.npy` reader, a list of arrays (one image each,
    stacked), a source, or image files, folders, globs and lists
    (``farm.client.inputs.find_image_files``)."""
    if isinstance(images, (ArraySource, FileSource)):
        return images
    try:
        if isinstance(images, (np.ndarray, NpyReader)):
            return ArraySource(images)
        if isinstance(images, (str, os.PathLike)):
            images = [images]  # one file, folder, glob or list
        if any(isinstance(image, np.ndarray) for image in images):
            return ArraySource(stacked(images))
        return open_input([os.fspath(path) for path in images])  # type: ignore[arg-type]
    except InputError as exc:
        raise FarmError(str(exc)) from None


def split_failures(
    offset: int, count: int, failures: list[tuple[int, int, str]]
) -> list[tuple[int, int, str | None]]:
    """Items ``[offset, offset + count)`` of a chunk as runs ``(low, high, reason)``: reason
    None for the items that came back, else why they failed."""
    runs: list[tuple[int, int, str | None]] = []
    position, stop = offset, offset + count
    for start, length, error in failures:
        low, high = max(start, position), min(start + length, stop)
        if low >= high:
            continue
        if low > position:
            runs.append((position, low, None))
        runs.append((low, high, error))
        position = high
    if position < stop:
        runs.append((position, stop, None))
    return runs


def describe_failures(
    failed: list[FailedItems], names: Callable[[int, int], Sequence[str]] | None = None
) -> str:
    """One line per failed range, for errors and the CLI; ``names``: what to call the items
    (image files' paths), for a range of one."""
    count = sum(f.count for f in failed)
    lines = [f"{plural(count, 'image')} failed:"]
    for f in failed[:20]:
        what = (
            names(f.start, 1)[0]
            if names is not None and f.count == 1
            else f"item {f.start}"
            if f.count == 1
            else f"items {f.start}..{f.start + f.count - 1}"
        )
        lines.append(f"  {what}: {f.error}")
    if len(failed) > 20:
        lines.append(f"  ... and {len(failed) - 20} more ranges")
    return "\n".join(lines)


__all__ = [
    "ArraySink",
    "OutputRefused",
    "OutputSpec",
    "Client",
    "FailedItems",
    "FarmError",
    "FarmTimeout",
    "JobResult",
    "NoWorker",
    "NpyReader",
    "NpyWriter",
    "OutputError",
    "ResumeRefused",
]
