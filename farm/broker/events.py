"""What goes into ``FarmState.handle`` (events) and what comes out (instructions).

Events are what the broker decoded from a socket, or a timer; each carries ``at``, the
driver's clock.  Instructions are messages to send and workers to drop; the driver (the
broker's I/O loop, or the simulator) carries them out.  ``payload`` fields are opaque to
the state: the broker passes zmq frames through, the simulator whatever it likes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from farm.broker.jobs import JobOptions
from farm.summary import JobSummary

Peer = bytes  # a ZeroMQ identity: a worker's or a client's


# ------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class WorkerFacts:
    """What a worker registers with (its READY header, checked)."""

    device: str
    host: str
    pid: int
    backend: str
    threads: int
    models: dict[str, Any]  # name -> {"input_shape": [...]}: what it can run
    loaded: frozenset[str]  # models it has loaded
    slots: int
    heartbeat: float = 1.0
    engines: dict[str, str] = field(default_factory=dict)
    speeds: dict[str, tuple[int, float]] = field(default_factory=dict)  # images, compute s


@dataclass(frozen=True)
class WorkerJoined:
    worker: Peer
    facts: WorkerFacts
    at: float


@dataclass(frozen=True)
class WorkerLeft:
    """The worker said goodbye (DISCONNECT), or (``crashed``) its connection closed without
    one: its process died, and the chunk it was computing is charged an attempt."""

    worker: Peer
    at: float
    reason: str = "disconnected"
    crashed: bool = False


@dataclass(frozen=True)
class WorkerHeard:
    """A worker's heartbeat, with its running compute counters and engines if it sent them."""

    worker: Peer
    at: float
    computed: tuple[int, float] | None = None
    engines: dict[str, str] | None = None


@dataclass(frozen=True)
class ChunkDone:
    """A worker's RESULT for attempt ``chunk`` of ``job``."""

    worker: Peer
    job: str
    chunk: int
    start: int
    count: int
    dtype: str
    item_shape: tuple[int, ...]
    timings: dict[str, float]
    at: float
    payload: Any = ()
    failed: int = 0  # items that failed on their own (undecodable files, NaN pixels)
    problem: str | None = None  # why the result cannot be taken (a malformed failures list)


@dataclass(frozen=True)
class ChunkFailed:
    """A worker's FAILED for attempt ``chunk``; ``fatal``: the model cannot run, fail the job;
    ``charge``: count it against the chunk's items."""

    worker: Peer
    job: str
    chunk: int
    error: str
    fatal: bool
    at: float
    charge: bool = True


@dataclass(frozen=True)
class ModelFound:
    """The broker's repository holds the job's model: its input shape and content digest."""

    item_shape: tuple[int, ...]
    digest: str
    layout: str = "CHW"
    crops: int = 1  # inputs per image file (10 when the model oversamples)


@dataclass(frozen=True)
class JobSubmitted:
    """A client's SUBMIT; ``model`` is what the broker's repository said of its model (an
    error text if it has no such model)."""

    client: Peer
    job: str
    model_name: str
    dtype: str
    item_shape: tuple[int, ...]
    total: int
    heartbeat: float
    options: JobOptions
    model: ModelFound | str
    at: float


@dataclass(frozen=True)
class JobCancelled:
    client: Peer
    job: str
    at: float


@dataclass(frozen=True)
class ClientHeard:
    """A client's heartbeat for its job."""

    client: Peer
    job: str
    at: float


@dataclass(frozen=True)
class ClientLeft:
    """A client's connection closed (its process died, or it quit): its jobs end."""

    client: Peer
    at: float


@dataclass(frozen=True)
class DataArrived:
    """A client's DATA: the input of one chunk, ``nbytes`` long."""

    client: Peer
    job: str
    chunk: int
    start: int
    count: int
    nbytes: int
    frames: int
    at: float
    payload: Any = ()


@dataclass(frozen=True)
class Tick:
    """Time passed: silent workers and clients expire, job deadlines pass."""

    at: float


Event = (WorkerJoined | WorkerLeft | WorkerHeard | ChunkDone | ChunkFailed | JobSubmitted
         | JobCancelled | ClientHeard | ClientLeft | DataArrived | Tick)


# ------------------------------------------------------------------------- instructions


@dataclass(frozen=True)
class SendNeed:
    """Ask a client for the input of one chunk (it answers with DATA)."""

    client: Peer
    job: str
    chunk: int
    start: int
    count: int


@dataclass(frozen=True)
class SendTask:
    """A chunk's input, forwarded to its worker."""

    worker: Peer
    job: str
    chunk: int
    attempt: int
    start: int
    count: int
    model: str
    digest: str
    dtype: str
    item_shape: tuple[int, ...]
    engine: tuple[str, str] | None
    payload: Any = ()


@dataclass(frozen=True)
class SendResult:
    """A chunk's outputs (the worker's ``result``), forwarded to its client; ``trace``:
    assigned, sent and answered, seconds after the job's submission."""

    client: Peer
    result: ChunkDone
    worker: str
    attempt: int
    trace: tuple[float, float, float]


@dataclass(frozen=True)
class SendFailed:
    """Items given up (every attempt failed): the client fills them and reports them."""

    client: Peer
    job: str
    chunk: int
    start: int
    count: int
    error: str


@dataclass(frozen=True)
class SendDone:
    client: Peer
    job: str
    summary: JobSummary


@dataclass(frozen=True)
class SendCancel:
    """To a client: its job stopped (``reason``, ``summary``); to a worker: drop the job's
    chunks (neither)."""

    peer: Peer
    job: str
    reason: str | None = None
    summary: JobSummary | None = None


@dataclass(frozen=True)
class SendError:
    peer: Peer
    error: str
    job: str | None = None
    unknown_job: bool = False


@dataclass(frozen=True)
class DropWorker:
    """A peer the state does not know as a worker spoke like one: tell it to register again."""

    worker: Peer


Instruction = (SendNeed | SendTask | SendResult | SendFailed | SendDone | SendCancel
               | SendError | DropWorker)
