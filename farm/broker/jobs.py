"""A job as the broker holds it: its options, policy, chunks waiting for input, failures,
shares."""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from farm import defaults
from farm.broker.blame import Evidence
from farm.broker.checks import Check, Checks
from farm.broker.facts import JobOptions
from farm.broker.registry import WorkerEntry
from farm.policies import Chunk, Policy
from farm.summary import FailedItems, JobSummary, WorkerShare
from farm.wire.shapes import ENCODED, MAX_TASK_BYTES, SIZE_BYTES, item_bytes


@dataclass
class ChunkRecord:
    """One attempt at a chunk, given to a worker; ``sent_at`` is None until its input arrived."""

    id: int
    job: Job
    chunk: Chunk
    worker: WorkerEntry[ChunkRecord]
    attempt: int = 1  # 1 + the most times any of its items ran without a result
    assigned_at: float = 0.0  # when the policy assigned it (the broker asked for its input)
    sent_at: float | None = None  # when the TASK went to the worker
    sent_seq: int = 0  # the order TASKs went out: a worker computes its chunks in this order
    retry: bool = False  # from the job's retry line, run outside its policy
    check: Check | None = None  # a spot check's second (or third) run, outside its policy
    # a backup attempt (``farm.broker.backups``): the attempt it backs up (a piece of its
    # range), outside its policy; and on that attempt, its backups while they run
    backup_of: ChunkRecord | None = None
    backups: list[ChunkRecord] = field(default_factory=list)
    projected: float = 0.0  # a backup: when its first attempt was expected to answer
    straggler: bool = False  # found past ``STRAGGLER_FACTOR`` times its predicted time

    @property
    def extra(self) -> bool:
        """A second run of a range outside the job's policy: a spot check or a backup."""
        return self.check is not None or self.backup_of is not None

    @property
    def job_id(self) -> str:
        return self.job.id


@dataclass
class Ranges:
    """Disjoint item ranges ``[start, stop)``, sorted: what kept results delivered of a job
    outside any attempt (a worker counted lost came back with them).  The job's policy
    still holds them; when it hands one out again it is done at once
    (``scheduling.assign``)."""

    starts: list[int] = field(default_factory=list)
    stops: list[int] = field(default_factory=list)

    def add(self, start: int, stop: int) -> None:
        """Add ``[start, stop)``, merged with the ranges it touches."""
        first = bisect.bisect_left(self.stops, start)
        last = bisect.bisect_right(self.starts, stop)
        if first < last:
            start, stop = min(start, self.starts[first]), max(stop, self.stops[last - 1])
        self.starts[first:last], self.stops[first:last] = [start], [stop]

    def covers(self, start: int, stop: int) -> bool:
        index = bisect.bisect_right(self.starts, start) - 1
        return index >= 0 and self.stops[index] >= stop

    def __bool__(self) -> bool:
        return bool(self.starts)


@dataclass
class Share:
    """One worker's part in one job."""

    name: str
    device: str
    items: int = 0
    chunks: int = 0
    compute_s: float = 0.0
    load_s: float = 0.0  # the longest wait of a chunk for the model's files and engine


@dataclass
class Job:
    """A client's job.  The broker holds none of its input: it asks the client for each
    chunk's items (NEED) when the chunk is assigned and forwards them to the worker."""

    id: str
    client: bytes
    model: str
    dtype: str
    item_shape: tuple[int, ...]
    total: int
    submitted_at: float
    client_expiry: float = 5.0  # seconds of client silence after which the job is dropped
    options: JobOptions = field(default_factory=JobOptions)
    algo: str = defaults.POLICY
    params: dict[str, Any] = field(default_factory=dict)
    seq: int = 0  # submission order: FIFO among equals
    started_at: float | None = None  # first chunk assigned
    outcome: str | None = None  # set when the job ends: done, failed, cancelled, timed_out...
    shared: bool = False  # another job ran at the same time (its waste counts theirs)
    policy: Policy | None = None  # made when the job is validated, for the workers then eligible
    digest: str = ""  # the content hash of the model's files, set when the job is validated
    item_bytes: int = 0
    decoded_bytes: int = 0  # an image file's decoded pixels (all its crops), once validated
    client_seen: float = 0.0
    pending: dict[int, ChunkRecord] = field(default_factory=dict)  # NEED sent, DATA not back
    evidence: Evidence = field(default_factory=Evidence)  # failed and lost attempts
    abandoned: list[FailedItems] = field(default_factory=list)  # ranges given up
    # ranges the broker runs itself, outside the policy: chunks charged a failure (to run on
    # another device) and pieces of suspect chunks (narrowing them down)
    retries: deque[Chunk] = field(default_factory=deque)
    retry_items: int = 0  # items taken from the policy to retry, not yet settled
    retry_failures: int = 0  # failed attempts at retried ranges, against RETRY_LIMIT
    items_run: int = 0  # items of every TASK sent: the job's size plus what ran again
    shares: dict[str, Share] = field(default_factory=dict)
    # workers offered this job
    eligible: dict[str, WorkerEntry[ChunkRecord]] = field(default_factory=dict)
    output_shape: tuple[int, ...] | None = None  # of its chunks' outputs, once one came back
    # where its workers read the items themselves (``farm.wire.storage.SharedInputs``), if they do
    inputs: Any = None
    unshared: set[str] = field(default_factory=set)  # workers that cannot: sent the bytes
    # which of the client's items the job holds, and the same for the client's earlier
    # submissions of it, lost with a broker (``(job_start, item_start, count)`` runs)
    runs: tuple[tuple[int, int, int], ...] = ()
    earlier: dict[str, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)
    # ranges kept results delivered outside any attempt: done when next handed out
    delivered: Ranges = field(default_factory=Ranges)
    kept_items: int = 0  # items done by ranges kept results delivered (not in any share)
    # what workers counted lost held of it, by worker name: only they may offer it kept
    lost_by: dict[str, Ranges] = field(default_factory=dict)
    checks: Checks | None = None  # spot checks (``farm.broker.verify``), if asked for
    # ranges a quarantined worker computed, run again: their results replace the ones sent
    corrections: Ranges = field(default_factory=Ranges)
    corrected: int = 0
    owner: str = ""  # who submitted it: its client's CURVE key, else its connection
    softmax: bool = False  # its model's outputs are probabilities: each is checked within 0..1
    bad_answers: int = 0  # results that failed the broker's checks, run again elsewhere
    quarantined: dict[str, str] = field(default_factory=dict)  # worker name -> why, meanwhile
    # fair admission (``farm.broker.inputs``): a job holds workers' slots only once its
    # client answered a NEED (``proven``); one that leaves a NEED unanswered is parked
    proven: bool = False
    parked_until: float | None = None
    parks: int = 0
    probes: int = 0
    slowest_input: float = 0.0  # the longest its client took to answer a NEED, in seconds
    # backup attempts at its last chunks (``farm.broker.backups``) and its tail
    backups: int = 0  # started
    backup_items: int = 0  # images they ran, or were to run
    backup_extra: float = 0.0  # images the attempts they backed up had computed by then
    backup_wins: int = 0  # answered before the attempts they backed up
    backup_saved: float = 0.0  # seconds the wins saved, by the first attempts' projections
    tail_from: float | None = None  # a worker first went idle with nothing of it left
    no_backup_at: int = -1  # the event at which no backup could be planned (planned once)

    def __post_init__(self) -> None:
        self.item_bytes = item_bytes(self.dtype, self.item_shape)
        self.client_seen = self.submitted_at

    @property
    def done(self) -> int:
        """Items computed (or given up) so far."""
        return self.policy.completed - self.retry_items if self.policy else 0

    @property
    def computed(self) -> bool:
        """Every item computed or given up: the policy's and every retried range."""
        return self.policy is not None and self.policy.finished and self.retry_items == 0

    @property
    def finished(self) -> bool:
        """Computed, and every spot check answered."""
        return self.computed and not (self.checks is not None and self.checks.open)

    @property
    def priority(self) -> int:
        return self.options.priority

    @property
    def deadline(self) -> float | None:
        """When the broker cancels the job (its timeout), on the broker's clock."""
        timeout = self.options.timeout
        return None if timeout is None else self.submitted_at + timeout

    @property
    def in_flight(self) -> int:
        """Chunks its policy assigned and has not seen answered (ranges on the retry line
        aside)."""
        return self.policy.holding if self.policy else 0

    def state(self) -> str:
        """queued (no chunk assigned yet) or running."""
        return "running" if self.started_at is not None else "queued"

    def describe(self, now: float) -> dict[str, Any]:
        """The job as ``farm status`` shows it."""
        done = self.done
        elapsed = now - self.started_at if self.started_at is not None else 0.0
        rate = done / elapsed if elapsed > 0 else 0.0
        failed = sum(f.count for f in self.abandoned)
        return {
            "job": self.id,
            "client": self.options.client,
            "model": self.model,
            "policy": self.algo,
            "priority": self.priority,
            "state": self.state(),
            "total": self.total,
            "done": done,
            "failed": failed,
            "in_flight": self.in_flight,
            "workers": len(
                {
                    w
                    for w, chunks in (self.policy.in_flight.items() if self.policy else ())
                    if chunks
                }
            ),
            "rate": rate,
            "eta_s": (self.total - done) / rate if rate > 0 else None,
            "age_s": now - self.submitted_at,
            "timeout_s": self.options.timeout,
            "owner": self.owner,
            "parked": self.parks > 0 and not self.proven,
            "bad_answers": self.bad_answers,
            "backups": self.backups,
            "backup_wins": self.backup_wins,
            "tail_s": now - self.tail_from if self.tail_from is not None else None,
        }

    @property
    def max_chunk(self) -> int:
        """The most items one chunk may hold: its input must fit ``MAX_TASK_BYTES``; for image
        files, both as sent (a file's size takes 4 bytes more) and as decoded; and its
        outputs too, once known (the broker reads no larger frame)."""
        per_item = self.item_bytes
        if self.dtype == ENCODED:
            per_item = max(per_item + SIZE_BYTES, self.decoded_bytes)
        if self.output_shape is not None:
            per_item = max(per_item, 4 * math.prod(self.output_shape))
        return max(1, MAX_TASK_BYTES // per_item)

    def attempt_of(self, chunk: Chunk) -> int:
        """1 + the most times any item of the chunk ran without a result."""
        return 1 + self.evidence.tally(chunk).runs

    def account(
        self, worker: WorkerEntry[ChunkRecord], chunk: Chunk, compute: float, load: float = 0.0
    ) -> None:
        share = self.shares.get(worker.id)
        if share is None:
            share = self.shares[worker.id] = Share(worker.name, worker.device)
        share.items += chunk.count
        share.chunks += 1
        share.compute_s += compute
        share.load_s = max(share.load_s, load)  # chunks parked on one load overlap
        worker.record(self.model, chunk.count, compute)

    def summary(self, now: float) -> JobSummary:
        """Per-worker shares with each worker's standalone speed on this model.

        A worker that was offered the job but ran none of it still counts in the
        theoretical speed, at the speed it showed on this model before.
        """
        workers = []
        for worker_id, worker in self.eligible.items():
            share = self.shares.get(worker_id, Share(worker.name, worker.device))
            history = worker.history.get(self.model)
            rate = (
                share.items / share.compute_s
                if share.compute_s > 0
                else history.rate
                if history
                else 0.0
            )
            workers.append(WorkerShare(**vars(share), rate=rate))
        return JobSummary(
            total=self.total,
            broker_seconds=now - self.submitted_at,
            items=self.done,
            policy=self.algo,
            workers=tuple(workers),
            shared=self.shared,
            failed_items=sum(f.count for f in self.abandoned),
            failed_attempts=self.evidence.charged,
            lost_attempts=self.evidence.lost,
            items_run=self.items_run,
            kept=self.kept_items,
            bad_answers=self.bad_answers,
            verified=self.checks.verified if self.checks else 0,
            disagreements=self.checks.disagreements if self.checks else 0,
            unresolved=self.checks.unresolved if self.checks else 0,
            unverified=self.checks.dropped if self.checks else 0,
            corrected=self.corrected,
            quarantined=tuple(f"{name}: {why}" for name, why in self.quarantined.items()),
            parked=self.parks,
            backups=self.backups,
            backup_items=self.backup_items,
            backup_extra=round(self.backup_extra),
            backup_wins=self.backup_wins,
            backup_saved_s=self.backup_saved,
            tail_s=now - self.tail_from if self.tail_from is not None else 0.0,
            span_s=now - self.started_at if self.started_at is not None else 0.0,
        )


#: A worker's registry entry, holding the broker's chunk records.
Worker = WorkerEntry[ChunkRecord]
