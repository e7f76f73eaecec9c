"""A worker's device and settings: which core or GPU it runs on, and what it was told.

``--device cpu:N`` pins the process to core N and caps every compute library at one
thread (``prepare_process``); ``--device cpu`` runs unpinned with the libraries'
defaults; ``--device gpu:N`` runs on CUDA device N.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

from farm import defaults
from farm.engines.engine import GPU_BACKEND, engine_class, limit_threads
from farm.wire.engines import EngineChoice

log = logging.getLogger("farm.worker")

#: glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


#: ``--device cpu:bound``: the core this process was bound to (by ``srun --cpu-bind``).
BOUND = "bound"


def bound_core() -> int:
    """The core a ``cpu:bound`` worker pins itself to: the one it was bound to; of several
    (a core's hyperthreads shared by two tasks, or a whole step's cores where Slurm binds
    nothing), the one at its task's index on the node (``SLURM_LOCALID``), so that tasks
    sharing a set spread over it; else the first."""
    allowed = sorted(os.sched_getaffinity(0))
    local = os.environ.get("SLURM_LOCALID", "")
    if len(allowed) > 1 and local.isdigit():
        return allowed[int(local) % len(allowed)]
    return allowed[0]


@dataclass(frozen=True)
class Device:
    """``cpu`` (all cores), ``cpu:N`` (pinned to core N), ``cpu:bound`` (pinned to the core
    this process was bound to: ``bound_core``) or ``gpu:N`` (CUDA device N)."""

    kind: str
    index: int | None = None

    @classmethod
    def parse(cls, text: str) -> Device:
        kind, _, index = text.partition(":")
        if kind not in ("cpu", "gpu"):
            raise ValueError(f"unsupported device {text!r}; use cpu, cpu:N, cpu:bound or gpu:N")
        if kind == "cpu" and index == BOUND:
            return cls("cpu", bound_core())
        if index and not index.isdigit():
            raise ValueError(f"bad device number in {text!r}")
        return cls(kind, int(index) if index else (0 if kind == "gpu" else None))

    @property
    def pinned(self) -> bool:
        return self.kind == "cpu" and self.index is not None

    @property
    def default_slots(self) -> int:
        return defaults.GPU_SLOTS if self.kind == "gpu" else defaults.SLOTS

    @property
    def engine_device(self) -> str:
        """The device name the engines take: ``cpu`` or ``cuda:N``."""
        return f"cuda:{self.index}" if self.kind == "gpu" else "cpu"

    def check(self) -> None:
        """A GPU must be visible to torch (ValueError says what torch sees instead); it is
        then this process's current device, so that nothing lands on GPU 0 by default."""
        if self.kind != "gpu":
            return
        engine_class(GPU_BACKEND)  # BackendUnavailable if torch is not installed
        import torch

        count = torch.cuda.device_count()
        if (self.index or 0) >= count:
            raise ValueError(
                f"device {self}: torch {torch.__version__} sees "
                f"{count} CUDA device(s)"
                + ("" if count else " (a CPU-only build, or no GPU driver)")
            )
        torch.cuda.set_device(self.index or 0)

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


def prepare_process(device: Device) -> None:
    """Pin to the device's core, cap threads, and keep glibc from returning big buffers.

    Without the mallopt calls glibc maps and unmaps every large activation
    buffer on each batch, which costs a third of LeNet's speed at batch 256+.
    """
    if device.pinned:
        if device.index not in os.sched_getaffinity(0):
            raise ValueError(
                f"core {device.index} is not available to this process "
                f"(allowed: {sorted(os.sched_getaffinity(0))})"
            )
        os.sched_setaffinity(0, {device.index})
        limit_threads(1)  # before OpenCV or torch is imported: both read these when loaded
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)
        # one arena for every thread: a thread's own arena grows in 64 MB heaps and maps
        # anything larger afresh on each batch, which cost the compute thread a third of
        # LeNet's speed at batch 1 000
        libc.mallopt(_M_ARENA_MAX, 1)
    except OSError:
        log.debug("not glibc: malloc left as it is")


@dataclass(kw_only=True)
class WorkerConfig:
    """What ``farm worker`` was told."""

    broker: str
    device: Device
    batch: int | None = None  # None: each model's own prototxt batch
    model_dirs: tuple[str, ...] = ()
    preload: tuple[str, ...] = ()
    slots: int | None = None  # None: the device's default (Device.default_slots)
    max_tasks: int | None = None  # exit after this many chunks (tests, benchmarks)
    backend: str = defaults.BACKEND  # auto: the fastest agreeing backend, chosen per model
    cache_dir: str | None = None  # None: $FARM_CACHE/models or ~/.cache/farm/models
    heartbeat: float = defaults.HEARTBEAT  # seconds between heartbeats to the broker
    liveness: int = defaults.LIVENESS  # silent broker heartbeats before the worker reconnects
    curve: str | None = None  # a `farm keys` folder: connect with CurveZMQ ...
    curve_name: str = defaults.WORKER_KEY  # ... as this key
    fail_items: tuple[int, int] | None = None  # fault injection: chunks touching [a, b) fail
    slow: tuple[float, float] | None = None  # tests: (factor, after seconds), chunks.Throttle
    precision: str = defaults.PRECISION  # one, or the precision gate's list (farm.wire.engines)

    def own_engine(self) -> EngineChoice:
        """The engine chunks run on unless their job chose one; ValueError if malformed."""
        return EngineChoice.parse(self.backend, self.precision)
