"""The policy interface: pure state machines that turn events into chunk assignments.

A policy knows nothing of sockets, clocks or threads.  Its driver (the broker,
or the simulator in ``bench/``) feeds it events and carries out the
assignments it returns.  One policy instance schedules one job.

Events:

* ``WorkerReady(worker)``: the worker can take one more chunk of this job
  (it has a free slot).  A policy with nothing to give remembers it as idle.
* ``ChunkDone(worker, chunk, seconds)``: the worker ran ``chunk`` in
  ``seconds`` of compute time.  The worker's slot is free again; the driver
  follows with ``WorkerReady`` when it wants the slot filled by this job.
* ``WorkerBusy(worker)``: the slot the worker offered this job was taken by
  another job (jobs share workers); the policy stops counting it as idle
  until the next ``WorkerReady``.
* ``WorkerLost(worker)``: the worker is gone; its chunks in flight go back
  to the pool and are handed to idle workers.
* ``ChunkFailed(worker, chunk, retry)``: the worker could not run ``chunk``;
  with ``retry`` it goes back to the pool like a lost worker's chunk, without
  it the chunk is given up (counted as finished, with no output and no speed).

Every event carries ``at``, the driver's clock (seconds, any origin): the
broker passes its monotonic clock, the simulator its simulated time.  A
policy reads time only from events, so the same object runs in both.

A policy is built with the job's size, the ``workers`` that are eligible for
it when it starts (the paper's devices ``1..n``; others may join later) and
``speeds`` the driver remembers for them (items/second on this model from
earlier jobs).  Policies that do not use them ignore them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

WorkerId = str

#: Chunks below this many items pay visible per-chunk overhead (docs/scheduling.md).
DEFAULT_FLOOR = 100


@dataclass(frozen=True, order=True)
class Chunk:
    """A contiguous range of item indices ``[start, start + count)``."""

    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count


@dataclass(frozen=True)
class WorkerReady:
    worker: WorkerId
    at: float = 0.0


@dataclass(frozen=True)
class ChunkDone:
    worker: WorkerId
    chunk: Chunk
    seconds: float
    at: float = 0.0


@dataclass(frozen=True)
class WorkerBusy:
    worker: WorkerId
    at: float = 0.0


@dataclass(frozen=True)
class WorkerLost:
    worker: WorkerId
    at: float = 0.0


@dataclass(frozen=True)
class ChunkFailed:
    worker: WorkerId
    chunk: Chunk
    retry: bool = True
    at: float = 0.0


Event = WorkerReady | ChunkDone | WorkerLost | ChunkFailed | WorkerBusy


@dataclass(frozen=True)
class Assign:
    """Instruction: send ``chunk`` to ``worker``."""

    worker: WorkerId
    chunk: Chunk


@dataclass
class ItemPool:
    """Item ranges not yet assigned, cut from the front in contiguous chunks."""

    ranges: deque[Chunk] = field(default_factory=deque)
    remaining: int = 0  # items in ``ranges``, kept as they change

    @classmethod
    def of(cls, total: int) -> ItemPool:
        return cls(deque([Chunk(0, total)] if total > 0 else []), max(total, 0))

    def take(self, size: int, floor: int = 1) -> Chunk | None:
        """Cut up to ``size`` items (at least one) from the first range.

        A cut that would leave fewer than ``floor`` items in that range takes
        them too, so no sliver is left behind.
        """
        if not self.ranges:
            return None
        head = self.ranges.popleft()
        size = max(1, min(size, head.count))
        if head.count - size < floor:
            size = head.count
        if size < head.count:
            self.ranges.appendleft(Chunk(head.start + size, head.count - size))
        self.remaining -= size
        return Chunk(head.start, size)

    def give_back(self, chunk: Chunk) -> None:
        """Return a chunk (from a lost worker) to be assigned first."""
        self.ranges.appendleft(chunk)
        self.remaining += chunk.count


def require_positive(**values: int) -> None:
    """ValueError naming the first parameter that is not a whole number of at least 1
    (sizes: probe, slice, chunk, floor)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}")


def proportional_split(
    total: int, weights: Mapping[WorkerId, float], floor: int = 1
) -> dict[WorkerId, int]:
    """Cut ``total`` items into integer shares proportional to ``weights``.

    Shares that would fall below ``floor`` are dropped and their items spread
    over the rest (the smallest weights drop first, the latest of equal ones
    first), so every share is at least ``floor`` unless ``total`` itself is
    smaller: then the heaviest worker gets it all.  Rounding goes by largest
    remainder; ties by order.
    """
    if total <= 0 or not weights:
        return {}
    members = [w for w in weights if weights[w] > 0] or list(weights)
    ranked = sorted(
        ((weights[w] if weights[w] > 0 else 1.0, -place, w) for place, w in enumerate(members)),
        reverse=True,
    )
    shares = split_ranked(total, [Ranked(w, weight, -place) for weight, place, w in ranked], floor)
    return {w: shares[w] for w in weights if w in shares}


class Ranked(NamedTuple):
    """A worker's weight in a split and its place in the order the workers are listed."""

    worker: WorkerId
    weight: float
    place: int


def split_ranked(total: int, ranked: list[Ranked], floor: int) -> dict[WorkerId, int]:
    """``proportional_split`` of ``total`` over workers ranked heaviest first (equal weights:
    the first listed first), of which only the first ``total // floor + 1`` can get a share.

    The workers that keep a share are the heaviest ``k``, for the largest ``k`` at which
    the lightest of them still gets ``floor`` (every share is summed in listed order, so
    the result is the one of dropping the lightest worker one at a time).
    """
    if total <= 0 or not ranked:
        return {}
    ranked = ranked[: total // floor + 1]
    if len(ranked) == 1:
        return {ranked[0].worker: total}  # w * (total / w) rounds to total, or just below
    listed = sorted(range(len(ranked)), key=lambda rank: ranked[rank].place)

    def scale(count: int) -> float:
        return total / sum([ranked[rank].weight for rank in listed if rank < count])

    def fair(count: int) -> bool:
        return count == 1 or ranked[count - 1].weight * scale(count) >= floor

    count, running = 1, 0.0
    for rank, member in enumerate(ranked, 1):  # a guess from sums in rank order ...
        running += member.weight
        if member.weight * total / running >= floor:
            count = rank
    while count < len(ranked) and fair(count + 1):  # ... settled with sums in listed order
        count += 1
    while not fair(count):
        count -= 1
    factor = scale(count)
    exact = {ranked[rank].worker: ranked[rank].weight * factor for rank in listed if rank < count}
    shares = {w: math.floor(share) for w, share in exact.items()}
    leftover = total - sum(shares.values())
    for w in sorted(exact, key=lambda w: shares[w] - exact[w])[:leftover]:
        shares[w] += 1
    return {w: share for w, share in shares.items() if share}


#: Up to this many members, sums over the members (equal-finish's totals, the mean known
#: speed) are taken afresh in member order, as they always were, so that small farms make
#: the very decisions they made before; above it they are running sums, equal up to rounding.
SMALL_FARM = 16


class Policy(ABC):
    """Bookkeeping shared by every policy; subclasses decide chunk sizes.

    ``prefetch``: whether a worker that already holds a chunk may be given a
    second one (to hide the round trip).  The paper's policies give work to
    idle devices only, so only fifo and our own policy prefetch.

    Everything is kept as events change it, so an event costs the same with 10 or
    10 000 workers: members by their place in the member order, idle workers by arrival,
    and which of them hold nothing (``free``).
    """

    name: str = "?"
    prefetch: bool = False
    floor: int = 1  # smallest chunk the policy cuts, except the last

    def __init__(
        self,
        total: int,
        workers: Iterable[WorkerId] = (),
        speeds: Mapping[WorkerId, float] | None = None,
    ) -> None:
        self.total = total
        self.pool = ItemPool.of(total)
        self.roster: list[WorkerId] = list(dict.fromkeys(workers))  # eligible at the start
        self.remembered: dict[WorkerId, float] = {w: v for w, v in (speeds or {}).items() if v > 0}
        self.in_flight: dict[WorkerId, list[Chunk]] = {}
        self.idle: dict[WorkerId, int] = {}  # workers waiting for work -> arrival number, in order
        self.free: set[WorkerId] = set()  # idle workers that hold no chunk
        self.roster_place = {w: i for i, w in enumerate(self.roster)}
        # members -> place in the member order: the roster's first, then joiners as they came
        self.place: dict[WorkerId, int] = dict(self.roster_place)
        self.completed = 0
        self.abandoned = 0  # items of chunks given up (counted in ``completed`` too)
        self.max_chunk: int | None = None  # the driver's cap on chunk size (message limits)
        self.holding = 0  # chunks in flight, all workers
        self.now = 0.0  # the latest event's time
        self.events = 0  # events handled: a version number for caches of derived state
        self._arrivals = 0  # numbers the idle workers' arrivals
        self._joins = len(self.roster)  # places of joiners
        self._members: list[WorkerId] | None = None

    @property
    def members(self) -> list[WorkerId]:
        """Workers this job can count on: the starting roster and any that joined, minus the
        lost."""
        if self._members is None:
            self._members = sorted(self.place, key=self.place.__getitem__)
        return self._members

    @property
    def finished(self) -> bool:
        """Every item has been computed."""
        return self.completed >= self.total

    @property
    def remaining(self) -> int:
        """Items not yet assigned to any worker."""
        return self.pool.remaining

    def handle(self, event: Event) -> list[Assign]:
        """The one entry point: apply an event, return the assignments it causes."""
        self.now = max(self.now, event.at)
        self.events += 1
        if isinstance(event, WorkerReady):
            self._ready(event.worker)
        elif isinstance(event, ChunkDone):
            self._complete(event)
        elif isinstance(event, WorkerLost):
            self._lose(event.worker)
        elif isinstance(event, ChunkFailed):
            self._fail(event)
        elif isinstance(event, WorkerBusy):
            self._leave_idle(event.worker)
            return []
        return self._assign()

    def _ready(self, worker: WorkerId) -> None:
        if worker not in self.in_flight:
            self.in_flight[worker] = []
            if worker not in self.place:
                self._join(worker)
        if worker not in self.idle:
            self.idle[worker] = self._arrivals
            self._arrivals += 1
            if not self.in_flight[worker]:
                self._set_free(worker)

    def _join(self, worker: WorkerId) -> None:
        """A new member: at its roster place if it has one, else after everyone."""
        if worker in self.roster_place:
            self.place[worker] = self.roster_place[worker]
        else:
            self.place[worker] = self._joins
            self._joins += 1
        self._members = None
        self.on_member_joined(worker)

    def _set_free(self, worker: WorkerId) -> None:
        self.free.add(worker)
        self.on_free(worker)

    def _leave_idle(self, worker: WorkerId) -> None:
        self.idle.pop(worker, None)
        self.free.discard(worker)

    def free_in_order(self) -> list[WorkerId]:
        """Idle workers that hold nothing, in the order they became idle."""
        return sorted(self.free, key=self.idle.__getitem__)

    def _release(self, worker: WorkerId, chunk: Chunk) -> None:
        """The worker no longer holds the chunk; ValueError if it never did."""
        chunks = self.in_flight.get(worker, [])
        if chunk not in chunks:
            raise ValueError(f"{worker} did not hold {chunk}")
        chunks.remove(chunk)
        self.holding -= 1
        if not chunks and worker in self.idle:
            self._set_free(worker)

    def _complete(self, event: ChunkDone) -> None:
        self._release(event.worker, event.chunk)
        self.completed += event.chunk.count
        self.on_chunk_done(event)

    def _fail(self, event: ChunkFailed) -> None:
        self._release(event.worker, event.chunk)
        if event.retry:
            self.pool.give_back(event.chunk)
            self.on_chunks_returned(event.worker, [event.chunk])
        else:
            self.completed += event.chunk.count
            self.abandoned += event.chunk.count
        self.on_chunk_failed(event)

    def _lose(self, worker: WorkerId) -> None:
        returned = self.in_flight.pop(worker, [])
        self.holding -= len(returned)
        for chunk in reversed(returned):
            self.pool.give_back(chunk)
        self._leave_idle(worker)
        if self.place.pop(worker, None) is not None:
            self._members = None
            self.on_member_left(worker)
        self.on_worker_lost(worker, returned)

    def _assign(self) -> list[Assign]:
        """Offer waiting workers a chunk, in ``offer_order``, while items are left.

        Another pass follows a pass that assigned something, in case one assignment
        changed another worker's answer.
        """
        assignments: list[Assign] = []
        while self.pool.ranges:
            made = len(assignments)
            for worker in self.offer_order():
                if not self.pool.ranges:
                    return assignments
                assignment = self._offer(worker)
                if assignment:
                    assignments.append(assignment)
            if len(assignments) == made or not self.idle:
                break
        return assignments

    def offer_order(self) -> list[WorkerId]:
        """The idle workers to offer a chunk, in turn: workers with nothing in flight first.

        A worker that already holds a chunk (it asked for a second, to hide the
        round trip) gets one only if the policy prefetches, and only while
        enough remains for every worker to get a chunk too; near the end of a
        job, work goes to idle workers only.  A policy may leave out workers
        whose offer it knows would be refused without changing anything.
        """
        return sorted(self.idle, key=lambda w: len(self.in_flight[w]))

    def _offer(self, worker: WorkerId) -> Assign | None:
        busy = bool(self.in_flight[worker])
        if busy and not self.prefetch:
            return None
        size = self.chunk_size(worker)
        if size is None or size <= 0:
            return None
        if self.max_chunk is not None:
            size = min(size, self.max_chunk)
        if busy and self.pool.remaining < size * len(self.in_flight):
            return None
        floor = self.cut_floor()
        chunk = self.pool.take(
            size, floor if self.max_chunk is None else min(floor, self.max_chunk - size + 1)
        )
        if chunk is None:  # the pool ran dry (``_assign`` checks first): nothing to give
            return None
        self._leave_idle(worker)
        self.in_flight[worker].append(chunk)
        self.holding += 1
        self.on_assign(worker, chunk)
        return Assign(worker, chunk)

    def least_share(self) -> int:
        """The smallest share of the whole job a member gets when it is split among the
        members now: ``total // members`` (at least 1).  No policy's first chunk for a
        member is bigger, so a job smaller than the farm's first round still reaches every
        member."""
        return max(1, self.total // max(1, len(self.place)))

    def cut_floor(self) -> int:
        """``floor``, lowered to ``least_share`` for a job too small to give every member a
        floor's worth (a lone member keeps ``floor``)."""
        if len(self.place) <= 1:
            return self.floor
        return min(self.floor, self.least_share())

    @abstractmethod
    def chunk_size(self, worker: WorkerId) -> int | None:
        """Items to give this idle worker now, or None to keep it waiting."""

    def on_assign(self, worker: WorkerId, chunk: Chunk) -> None:
        """Hook: a chunk was just given to a worker."""

    def on_member_joined(self, worker: WorkerId) -> None:
        """Hook: a worker became a member after the start (it joined, or came back after it
        was lost); the roster's members are members from the start."""

    def on_member_left(self, worker: WorkerId) -> None:
        """Hook: a member was lost."""

    def on_free(self, worker: WorkerId) -> None:
        """Hook: an idle worker holds nothing now (it just arrived, or its last chunk ended)."""

    def on_chunk_failed(self, event: ChunkFailed) -> None:
        """Hook: a chunk failed (after it went back to the pool, or was given up)."""

    def on_chunk_done(self, event: ChunkDone) -> None:
        """Hook: a chunk finished (speeds, barriers)."""

    def on_worker_lost(self, worker: WorkerId, returned: list[Chunk]) -> None:
        """Hook: a worker left; ``returned`` are its chunks, back in the pool."""
        self.on_chunks_returned(worker, returned)

    def on_chunks_returned(self, worker: WorkerId, returned: list[Chunk]) -> None:
        """Hook: chunks the worker held are back in the pool (it left, or they failed)."""
