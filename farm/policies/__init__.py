"""Scheduling policies, chosen by name (``farm broker --algo NAME``)."""

from __future__ import annotations

from typing import Any, Callable

from farm.policies.base import (Assign, Chunk, ChunkDone, Event, Policy, WorkerLost,
                                WorkerReady)
from farm.policies.fifo import FifoPolicy

#: name -> factory(total items, **parameters)
POLICIES: dict[str, Callable[..., Policy]] = {
    FifoPolicy.name: FifoPolicy,
}


def make_policy(name: str, total: int, **params: Any) -> Policy:
    """A fresh policy instance for one job of ``total`` items."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}") from None
    return factory(total, **params)


__all__ = ["Assign", "Chunk", "ChunkDone", "Event", "Policy", "POLICIES", "WorkerLost",
           "WorkerReady", "make_policy"]
