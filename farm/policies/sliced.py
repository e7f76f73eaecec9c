"""sliced (docs/scheduling.md): rounds of one slice each, split equally first, then by measured
speed."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from farm.policies.base import DEFAULT_FLOOR, WorkerId, require_positive
from farm.policies.rounds import RoundPolicy
from farm.policies.speeds import DEFAULT_SPEED_ALPHA


class SlicedPolicy(RoundPolicy):
    """Every round hands out ``slice`` items (the paper's ``w``: tried 1000, 2000, 5000).

    The first round splits its slice equally; after each barrier the next
    slice is split by the speeds measured so far (see ``SpeedBook``).
    """

    name = "sliced"

    def __init__(
        self,
        total: int,
        workers: Iterable[WorkerId] = (),
        speeds: Mapping[WorkerId, float] | None = None,
        slice: int = 2000,
        floor: int = DEFAULT_FLOOR,
        speed_alpha: float = DEFAULT_SPEED_ALPHA,
    ) -> None:
        require_positive(slice=slice)
        super().__init__(total, workers, speeds, floor, speed_alpha)
        self.slice = slice

    def plan_round(self) -> dict[WorkerId, int]:
        return self.split(min(self.slice, self.remaining))
