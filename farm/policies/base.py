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
* ``WorkerLost(worker)``: the worker is gone; its chunks in flight go back
  to the pool and are handed to idle workers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class ChunkDone:
    worker: WorkerId
    chunk: Chunk
    seconds: float


@dataclass(frozen=True)
class WorkerLost:
    worker: WorkerId


Event = WorkerReady | ChunkDone | WorkerLost


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

    def take(self, size: int) -> Chunk | None:
        """Cut up to ``size`` items (at least one) from the first range."""
        if not self.ranges:
            return None
        head = self.ranges.popleft()
        size = max(1, min(size, head.count))
        if size < head.count:
            self.ranges.appendleft(Chunk(head.start + size, head.count - size))
        self.remaining -= size
        return Chunk(head.start, size)

    def give_back(self, chunk: Chunk) -> None:
        """Return a chunk (from a lost worker) to be assigned first."""
        self.ranges.appendleft(chunk)
        self.remaining += chunk.count


class Policy(ABC):
    """Bookkeeping shared by every policy; subclasses decide chunk sizes."""

    name: str = "?"

    def __init__(self, total: int) -> None:
        self.total = total
        self.pool = ItemPool.of(total)
        self.in_flight: dict[WorkerId, list[Chunk]] = {}
        self.idle: list[WorkerId] = []  # workers waiting for work, in arrival order
        self.completed = 0

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
        if isinstance(event, WorkerReady):
            self.in_flight.setdefault(event.worker, [])
            if event.worker not in self.idle:
                self.idle.append(event.worker)
        elif isinstance(event, ChunkDone):
            self._complete(event)
        elif isinstance(event, WorkerLost):
            self._lose(event.worker)
        return self._assign()

    def _complete(self, event: ChunkDone) -> None:
        chunks = self.in_flight.get(event.worker, [])
        if event.chunk not in chunks:
            raise ValueError(f"{event.worker} did not hold {event.chunk}")
        chunks.remove(event.chunk)
        self.completed += event.chunk.count
        self.on_chunk_done(event)

    def _lose(self, worker: WorkerId) -> None:
        for chunk in reversed(self.in_flight.pop(worker, [])):
            self.pool.give_back(chunk)
        if worker in self.idle:
            self.idle.remove(worker)
        self.on_worker_lost(worker)

    def _assign(self) -> list[Assign]:
        """Offer waiting workers a chunk: workers with nothing in flight first.

        A worker that already holds a chunk (it asked for a second, to hide the
        round trip) gets one only while enough remains for every worker to get
        a chunk too; near the end of a job, work goes to idle workers only.
        """
        assignments = []
        for worker in sorted(self.idle, key=lambda w: len(self.in_flight[w])):
            if not self.pool.ranges:
                break
            size = self.chunk_size(worker)
            if size is None:
                continue
            if self.in_flight[worker] and self.pool.remaining < size * len(self.in_flight):
                continue
            chunk = self.pool.take(size)
            self.idle.remove(worker)
            self.in_flight[worker].append(chunk)
            assignments.append(Assign(worker, chunk))
        return assignments

    @abstractmethod
    def chunk_size(self, worker: WorkerId) -> int | None:
        """Items to give this idle worker now, or None to keep it waiting."""

    def on_chunk_done(self, event: ChunkDone) -> None:
        """Hook: a chunk finished (speeds, barriers)."""

    def on_worker_lost(self, worker: WorkerId) -> None:
        """Hook: a worker left."""
