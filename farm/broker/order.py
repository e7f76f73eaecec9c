"""The order in which running jobs are offered a free slot."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from farm.broker.jobs import Job

Key = tuple[int, int, int]


@dataclass
class SlotOrder:
    """Running jobs, highest priority first, then (``fair``) the fewest chunks in flight,
    then the oldest.  Each job stays where its key put it until ``moved`` places it anew."""

    fair: bool = True
    jobs: list[Job] = field(default_factory=list)
    placed: dict[str, Key] = field(default_factory=dict)  # each job's key in ``jobs``

    def key(self, job: Job) -> Key:
        return -job.priority, job.in_flight if self.fair else 0, job.seq

    def place(self, job: Job) -> None:
        """Put the job in ``jobs`` by its key now."""
        self.placed[job.id] = self.key(job)
        bisect.insort(self.jobs, job, key=self.placed_key)

    def unplace(self, job: Job) -> None:
        index = bisect.bisect_left(self.jobs, self.placed[job.id], key=self.placed_key)
        del self.jobs[index]
        del self.placed[job.id]

    def moved(self, job: Job) -> None:
        """Place the job again if its key changed (it holds more chunks, or fewer)."""
        if self.placed[job.id] != self.key(job):
            self.unplace(job)
            self.place(job)

    def placed_key(self, job: Job) -> Key:
        return self.placed[job.id]
