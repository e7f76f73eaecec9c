"""Barrier policies: work goes out in rounds, and a round starts only when the last one is done."""

from __future__ import annotations

from abc import abstractmethod
from typing import Iterable, Mapping

from farm.policies.base import (DEFAULT_FLOOR, Chunk, ChunkDone, Policy, WorkerId,
                                proportional_split, require_positive)
from farm.policies.speeds import DEFAULT_SPEED_ALPHA, SpeedBook


class RoundPolicy(Policy):
    """Plans one piece per member for each round; waits at the barrier between rounds.

    A round's plan is made when the first worker asks after the previous round
    finished, for every member (the starting roster and workers that joined,
    minus the lost): members not yet ready get their piece when they ask.  A
    worker that joins mid-round waits for the next round.  When a worker is
    lost, its chunks in flight and its piece not yet handed out become
    *orphans* of the round: the next idle worker takes them at once, without
    waiting for the barrier.
    """

    def __init__(self, total: int, workers: Iterable[WorkerId] = (),
                 speeds: Mapping[WorkerId, float] | None = None, floor: int = DEFAULT_FLOOR,
                 speed_alpha: float = DEFAULT_SPEED_ALPHA) -> None:
        require_positive(floor=floor)
        super().__init__(total, workers, speeds)
        self.floor = floor
        self.speeds = SpeedBook(speed_alpha)
        self.round = 0  # the round being handed out or run; 0 before the first
        self.plan: dict[WorkerId, int] = {}  # pieces of this round not yet handed out
        self.orphans = 0  # items of this round that lost workers left behind
        self.round_seconds: dict[WorkerId, float] = {}  # compute time per worker this round
        self.last_round_seconds: dict[WorkerId, float] = {}

    @property
    def round_open(self) -> bool:
        """Some piece of the current round is still to be handed out or running."""
        return bool(self.plan) or self.orphans > 0 or self.holding > 0

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
        self.plan = self.plan_round(self.members)

    @abstractmethod
    def plan_round(self, members: list[WorkerId]) -> dict[WorkerId, int]:
        """Sizes of this round's pieces by worker (taken from ``self.remaining``)."""

    def on_chunk_done(self, event: ChunkDone) -> None:
        self.speeds.update(event.worker, event.chunk.count, event.seconds)
        self.round_seconds[event.worker] = self.round_seconds.get(event.worker, 0.0) + event.seconds

    def on_worker_lost(self, worker: WorkerId, returned: list[Chunk]) -> None:
        """What the worker held or was still due this round goes to the next idle worker."""
        self.orphans += self.plan.pop(worker, 0)
        self.on_chunks_returned(worker, returned)

    def on_chunks_returned(self, worker: WorkerId, returned: list[Chunk]) -> None:
        self.orphans += sum(chunk.count for chunk in returned)

    def split(self, items: int, members: list[WorkerId]) -> dict[WorkerId, int]:
        """``items`` split by measured speed (equal while none is known), no piece below the floor."""
        return proportional_split(items, self.speeds.weights(members), self.floor)
