"""farm: Caffe-model inference spread over every core and GPU, scheduled so no device idles.

The subsystems, one folder each: ``broker`` (the scheduler: a pure ``FarmState`` and the
socket loop around it), ``policies`` (pure scheduling policies), ``workers`` (a device's
process), ``client`` (jobs, inputs and answers on the user's side), ``engines`` (running a
model on a backend), ``modelrepo`` (finding, reading and caching models), ``simulation``
(policies and ``FarmState`` on simulated devices), ``ops`` (local farms, deployment,
configuration), ``cli`` and ``benchsuite`` (the code behind ``farm bench``).  The ``wire``
(frames, messages, the engine choice, the link, CURVE keys) and ``summary`` are shared by
all of them.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

#: The public names, loaded on first use: ``import farm.broker.state`` stays free of sockets.
_EXPORTS = {
    "Client": "farm.client.client",
    "FarmError": "farm.client.client",
    "FarmTimeout": "farm.client.client",
    "JobResult": "farm.client.client",
    "JobSummary": "farm.summary",
}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'farm' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
