"""Running sums of speed and of speed x free time over a job's members, for equal-finish."""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from farm.policies.base import WorkerId


class Predictor(Protocol):
    """What the sums are of: equal-finish's own predictions, per worker."""

    now: float

    def speed(self, worker: WorkerId) -> float | None: ...

    def rate(self, worker: WorkerId) -> float: ...

    def available_at(self, worker: WorkerId) -> float: ...

    def overdue_from(self, worker: WorkerId) -> float | None: ...


NOW, AHEAD, OVERDUE = 0, 1, 2


@dataclass
class FreeTimes:
    """``sum(v)`` and ``sum(v * free)`` over the members with a speed, kept as they change.

    Each such member is filed by what its terms do as time passes:

    * ``NOW``: free now (idle, or past its predicted end): ``v`` and ``v * now``;
    * ``AHEAD``: busy until ``free`` > now: ``v`` and ``v * free``, fixed until time
      reaches ``free`` or the point where its chunk is overdue;
    * ``OVERDUE``: its rate falls as time passes, so its terms are taken afresh (few are).

    Members whose predictions changed are ``mark``-ed and filed again when the sums are
    next asked for; a heap of the times at which a member's filing changes refiles it
    when time gets there.  The running sums are taken afresh from the terms now and then.
    """

    predictor: Predictor
    terms: dict[WorkerId, tuple[int, float, float]] = field(default_factory=dict)
    # dicts, not sets, wherever the order is summed in: a set's order changes from run to run
    stale: dict[WorkerId, None] = field(default_factory=dict)  # to file before the next sums
    overdue: dict[WorkerId, None] = field(default_factory=dict)
    v_now: float = 0.0
    v_ahead: float = 0.0
    weighted_ahead: float = 0.0
    changes: list[tuple[float, WorkerId]] = field(default_factory=list)  # heap, may hold stale
    next_change: dict[WorkerId, float] = field(default_factory=dict)  # the live entry's time
    updates: int = 0

    @classmethod
    def of(cls, predictor: Predictor, members: Iterable[WorkerId]) -> FreeTimes:
        return cls(predictor, stale=dict.fromkeys(members))

    def mark(self, worker: WorkerId) -> None:
        """The member's predictions changed (it joined, took or ended a chunk, sped up)."""
        self.stale[worker] = None

    def drop(self, worker: WorkerId) -> None:
        """Forget a member's terms (it left, or is about to be filed again)."""
        self.stale.pop(worker, None)
        self.next_change.pop(worker, None)
        self.overdue.pop(worker, None)
        kind, rate, weighted = self.terms.pop(worker, (OVERDUE, 0.0, 0.0))
        if kind == NOW:
            self.v_now -= rate
        elif kind == AHEAD:
            self.v_ahead -= rate
            self.weighted_ahead -= weighted

    def file(self, worker: WorkerId) -> None:
        """File a member by its predictions now (not at all without a speed)."""
        self.drop(worker)
        p = self.predictor
        speed = p.speed(worker)
        if speed is None:
            return
        rate = p.rate(worker)
        if rate != speed:
            self.overdue[worker] = None
            self.terms[worker] = (OVERDUE, 0.0, 0.0)
            return
        free, change = p.available_at(worker), p.overdue_from(worker)
        if free > p.now:
            self.terms[worker] = (AHEAD, rate, rate * free)
            self.v_ahead += rate
            self.weighted_ahead += rate * free
            change = free if change is None else min(free, change)
        else:
            self.terms[worker] = (NOW, rate, 0.0)
            self.v_now += rate
        if change is not None:
            self._expect(worker, max(change, math.nextafter(p.now, math.inf)))
        self.updates += 1
        if self.updates > max(64, len(self.terms)):
            self._resum()

    def _expect(self, worker: WorkerId, when: float) -> None:
        """File the member again once time reaches ``when``."""
        self.next_change[worker] = when
        heapq.heappush(self.changes, (when, worker))
        if len(self.changes) > 2 * len(self.next_change) + 64:
            self.changes = [(when, w) for w, when in self.next_change.items()]
            heapq.heapify(self.changes)

    def _resum(self) -> None:
        """Take the sums afresh from the filed terms, shedding the rounding of many updates."""
        self.updates = 0
        terms = self.terms.values()
        self.v_now = sum(rate for kind, rate, _ in terms if kind == NOW)
        self.v_ahead = sum(rate for kind, rate, _ in terms if kind == AHEAD)
        self.weighted_ahead = sum(weighted for kind, _, weighted in terms if kind == AHEAD)

    def totals(self, unknown_rate: float) -> tuple[float, float]:
        """``sum(v)`` and ``sum(v * free)``, adding ``unknown_rate`` for what has no speed."""
        p = self.predictor
        while self.changes and self.changes[0][0] <= p.now:
            when, worker = heapq.heappop(self.changes)
            if self.next_change.get(worker) == when:
                self.stale[worker] = None
        while self.stale:
            self.file(self.stale.popitem()[0])
        free_now = unknown_rate + self.v_now
        rate_sum = free_now + self.v_ahead
        weighted = free_now * p.now + self.weighted_ahead
        for worker in self.overdue:
            rate = p.rate(worker)
            rate_sum += rate
            weighted += rate * p.available_at(worker)
        return rate_sum, weighted
