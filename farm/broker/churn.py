"""How often workers are being lost, and the chunk length that loses least to it.

A worker that dies or goes silent wastes, on average, half the chunk it was
computing; a chunk also costs about ``CHUNK_OVERHEAD`` seconds of messaging and
scheduling.  With ``rate`` unplanned losses per worker-second, a chunk of ``t``
seconds of compute wastes a share ``CHUNK_OVERHEAD / t + rate * t / 2`` of a
worker's time, least at ``t = sqrt(2 * CHUNK_OVERHEAD / rate)``.  Under steady
churn the broker caps chunks there; an isolated fault does not shrink them (one
loss in the window among three workers calls for chunks of 1.3 s, above the
default cap of 1 s).

The rate is counted over the window, or over the time the broker has watched if that
is shorter (``MIN_SPAN`` at least): a broker restarted into a farm in turmoil sees its
first losses as the rate they are, not spread over 30 s it did not watch.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

#: Seconds of worker losses the estimate looks back over.
CHURN_WINDOW = 30.0
#: Seconds a chunk costs beyond its compute: round trip, scheduling, the client's read.
CHUNK_OVERHEAD = 0.01
#: The shortest chunk churn asks for, in seconds of compute.
MIN_CHUNK_SECONDS = 0.1
#: The shortest span losses are counted over, in seconds.
MIN_SPAN = 10.0


@dataclass
class Churn:
    """Unplanned worker losses (deaths, silences) over the last ``CHURN_WINDOW`` seconds."""

    losses: deque[float] = field(default_factory=deque)
    since: float | None = None  # when the broker began to watch (its first event)

    def lost(self, at: float) -> None:
        self.losses.append(at)

    def forget(self, now: float) -> bool:
        """Drop losses older than the window; True if any went."""
        before = len(self.losses)
        while self.losses and self.losses[0] < now - CHURN_WINDOW:
            self.losses.popleft()
        return len(self.losses) < before

    def chunk_seconds(self, workers: int, now: float) -> float | None:
        """The chunk length that wastes least with ``workers`` at the recent loss rate;
        None with no recent loss."""
        if not self.losses or workers < 1:
            return None
        watched = now - (self.since if self.since is not None else now - CHURN_WINDOW)
        rate = len(self.losses) / (min(CHURN_WINDOW, max(MIN_SPAN, watched)) * workers)
        return max(MIN_CHUNK_SECONDS, math.sqrt(2 * CHUNK_OVERHEAD / rate))
