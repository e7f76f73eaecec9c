"""Scheduling policies, chosen by name (``farm broker --algo NAME``).

The paper's six (docs/scheduling.md) and ours, ``equal-finish``.  Every policy is a pure
object: events in, chunk assignments out (see ``farm.policies.base``).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from farm.policies.base import (
    DEFAULT_FLOOR,
    Assign,
    Chunk,
    ChunkDone,
    ChunkFailed,
    Event,
    Policy,
    WorkerBusy,
    WorkerId,
    WorkerLost,
    WorkerReady,
    proportional_split,
)
from farm.policies.equal_finish import EqualFinishPolicy
from farm.policies.fast_split import FastSplitPolicy
from farm.policies.fifo import FifoPolicy
from farm.policies.hat import HatPolicy
from farm.policies.quick import QuickPolicy
from farm.policies.rounds import RoundPolicy
from farm.policies.sliced import SlicedPolicy
from farm.policies.static import StaticPolicy

#: name -> policy class, in the paper's order, ours last.
POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        StaticPolicy,
        QuickPolicy,
        SlicedPolicy,
        HatPolicy,
        FifoPolicy,
        FastSplitPolicy,
        EqualFinishPolicy,
    )
}

#: The paper's tried values of each policy's main parameter (docs/scheduling.md).
PAPER_PARAMETERS: dict[str, tuple[str, tuple[Any, ...]]] = {
    "static": ("ratio", ((),)),
    "quick": ("probe", (250, 500, 1000, 2000)),
    "sliced": ("slice", (1000, 2000, 5000)),
    "hat": ("slice", (500, 1000, 2000)),
    "fifo": ("chunk", (500, 1000, 2000, 3000)),
    "fast-split": ("ratio", (0.25, 1 / 3, 0.4, 0.5)),
}

#: Policies that wait for a round to finish before the next.
BARRIER_POLICIES = frozenset(
    name for name, cls in POLICIES.items() if issubclass(cls, RoundPolicy) and name != "static"
)


def parameters(name: str) -> dict[str, Any]:
    """A policy's tunable parameters and their defaults."""
    signature = inspect.signature(POLICIES[name].__init__)
    return {
        key: p.default
        for key, p in signature.parameters.items()
        if key not in ("self", "total", "workers", "speeds")
    }


def make_policy(
    name: str,
    total: int,
    workers: Iterable[WorkerId] = (),
    speeds: Mapping[WorkerId, float] | None = None,
    **params: Any,
) -> Policy:
    """A fresh policy instance for one job of ``total`` items."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
    unknown = sorted(set(params) - set(parameters(name)))
    if unknown:
        raise ValueError(
            f"policy {name} takes no parameter {', '.join(unknown)}; "
            f"it takes {', '.join(parameters(name)) or 'none'}"
        )
    return cls(total, workers, speeds, **params)


__all__ = [
    "Assign",
    "BARRIER_POLICIES",
    "Chunk",
    "ChunkDone",
    "ChunkFailed",
    "DEFAULT_FLOOR",
    "Event",
    "PAPER_PARAMETERS",
    "POLICIES",
    "Policy",
    "WorkerBusy",
    "WorkerLost",
    "WorkerReady",
    "make_policy",
    "parameters",
    "proportional_split",
]
