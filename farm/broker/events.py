"""What goes into ``FarmState.handle`` (events) and what comes out (instructions).

Events are what the broker decoded from a socket (``farm.broker.wire`` makes them), or a
timer; each carries ``at``, the driver's clock.  Instructions are messages to send and
workers to drop; the driver (the broker's I/O loop, through the wire adapter, or the
simulator) carries them out.  ``payload`` and ``header`` fields are opaque to the state:
the broker passes zmq frames and decoded headers through, the simulator whatever it likes.
Both are built by keyword; ``matching`` picks instructions out by their fields.

The state numbers the events it handles, 1 for the first (``Farm.stimulus``), and every
instruction names the one that caused it (``stimulus``, as dask's ``stimulus_id``): the
broker's debug log and a replay tell why each message went out.  It is provenance, not
content: instructions that send the same message compare equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar

from farm.broker.facts import JobOptions, ModelFound, WorkerFacts
from farm.summary import JobSummary
from farm.wire.engines import EngineChoice

Peer = bytes  # a ZeroMQ identity: a worker's or a client's


# ------------------------------------------------------------------------------- events


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerJoined:
    worker: Peer
    facts: WorkerFacts
    at: float


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerLeft:
    """The worker said goodbye (DISCONNECT), or (``crashed``) its connection closed without
    one: its process died, and the chunk it was computing is charged an attempt."""

    worker: Peer
    at: float
    reason: str = "disconnected"
    crashed: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerHeard:
    """A worker's heartbeat, with its running compute counters and engines if it sent them."""

    worker: Peer
    at: float
    computed: tuple[int, float] | None = None
    engines: dict[str, str] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ResultArrived:
    """A worker's RESULT for attempt ``chunk`` of ``job``; ``header``: the RESULT's own
    header, forwarded to the client with the payload (opaque to the state)."""

    worker: Peer
    job: str
    chunk: int
    start: int
    count: int
    output_shape: tuple[int, ...]
    timings: dict[str, float]
    at: float
    header: Any = None
    payload: Any = ()
    problem: str | None = None  # why the result cannot be taken (the wire's checks)
    # the problem lies in the values (not finite, out of range), which may be the images'
    # doing: the worker is blamed only once another device answers the same items well
    in_values: bool = False
    kept: bool = False  # offered again by a worker that lost its broker
    size: int = 0  # the payload's bytes (kept results are held within a bound)
    outputs: Any = None  # the payload's rows (numpy), for spot checks; None: not read
    failed: int = 0  # items that failed on their own (their rows are NaN)


@dataclass(frozen=True, kw_only=True, slots=True)
class FailureArrived:
    """A worker's FAILED for attempt ``chunk``; ``fatal``: the model cannot run, fail the job;
    ``charge``: count it against the chunk's items."""

    worker: Peer
    job: str
    chunk: int
    error: str
    fatal: bool
    at: float
    charge: bool = True
    unshared: bool = False  # the worker cannot read the job's shared inputs


@dataclass(frozen=True, kw_only=True, slots=True)
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
    # where the workers read the items themselves (``farm.wire.storage.SharedInputs``), if they do
    inputs: Any = None
    # (job_start, item_start, count): which of the client's items the job holds, and the
    # same for the client's earlier submissions of it (lost with a broker or a client)
    runs: tuple[tuple[int, int, int], ...] = ()
    earlier: dict[str, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)
    owner: str = ""  # who submitted it: its CURVE key, else its connection (per-client limits)


@dataclass(frozen=True, kw_only=True, slots=True)
class JobCancelled:
    client: Peer
    job: str
    at: float


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientHeard:
    """A client's heartbeat for its job."""

    client: Peer
    job: str
    at: float


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientLeft:
    """A client's connection closed (its process died, or it quit): its jobs end."""

    client: Peer
    at: float


@dataclass(frozen=True, kw_only=True, slots=True)
class DataArrived:
    """A client's DATA: the input of one chunk."""

    client: Peer
    job: str
    chunk: int
    start: int
    count: int
    at: float
    payload: Any = ()
    problem: str | None = None  # why the input cannot be taken (the wire's checks)


@dataclass(frozen=True, kw_only=True, slots=True)
class Tick:
    """Time passed: silent workers and clients expire, job deadlines pass."""

    at: float


FarmEvent = (
    WorkerJoined
    | WorkerLeft
    | WorkerHeard
    | ResultArrived
    | FailureArrived
    | JobSubmitted
    | JobCancelled
    | ClientHeard
    | ClientLeft
    | DataArrived
    | Tick
)


# ------------------------------------------------------------------------- instructions


@dataclass(frozen=True, kw_only=True, slots=True)
class SendNeed:
    """Ask a client for the input of one chunk (it answers with DATA)."""

    client: Peer
    job: str
    chunk: int
    start: int
    count: int
    stimulus: int = field(default=0, compare=False)  # the id of the event that caused it


@dataclass(frozen=True, kw_only=True, slots=True)
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
    engine: EngineChoice | None
    payload: Any = ()
    stored: Literal["files", "npy"] | None = None  # the payload says where the items lie
    place: Any = None  # a shared array's file
    exif_rotate: bool = True  # image files turned upright by their EXIF orientation
    stimulus: int = field(default=0, compare=False)  # the id of the event that caused it


@dataclass(frozen=True, kw_only=True, slots=True)
class SendResult:
    """A chunk's outputs (the worker's ``result``), forwarded to its client; ``trace``:
    assigned, sent and answered, seconds after the job's submission."""

    client: Peer
    result: ResultArrived
    worker: str
    attempt: int
    trace: tuple[float, float, float] | None  # None: a kept result, from a lost broker
    kept: bool = False  # from a worker counted lost, a lost broker or a vanished client
    corrects: bool = False  # replaces rows sent before (their worker lost a spot check)
    stimulus: int = field(default=0, compare=False)  # the id of the event that caused it


@dataclass(frozen=True, kw_only=True, slots=True)
class SendFailed:
    """Items given up (every attempt failed): the client fills them and reports them."""

    client: Peer
    job: str
    chunk: int
    start: int
    count: int
    error: str
    stimulus: int = field(default=0, compare=False)  # the id of the event that caused it


@dataclass(frozen=True, kw_only=True, slots=True)
class SendDone:
    client: Peer
    job: str
    summary: JobSummary
    stimulus: int = field(default=0, compare=False)  # the id of the event that caused it


@dataclass(frozen=True, kw_only=True, slots=True)
class SendCancel:
    """To a client: its job stopped (``reason``, ``summary``); to a worker: drop the job's
    chunks (neither), or (``chunk``) that attempt alone."""

    peer: Peer
    job: str
    reason: str | None = None
    summary: JobSummary | None = None
    chunk: int | None = None
    stimulus: int = field(default=0, compare=False)  # the id of the event that caused it


@dataclass(frozen=True, kw_only=True, slots=True)
class SendError:
    peer: Peer
    error: str
    job: str | None = None
    unknown_job: bool = False
    resubmit: bool = False  # the job was not made: submit what is still missing
    stimulus: int = field(default=0, compare=False)  # the id of the event that caused it


@dataclass(frozen=True, kw_only=True, slots=True)
class DropWorker:
    """A peer the state does not know as a worker spoke like one: tell it to register again."""

    worker: Peer
    stimulus: int = field(default=0, compare=False)  # the id of the event that caused it


Instruction = (
    SendNeed | SendTask | SendResult | SendFailed | SendDone | SendCancel | SendError | DropWorker
)


Kind = TypeVar("Kind")


def matching(instructions: list[Any], kind: type[Kind], **values: Any) -> list[Kind]:
    """The instructions of type ``kind`` whose fields equal ``values``, in order."""
    names = {f.name for f in fields(kind)}  # type: ignore[arg-type]
    unknown = set(values) - names
    if unknown:
        raise TypeError(f"{kind.__name__} has no field {', '.join(sorted(unknown))}")
    return [
        each
        for each in instructions
        if isinstance(each, kind)
        and all(getattr(each, name) == value for name, value in values.items())
    ]
