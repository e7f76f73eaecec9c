"""equal-finish (ours): size every chunk so that all workers' predicted finish times meet."""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping

from farm.policies.base import (
    DEFAULT_FLOOR,
    SMALL_FARM,
    Chunk,
    ChunkDone,
    ChunkFailed,
    WorkerId,
    require_positive,
)
from farm.policies.free_times import FreeTimes
from farm.policies.speeds import MeasuredPolicy

#: Probe for a worker with no speed yet (none remembered from earlier jobs).
DEFAULT_PROBE = 200
#: Per-chunk cost the driver adds on top of compute time (the paper: about 0.2 ms).
DEFAULT_OVERHEAD = 0.0002
#: Largest share of a chunk's time that per-chunk overhead may take.
DEFAULT_MAX_OVERHEAD = 0.01
#: Seconds of compute that weigh as much as all earlier measurements (see ``SpeedBook``).
DEFAULT_SPEED_WINDOW = 2.0
#: Deviations of chunk speed guarded against near the end (see ``EqualFinishPolicy``); 0: none.
#: Measured (0.5 to 3, 4-device paper farms with noise or a device slowing): makespan within
#: 0.1% either way of no guard, so none by default.
DEFAULT_SPREAD = 0.0
#: Near the end: the worker's share is at most this many of its minimum chunks.
NEAR_END = 8
#: A chunk running this many times its predicted time caps its worker's speed estimate.
OVERDUE = 1.2


class EqualFinishPolicy(MeasuredPolicy):
    """Asynchronous and predictive; no barrier, no fixed ratio.

    The policy keeps, per worker, a speed (see ``SpeedBook``) and the time it
    will be free (its chunks in flight at that speed).  When a worker asks,
    it computes the time ``T`` at which the whole farm would finish if the
    items left were shared so that every member finishes together:
    ``sum_j v_j * (T - free_j) = remaining``.  The worker's share is
    ``v_i * (T - free_i)``; it gets ``fraction`` of it, so later chunks can
    correct for noise and drift, but never less than the chunk whose
    per-chunk ``overhead`` (seconds) is at most ``max_overhead`` of its time,
    nor less than ``floor``.  At the end of the job, when that share would be
    under the minimum, what is left is planned in minimum-size pieces, each
    for the worker that would finish it first (earliest finish time); the
    asking worker takes its first piece, or waits if the plan gives it none,
    and no piece leaves less than ``floor`` behind.

    * Speeds are averaged with weights by chunk length (``speed_window``
      seconds, see ``SpeedBook``).  A worker still busy at 1.2 times its
      chunk's predicted time is slower than believed: its speed counts as
      at most what it could have done so far, so the others take more.
    * A worker alone takes the whole job at once.
    * Workers with no speed get a ``probe``; meanwhile they count at the
      fastest known speed, which keeps early chunks of the others small.
    * Speeds remembered from earlier jobs (``speeds``) skip the probe.
    * Workers that already hold a chunk may get a second one (prefetch)
      when their share after what they hold is still positive.
    * ``spread`` (z) guards the last chunks against a worker's own variance:
      near the end (its share at most ``NEAR_END`` of its minimum chunks) and
      in the end-game plan, each worker counts at ``rate / (1 + z * cv)``, ``cv``
      the relative deviation of its chunk speeds (see ``SpeedBook``), so a
      noisy or slowing worker takes a shorter last chunk and the end-game
      pieces go to the workers whose pessimistic finish is earliest.  ``T``
      stays the plain prediction.  ``0`` (the default) decides exactly as
      without it: in the simulator no z from 0.5 to 3 moved the makespan by
      more than 0.1% either way.
    """

    name = "equal-finish"
    prefetch = True

    def __init__(
        self,
        total: int,
        workers: Iterable[WorkerId] = (),
        speeds: Mapping[WorkerId, float] | None = None,
        fraction: float = 0.5,
        probe: int = DEFAULT_PROBE,
        overhead: float = DEFAULT_OVERHEAD,
        max_overhead: float = DEFAULT_MAX_OVERHEAD,
        floor: int = DEFAULT_FLOOR,
        speed_window: float = DEFAULT_SPEED_WINDOW,
        spread: float = DEFAULT_SPREAD,
    ) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be within (0, 1], got {fraction}")
        require_positive(probe=probe, floor=floor)
        if overhead < 0 or not 0 < max_overhead <= 1:
            raise ValueError("overhead must be >= 0 and max_overhead within (0, 1]")
        if speed_window < 0:
            raise ValueError(f"speed_window must be >= 0, got {speed_window}")
        if spread < 0:
            raise ValueError(f"spread must be >= 0, got {spread}")
        super().__init__(total, workers, speeds, 1.0, speed_window, seeded=True)
        self.fraction, self.probe, self.floor = fraction, probe, floor
        self.overhead, self.max_overhead = overhead, max_overhead
        self.spread = spread
        self.started_at: dict[WorkerId, float] = {}  # when each worker began its current chunk
        self.free_times: FreeTimes | None = None  # kept only while over SMALL_FARM members
        self._totals: tuple[int, float, float] | None = None  # (event, sum v, sum v * free)
        self._plan: tuple[int, dict[WorkerId, int]] | None = None  # (event, end-game pieces)

    # ------------------------------------------------------------ predictions

    def rate(self, worker: WorkerId) -> float:
        """Known speed, else the fastest known (optimistic), else 1.

        A worker still busy past its predicted end is slower than we thought:
        its speed is capped at the items of its current chunk over the time
        the chunk has run so far.
        """
        known = self.speeds.speeds.get(worker)
        if known is None:
            return self.unknown_rate()
        chunks = self.in_flight.get(worker)
        if chunks:
            running = self.now - self.started_at.get(worker, self.now)
            if running > 0 and chunks[0].count * OVERDUE < known * running:
                return chunks[0].count / running
        return known

    def unknown_rate(self) -> float:
        """The rate of a worker with no speed yet: the fastest known, else 1."""
        fastest = self.speeds.fastest()
        return 1.0 if fastest is None else fastest

    def guarded(self, speed: float, worker: WorkerId) -> float:
        """``speed`` made pessimistic by ``spread`` deviations of the worker's chunk speeds."""
        if not self.spread:
            return speed
        return speed / (1.0 + self.spread * self.speeds.spread(worker))

    def available_at(self, worker: WorkerId, rate: float | None = None) -> float:
        """When the worker will have finished what it holds (now if idle or probing), at
        ``rate`` (default: its ``rate``)."""
        chunks = self.in_flight.get(worker)
        if not chunks or not self.speeds.knows(worker):
            return self.now
        if rate is None:
            rate = self.rate(worker)
        free = (
            self.started_at.get(worker, self.now)
            + sum(c.count for c in chunks) / rate
            + self.overhead * len(chunks)
        )
        return max(self.now, free)

    def speed(self, worker: WorkerId) -> float | None:
        return self.speeds.get(worker)

    def overdue_from(self, worker: WorkerId) -> float | None:
        """When the chunk the worker runs will count as overdue (None if it runs none)."""
        chunks = self.in_flight.get(worker)
        speed = self.speeds.get(worker)
        if not chunks or speed is None:
            return None
        return self.started_at.get(worker, self.now) + chunks[0].count * OVERDUE / speed

    def min_chunk(self, speed: float) -> int:
        """The smallest chunk worth its overhead, at least ``floor``; but no more than
        ``least_share``, so a job too small for a minimum chunk per member still reaches
        every member."""
        smallest = max(self.floor, math.ceil(self.overhead / self.max_overhead * speed))
        return smallest if len(self.place) <= 1 else min(smallest, self.least_share())

    # ---------------------------------------------------------------- policy

    def chunk_size(self, worker: WorkerId) -> int | None:
        left = self.remaining
        if len(self.place) == 1:
            return left  # alone: nothing to balance
        speed = self.speeds.get(worker)
        if speed is None:
            return min(self.probe, self.least_share(), left)
        rate_sum, weighted_free = self.totals()
        finish = (left + weighted_free) / rate_sum
        share = speed * (finish - self.available_at(worker))
        if share <= 0:
            return None
        if self.spread and share <= NEAR_END * self.min_chunk(speed):  # near the end: guard
            guarded_free = self.available_at(worker, self.guarded(self.rate(worker), worker))
            share = self.guarded(speed, worker) * (finish - guarded_free)
            if share <= 0:
                return None
        size = math.ceil(self.fraction * share)
        if size >= self.min_chunk(speed) and size < left - self.cut_floor():
            return size  # a share of the work, with slack for later chunks to correct
        return self.end_game_piece(worker)

    def totals(self) -> tuple[float, float]:
        """``sum(v_j)`` and ``sum(v_j * free_j)`` over the members, cached for one event:
        on small farms summed afresh in member order, as they always were, else from the
        running sums of ``FreeTimes`` (equal up to rounding)."""
        if self._totals is None or self._totals[0] != self.events:
            if len(self.place) <= SMALL_FARM:
                self.free_times = None
                rates = [(self.rate(m), self.available_at(m)) for m in self.members]
                self._totals = (
                    self.events,
                    sum(r for r, _ in rates),
                    sum(r * free for r, free in rates),
                )
            else:
                if self.free_times is None:
                    self.free_times = FreeTimes.of(self, self.place)
                unknown = len(self.place) - self.ranking.known
                self._totals = (
                    self.events,
                    *self.free_times.totals(unknown * self.unknown_rate() if unknown else 0.0),
                )
        return self._totals[1], self._totals[2]

    def end_game_piece(self, worker: WorkerId) -> int | None:
        """The worker's next piece in an earliest-finish-first plan of what is left, if any.

        What remains is cut into minimum-size pieces; each goes in turn to the
        member with a known speed that would finish it first.  The asking worker takes its
        first piece, or waits if the plan gives it none.  The plan holds
        until the next event.
        """
        if self._plan is None or self._plan[0] != self.events:
            self._plan = (self.events, self.plan_end_game(self.idle))
        return self._plan[1].pop(worker, None)

    def plan_end_game(self, wanted: Iterable[WorkerId]) -> dict[WorkerId, int]:
        """First piece per worker in the earliest-finish-first plan of the remaining items,
        planned until each ``wanted`` worker (those that may ask before the next event:
        the idle) has its first piece."""
        left = self.remaining
        rates = {m: self.rate(m) for m in self.members if self.speeds.knows(m)}  # they hold
        smallest = {m: self.min_chunk(rate) for m, rate in rates.items()}  # still while planning
        if self.spread:
            rates = {m: self.guarded(rate, m) for m, rate in rates.items()}
        waiting = {w for w in wanted if w in rates}
        heap = []  # (end of its next piece, start, worker)
        for m, rate in rates.items():
            start = self.available_at(m, rate)
            heap.append((start + self.piece(smallest[m], left) / rate, start, m))
        heapq.heapify(heap)
        firsts: dict[WorkerId, int] = {}
        while left > 0 and heap and waiting:
            _, start, chosen = heapq.heappop(heap)
            size = self.piece(smallest[chosen], left)
            end = start + size / rates[chosen]
            if heap and end > heap[0][0]:  # the piece grew (it took a sliver): re-queue it
                heapq.heappush(heap, (end, start, chosen))
                continue
            firsts.setdefault(chosen, size)
            waiting.discard(chosen)
            left -= size
            start = end + self.overhead
            heapq.heappush(
                heap, (start + self.piece(smallest[chosen], left) / rates[chosen], start, chosen)
            )
        return firsts

    def piece(self, smallest: int, left: int) -> int:
        """A chunk of ``smallest`` items, or everything left if less than ``floor`` would
        remain."""
        size = min(smallest, left)
        return left if left - size < self.cut_floor() else size

    def on_assign(self, worker: WorkerId, chunk: Chunk) -> None:
        if len(self.in_flight[worker]) == 1:
            self.started_at[worker] = self.now
        self._totals = None  # the worker's free time moved
        self.refile(worker)

    def on_chunk_done(self, event: ChunkDone) -> None:
        self.ranking.update(event.worker, event.chunk.count, event.seconds)
        self.started_at[event.worker] = self.now  # the next chunk it holds starts now
        self.refile(event.worker)

    def on_chunk_failed(self, event: ChunkFailed) -> None:
        self.refile(event.worker)

    def on_member_joined(self, worker: WorkerId) -> None:
        super().on_member_joined(worker)
        self.refile(worker)

    def on_member_left(self, worker: WorkerId) -> None:
        super().on_member_left(worker)
        if self.free_times is not None:
            self.free_times.drop(worker)

    def refile(self, worker: WorkerId) -> None:
        """The worker's terms in the running sums changed (if they are kept)."""
        if self.free_times is not None:
            self.free_times.mark(worker)

    def on_worker_lost(self, worker: WorkerId, returned: list[Chunk]) -> None:
        self.started_at.pop(worker, None)
