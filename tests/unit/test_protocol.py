"""The wire format: round trips and the validation of every field."""

from __future__ import annotations

import msgpack
import msgspec
import numpy as np
import pytest

from farm.summary import JobSummary, WorkerShare
from farm.wire import messages, protocol
from farm.wire.protocol import Command, ProtocolError


def task_header(count: int = 2, shape=(1, 28, 28), dtype: str = "uint8") -> dict:
    return {
        "job": "j",
        "chunk": 1,
        "attempt": 1,
        "start": 0,
        "count": count,
        "model": "lenet",
        "digest": "0" * 64,
        "dtype": dtype,
        "item_shape": list(shape),
    }


def task(count: int = 2, shape=(1, 28, 28), dtype: str = "uint8") -> messages.Task:
    return msgspec.convert(task_header(count, shape, dtype), messages.Task)


def test_array_round_trip_is_zero_copy_for_one_frame() -> None:
    images = np.arange(2 * 784, dtype=np.uint8).reshape(2, 1, 28, 28)
    signature, command, header, payload = protocol.encode(
        Command.TASK, task(), protocol.array_frames(images)
    )
    frame = bytearray(payload)
    message = protocol.decode([signature, command, header, frame])
    decoded = message.array("uint8", (1, 28, 28))
    assert message.command is Command.TASK
    np.testing.assert_array_equal(decoded, images)
    frame[0] = 255  # the decoded array is a view of the frame: it sees the change
    assert decoded[0, 0, 0, 0] == 255


def test_array_from_several_frames_is_joined() -> None:
    images = np.arange(3 * 4, dtype=np.float32).reshape(3, 4)
    frames = protocol.encode(
        Command.TASK, task(3, (4,), "float32"), [images[:1].tobytes(), images[1:].tobytes()]
    )
    np.testing.assert_array_equal(protocol.decode(frames).array("float32", (4,)), images)


@pytest.mark.parametrize(
    "frames, reason",
    [
        ([protocol.SIGNATURE, b"\x02"], "at least 3 frames"),
        ([b"FARM99", b"\x02", msgpack.packb({})], "protocol version FARM99 is not supported"),
        ([b"XX", b"\x02", msgpack.packb({})], "unknown protocol signature"),
        ([protocol.SIGNATURE, b"\x7f", msgpack.packb({})], "unknown command"),
        ([protocol.SIGNATURE, b"\x02", b"\xc1garbage"], "not valid msgpack"),
        ([protocol.SIGNATURE, b"\x02", msgpack.packb([1, 2])], "Expected `object`, got `array`"),
        (
            [
                protocol.SIGNATURE,
                b"\x02",
                msgpack.packb({**task_header(), "count": "2"}),
                b"x" * 1568,
            ],
            "count",
        ),
        (
            [
                protocol.SIGNATURE,
                b"\x02",
                msgpack.packb({**task_header(), "dtype": "float64"}),
                b"x" * 1568,
            ],
            "not allowed",
        ),
        (
            [
                protocol.SIGNATURE,
                b"\x02",
                msgpack.packb({**task_header(), "item_shape": [1, -28, 28]}),
                b"x",
            ],
            r">= 1 - at `\$.item_shape\[1\]`",
        ),
        (
            [protocol.SIGNATURE, b"\x02", msgpack.packb(task_header()), b"x" * 1567],
            "payload is 1567 bytes",
        ),
        (
            [protocol.SIGNATURE, b"\x02", msgpack.packb({**task_header(), "count": 1 << 40}), b"x"],
            r"<= 2147483648 - at `\$.count`",
        ),
        (
            [
                protocol.SIGNATURE,
                b"\x02",
                msgpack.packb({**task_header(), "colour": "red"}),
                b"x" * 1568,
            ],
            "unknown field `colour`",
        ),
        (
            [protocol.SIGNATURE, b"\x05", msgpack.packb({"job": "j" * 101})],
            r"length <= 100 - at `\$.job`",
        ),
        ([protocol.SIGNATURE, b"\x0a", msgpack.packb({"interval": 0.0})], r"`\$.interval`"),
        (
            [protocol.SIGNATURE, b"\x0a", b"\x81\xa3job" + b"\x91" * 3000 + b"\xc0"],
            r"got `array` - at `\$.job`",
        ),
        (
            [protocol.SIGNATURE, b"\x02", msgpack.packb({**task_header(1, [1 << 20] * 4)}), b"x"],
            "larger than",
        ),
        ([protocol.SIGNATURE, b"\x05", msgpack.packb({"job": "j"})], "model"),
        ([protocol.SIGNATURE, b"\x0a", msgpack.packb({}), b"unexpected"], "carries no payload"),
        ([protocol.SIGNATURE, b"\x09", msgpack.packb({}), b"a", b"b"], "at most one document"),
        ([protocol.SIGNATURE, b"\x02", b"\x81" + b"\xdb\x7f\xff\xff\xff"], "not valid msgpack"),
    ],
)
def test_malformed_messages_are_rejected_with_a_reason(frames, reason) -> None:
    with pytest.raises(ProtocolError, match=reason):
        protocol.decode(frames)


def test_commands_outside_the_allowed_set_are_rejected() -> None:
    with pytest.raises(ProtocolError, match="not accepted"):
        protocol.decode(
            [protocol.SIGNATURE, Command.SUBMIT.value, msgpack.packb({})],
            allowed=frozenset({Command.TASK}),
        )


def test_oversized_header_is_rejected() -> None:
    header = msgpack.packb({"pad": "x" * (protocol.MAX_HEADER_BYTES + 1)})
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.decode([protocol.SIGNATURE, Command.INFO.value, header])


def test_frames_are_a_msgpack_header_and_the_raw_buffer() -> None:
    header = {
        "job": "j",
        "chunk": 0,
        "start": 0,
        "count": 1,
        "dtype": "float32",
        "item_shape": [10],
        "timings": {"compute": 0.5},
    }
    outputs = np.linspace(0, 1, 10, dtype=np.float32).reshape(1, 10)
    frames = protocol.encode(
        Command.RESULT, msgspec.convert(header, messages.Result), protocol.array_frames(outputs)
    )
    assert len(frames) == 4 and bytes(frames[0]) == protocol.SIGNATURE and frames[1] == b"\x03"
    assert msgpack.unpackb(frames[2]) == header  # plain msgpack, readable by any language
    assert bytes(frames[3]) == outputs.tobytes()  # the buffer itself: no pickle framing


def test_a_snapshot_far_beyond_the_header_limit_travels_as_a_document_frame() -> None:
    """INFO snapshots and job summaries grow with the farm: 2 000 workers' worth, over
    twice the 64 KiB header limit, round-trips; a document that is not a msgpack map is
    refused."""
    snapshot = {
        "workers": [
            {
                "name": f"rack{i // 64}.example.org:{40000 + i}/cpu:{i % 64}",
                "models": ["caffenet", "cifar10_quick", "lenet"],
                "rate": 9000.5,
            }
            for i in range(2000)
        ],
        "jobs": [],
    }
    frames = protocol.encode(Command.INFO, messages.Info(), protocol.document_frames(snapshot))
    assert len(frames[-1]) > 2 * protocol.MAX_HEADER_BYTES
    assert protocol.decode(frames).document(dict) == snapshot
    with pytest.raises(ProtocolError, match="DONE document: Expected `object`, got `array`"):
        protocol.decode(
            protocol.encode(Command.DONE, messages.Done(job="j"), [msgpack.packb([1, 2])])
        ).document(JobSummary)


def test_a_typed_header_round_trips_and_leaves_its_defaults_off_the_wire() -> None:
    heartbeat = messages.Heartbeat(job="j")
    frames = protocol.encode(Command.HEARTBEAT, heartbeat)
    assert msgpack.unpackb(frames[2]) == {"job": "j"}
    assert protocol.decode(frames).header == heartbeat
    with pytest.raises(TypeError, match="Heartbeat header cannot go with INFO"):
        protocol.encode(Command.INFO, heartbeat)


def test_only_a_commands_own_struct_is_encoded_never_a_map() -> None:
    """A map of fields is refused (a malformed header is built by hand, as tests do); no
    header stands for the command's defaults, where all its fields have one."""
    with pytest.raises(TypeError, match="dict header cannot go with INFO"):
        protocol.encode(Command.INFO, {"wait_workers": 1})  # type: ignore[arg-type]
    assert msgpack.unpackb(protocol.encode(Command.DISCONNECT)[2]) == {}
    with pytest.raises(TypeError):
        protocol.encode(Command.SUBMIT)


def test_unknown_fields_deep_in_a_header_are_refused_without_recursing() -> None:
    deep = b"\x81\xa1x" + b"\x91" * 3000 + b"\xc0"  # {"x": [[[...]]]}, 3 000 deep
    with pytest.raises(ProtocolError, match="unknown field `x`"):
        protocol.decode([protocol.SIGNATURE, Command.INFO.value, deep])


def test_a_job_summary_travels_as_its_document() -> None:
    summary = JobSummary(
        total=10,
        items=10,
        policy="fifo",
        broker_seconds=0.5,
        workers=(
            WorkerShare(
                name="h:1/cpu:0", device="cpu:0", items=10, chunks=1, compute_s=0.25, rate=40.0
            ),
        ),
    )
    frames = protocol.encode(
        Command.DONE, messages.Done(job="j"), protocol.document_frames(summary)
    )
    assert msgpack.unpackb(frames[3])["workers"][0]["standalone_rate"] == 40.0
    assert protocol.decode(frames).document(JobSummary) == summary


def test_a_tasks_engine_choice_crosses_the_wire_and_a_malformed_one_is_refused() -> None:
    """A job's engine choice travels as a typed struct; one that breaks its rules (a gated
    list not ending in f32) is refused as it is decoded, naming the field."""
    from farm.wire.engines import EngineChoice

    choice = EngineChoice("auto", ("int8", "bf16", "f32"), "openvino", "0123456789ab")
    chunk = msgspec.structs.replace(task(), engine=choice)
    images = np.zeros((2, 1, 28, 28), np.uint8)
    frames = protocol.encode(Command.TASK, chunk, protocol.array_frames(images))
    decoded = protocol.decode(frames).header
    assert isinstance(decoded, messages.Task) and decoded.engine == choice
    engine = {"precisions": ["int8", "bf16"], "measured_on": "openvino"}
    header = msgpack.packb({**task_header(), "engine": engine})
    with pytest.raises(ProtocolError, match=r"ends in f32.*\$\.engine"):
        protocol.decode([protocol.SIGNATURE, Command.TASK.value, header, b"\0" * 2 * 784])
