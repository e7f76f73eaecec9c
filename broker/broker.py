"""The ROUTER broker: a registry of workers, jobs cut into chunks by policy objects.

One ROUTER socket serves workers and clients alike.  The loop is thin: poll,
decode, dispatch to a handler, repeat.  Payload frames are forwarded as the
zmq frames they arrived in (a chunk is a memoryview slice of the client's
block): the broker never copies or decodes image or output data.
"""

from __future__ import annotations

import logging
import mmap
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import zmq

from farm import protocol
from farm.broker.jobs import ChunkRecord, Job
from farm.broker.models import ModelCatalog
from farm.broker.registry import WorkerEntry
from farm.policies import Assign, ChunkDone, WorkerLost, WorkerReady, make_policy
from farm.protocol import Command, Message, ProtocolError
from farm.repository import ModelError

log = logging.getLogger("farm.broker")

#: Most INFO requests that may wait for workers at once.
MAX_INFO_WAITERS = 1000

@dataclass
class BrokerConfig:
    bind: str = "tcp://127.0.0.1:5555"
    algo: str = "fifo"
    params: dict[str, Any] = field(default_factory=dict)
    heartbeat: float = 1.0  # seconds between heartbeats to clients with running jobs
    model_dirs: tuple[str, ...] = ()  # searched before $FARM_MODELS and the bundled models


class Broker:
    """Registry + dispatcher.  ``poll_once`` is the whole loop body."""

    def __init__(self, config: BrokerConfig, context: zmq.Context,
                 clock: Callable[[], float] = time.monotonic) -> None:
        make_policy(config.algo, 1, **config.params)  # fail fast on a bad name or parameter
        self.config = config
        self.clock = clock
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        self.socket.bind(config.bind)
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.workers: dict[bytes, WorkerEntry] = {}
        self.by_id: dict[str, WorkerEntry] = {}  # the same entries by policy worker id
        self.jobs: dict[str, Job] = {}
        self.models = ModelCatalog(config.model_dirs)
        self.info_waiters: list[tuple[bytes, int]] = []
        self.next_chunk_id = 0
        self.running = True
        self.handlers: dict[Command, Callable[[bytes, Message], None]] = {
            Command.READY: self.on_ready, Command.RESULT: self.on_result,
            Command.FAILED: self.on_failed, Command.SUBMIT: self.on_submit,
            Command.DATA: self.on_data, Command.INFO: self.on_info,
            Command.DISCONNECT: self.on_disconnect, Command.HEARTBEAT: lambda *_: None,
            Command.FETCH: self.on_fetch,
        }
        self.accepted = frozenset(self.handlers)

    # ----------------------------------------------------------------- loop

    def serve(self) -> None:
        """Run until ``stop`` is called (SIGINT/SIGTERM in the CLI)."""
        log.info("broker listening on %s, policy %s %s", self.endpoint, self.config.algo,
                 self.config.params)
        next_heartbeat = self.clock()
        while self.running:
            self.poll_once(int(self.config.heartbeat * 1000))
            if self.clock() >= next_heartbeat:
                self.heartbeat_clients()
                next_heartbeat = self.clock() + self.config.heartbeat
        self.socket.close()

    def heartbeat_clients(self) -> None:
        """Tell each client with a running job that the broker is alive and how far it got."""
        for job in self.jobs.values():
            self.send(job.client, Command.HEARTBEAT, {"job": job.id, "done": job.done})

    def poll_once(self, timeout_ms: int) -> None:
        """Handle every message that is waiting (or arrives within the timeout)."""
        if not self.socket.poll(timeout_ms):
            return
        while True:
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
        message = None
        try:
            message = protocol.decode(body, allowed=self.accepted)
            self.handlers[message.command](identity, message)
        except ProtocolError as exc:
            log.warning("bad message from %s: %s", identity.hex(), exc)
            job = message.header.get("job") if message else None
            self.send(identity, Command.ERROR, {"error": str(exc), **({"job": job} if job else {})})
        except Exception:  # a bug must not take the farm down; log it and keep serving
            log.exception("error handling a message from %s", identity.hex())

    def send(self, identity: bytes, command: Command, header: dict[str, Any],
             payload: list[Any] | tuple = ()) -> None:
        self.socket.send_multipart([identity, *protocol.encode(command, header, payload)],
                                   copy=False)

    # -------------------------------------------------------------- workers

    def on_ready(self, identity: bytes, message: Message) -> None:
        entry = WorkerEntry.from_ready(identity, message.header)
        if identity in self.workers:
            self.lose_worker(identity, "re-registered")
        self.workers[identity] = self.by_id[entry.id] = entry
        log.info("worker %s joined (%s, %d threads, models %s)", entry.name, entry.backend,
                 entry.threads, ", ".join(sorted(entry.models)))
        for job in list(self.jobs.values()):
            self.validate_job(job)
        self.answer_info_waiters()
        self.fill(entry)

    def on_disconnect(self, identity: bytes, message: Message) -> None:
        self.lose_worker(identity, "disconnected")

    def lose_worker(self, identity: bytes, reason: str) -> None:
        """Forget a worker; its chunks go back to their jobs' policies."""
        entry = self.workers.pop(identity, None)
        if entry is None:
            return
        del self.by_id[entry.id]
        log.info("worker %s left (%s) with %d chunks in flight", entry.name, reason,
                 len(entry.in_flight))
        entry.in_flight.clear()
        for job in list(self.jobs.values()):
            if job.policy:
                self.dispatch(job, job.policy.handle(WorkerLost(entry.id, at=self.clock())))
        self.fill_all()

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
        """Offer one slot to the jobs, oldest first; True if one took it."""
        if entry.identity not in self.workers:
            return False
        before = len(entry.in_flight)
        for job in list(self.jobs.values()):
            if job.policy:
                job.eligible[entry.id] = entry
                self.dispatch(job, job.policy.handle(WorkerReady(entry.id, at=self.clock())))
                if len(entry.in_flight) > before:
                    return True
        return False

    def dispatch(self, job: Job, assignments: list[Assign]) -> None:
        """Carry out a policy's assignments: each takes a slot now, and is sent once its input is here."""
        for assignment in assignments:
            entry = self.by_id.get(assignment.worker)
            if entry is None:  # the policy has not heard the worker is gone yet
                self.dispatch(job, job.policy.handle(WorkerLost(assignment.worker,
                                                                at=self.clock())))
                continue
            record = ChunkRecord(self.next_chunk_id, job, assignment.chunk, entry)
            self.next_chunk_id += 1
            entry.in_flight[record.id] = record
            job.unsent.append(record)
        self.send_ready_chunks(job)

    def send_ready_chunks(self, job: Job) -> None:
        """Send every assigned chunk of the job whose input has arrived."""
        waiting, job.unsent = job.unsent, []
        for record in waiting:
            if record.id not in record.worker.in_flight:
                continue  # its worker was lost meanwhile
            views = job.slices(record.chunk)
            if views is None:
                job.unsent.append(record)
                continue
            record.sent_at = self.clock()
            chunk = record.chunk
            self.send(record.worker.identity, Command.TASK, {
                "job": job.id, "chunk": record.id, "start": chunk.start, "count": chunk.count,
                "model": job.model, "digest": job.digest, "dtype": job.dtype,
                "item_shape": list(job.item_shape)},
                views)

    def answered_record(self, identity: bytes, message: Message) -> ChunkRecord | None:
        """The sent chunk a RESULT or FAILED answers; None for a late, duplicate or unknown one."""
        entry = self.workers.get(identity)
        record = entry.in_flight.get(message.header["chunk"]) if entry else None
        if record is None or record.sent_at is None or record.job.id not in self.jobs:
            log.info("dropped a reply for chunk %s (late, duplicate or cancelled)",
                     message.header["chunk"])
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
        compute = float(header["timings"]["compute"])
        job.account(entry, chunk, compute)
        self.send(job.client, Command.RESULT, {
            **header, "job": job.id, "worker": entry.name,
            "round_trip": self.clock() - record.sent_at}, message.payload)
        self.dispatch(job, job.policy.handle(ChunkDone(entry.id, chunk, compute,
                                                       at=self.clock())))
        if job.policy.finished:
            self.finish(job)
        self.fill(entry)

    def on_failed(self, identity: bytes, message: Message) -> None:
        record = self.answered_record(identity, message)
        if record is None:
            return
        chunk = record.chunk
        self.fail_job(record.job, f"items {chunk.start}..{chunk.stop - 1} failed on "
                                  f"{record.worker.name}: {message.header['error']}")

    # ----------------------------------------------------------------- jobs

    def on_submit(self, identity: bytes, message: Message) -> None:
        header = message.header
        job_id = header["job"]
        if job_id in self.jobs:
            raise ProtocolError(f"job {job_id} already exists")
        protocol.check_array_spec(header["dtype"], header["item_shape"])
        if not 0 < header["total"] <= protocol.MAX_ITEMS:
            raise ProtocolError(f"job total {header['total']} out of range")
        job = Job(job_id, identity, header["model"], header["dtype"],
                  tuple(header["item_shape"]), header["total"], self.clock())
        self.jobs[job_id] = job
        log.info("job %s: %d x %s %s for model %s", job_id, job.total, job.item_shape,
                 job.dtype, job.model)
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
        job.policy = make_policy(self.config.algo, job.total, [e.id for e in eligible], speeds,
                                 **self.config.params)
        return True

    def on_fetch(self, identity: bytes, message: Message) -> None:
        """Send a registered worker a model's files; an error reply if it is gone or changed.

        The files go out memory-mapped: however many workers fetch a model at once, its
        bytes are in memory once, in the page cache.
        """
        entry = self.workers.get(identity)
        name, digest = message.header["model"], message.header["digest"]
        try:
            if entry is None:
                raise ModelError("models are sent to registered workers only")
            spec, manifest = self.models.lookup(name)
            if manifest.digest != digest:
                raise ModelError(f"model {name!r} changed on the broker (now {manifest.digest[:12]}"
                                 f", asked for {digest[:12]})")
            size = sum(f.size for f in manifest.files)
            if size > protocol.MAX_MESSAGE_BYTES:
                raise ModelError(f"model {name!r} is {size:,} bytes, over the "
                                 f"{protocol.MAX_MESSAGE_BYTES:,}-byte message limit")
            contents = [mapped(spec.files()[f.name]) for f in manifest.files]
        except (ModelError, OSError) as exc:
            self.send(identity, Command.MODEL, {"model": name, "digest": digest, "files": [],
                                                "error": str(exc)})
            return
        entry.fetched[name] = entry.fetched.get(name, 0) + 1
        log.info("sending model %s (%d bytes) to %s", name, size, entry.name)
        self.send(identity, Command.MODEL, manifest.header(), contents)

    def on_data(self, identity: bytes, message: Message) -> None:
        header = message.header
        job = self.jobs.get(header["job"])
        if job is None or job.client != identity:
            return  # data of a job that failed or was never accepted: drop silently
        try:
            if len(message.payload) != 1:
                raise ProtocolError("DATA carries exactly one frame")
            job.add_block(header["start"], header["count"], message.payload[0])
        except ProtocolError as exc:
            self.fail_job(job, str(exc))
            return
        self.send_ready_chunks(job)

    def finish(self, job: Job) -> None:
        del self.jobs[job.id]
        summary = job.summary(self.clock())
        log.info("job %s done: %d items in %.3f s", job.id, job.total, summary["broker_seconds"])
        self.send(job.client, Command.DONE, {"job": job.id, "summary": summary})

    def fail_job(self, job: Job, error: str) -> None:
        """Tell the client why its job failed; free the slots its chunks held."""
        self.jobs.pop(job.id, None)
        log.warning("job %s failed: %s", job.id, error)
        self.send(job.client, Command.ERROR, {"error": error, "job": job.id})
        for entry in self.workers.values():
            for chunk_id in [i for i, r in entry.in_flight.items() if r.job is job]:
                del entry.in_flight[chunk_id]
        self.fill_all()

    # ----------------------------------------------------------------- info

    def on_info(self, identity: bytes, message: Message) -> None:
        """A snapshot of the registry; with ``wait_workers`` it is sent once that many joined."""
        wanted = message.header.get("wait_workers", 0)
        if not isinstance(wanted, int) or isinstance(wanted, bool):
            raise ProtocolError("INFO wait_workers must be an integer")
        if len(self.workers) >= wanted:
            self.send(identity, Command.INFO, self.snapshot())
        elif len(self.info_waiters) >= MAX_INFO_WAITERS:
            raise ProtocolError("too many INFO requests waiting for workers")
        else:
            self.info_waiters.append((identity, wanted))

    def answer_info_waiters(self) -> None:
        waiting, self.info_waiters = self.info_waiters, []
        for identity, wanted in waiting:
            if len(self.workers) >= wanted:
                self.send(identity, Command.INFO, self.snapshot())
            else:
                self.info_waiters.append((identity, wanted))

    def snapshot(self) -> dict[str, Any]:
        return {"policy": self.config.algo, "params": self.config.params,
                "workers": [entry.describe() for entry in self.workers.values()],
                "jobs": [{"job": job.id, "model": job.model, "total": job.total,
                          "done": job.done} for job in self.jobs.values()]}


def mapped(path: Path) -> Any:
    """A read-only memory map of a file (b"" for an empty one): a zero-copy frame."""
    with open(path, "rb") as handle:
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if path.stat().st_size \
            else b""


def serve(config: BrokerConfig, on_bound: Callable[[str], None] | None = None) -> None:
    """Bind, report the endpoint, and serve until SIGINT/SIGTERM."""
    context = zmq.Context()
    broker = Broker(config, context)
    signal.signal(signal.SIGTERM, broker.stop)
    signal.signal(signal.SIGINT, broker.stop)
    if on_bound:
        on_bound(broker.endpoint)
    try:
        broker.serve()
    finally:
        context.term()
