"""The farm wire protocol: the only module that builds or parses frames.

A message is a list of frames (after any ROUTER identity frame)::

    [SIGNATURE, command (1 byte), header (msgpack map), *payload]

``SIGNATURE`` carries the protocol version (``b"FARM10"``).  The header is a
small msgpack map, decoded straight into the command's struct (``HEADERS``,
defined in ``farm.wire.messages``), which checks every field's type and range.  The
payload frames are raw numpy buffers; their dtype and shape live in the header,
never in the payload; no object serialiser is ever involved.  Payloads are sent with
``copy=False``: pyzmq copies frames below ``socket.copy_threshold`` (64 kB by
default) anyway, because zero-copy only pays off above that size.
"""

from __future__ import annotations

import enum
import functools
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

import msgspec
import numpy as np
from msgspec import Meta

from farm.wire import messages, shapes
from farm.wire.messages import MAX_DIMS, MAX_ITEMS, Header
from farm.wire.shapes import ALLOWED_DTYPES, ENCODED, MAX_FILE_BYTES, MAX_TASK_BYTES, SIZE_BYTES

SIGNATURE = b"FARM10"
PROTOCOL_FAMILY = b"FARM"

#: The dtype of a file sizes frame (``file_frames``).
SIZES_DTYPE = np.dtype("<u4")
assert SIZES_DTYPE.itemsize == SIZE_BYTES

MAX_HEADER_BYTES = 64 * 1024
MAX_PAYLOAD_FRAMES = 64
#: Largest frame a socket accepts (ZMQ_MAXMSGSIZE, which libzmq applies per frame): a peer
#: that sends a bigger one is disconnected before the frame is allocated.
MAX_MESSAGE_BYTES = 256 << 20
#: Messages a socket queues per peer in each direction (ZMQ_RCVHWM, ZMQ_SNDHWM).
QUEUE_LIMIT = 1000
#: The largest frame the broker's socket reads (``ZMQ_MAXMSGSIZE``): a chunk's input or
#: outputs (chunks are capped to fit both) or a SUBMIT's document.  libzmq drops a peer
#: that announces a larger frame before allocating it, so a flood of large frames costs
#: the broker nothing; within the limit, a peer's message costs at most its frames.
MAX_BROKER_FRAME_BYTES = MAX_TASK_BYTES
#: Messages the broker's socket queues from one peer before libzmq stops reading that
#: peer's connection (backpressure): a worker sends a RESULT per slot and a client a DATA
#: per NEED, so more is only a flood, held in memory.
BROKER_RECEIVE_QUEUE = 16
#: Largest document frame: a broker's INFO snapshot or a job's summary, which grow with the
#: number of workers and jobs and so travel as a msgpack payload frame, not in the header.
MAX_DOCUMENT_BYTES = 16 << 20

_encoder = msgspec.msgpack.Encoder()
D = TypeVar("D")


class Command(bytes, enum.Enum):
    """One-byte commands; the direction is in the comment."""

    READY = b"\x01"  # worker -> broker: registration with the worker's facts
    TASK = b"\x02"  # broker -> worker: a chunk to run
    RESULT = b"\x03"  # worker -> broker -> client: a chunk's outputs
    FAILED = b"\x04"  # worker -> broker -> client: a chunk (or some of its images) could not run
    SUBMIT = b"\x05"  # client -> broker: a new job (no payload)
    DATA = b"\x06"  # client -> broker: a block of a job's items
    DONE = b"\x07"  # broker -> client: every item of a job came back
    ERROR = b"\x08"  # broker -> client or worker: a request was refused
    INFO = b"\x09"  # client -> broker and back: registry snapshot
    HEARTBEAT = b"\x0a"  # any direction: liveness
    DISCONNECT = b"\x0b"  # worker or client -> broker: leaving cleanly; broker -> worker: go away
    FETCH = b"\x0c"  # worker -> broker: send me a model's files
    MODEL = b"\x0d"  # broker -> worker: a model's manifest, one payload frame per file
    NEED = b"\x0e"  # broker -> client: send the input of one chunk (answered by DATA)
    CANCEL = b"\x0f"  # client -> broker: stop a job; broker -> client: it stopped (and why);
    #                   broker -> worker: drop the job's chunks


class ProtocolError(ValueError):
    """A message that does not follow the protocol; ``header``: its header, when that
    decoded and the payload did not fit it (a broker fails that attempt of a RESULT)."""

    header: Header | None = None


#: Each command's header struct.
HEADERS: dict[Command, type[Header]] = {
    Command.READY: messages.Ready,
    Command.TASK: messages.Task,
    Command.RESULT: messages.Result,
    Command.FAILED: messages.Failed,
    Command.SUBMIT: messages.Submit,
    Command.DATA: messages.Data,
    Command.DONE: messages.Done,
    Command.ERROR: messages.Error,
    Command.INFO: messages.Info,
    Command.HEARTBEAT: messages.Heartbeat,
    Command.DISCONNECT: messages.Disconnect,
    Command.FETCH: messages.Fetch,
    Command.MODEL: messages.Model,
    Command.NEED: messages.Need,
    Command.CANCEL: messages.Cancel,
}
_COMMANDS = {kind: command for command, kind in HEADERS.items()}
_DECODERS = {command: msgspec.msgpack.Decoder(kind) for command, kind in HEADERS.items()}

#: Commands whose payload is an array described by dtype/item_shape/count.
_ARRAY_COMMANDS = frozenset({Command.TASK, Command.RESULT, Command.DATA})

#: Commands whose payload is one frame per file listed in the header (sizes checked).
_FILE_COMMANDS = frozenset({Command.MODEL})

#: Commands that may carry one document frame (``document_frames``, ``Message.document``):
#: INFO's snapshot, DONE's and CANCEL's job summary, SUBMIT's shared inputs; and how large.
_DOCUMENT_COMMANDS = {
    Command.INFO: MAX_DOCUMENT_BYTES,
    Command.DONE: MAX_DOCUMENT_BYTES,
    Command.CANCEL: MAX_DOCUMENT_BYTES,
    Command.SUBMIT: MAX_TASK_BYTES,  # a path per image: 20 MB for a million images
}


@dataclass
class Message:
    """A decoded message: command, its typed header (``HEADERS[command]``) and raw payload
    frames."""

    command: Command
    header: Header
    payload: list[Any] = field(default_factory=list)

    def document(self, kind: type[D]) -> D | None:
        """The document frame decoded as ``kind`` (None if there is none); ProtocolError if
        malformed."""
        if not self.payload:
            return None
        try:
            document: D = msgspec.msgpack.decode(memoryview(self.payload[0]), type=kind)
            return document
        except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError included
            raise ProtocolError(f"{self.command.name} document: {exc}") from None

    def array(self, dtype: str, item_shape: Sequence[int]) -> np.ndarray:
        """The payload as one array of ``(count, *item_shape)``, zero-copy when it is one frame
        (a RESULT's failures document, ``failures``, left out)."""
        frames = self.payload
        if isinstance(self.header, messages.Result) and self.header.failed:
            frames = frames[:-1]
        buffers = [memoryview(frame) for frame in frames]
        data = buffers[0] if len(buffers) == 1 else b"".join(buffers)
        return np.frombuffer(data, dtype=dtype).reshape(-1, *item_shape)

    def failures(self) -> list[tuple[int, int, str]]:
        """A RESULT's items that failed on their own: ``(offset in the chunk, count, reason)``,
        in order; [] when none did.  ProtocolError if the document is malformed."""
        header = self.header
        if not isinstance(header, messages.Result) or not header.failed:
            return []
        try:
            failures = msgspec.msgpack.decode(memoryview(self.payload[-1]), type=FailureList)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise ProtocolError(f"RESULT failures: {exc}") from None
        end, failed = 0, 0
        for offset, count, _ in failures:
            if offset < end or offset + count > header.count:
                raise ProtocolError(
                    f"RESULT failures: items {offset}+{count} overlap or lie "
                    f"outside the chunk of {header.count}"
                )
            end, failed = offset + count, failed + count
        if failed != header.failed:
            raise ProtocolError(
                f"RESULT failures list {failed} items, the header says {header.failed}"
            )
        return [tuple(failure) for failure in failures]  # type: ignore[misc]

    def files(self) -> list[memoryview]:
        """A chunk of image files (dtype ``ENCODED``) as one view per file."""
        sizes, blob = (memoryview(frame) for frame in self.payload)
        offsets = np.cumsum(np.frombuffer(sizes, SIZES_DTYPE), dtype=np.int64)
        starts = np.concatenate(([0], offsets[:-1]))
        return [blob[start:stop] for start, stop in zip(starts.tolist(), offsets.tolist())]


#: A RESULT's failures document: ``[offset, count, reason]`` per run of failed items.
FailureList = Annotated[
    list[tuple[Annotated[int, Meta(ge=0)], Annotated[int, Meta(gt=0)], messages.Text]],
    Meta(max_length=messages.MAX_ITEMS),
]


def _frame_size(frame: Any) -> int:
    return memoryview(frame).nbytes


def payload_bytes(frames: Sequence[Any]) -> int:
    """The bytes of a message's payload frames, together."""
    return sum(_frame_size(frame) for frame in frames)


def command_of(header: Header) -> Command:
    """The command a header struct belongs to."""
    return _COMMANDS[type(header)]


def command_of_class(kind: type) -> Command:
    """The command a header struct class belongs to."""
    return _COMMANDS[kind]


def encode(
    command: Command, header: Header | None = None, payload: Sequence[Any] = ()
) -> list[Any]:
    """Frames for one message; payload frames are passed through untouched.  ``header``: the
    command's struct (None: its defaults, for a command whose fields all have one)."""
    if header is None:
        header = HEADERS[command]()
    if type(header) is not HEADERS[command]:
        raise TypeError(f"a {type(header).__name__} header cannot go with {command.name}")
    return [SIGNATURE, command.value, _encoder.encode(header), *payload]


def document_frames(document: Any) -> list[bytes]:
    """Payload for a document (a snapshot, a summary): one msgpack frame."""
    return [_encoder.encode(document)]


def array_frames(array: np.ndarray) -> list[Any]:
    """Payload frames for an array: its one contiguous raw buffer."""
    return [np.ascontiguousarray(array).data]


def file_frames(files: Sequence[bytes | memoryview]) -> list[Any]:
    """Payload frames for a chunk of image files: their sizes, then their bytes."""
    sizes = np.fromiter((memoryview(f).nbytes for f in files), SIZES_DTYPE, len(files))
    return [sizes.data, b"".join(files)]


def failures_frame(failures: Sequence[tuple[int, int, str]]) -> bytes:
    """A RESULT's failures document (see ``Message.failures``)."""
    return _encoder.encode(list(failures))


def check_files(frames: Sequence[Any], count: int, max_bytes: int) -> None:
    """A chunk of ``count`` image files of at most ``max_bytes`` each, as ``file_frames``
    makes it; ProtocolError if not."""
    if len(frames) != 2:
        raise ProtocolError(f"a chunk of image files is 2 frames (sizes, bytes), got {len(frames)}")
    sizes, blob = (memoryview(frame) for frame in frames)
    if sizes.nbytes != count * SIZES_DTYPE.itemsize:
        raise ProtocolError(
            f"the sizes frame has {sizes.nbytes} bytes, not {count} x {SIZES_DTYPE.itemsize}"
        )
    values = np.frombuffer(sizes, SIZES_DTYPE)
    if count and int(values.max()) > max_bytes:
        raise ProtocolError(
            f"a file of {int(values.max())} bytes exceeds the job's largest, {max_bytes}"
        )
    if int(values.sum(dtype=np.int64)) != blob.nbytes:
        raise ProtocolError(
            f"the files' sizes add up to {int(values.sum(dtype=np.int64))} "
            f"bytes, the frame has {blob.nbytes}"
        )


def decode(frames: Sequence[Any], allowed: frozenset[Command] | None = None) -> Message:
    """Parse and validate frames (identity already removed); raise ProtocolError."""
    if len(frames) < 3:
        raise ProtocolError(f"expected at least 3 frames, got {len(frames)}")
    signature, command_frame, header_frame, *payload = frames
    head = bytes(memoryview(signature)[: len(SIGNATURE) + 1])  # a slice: a huge frame is not copied
    if head != SIGNATURE:
        if head.startswith(PROTOCOL_FAMILY) and len(head) == len(SIGNATURE):
            raise ProtocolError(
                f"protocol version {head.decode('ascii', 'replace')} is not "
                f"supported; this farm speaks {SIGNATURE.decode()}"
            )
        raise ProtocolError(f"unknown protocol signature {head!r}")
    command = _decode_command(bytes(memoryview(command_frame)[:2]))
    if allowed is not None and command not in allowed:
        raise ProtocolError(f"command {command.name} not accepted here")
    header = _decode_header(memoryview(header_frame), command)
    if len(payload) > MAX_PAYLOAD_FRAMES:
        raise ProtocolError(f"too many payload frames: {len(payload)}")
    message = Message(command, header, list(payload))
    try:
        _check_payload(message)
    except ProtocolError as exc:
        exc.header = header
        raise
    return message


def _check_payload(message: Message) -> None:
    command, payload = message.command, message.payload
    if command in _ARRAY_COMMANDS:
        _check_array(message)
    elif command in _FILE_COMMANDS:
        _check_files(message)
    elif command in _DOCUMENT_COMMANDS:
        limit = _DOCUMENT_COMMANDS[command]
        if len(payload) > 1 or payload and _frame_size(payload[0]) > limit:
            raise ProtocolError(
                f"{command.name} carries at most one document frame of {limit} bytes"
            )
    elif payload:
        raise ProtocolError(f"{command.name} carries no payload, got {len(payload)} frames")


_COMMANDS_BY_BYTE = {command.value: command for command in Command}


def _decode_command(raw: bytes) -> Command:
    command = _COMMANDS_BY_BYTE.get(raw)  # a dict: an Enum call costs a few us a message
    if command is None:
        raise ProtocolError(f"unknown command {raw[:8]!r}")
    return command


def _decode_header(raw: memoryview, command: Command) -> Header:
    if raw.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {raw.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        return _DECODERS[command].decode(raw)
    except msgspec.ValidationError as exc:  # names the field: "... - at `$.count`"
        raise ProtocolError(f"{command.name} header: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    except RecursionError:
        raise ProtocolError(f"{command.name} header is nested too deeply") from None


def _check_array(message: Message) -> None:
    """Check dtype against the allow-list and the declared shape against the byte count."""
    header = message.header
    assert isinstance(header, (messages.Task, messages.Result, messages.Data))
    if message.command is not Command.RESULT and payload_bytes(message.payload) > MAX_TASK_BYTES:
        raise ProtocolError(f"{message.command.name} carries more than {MAX_TASK_BYTES} bytes")
    if isinstance(header, messages.Data):
        return  # dtype and item shape were declared by the job's SUBMIT; checked by the broker
    item_bytes = check_array_spec(header.dtype, header.item_shape)
    if isinstance(header, messages.Task) and header.stored is not None:
        _check_located(header, message.payload)
        return
    if header.dtype == ENCODED:
        check_files(message.payload, header.count, item_bytes)
        return
    frames = message.payload
    if isinstance(header, messages.Result) and header.failed:
        if len(frames) < 2 or _frame_size(frames[-1]) > MAX_DOCUMENT_BYTES:
            raise ProtocolError(
                f"a RESULT with failed items ends with one failures frame of "
                f"at most {MAX_DOCUMENT_BYTES} bytes"
            )
        frames = frames[:-1]
    expected = header.count * item_bytes
    actual = payload_bytes(frames)
    if actual != expected:
        raise ProtocolError(
            f"payload is {actual} bytes, header declares {header.count} x "
            f"{list(header.item_shape)} {header.dtype} = {expected}"
        )


def _check_located(task: messages.Task, frames: Sequence[Any]) -> None:
    """A TASK of shared inputs: files' paths and sizes, or an array's place and row ranges."""
    if task.stored == "files":
        if len(frames) != 2 or _frame_size(frames[1]) != task.count * 8 or task.place:
            raise ProtocolError("a TASK of shared files is 2 frames: paths, then a size per file")
        return
    if task.place is None or len(frames) != 1 or _frame_size(frames[0]) % 16:
        raise ProtocolError("a TASK of shared rows names its file and carries (row, count) pairs")


def _check_files(message: Message) -> None:
    """One payload frame per listed file, each of the size the header gives."""
    header = message.header
    assert isinstance(header, messages.Model)
    if len(header.files) != len(message.payload):
        raise ProtocolError(f"{len(header.files)} files listed, {len(message.payload)} frames sent")
    for (name, size, _), frame in zip(header.files, message.payload):
        if size != _frame_size(frame):
            raise ProtocolError(
                f"file {reprlib.repr(name)} is listed as {size} bytes, its "
                f"frame has {_frame_size(frame)}"
            )


def check_array_spec(dtype: str, item_shape: Sequence[Any]) -> int:
    """Validate a dtype name and item shape; return the bytes per item (for ``ENCODED``: the
    most one file may have)."""
    if type(item_shape) is tuple and type(dtype) is str:  # every header's: a job's few
        return _checked_spec(dtype, item_shape)
    return _check_spec(dtype, item_shape)


@functools.lru_cache(maxsize=1024)
def _checked_spec(dtype: str, item_shape: tuple[Any, ...]) -> int:
    return _check_spec(dtype, item_shape)


def _check_spec(dtype: str, item_shape: Sequence[Any]) -> int:
    if dtype == ENCODED:
        if (
            len(item_shape) != 1
            or not isinstance(item_shape[0], int)
            or not 0 < item_shape[0] <= MAX_FILE_BYTES
        ):
            raise ProtocolError(
                f"image files need an item shape of [largest file's bytes], "
                f"at most {MAX_FILE_BYTES}; got {reprlib.repr(item_shape)}"
            )
        return item_shape[0]
    if dtype not in ALLOWED_DTYPES:
        raise ProtocolError(
            f"dtype {reprlib.repr(dtype)} not allowed; use one of {sorted(ALLOWED_DTYPES)}"
        )
    if not 0 < len(item_shape) <= MAX_DIMS or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 < d <= MAX_ITEMS for d in item_shape
    ):
        raise ProtocolError(f"invalid item shape {reprlib.repr(item_shape)}")
    item_bytes = shapes.item_bytes(dtype, item_shape)
    if item_bytes > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"item of shape {item_shape} is larger than {MAX_MESSAGE_BYTES} bytes")
    return item_bytes
