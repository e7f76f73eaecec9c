"""Per-worker speed estimates, refreshed as chunks finish."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from farm.policies.base import WorkerId

#: Default weight of the newest chunk's speed (see ``SpeedBook``).
DEFAULT_SPEED_ALPHA = 0.5


@dataclass
class SpeedBook:
    """Items/second per worker, from the compute seconds of its finished chunks.

    The paper leaves open how ``v_i`` is averaged.  ``alpha`` is the weight of
    the newest chunk: ``1`` keeps only the last chunk's speed, ``0`` the
    cumulative speed over the job (items / seconds of every chunk), and values
    between give an exponentially weighted average of chunk speeds, which
    follows a device that slows down without jumping at every noisy chunk.
    Speeds remembered from earlier jobs seed the book and are refreshed the
    same way.

    With ``window`` (seconds) the newest chunk's weight instead grows with how
    long it ran, ``seconds / (seconds + window)``: a long chunk is a reliable
    measurement of the device as it is now, a short one is mostly jitter.
    """

    alpha: float = DEFAULT_SPEED_ALPHA
    window: float | None = None
    speeds: dict[WorkerId, float] = field(default_factory=dict)
    items: dict[WorkerId, int] = field(default_factory=dict)
    seconds: dict[WorkerId, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"speed_alpha must be within 0..1, got {self.alpha}")

    @classmethod
    def seeded(cls, alpha: float, remembered: Mapping[WorkerId, float],
               window: float | None = None) -> SpeedBook:
        return cls(alpha, window, dict(remembered))

    def update(self, worker: WorkerId, items: int, seconds: float) -> None:
        """Fold in a finished chunk of ``items`` that took ``seconds``."""
        self.items[worker] = self.items.get(worker, 0) + items
        self.seconds[worker] = self.seconds.get(worker, 0.0) + seconds
        if seconds <= 0:
            return  # too fast to time: keep what we had
        latest = items / seconds
        previous = self.speeds.get(worker)
        if previous is None:
            self.speeds[worker] = latest
        elif self.window is not None:
            weight = seconds / (seconds + self.window)
            self.speeds[worker] = weight * latest + (1 - weight) * previous
        elif self.alpha == 0.0:
            self.speeds[worker] = self.items[worker] / self.seconds[worker]
        else:
            self.speeds[worker] = self.alpha * latest + (1 - self.alpha) * previous

    def get(self, worker: WorkerId) -> float | None:
        return self.speeds.get(worker)

    def knows(self, worker: WorkerId) -> bool:
        return worker in self.speeds

    def forget(self, worker: WorkerId) -> None:
        for table in (self.speeds, self.items, self.seconds):
            table.pop(worker, None)

    def weights(self, workers: list[WorkerId]) -> dict[WorkerId, float]:
        """Speeds for splitting among ``workers``: the unknown get the mean known speed (equal if none known)."""
        known = [self.speeds[w] for w in workers if w in self.speeds]
        default = sum(known) / len(known) if known else 1.0
        return {w: self.speeds.get(w, default) for w in workers}
