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

from abc import ABC, abstractmethod
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping

WorkerId = str

#: Chunks below this many items pay visible per-chunk overhead (SPEC.md).
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


def proportional_split(total: int, weights: Mapping[WorkerId, float],
                       floor: int = 1) -> dict[WorkerId, int]:
    """Cut ``total`` items into integer shares proportional to ``weights``.

    Shares that would fall below ``floor`` are dropped and their items spread
    over the rest (the smallest weights drop first), so every share is at
    least ``floor`` unless ``total`` itself is smaller: then the heaviest
    worker gets it all.  Rounding goes by largest remainder; ties by order.
    """
    if total <= 0 or not weights:
        return {}
    members = [w for w in weights if weights[w] > 0] or list(weights)
    weight = {w: weights[w] if weights[w] > 0 else 1.0 for w in members}
    while True:
        scale = total / sum(weight[w] for w in members)
        exact = {w: weight[w] * scale for w in members}
        if len(members) == 1 or min(exact.values()) >= floor:
            break
        members.remove(min(members, key=lambda w: (exact[w], -members.index(w))))
    shares = {w: math.floor(exact[w]) for w in members}
    leftover = total - sum(shares.values())
    by_remainder = sorted(members, key=lambda w: -(exact[w] - shares[w]))
    for w in by_remainder[:leftover]:
        shares[w] += 1
    return {w: shares[w] for w in weights if shares.get(w)}


class Policy(ABC):
    """Bookkeeping shared by every policy; subclasses decide chunk sizes.

    ``prefetch``: whether a worker that already holds a chunk may be given a
    second one (to hide the round trip).  The paper's policies give work to
    idle devices only, so only fifo and our own policy prefetch.
    """

    name: str = "?"
    prefetch: bool = False
    floor: int = 1  # smallest chunk the policy cuts, except the last

    def __init__(self, total: int, workers: Iterable[WorkerId] = (),
                 speeds: Mapping[WorkerId, float] | None = None) -> None:
        self.total = total
        self.pool = ItemPool.of(total)
        self.roster: list[WorkerId] = list(dict.fromkeys(workers))  # eligible at the start
        self.remembered: dict[WorkerId, float] = {
            w: v for w, v in (speeds or {}).items() if v > 0}
        self.in_flight: dict[WorkerId, list[Chunk]] = {}
        self.idle: list[WorkerId] = []  # workers waiting for work, in arrival order
        self.lost: set[WorkerId] = set()
        self.completed = 0
        self.abandoned = 0  # items of chunks given up (counted in ``completed`` too)
        self.max_chunk: int | None = None  # the driver's cap on chunk size (message limits)
        self.holding = 0  # chunks in flight, all workers
        self.now = 0.0  # the latest event's time
        self.events = 0  # events handled: a version number for caches of derived state
        self._members: list[WorkerId] | None = None

    @property
    def members(self) -> list[WorkerId]:
        """Workers this job can count on: the starting roster and any that joined, minus the lost."""
        if self._members is None:
            known = dict.fromkeys([*self.roster, *self.in_flight])
            self._members = [w for w in known if w not in self.lost]
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
            if event.worker not in self.in_flight:
                self._members = None
            self.lost.discard(event.worker)
            self.in_flight.setdefault(event.worker, [])
            if event.worker not in self.idle:
                self.idle.append(event.worker)
        elif isinstance(event, ChunkDone):
            self._complete(event)
        elif isinstance(event, WorkerLost):
            self._lose(event.worker)
        elif isinstance(event, ChunkFailed):
            self._fail(event)
        elif isinstance(event, WorkerBusy):
            if event.worker in self.idle:
                self.idle.remove(event.worker)
            return []
        return self._assign()

    def _release(self, worker: WorkerId, chunk: Chunk) -> None:
        """The worker no longer holds the chunk; ValueError if it never did."""
        chunks = self.in_flight.get(worker, [])
        if chunk not in chunks:
            raise ValueError(f"{worker} did not hold {chunk}")
        chunks.remove(chunk)
        self.holding -= 1

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

    def _lose(self, worker: WorkerId) -> None:
        returned = self.in_flight.pop(worker, [])
        self.holding -= len(returned)
        self._members = None
        for chunk in reversed(returned):
            self.pool.give_back(chunk)
        if worker in self.idle:
            self.idle.remove(worker)
        self.lost.add(worker)
        self.on_worker_lost(worker, returned)

    def _assign(self) -> list[Assign]:
        """Offer waiting workers a chunk: workers with nothing in flight first.

        A worker that already holds a chunk (it asked for a second, to hide the
        round trip) gets one only if the policy prefetches, and only while
        enough remains for every worker to get a chunk too; near the end of a
        job, work goes to idle workers only.
        """
        assignments: list[Assign] = []
        while True:  # another pass if one assignment may have changed another's answer
            made = len(assignments)
            for worker in sorted(self.idle, key=lambda w: len(self.in_flight[w])):
                if not self.pool.ranges:
                    return assignments
                assignment = self._offer(worker)
                if assignment:
                    assignments.append(assignment)
            if len(assignments) == made or not self.idle:
                return assignments

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
        chunk = self.pool.take(size, self.floor if self.max_chunk is None
                               else min(self.floor, self.max_chunk - size + 1))
        self.idle.remove(worker)
        self.in_flight[worker].append(chunk)
        self.holding += 1
        self.on_assign(worker, chunk)
        return Assign(worker, chunk)

    @abstractmethod
    def chunk_size(self, worker: WorkerId) -> int | None:
        """Items to give this idle worker now, or None to keep it waiting."""

    def on_assign(self, worker: WorkerId, chunk: Chunk) -> None:
        """Hook: a chunk was just given to a worker."""

    def on_chunk_done(self, event: ChunkDone) -> None:
        """Hook: a chunk finished (speeds, barriers)."""

    def on_worker_lost(self, worker: WorkerId, returned: list[Chunk]) -> None:
        """Hook: a worker left; ``returned`` are its chunks, back in the pool."""
        self.on_chunks_returned(worker, returned)

    def on_chunks_returned(self, worker: WorkerId, returned: list[Chunk]) -> None:
        """Hook: chunks the worker held are back in the pool (it left, or they failed)."""
