"""What the broker knows of its workers: facts they registered with, slots, history."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from farm import defaults
from farm.broker.facts import WorkerFacts

#: Seconds behind a worker's images/s and busy share in ``farm status``.
RECENT_WINDOW = 5.0
#: Most heartbeat samples kept per worker (a window's worth at the fastest heartbeat).
MAX_SAMPLES = 600


@dataclass
class ModelHistory:
    """A worker's lifetime figures on one model: its standalone speed between jobs."""

    items: int = 0
    compute_s: float = 0.0

    @property
    def rate(self) -> float:
        return self.items / self.compute_s if self.compute_s > 0 else 0.0


class Attempt(Protocol):
    """What the registry reads of a chunk in flight (``farm.broker.jobs.ChunkRecord``)."""

    @property
    def job_id(self) -> str: ...

    @property
    def straggler(self) -> bool: ...


#: The chunks a worker holds: ``jobs.ChunkRecord`` in the broker (the registry does not
#: import the jobs, which hold its entries).
A = TypeVar("A", bound=Attempt)


@dataclass
class WorkerEntry(Generic[A]):
    """One connected worker."""

    identity: bytes
    device: str
    host: str
    pid: int
    backend: str
    threads: int
    models: dict[str, tuple[int, ...]]  # what it can run: name -> input shape
    loaded: set[str]  # models it has loaded
    slots: int
    engines: dict[str, str] = field(default_factory=dict)  # model -> "openvino f32 batch 64"
    startup: dict[str, float] = field(default_factory=dict)  # stage -> wall-clock time
    heartbeat: float = defaults.HEARTBEAT  # seconds between the worker's heartbeats
    last_seen: float = 0.0  # broker clock when the worker was last heard from
    in_flight: dict[int, A] = field(default_factory=dict)
    history: dict[str, ModelHistory] = field(default_factory=dict)
    fetched: dict[str, int] = field(default_factory=dict)  # model -> times its files were sent
    offered: set[str] = field(default_factory=set)  # jobs that declined its free slot
    joined_at: float = 0.0  # broker clock when it registered
    last_answer_at: float = 0.0  # broker clock of its last RESULT taken
    strikes: int = 0  # answers that failed the broker's checks (``farm.broker.quarantine``)
    quarantined: str | None = None  # why it gets no more tasks, once it does not
    # (broker clock, images computed, compute seconds): the worker's running counters as its
    # heartbeats reported them, over the last RECENT_WINDOW seconds and one sample before
    samples: deque[tuple[float, int, float]] = field(
        default_factory=lambda: deque(maxlen=MAX_SAMPLES)
    )
    id: str = ""  # the policies' name for it
    name: str = ""  # host:pid/device, for people (its own word)
    owner: str = ""  # its CURVE key, else its connection (the broker's word)

    def __post_init__(self) -> None:
        self.id = self.identity.hex()
        self.name = f"{self.host}:{self.pid}/{self.device}"

    @property
    def place(self) -> str:
        """host/device: the hardware it runs on (a restarted process keeps it)."""
        return f"{self.host}/{self.device}"

    @classmethod
    def from_facts(cls, identity: bytes, facts: WorkerFacts) -> WorkerEntry[A]:
        """The entry of a worker that registered with ``facts``."""
        entry = cls(
            identity=identity,
            device=facts.device,
            host=facts.host,
            pid=facts.pid,
            backend=facts.backend,
            threads=facts.threads,
            models=dict(facts.models),
            loaded=set(facts.loaded),
            slots=facts.slots,
            heartbeat=facts.heartbeat,
            engines=dict(facts.engines),
            startup=dict(facts.startup),
            owner=facts.owner,
        )
        for model, (images, seconds) in facts.speeds.items():
            entry.history[model] = ModelHistory(images, seconds)
        return entry

    @property
    def free_slots(self) -> int:
        return self.slots - len(self.in_flight)

    def record(self, model: str, items: int, compute_s: float) -> None:
        history = self.history.setdefault(model, ModelHistory())
        history.items += items
        history.compute_s += compute_s
        self.loaded.add(model)

    def note_computed(self, counters: tuple[int, float], now: float) -> None:
        """A heartbeat's running counters (images, compute seconds), counted batch by batch,
        so they move while a long chunk runs."""
        self.samples.append((now, counters[0], counters[1]))
        while len(self.samples) > 2 and self.samples[1][0] <= now - RECENT_WINDOW:
            self.samples.popleft()

    def note_engines(self, engines: dict[str, str]) -> None:
        """The engine running each loaded model (``auto`` chooses per model)."""
        self.engines = dict(engines)

    def recent_load(self) -> tuple[float, float]:
        """Images/s and the busy share (compute seconds per second) over the last
        ``RECENT_WINDOW`` seconds of heartbeats; zeros until two have come."""
        if len(self.samples) < 2:
            return 0.0, 0.0
        (first, images0, busy0), (last, images1, busy1) = self.samples[0], self.samples[-1]
        span = last - first
        if span <= 0:
            return 0.0, 0.0
        return max(0.0, images1 - images0) / span, min(1.0, max(0.0, busy1 - busy0) / span)

    def state(self) -> str:
        """quarantined, straggling (an attempt past its time: ``farm.broker.backups``),
        busy or idle."""
        if self.quarantined:
            return "quarantined"
        if any(record.straggler for record in self.in_flight.values()):
            return "straggling"
        return "busy" if self.in_flight else "idle"

    def describe(self, now: float) -> dict[str, Any]:
        rate, busy = self.recent_load()
        return {
            "name": self.name,
            "heartbeat_age_s": now - self.last_seen,
            "device": self.device,
            "host": self.host,
            "pid": self.pid,
            "backend": self.backend,
            "threads": self.threads,
            "models": sorted(self.models),
            "loaded": sorted(self.loaded),
            "engines": dict(self.engines),
            "startup": dict(self.startup),
            "fetched": dict(self.fetched),
            "state": self.state(),
            "strikes": self.strikes,
            "quarantined": self.quarantined,
            "slots": self.slots,
            "in_flight": len(self.in_flight),
            "rate": rate,
            "busy_share": busy,
            "jobs": sorted({record.job_id for record in self.in_flight.values()}),
            "uptime_s": now - self.joined_at,
            "items_done": sum(h.items for h in self.history.values()),
            "compute_s": sum(h.compute_s for h in self.history.values()),
        }
