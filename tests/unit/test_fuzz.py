"""Fuzzing: over 10 000 malformed messages at a broker and at a worker, while real work runs.

Hypothesis builds the garbage from a valid message of every command (its header
has every required field of the command's struct, ``protocol.HEADERS``, its
payload the size the header declares) and breaks it the ways a broken or hostile
peer would: truncated frames, random bytes, a wrong msgpack type in a field,
values out of range, payloads that lie about their size, huge declared shapes
and counts, unknown commands, other protocol versions, too many frames, headers
over the size limit, deep or long msgpack containers, commands sent in the wrong
direction, and well-formed replies nobody asked for.  A fixed corpus of messages
that broke a peer once runs first on every run.

Each hypothesis example is a batch of about a hundred messages, sent without
waiting for replies; one round trip at the end of the batch proves the peer read
the whole batch and still answers.  Real LeNet work runs alongside and must
come back exact, and the peers' resident memory may not grow past a bound
between a warm-up batch and the end.  What a peer's own code calls a bug fails
the test too: an exception it logged, a message it sent that the protocol
rejects.  ``pytest -s`` prints the figures.
"""

from __future__ import annotations

import copy
import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import msgpack
import msgspec
import numpy as np
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from farm.broker import wire
from farm.broker.broker import ACCEPTED as BROKER_ACCEPTS
from farm.modelrepo.repository import available
from farm.wire import messages, protocol
from farm.wire.protocol import (
    MAX_HEADER_BYTES,
    MAX_ITEMS,
    MAX_PAYLOAD_FRAMES,
    SIGNATURE,
    Command,
)
from farm.workers.worker import ACCEPTED as WORKER_ACCEPTS
from tests.frames import GARBAGE, digest_of

#: Malformed messages (rejected by ``protocol.decode`` as the peer calls it) each peer must get.
TARGET = 10_000
#: Messages sent before the first memory reading: the peer's buffers and caches have grown.
WARMUP = 1_000
#: How much a peer's resident memory may grow between the warm-up and the end.
RSS_GROWTH_LIMIT = 50 << 20
#: Messages per hypothesis example; examples per run: about 125 reach ``TARGET``, where the
#: run stops (another run follows in the unlikely case 150 were not enough).
BATCH = (80, 120)
EXAMPLES = 150
#: Seconds the fuzzing of one peer may take in all before the test fails (not a hang).
FUZZ_BUDGET = 240.0
#: Seconds to wait for any one reply.
REPLY_TIMEOUT = 30.0

#: A stand-in for the id of the real job running on the broker, put in at send time (the
#: client makes its job ids with uuid4().hex: 32 characters, the placeholder's length).
LIVE = b"L" * 32

LENET_DIGEST = digest_of("lenet")
ITEM_SHAPE, ITEM_BYTES, OUTPUT_BYTES = [1, 28, 28], 784, 40  # LeNet: 1 x 28 x 28 in, 10 out
MODEL_FILE = b"name = 'fuzz'\n"


def python_types(kind: msgspec.inspect.Type) -> tuple[type, ...]:
    """The Python types a header field of this kind takes, as msgpack decodes them."""
    if isinstance(
        kind, (msgspec.inspect.ListType, msgspec.inspect.TupleType, msgspec.inspect.VarTupleType)
    ):
        return (list,)
    if isinstance(kind, (msgspec.inspect.DictType, msgspec.inspect.StructType)):
        return (dict,)
    return {msgspec.inspect.StrType: (str,), msgspec.inspect.IntType: (int,)}[type(kind)]


#: Each command's required header fields, and the Python types each takes.
SCHEMAS: dict[Command, dict[str, tuple[type, ...]]] = {
    command: {
        field.encode_name: python_types(msgspec.inspect.type_info(field.type))
        for field in msgspec.structs.fields(kind)
        if field.required
    }
    for command, kind in protocol.HEADERS.items()
}

#: A valid value of every schema field, by name; per command overrides below.
SAMPLE: dict[str, Any] = {
    "job": "fuzz-job",
    "chunk": 7,
    "attempt": 1,
    "start": 0,
    "count": 2,
    "model": "lenet",
    "digest": LENET_DIGEST,
    "dtype": "uint8",
    "item_shape": ITEM_SHAPE,
    "timings": {"receive": 0.0, "compute": 0.001, "send": 0.0},
    "error": "boom",
    "total": 2,
    "options": {},
    "summary": {"items": 2},
    "device": "cpu:0",
    "host": "fuzz",
    "pid": 1,
    "backend": "opencv",
    "models": {"lenet": {"input_shape": ITEM_SHAPE}},
    "slots": 1,
    "files": [["model.toml", len(MODEL_FILE), hashlib.sha256(MODEL_FILE).hexdigest()]],
}
OVERRIDES: dict[Command, dict[str, Any]] = {
    Command.RESULT: {"dtype": "float32", "item_shape": [10]},
    Command.SUBMIT: {"model": "fuzz-no-such-model"},  # a real model would make a real job
    Command.MODEL: {"model": "fuzz-model"},
}


def template(command: Command) -> tuple[dict[str, Any], list[bytes]]:
    """A valid header (every field of the command's schema) and the payload it declares."""
    overrides = OVERRIDES.get(command, {})
    header = {name: copy.deepcopy(overrides.get(name, SAMPLE[name])) for name in SCHEMAS[command]}
    if command in (Command.TASK, Command.DATA):
        payload = [bytes(header["count"] * ITEM_BYTES)]
    elif command is Command.RESULT:
        payload = [bytes(header["count"] * OUTPUT_BYTES)]
    elif command is Command.MODEL:
        payload = [MODEL_FILE]
    else:
        payload = []
    return header, payload


def pack(header: Any) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def build(
    command: Command, header: Any, payload: Sequence[bytes] = (), signature: bytes = SIGNATURE
) -> list[bytes]:
    return [signature, command.value, pack(header), *payload]


def nest(depth: int) -> Any:
    """A list nested ``depth`` deep."""
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def split(data: bytes, parts: int) -> list[bytes]:
    """``data`` cut into ``parts`` frames (some may be empty)."""
    if parts <= 1:
        return [data] if parts else []
    edges = np.linspace(0, len(data), parts + 1).astype(int)
    return [data[a:b] for a, b in zip(edges[:-1], edges[1:])]


class Garbage:
    """One fuzz message; its repr is short, for hypothesis' report of a failing batch (a plain
    class: hypothesis would print a dataclass field by field, 64 KiB headers and all)."""

    __slots__ = ("family", "frames")

    def __init__(self, family: str, frames: Sequence[bytes]) -> None:
        self.family, self.frames = family, tuple(frames)

    def __repr__(self) -> str:
        shown = ", ".join(
            repr(f[:24]) + (f"..+{len(f) - 24}" if len(f) > 24 else "") for f in self.frames[:4]
        )
        more = f", ..{len(self.frames) - 4} more" if len(self.frames) > 4 else ""
        return f"Garbage({self.family}: {shown}{more})"


# ------------------------------------------------------------------ strategies

COMMANDS = sorted(Command, key=lambda c: c.value)
ARRAY_COMMANDS = (Command.TASK, Command.RESULT, Command.DATA)

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=6),
    st.binary(max_size=6),
)
#: Any msgpack value, deep nesting included (1000 levels: deeper than Python's repr goes, yet
#: within msgpack's 1024 with the header map around it, both to pack and to unpack).
VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=4),
    st.dictionaries(st.text(max_size=4), SCALARS, max_size=3),
    st.sampled_from([3, 1000]).map(nest),
)
HEX64 = st.binary(min_size=32, max_size=32).map(bytes.hex)
#: Lengths at, just under and over msgpack's 4096 limit on a header's strings.
LONG = st.sampled_from([4095, 4096, 4097]) | st.integers(4000, 6000)
STRING_FIELDS = sorted(
    {name for schema in SCHEMAS.values() for name, types in schema.items() if types == (str,)}
)

HUGE_COUNTS = [0, -1, -(2**63), MAX_ITEMS, MAX_ITEMS + 1, 2**32, 2**63 - 1, 2**64 - 1]
HUGE_SHAPES = st.one_of(
    st.sampled_from(
        [
            [2**20] * 4,
            [2**31] * 8,
            [MAX_ITEMS + 1],
            [1] * 9,
            [],
            [0],
            [-1],
            [2**64 - 1],
            [2**16, 2**16],
            [2**14, 2**14],
            [2**14, 2**14, 2],
            [True, 28, 28],
            [1.5],
            ["28"],
            [None],
            [1, 28, 28, 0],
            [[1]],
            [28] * 8,
            [nest(1000)],
        ]
    ),
    st.lists(st.integers(-(2**63), 2**64 - 1), max_size=10),
)

#: Values of the right msgpack type that no peer may accept (or that make a peer refuse).
BAD_VALUES: dict[str, st.SearchStrategy] = {
    "dtype": st.sampled_from(
        [
            "float64",
            "int32",
            "object",
            "O",
            "<U8",
            "V8",
            "bool",
            "S1",
            "complex128",
            "",
            "uint8 ",
            "UINT8",
            "float32\x00",
            "M8",
        ]
    ),
    "item_shape": HUGE_SHAPES,
    "count": st.sampled_from(HUGE_COUNTS),
    "total": st.sampled_from(HUGE_COUNTS),
    "start": st.integers(-(2**63), -1),
    "chunk": st.integers(-(2**63), 2**64 - 1),
    "attempt": st.integers(-(2**63), 2**64 - 1),
    "slots": st.sampled_from([0, -1, 65, 2**63, 2**64 - 1]),
    "models": st.sampled_from(
        [
            {"lenet": 5},
            {"x": {}},
            {"x": {"input_shape": "28"}},
            {"x": {"input_shape": [2**31] * 8}},
            {"x": {"input_shape": []}},
            {"x": {"input_shape": [[1]]}},
            {"x": {"input_shape": [nest(990)]}},
            {"m" * 4096: {}},
        ]
    ),
    "digest": st.sampled_from(
        ["", "x", "../../etc/passwd", "0" * 63, "g" * 64, "F" * 64, "0" * 64 + "\x00"]
    )
    | HEX64,
    "model": st.sampled_from(
        [
            "",
            ".",
            "..",
            "../x",
            "/etc/passwd",
            "a/b",
            "x\x00y",
            "x" * 300,
            "lenet/../lenet",
            "-x",
            ".hidden",
            "m" * 4096,
        ]
    ),
    "timings": st.sampled_from(
        [
            {},
            {"compute": "x"},
            {"compute": -1.0},
            {"compute": None},
            {"compute": float("nan")},
            {"compute": float("inf")},
        ]
    ),
    "error": st.text(max_size=20) | st.sampled_from(["e" * 4096]),
    "job": VALUES | st.just("j" * 4096),
    # optional fields
    "loaded": st.sampled_from([[["lenet"]], [{"a": 1}], "lenet", ["nope"], [1], None]),
    "threads": VALUES,
    "heartbeat": st.sampled_from([0, -1, 1e-9, 1e300, float("nan"), float("inf"), "1", None]),
    "interval": st.sampled_from([0, -1, 1e-300, 61, 1e300, float("nan"), "1", None, [1]]),
    "wait_workers": st.sampled_from([-1, 3, 10**6, 2**63, True, 1.5, "2", None, [1]]),
    "fatal": VALUES,
}
#: Optional fields of a command's header (and fields it does not have: INFO and DISCONNECT's
#: "job").
EXTRA_FIELDS: dict[Command, list[str]] = {
    Command.READY: ["loaded", "threads", "heartbeat"],
    Command.SUBMIT: ["heartbeat"],
    Command.HEARTBEAT: ["job", "interval"],
    Command.INFO: ["wait_workers", "job"],
    Command.FAILED: ["fatal"],
    Command.MODEL: ["error"],
    Command.DISCONNECT: ["job"],
}

UNKNOWN_COMMANDS = st.one_of(
    st.sampled_from(
        [b"", b"\x00", b"\x0f", b"\x10", b"\x7f", b"\xff", b"\x02\x00", b"\x0a\x0a", b"2", b"TASK"]
    ),
    st.binary(max_size=3).filter(lambda raw: raw[:2] not in {c.value for c in Command}),
)
BAD_SIGNATURES = st.one_of(
    st.sampled_from(
        [
            b"FARM01",
            b"FARM99",
            b"FARM00",
            b"FARM02",
            b"FARM03",
            b"FARM04",
            b"FARM08",  # the version before this one
            b"FARM2",
            b"FARM",
            b"FARM022",
            b"FARM05\x00",
            b"farm05",
            b"",
            b"\x00" * 6,
            b"FARM\xff\xff",
        ]
    ),
    st.binary(max_size=10).filter(lambda raw: raw != SIGNATURE),
)
#: Headers that are not a map of at most 64 fields, or not msgpack at all.
NOT_A_MAP = st.sampled_from([[], [1, 2], 5, -1, "header", b"header", None, True, 1.5])


@functools.cache
def odd_msgpack(command: Command) -> st.SearchStrategy[bytes]:
    header = template(command)[0]
    valid = pack(header)
    return st.one_of(
        st.integers(1, 3000).map(lambda d: b"\x81\xa3job" + b"\x91" * d + b"\xc0"),  # deep list
        st.integers(1, 3000).map(lambda d: b"\x81\xa1k" * d + b"\xc0"),  # deep map
        st.integers(4090, 9000).map(  # an array longer than the 4096 allowed
            lambda n: b"\x81\xa1x\xdc" + n.to_bytes(2, "big") + b"\x00" * n
        ),
        st.integers(60, 300).map(lambda n: pack({**header, **{f"k{i}": 0 for i in range(n)}})),
        st.tuples(st.sampled_from(STRING_FIELDS), LONG).map(  # a string at and over the limit
            lambda f: pack({**header, f[0]: "s" * f[1]})
        ),
        LONG.map(lambda n: pack({**header, "x": b"b" * n})),
        st.integers(0, len(valid) - 1).map(lambda n: valid[:n]),  # truncated
        st.binary(min_size=1, max_size=4).map(lambda tail: valid + tail),  # trailing bytes
        NOT_A_MAP.map(pack),
        st.sampled_from(
            [
                b"",
                b"\xc1",
                b"\x81\xa1x\xd4\x05\x00",  # reserved byte; an ext type
                b"\x81\xa1x\xd6\xff\x00\x00\x00\x01",  # a timestamp (an ext type too)
                b"\x81\x01\x02",
                b"\x81\xc0\x01",
                b"\x81\xcb" + bytes(8) + b"\x01",  # odd keys:
                b"\x81\x91\x01\x01",  # an int, nil, a float, a list
                b"\xdf\xff\xff\xff\xff",
                b"\x81\xa1x\xdd\xff\xff\xff\xff",  # maps/arrays claiming 4G
                b"\x81\xa1x\xdb\xff\xff\xff\xff",
                b"\x81\xa1x\xc6\xff\xff\xff\xff",  # str/bin ditto
                b"\x82\xa3job\xa1a\xa3job\xa1b",  # a key twice
                pack({k.encode(): v for k, v in header.items()}),  # bytes keys
            ]
        ),
    )


@st.composite
def truncated(draw, commands) -> list[bytes]:
    """A prefix of a valid message: fewer frames, the last one cut short."""
    command = draw(st.sampled_from(commands))
    frames = build(command, *template(command))
    frames = frames[: draw(st.integers(1, len(frames)))]
    frames[-1] = frames[-1][: draw(st.integers(0, max(0, len(frames[-1]) - 1)))]
    return frames


@functools.cache
def wrong_values(types: tuple[type, ...]) -> st.SearchStrategy:
    """Values that are not of ``types`` (a bool is no int to the schemas)."""
    return VALUES.filter(
        lambda v: not isinstance(v, types) or isinstance(v, bool) and bool not in types
    )


@st.composite
def wrong_types(draw, commands) -> list[bytes]:
    """Fields of the wrong msgpack type, or missing, or a header that is not a map."""
    command = draw(st.sampled_from(commands))
    header, payload = template(command)
    schema = SCHEMAS[command]
    if not schema or draw(st.integers(0, 9)) == 0:
        return build(command, draw(NOT_A_MAP), payload)
    for name in draw(
        st.lists(st.sampled_from(sorted(schema)), min_size=1, max_size=3, unique=True)
    ):
        types = schema[name]
        if draw(st.integers(0, 4)) == 0:
            del header[name]
        else:
            header[name] = draw(wrong_values(types))
    return build(command, header, payload)


@st.composite
def bad_values(draw, commands) -> list[bytes]:
    """Fields of the right type whose value is out of range, unsafe or inconsistent."""
    command = draw(st.sampled_from([c for c in commands if bad_fields(c)]))
    header, payload = template(command)
    for name in draw(
        st.lists(st.sampled_from(bad_fields(command)), min_size=1, max_size=2, unique=True)
    ):
        header[name] = draw(BAD_VALUES[name])
    return build(command, header, payload)


def bad_fields(command: Command) -> list[str]:
    return [name for name in SCHEMAS[command] if name in BAD_VALUES] + EXTRA_FIELDS.get(command, [])


@st.composite
def lying_sizes(draw, commands) -> list[bytes]:
    """Payloads that are not count x item bytes; file lists that do not match the frames."""
    command = draw(
        st.sampled_from([c for c in commands if c in ARRAY_COMMANDS or c is Command.MODEL])
    )
    header, _ = template(command)
    if command is not Command.MODEL:
        header["count"] = count = draw(st.integers(1, 4))
        header["job"] = draw(st.sampled_from(["fuzz-job", LIVE.decode()]))
        right = count * (OUTPUT_BYTES if command is Command.RESULT else ITEM_BYTES)
        size = draw(st.integers(0, right + 64).filter(lambda n: n != right))
        return build(command, header, split(bytes(size), draw(st.integers(int(size > 0), 3))))
    sizes = draw(st.lists(st.integers(0, 40), max_size=4))
    frames = [b"f" * n for n in sizes]
    files = [[f"file{i}", n, "0" * 64] for i, n in enumerate(sizes)]
    variant = draw(st.integers(0, 2))
    if variant == 0:  # as many files listed as frames sent: one more, or one fewer
        files = files[:-1] if files and draw(st.booleans()) else files + [["extra", 0, "0" * 64]]
    elif variant == 1 and files:  # one size off
        index = draw(st.integers(0, len(files) - 1))
        files[index][1] += draw(st.integers(-files[index][1], 40).filter(bool))
    else:  # an entry that is not [name, size, sha256]
        frames.append(b"x")
        files.append(
            draw(
                st.sampled_from(
                    [
                        ["a", 1],
                        ["a", "1", "x"],
                        "abc",
                        5,
                        None,
                        ["a", 1, "x", "y"],
                        {"a": 1},
                        ["a", 1.0, "x"],
                        [nest(990)],
                        nest(990),
                    ]
                )
            )
        )
    header["files"] = files
    return build(command, header, frames)


@st.composite
def huge_declarations(draw, commands) -> list[bytes]:
    """Counts, totals and shapes far too large (or nonsensical) for the small payload sent."""
    command = draw(
        st.sampled_from(
            [c for c in commands if c in ARRAY_COMMANDS or c in (Command.SUBMIT, Command.READY)]
        )
    )
    header, _ = template(command)
    if command is Command.READY:
        header["models"] = {"huge": {"input_shape": draw(HUGE_SHAPES)}}
    for name, values in (
        ("count", st.sampled_from(HUGE_COUNTS) | st.integers(1, 4)),
        ("total", st.sampled_from(HUGE_COUNTS)),
        ("item_shape", HUGE_SHAPES),
    ):
        if name in header:
            header[name] = draw(values)
    size = draw(st.integers(0, 64))
    return build(command, header, split(bytes(size), draw(st.integers(int(size > 0), 2))))


@st.composite
def unknown_commands(draw, commands) -> list[bytes]:
    header, payload = template(draw(st.sampled_from(COMMANDS)))
    return [SIGNATURE, draw(UNKNOWN_COMMANDS), pack(header), *payload]


@st.composite
def other_versions(draw, commands) -> list[bytes]:
    command = draw(st.sampled_from(commands))
    return build(command, *template(command), signature=draw(BAD_SIGNATURES))


@st.composite
def too_many_frames(draw, commands) -> list[bytes]:
    """More payload frames than allowed, or payload where a command takes none."""
    command = draw(st.sampled_from(commands))
    header, payload = template(command)
    variant = draw(st.integers(0, 2))
    if variant == 0:
        payload = payload + [b""] * draw(st.integers(MAX_PAYLOAD_FRAMES, MAX_PAYLOAD_FRAMES + 64))
    elif variant == 1 and payload:  # the right bytes, cut into too many frames
        payload = split(b"".join(payload), draw(st.integers(MAX_PAYLOAD_FRAMES + 1, 100)))
    else:
        payload = payload + [b"\x00" * draw(st.integers(0, 8))] * draw(st.integers(1, 5))
    return build(command, header, payload)


@st.composite
def big_headers(draw, commands) -> list[bytes]:
    """Headers around and over the 64 KiB limit."""
    command = draw(st.sampled_from(commands))
    header, payload = template(command)
    target = MAX_HEADER_BYTES + draw(st.integers(-64, 4096))
    kind = draw(st.sampled_from(["str", "bin", "list", "fields", "raw"]))
    if kind == "raw":
        filler = draw(st.sampled_from([b"\x00", b"\x81", b"\xff"]))
        return [SIGNATURE, command.value, filler * target, *payload]
    if kind == "fields":  # many fields, each within the msgpack limits: only the size is wrong
        count = draw(st.integers(14, 20))
        return build(command, {**header, **{f"pad{i}": "p" * 4000 for i in range(count)}}, payload)
    pad = {"str": lambda n: "p" * n, "bin": lambda n: b"p" * n, "list": lambda n: [0] * n}[kind]
    length = max(0, target - len(pack(header)) - 10)
    for _ in range(2):  # the length prefix grows with the filler: settle it
        length = max(0, length + target - len(pack({**header, "pad": pad(length)})))
    return build(command, {**header, "pad": pad(length)}, payload)


@st.composite
def odd_headers(draw, commands) -> list[bytes]:
    """Deep or long msgpack containers, ext types, odd keys, trailing or missing bytes."""
    command = draw(st.sampled_from(commands))
    return [SIGNATURE, command.value, draw(odd_msgpack(command)), *template(command)[1]]


@st.composite
def wrong_direction(draw, commands) -> list[bytes]:
    """Well-formed messages of a command this peer never receives."""
    command = draw(st.sampled_from([c for c in COMMANDS if c not in commands]))
    return build(command, *template(command))


@st.composite
def unasked_for(draw, commands) -> list[bytes]:
    """To the broker: well-formed replies for chunks nobody asked this peer for, input for
    unknown jobs and for a job that is someone else's (the real one), that job's heartbeat."""
    command = draw(
        st.sampled_from(
            [
                Command.RESULT,
                Command.FAILED,
                Command.DATA,
                Command.HEARTBEAT,
                Command.SUBMIT,
                Command.FETCH,
                Command.DISCONNECT,
                Command.INFO,
            ]
        )
    )
    header, payload = template(command)
    job = draw(st.sampled_from([LIVE.decode(), "fuzz-job"]) | st.text(max_size=12))
    if "job" in header or command is Command.HEARTBEAT:
        header["job"] = job
    if "chunk" in header:
        header["chunk"] = draw(st.integers(0, 3) | st.integers(0, 2**48))
    if command is Command.FAILED:
        header["fatal"] = draw(st.booleans())
    if command is Command.INFO:
        header["wait_workers"] = draw(st.sampled_from([0, 1, 2, 3, 10**6]))
    return build(command, header, payload)


@st.composite
def odd_tasks(draw, commands) -> list[bytes]:
    """To a worker: well-formed TASKs it must refuse or fetch for, MODELs nobody asked for,
    ERRORs and heartbeats with odd intervals."""
    variant = draw(
        st.sampled_from(
            ["digest", "model", "shape", "float32", "run", "model-file", "error", "heartbeat"]
        )
    )
    header, payload = template(Command.TASK)
    header.update(job="fuzz-job", chunk=draw(st.integers(0, 2**48)))
    if variant == "digest":  # a model the worker lacks: it FETCHes (the test answers)
        header["digest"] = draw(HEX64 | BAD_VALUES["digest"])
    elif variant == "model":
        header.update(model=draw(BAD_VALUES["model"]), digest=draw(HEX64))
    elif variant == "shape":  # a consistent payload of a shape LeNet does not take
        shape = draw(st.lists(st.integers(1, 30), min_size=1, max_size=3))
        header["item_shape"] = shape
        payload = [bytes(header["count"] * int(np.prod(shape)))]
    elif variant == "float32":
        header["dtype"] = "float32"
        payload = [np.zeros((header["count"], *ITEM_SHAPE), np.float32).tobytes()]
    elif variant == "model-file":  # files whose hashes do not match; no files at all
        header, payload = template(Command.MODEL)
        header["digest"] = draw(HEX64)
        if draw(st.booleans()):  # an empty manifest: its digest checks out, but no model comes
            header.update(files=[], digest=hashlib.sha256(b"").hexdigest())
            payload = []
        if draw(st.booleans()):
            header["error"] = "no such model"
        return build(Command.MODEL, header, payload)
    elif variant == "error":
        return build(Command.ERROR, {"error": draw(st.text(max_size=40))})
    elif variant == "heartbeat":
        return build(Command.HEARTBEAT, {"interval": draw(BAD_VALUES["interval"] | VALUES)})
    return build(Command.TASK, header, payload)


def random_frames(commands) -> st.SearchStrategy[list[bytes]]:
    return st.lists(st.binary(max_size=48), min_size=1, max_size=6)


FAMILIES = {
    "random": random_frames,
    "truncated": truncated,
    "wrong-type": wrong_types,
    "bad-value": bad_values,
    "lying-size": lying_sizes,
    "huge": huge_declarations,
    "command": unknown_commands,
    "version": other_versions,
    "frames": too_many_frames,
    "big-header": big_headers,
    "msgpack": odd_headers,
    "direction": wrong_direction,
}
MODELS = frozenset(available())


def harmless_to_broker(frames: Sequence[bytes]) -> bool:
    """False for what would make the fuzzer a real worker or submit a real job (they would
    take part in the real work, and then not do it): a valid READY, a SUBMIT of a real model."""
    try:
        message = protocol.decode(frames, allowed=BROKER_ACCEPTS)
    except Exception:  # malformed (Tally.count reports anything but a ProtocolError)
        return True
    if message.command is Command.READY:
        try:
            wire.worker_facts(message.header)  # what the broker registers a worker with
        except Exception:
            return True
        return False
    header = message.header
    return not isinstance(header, messages.Submit) or header.model not in MODELS


def harmless_to_worker(frames: Sequence[bytes]) -> bool:
    """False for a valid DISCONNECT: the worker would reconnect as a new peer, mid-batch."""
    try:
        return protocol.decode(frames, allowed=WORKER_ACCEPTS).command is not Command.DISCONNECT
    except Exception:
        return True


@st.composite
def tagged(draw, family: str, frames: st.SearchStrategy[list[bytes]]) -> Garbage:
    return Garbage(family, draw(frames))


def garbage(side: str) -> st.SearchStrategy[Garbage]:
    """Messages for the broker or a worker: every family, aimed at what that peer accepts."""
    accepts, extra, harmless = {
        "broker": (BROKER_ACCEPTS, {"unasked": unasked_for}, harmless_to_broker),
        "worker": (WORKER_ACCEPTS, {"odd-task": odd_tasks}, harmless_to_worker),
    }[side]
    commands = [c for c in COMMANDS if c in accepts]
    return st.one_of(
        *[tagged(name, strategy(commands)) for name, strategy in {**FAMILIES, **extra}.items()]
    ).filter(lambda g: harmless(g.frames))


def corpus(side: str) -> list[Garbage]:
    """Messages that broke a peer once (found by this fuzzing), sent first on every run as
    hypothesis' explicit example, with test_bad_input's garbage."""
    task, _ = template(Command.TASK)
    ready, _ = template(Command.READY)
    common = [
        build(Command.TASK, {**task, "item_shape": [nest(1000)]}, [b"x"]),  # repr recursion
        build(Command.RESULT, {**template(Command.RESULT)[0], "item_shape": [nest(1000)]}),
        build(Command.MODEL, {**template(Command.MODEL)[0], "files": [nest(1000)]}, [b"x"]),
        build(Command.TASK, {**task, "dtype": "d" * 4096}, [b"x"]),  # an echo over 4096
        build(Command.SUBMIT, {**template(Command.SUBMIT)[0], "dtype": "d" * 4096}),
        build(Command.SUBMIT, {**template(Command.SUBMIT)[0], "model": "m" * 4096}),
        build(Command.HEARTBEAT, {"job": "j" * 4096}),
        build(Command.HEARTBEAT, {"job": nest(1000)}),  # str() of it recurses too deep
        build(Command.INFO, {"job": nest(1000), "wait_workers": "x"}),  # echoed back as is
        build(Command.READY, {**ready, "loaded": [["lenet"]]}),  # unhashable
        build(Command.READY, {**ready, "loaded": [{"a": 1}]}),
        build(Command.READY, {**ready, "models": {"m" * 4096: {}}}),
        build(Command.HEARTBEAT, {"interval": float("nan")}),
        *GARBAGE,
    ]
    harmless = harmless_to_broker if side == "broker" else harmless_to_worker
    return [Garbage("corpus", frames) for frames in common if harmless(frames)]


FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    print_blob=False,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.large_base_example,
    ],
)


# ----------------------------------------------------------------- bookkeeping


def test_every_template_is_a_valid_message() -> None:
    """The fuzzing starts from valid messages: each command's template decodes."""
    for command in Command:
        message = protocol.decode(build(command, *template(command)))
        assert message.command is command and type(message.header) is protocol.HEADERS[command]


# --------------------------------------------------------------------- worker
