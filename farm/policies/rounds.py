"""Barrier policies: work goes out in rounds, and a round starts only when the last one is done."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Mapping

from farm.policies.base import (
    DEFAULT_FLOOR,
    Chunk,
    ChunkDone,
    WorkerId,
    require_positive,
    split_ranked,
)
from farm.policies.speeds import DEFAULT_SPEED_ALPHA, MeasuredPolicy


class RoundPolicy(MeasuredPolicy):
    """Plans one piece per member for each round; waits at the barrier between rounds.

    A round's plan is made when the first worker asks after the previous round
    finished, for every member (the starting roster and workers that joined,
    minus the lost): members not yet ready get their piece when they ask.  A
    worker that joins mid-round waits for the next round.  When a worker is
    lost, its chunks in flight and its piece not yet handed out become
    *orphans* of the round: the next idle worker takes them at once, without
    waiting for the barrier.

    Workers waiting at the barrier are not asked again at every event: within a
    round only the idle workers with a piece still due (``due``) can take one.
    """

    def __init__(
        self,
        total: int,
        workers: Iterable[WorkerId] = (),
        speeds: Mapping[WorkerId, float] | None = None,
        floor: int = DEFAULT_FLOOR,
        speed_alpha: float = DEFAULT_SPEED_ALPHA,
    ) -> None:
        require_positive(floor=floor)
        super().__init__(total, workers, speeds, speed_alpha)
        self.floor = floor
        self.round = 0  # the round being handed out or run; 0 before the first
        self.plan: dict[WorkerId, int] = {}  # pieces of this round not yet handed out
        self.due: set[WorkerId] = set()  # idle, holding nothing, maybe a piece in the plan
        self.orphans = 0  # items of this round that lost workers left behind
        self.round_seconds: dict[WorkerId, float] = {}  # compute time per worker this round
        self.last_round_seconds: dict[WorkerId, float] = {}
        self.round_floor = floor  # the floor this round is cut with (``cut_floor`` at its start)

    @property
    def round_open(self) -> bool:
        """Some piece of the current round is still to be handed out or running."""
        return bool(self.plan) or self.orphans > 0 or self.holding > 0

    def offer_order(self) -> list[WorkerId]:
        """Only a worker that holds nothing can take a piece (no prefetch): the first one
        starts a round after the barrier; then those with a piece due, or all of them
        while a lost worker's orphans wait."""
        if not self.free:
            return []
        if not self.round_open:
            self.start_round()  # a round over a pool with items plans at least one piece
        if self.orphans > 0:
            return self.free_in_order()
        if not self.due:
            return []  # at the barrier, or every piece due is out
        ready = [w for w in self.due if w in self.free and w in self.plan]
        self.due = set(ready)
        return sorted(ready, key=self.idle.__getitem__)

    def chunk_size(self, worker: WorkerId) -> int | None:
        if not self.round_open:
            self.start_round()
        if worker in self.plan:
            return self.plan.pop(worker)
        if self.orphans > 0:
            size = min(self.orphans, self.pool.ranges[0].count)
            self.orphans -= size
            return size
        return None  # at the barrier

    def start_round(self) -> None:
        self.last_round_seconds, self.round_seconds = self.round_seconds, {}
        self.round += 1
        self.round_floor = super().cut_floor()
        self.plan = self.plan_round()
        fewer, more = sorted((self.plan, self.free), key=len)
        self.due = {w for w in fewer if w in more}

    def cut_floor(self) -> int:
        """The floor fixed when the round started, so its pieces are cut as they were
        planned."""
        return self.round_floor

    @abstractmethod
    def plan_round(self) -> dict[WorkerId, int]:
        """Sizes of this round's pieces by member (taken from ``self.remaining``)."""

    def on_free(self, worker: WorkerId) -> None:
        if worker in self.plan:
            self.due.add(worker)

    def on_chunk_done(self, event: ChunkDone) -> None:
        self.ranking.update(event.worker, event.chunk.count, event.seconds)
        self.round_seconds[event.worker] = self.round_seconds.get(event.worker, 0.0) + event.seconds

    def on_worker_lost(self, worker: WorkerId, returned: list[Chunk]) -> None:
        """What the worker held or was still due this round goes to the next idle worker."""
        self.orphans += self.plan.pop(worker, 0)
        self.on_chunks_returned(worker, returned)

    def on_chunks_returned(self, worker: WorkerId, returned: list[Chunk]) -> None:
        self.orphans += sum(chunk.count for chunk in returned)

    def split(self, items: int) -> dict[WorkerId, int]:
        """``items`` split by measured speed (unknown speeds count as the mean known one,
        equal while none is known), no piece below the round's floor.  Only the heaviest
        ``items // floor + 1`` members can get a piece: only they are looked at."""
        heaviest = self.ranking.heaviest(min(len(self.place), items // self.round_floor + 1))
        return split_ranked(items, heaviest, self.round_floor)
