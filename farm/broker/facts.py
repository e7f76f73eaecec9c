"""Small facts the scheduling core is told: a worker's, a job's options, a model's.

Events (``farm.broker.events``), jobs (``farm.broker.jobs``) and the registry
(``farm.broker.registry``) all use them, and this module uses none of those, so they
import in one direction.  The wire adapter (``farm.broker.wire``) makes them from
checked headers; the simulator and tests make them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from farm import defaults
from farm.wire.engines import EngineChoice


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerFacts:
    """What a worker registers with (its READY header, checked)."""

    device: str
    host: str
    pid: int
    backend: str
    threads: int
    models: dict[str, tuple[int, ...]]  # name -> input shape: what it can run
    loaded: frozenset[str]  # models it has loaded
    slots: int
    heartbeat: float = defaults.HEARTBEAT
    engines: dict[str, str] = field(default_factory=dict)
    speeds: dict[str, tuple[int, float]] = field(default_factory=dict)  # images, compute s
    startup: dict[str, float] = field(default_factory=dict)  # stage -> wall-clock time
    owner: str = ""  # who it is to the broker: its CURVE key, else its connection


@dataclass(frozen=True, kw_only=True, slots=True)
class JobOptions:
    """What a client chooses per job (the SUBMIT header's ``options``).

    ``algo`` and ``params``: the job's own policy (default: the broker's);
    ``priority``: jobs of higher priority are offered free slots first;
    ``timeout``: seconds after submission at which the broker cancels the job;
    ``client``: who submitted it (``host:pid``), shown by ``farm status``;
    ``engine``: the backend and precisions the workers run this job's chunks in, instead
    of their own; ``exif_rotate``: image files are turned upright by their EXIF orientation
    (False: decoded as stored).
    """

    algo: str | None = None
    params: tuple[tuple[str, Any], ...] = ()
    priority: int = 0
    timeout: float | None = None
    client: str = ""
    engine: EngineChoice | None = None
    exif_rotate: bool = True
    verify: float | None = None  # part of its images spot-checked (None: the broker's)

    def policy(self, default_algo: str, default_params: dict[str, Any]) -> tuple[str, dict]:
        """The job's policy name and parameters: the broker's unless the job chose (they are
        checked when the broker makes the job's policy)."""
        if self.algo is None or (self.algo == default_algo and not self.params):
            return default_algo, dict(default_params)
        return self.algo, dict(self.params)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFound:
    """The broker's repository holds the job's model: its input shape and content digest."""

    item_shape: tuple[int, ...]
    digest: str
    layout: str = "CHW"
    crops: int = 1  # inputs per image file (10 when the model oversamples)
    # one image's outputs, from the net itself (None: unknown, the first result's is taken)
    output_shape: tuple[int, ...] | None = None
    softmax: bool = False  # the outputs are probabilities: each within 0..1
