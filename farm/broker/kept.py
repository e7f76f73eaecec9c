"""Results workers kept across a lost broker, waiting for their client to come back.

A worker that loses its broker keeps the results it sent last and offers them again
(``Result.kept``) to the broker it registers with next.  That broker, restarted, knows
none of their jobs; it holds them here, bounded in bytes and in time, until a client
submits again naming the lost job among its ``earlier`` submissions, and then passes
them on: the client takes each item once, as always.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from farm.broker import events as ev

#: Most bytes of kept results held at once; the oldest go first.
MAX_KEPT_BYTES = 256 << 20
#: Seconds a kept result waits for its client before it is dropped.
KEPT_SECONDS = 120.0


@dataclass
class KeptResults:
    """Kept results by job, oldest first, with their sizes and arrival times."""

    max_bytes: int = MAX_KEPT_BYTES
    seconds: float = KEPT_SECONDS
    held: OrderedDict[int, ev.ResultArrived] = field(default_factory=OrderedDict)
    by_job: dict[str, list[int]] = field(default_factory=dict)
    size: int = 0
    next_id: int = 0
    dropped: int = 0  # results dropped unclaimed (too old, or over the byte bound)

    def add(self, result: ev.ResultArrived) -> None:
        """Hold a kept result; drop the oldest beyond the byte bound."""
        self.held[self.next_id] = result
        self.by_job.setdefault(result.job, []).append(self.next_id)
        self.next_id += 1
        self.size += result.size
        while self.size > self.max_bytes and self.held:
            self.drop_oldest()

    def take(self, jobs: tuple[str, ...]) -> list[ev.ResultArrived]:
        """The results held for these jobs, in arrival order; they are no longer held."""
        ids = sorted(i for job in jobs for i in self.by_job.pop(job, ()))
        taken = []
        for i in ids:
            result = self.held.pop(i)
            self.size -= result.size
            taken.append(result)
        return taken

    def expire(self, now: float) -> None:
        """Drop the results older than ``seconds``."""
        while self.held and next(iter(self.held.values())).at < now - self.seconds:
            self.drop_oldest()

    def drop_oldest(self) -> None:
        i, result = self.held.popitem(last=False)
        self.size -= result.size
        self.dropped += 1
        ids = self.by_job[result.job]
        ids.remove(i)
        if not ids:
            del self.by_job[result.job]

    def __len__(self) -> int:
        return len(self.held)


Run = tuple[int, int, int]  # (job_start, item_start, count)


def translate(
    source: Sequence[Run], target: Sequence[Run], start: int, count: int
) -> list[tuple[int, int]]:
    """Items ``start..start + count`` of one submission of a job (its ``source`` runs) as
    ranges ``[first, stop)`` of another's (``target``): the client's items both hold.  Runs
    are in the client's item order, as ``Client.run`` makes them."""
    stop = start + count
    ranges = []
    item_starts = [item for _, item, _ in target]
    for job_start, item_start, run_count in source:
        low, high = max(start, job_start), min(stop, job_start + run_count)
        if low >= high:
            continue
        first, last = item_start + low - job_start, item_start + high - job_start
        index = max(0, bisect.bisect_right(item_starts, first) - 1)
        for target_start, target_item, target_count in target[index:]:
            if target_item >= last:
                break
            lo, hi = max(first, target_item), min(last, target_item + target_count)
            if lo < hi:
                ranges.append((target_start + lo - target_item, target_start + hi - target_item))
    return ranges
