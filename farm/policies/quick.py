"""quick (docs/scheduling.md): a probe round of ``p`` items each, a barrier, then the rest split by
speed."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from farm.policies.base import DEFAULT_FLOOR, WorkerId, require_positive
from farm.policies.rounds import RoundPolicy
from farm.policies.speeds import DEFAULT_SPEED_ALPHA


class QuickPolicy(RoundPolicy):
    """Probe, measure, split once.

    Round 1 gives every member ``probe`` items (the paper's ``p``: tried 250,
    500, 1000, 2000); round 2 splits all that remains by the speeds measured
    in round 1, one chunk each.  A worker that joins after the probe round
    has no speed: it is weighted at the mean of the measured ones.
    """

    name = "quick"

    def __init__(
        self,
        total: int,
        workers: Iterable[WorkerId] = (),
        speeds: Mapping[WorkerId, float] | None = None,
        probe: int = 500,
        floor: int = DEFAULT_FLOOR,
        speed_alpha: float = DEFAULT_SPEED_ALPHA,
    ) -> None:
        require_positive(probe=probe)
        super().__init__(total, workers, speeds, floor, speed_alpha)
        self.probe = probe

    def plan_round(self) -> dict[WorkerId, int]:
        if self.round == 1:
            probes = min(self.remaining, self.probe * len(self.place))
            return (
                self.split(probes)
                if probes < self.probe * len(self.place)
                else {w: self.probe for w in self.members}
            )
        return self.split(self.remaining)
