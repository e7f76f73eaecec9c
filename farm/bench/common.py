"""What the benches share: process memory from /proc, the machine line, a report tee."""

from __future__ import annotations

import io
import os
import shutil
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any, Callable


def status_kib(pid: int, field: str = "VmRSS") -> int:
    """A ``/proc/PID/status`` memory field (VmRSS, VmHWM...) in KiB."""
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"{field} not in /proc/{pid}/status")


def machine() -> str:
    """One line: cores, memory, GPU."""
    with open("/proc/meminfo") as handle:
        total = int(handle.readline().split()[1]) / 1024 ** 2
    gpu = "a GPU (nvidia-smi found)" if shutil.which("nvidia-smi") else "no GPU"
    return f"machine: {os.cpu_count()} cores, {total:.0f} GiB memory, {gpu}"


class Tee(io.TextIOBase):
    """Write to several text streams at once."""

    def __init__(self, *streams: Any) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
            stream.flush()
        return len(text)


def saved(save: Path, body: Callable[[], int]) -> int:
    """Run ``body``, its printout copied to ``save`` as well (``-``: nowhere); its status."""
    if str(save) == "-":
        return body()
    with open(save, "w") as handle, redirect_stdout(Tee(sys.stdout, handle)):
        return body()
