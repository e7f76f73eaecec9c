"""fast-split (docs/scheduling.md): probe every worker, then give each idle worker a share of what
remains."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from farm.policies.base import DEFAULT_FLOOR, ChunkDone, WorkerId, require_positive
from farm.policies.speeds import DEFAULT_SPEED_ALPHA, MeasuredPolicy

#: Probe size ``w_s`` (the paper leaves it open): large enough that per-chunk
#: overhead is under 1% on a 10 000 images/s core, small next to real jobs.
DEFAULT_PROBE = 500


class FastSplitPolicy(MeasuredPolicy):
    """The paper's best policy; no barrier.

    An idle worker that has no speed yet, or any idle worker while some member
    has none, gets a probe of ``probe`` items (at most ``least_share``, so a job
    smaller than a probe per member still reaches every member).  Once every member has a speed,
    an idle worker gets ``remaining * ratio * v_i / max(v)`` items (at least
    ``floor``) while ``remaining >= floor``, else all that remains.  Speeds are
    refreshed at every finished chunk (see ``SpeedBook`` for the averaging).
    ``ratio`` is the paper's ``r``: tried 0.25, 0.333, 0.4, 0.5.
    """

    name = "fast-split"

    def __init__(
        self,
        total: int,
        workers: Iterable[WorkerId] = (),
        speeds: Mapping[WorkerId, float] | None = None,
        ratio: float = 0.5,
        probe: int = DEFAULT_PROBE,
        floor: int = DEFAULT_FLOOR,
        speed_alpha: float = DEFAULT_SPEED_ALPHA,
    ) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"fast-split ratio must be within (0, 1], got {ratio}")
        require_positive(probe=probe, floor=floor)
        super().__init__(total, workers, speeds, speed_alpha)
        self.ratio, self.probe, self.floor = ratio, probe, floor

    def offer_order(self) -> list[WorkerId]:
        """Workers that hold nothing, each of which takes a chunk (no prefetch)."""
        return self.free_in_order()

    def chunk_size(self, worker: WorkerId) -> int:
        if not self.ranking.all_known():
            return min(self.probe, self.least_share())
        floor = self.cut_floor()
        if self.remaining < floor:
            return self.remaining
        fastest, speed = self.ranking.fastest(), self.speeds.get(worker)
        assert fastest and speed is not None  # every member has a speed (all_known)
        share = self.remaining * self.ratio * speed / fastest
        return max(floor, math.ceil(share))

    def on_chunk_done(self, event: ChunkDone) -> None:
        self.ranking.update(event.worker, event.chunk.count, event.seconds)
