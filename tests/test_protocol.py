"""The wire format: round trips and the validation of every field."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from farm import protocol
from farm.protocol import Command, ProtocolError


def task_header(count: int = 2, shape=(1, 28, 28), dtype: str = "uint8") -> dict:
    return {"job": "j", "chunk": 1, "attempt": 1, "start": 0, "count": count, "model": "lenet",
            "digest": "0" * 64,
            "dtype": dtype, "item_shape": list(shape)}


def test_array_round_trip_is_zero_copy_for_one_frame() -> None:
    images = np.arange(2 * 784, dtype=np.uint8).reshape(2, 1, 28, 28)
    signature, command, header, payload = protocol.encode(Command.TASK, task_header(),
                                                          protocol.array_frames(images))
    frame = bytearray(payload)
    message = protocol.decode([signature, command, header, frame])
    decoded = message.array("uint8", (1, 28, 28))
    assert message.command is Command.TASK
    np.testing.assert_array_equal(decoded, images)
    frame[0] = 255  # the decoded array is a view of the frame: it sees the change
    assert decoded[0, 0, 0, 0] == 255


def test_array_from_several_frames_is_joined() -> None:
    images = np.arange(3 * 4, dtype=np.float32).reshape(3, 4)
    frames = protocol.encode(Command.TASK, task_header(3, (4,), "float32"),
                             [images[:1].tobytes(), images[1:].tobytes()])
    np.testing.assert_array_equal(protocol.decode(frames).array("float32", (4,)), images)


@pytest.mark.parametrize("frames, reason", [
    ([protocol.SIGNATURE, b"\x02"], "at least 3 frames"),
    ([b"FARM99", b"\x02", msgpack.packb({})], "protocol version FARM99 is not supported"),
    ([b"XX", b"\x02", msgpack.packb({})], "unknown protocol signature"),
    ([protocol.SIGNATURE, b"\x7f", msgpack.packb({})], "unknown command"),
    ([protocol.SIGNATURE, b"\x02", b"\xc1garbage"], "not valid msgpack"),
    ([protocol.SIGNATURE, b"\x02", msgpack.packb([1, 2])], "must be a map"),
    ([protocol.SIGNATURE, b"\x02", msgpack.packb({**task_header(), "count": "2"}), b"x" * 1568], "count"),
    ([protocol.SIGNATURE, b"\x02", msgpack.packb({**task_header(), "dtype": "float64"}), b"x" * 1568],
     "not allowed"),
    ([protocol.SIGNATURE, b"\x02", msgpack.packb({**task_header(), "item_shape": [1, -28, 28]}), b"x"],
     "invalid item shape"),
    ([protocol.SIGNATURE, b"\x02", msgpack.packb(task_header()), b"x" * 1567], "payload is 1567 bytes"),
    ([protocol.SIGNATURE, b"\x02", msgpack.packb({**task_header(), "count": 1 << 40}), b"x"],
     "out of range"),
    ([protocol.SIGNATURE, b"\x02", msgpack.packb({**task_header(1, [1 << 20] * 4)}), b"x"], "larger than"),
    ([protocol.SIGNATURE, b"\x05", msgpack.packb({"job": "j"})], "model"),
    ([protocol.SIGNATURE, b"\x0a", msgpack.packb({}), b"unexpected"], "carries no payload"),
    ([protocol.SIGNATURE, b"\x09", msgpack.packb({}), b"a", b"b"], "at most one document"),
    ([protocol.SIGNATURE, b"\x02", b"\x81" + b"\xdb\x7f\xff\xff\xff"], "not valid msgpack"),
])
def test_malformed_messages_are_rejected_with_a_reason(frames, reason) -> None:
    with pytest.raises(ProtocolError, match=reason):
        protocol.decode(frames)


def test_commands_outside_the_allowed_set_are_rejected() -> None:
    with pytest.raises(ProtocolError, match="not accepted"):
        protocol.decode(protocol.encode(Command.SUBMIT, {}),
                        allowed=frozenset({Command.TASK}))


def test_oversized_header_is_rejected() -> None:
    header = msgpack.packb({"pad": "x" * (protocol.MAX_HEADER_BYTES + 1)})
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.decode([protocol.SIGNATURE, Command.INFO.value, header])


def test_frames_are_a_msgpack_header_and_the_raw_buffer() -> None:
    header = {"job": "j", "chunk": 0, "start": 0, "count": 1, "dtype": "float32",
              "item_shape": [10], "timings": {"compute": 0.5}}
    outputs = np.linspace(0, 1, 10, dtype=np.float32).reshape(1, 10)
    frames = protocol.encode(Command.RESULT, header, protocol.array_frames(outputs))
    assert len(frames) == 4 and bytes(frames[0]) == protocol.SIGNATURE and frames[1] == b"\x03"
    assert msgpack.unpackb(frames[2]) == header  # plain msgpack, readable by any language
    assert bytes(frames[3]) == outputs.tobytes()  # the buffer itself: no pickle framing


def test_a_snapshot_far_beyond_the_header_limit_travels_as_a_document_frame() -> None:
    """INFO snapshots and job summaries grow with the farm: 2 000 workers' worth, over
    twice the 64 KiB header limit, round-trips; a document that is not a msgpack map is
    refused."""
    snapshot = {"workers": [{"name": f"rack{i // 64}.example.org:{40000 + i}/cpu:{i % 64}",
                             "models": ["caffenet", "cifar10_quick", "lenet"], "rate": 9000.5}
                            for i in range(2000)], "jobs": []}
    frames = protocol.encode(Command.INFO, {}, protocol.document_frames(snapshot))
    assert len(frames[-1]) > 2 * protocol.MAX_HEADER_BYTES
    assert protocol.decode(frames).document() == snapshot
    with pytest.raises(ProtocolError, match="document must be a map"):
        protocol.decode(protocol.encode(Command.DONE, {"job": "j"},
                                        [msgpack.packb([1, 2])])).document()
