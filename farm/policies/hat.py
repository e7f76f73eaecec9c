"""HAT (docs/scheduling.md): sliced rounds whose slice doubles until the round's finish times are
close."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from farm.policies.base import DEFAULT_FLOOR, WorkerId, require_positive
from farm.policies.rounds import RoundPolicy
from farm.policies.speeds import DEFAULT_SPEED_ALPHA

#: Finish times within this fraction of the slowest count as "close" (the paper leaves it open).
DEFAULT_TOLERANCE = 0.10


class HatPolicy(RoundPolicy):
    """Start with a slice of ``slice`` items (the paper's ``s``: tried 500, 1000, 2000).

    After each barrier: if the last round's finish times were close, or too
    little remains for a doubled slice, split everything that remains by
    speed in one round; otherwise double the slice and split it by speed.

    "Close" (left open by the paper): ``(slowest - fastest) / slowest <=
    tolerance``, over each worker's compute seconds in the round (the round's
    pieces start together at the barrier, so these are its finish times).
    """

    name = "hat"

    def __init__(
        self,
        total: int,
        workers: Iterable[WorkerId] = (),
        speeds: Mapping[WorkerId, float] | None = None,
        slice: int = 1000,
        tolerance: float = DEFAULT_TOLERANCE,
        floor: int = DEFAULT_FLOOR,
        speed_alpha: float = DEFAULT_SPEED_ALPHA,
    ) -> None:
        require_positive(slice=slice)
        if not 0 <= tolerance < 1:
            raise ValueError(f"tolerance must be within 0..1, got {tolerance}")
        super().__init__(total, workers, speeds, floor, speed_alpha)
        self.slice = slice
        self.tolerance = tolerance

    def finish_times_close(self) -> bool:
        times = [t for t in self.last_round_seconds.values() if t > 0]
        if len(times) < 2:
            return len(times) == 1
        return (max(times) - min(times)) / max(times) <= self.tolerance

    def plan_round(self) -> dict[WorkerId, int]:
        if self.round > 1:
            if self.finish_times_close() or self.remaining < 2 * self.slice:
                return self.split(self.remaining)
            self.slice *= 2
        return self.split(min(self.slice, self.remaining))
