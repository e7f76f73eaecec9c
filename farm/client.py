"""The client: stream an image array to the broker, collect outputs in input order.

    >>> import farm
    >>> scores = farm.Client("tcp://127.0.0.1:5555").map(images, model="lenet")
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import zmq

from farm import protocol
from farm.protocol import Command, ProtocolError
from farm.summary import JobSummary

DEFAULT_BROKER = "tcp://127.0.0.1:5555"

#: Input is streamed in blocks of about this many bytes (at least one item each).
BLOCK_BYTES = 4 << 20

#: Commands a client accepts from the broker.
ACCEPTED = frozenset({Command.RESULT, Command.DONE, Command.ERROR, Command.INFO,
                      Command.HEARTBEAT})


class FarmError(RuntimeError):
    """The broker refused or failed a job; the message says why."""


class FarmTimeout(FarmError):
    """Nothing came back from the broker within the timeout."""


def as_batch(images: np.ndarray) -> np.ndarray:
    """N x C x H x W as is; N x H x W (one channel) gets its channel axis."""
    images = np.asarray(images)
    if images.ndim == 3:
        return images[:, np.newaxis]
    if images.ndim != 4:
        raise FarmError(f"images must be N x C x H x W or N x H x W, got shape {images.shape}")
    return images


@dataclass
class JobResult:
    outputs: np.ndarray
    summary: JobSummary


ProgressCallback = Callable[[int], None]


class Client:
    """A connection to a broker; one job at a time per client."""

    def __init__(self, broker: str = DEFAULT_BROKER, timeout: float | None = 60.0,
                 context: zmq.Context | None = None, block_bytes: int = BLOCK_BYTES) -> None:
        self.broker = broker
        self.timeout = timeout
        self.block_bytes = block_bytes
        self._own_context = context is None
        self.context = context or zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        self.socket.connect(broker)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def close(self) -> None:
        self.socket.close()
        if self._own_context:
            self.context.term()

    def map(self, images: np.ndarray, model: str, **options: Any) -> np.ndarray:
        """Outputs for every image, in input order."""
        return self.run(images, model, **options).outputs

    def run(self, images: np.ndarray, model: str, out: np.ndarray | None = None,
            progress: ProgressCallback | None = None) -> JobResult:
        """Submit a job, stream its input, gather outputs (into ``out`` if given) and a summary."""
        batch = as_batch(images)
        if len(batch) == 0:
            raise FarmError("no images to run")
        job = uuid.uuid4().hex
        started = time.perf_counter()
        self._send(Command.SUBMIT, {"job": job, "model": model, "dtype": str(batch.dtype),
                                    "item_shape": list(batch.shape[1:]), "total": len(batch),
                                    "options": {}})
        self._stream(job, batch)
        return self._collect(job, len(batch), out, progress, started)

    def _send(self, command: Command, header: dict[str, Any], payload: list[Any] = ()) -> None:
        self.socket.send_multipart(protocol.encode(command, header, payload), copy=False)

    def _stream(self, job: str, batch: np.ndarray) -> None:
        """Send the input in blocks; each block is one raw frame."""
        per_block = max(1, self.block_bytes // max(1, batch[0].nbytes))
        for start in range(0, len(batch), per_block):
            block = batch[start:start + per_block]
            self._send(Command.DATA, {"job": job, "start": start, "count": len(block)},
                       protocol.array_frames(block))

    def _collect(self, job: str, total: int, out: np.ndarray | None,
                 progress: ProgressCallback | None, started: float) -> JobResult:
        seen = np.zeros(total, dtype=bool)
        while True:
            message = self._receive()
            header = message.header
            if message.command is Command.ERROR and "job" not in header:
                raise FarmError(f"the broker refused a request: {header['error']}")
            if header.get("job") != job:
                continue  # a stale reply of an earlier job
            if message.command is Command.ERROR:
                raise FarmError(header["error"])
            if message.command is Command.DONE:
                break
            if message.command is Command.RESULT:
                start, count = header["start"], header["count"]
                if start + count > total or seen[start:start + count].any():
                    continue  # out of range or a duplicate: keep the first copy
                values = message.array(header["dtype"], header["item_shape"])
                if out is None:
                    out = np.empty((total, *values.shape[1:]), dtype=values.dtype)
                if values.shape[1:] != out.shape[1:]:
                    raise FarmError(f"outputs of shape {values.shape[1:]} for items {start}+"
                                    f"{count} do not match earlier ones {out.shape[1:]}")
                out[start:start + count] = values
                seen[start:start + count] = True
                if progress:
                    progress(count)
        elapsed = time.perf_counter() - started
        if not seen.all():
            missing = np.flatnonzero(~seen)
            raise FarmError(f"job ended with {len(missing)} images missing, first {missing[:10]}")
        return JobResult(out, JobSummary.from_broker(header["summary"], elapsed))

    def _receive(self) -> protocol.Message:
        """The next well-formed message from the broker; FarmTimeout if none comes.

        The broker heartbeats clients with running jobs, so the timeout measures
        the broker's silence, not the length of a job.
        """
        while True:
            timeout_ms = None if self.timeout is None else int(self.timeout * 1000)
            if not self.socket.poll(timeout_ms):
                raise FarmTimeout(f"no reply from broker {self.broker} in {self.timeout} s")
            frames = self.socket.recv_multipart(copy=False)
            try:
                return protocol.decode(frames, allowed=ACCEPTED)
            except ProtocolError:
                continue

    def info(self, wait_workers: int = 0) -> dict[str, Any]:
        """The broker's registry; with ``wait_workers``, once that many workers have joined."""
        self._send(Command.INFO, {"wait_workers": wait_workers})
        while True:
            message = self._receive()
            if message.command is Command.INFO:
                return message.header
            if message.command is Command.ERROR and "job" not in message.header:
                raise FarmError(message.header["error"])
