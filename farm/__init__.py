"""farm: Caffe-model inference spread over every core and GPU, scheduled so no device idles."""

from __future__ import annotations

from importlib import import_module
from typing import Any

#: The public names, loaded on first use: ``import farm.broker.state`` stays free of sockets.
_EXPORTS = {"Client": "farm.client", "FarmError": "farm.client", "FarmTimeout": "farm.client",
            "JobResult": "farm.client", "JobSummary": "farm.summary"}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'farm' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
