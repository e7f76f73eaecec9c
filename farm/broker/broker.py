"""The ROUTER broker: a registry of workers, jobs cut into chunks by policy objects.

One ROUTER socket serves workers and clients alike.  The loop is thin: poll,
decode, dispatch to a handler, run the timers, repeat.  Liveness is the
ZeroMQ guide's Paranoid Pirate pattern both ways: the broker heartbeats every
worker and client it serves, and drops a worker (its chunks go back to the
policy) or a job (its client vanished) once the peer has been silent for
``liveness`` heartbeats.

The broker holds no job input.  When a policy assigns a chunk, the broker asks
the job's client for exactly those items (NEED), and forwards the DATA frame
it gets back to the worker as the TASK payload, untouched.  So its memory is
bounded by the chunks in flight (workers x slots x ``MAX_TASK_BYTES``), and
an input far larger than RAM streams through it.  Each assignment is an
*attempt* with its own id: a reply to an attempt that is no longer in flight
(its worker was declared dead, or it was answered already) is dropped, so every
item is delivered exactly once; an item range that fails ``max_attempts`` times
is a poison chunk, reported to the client instead of retried forever.

Several jobs share the workers: every free slot is offered to the jobs in
order, highest priority first, then (``sharing="fair"``) the job holding the
fewest slots, then the oldest; each job's own policy decides whether to take
it.  A worker with nothing left of one job thus takes chunks of the next, and
job tails overlap.  Every chunk is capped at ``max_chunk_seconds`` of compute on
the job's fastest worker (once speeds are known; a quarter of that while jobs
share the farm), so a job that arrives waits for a worker about a second, not
minutes, and a cancel, a lost worker or a progress bar never waits on a chunk
of minutes.  A job that ends early (cancelled, timed out, failed) has
its queued chunks dropped at once; the workers running its chunks get CANCEL,
stop after their current compute batch, and their slots free when they answer.
"""

from __future__ import annotations

import logging
import mmap
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import zmq
from msgspec import structs

from farm import protocol
from farm.broker.jobs import ChunkRecord, Job, JobOptions
from farm.broker.models import ModelCatalog
from farm.broker.registry import WorkerEntry
from farm.messages import job_of
from farm.policies import (Assign, ChunkDone, ChunkFailed, Event, WorkerBusy, WorkerLost,
                           WorkerReady, make_policy)
from farm.protocol import Command, Message, ProtocolError
from farm.repository import ModelError
from farm.trace import network_seconds
from farm.wakeup import Wakeup

log = logging.getLogger("farm.broker")

#: Most INFO requests that may wait for workers at once.
MAX_INFO_WAITERS = 1000
#: Most jobs the broker holds at once.
MAX_JOBS = 1000
#: Most messages handled in one loop pass before the timers run.
MAX_BATCH = 1000
#: Seconds an INFO request waits for workers before it is forgotten (its client gave up).
INFO_WAIT_LIMIT = 120.0
#: Longest error text sent: a reply must stay within the protocol's own string limits.
MAX_ERROR_CHARS = 1000
#: How jobs share free slots: "fair" (fewest slots held first) or "fifo" (oldest first).
SHARING = ("fair", "fifo")
#: Part of ``max_chunk_seconds`` that caps chunks while several jobs share the farm.
SHARED_CHUNK_FRACTION = 0.25
#: Ways a job ends, counted in INFO and metrics.
OUTCOMES = ("done", "failed", "cancelled", "timed_out", "expired")


@dataclass
class BrokerConfig:
    bind: str = "tcp://127.0.0.1:5555"
    algo: str = "fifo"
    params: dict[str, Any] = field(default_factory=dict)
    heartbeat: float = 1.0  # seconds between heartbeats to workers and clients
    model_dirs: tuple[str, ...] = ()  # searched before $FARM_MODELS and the bundled models
    liveness: int = 5  # heartbeats a peer may miss before it is declared gone
    max_attempts: int = 3  # attempts at an item range before it is given up as poison
    curve: str | None = None  # a `farm keys` folder: CurveZMQ with its allowed keys
    sharing: str = "fair"  # see SHARING; priorities come first either way
    max_chunk_seconds: float = 1.0  # chunk cap, in seconds of compute (0: none)
    metrics: tuple[str, int] | None = None  # (host, port) of the Prometheus endpoint


@dataclass
class BrokerStats:
    """Counters of what went wrong and was recovered; in every INFO snapshot."""

    bad_messages: int = 0
    late_replies: int = 0  # replies to attempts no longer in flight: dropped
    requeued_chunks: int = 0
    abandoned_chunks: int = 0
    workers_expired: int = 0
    jobs_expired: int = 0


class Broker:
    """Registry + dispatcher.  ``poll_once`` and ``tick`` are the whole loop body."""

    def __init__(self, config: BrokerConfig, context: zmq.Context,
                 clock: Callable[[], float] = time.monotonic) -> None:
        make_policy(config.algo, 1, **config.params)  # fail fast on a bad name or parameter
        if config.sharing not in SHARING:
            raise ValueError(f"sharing must be one of {', '.join(SHARING)}")
        self.config = config
        self.clock = clock
        self.socket = context.socket(zmq.ROUTER)
        protocol.limit_socket(self.socket)
        try:
            if config.curve:
                from farm.keys import make_server

                make_server(self.socket, config.curve)
            self.socket.bind(config.bind)
        except Exception:
            self.socket.close()
            raise
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.wakeup: Wakeup | None = None  # serve() ends the loop's wait on SIGINT/SIGTERM
        self.workers: dict[bytes, WorkerEntry] = {}
        self.by_id: dict[str, WorkerEntry] = {}  # the same entries by policy worker id
        self.jobs: dict[str, Job] = {}
        self.models = ModelCatalog(config.model_dirs)
        self.info_waiters: list[tuple[bytes, int, float]] = []  # identity, workers, since
        self.stats = BrokerStats()
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.started_at = self.clock()
        self.next_seq = 0  # submission order of jobs
        self.metrics = None
        self.metrics_url = ""
        if config.metrics:
            from farm.broker.metrics import BrokerMetrics

            self.metrics = BrokerMetrics(self)
            try:
                self.metrics_url = self.metrics.serve(*config.metrics)
            except OSError as exc:
                self.socket.close()
                raise OSError(f"cannot serve metrics on {config.metrics[0]}:"
                              f"{config.metrics[1]}: {exc.strerror or exc}") from exc
        # attempt ids differ from any a previous broker on this address handed out, so a
        # worker's reply to one of those can never pass for a reply to a new attempt
        self.next_chunk_id = secrets.randbits(48)
        self.next_heartbeat = self.clock()
        self.running = True
        self.handlers: dict[Command, Callable[[bytes, Message], None]] = {
            Command.READY: self.on_ready, Command.RESULT: self.on_result,
            Command.FAILED: self.on_failed, Command.SUBMIT: self.on_submit,
            Command.DATA: self.on_data, Command.INFO: self.on_info,
            Command.DISCONNECT: self.on_disconnect, Command.HEARTBEAT: self.on_heartbeat,
            Command.FETCH: self.on_fetch, Command.CANCEL: self.on_cancel,
        }
        self.accepted = frozenset(self.handlers)

    # ----------------------------------------------------------------- loop

    def serve(self) -> None:
        """Run until ``stop`` is called (SIGINT/SIGTERM in the CLI)."""
        config = self.config
        log.info("broker listening on %s: policy %s%s, sharing %s, CURVE %s%s", self.endpoint,
                 config.algo, f" {config.params}" if config.params else "", config.sharing,
                 "on" if config.curve else "off",
                 f", metrics {self.metrics_url}" if self.metrics_url else "",
                 extra={"event": "broker_started", "endpoint": self.endpoint,
                        "policy": config.algo})
        while self.running:
            wait = max(0.0, self.next_heartbeat - self.clock())
            self.poll_once(int(wait * 1000) + 1)
            self.tick()
        self.close()

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.socket.close()

    def tick(self) -> None:
        """The timers, run on every loop pass: heartbeats out, silent peers dropped."""
        now = self.clock()
        if now >= self.next_heartbeat:
            self.heartbeat_peers()
            self.next_heartbeat = now + self.config.heartbeat
        for identity, entry in list(self.workers.items()):
            silent = now - entry.last_seen
            if silent > self.worker_expiry(entry):
                self.stats.workers_expired += 1
                self.lose_worker(identity, f"silent for {silent:.1f} s")
        if self.info_waiters and self.info_waiters[0][2] < now - INFO_WAIT_LIMIT:
            self.answer_info_waiters()
        for job in list(self.jobs.values()):
            silent = now - job.client_seen
            if silent > job.client_expiry:
                self.stats.jobs_expired += 1
                log.warning("job %s dropped: its client was silent for %.1f s", job.id, silent,
                            extra={"event": "job_ended", "job": job.id, "outcome": "expired"})
                self.end_job(job, "expired")
            elif job.deadline is not None and now > job.deadline:
                self.cancel_job(job, "timed_out",
                                f"the job's timeout of {job.options.timeout:g} s passed")

    def worker_expiry(self, entry: WorkerEntry) -> float:
        return self.config.liveness * max(self.config.heartbeat, entry.heartbeat)

    def heartbeat_peers(self) -> None:
        """Tell every worker, and each client with a running job, that the broker is alive."""
        interval = self.config.heartbeat
        for identity in self.workers:
            self.send(identity, Command.HEARTBEAT, {"interval": interval})
        for job in self.jobs.values():
            self.send(job.client, Command.HEARTBEAT, {"job": job.id, "interval": interval})

    def poll_once(self, timeout_ms: int) -> None:
        """Handle the messages waiting (or arriving within the timeout), at most ``MAX_BATCH``;
        a stop signal ends the wait."""
        if self.socket not in dict(self.poller.poll(timeout_ms)):
            if self.wakeup is not None:
                self.wakeup.drain()
            return
        for _ in range(MAX_BATCH):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.handle(frames)

    def stop(self, *_: Any) -> None:
        self.running = False

    def handle(self, frames: list[Any]) -> None:
        """Decode and dispatch one message; a bad one gets an ERROR, never a crash."""
        identity, body = frames[0].bytes, frames[1:]
        entry = self.workers.get(identity)
        if entry is not None:
            entry.last_seen = self.clock()
        message = None
        try:
            message = protocol.decode(body, allowed=self.accepted)
            self.handlers[message.command](identity, message)
        except ProtocolError as exc:
            self.stats.bad_messages += 1
            log.warning("bad message from %s: %s", identity.hex(), exc)
            job = job_of(message.header) if message else None
            self.send(identity, Command.ERROR, {"error": str(exc), **(
                {"job": job} if job is not None else {})})
        except Exception:  # a bug must not take the farm down; log it and keep serving
            log.exception("error handling a message from %s", identity.hex())

    def send(self, identity: bytes, command: Command, header: dict[str, Any],
             payload: list[Any] | tuple = ()) -> None:
        error = header.get("error")
        if isinstance(error, str) and len(error) > MAX_ERROR_CHARS:  # it may quote the peer
            header = {**header, "error": error[:MAX_ERROR_CHARS - 3] + "..."}
        self.socket.send_multipart([identity, *protocol.encode(command, header, payload)],
                                   copy=False)

    def on_heartbeat(self, identity: bytes, message: Message) -> None:
        """A client's heartbeat names its job; a worker's carries its compute counters and
        needs no answer, unless the worker is unknown."""
        job_id = message.header.job
        if job_id is None:
            entry = self.workers.get(identity)
            if entry is None:
                self.send(identity, Command.DISCONNECT, {})  # a worker we dropped: re-register
            else:
                if message.header.computed is not None:
                    entry.note_computed(message.header.computed, self.clock())
                if message.header.engines is not None:
                    entry.note_engines(message.header.engines)
            return
        job = self.jobs.get(job_id)
        if job is None or job.client != identity:
            self.send(identity, Command.ERROR, {"job": job_id, "unknown_job": True,
                                                "error": f"the broker has no job {job_id}"})
            return
        job.client_seen = self.clock()

    # -------------------------------------------------------------- workers

    def on_ready(self, identity: bytes, message: Message) -> None:
        entry = WorkerEntry.from_ready(identity, message.header)
        entry.last_seen = entry.joined_at = self.clock()
        if identity in self.workers:
            self.lose_worker(identity, "re-registered")
        self.workers[identity] = self.by_id[entry.id] = entry
        if self.metrics:
            self.metrics.worker_joined(entry)
        log.info("worker %s joined (%s, %d compute thread%s; loaded: %s; can run: %s)",
                 entry.name, entry.backend, entry.threads, "" if entry.threads == 1 else "s",
                 ", ".join(sorted(entry.loaded)) or "none", ", ".join(sorted(entry.models)),
                 extra={"event": "worker_joined", "worker": entry.name, "backend": entry.backend})
        self.send(identity, Command.HEARTBEAT, {"interval": self.config.heartbeat})
        self.answer_info_waiters()
        self.fill(entry)

    def on_disconnect(self, identity: bytes, message: Message) -> None:
        self.lose_worker(identity, "disconnected")

    def lose_worker(self, identity: bytes, reason: str) -> None:
        """Forget a worker; each of its chunks counts a failed attempt and goes back to its
        job's policy, or is given up if that was its last attempt."""
        entry = self.workers.pop(identity, None)
        if entry is None:
            return
        del self.by_id[entry.id]
        records = list(entry.in_flight.values())
        entry.in_flight.clear()
        log.info("worker %s left (%s) with %d chunks in flight", entry.name, reason, len(records),
                 extra={"event": "worker_left", "worker": entry.name, "reason": reason})
        for record in records:
            job = record.job
            job.pending.pop(record.id, None)
            if job.outcome is None and job.policy:
                self.attempt_failed(record, f"worker {entry.name} was lost ({reason})",
                                    requeue_with_worker=True)
        # after its chunks' failures were counted; a worker that reconnected (a new socket,
        # the same name) keeps its series
        if self.metrics and all(other.name != entry.name for other in self.workers.values()):
            self.metrics.worker_left(entry)
        for job in list(self.jobs.values()):
            if job.policy:
                self.step(job, WorkerLost(entry.id, at=self.clock()))
        self.fill_all()

    def attempt_failed(self, record: ChunkRecord, error: str,
                       requeue_with_worker: bool = False) -> None:
        """Retry the chunk, or give it up after ``max_attempts`` and tell the client.

        ``requeue_with_worker``: the worker was lost, and the policy's ``WorkerLost``
        returns its chunks to the pool, so only a chunk given up needs an event here.
        """
        job, chunk = record.job, record.chunk
        job.note_failure(record, error)
        if self.metrics:
            self.metrics.chunk_failed(record.worker)
        if record.attempt < self.config.max_attempts:
            self.stats.requeued_chunks += 1
            log.info("job %s: items %d..%d failed attempt %d (%s); retrying", job.id,
                     chunk.start, chunk.stop - 1, record.attempt, error)
            if not requeue_with_worker:
                self.step(job, ChunkFailed(record.worker.id, chunk, True, at=self.clock()))
            return
        self.stats.abandoned_chunks += 1
        message = f"gave up after {record.attempt} attempts; last: {error}"
        job.abandoned.append(job.failures[-1])
        log.warning("job %s: items %d..%d %s", job.id, chunk.start, chunk.stop - 1, message,
                    extra={"event": "chunk_abandoned", "job": job.id, "start": chunk.start,
                           "count": chunk.count})
        self.send(job.client, Command.FAILED, {"job": job.id, "chunk": record.id,
                                               "start": chunk.start, "count": chunk.count,
                                               "error": message})
        self.step(job, ChunkFailed(record.worker.id, chunk, False, at=self.clock()))
        self.finish_if_done(job)

    def fill(self, entry: WorkerEntry) -> None:
        """Offer all of one worker's free slots to the jobs."""
        while entry.free_slots > 0 and self.offer_slot(entry):
            pass

    def fill_all(self) -> None:
        """Offer free slots breadth-first: every worker's first slot before anyone's second."""
        progress = True
        while progress:
            progress = False
            for entry in list(self.workers.values()):
                if entry.free_slots > 0 and self.offer_slot(entry):
                    progress = True

    def offer_slot(self, entry: WorkerEntry) -> bool:
        """Offer one slot to the jobs in ``job_order``; True if one took it."""
        if entry.identity not in self.workers:
            return False
        before = len(entry.in_flight)
        for job in self.job_order():
            job.eligible[entry.id] = entry
            self.step(job, WorkerReady(entry.id, at=self.clock()))
            if len(entry.in_flight) > before:
                return True
        return False

    def job_order(self) -> list[Job]:
        """Running jobs in the order they are offered a free slot: highest priority first,
        then (fair sharing) the fewest chunks in flight, then the oldest."""
        jobs = [job for job in self.jobs.values() if job.policy]
        if self.config.sharing == "fair":
            return sorted(jobs, key=lambda job: (-job.priority, job.in_flight, job.seq))
        return sorted(jobs, key=lambda job: (-job.priority, job.seq))

    def slots_taken(self, entry: WorkerEntry, taker: Job) -> None:
        """The worker's last free slot went to ``taker``: other jobs' policies that counted
        it as idle hear it is busy."""
        for job in list(self.jobs.values()):
            if job is not taker and job.policy and entry.id in job.policy.idle:
                self.step(job, WorkerBusy(entry.id, at=self.clock()))

    def step(self, job: Job, event: Event) -> None:
        """Feed one event to the job's policy and carry out its assignments.  A policy that
        raises (on parameters a client chose, say) fails its own job, not the farm."""
        if job.outcome is not None:
            return
        try:
            assignments = job.policy.handle(event)
        except Exception as exc:
            log.exception("job %s: policy %s failed on %s", job.id, job.algo, event)
            self.fail_job(job, f"policy {job.algo} failed: {type(exc).__name__}: {exc}")
            return
        self.dispatch(job, assignments)

    def dispatch(self, job: Job, assignments: list[Assign]) -> None:
        """Carry out a policy's assignments: each takes a slot now and asks the client for
        its input; the TASK goes out when the DATA comes back."""
        for assignment in assignments:
            entry = self.by_id.get(assignment.worker)
            if entry is None:  # the policy has not heard the worker is gone yet
                self.step(job, WorkerLost(assignment.worker, at=self.clock()))
                continue
            chunk, now = assignment.chunk, self.clock()
            record = ChunkRecord(self.next_chunk_id, job, chunk, entry, job.attempt_of(chunk),
                                 assigned_at=now)
            self.next_chunk_id += 1
            entry.in_flight[record.id] = record
            job.pending[record.id] = record
            if job.started_at is None:
                job.started_at = now
            self.send(job.client, Command.NEED, {"job": job.id, "chunk": record.id,
                                                 "start": chunk.start, "count": chunk.count})
            if entry.free_slots <= 0 and len(self.jobs) > 1:
                self.slots_taken(entry, job)

    def on_data(self, identity: bytes, message: Message) -> None:
        """A chunk's input from its client: forward it to the chunk's worker as the TASK."""
        header = message.header
        job = self.jobs.get(header.job)
        if job is None or job.client != identity:
            return  # data of a job that failed or was dropped: nothing waits for it
        job.client_seen = self.clock()
        record = job.pending.pop(header.chunk, None)
        if record is None or record.id not in record.worker.in_flight:
            return  # its worker was lost meanwhile: the chunk was requeued
        try:
            if len(message.payload) != 1:
                raise ProtocolError("DATA carries exactly one frame")
            job.check_data(record, header, message.payload[0])
        except ProtocolError as exc:
            self.fail_job(job, str(exc))
            return
        record.sent_at = self.clock()
        chunk = record.chunk
        header = {"job": job.id, "chunk": record.id, "attempt": record.attempt,
                  "start": chunk.start, "count": chunk.count, "model": job.model,
                  "digest": job.digest, "dtype": job.dtype, "item_shape": list(job.item_shape)}
        if job.options.engine:
            header["engine"] = list(job.options.engine)
        self.send(record.worker.identity, Command.TASK, header, message.payload)

    def answered_record(self, identity: bytes, message: Message) -> ChunkRecord | None:
        """The attempt a RESULT or FAILED answers; None for a late, duplicate or unknown one.

        A reply from a worker the broker no longer knows (declared dead, then back)
        gets DISCONNECT: the worker reconnects and registers afresh.
        """
        entry = self.workers.get(identity)
        record = entry.in_flight.get(message.header.chunk) if entry else None
        if (record is not None and record.sent_at is not None and record.job.outcome
                and record.job.id == message.header.job):
            del entry.in_flight[record.id]  # a chunk of a job that ended: its slot is free
            self.fill(entry)
            return None
        if (record is None or record.sent_at is None or record.job.id not in self.jobs
                or record.job.id != message.header.job):
            self.stats.late_replies += 1
            log.info("dropped a reply for chunk %s from %s (late, duplicate or cancelled)",
                     message.header.chunk, entry.name if entry else identity.hex())
            if entry is None:
                self.send(identity, Command.DISCONNECT, {})
            return None
        del entry.in_flight[record.id]
        return record

    def on_result(self, identity: bytes, message: Message) -> None:
        record = self.answered_record(identity, message)
        if record is None:
            return
        job, chunk, entry, header = record.job, record.chunk, record.worker, message.header
        problem = job.check_result(record, header)
        if problem:
            self.fail_job(job, f"worker {entry.name} returned a bad result for items "
                               f"{chunk.start}..{chunk.stop - 1}: {problem}")
            return
        timings, now = header.timings, self.clock()
        compute = float(timings["compute"])
        job.account(entry, chunk, compute)
        origin = job.submitted_at
        self.send(job.client, Command.RESULT, {
            **structs.asdict(header), "job": job.id, "worker": entry.name,
            "attempt": record.attempt,
            "trace": [record.assigned_at - origin, record.sent_at - origin, now - origin]},
            message.payload)
        self.cap_chunks(job)  # speeds changed
        if self.metrics:
            self.metrics.chunk_done(entry, chunk.count, timings, record.sent_at -
                                    record.assigned_at + float(timings.get("receive", 0.0)),
                                    network_seconds(now - record.sent_at, timings))
        self.step(job, ChunkDone(entry.id, chunk, compute, at=self.clock()))
        self.finish_if_done(job)
        self.fill(entry)

    def on_failed(self, identity: bytes, message: Message) -> None:
        """A chunk failed on its worker: a model error fails the job, anything else retries."""
        record = self.answered_record(identity, message)
        if record is None:
            return
        chunk, error = record.chunk, message.header.error
        if message.header.fatal:
            self.fail_job(record.job, f"items {chunk.start}..{chunk.stop - 1} failed on "
                                      f"{record.worker.name}: {error}")
            return
        self.attempt_failed(record, f"{record.worker.name}: {error}")
        self.fill(record.worker)

    # ----------------------------------------------------------------- jobs

    def on_submit(self, identity: bytes, message: Message) -> None:
        header = message.header
        job_id = header.job
        if job_id in self.jobs:
            raise ProtocolError(f"job {job_id} already exists")
        if len(self.jobs) >= MAX_JOBS:
            raise ProtocolError(f"the broker holds {MAX_JOBS} jobs already; try later")
        protocol.check_array_spec(header.dtype, header.item_shape)
        heartbeat = header.heartbeat or self.config.heartbeat
        options = JobOptions.parse(header.options)
        algo, params = options.policy(self.config.algo, self.config.params)
        job = Job(job_id, identity, header.model, header.dtype,
                  tuple(header.item_shape), header.total, self.clock(),
                  self.config.liveness * max(self.config.heartbeat, heartbeat), options,
                  algo, params, self.next_seq)
        self.next_seq += 1
        self.jobs[job_id] = job
        if len(self.jobs) > 1:
            for each in self.jobs.values():
                each.shared = True
        log.info("job %s: %d x %s %s for model %s, policy %s, priority %d", job_id, job.total,
                 job.item_shape, job.dtype, job.model, algo, options.priority,
                 extra={"event": "job_submitted", "job": job_id, "model": job.model,
                        "items": job.total, "policy": algo, "priority": options.priority,
                        "client": options.client})
        if self.validate_job(job):
            self.fill_all()

    def validate_job(self, job: Job) -> bool:
        """Check the job's model and shape against the broker's repository; fail it if wrong.

        Every worker can run every model (it fetches the files it lacks), so a
        valid job gets its policy at once, told the workers connected now and
        their speeds on this model from earlier jobs.
        """
        if job.policy:
            return True
        try:
            spec, manifest = self.models.lookup(job.model)
        except Exception as exc:  # ModelError, or a bug: either way the client hears why
            self.fail_job(job, str(exc) if isinstance(exc, ModelError) else
                          f"cannot use model {job.model!r}: {type(exc).__name__}: {exc}")
            return False
        if job.item_shape != spec.item_shape:
            layout = " (H x W x C)" if spec.preprocess.layout == "HWC" else ""
            self.fail_job(job, f"images of shape {job.item_shape} do not match model "
                               f"{job.model!r}, which takes {spec.item_shape}{layout}")
            return False
        job.digest = manifest.digest
        eligible = list(self.workers.values())
        speeds = {entry.id: entry.history[job.model].rate for entry in eligible
                  if job.model in entry.history}
        try:
            job.policy = make_policy(job.algo, job.total, [e.id for e in eligible], speeds,
                                     **job.params)
        except Exception as exc:  # a job's own parameters: ValueError, or what odd values provoke
            self.fail_job(job, f"job policy: {exc}")
            return False
        self.cap_chunks(job)
        return True

    def cap_chunks(self, job: Job) -> None:
        """Cap the job's chunks at its byte limit and at ``max_chunk_seconds`` of compute on
        its fastest worker, once a speed on its model is known; while several jobs share
        the farm, at ``SHARED_CHUNK_FRACTION`` of that, so every job's turn on a worker
        comes round quickly (a chunk queued on a worker waits for the one running)."""
        job.policy.max_chunk = job.max_chunk
        fastest = max((entry.history[job.model].rate for entry in self.workers.values()
                       if job.model in entry.history), default=0.0)
        seconds = self.config.max_chunk_seconds
        if sum(1 for other in self.jobs.values() if other.policy) > 1:
            seconds *= SHARED_CHUNK_FRACTION
        if fastest > 0 and seconds > 0:  # min() first: a rate may be huge, even inf
            job.policy.max_chunk = max(1, int(min(job.max_chunk, fastest * seconds)))

    def on_fetch(self, identity: bytes, message: Message) -> None:
        """Send a registered worker a model's files; an error reply if it is gone or changed.

        The files go out memory-mapped: however many workers fetch a model at once, its
        bytes are in memory once, in the page cache.
        """
        entry = self.workers.get(identity)
        name, digest = message.header.model, message.header.digest
        try:
            if entry is None:
                raise ModelError("models are sent to registered workers only")
            spec, manifest = self.models.lookup(name)
            if manifest.digest != digest:
                raise ModelError(f"model {name!r} changed on the broker (now {manifest.digest[:12]}"
                                 f", asked for {digest[:12]})")
            size = sum(f.size for f in manifest.files)
            largest = max((f.size for f in manifest.files), default=0)
            if largest > protocol.MAX_MESSAGE_BYTES:
                raise ModelError(f"model {name!r} has a file of {largest:,} bytes, over the "
                                 f"{protocol.MAX_MESSAGE_BYTES:,}-byte frame limit")
            contents = [mapped(spec.files()[f.name]) for f in manifest.files]
        except (ModelError, OSError) as exc:
            self.send(identity, Command.MODEL, {"model": name, "digest": digest, "files": [],
                                                "error": str(exc)})
            return
        entry.fetched[name] = entry.fetched.get(name, 0) + 1
        log.info("sending model %s (%d bytes) to %s", name, size, entry.name)
        self.send(identity, Command.MODEL, manifest.header(), contents)

    def finish_if_done(self, job: Job) -> None:
        if job.outcome is None and job.policy.finished:
            self.finish(job)

    def finish(self, job: Job) -> None:
        summary = job.summary(self.clock())
        self.end_job(job, "done")
        log.info("job %s done: %d items in %.3f s", job.id, job.total, summary.broker_seconds,
                 extra={"event": "job_ended", "job": job.id, "outcome": "done",
                        "seconds": summary.broker_seconds})
        self.send(job.client, Command.DONE, {"job": job.id}, protocol.document_frames(summary))

    def fail_job(self, job: Job, error: str) -> None:
        """Tell the client why its job failed; free the slots its chunks held."""
        log.warning("job %s failed: %s", job.id, error,
                    extra={"event": "job_ended", "job": job.id, "outcome": "failed"})
        self.send(job.client, Command.ERROR, {"error": error, "job": job.id})
        self.end_job(job, "failed")

    def cancel_job(self, job: Job, outcome: str, reason: str) -> None:
        """Stop a job and tell its client why, with what finished."""
        log.info("job %s %s: %s", job.id, outcome.replace("_", " "), reason,
                 extra={"event": "job_ended", "job": job.id, "outcome": outcome})
        summary = job.summary(self.clock())
        self.end_job(job, outcome)
        self.send(job.client, Command.CANCEL, {"job": job.id, "reason": reason},
                  protocol.document_frames(summary))

    def end_job(self, job: Job, outcome: str) -> None:
        """Forget a job.  Chunks still waiting for input are dropped; workers running its
        chunks are told to stop, and their slots free when they answer."""
        self.jobs.pop(job.id, None)
        job.outcome = outcome
        self.outcomes[outcome] += 1
        job.pending.clear()
        for entry in self.workers.values():
            records = [r for r in entry.in_flight.values() if r.job is job]
            for record in records:
                if record.sent_at is None:
                    del entry.in_flight[record.id]
            if outcome != "done" and any(r.sent_at is not None for r in records):
                self.send(entry.identity, Command.CANCEL, {"job": job.id})
        self.fill_all()

    def on_cancel(self, identity: bytes, message: Message) -> None:
        """A client stops its job."""
        job_id = message.header.job
        job = self.jobs.get(job_id)
        if job is None or job.client != identity:
            self.send(identity, Command.ERROR, {"job": job_id[:100], "unknown_job": True,
                                                "error": f"the broker has no job {job_id[:100]}"})
            return
        self.cancel_job(job, "cancelled", "cancelled by the client")

    # ----------------------------------------------------------------- info

    def on_info(self, identity: bytes, message: Message) -> None:
        """A snapshot of the registry; with ``wait_workers`` it is sent once that many joined."""
        wanted = message.header.wait_workers
        if len(self.workers) >= wanted:
            self.send(identity, Command.INFO, {}, protocol.document_frames(self.snapshot()))
        elif len(self.info_waiters) >= MAX_INFO_WAITERS:
            raise ProtocolError("too many INFO requests waiting for workers")
        else:
            self.info_waiters.append((identity, wanted, self.clock()))

    def answer_info_waiters(self) -> None:
        """Answer INFO requests whose workers have joined; forget those waiting too long."""
        waiting, self.info_waiters = self.info_waiters, []
        oldest = self.clock() - INFO_WAIT_LIMIT
        for identity, wanted, since in waiting:
            if len(self.workers) >= wanted:
                self.send(identity, Command.INFO, {}, protocol.document_frames(self.snapshot()))
            elif since > oldest:
                self.info_waiters.append((identity, wanted, since))

    def snapshot(self) -> dict[str, Any]:
        """What ``farm status`` shows: the broker, its workers and its jobs (in slot order)."""
        now = self.clock()
        return {"endpoint": self.endpoint, "uptime_s": now - self.started_at,
                "policy": self.config.algo, "params": self.config.params,
                "sharing": self.config.sharing, "metrics": self.metrics_url,
                "heartbeat": self.config.heartbeat, "liveness": self.config.liveness,
                "stats": asdict(self.stats), "jobs_ended": dict(self.outcomes),
                "workers": [entry.describe(now) for entry in self.workers.values()],
                "jobs": [job.describe(now) for job in self.job_order()]}


def mapped(path: Path) -> Any:
    """A read-only memory map of a file (b"" for an empty one): a zero-copy frame."""
    with open(path, "rb") as handle:
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if path.stat().st_size \
            else b""


def serve(config: BrokerConfig, on_bound: Callable[[Broker], None] | None = None) -> None:
    """Bind, report the endpoints, and serve until SIGINT/SIGTERM."""
    context = zmq.Context()
    authenticator = None
    if config.curve:
        from farm.keys import start_authenticator

        authenticator = start_authenticator(context, config.curve)
    broker = None
    try:
        broker = Broker(config, context)
        broker.wakeup = Wakeup(broker.stop)
        broker.wakeup.watch(broker.poller)
        if on_bound:
            on_bound(broker)
        broker.serve()
    finally:
        if broker is not None and broker.wakeup is not None:
            broker.wakeup.close()
        if authenticator is not None:
            authenticator.stop()
        context.term()
