"""The user's side of a job: ``Client`` submits it and streams answers back in input order;
``inputs`` reads arrays, ``.npy`` files and image folders; ``journal`` makes a job resumable;
``answers`` names what came back; ``report`` and ``trace`` explain where the time went."""

from __future__ import annotations

from importlib import import_module
from typing import Any

#: The public names, loaded on first use (``farm.client.npy`` needs no sockets).
_PUBLIC = (
    "Client",
    "FarmError",
    "FarmTimeout",
    "NoWorker",
    "OutputError",
    "OutputRefused",
    "ResumeRefused",
    "JobResult",
)

__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'farm.client' has no attribute {name!r}")
    return getattr(import_module("farm.client.client"), name)
