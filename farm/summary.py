"""A finished job's figures: throughput, each worker's share, and waste (docs/scheduling.md).

Waste = (theoretical - achieved) / theoretical, where theoretical is the sum
of the standalone speeds of every worker the job was offered to.  A worker's
standalone speed is measured in the job itself: the items it ran divided by
the compute seconds it reported, so every run measures its own waste.  A worker
that ran none of the job counts at the speed it showed on the model before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec

#: A job whose work, at the sum of the workers' standalone speeds, takes less than this
#: many seconds gets no waste figure of its own: fixed costs (a chunk's round trips, the
#: last result's way back) weigh as much as scheduling there.
SHORT_JOB_SECONDS = 0.5


def plural(count: int, noun: str) -> str:
    """``1 image``, ``2 images``, ``1,000 images``."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def per_second(rate: float, noun: str = "image") -> str:
    """A rate as shown, rounded to a whole number: ``1 image/s``, ``2,400 images/s``."""
    shown = f"{rate:,.0f}"
    return f"{shown} {noun}{'' if shown == '1' else 's'}/s"


def were(count: int) -> str:
    """``1 was``, ``2 were``."""
    return f"{count:,} {'was' if count == 1 else 'were'}"


class WorkerShare(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's part in a job, and its standalone speed on the job's model."""

    name: str
    device: str
    items: int
    chunks: int
    compute_s: float
    rate: float = msgspec.field(name="standalone_rate")  # images per second of compute
    load_s: float = 0.0  # seconds its chunks waited for the model's files and engine


class JobSummary(msgspec.Struct, frozen=True, kw_only=True):
    """A job's figures: the broker's account of it (the document of its DONE or CANCEL),
    with the client's wall time added by the client."""

    total: int  # images in the job
    items: int  # images done (all of them, unless the job stopped early)
    policy: str = "?"
    workers: tuple[WorkerShare, ...] = ()
    shared: bool = False  # other jobs ran on the farm at the same time
    failed_items: int = 0  # images given up after their attempts
    failed_attempts: int = 0  # attempts failed, or cut short by their worker dying
    lost_attempts: int = 0  # attempts whose worker was lost while they waited or ran
    items_run: int = 0  # images sent to workers: the job's size plus what ran again
    # images of ``items`` done by results workers kept across a lost broker, worker or
    # client: computed before, so not in the shares, the rate or the waste
    kept: int = 0
    bad_answers: int = 0  # results that failed the broker's checks: run again elsewhere
    quarantined: tuple[str, ...] = ()  # "worker: why" for workers quarantined meanwhile
    parked: int = 0  # times the job was parked: its client left a NEED unanswered
    verified: int = 0  # images run again on another device as spot checks
    disagreements: int = 0  # spot checks whose two answers disagreed
    unresolved: int = 0  # ... that no third device could settle
    unverified: int = 0  # images sampled that no other device could check
    corrected: int = 0  # images run again because the worker that computed them lost a check
    backups: int = 0  # backup attempts at the job's last chunks (farm/broker/backups.py)
    backup_items: int = 0  # images they ran, or were to run
    # images computed twice, projected when each started: what the attempts they backed up
    # had computed by the time the backups were to end
    backup_extra: int = 0
    backup_wins: int = 0  # ... that answered before the attempts they backed up
    backup_saved_s: float = 0.0  # seconds the wins saved, by the first attempts' projections
    tail_s: float = 0.0  # from the first worker idle with nothing left to the last result
    span_s: float = 0.0  # from the first chunk assigned to the last result
    broker_seconds: float = 0.0  # submission to the last result, on the broker's clock
    seconds: float = 0.0  # the client's wall time, submit to last result

    @property
    def computed(self) -> int:
        """Images done by the job's own attempts (kept results aside)."""
        return self.items - self.kept

    @property
    def rate(self) -> float:
        """Achieved images per second (of the job's own attempts)."""
        return self.computed / self.seconds if self.seconds > 0 else 0.0

    @property
    def theoretical_rate(self) -> float:
        return sum(share.rate for share in self.workers)

    @property
    def load_seconds(self) -> float:
        """Seconds the job waited for engines on fresh workers (they load side by side)."""
        return max((share.load_s for share in self.workers), default=0.0)

    @property
    def waste(self) -> float:
        """1 - images done / what the workers could have done in the job's time, each at
        its standalone speed, minus the time it spent loading the model."""
        capacity = sum(share.rate * max(0.0, self.seconds - share.load_s) for share in self.workers)
        return (capacity - self.computed) / capacity if capacity > 0 else 0.0

    @property
    def work_seconds(self) -> float:
        """The job's work at the sum of the standalone speeds: its ideal length."""
        theoretical = self.theoretical_rate
        return (self.total - self.kept) / theoretical if theoretical > 0 else 0.0

    @property
    def tail_share(self) -> float:
        """The tail as a share of the job's span (broker clock)."""
        return self.tail_s / self.span_s if self.span_s > 0 else 0.0

    def tail_text(self) -> str:
        """``tail 0.31 s (2.1% of the span)``: from the first worker idle with nothing
        left to the job's end."""
        return f"tail {self.tail_s:.2f} s ({self.tail_share:.1%} of the span)"

    def tail_part(self) -> str:
        """``, tail ...`` after the waste, for a job that ran to its end."""
        return f", {self.tail_text()}" if self.items >= self.total and self.span_s > 0 else ""

    def backup_text(self) -> str | None:
        """``backup attempts: 3 chunks (4,000 images), 1.2% extra work, 2 won, 0.80 s
        saved``; None if none."""
        if not self.backups:
            return None
        extra = self.backup_extra / self.total if self.total else 0.0
        return (
            f"backup attempts: {plural(self.backups, 'chunk')} "
            f"({plural(self.backup_items, 'image')}), {extra:.1%} extra work, "
            f"{self.backup_wins:,} won, {self.backup_saved_s:.2f} s saved"
        )

    def waste_text(self) -> str:
        if self.items < self.total:
            return "no waste figure: the job stopped early"
        if self.work_seconds < SHORT_JOB_SECONDS:
            return (
                f"waste {self.waste:.0%}, not meaningful: the job is "
                f"{self.work_seconds * 1000:.0f} ms of work, and in so short a job a "
                f"chunk's round trips weigh as much as scheduling"
            )
        if self.shared:
            return f"waste {self.waste:.1%} (other jobs shared the workers meanwhile)"
        return f"waste {self.waste:.1%}"

    def format(self) -> str:
        """A few aligned lines for the terminal."""
        done = (
            plural(self.items, "image")
            if self.items >= self.total
            else f"{self.items:,} of {plural(self.total, 'image')} (stopped early)"
        )
        lines = [f"{done} in {self.seconds:.3f} s: {per_second(self.rate)} (policy {self.policy})"]
        loading = self.load_seconds
        if loading > 0.001 * self.seconds and loading < self.seconds:
            lines.append(
                f"{loading:.3f} s of it went to loading the model on fresh workers; "
                f"{per_second(self.items / (self.seconds - loading))} once loaded"
            )
        lines += [
            f"theoretical {per_second(self.theoretical_rate)} (sum of standalone "
            f"worker speeds), " + self.waste_text() + self.tail_part(),
            f"  {'worker':<36} {'share':>7} {'images':>8} {'chunks':>6} {'images/s':>9}",
        ]
        for share in sorted(self.workers, key=lambda s: s.name):
            part = share.items / self.items if self.items else 0.0
            lines.append(
                f"  {share.name:<36} {part:>7.1%} {share.items:>8,} "
                f"{share.chunks:>6} {share.rate:>9,.0f}"
            )
        backups = self.backup_text()
        if backups:
            lines.append(backups)
        if self.failed_attempts or self.lost_attempts:
            lines.append(
                f"{plural(max(0, self.items_run - self.total), 'image')} ran again: "
                f"{plural(self.failed_attempts, 'attempt')} failed, "
                f"{were(self.lost_attempts)} lost with their workers"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class FailedItems:
    """Items ``[start, start + count)`` that did not come back, and why."""

    start: int
    count: int
    error: str


def network_seconds(round_trip: float, timings: dict[str, Any]) -> float:
    """The part of a chunk's round trip (TASK sent to RESULT back) spent on the network, both
    ways: what the worker's receive, compute and send times leave over."""
    spent = sum(seconds_of(timings.get(key)) for key in ("receive", "compute", "send"))
    return max(0.0, round_trip - spent)


def seconds_of(value: Any) -> float:
    """A worker's reported time in seconds; 0 for anything not a finite number."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0
