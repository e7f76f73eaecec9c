"""A job's spot checks as data (``farm.broker.verify`` runs them): ranges to run again on
another device, with the answers so far."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from farm.policies import Chunk

#: One answer to a check: (worker id, place, precision, its rows).
Answer = tuple[str, str, str, np.ndarray]


@dataclass
class Check:
    """Items ``chunk`` of a job to run again, and the answers so far: ``(worker id, place,
    precision, rows)``, the first from the chunk's own attempt."""

    chunk: Chunk
    answers: list[Answer] = field(default_factory=list)
    tried: set[str] = field(default_factory=set)  # places that ran it without an answer
    names: list[str] = field(default_factory=list)  # the answers' workers, by name

    @property
    def places(self) -> set[str]:
        """Where it may not run: where an answer came from, or an attempt failed."""
        return {place for _, place, _, _ in self.answers} | self.tried


@dataclass
class Checks:
    """A job's spot checks: waiting for a worker, and in flight; what they found."""

    fraction: float
    rng: random.Random
    waiting: list[Check] = field(default_factory=list)
    running: int = 0
    verified: int = 0  # images checked on a second device
    disagreements: int = 0
    unresolved: int = 0  # disagreements no third device could settle
    dropped: int = 0  # images no other connected device could check
    computed_by: dict[str, list[Chunk]] = field(default_factory=dict)  # worker id -> chunks

    @property
    def open(self) -> bool:
        return bool(self.waiting) or self.running > 0


def checks_of(job_id: str, fraction: float) -> Checks | None:
    """A job's checks at ``fraction`` of its images (None at 0), drawn from a generator
    seeded by its id: a replay samples the same images."""
    return Checks(fraction, random.Random(job_id)) if fraction > 0 else None


__all__ = ["Answer", "Check", "Checks", "checks_of"]
