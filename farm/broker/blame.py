"""What a lost or failed attempt says about its images: the evidence kept per job.

Infrastructure faults are not the work's fault (issue 17).  So:

* An attempt is *charged* to its items only if its worker failed it (FAILED), or died (its
  connection closed with no goodbye) while computing it.  A chunk queued behind the one
  computing, or held by a worker lost to silence, a goodbye or a broker restart, runs
  again uncharged.
* A charged chunk leaves its policy for the job's retry line, which runs it again on
  another device where there is one.  Items charged on two distinct devices (or
  ``max_attempts`` times on one) are *suspect*: their range is narrowed: run in halves,
  a half charged again is halved, down to single images.  A single image is given up
  once it was charged by itself on two devices (or ``max_attempts`` times), with its
  own last error.
* Every run that ends without a result, charged or not, counts towards ``max_runs``: a
  range run that often is given up as one that kept losing its workers, a cause
  reported apart from failures.
* A result that fails the broker's checks (``farm.broker.quarantine``) is *refused*: the
  attempt is the worker's fault, not its items'.  The range runs again on another
  device; a refused answer whose values were wrong is held against its worker once
  another device answers the same items well (``Evidence.settle`` returns it).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from farm.policies import Chunk


@dataclass(frozen=True)
class Mark:
    """One attempt at items ``[start, stop)`` that ended without a result."""

    start: int
    stop: int
    device: str  # host/device of the worker that ran it: two processes on one core are one
    error: str
    charged: bool  # the attempt is evidence against its items
    refused: str = ""  # the id of the worker whose answer the checks refused
    blame_later: bool = False  # refused for its values: its worker is blamed on settling


@dataclass(frozen=True)
class Tally:
    """The most any one item of a range was run, charged, and charged on distinct devices."""

    runs: int = 0
    charges: int = 0
    devices: int = 0


@dataclass
class Evidence:
    """A job's marks: what its failed and lost attempts say, range by range.  Marks of
    items that came back are dropped (``settle``), so they stay few."""

    marks: list[Mark] = field(default_factory=list)
    charged: int = 0  # attempts charged, over the job
    lost: int = 0  # attempts lost uncharged, over the job
    refused: int = 0  # answers the checks refused, over the job

    def add(self, mark: Mark) -> None:
        self.marks.append(mark)
        if mark.charged:
            self.charged += 1
        elif mark.refused:
            self.refused += 1
        else:
            self.lost += 1

    def settle(self, chunk: Chunk) -> list[Mark]:
        """The chunk's items came back: forget the marks that lie within it; return those
        of refused answers whose worker is to be blamed now (``Mark.blame_later``)."""
        if not self.marks:
            return []
        inside = [chunk.start <= m.start and m.stop <= chunk.stop for m in self.marks]
        if not any(inside):
            return []
        blamed = [m for m, i in zip(self.marks, inside) if i and m.blame_later]
        self.marks = [m for m, i in zip(self.marks, inside) if not i]
        return blamed

    def tally(self, chunk: Chunk, alone: bool = False) -> Tally:
        """The worst item of ``chunk``; ``alone``: count only marks of exactly this range
        (what a single image did by itself)."""
        marks = [
            m
            for m in self.marks
            if m.start < chunk.stop
            and chunk.start < m.stop
            and (not alone or (m.start, m.stop) == (chunk.start, chunk.stop))
        ]
        if not marks:
            return Tally()
        edges = sorted({max(m.start, chunk.start) for m in marks})
        worst = Tally()
        for item in edges:  # coverage only changes where a mark starts
            over = [m for m in marks if m.start <= item < m.stop]
            charged = [m for m in over if m.charged]
            worst = Tally(
                max(worst.runs, len(over)),
                max(worst.charges, len(charged)),
                max(worst.devices, len({m.device for m in charged})),
            )
        return worst

    def devices_charging(self, chunk: Chunk) -> set[str]:
        """Devices on which an attempt at exactly ``chunk`` was charged or its answer
        refused: the range runs elsewhere where it can."""
        return {
            m.device
            for m in self.marks
            if (m.charged or m.refused) and (m.start, m.stop) == (chunk.start, chunk.stop)
        }


def suspect(tally: Tally, max_attempts: int) -> bool:
    """Charged on two distinct devices, or ``max_attempts`` times on one."""
    return tally.devices >= 2 or tally.charges >= max_attempts


def halves(chunk: Chunk) -> tuple[Chunk, Chunk]:
    """A range of two or more items cut in two."""
    first = chunk.count // 2
    return Chunk(chunk.start, first), Chunk(chunk.start + first, chunk.count - first)


def retry_index(
    retries: Iterable[Chunk], evidence: Evidence, place: str, places: Collection[str]
) -> int | None:
    """The first range of a retry line a worker on ``place`` may run: one no worker on its
    device was charged for, unless no other device (of ``places``, those connected) is left;
    None if it may run none."""
    for index, chunk in enumerate(retries):
        blamed = evidence.devices_charging(chunk)
        if place not in blamed or not other_place(place, blamed, places):
            return index
    return None


def other_place(place: str, blamed: set[str], places: Collection[str]) -> bool:
    """Whether a connected device other than ``place`` and ``blamed`` is left."""
    others = len(places) - (place in places)
    return others > sum(1 for p in blamed if p != place and p in places)


__all__ = ["Evidence", "Mark", "Tally", "halves", "retry_index", "suspect"]
