"""``FarmState``: the whole farm's scheduling as a pure state machine.

Its one entry point, ``handle(event) -> [instruction]``, takes what the broker decoded
(or the simulator made up) and returns the messages to send, each naming the event
that caused it (``stimulus``).  It reads no clock (every event carries ``at``), touches
no socket and does no I/O, so the broker and the simulator run the same scheduling,
and tests drive it with plain events.

Its data is a ``Farm`` (``farm.broker.core``); each concern is a module of functions
over it, and ``HANDLERS`` routes every event to one:

* ``scheduling``: several jobs share the workers.  Every free slot is offered to the
  running jobs in order: highest priority first, then (``sharing="fair"``) the job
  holding the fewest chunks, then the oldest; each job's own policy decides whether to
  take it.  A chunk assigned takes its worker's slot at once, as an attempt with its
  own id.  Jobs end here too.
* ``inputs``: the state asks the job's client for a chunk's input (NEED) and forwards
  the DATA as the TASK; a job whose workers read its items from shared storage gets
  its TASKs at once, and a worker that cannot read them is sent the bytes.
* ``attempts`` (with ``blame``): a reply to an attempt no longer in flight is dropped,
  so every item is delivered once.  Only what the evidence supports is charged to a
  chunk's items: a FAILED, or its worker dying while computing it.  A chunk charged on
  two devices is narrowed down by halves to the images that fail by themselves, which
  alone are given up and reported (FAILED); lost workers charge nothing, but no item
  runs more than ``max_runs`` times.
* ``results``: a RESULT goes to the client and counts; a FAILED fails the job or the
  attempt.
* ``caps``: chunks are capped at ``max_chunk_seconds`` of compute on the job's fastest
  worker (a quarter of that while jobs share the farm), and at the byte limit of a
  message.
* ``membership`` and ``clients``: silent workers and clients expire after ``liveness``
  heartbeats; a lost worker's chunks go back to their jobs.  A job whose client
  vanished ends, but its chunks in flight finish: their results are held for a client
  resuming it.
* ``admission``: a SUBMIT is refused, or becomes a job checked against its model.
* ``keeping`` (with ``kept``): results workers kept across a lost broker, a lost worker
  or a vanished client (``Result.kept``) are passed to the job's client, or held until
  a resubmission naming the lost job comes; the ranges they cover are done without
  running again (``Job.delivered``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from farm.broker import events as ev
from farm.broker import keeping, membership
from farm.broker.admission import on_job_submitted
from farm.broker.caps import cap_all
from farm.broker.clients import (
    expire_silent,
    on_client_heard,
    on_client_left,
    on_data_arrived,
    on_job_cancelled,
    overdue_needs,
)
from farm.broker.core import OUTCOMES, SHARING, Farm, FarmStats, Observer, SchedulingConfig
from farm.broker.jobs import ChunkRecord
from farm.broker.results import on_failure_arrived, on_result_arrived
from farm.broker.scheduling import fill_all, finish_if_done, offer_idle


@dataclass(frozen=True, kw_only=True)
class FarmCounts:
    """The farm's numbers at one moment (the broker's metrics read them)."""

    jobs: dict[str, int]  # by state: queued, running
    workers: int
    chunks_waiting: int  # assigned, their input not back from the client yet
    outcomes: dict[str, int]  # jobs ended, by outcome
    stats: dict[str, int]  # FarmStats


class FarmState(Farm):
    """The farm's scheduling state; ``handle`` is the only way in."""

    def __init__(
        self, config: SchedulingConfig, first_chunk_id: int = 1, observer: Observer | None = None
    ) -> None:
        config.check()
        super().__init__(config=config, observer=observer, next_chunk_id=first_chunk_id)

    def handle(self, event: ev.FarmEvent) -> list[ev.Instruction]:
        """Apply one event; return the instructions it causes, in order, each naming it
        (``stimulus``: its number among the events this state handled, from 1)."""
        self.stimulus += 1
        self.now = max(self.now, event.at)
        if self.churn.since is None:
            self.churn.since = event.at
        self.out = []
        HANDLERS[type(event)](self, event)
        if self.refill:  # a retry or a job may wait for a worker that is idle now
            self.refill = False
            fill_all(self)
        return self.out

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
            "jobs": [job.describe(now) for job in self.order.jobs],
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


def on_tick(farm: Farm, event: ev.Tick) -> None:
    """Drop silent workers and jobs whose client went silent; cancel overdue jobs; offer
    idle workers' slots again, and backups of attempts fallen behind."""
    membership.expire_silent(farm, event.at)
    if farm.churn.forget(event.at):
        cap_all(farm)
    keeping.expire(farm, event.at)
    expire_silent(farm, event.at)
    overdue_needs(farm, event.at)
    for job in list(farm.running.values()):  # spot checks no connected worker may run
        if job.computed and job.checks is not None:  # any more (it left, or is quarantined)
            finish_if_done(farm, job)
    offer_idle(farm)


HANDLERS: dict[type, Any] = {
    ev.WorkerJoined: membership.on_worker_joined,
    ev.WorkerLeft: membership.on_worker_left,
    ev.WorkerHeard: membership.on_worker_heard,
    ev.ResultArrived: on_result_arrived,
    ev.FailureArrived: on_failure_arrived,
    ev.JobSubmitted: on_job_submitted,
    ev.JobCancelled: on_job_cancelled,
    ev.ClientHeard: on_client_heard,
    ev.ClientLeft: on_client_left,
    ev.DataArrived: on_data_arrived,
    ev.Tick: on_tick,
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
