"""How long a farm took to start: when each process started, imported its code and was
ready, on one wall clock (every process of a local farm shares it).

``farm run --timings`` prints the stages; workers send theirs in READY (``startup``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

#: When this process was forked from its farm's (``farm.ops.forked``), to the microsecond.
forked_at: float | None = None


def process_started(pid: int | None = None) -> float:
    """The wall-clock time the process started (``time.time()``'s clock): the fork's own
    stamp for this process when it was forked by farm, else /proc's, to the kernel's tick
    (10 ms); now if /proc cannot say."""
    if forked_at is not None and pid in (None, os.getpid()):
        return forked_at
    found = process_state(pid or os.getpid())
    return time.time() if found is None else found[1]


def process_state(pid: int) -> tuple[str, float] | None:
    """A process's state letter (``R``, ``S``, ``Z`` for a zombie...) and the wall-clock
    time it started, to the kernel's tick, from /proc; None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # from field 3, the state
        with open("/proc/uptime") as uptime:
            booted_s_ago = float(uptime.read().split()[0])
        ticks = int(fields[19])  # field 22: starttime, in ticks since boot
    except (OSError, ValueError, IndexError):
        return None
    return fields[0], time.time() - booted_s_ago + ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class Timeline:
    """Named moments (wall clock) of one process's start-up, in order."""

    stamps: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of_this_process(cls) -> Timeline:
        return cls({"process": process_started()})

    def mark(self, stage: str) -> None:
        self.stamps[stage] = time.time()

    def rows(self, origin: float, who: str = "") -> list[tuple[float, str]]:
        """``(seconds since origin, "who: stage")`` for each stage."""
        prefix = f"{who}: " if who else ""
        return [(at - origin, prefix + stage) for stage, at in self.stamps.items()]


def breakdown(rows: list[tuple[float, str]]) -> list[str]:
    """One line per stage, in time order, with the seconds since the previous one."""
    lines, previous = [], 0.0
    for at, stage in sorted(rows):
        lines.append(f"  {at:6.3f} s  (+{max(0.0, at - previous):.3f})  {stage}")
        previous = at
    return lines
