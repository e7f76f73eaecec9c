"""Message headers: one typed struct per command (``farm.wire.protocol`` maps commands to them).

A header is decoded with ``msgspec`` straight into its struct, so a missing
field, a field of the wrong type, a number out of range or a string or list too
long is refused while decoding, and the error names the field (``$.count``).
Optional fields are left off the wire while they hold their default.  Checks
that need more than one field, the broker's state or the model repository
(a payload's size, a dtype's item size) stay with the code that has what they
need; a job's engine checks itself (``farm.wire.engines``).
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

#: Heartbeat intervals a peer may announce, in seconds.
from farm.defaults import HEARTBEAT, MAX_HEARTBEAT, MIN_HEARTBEAT  # noqa: E402
from farm.wire.engines import EngineChoice

#: Most items in a job, a chunk or one dimension of an item.
MAX_ITEMS = 1 << 31
#: Most dimensions of an item.
MAX_DIMS = 8
#: Most chunks a worker may ask to have in flight at once.
MAX_SLOTS = 64
#: Models whose engines one worker may report.
MAX_ENGINES = 100
#: Job priorities a client may ask for: higher runs first.
MIN_PRIORITY, MAX_PRIORITY = -100, 100
#: Longest per-job timeout, in seconds (a week).
MAX_TIMEOUT = 7 * 24 * 3600.0
#: Longest string, and longest list, in a header; most entries in a header's map.
MAX_TEXT, MAX_LIST, MAX_MAP = 4096, 4096, 64

Text = Annotated[str, Meta(max_length=MAX_TEXT)]
Name = Annotated[str, Meta(max_length=200)]
JobId = Annotated[str, Meta(min_length=1, max_length=100)]
Start = Annotated[int, Meta(ge=0, le=MAX_ITEMS)]
Count = Annotated[int, Meta(gt=0, le=MAX_ITEMS)]
Shape = Annotated[
    tuple[Annotated[int, Meta(gt=0, le=MAX_ITEMS)], ...], Meta(min_length=1, max_length=MAX_DIMS)
]
Interval = Annotated[float, Meta(ge=MIN_HEARTBEAT, le=MAX_HEARTBEAT)]
Finite = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max)]  # no NaN, no inf
#: A policy parameter's value: a number, a name, a flag, or a list of them.
Scalar = bool | int | float | Text | None
Param = Scalar | Annotated[list[Scalar], Meta(max_length=MAX_LIST)]


class Header(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """A command's header; subclasses list its fields (build them by keyword)."""


class ModelFacts(msgspec.Struct, frozen=True):
    """What a worker advertises about a model it can run."""

    input_shape: Shape


class Ready(Header):
    """worker -> broker: registration with the worker's facts."""

    device: Text
    host: Text
    pid: int
    backend: Text
    models: Annotated[dict[Name, ModelFacts], Meta(max_length=MAX_MAP)]
    slots: Annotated[int, Meta(ge=1, le=MAX_SLOTS)]
    threads: int = 0
    loaded: Annotated[tuple[Name, ...], Meta(max_length=MAX_MAP)] = ()
    engines: Annotated[dict[Name, Name], Meta(max_length=MAX_ENGINES)] = {}
    heartbeat: Interval = HEARTBEAT
    # model -> (images, compute seconds) this process ran: its speed, for a broker that
    # (re)started after it did and would otherwise cut uncapped chunks until it measured one
    speeds: Annotated[
        dict[Name, tuple[Annotated[int, Meta(ge=0)], Annotated[float, Meta(ge=0)]]],
        Meta(max_length=MAX_ENGINES),
    ] = {}
    # when (wall clock) this process started, had imported its code, had loaded its
    # --model models: ``farm run --timings`` shows a farm's start-up from them
    startup: Annotated[dict[Name, float], Meta(max_length=MAX_MAP)] = {}


class ChunkHeader(Header):
    """A header about one chunk: its job, its attempt's id (``chunk``) and its items."""

    job: JobId
    chunk: int
    start: Start
    count: Count


class ArrayPlace(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a shared `.npy` file's rows lie, and what the client saw of it (``storage``)."""

    path: Text
    offset: Annotated[int, Meta(ge=0)]
    size: Annotated[int, Meta(ge=0)]
    head: Annotated[str, Meta(max_length=64)]


class Task(ChunkHeader):
    """broker -> worker: a chunk to run; ``engine`` the job's own, if it chose one.

    ``stored``: the payload says where the items lie on shared storage, not what they are
    (``farm.wire.storage``): "files", their paths and sizes; "npy", row ranges of the file at
    ``place``.
    """

    attempt: int
    model: Text
    digest: Text
    dtype: Text
    item_shape: Shape
    engine: EngineChoice | None = None
    stored: Literal["files", "npy"] | None = None
    place: ArrayPlace | None = None
    exif_rotate: bool = True  # image files turned upright by their EXIF orientation


class Result(ChunkHeader):
    """worker -> broker -> client: a chunk's outputs.

    ``timings`` (receive, compute, send seconds) are judged by the broker, which
    fails the job on a bad one rather than refusing the message.  ``failed``: items
    that failed on their own (image files that cannot be decoded, float32 images with a
    NaN or infinite pixel); their outputs are NaN, and a last payload frame lists them
    with their reasons (``protocol.Message.failures``).  The broker adds for the
    client: the worker's name, the attempt, and ``trace``: when the chunk was
    assigned, sent and answered, in seconds since the job's submission.
    """

    dtype: Text
    item_shape: Shape
    timings: Annotated[dict[Name, Any], Meta(max_length=MAX_MAP)]
    failed: Annotated[int, Meta(ge=0, le=MAX_ITEMS)] = 0
    kept: bool = False  # offered again after a lost broker (``farm.workers.kept``)
    worker: Text = ""
    attempt: int = 1
    trace: tuple[Finite, Finite, Finite] | None = None
    # image files whose EXIF orientation is not "as stored" (turned upright if the job said so)
    oriented: Annotated[int, Meta(ge=0, le=MAX_ITEMS)] = 0
    # a cascade's items whose fast answer was in doubt, run again in f32 (``farm.engines.cascade``)
    rerun: Annotated[int, Meta(ge=0, le=MAX_ITEMS)] = 0
    corrects: bool = False  # broker -> client: these rows replace the ones sent before


class Failed(ChunkHeader):
    """worker -> broker -> client: a chunk could not run; ``fatal``: no retry can help;
    ``charge``: the failure may be the items' fault (False: the worker's own trouble, such
    as a cancelled job or a model fetch that timed out); ``unshared``: the worker cannot
    read the job's shared inputs (``farm.wire.storage``): send it their bytes."""

    error: Text
    fatal: bool = True
    charge: bool = True
    unshared: bool = False


class Options(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """A job's own choices, in SUBMIT: see ``farm.broker.jobs.JobOptions``."""

    client: Name = ""
    priority: Annotated[int, Meta(ge=MIN_PRIORITY, le=MAX_PRIORITY)] = 0
    # part of the job's images run again on another device (spot checks); None: the broker's
    verify: Annotated[float, Meta(ge=0, le=1)] | None = None
    timeout: Annotated[float, Meta(gt=0, le=MAX_TIMEOUT)] | None = None
    algo: Name | None = None
    params: Annotated[dict[Name, Param], Meta(max_length=MAX_MAP)] = {}
    engine: EngineChoice | None = None
    exif_rotate: bool = True  # False: image files decoded as stored, EXIF orientation ignored


class Submit(Header):
    """client -> broker: a new job; ``heartbeat``: the client's interval (default the
    broker's).  Its document (``SubmitDocument``), if any, says where shared inputs lie and
    which earlier submissions of the same job it follows."""

    job: JobId
    model: Text
    dtype: Text
    item_shape: Shape
    total: Count
    options: Options
    heartbeat: Interval | None = None


#: ``(job_start, item_start, count)``: a submission's items ``job_start..`` are the client's
#: items ``item_start..`` (a resubmission holds only the items still missing).
Run = tuple[Start, Start, Count]
Runs = Annotated[list[Run], Meta(max_length=MAX_ITEMS)]


class StoredInputs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a job's items lie on storage its workers share (``farm.wire.storage``).

    ``kind`` "files": ``names``, the items' paths joined by NUL, and ``sizes``, their sizes
    on the client (little-endian uint64); an empty name is an item the client refused (a
    broken link): it fails as an empty file.  ``kind`` "npy": the file ``path``, where its
    rows start (``offset``), its size and a hash of its first bytes (``head``), its
    ``rows``, and ``runs``: the job's items ``job_start..`` are rows ``row..`` (modulo
    ``rows``: a job may repeat the array), ``(job_start, row, count)``.
    """

    kind: Literal["files", "npy"]
    names: bytes = b""
    sizes: bytes = b""
    path: Text = ""
    offset: Annotated[int, Meta(ge=0)] = 0
    size: Annotated[int, Meta(ge=0)] = 0
    head: Annotated[str, Meta(max_length=64)] = ""
    rows: Annotated[int, Meta(ge=0)] = 0
    runs: Runs = []


class SubmitDocument(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """SUBMIT's document: ``inputs``, where the workers read the items themselves; ``runs``,
    which of the client's items this submission holds, and ``earlier``, the same for the
    client's earlier submissions of the job (lost with a broker, or with a killed client
    now resumed): results workers kept for those count for this one (``Result.kept``)."""

    inputs: StoredInputs | None = None
    runs: Runs = []
    earlier: Annotated[dict[JobId, Runs], Meta(max_length=MAX_LIST)] = {}


class Data(ChunkHeader):
    """client -> broker: the items of one chunk (answers NEED)."""


class Need(ChunkHeader):
    """broker -> client: send the input of one chunk."""


class Done(Header):
    """broker -> client: every item of a job came back (the summary is the document)."""

    job: JobId


class Error(Header):
    """broker -> client or worker: a request was refused; ``job`` when it concerns one,
    ``unknown_job`` when the broker does not know it, ``resubmit`` when the client should
    submit what it still misses (results kept from a lost broker just reached it),
    ``registration`` when it refuses a worker's READY (the worker then exits)."""

    error: Text
    job: JobId | None = None
    unknown_job: bool = False
    resubmit: bool = False
    registration: bool = False


class Info(Header):
    """client -> broker: a registry snapshot, once ``wait_workers`` have joined; or, with
    ``model``, that model's card (its class labels and whether it ends in a softmax).  The
    reply carries it as its document."""

    wait_workers: int = 0
    model: Text | None = None


class Heartbeat(Header):
    """Liveness, any direction.  A client names its job; the broker gives its interval
    (and tells a client how many workers are connected); a worker reports its compute
    counters ``(images, seconds)`` and engines."""

    job: JobId | None = None
    interval: Interval | None = None
    workers: Annotated[int, Meta(ge=0, le=MAX_ITEMS)] | None = None
    computed: (
        tuple[Annotated[int, Meta(ge=0, lt=10**18)], Annotated[float, Meta(ge=0, lt=1e18)]] | None
    ) = None
    engines: Annotated[dict[Name, Name], Meta(max_length=MAX_ENGINES)] | None = None


class Disconnect(Header):
    """worker -> broker: leaving; broker -> worker: register again."""


class Fetch(Header):
    """worker -> broker: send me a model's files; ``digest`` "": the broker's current copy."""

    model: Text
    digest: Text


#: One file of a MODEL message: name, size in bytes, SHA-256.
FileEntry = tuple[Text, Annotated[int, Meta(ge=0)], Text]


class Model(Header):
    """broker -> worker: a model's manifest, one payload frame per file; or why not."""

    model: Text
    digest: Text
    files: Annotated[list[FileEntry], Meta(max_length=MAX_LIST)]
    error: Text | None = None


class Cancel(Header):
    """client -> broker: stop a job; broker -> client: it stopped, and why; broker ->
    worker: drop the job's chunks (with ``chunk``: that attempt alone, which kept results
    answered meanwhile)."""

    job: JobId
    reason: Text | None = None
    chunk: int | None = None


def job_of(header: Header) -> str | None:
    """The job a header concerns, if it names one."""
    job = getattr(header, "job", None)
    return job if isinstance(job, str) else None
