"""``FarmState``: the whole farm's scheduling as a pure state machine.

It holds the registry of workers, the jobs and their policies, the arbitration
between jobs, attempts and poison chunks, and the chunk caps.  Its one entry
point, ``handle(event) -> [instruction]``, takes what the broker decoded (or the
simulator made up) and returns the messages to send.  It reads no clock (every
event carries ``at``), touches no socket and does no I/O, so the broker and the
simulator run the same scheduling, and tests drive it with plain events.

The rules:

* Several jobs share the workers.  Every free slot is offered to the running
  jobs in order: highest priority first, then (``sharing="fair"``) the job
  holding the fewest chunks, then the oldest; each job's own policy decides
  whether to take it.
* A chunk assigned by a policy takes its worker's slot at once; the state asks
  the job's client for its input (NEED) and forwards the DATA as the TASK.
* Each assignment is an attempt with its own id.  A reply to an attempt no
  longer in flight is dropped, so every item is delivered once.
* Only what the evidence supports is charged to a chunk's items: a FAILED, or its
  worker dying while computing it.  A chunk charged on two devices is narrowed
  down by halves to the images that fail by themselves, which alone are given up
  and reported (FAILED); lost workers charge nothing, but no item runs more than
  ``max_runs`` times (``farm/broker/blame.py``).
* Chunks are capped at ``max_chunk_seconds`` of compute on the job's fastest
  worker (a quarter of that while jobs share the farm), and at the byte limit of
  a message.
* Silent workers and clients expire after ``liveness`` heartbeats; a lost
  worker's chunks go back to their jobs.  A job whose client vanished ends, but its
  chunks in flight finish: their results are held for a client resuming it.
* A job whose workers read its items from shared storage (``inputs``) gets its TASKs
  at once, without NEED and DATA; a worker that cannot read them is sent the bytes.
* Results workers kept across a lost broker, a lost worker or a vanished client
  (``Result.kept``) are passed to the job's client, or held (``farm.broker.kept``) until
  a resubmission naming the lost job comes; the ranges they cover are done without
  running again (``Job.delivered``).
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

from farm import defaults
from farm.broker import events as ev
from farm.broker.blame import Mark, halves, suspect
from farm.broker.churn import Churn
from farm.broker.jobs import ChunkRecord, Job, Worker
from farm.broker.kept import KeptResults, translate
from farm.broker.registry import WorkerEntry
from farm.policies import (
    Assign,
    Chunk,
    ChunkDone,
    ChunkFailed,
    Event,
    WorkerBusy,
    WorkerLost,
    WorkerReady,
    make_policy,
)
from farm.summary import FailedItems
from farm.wire.shapes import ENCODED, input_mismatch

log = logging.getLogger("farm.broker")

#: How jobs share free slots: "fair" (fewest slots held first) or "fifo" (oldest first).
SHARING = ("fair", "fifo")
#: Part of ``max_chunk_seconds`` that caps chunks while several jobs share the farm.
SHARED_CHUNK_FRACTION = 0.25
#: Ways a job ends, counted in INFO and metrics.
OUTCOMES = ("done", "failed", "cancelled", "timed_out", "expired")
#: Most jobs the farm holds at once.
MAX_JOBS = 1000
#: Failed attempts at retried ranges a job may spend; past it, a failing range is given up
#: whole (failures everywhere are not a few bad images).
RETRY_LIMIT = 1000


@dataclass(kw_only=True)
class SchedulingConfig:
    """What the state machine is told: the policy, the timers' counts, attempts, caps."""

    algo: str = defaults.POLICY
    params: dict[str, Any] = field(default_factory=dict)
    heartbeat: float = defaults.HEARTBEAT  # seconds between heartbeats to workers and clients
    liveness: int = defaults.LIVENESS  # heartbeats a peer may miss before it is declared gone
    max_attempts: int = defaults.MAX_ATTEMPTS  # charges that make items suspect on one device
    max_runs: int = defaults.MAX_RUNS  # runs of an item, for any reason, before it is given up
    sharing: str = defaults.SHARING  # see SHARING; priorities come first either way
    max_chunk_seconds: float = defaults.MAX_CHUNK_SECONDS  # chunk cap in compute s (0: none)

    def check(self) -> None:
        """ValueError on a bad policy, parameter or sharing rule."""
        make_policy(self.algo, 1, **self.params)
        if self.sharing not in SHARING:
            raise ValueError(f"sharing must be one of {', '.join(SHARING)}")


@dataclass
class FarmStats:
    """Counters of what went wrong and was recovered; in every INFO snapshot."""

    bad_messages: int = 0
    late_replies: int = 0  # replies to attempts no longer in flight: dropped
    requeued_chunks: int = 0
    abandoned_chunks: int = 0
    narrowed_chunks: int = 0  # suspect ranges cut in two, narrowing down to bad images
    charged_attempts: int = 0  # attempts failed, or cut short by their worker dying
    lost_attempts: int = 0  # attempts lost uncharged with their workers
    workers_expired: int = 0  # lost to silence
    workers_crashed: int = 0  # lost as their connection closed with no goodbye
    jobs_expired: int = 0
    unshared_workers: int = 0  # workers sent a job's bytes: they cannot read its shared inputs
    kept_results: int = 0  # results offered again by workers that lost their broker
    kept_delivered: int = 0  # ... of them passed on to the job's client
    kept_used: int = 0  # ranges a kept result delivered, not computed again


@dataclass(frozen=True, kw_only=True)
class FarmCounts:
    """The farm's numbers at one moment (the broker's metrics read them)."""

    jobs: dict[str, int]  # by state: queued, running
    workers: int
    chunks_waiting: int  # assigned, their input not back from the client yet
    outcomes: dict[str, int]  # jobs ended, by outcome
    stats: dict[str, int]  # FarmStats


class Observer(Protocol):
    """Who hears of workers and chunks as they come and go (the broker's metrics)."""

    def worker_joined(self, entry: Worker) -> None: ...

    def worker_left(self, entry: Worker) -> None: ...

    def chunk_done(
        self,
        entry: Worker,
        items: int,
        timings: dict[str, float],
        queued_s: float,
        round_trip_s: float,
    ) -> None: ...

    def chunk_failed(self, entry: Worker) -> None: ...


class FarmState:
    """The farm's scheduling state; ``handle`` is the only way in."""

    def __init__(
        self, config: SchedulingConfig, first_chunk_id: int = 1, observer: Observer | None = None
    ) -> None:
        config.check()
        self.config = config
        self.observer = observer
        self.workers: dict[bytes, Worker] = {}
        self.by_id: dict[str, Worker] = {}  # the same entries by policy worker id
        self.jobs: dict[str, Job] = {}
        self.running: dict[str, Job] = {}  # jobs with a policy (validated), by id
        self.order: list[Job] = []  # the running jobs in the order slots are offered
        self.placed: dict[str, tuple[int, int, int]] = {}  # each job's key in ``order``
        self.fastest: dict[str, tuple[float, str]] = {}  # model -> (rate, worker id)
        self.stats = FarmStats()
        self.churn = Churn()  # recent deaths and silences: chunks shorten under churn
        self.places: Counter[str] = Counter()  # connected workers per device (host/device)
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.next_chunk_id = first_chunk_id
        self.next_seq = 0  # submission order of jobs
        self.next_seq_sent = 0  # the order TASKs go out
        self.now = 0.0
        self.out: list[ev.Instruction] = []
        self.retries_added = False  # a range joined a retry line during this event
        self.kept = KeptResults()  # results of jobs this state does not know, kept by workers
        self.aliases: dict[str, str] = {}  # a job lost with a broker -> its resubmission here
        # jobs whose client vanished, by when: their chunks in flight still finish, and
        # their results are kept for the client's resumption (``KeptResults``)
        self.vanished: dict[str, float] = {}

    def handle(self, event: ev.FarmEvent) -> list[ev.Instruction]:
        """Apply one event; return the instructions it causes, in order."""
        self.now = max(self.now, event.at)
        if self.churn.since is None:
            self.churn.since = event.at
        self.out = []
        HANDLERS[type(event)](self, event)
        if self.retries_added:  # a retry may wait for a worker that is idle now
            self.retries_added = False
            self.fill_all()
        return self.out

    # -------------------------------------------------------------------- workers

    def on_worker_joined(self, event: ev.WorkerJoined) -> None:
        if event.worker in self.workers:
            self.lose_worker(event.worker, "re-registered")
        entry: Worker = WorkerEntry.from_facts(event.worker, event.facts)
        entry.last_seen = entry.joined_at = event.at
        self.workers[event.worker] = self.by_id[entry.id] = entry
        self.places[entry.place] += 1
        known = set(self.fastest)
        for model in entry.history:  # the speeds it brought: chunks are capped at once
            self.note_rate(model, entry)
        if set(self.fastest) != known:
            self.cap_all()
        if self.observer:
            self.observer.worker_joined(entry)
        log.info(
            "worker %s joined (%s, %d compute thread%s; loaded: %s; can run: %s)",
            entry.name,
            entry.backend,
            entry.threads,
            "" if entry.threads == 1 else "s",
            ", ".join(sorted(entry.loaded)) or "none",
            ", ".join(sorted(entry.models)),
            extra={"event": "worker_joined", "worker": entry.name, "backend": entry.backend},
        )
        self.fill(entry)

    def on_worker_left(self, event: ev.WorkerLeft) -> None:
        if event.crashed and event.worker in self.workers:
            self.stats.workers_crashed += 1
            self.churn.lost(event.at)
        self.lose_worker(event.worker, event.reason, event.crashed)

    def on_worker_heard(self, event: ev.WorkerHeard) -> None:
        entry = self.heard_worker(event.worker)
        if entry is None:
            self.out.append(ev.DropWorker(worker=event.worker))  # we dropped it: re-register
            return
        if event.computed is not None:
            entry.note_computed(event.computed, event.at)
        if event.engines is not None:
            entry.note_engines(event.engines)

    def heard_worker(self, identity: bytes) -> Worker | None:
        """The worker's entry, its silence reset; None if the state does not know it."""
        entry = self.workers.get(identity)
        if entry is not None:
            entry.last_seen = self.now
        return entry

    def lose_worker(self, identity: bytes, reason: str, crashed: bool = False) -> None:
        """Forget a worker; its chunks go back to their jobs.  Only the one it was computing
        when it ``crashed`` is charged an attempt: the others waited behind it, and a worker
        lost to silence or a goodbye says nothing about its chunks."""
        entry = self.workers.pop(identity, None)
        if entry is None:
            return
        del self.by_id[entry.id]
        self.places[entry.place] -= 1
        if not self.places[entry.place]:
            del self.places[entry.place]
        records = list(entry.in_flight.values())
        entry.in_flight.clear()
        log.info(
            "worker %s left (%s) with %d chunks in flight",
            entry.name,
            reason,
            len(records),
            extra={"event": "worker_left", "worker": entry.name, "reason": reason},
        )
        sent = [
            record
            for record in records
            if record.sent_at is not None and record.job.outcome is None
        ]
        computing = min(sent, key=lambda r: r.sent_seq) if crashed and sent else None
        for record in records:
            job = record.job
            job.pending.pop(record.id, None)
            if job.outcome is not None or job.policy is None:
                continue
            if record is computing:
                self.attempt_failed(
                    record,
                    f"worker {entry.name} died while computing it ({reason})",
                    charged=True,
                    worker_lost=True,
                )
            elif record.sent_at is not None:
                self.attempt_failed(
                    record,
                    f"worker {entry.name} was lost ({reason})",
                    charged=False,
                    worker_lost=True,
                )
            elif record.retry:  # it never left: back in line, uncharged
                job.retries.appendleft(record.chunk)
        # a worker that reconnected (a new socket, the same name) keeps its metrics series
        if self.observer and all(other.name != entry.name for other in self.workers.values()):
            self.observer.worker_left(entry)
        slowed = [model for model, (_, fastest) in self.fastest.items() if fastest == entry.id]
        for model in slowed:
            self.find_fastest(model)
        if slowed or self.churn.losses:
            self.cap_all()  # the fastest worker, or the rate of losses per worker, changed
        for job in list(self.running.values()):
            self.step(job, WorkerLost(entry.id, at=self.now))
        self.fill_all()

    # --------------------------------------------------------------------- chunks

    def answered_record(self, identity: bytes, job_id: str, chunk_id: int) -> ChunkRecord | None:
        """The attempt a RESULT or FAILED answers; None for a late, duplicate or unknown one.

        A reply from a worker the state no longer knows (declared dead, then back)
        gets DropWorker: the worker registers afresh.
        """
        entry = self.heard_worker(identity)
        record = entry.in_flight.get(chunk_id) if entry else None
        if (
            entry is not None
            and record is not None
            and record.sent_at is not None
            and record.job.outcome
            and record.job.id == job_id
        ):
            del entry.in_flight[record.id]  # a chunk of a job that ended: its slot is free
            self.fill(entry)
            return None
        if (
            entry is None
            or record is None
            or record.sent_at is None
            or record.job.id not in self.jobs
            or record.job.id != job_id
        ):
            self.stats.late_replies += 1
            log.info(
                "dropped a reply for chunk %s from %s (late, duplicate or cancelled)",
                chunk_id,
                entry.name if entry else identity.hex(),
            )
            if entry is None:
                self.out.append(ev.DropWorker(worker=identity))
            return None
        del entry.in_flight[record.id]
        return record

    def on_result_arrived(self, event: ev.ResultArrived) -> None:
        if event.kept:
            self.take_kept(event)
            return
        if event.job in self.vanished:
            self.keep_vanished(event)
            return
        record = self.answered_record(event.worker, event.job, event.chunk)
        if record is None:
            return
        job, chunk, entry = record.job, record.chunk, record.worker
        if event.problem:
            self.fail_job(
                job,
                f"worker {entry.name} returned a bad result for items "
                f"{chunk.start}..{chunk.stop - 1}: {event.problem}",
            )
            return
        job.output_shape = event.output_shape
        compute = float(event.timings["compute"])
        job.account(entry, chunk, compute, float(event.timings.get("load", 0.0)))
        self.note_rate(job.model, entry)
        origin, sent = job.submitted_at, record.sent_at or record.assigned_at
        if not job.delivered or not job.delivered.covers(chunk.start, chunk.stop):
            self.out.append(
                ev.SendResult(
                    client=job.client,
                    result=event,
                    worker=entry.name,
                    attempt=record.attempt,
                    trace=(record.assigned_at - origin, sent - origin, event.at - origin),
                )
            )
        log.debug("delivered items %d..%d of job %s", chunk.start, chunk.stop - 1, job.id)
        self.cap_chunks(job)  # speeds changed
        if self.observer:
            self.observer.chunk_done(
                entry, chunk.count, event.timings, sent - record.assigned_at, event.at - sent
            )
        job.evidence.settle(chunk)
        if record.retry:
            job.retry_items -= chunk.count
        else:
            self.step(job, ChunkDone(entry.id, chunk, compute, at=self.now))
        self.finish_if_done(job)
        self.fill(entry)

    def take_kept(self, event: ev.ResultArrived) -> None:
        """A result a worker kept and offers again: of a job this broker runs (the worker
        was counted lost meanwhile), or of one lost with a broker: to its resubmission's
        client if it came, else held until it does (or for a while)."""
        entry = self.heard_worker(event.worker)
        if event.problem:
            log.info("dropped a kept result: %s", event.problem)
            return
        running = self.running.get(event.job)
        if running is not None:
            self.take_late(running, event, entry.name if entry else "")
            return
        self.hold_or_pass(event, entry.name if entry else "")

    def hold_or_pass(self, event: ev.ResultArrived, worker: str) -> None:
        """A kept result of a job this state no longer runs: to the job that resubmitted it,
        if one did, else held for one that will."""
        self.stats.kept_results += 1
        job = self.jobs.get(self.aliases.get(event.job, ""))
        if job is None:
            self.kept.add(event)
        else:
            self.pass_kept(job, event, worker)

    def pass_kept(self, job: Job, event: ev.ResultArrived, worker: str) -> None:
        """A kept result of an earlier submission of ``job``: to its client, and the items
        both hold are done in ``job`` when next handed out."""
        runs = job.earlier.get(event.job)
        self.forward_kept(job.client, event, worker)
        if runs and job.runs:
            for first, stop in translate(runs, job.runs, event.start, event.count):
                job.delivered.add(first, stop)
            self.settle_delivered(job)

    def take_late(self, job: Job, event: ev.ResultArrived, worker: str) -> None:
        """A kept result of a running job, from a worker counted lost when it was computing
        it: the client gets it now, and the range, wherever its policy holds it, is done
        when next assigned.  A range delivered before is not sent twice."""
        chunk = Chunk(event.start, event.count)
        if chunk.stop > job.total or job.output_shape not in (None, event.output_shape):
            log.info("dropped a kept result of job %s that does not fit it", job.id)
            return
        if job.delivered.covers(chunk.start, chunk.stop):
            return
        job.output_shape = event.output_shape
        job.delivered.add(chunk.start, chunk.stop)
        self.stats.kept_results += 1
        self.forward_kept(job.client, event, worker)
        self.settle_delivered(job)

    def settle_delivered(self, job: Job) -> None:
        """The job's attempts in flight whose items kept results delivered are answered now:
        their workers drop them (CANCEL of the attempt) and take other chunks."""
        for entry in list(self.workers.values()):
            if job.outcome is not None:
                return
            covered = [
                record
                for record in entry.in_flight.values()
                if record.job is job and job.delivered.covers(record.chunk.start, record.chunk.stop)
            ]
            for record in covered:
                del entry.in_flight[record.id]
                job.pending.pop(record.id, None)
                if record.sent_at is not None:
                    self.out.append(ev.SendCancel(peer=entry.identity, job=job.id, chunk=record.id))
                self.complete_delivered(job, record.chunk, entry, record.retry)
            if covered:
                self.fill(entry)

    def complete_delivered(self, job: Job, chunk: Chunk, entry: Worker, retry: bool) -> None:
        """A range kept results delivered, handed out again: done now, in no worker's
        share; the policy hears it done at ``entry``'s own speed (it learns nothing)."""
        self.stats.kept_used += 1
        job.kept_items += chunk.count
        rate = entry.history[job.model].rate if job.model in entry.history else 0.0
        rate = rate or self.fastest.get(job.model, (0.0, ""))[0]
        compute = chunk.count / rate if rate > 0 else 0.0
        job.evidence.settle(chunk)
        if job.started_at is None:
            job.started_at = self.now
        if retry:
            job.retry_items -= chunk.count
        else:
            self.step(job, ChunkDone(entry.id, chunk, compute, at=self.now))
        self.finish_if_done(job)

    def keep_vanished(self, event: ev.ResultArrived) -> None:
        """A result of a job whose client vanished: its slot frees, and it is kept for a
        client that resumes the job naming it."""
        entry = self.heard_worker(event.worker)
        record = entry.in_flight.pop(event.chunk, None) if entry else None
        if record is None or record.job.id != event.job:
            self.stats.late_replies += 1
            return
        if not event.problem:
            self.hold_or_pass(event, record.worker.name)
        self.fill(record.worker)

    def forward_kept(self, client: bytes, result: ev.ResultArrived, worker: str) -> None:
        self.stats.kept_delivered += 1
        log.debug(
            "delivered kept items %d..%d of job %s",
            result.start,
            result.start + result.count - 1,
            result.job,
        )
        self.out.append(
            ev.SendResult(
                client=client, result=result, worker=worker, attempt=1, trace=None, kept=True
            )
        )

    def on_failure_arrived(self, event: ev.FailureArrived) -> None:
        """A chunk failed on its worker: a model error fails the job, anything else retries."""
        record = self.answered_record(event.worker, event.job, event.chunk)
        if record is None:
            return
        chunk = record.chunk
        if event.unshared:
            self.send_bytes(record, event.error)
            return
        if event.fatal:
            self.fail_job(
                record.job,
                f"items {chunk.start}..{chunk.stop - 1} failed on "
                f"{record.worker.name}: {event.error}",
            )
            return
        self.attempt_failed(record, f"{record.worker.name}: {event.error}", event.charge)
        self.fill(record.worker)

    def send_bytes(self, record: ChunkRecord, error: str) -> None:
        """The worker cannot read the job's shared inputs: it gets their bytes from now on
        (NEED and DATA), and the chunk runs again, uncharged."""
        job, entry = record.job, record.worker
        if entry.id not in job.unshared:
            job.unshared.add(entry.id)
            self.stats.unshared_workers += 1
            log.warning(
                "job %s: worker %s cannot read the shared inputs (%s): sending it their bytes",
                job.id,
                entry.name,
                error,
                extra={"event": "inputs_unshared", "job": job.id, "worker": entry.name},
            )
        self.attempt_failed(record, f"{entry.name}: {error}", charged=False)
        self.fill(entry)

    def attempt_failed(
        self, record: ChunkRecord, error: str, charged: bool, worker_lost: bool = False
    ) -> None:
        """Mark the attempt; then run the range again, cut it, or give it up.

        A charged range leaves its policy for the job's retry line, which runs it on
        another device; a suspect one is cut in halves first.  ``worker_lost``: the
        policy's ``WorkerLost`` (which follows) returns the worker's other chunks.
        """
        job, chunk = record.job, record.chunk
        job.evidence.add(Mark(chunk.start, chunk.stop, record.worker.place, error, charged))
        if charged:
            self.stats.charged_attempts += 1
            if self.observer:
                self.observer.chunk_failed(record.worker)
        else:
            self.stats.lost_attempts += 1
        runs = job.evidence.tally(chunk).runs
        if runs >= self.config.max_runs:
            self.give_up(
                record,
                f"ran {runs} times without a result, its workers lost or "
                f"failing each time (the images may be fine); last: {error}",
            )
            return
        if not record.retry:
            if not charged:
                self.stats.requeued_chunks += 1
                if not worker_lost:
                    self.step(job, ChunkFailed(record.worker.id, chunk, True, at=self.now))
                return
            self.step(job, ChunkFailed(record.worker.id, chunk, False, at=self.now))
            job.retry_items += chunk.count
            record.retry = True  # its range belongs to the retry line now
        log.info(
            "job %s: items %d..%d: attempt %d %s (%s)",
            job.id,
            chunk.start,
            chunk.stop - 1,
            record.attempt,
            "failed" if charged else "lost",
            error,
        )
        self.retry(record, error, charged)

    def retry(self, record: ChunkRecord, error: str, charged: bool) -> None:
        """Put a range in its job's retry line: as it is, or (suspect) in halves; a single
        image charged by itself on two devices (or ``max_attempts`` times) is given up."""
        job, chunk = record.job, record.chunk
        self.retries_added = True
        if not charged:
            self.stats.requeued_chunks += 1
            job.retries.appendleft(chunk)
            return
        job.retry_failures += 1
        tally = job.evidence.tally(chunk, alone=chunk.count == 1)
        if job.retry_failures > RETRY_LIMIT:
            self.give_up(
                record,
                f"{error} (retries stopped after {RETRY_LIMIT} failed "
                f"attempts: the failures are not confined to a few images)",
            )
        elif not suspect(tally, self.config.max_attempts):
            self.stats.requeued_chunks += 1
            job.retries.appendleft(chunk)
        elif chunk.count == 1:
            self.give_up(
                record,
                f"failed by itself {tally.charges} times on {tally.devices} "
                f"device(s); last: {error}",
            )
        else:
            self.stats.narrowed_chunks += 1
            log.warning(
                "job %s: items %d..%d failed on %d device(s); narrowing them down",
                job.id,
                chunk.start,
                chunk.stop - 1,
                tally.devices,
            )
            for piece in reversed(halves(chunk)):
                job.retries.appendleft(piece)

    def give_up(self, record: ChunkRecord, message: str) -> None:
        """Report the record's items failed (FAILED to the client) with ``message``."""
        job, chunk = record.job, record.chunk
        self.stats.abandoned_chunks += 1
        job.abandoned.append(FailedItems(chunk.start, chunk.count, message))
        log.warning(
            "job %s: items %d..%d given up: %s",
            job.id,
            chunk.start,
            chunk.stop - 1,
            message,
            extra={
                "event": "chunk_abandoned",
                "job": job.id,
                "start": chunk.start,
                "count": chunk.count,
            },
        )
        self.out.append(
            ev.SendFailed(
                client=job.client,
                job=job.id,
                chunk=record.id,
                start=chunk.start,
                count=chunk.count,
                error=message,
            )
        )
        if record.retry:
            job.retry_items -= chunk.count
        else:
            self.step(job, ChunkFailed(record.worker.id, chunk, False, at=self.now))
        self.finish_if_done(job)

    # ---------------------------------------------------------------------- slots

    def fill(self, entry: Worker) -> None:
        """Offer all of one worker's free slots to the jobs."""
        while entry.free_slots > 0 and self.offer_slot(entry):
            pass

    def fill_all(self) -> None:
        """Offer free slots breadth-first: every worker's first slot before anyone's second."""
        if not self.running:
            return
        progress = True
        while progress:
            progress = False
            for entry in list(self.workers.values()):
                if entry.free_slots > 0 and self.offer_slot(entry):
                    progress = True

    def offer_slot(self, entry: Worker) -> bool:
        """Offer one slot to the jobs in ``job_order``; True if one took it."""
        if entry.identity not in self.workers:
            return False
        before, done_before = len(entry.in_flight), self.stats.kept_used
        for job in self.job_order():
            job.eligible[entry.id] = entry
            if job.retries and self.run_retry(job, entry):
                return True
            self.step(job, WorkerReady(entry.id, at=self.now))
            if len(entry.in_flight) > before or self.stats.kept_used > done_before:
                return True  # a chunk, or a range a kept result had done: offer the slot again
            entry.offered.add(job.id)  # its policy keeps the worker as idle
        return False

    def job_order(self) -> list[Job]:
        """Running jobs in the order they are offered a free slot: highest priority first,
        then (fair sharing) the fewest chunks in flight, then the oldest."""
        return list(self.order)

    def order_key(self, job: Job) -> tuple[int, int, int]:
        return -job.priority, job.in_flight if self.config.sharing == "fair" else 0, job.seq

    def place(self, job: Job) -> None:
        """Put the job in ``order`` by its key now (kept in ``placed``)."""
        self.placed[job.id] = self.order_key(job)
        bisect.insort(self.order, job, key=self.placed_key)

    def unplace(self, job: Job) -> None:
        index = bisect.bisect_left(self.order, self.placed[job.id], key=self.placed_key)
        del self.order[index]
        del self.placed[job.id]

    def placed_key(self, job: Job) -> tuple[int, int, int]:
        return self.placed[job.id]

    def slots_taken(self, entry: Worker, taker: Job | None) -> None:
        """The worker's last free slot went to ``taker`` (None: a range from a retry line,
        which no policy knows of): other jobs' policies that counted it as idle (jobs it was
        offered to and declined) hear it is busy."""
        offered, entry.offered = entry.offered, set()
        for job_id in sorted(
            offered, key=lambda j: self.running[j].seq if j in self.running else -1
        ):
            job = self.running.get(job_id)
            if (
                job is not None
                and job is not taker
                and job.policy is not None
                and entry.id in job.policy.idle
            ):
                self.step(job, WorkerBusy(entry.id, at=self.now))

    def step(self, job: Job, event: Event) -> None:
        """Feed one event to the job's policy and carry out its assignments.  A policy that
        raises (on parameters a client chose, say) fails its own job, not the farm."""
        if job.outcome is not None or job.policy is None:
            return
        try:
            assignments = job.policy.handle(event)
            if self.placed[job.id] != self.order_key(job):  # it holds more, or fewer
                self.unplace(job)
                self.place(job)
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
            if entry is None:  # the worker is being lost, and the policy hears of it next:
                # take the chunk back and the worker out of its idle ones (a WorkerLost now
                # would return the worker's other chunks while they are being settled)
                self.step(job, WorkerBusy(assignment.worker, at=self.now))
                self.step(job, ChunkFailed(assignment.worker, assignment.chunk, True, at=self.now))
                continue
            self.assign(job, assignment.chunk, entry)
            if entry.free_slots <= 0 and len(self.running) > 1:
                self.slots_taken(entry, job)

    def run_retry(self, job: Job, entry: Worker) -> bool:
        """Give the worker's free slot to the first range in the job's retry line that it
        may run: one no worker on its device failed, unless no other device is left.
        The job's policy, which does not know of it, hears the worker is busy if it
        thought it idle.  False if the worker may run none."""
        for index, chunk in enumerate(job.retries):
            blamed = job.evidence.devices_charging(chunk)
            if entry.place not in blamed or not self.other_place(entry.place, blamed):
                del job.retries[index]
                self.assign(job, chunk, entry, retry=True)
                if entry.free_slots <= 0:
                    self.slots_taken(entry, None)
                return True
        return False

    def other_place(self, place: str, blamed: set[str]) -> bool:
        """Whether a connected worker runs on a device other than ``place`` and ``blamed``."""
        others = len(self.places) - (place in self.places)
        return others > sum(1 for p in blamed if p != place and p in self.places)

    def assign(self, job: Job, chunk: Chunk, entry: Worker, retry: bool = False) -> None:
        """A new attempt: it takes the worker's slot now and asks the client for its input
        (or sends the TASK at once when the worker reads the items itself).  A range a
        kept result delivered is done at once instead."""
        if job.delivered and job.delivered.covers(chunk.start, chunk.stop):
            self.complete_delivered(job, chunk, entry, retry)
            return
        record = ChunkRecord(
            self.next_chunk_id,
            job,
            chunk,
            entry,
            job.attempt_of(chunk),
            assigned_at=self.now,
            retry=retry,
        )
        self.next_chunk_id += 1
        entry.in_flight[record.id] = record
        if job.started_at is None:
            job.started_at = self.now
        if job.inputs is not None and entry.id not in job.unshared:  # the worker reads them
            located = job.inputs.locate(chunk.start, chunk.count)
            self.send_task(record, located.payload, located.stored, located.place)
            return
        job.pending[record.id] = record
        self.out.append(
            ev.SendNeed(
                client=job.client, job=job.id, chunk=record.id, start=chunk.start, count=chunk.count
            )
        )

    def on_data_arrived(self, event: ev.DataArrived) -> None:
        """A chunk's input from its client: forward it to the chunk's worker as the TASK."""
        job = self.jobs.get(event.job)
        if job is None or job.client != event.client:
            return  # data of a job that failed or was dropped: nothing waits for it
        job.client_seen = event.at
        record = job.pending.pop(event.chunk, None)
        if record is None or record.id not in record.worker.in_flight:
            return  # its worker was lost meanwhile: the chunk was requeued
        if event.problem is not None:
            self.fail_job(job, event.problem)
            return
        self.send_task(record, event.payload)

    def send_task(
        self,
        record: ChunkRecord,
        payload: Any,
        stored: Literal["files", "npy"] | None = None,
        place: Any = None,
    ) -> None:
        """The attempt's TASK to its worker: its items (``payload``), or where they lie."""
        job = record.job
        record.sent_at = self.now
        record.sent_seq = self.next_seq_sent
        self.next_seq_sent += 1
        chunk = record.chunk
        job.items_run += chunk.count
        self.out.append(
            ev.SendTask(
                worker=record.worker.identity,
                job=job.id,
                chunk=record.id,
                attempt=record.attempt,
                start=chunk.start,
                count=chunk.count,
                model=job.model,
                digest=job.digest,
                dtype=job.dtype,
                item_shape=job.item_shape,
                engine=job.options.engine,
                exif_rotate=job.options.exif_rotate,
                payload=payload,
                stored=stored,
                place=place,
            )
        )

    # ----------------------------------------------------------------------- caps

    def note_rate(self, model: str, entry: Worker) -> None:
        """Keep the fastest rate per model current as one worker's rate moves (O(1) unless
        the fastest worker slowed down).  A rate of a worker since lost stands until a
        connected worker has one: new processes must not run uncapped chunks."""
        rate = entry.history[model].rate
        best = self.fastest.get(model)
        if best is None or rate >= best[0] or best[1] not in self.by_id:
            self.fastest[model] = (rate, entry.id)
        elif best[1] == entry.id:
            self.find_fastest(model)

    def find_fastest(self, model: str) -> None:
        rates = [
            (entry.history[model].rate, entry.id)
            for entry in self.workers.values()
            if model in entry.history
        ]
        if rates:
            self.fastest[model] = max(rates)

    def cap_all(self) -> None:
        for job in self.running.values():
            self.cap_chunks(job)

    def cap_chunks(self, job: Job) -> None:
        """Cap the job's chunks at its byte limit and at ``max_chunk_seconds`` of compute on
        its fastest worker, once a speed on its model is known; while several jobs share
        the farm, at ``SHARED_CHUNK_FRACTION`` of that, so every job's turn on a worker
        comes round quickly (a chunk queued on a worker waits for the one running); and
        under churn, at the length that loses least to it (``farm/broker/churn.py``)."""
        assert job.policy is not None
        job.policy.max_chunk = job.max_chunk
        fastest = self.fastest.get(job.model, (0.0, ""))[0]
        seconds = self.config.max_chunk_seconds
        if len(self.running) > 1:
            seconds *= SHARED_CHUNK_FRACTION
        churn = self.churn.chunk_seconds(len(self.workers), self.now)
        if churn is not None and seconds > 0:
            seconds = min(seconds, churn)
        if fastest > 0 and seconds > 0:  # min() first: a rate may be huge, even inf
            job.policy.max_chunk = max(1, int(min(job.max_chunk, fastest * seconds)))

    # ----------------------------------------------------------------------- jobs

    def on_job_submitted(self, event: ev.JobSubmitted) -> None:
        refusal = self.refusal(event)
        if refusal:
            self.stats.bad_messages += 1
            self.out.append(
                ev.SendError(peer=event.client, error=refusal, job=event.job[:100] or None)
            )
            return
        if self.pass_on_kept(event):
            return
        config = self.config
        algo, params = event.options.policy(config.algo, config.params)
        job = Job(
            event.job,
            event.client,
            event.model_name,
            event.dtype,
            event.item_shape,
            event.total,
            event.at,
            config.liveness * max(config.heartbeat, event.heartbeat),
            event.options,
            algo,
            params,
            self.next_seq,
            inputs=event.inputs,
            runs=event.runs,
            earlier=event.earlier,
        )
        self.next_seq += 1
        self.jobs[job.id] = job
        for earlier in job.earlier:
            self.aliases[earlier] = job.id
        if len(self.jobs) > 1:
            for each in self.jobs.values():
                each.shared = True
        log.info(
            "job %s: %d x %s %s for model %s, policy %s, priority %d",
            job.id,
            job.total,
            job.item_shape,
            job.dtype,
            job.model,
            algo,
            job.priority,
            extra={
                "event": "job_submitted",
                "job": job.id,
                "model": job.model,
                "items": job.total,
                "policy": algo,
                "priority": job.priority,
                "client": job.options.client,
            },
        )
        if self.start_job(job, event.model):
            self.fill_all()

    def pass_on_kept(self, event: ev.JobSubmitted) -> bool:
        """A resubmission after a lost broker, with results of its earlier submissions held
        here: they go to the client, which submits again what is still missing (True).  The
        job is not made: its items would be computed twice."""
        kept = self.kept.take(tuple(event.earlier)) if event.earlier else []
        for result in kept:
            entry = self.workers.get(result.worker)
            self.forward_kept(event.client, result, entry.name if entry else "")
        if kept:
            self.out.append(
                ev.SendError(
                    peer=event.client,
                    job=event.job,
                    error=f"{len(kept)} results kept from before the broker restarted were "
                    f"passed on: submit what is still missing",
                    resubmit=True,
                )
            )
        return bool(kept)

    def refusal(self, event: ev.JobSubmitted) -> str | None:
        """Why a SUBMIT cannot even become a job, or None."""
        if not 0 < len(event.job) <= 100:
            return "SUBMIT 'job' must be an id of 1 to 100 characters"
        if event.job in self.jobs:
            return f"job {event.job} already exists"
        if len(self.jobs) >= MAX_JOBS:
            return f"the broker holds {MAX_JOBS} jobs already; try later"
        return None

    def start_job(self, job: Job, model: ev.ModelFound | str) -> bool:
        """Check the job against its model and make its policy; fail the job if it cannot run.

        Every worker can run every model (it fetches the files it lacks), so a valid job
        gets its policy at once, told the workers connected now and their speeds on this
        model from earlier jobs.
        """
        if isinstance(model, str):
            self.fail_job(job, model)
            return False
        problem = input_mismatch(
            job.model, model.item_shape, model.layout, job.dtype, job.item_shape
        )
        if problem:
            self.fail_job(job, problem)
            return False
        if job.dtype != ENCODED:  # a 1-channel model's 1 x H x W items are its H x W x 1
            job.item_shape = tuple(model.item_shape)
        if job.dtype == ENCODED:
            job.decoded_bytes = math.prod(model.item_shape) * model.crops
        job.digest = model.digest
        eligible = list(self.workers.values())
        speeds = {
            entry.id: entry.history[job.model].rate
            for entry in eligible
            if job.model in entry.history
        }
        try:
            job.policy = make_policy(
                job.algo, job.total, [e.id for e in eligible], speeds, **job.params
            )
        except Exception as exc:  # a job's own parameters: ValueError, or what odd values provoke
            self.fail_job(job, f"job policy: {exc}")
            return False
        self.running[job.id] = job
        self.place(job)
        self.cap_all()  # a second job shortens everyone's chunks
        return True

    def on_job_cancelled(self, event: ev.JobCancelled) -> None:
        """A client stops its job."""
        job = self.client_job(event.client, event.job)
        if job is not None:
            self.cancel_job(job, "cancelled", "cancelled by the client")

    def on_client_left(self, event: ev.ClientLeft) -> None:
        """A client's connection closed: nobody takes its jobs' results any more."""
        for job in [job for job in self.jobs.values() if job.client == event.client]:
            self.stats.jobs_expired += 1
            log.warning(
                "job %s dropped: its client's connection closed",
                job.id,
                extra={"event": "job_ended", "job": job.id, "outcome": "expired"},
            )
            self.end_job(job, "expired")

    def on_client_heard(self, event: ev.ClientHeard) -> None:
        job = self.client_job(event.client, event.job)
        if job is not None:
            job.client_seen = event.at

    def client_job(self, client: bytes, job_id: str) -> Job | None:
        """The client's job, or None after telling the client the farm has no such job."""
        job = self.jobs.get(job_id)
        if job is None or job.client != client:
            self.out.append(
                ev.SendError(
                    peer=client,
                    error=f"the broker has no job {job_id[:100]}",
                    job=job_id[:100],
                    unknown_job=True,
                )
            )
            return None
        return job

    def finish_if_done(self, job: Job) -> None:
        if job.outcome is None and job.finished:
            summary = job.summary(self.now)
            self.end_job(job, "done")
            log.info(
                "job %s done: %d items in %.3f s",
                job.id,
                job.total,
                summary.broker_seconds,
                extra={
                    "event": "job_ended",
                    "job": job.id,
                    "outcome": "done",
                    "seconds": summary.broker_seconds,
                },
            )
            self.out.append(ev.SendDone(client=job.client, job=job.id, summary=summary))

    def fail_job(self, job: Job, error: str) -> None:
        """Tell the client why its job failed; free the slots its chunks held."""
        log.warning(
            "job %s failed: %s",
            job.id,
            error,
            extra={"event": "job_ended", "job": job.id, "outcome": "failed"},
        )
        self.out.append(ev.SendError(peer=job.client, error=error, job=job.id))
        self.end_job(job, "failed")

    def cancel_job(self, job: Job, outcome: str, reason: str) -> None:
        """Stop a job and tell its client why, with what finished."""
        log.info(
            "job %s %s: %s",
            job.id,
            outcome.replace("_", " "),
            reason,
            extra={"event": "job_ended", "job": job.id, "outcome": outcome},
        )
        summary = job.summary(self.now)
        self.end_job(job, outcome)
        self.out.append(ev.SendCancel(peer=job.client, job=job.id, reason=reason, summary=summary))

    def end_job(self, job: Job, outcome: str) -> None:
        """Forget a job.  Chunks still waiting for input are dropped; workers running its
        chunks are told to stop, and their slots free when they answer."""
        self.jobs.pop(job.id, None)
        for earlier in job.earlier:
            self.aliases.pop(earlier, None)
        if self.running.pop(job.id, None) is not None:
            self.unplace(job)
        job.outcome = outcome
        self.outcomes[outcome] += 1
        job.pending.clear()
        job.retries.clear()
        for entry in self.workers.values():
            records = [r for r in entry.in_flight.values() if r.job is job]
            for record in records:
                if record.sent_at is None:
                    del entry.in_flight[record.id]
            if outcome not in ("done", "expired") and any(r.sent_at is not None for r in records):
                self.out.append(ev.SendCancel(peer=entry.identity, job=job.id))
        if outcome == "expired":  # what its workers are computing is kept for a resumption
            self.vanished[job.id] = self.now
        self.cap_all()  # one job fewer: longer chunks may do
        self.fill_all()

    # ---------------------------------------------------------------------- timers

    def on_tick(self, event: ev.Tick) -> None:
        """Drop silent workers and jobs whose client went silent; cancel overdue jobs."""
        for identity, entry in list(self.workers.items()):
            silent = event.at - entry.last_seen
            if silent > self.worker_expiry(entry):
                self.stats.workers_expired += 1
                self.churn.lost(event.at)
                self.lose_worker(identity, f"silent for {silent:.1f} s")
        if self.churn.forget(event.at):
            self.cap_all()
        self.kept.expire(event.at)
        while self.vanished and next(iter(self.vanished.values())) < event.at - self.kept.seconds:
            del self.vanished[next(iter(self.vanished))]
        for job in list(self.jobs.values()):
            silent = event.at - job.client_seen
            if silent > job.client_expiry:
                self.stats.jobs_expired += 1
                log.warning(
                    "job %s dropped: its client was silent for %.1f s",
                    job.id,
                    silent,
                    extra={"event": "job_ended", "job": job.id, "outcome": "expired"},
                )
                self.end_job(job, "expired")
            elif job.deadline is not None and event.at > job.deadline:
                self.cancel_job(
                    job, "timed_out", f"the job's timeout of {job.options.timeout:g} s passed"
                )

    def worker_expiry(self, entry: Worker) -> float:
        return self.config.liveness * max(self.config.heartbeat, entry.heartbeat)

    # ------------------------------------------------------------------------ views

    def describe(self, now: float) -> dict[str, Any]:
        """The state's part of ``farm status`` at ``now``: counters, workers, jobs."""
        return {
            "policy": self.config.algo,
            "params": self.config.params,
            "sharing": self.config.sharing,
            "heartbeat": self.config.heartbeat,
            "liveness": self.config.liveness,
            "stats": asdict(self.stats),
            "jobs_ended": dict(self.outcomes),
            "workers": [entry.describe(now) for entry in self.workers.values()],
            "jobs": [job.describe(now) for job in self.job_order()],
        }

    def counts(self) -> FarmCounts:
        """The farm's numbers now; safe to call from another thread (single reads of the
        state's dicts, atomic under the GIL)."""
        jobs = list(self.jobs.values())
        return FarmCounts(
            jobs=Counter(job.state() for job in jobs),
            workers=len(self.workers),
            chunks_waiting=sum(len(job.pending) for job in jobs),
            outcomes=dict(self.outcomes),
            stats=asdict(self.stats),
        )

    def awaited_input(self, job_id: str, chunk_id: int) -> ChunkRecord | None:
        """The attempt whose input (DATA) is awaited as ``chunk_id`` of ``job_id``, if any."""
        job = self.jobs.get(job_id)
        return job.pending.get(chunk_id) if job is not None else None

    def awaited_result(self, worker: bytes, chunk_id: int) -> ChunkRecord | None:
        """The attempt ``worker`` holds as ``chunk_id`` (a RESULT would answer it), if any."""
        entry = self.workers.get(worker)
        return entry.in_flight.get(chunk_id) if entry is not None else None


HANDLERS: dict[type, Any] = {
    ev.WorkerJoined: FarmState.on_worker_joined,
    ev.WorkerLeft: FarmState.on_worker_left,
    ev.WorkerHeard: FarmState.on_worker_heard,
    ev.ResultArrived: FarmState.on_result_arrived,
    ev.FailureArrived: FarmState.on_failure_arrived,
    ev.JobSubmitted: FarmState.on_job_submitted,
    ev.JobCancelled: FarmState.on_job_cancelled,
    ev.ClientHeard: FarmState.on_client_heard,
    ev.ClientLeft: FarmState.on_client_left,
    ev.DataArrived: FarmState.on_data_arrived,
    ev.Tick: FarmState.on_tick,
}

__all__ = [
    "FarmCounts",
    "FarmState",
    "FarmStats",
    "Observer",
    "SchedulingConfig",
    "SHARING",
    "OUTCOMES",
]
