"""Per-worker speed estimates, refreshed as chunks finish."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from farm.policies.base import SMALL_FARM, Policy, Ranked, WorkerId
from farm.policies.ranking import Entry, LazyHeap

#: Default weight of the newest chunk's speed (see ``SpeedBook``).
DEFAULT_SPEED_ALPHA = 0.5
#: Weight of the newest chunk's deviation in a worker's spread (see ``SpeedBook``).
SPREAD_ALPHA = 0.25


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

    Each worker's ``spread`` is how far its chunk speeds stray from the estimate:
    an exponentially weighted mean (newest weight ``SPREAD_ALPHA``) of
    ``(chunk speed / estimate before the chunk - 1)**2``; its square root is the
    relative deviation to expect of the next chunk (noise, or a device slowing).
    Plain arithmetic, no ``log``, so that it is the same on every CPU.
    """

    alpha: float = DEFAULT_SPEED_ALPHA
    window: float | None = None
    speeds: dict[WorkerId, float] = field(default_factory=dict)
    items: dict[WorkerId, int] = field(default_factory=dict)
    seconds: dict[WorkerId, float] = field(default_factory=dict)
    spreads: dict[WorkerId, float] = field(default_factory=dict)  # mean squared relative deviation
    by_speed: LazyHeap = field(default_factory=LazyHeap, repr=False, compare=False)  # (-v, w)

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"speed_alpha must be within 0..1, got {self.alpha}")
        for worker, speed in self.speeds.items():
            self.by_speed.push(-speed, worker)

    @classmethod
    def seeded(
        cls, alpha: float, remembered: Mapping[WorkerId, float], window: float | None = None
    ) -> SpeedBook:
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
        if previous:
            self.note_spread(worker, (latest / previous - 1.0) ** 2)
        if self.speeds[worker] != previous:
            self.by_speed.push(-self.speeds[worker], worker)
            self.by_speed.rebuild_if_stale(
                len(self.speeds), lambda: ((-speed, w) for w, speed in self.speeds.items())
            )

    def note_spread(self, worker: WorkerId, deviation: float) -> None:
        """Fold a chunk's squared relative deviation from the estimate into the spread."""
        spread = self.spreads.get(worker)
        self.spreads[worker] = (
            deviation if spread is None else spread + SPREAD_ALPHA * (deviation - spread)
        )

    def spread(self, worker: WorkerId) -> float:
        """The worker's relative deviation to expect of a chunk's speed (0 until measured)."""
        return math.sqrt(self.spreads.get(worker, 0.0))

    def fastest(self) -> float | None:
        """The highest speed in the book, None while it is empty."""
        top = self.by_speed.first(1, lambda key, worker: self.speeds.get(worker) == -key)
        return -top[0][0] if top else None

    def get(self, worker: WorkerId) -> float | None:
        return self.speeds.get(worker)

    def knows(self, worker: WorkerId) -> bool:
        return worker in self.speeds

    def forget(self, worker: WorkerId) -> None:
        for table in (self.speeds, self.items, self.seconds, self.spreads):
            table.pop(worker, None)


@dataclass
class MemberSpeeds:
    """A job's members ranked by their speeds in ``book`` as speeds and members change.

    ``place``: each member's place in the member order (the policy's own table).
    Members with a speed are ranked fastest first, the others by place; the
    first few of either, the fastest speed and the mean cost O(log n) each.
    """

    book: SpeedBook
    place: dict[WorkerId, int]
    known: int = 0  # members with a speed
    speed_sum: float = 0.0  # running sum of their speeds
    by_speed: LazyHeap = field(default_factory=LazyHeap, repr=False)  # ((-speed, place), worker)
    unknown: LazyHeap = field(default_factory=LazyHeap, repr=False)  # (place, worker)

    def __post_init__(self) -> None:
        for worker in self.place:
            self.joined(worker)

    def joined(self, worker: WorkerId) -> None:
        speed = self.book.get(worker)
        if speed is None:
            self.unknown.push(self.place[worker], worker)
        else:
            self.known += 1
            self.speed_sum += speed
            self.by_speed.push((-speed, self.place[worker]), worker)
        self._tidy()

    def left(self, worker: WorkerId) -> None:
        """The worker is no longer a member (its entries go stale)."""
        speed = self.book.get(worker)
        if speed is not None:
            self.known -= 1
            self.speed_sum -= speed

    def update(self, worker: WorkerId, items: int, seconds: float) -> None:
        """Fold a finished chunk into the book, and rank the worker by its new speed."""
        before = self.book.get(worker)
        self.book.update(worker, items, seconds)
        after = self.book.get(worker)
        if worker not in self.place or after == before or after is None:
            return
        if before is None:
            self.known += 1
            self.speed_sum += after
        else:
            self.speed_sum += after - before
        self.by_speed.push((-after, self.place[worker]), worker)
        self._tidy()

    def _tidy(self) -> None:
        live = len(self.place)
        self.by_speed.rebuild_if_stale(live, self._ranked_entries)
        self.unknown.rebuild_if_stale(live, self._unknown_entries)

    def _ranked_entries(self) -> Iterable[Entry]:
        return (((-self.book.speeds[w], p), w) for w, p in self.place.items() if self.book.knows(w))

    def _unknown_entries(self) -> Iterable[Entry]:
        return ((p, w) for w, p in self.place.items() if not self.book.knows(w))

    def _live(self, key: tuple[float, int], worker: WorkerId) -> bool:
        place = self.place.get(worker)
        return place == key[1] and self.book.speeds.get(worker) == -key[0]

    def _live_unknown(self, place: int, worker: WorkerId) -> bool:
        return self.place.get(worker) == place and not self.book.knows(worker)

    def fastest(self) -> float | None:
        """The highest speed of a member, None if no member has one."""
        top = self.by_speed.first(1, self._live)
        return -top[0][0][0] if top else None

    def all_known(self) -> bool:
        """Every member has a speed."""
        return self.known == len(self.place)

    def mean(self) -> float:
        """The members' mean speed (1 if none has one): on small farms summed in member
        order, as it always was, else the running sum."""
        if len(self.place) > SMALL_FARM:
            return self.speed_sum / self.known if self.known else 1.0
        known = [
            self.book.speeds[w]
            for w in sorted(self.place, key=self.place.__getitem__)
            if w in self.book.speeds
        ]
        return sum(known) / len(known) if known else 1.0

    def heaviest(self, count: int) -> list[Ranked]:
        """The first ``count`` members by weight, heaviest first (equal: first placed first),
        weighing members without a speed at the mean speed."""
        default = self.mean() if self.known < len(self.place) else 1.0
        if count >= len(self.place):  # everyone: one sort beats taking them off the heaps
            speeds = self.book.speeds
            ranked = [Ranked(w, speeds.get(w, default), p) for w, p in self.place.items()]
        else:
            ranked = [
                Ranked(w, -key[0], key[1]) for key, w in self.by_speed.first(count, self._live)
            ]
            ranked += [
                Ranked(w, default, place)
                for place, w in self.unknown.first(count, self._live_unknown)
            ]
        ranked.sort(key=lambda m: (-m.weight, m.place))
        return ranked[:count]


class MeasuredPolicy(Policy):
    """A policy that measures its workers: a ``SpeedBook`` and its members ranked by speed."""

    def __init__(
        self,
        total: int,
        workers: Iterable[WorkerId],
        speeds: Mapping[WorkerId, float] | None,
        alpha: float,
        window: float | None = None,
        seeded: bool = False,
    ) -> None:
        """``seeded``: the book starts from the speeds remembered from earlier jobs."""
        super().__init__(total, workers, speeds)
        self.speeds = SpeedBook.seeded(alpha, self.remembered if seeded else {}, window)
        self.ranking = MemberSpeeds(self.speeds, self.place)

    def on_member_joined(self, worker: WorkerId) -> None:
        self.ranking.joined(worker)

    def on_member_left(self, worker: WorkerId) -> None:
        self.ranking.left(worker)
