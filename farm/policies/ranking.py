"""A heap whose entries may go stale: the first few live entries in O(log n) each."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from farm.policies.base import WorkerId

Entry = tuple[Any, WorkerId]


@dataclass
class LazyHeap:
    """A min-heap of ``(key, worker)``; an entry stays in when its worker's key changes.

    Owners push a worker's new key and let the old entry go stale: ``valid(key, worker)``
    tells which entries are live.  Stale entries are dropped when they come to the top,
    and all at once by ``rebuild_if_stale`` when they outnumber the live ones.
    """

    entries: list[Entry] = field(default_factory=list)

    def push(self, key: Any, worker: WorkerId) -> None:
        heapq.heappush(self.entries, (key, worker))

    def first(self, count: int, valid: Callable[[Any, WorkerId], bool]) -> list[Entry]:
        """Up to ``count`` live entries, smallest first, one per worker; they stay in."""
        taken: list[Entry] = []
        seen: set[WorkerId] = set()
        while self.entries and len(taken) < count:
            key, worker = heapq.heappop(self.entries)
            if worker not in seen and valid(key, worker):
                seen.add(worker)
                taken.append((key, worker))
        for entry in taken:
            heapq.heappush(self.entries, entry)
        return taken

    def rebuild_if_stale(self, live: int, entries: Callable[[], Iterable[Entry]]) -> None:
        """Start afresh from ``entries()`` once the heap holds over twice ``live`` entries."""
        if len(self.entries) > 2 * live + 64:
            self.entries = list(entries())
            heapq.heapify(self.entries)
