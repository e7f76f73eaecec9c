"""What the benches share: process memory from /proc, the machine line, a report tee."""

from __future__ import annotations

import io
import os
import shutil
import sys
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any


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
        total = int(handle.readline().split()[1]) / 1024**2
    gpu = "a GPU (nvidia-smi found)" if shutil.which("nvidia-smi") else "no GPU"
    return f"machine: {os.cpu_count()} cores, {total:.0f} GiB memory, {gpu}"


def cpu_line() -> str:
    """The CPU's name and the flags that decide which precisions it runs fast."""
    from farm.engines.cpu import PRECISION_FLAGS, cpu_flags, cpu_name

    flags = cpu_flags()
    marks = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in PRECISION_FLAGS)
    return f"CPU: {cpu_name()}; {marks}"


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


def shared_squeezenet(root: Path, source: Path, resize: bool = False) -> Path:
    """A repository folder under ``root`` holding the shared ImageNet SqueezeNet v1.0 from
    ``source`` (copied: its weights may not enter the repository), BGR minus Caffe's channel
    means; ``resize``: shorter side 256 and a centre crop for image files of any size."""
    folder = root / "squeezenet_v1.0"
    folder.mkdir(parents=True)
    for name in ("deploy.prototxt", "squeezenet_v1.0.caffemodel", "synset_words.txt"):
        shutil.copy(source / name, folder / name)
    (folder / "model.toml").write_text(
        'prototxt = "deploy.prototxt"\nweights = "squeezenet_v1.0.caffemodel"\n'
        'labels = "synset_words.txt"\n[preprocess]\nlayout = "HWC"\nchannel_swap = [2, 1, 0]\n'
        "mean = [104.0, 117.0, 123.0]\n"
        + ('[resize]\nshorter_side = 256\ncrop = "center"\n' if resize else "")
    )
    return folder
