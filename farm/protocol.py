"""The farm wire protocol: the only module that builds or parses frames.

A message is a list of frames (after any ROUTER identity frame)::

    [SIGNATURE, command (1 byte), header (msgpack map), *payload]

``SIGNATURE`` carries the protocol version (``b"FARM03"``).  The header is a
small msgpack map whose fields are checked against a per-command schema.  The
payload frames are raw numpy buffers; their dtype and shape live in the header,
never in the payload; no object serialiser is ever involved.  Payloads are sent with
``copy=False``: pyzmq copies frames below ``socket.copy_threshold`` (64 kB by
default) anyway, because zero-copy only pays off above that size.
"""

from __future__ import annotations

import enum
import math
import reprlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack
import numpy as np
import zmq

SIGNATURE = b"FARM03"
PROTOCOL_FAMILY = b"FARM"

#: Dtypes that may cross the wire, by their numpy name.
ALLOWED_DTYPES = frozenset({"uint8", "float32"})

MAX_HEADER_BYTES = 64 * 1024
MAX_PAYLOAD_FRAMES = 64
MAX_DIMS = 8
MAX_ITEMS = 1 << 31
#: Largest frame a socket accepts (ZMQ_MAXMSGSIZE, which libzmq applies per frame): a peer
#: that sends a bigger one is disconnected before the frame is allocated.
MAX_MESSAGE_BYTES = 256 << 20
#: Largest chunk of input the broker cuts: policies' chunks are capped to this many bytes.
MAX_TASK_BYTES = 64 << 20
#: Messages a socket queues per peer in each direction (ZMQ_RCVHWM, ZMQ_SNDHWM).
QUEUE_LIMIT = 1000

#: msgpack limits for headers: no string, list or map in a header may be longer.
_UNPACK_LIMITS = {"max_str_len": 4096, "max_bin_len": 4096, "max_array_len": 4096,
                  "max_map_len": 64, "max_ext_len": 0}
#: Largest document frame: a broker's INFO snapshot or a job's summary, which grow with the
#: number of workers and jobs and so travel as a msgpack payload frame, not in the header.
MAX_DOCUMENT_BYTES = 16 << 20
_DOCUMENT_LIMITS = {"max_str_len": 1 << 16, "max_bin_len": 0, "max_array_len": 1 << 20,
                    "max_map_len": 1 << 20, "max_ext_len": 0}


class Command(bytes, enum.Enum):
    """One-byte commands; the direction is in the comment."""

    READY = b"\x01"  # worker -> broker: registration with the worker's facts
    TASK = b"\x02"  # broker -> worker: a chunk to run
    RESULT = b"\x03"  # worker -> broker -> client: a chunk's outputs
    FAILED = b"\x04"  # worker -> broker: a chunk could not run
    SUBMIT = b"\x05"  # client -> broker: a new job (no payload)
    DATA = b"\x06"  # client -> broker: a block of a job's items
    DONE = b"\x07"  # broker -> client: every item of a job came back
    ERROR = b"\x08"  # broker -> client or worker: a request was refused
    INFO = b"\x09"  # client -> broker and back: registry snapshot
    HEARTBEAT = b"\x0a"  # any direction: liveness
    DISCONNECT = b"\x0b"  # worker -> broker: leaving cleanly
    FETCH = b"\x0c"  # worker -> broker: send me a model's files
    MODEL = b"\x0d"  # broker -> worker: a model's manifest, one payload frame per file
    NEED = b"\x0e"  # broker -> client: send the input of one chunk (answered by DATA)
    CANCEL = b"\x0f"  # client -> broker: stop a job; broker -> client: it stopped (and why);
    #                   broker -> worker: drop the job's chunks


class ProtocolError(ValueError):
    """A message that does not follow the protocol."""


#: Per-command header schema: field name -> accepted Python types.
_SCHEMAS: dict[Command, dict[str, tuple[type, ...]]] = {
    Command.READY: {"device": (str,), "host": (str,), "pid": (int,), "backend": (str,),
                    "models": (dict,), "slots": (int,)},
    Command.TASK: {"job": (str,), "chunk": (int,), "attempt": (int,), "start": (int,),
                   "count": (int,), "model": (str,), "digest": (str,), "dtype": (str,),
                   "item_shape": (list,)},
    Command.RESULT: {"job": (str,), "chunk": (int,), "start": (int,), "count": (int,),
                     "dtype": (str,), "item_shape": (list,), "timings": (dict,)},
    Command.FAILED: {"job": (str,), "chunk": (int,), "start": (int,), "count": (int,),
                     "error": (str,)},
    Command.SUBMIT: {"job": (str,), "model": (str,), "dtype": (str,), "item_shape": (list,),
                     "total": (int,), "options": (dict,)},
    Command.DATA: {"job": (str,), "chunk": (int,), "start": (int,), "count": (int,)},
    Command.DONE: {"job": (str,)},
    Command.ERROR: {"error": (str,)},
    Command.INFO: {},
    Command.HEARTBEAT: {},
    Command.DISCONNECT: {},
    Command.FETCH: {"model": (str,), "digest": (str,)},
    Command.MODEL: {"model": (str,), "digest": (str,), "files": (list,)},
    Command.NEED: {"job": (str,), "chunk": (int,), "start": (int,), "count": (int,)},
    Command.CANCEL: {"job": (str,)},
}

#: Commands whose payload is an array described by dtype/item_shape/count.
_ARRAY_COMMANDS = frozenset({Command.TASK, Command.RESULT, Command.DATA})

#: Commands whose payload is one frame per file listed in the header (sizes checked).
_FILE_COMMANDS = frozenset({Command.MODEL})

#: Commands that may carry one document frame (``document_frames``, ``Message.document``):
#: INFO's snapshot, DONE's and CANCEL's job summary.
_DOCUMENT_COMMANDS = frozenset({Command.INFO, Command.DONE, Command.CANCEL})


@dataclass
class Message:
    """A decoded message: command, validated header and raw payload frames."""

    command: Command
    header: dict[str, Any]
    payload: list[Any] = field(default_factory=list)

    def document(self) -> dict[str, Any]:
        """The document frame as a dict ({} if there is none); ProtocolError if malformed."""
        if not self.payload:
            return {}
        try:
            document = msgpack.unpackb(_buffer(self.payload[0]), raw=False,
                                       strict_map_key=True, **_DOCUMENT_LIMITS)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"{self.command.name} document is not valid msgpack: "
                                f"{exc}") from exc
        if not isinstance(document, dict):
            raise ProtocolError(f"{self.command.name} document must be a map")
        return document

    def array(self, dtype: str, item_shape: Sequence[int]) -> np.ndarray:
        """The payload as one array of ``(count, *item_shape)``, zero-copy when it is one frame."""
        buffers = [_buffer(frame) for frame in self.payload]
        data = buffers[0] if len(buffers) == 1 else b"".join(buffers)
        return np.frombuffer(data, dtype=dtype).reshape(-1, *item_shape)


def _buffer(frame: Any) -> memoryview:
    """A memoryview of a zmq.Frame, bytes or memoryview."""
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def _frame_size(frame: Any) -> int:
    return _buffer(frame).nbytes


def limit_socket(socket: Any, linger_ms: int = 0) -> None:
    """Bound what a peer can make this socket hold: frame size and queued messages."""
    socket.setsockopt(zmq.LINGER, linger_ms)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    socket.setsockopt(zmq.RCVHWM, QUEUE_LIMIT)
    socket.setsockopt(zmq.SNDHWM, QUEUE_LIMIT)


def encode(command: Command, header: dict[str, Any] | None = None,
           payload: Sequence[Any] = ()) -> list[Any]:
    """Frames for one message; payload frames are passed through untouched."""
    packed = msgpack.packb(header or {}, use_bin_type=True)
    return [SIGNATURE, command.value, packed, *payload]


def document_frames(document: dict[str, Any]) -> list[bytes]:
    """Payload for a document (a snapshot, a summary): one msgpack frame."""
    return [msgpack.packb(document, use_bin_type=True)]


def array_frames(array: np.ndarray) -> list[Any]:
    """Payload frames for an array: its one contiguous raw buffer."""
    return [np.ascontiguousarray(array).data]


def decode(frames: Sequence[Any], allowed: frozenset[Command] | None = None) -> Message:
    """Parse and validate frames (identity already removed); raise ProtocolError."""
    if len(frames) < 3:
        raise ProtocolError(f"expected at least 3 frames, got {len(frames)}")
    signature, command_frame, header_frame, *payload = frames
    head = bytes(_buffer(signature)[:len(SIGNATURE) + 1])  # a slice: a huge frame is not copied
    if head != SIGNATURE:
        if head.startswith(PROTOCOL_FAMILY) and len(head) == len(SIGNATURE):
            raise ProtocolError(f"protocol version {head.decode('ascii', 'replace')} is not "
                                f"supported; this farm speaks {SIGNATURE.decode()}")
        raise ProtocolError(f"unknown protocol signature {head!r}")
    command = _decode_command(bytes(_buffer(command_frame)[:2]))
    if allowed is not None and command not in allowed:
        raise ProtocolError(f"command {command.name} not accepted here")
    header = _decode_header(_buffer(header_frame), command)
    if len(payload) > MAX_PAYLOAD_FRAMES:
        raise ProtocolError(f"too many payload frames: {len(payload)}")
    message = Message(command, header, list(payload))
    if command in _ARRAY_COMMANDS:
        _check_array(message)
    elif command in _FILE_COMMANDS:
        _check_files(message)
    elif command in _DOCUMENT_COMMANDS:
        if len(payload) > 1 or payload and _frame_size(payload[0]) > MAX_DOCUMENT_BYTES:
            raise ProtocolError(f"{command.name} carries at most one document frame of "
                                f"{MAX_DOCUMENT_BYTES} bytes")
    elif payload:
        raise ProtocolError(f"{command.name} carries no payload, got {len(payload)} frames")
    return message


def _decode_command(raw: bytes) -> Command:
    try:
        return Command(raw)
    except ValueError:
        raise ProtocolError(f"unknown command {raw[:8]!r}") from None


def _decode_header(raw: memoryview, command: Command) -> dict[str, Any]:
    if raw.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {raw.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, **_UNPACK_LIMITS)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not valid msgpack: {exc}") from exc
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    for name, types in _SCHEMAS[command].items():
        value = header.get(name)
        if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
            raise ProtocolError(f"{command.name} header field {name!r} missing or not "
                                f"{'/'.join(t.__name__ for t in types)}")
    return header


def _check_array(message: Message) -> None:
    """Check dtype against the allow-list and the declared shape against the byte count."""
    header = message.header
    count = header["count"]
    if not 0 < count <= MAX_ITEMS:
        raise ProtocolError(f"item count {count} out of range")
    if header.get("start", 0) < 0:
        raise ProtocolError("negative start")
    if message.command is not Command.RESULT and sum(
            _frame_size(frame) for frame in message.payload) > MAX_TASK_BYTES:
        raise ProtocolError(f"{message.command.name} carries more than {MAX_TASK_BYTES} bytes")
    if message.command is Command.DATA:
        return  # dtype and item shape were declared by the job's SUBMIT; checked by the broker
    item_bytes = check_array_spec(header["dtype"], header["item_shape"])
    expected = count * item_bytes
    actual = sum(_frame_size(frame) for frame in message.payload)
    if actual != expected:
        raise ProtocolError(f"payload is {actual} bytes, header declares {count} x "
                            f"{header['item_shape']} {header['dtype']} = {expected}")


def _check_files(message: Message) -> None:
    """One payload frame per listed file, each of the size the header gives."""
    files = message.header["files"]
    if len(files) != len(message.payload):
        raise ProtocolError(f"{len(files)} files listed, {len(message.payload)} frames sent")
    for entry, frame in zip(files, message.payload):
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[1], int)
                and entry[1] == _frame_size(frame)):
            raise ProtocolError(f"file entry {reprlib.repr(entry)} does not describe its frame "
                                f"({_frame_size(frame)} bytes)")


def check_array_spec(dtype: str, item_shape: Sequence[Any]) -> int:
    """Validate a dtype name and item shape; return the bytes per item."""
    if dtype not in ALLOWED_DTYPES:
        raise ProtocolError(f"dtype {reprlib.repr(dtype)} not allowed; use one of "
                            f"{sorted(ALLOWED_DTYPES)}")
    if not 0 < len(item_shape) <= MAX_DIMS or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 < d <= MAX_ITEMS for d in item_shape):
        raise ProtocolError(f"invalid item shape {reprlib.repr(item_shape)}")
    item_bytes = np.dtype(dtype).itemsize * math.prod(item_shape)
    if item_bytes > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"item of shape {item_shape} is larger than {MAX_MESSAGE_BYTES} bytes")
    return item_bytes
