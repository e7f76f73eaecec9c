"""static (docs/scheduling.md): at the start, worker ``i`` gets ``W * r_i / sum(r)`` items in one
chunk."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from farm.policies.base import DEFAULT_FLOOR, WorkerId, proportional_split
from farm.policies.rounds import RoundPolicy


class StaticPolicy(RoundPolicy):
    """One round, cut by fixed ratios.

    ``ratio`` gives ``r_1..r_n`` for the workers in the order they are known
    (the starting roster, then joiners); a worker beyond the list gets the
    mean ratio, so the default (empty) splits equally.  Nothing is measured.
    Items a lost worker leaves behind go to the next idle worker; if items
    somehow remain after the round, the next round splits them by ratio too.
    """

    name = "static"

    def __init__(
        self,
        total: int,
        workers: Iterable[WorkerId] = (),
        speeds: Mapping[WorkerId, float] | None = None,
        ratio: Sequence[float] = (),
        floor: int = DEFAULT_FLOOR,
    ) -> None:
        if any(r <= 0 for r in ratio):
            raise ValueError(f"static ratios must be positive, got {list(ratio)}")
        super().__init__(total, workers, speeds, floor)
        self.ratio = tuple(float(r) for r in ratio)

    def weights(self) -> dict[WorkerId, float]:
        """Each member's ratio, by its place in the member order."""
        default = sum(self.ratio) / len(self.ratio) if self.ratio else 1.0
        return {
            w: self.ratio[i] if i < len(self.ratio) else default for i, w in enumerate(self.members)
        }

    def least_share(self) -> int:
        """The smallest member's share of the whole job by ratio (at least 1)."""
        weights = self.weights().values()
        if not weights:
            return max(1, self.total)
        return max(1, int(self.total * min(weights) / sum(weights)))

    def plan_round(self) -> dict[WorkerId, int]:
        return proportional_split(self.remaining, self.weights(), self.round_floor)
