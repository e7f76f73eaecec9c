"""Protocol frames built and read by hand, for tests that speak to a broker or a worker as a
broken or hostile peer would.  In-process only: both tiers import it."""

from __future__ import annotations

import msgpack
import numpy as np
import zmq

from farm.modelrepo.modelstore import manifest_of
from farm.modelrepo.repository import ModelError, find
from farm.wire import messages, protocol
from farm.wire.protocol import Command

REPLY_TIMEOUT_MS = 10_000

V = protocol.SIGNATURE

#: Malformed messages, each of which a peer must answer (or drop) and survive.
GARBAGE = [
    [b"random bytes"],
    [V],
    [V, b"\x05"],
    [b"FARM01", b"\x09", msgpack.packb({})],  # an older protocol version
    [V, b"\xff", msgpack.packb({})],
    [V, b"\x05", b"\x93\x01"],  # truncated msgpack
    [V, b"\x05", msgpack.packb({"job": 1, "model": ["x"]})],
    [
        V,
        b"\x05",
        msgpack.packb(
            {
                "job": "j",
                "model": "lenet",
                "dtype": "uint8",
                "item_shape": [1, 28, 28],
                "total": -5,
                "options": {},
            }
        ),
    ],
    [
        V,
        b"\x03",
        msgpack.packb(
            {
                "job": "j",
                "chunk": 9,
                "start": 0,
                "count": 1,
                "dtype": "float32",
                "item_shape": [10],
                "timings": {},
            }
        ),
        b"\0" * 40,
    ],  # a result nobody asked
    [V, b"\x02", msgpack.packb({})],  # a TASK sent to the broker
    [
        V,
        b"\x01",
        msgpack.packb(
            {
                "device": "cpu",
                "host": "h",
                "pid": 1,
                "backend": "x",
                "models": {"lenet": 5},
                "slots": 1,
            }
        ),
    ],
]


def reply(sock: zmq.Socket, timeout_ms: int = REPLY_TIMEOUT_MS) -> protocol.Message | None:
    """The broker's next message other than a heartbeat; None if none came in time."""
    while sock.poll(timeout_ms):
        message = protocol.decode(sock.recv_multipart())
        if message.command is not Command.HEARTBEAT:
            return message
    assert timeout_ms < REPLY_TIMEOUT_MS, "no reply within the timeout"
    return None


def next_reply(router: zmq.Socket) -> protocol.Message:
    """The worker's next message other than a heartbeat (answered, as a broker would)."""
    while True:
        assert router.poll(REPLY_TIMEOUT_MS), "worker did not answer"
        identity, *frames = router.recv_multipart()
        message = protocol.decode(frames)
        if message.command is not Command.HEARTBEAT:
            return message
        router.send_multipart([identity, *protocol.encode(Command.HEARTBEAT)])


def digest_of(model: str) -> str:
    """The content digest of a bundled model, or a made-up one for a model nobody has."""
    try:
        return manifest_of(find(model)).digest
    except ModelError:
        return "f" * 64


def task(identity: bytes, chunk: int, images: np.ndarray, model: str = "lenet", shape=None) -> list:
    """A TASK for the worker ``identity`` (the frames a ROUTER sends)."""
    header = messages.Task(
        job="j",
        chunk=chunk,
        attempt=1,
        start=0,
        count=len(images),
        model=model,
        digest=digest_of(model),
        dtype=str(images.dtype),
        item_shape=tuple(shape or images.shape[1:]),
    )
    return [identity, *protocol.encode(Command.TASK, header, [images.tobytes()])]


def reply_after_probe(sock: zmq.Socket, item: list[bytes]) -> protocol.Message | None:
    """The broker's next message after the probe of a job just submitted (a NEED of item 0,
    chunk 0: fair admission, ``farm.broker.inputs``), answered with ``item``'s frames."""
    probe = reply(sock)
    assert probe is not None and probe.command is Command.NEED, probe
    assert (probe.header.chunk, probe.header.start, probe.header.count) == (0, 0, 1)
    data = messages.Data(job=probe.header.job, chunk=0, start=0, count=1)
    sock.send_multipart(protocol.encode(Command.DATA, data, item))
    return reply(sock)
