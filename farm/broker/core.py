"""The farm's scheduling data: what ``FarmState`` holds and the modules beside it change.

Each concern (``workers``, ``admission``, ``clients``, ``inputs``, ``scheduling``,
``attempts``, ``results``, ``keeping``, ``caps``) is a module of functions taking a
``Farm``; they append instructions to ``Farm.out``, each naming the event being handled
(``Farm.stimulus``).  None reads a clock: ``Farm.now`` is the latest event's ``at``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from farm import defaults
from farm.broker import events as ev
from farm.broker.churn import Churn
from farm.broker.jobs import Job, Worker
from farm.broker.kept import KeptResults
from farm.broker.order import SlotOrder
from farm.policies import make_policy

#: How jobs share free slots: "fair" (fewest slots held first) or "fifo" (oldest first).
SHARING = ("fair", "fifo")
#: Ways a job ends, counted in INFO and metrics.
OUTCOMES = ("done", "failed", "cancelled", "timed_out", "expired")


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
    verify: float = 0.0  # part of each job's images run again on another device (spot checks)
    backup_share: float = defaults.BACKUP_SHARE  # most extra work of a job's backup attempts

    def check(self) -> None:
        """ValueError on a bad policy, parameter or sharing rule."""
        make_policy(self.algo, 1, **self.params)
        if self.sharing not in SHARING:
            raise ValueError(f"sharing must be one of {', '.join(SHARING)}")
        if not 0 <= self.verify <= 1:
            raise ValueError(f"verify must be a fraction within 0..1, not {self.verify}")
        if not 0 <= self.backup_share <= 1:
            raise ValueError(f"backup share must be within 0..1, not {self.backup_share}")


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
    refused_messages: int = 0  # a peer sent what its role may not (a client's RESULT...)
    bad_answers: int = 0  # results that failed the checks: their chunks ran again elsewhere
    quarantined_workers: int = 0  # workers given no more tasks (``farm.broker.quarantine``)
    parked_jobs: int = 0  # jobs whose client left a NEED unanswered past its deadline
    refused_fetches: int = 0  # FETCHes past a connection's budget for one model
    backup_attempts: int = 0  # second attempts at a job's last chunks (``farm.broker.backups``)
    backup_wins: int = 0  # ... that answered before the first attempt
    stragglers: int = 0  # attempts found past STRAGGLER_FACTOR times their predicted time


class Observer(Protocol):
    """Who hears of workers and chunks as they come and go (the broker's metrics)."""

    def worker_joined(self, entry: Worker) -> None: ...

    def worker_left(self, entry: Worker) -> None: ...

    def chunk_done(
        self,
        entry: Worker,
        items: int,
        compute_s: float,
        timings: dict[str, float],
        queued_s: float,
        round_trip_s: float,
    ) -> None: ...

    def chunk_failed(self, entry: Worker) -> None: ...


@dataclass(eq=False, repr=False, kw_only=True)
class Farm:
    """Workers, jobs, counters and the instructions of the event being handled."""

    config: SchedulingConfig
    observer: Observer | None = None
    next_chunk_id: int = 1  # the next attempt's id
    workers: dict[bytes, Worker] = field(default_factory=dict)
    by_id: dict[str, Worker] = field(default_factory=dict)  # the same entries by policy id
    jobs: dict[str, Job] = field(default_factory=dict)
    running: dict[str, Job] = field(default_factory=dict)  # jobs with a policy, by id
    order: SlotOrder = field(init=False)  # the running jobs in the order slots are offered
    fastest: dict[str, tuple[float, str]] = field(default_factory=dict)  # model -> rate, id
    stats: FarmStats = field(default_factory=FarmStats)
    churn: Churn = field(default_factory=Churn)  # recent losses: chunks shorten under churn
    places: Counter[str] = field(default_factory=Counter)  # workers per device (host/device)
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    next_seq: int = 0  # submission order of jobs
    next_seq_sent: int = 0  # the order TASKs go out
    now: float = 0.0
    stimulus: int = 0  # the id of the event being handled: 1 for the first, then 2, ...
    out: list[ev.Instruction] = field(default_factory=list)
    # slots are offered again once the event is handled: a range joined a retry line, or
    # a parked job's client answered
    refill: bool = False
    kept: KeptResults = field(default_factory=KeptResults)  # results of jobs not known here
    aliases: dict[str, str] = field(default_factory=dict)  # a lost job -> its resubmission
    # jobs whose client vanished, by when: their chunks in flight still finish, and
    # their results are kept for the client's resumption (``KeptResults``)
    vanished: dict[str, float] = field(default_factory=dict)
    # workers quarantined, by name (host:pid/device) and by owner (CURVE key, else
    # connection): the same process or key registering again stays quarantined; a
    # restarted process (another pid, another connection) starts afresh
    quarantined: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.order = SlotOrder(fair=self.config.sharing == "fair")

    def heard_worker(self, identity: bytes) -> Worker | None:
        """The worker's entry, its silence reset; None if the farm does not know it."""
        entry = self.workers.get(identity)
        if entry is not None:
            entry.last_seen = self.now
        return entry


__all__ = ["OUTCOMES", "SHARING", "Farm", "FarmStats", "Observer", "SchedulingConfig"]
