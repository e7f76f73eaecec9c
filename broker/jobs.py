"""A job as the broker holds it: input blocks, its policy, chunks in flight, shares."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

from farm import protocol
from farm.broker.registry import WorkerEntry
from farm.policies import Chunk, Policy
from farm.protocol import ProtocolError


@dataclass
class ChunkRecord:
    """A chunk given to a worker; ``sent_at`` is None while its input has not all arrived."""

    id: int
    job: Job
    chunk: Chunk
    worker: WorkerEntry
    sent_at: float | None = None


@dataclass
class Share:
    """One worker's part in one job."""

    name: str
    device: str
    items: int = 0
    chunks: int = 0
    compute_s: float = 0.0


@dataclass
class Job:
    """A client's job."""

    id: str
    client: bytes
    model: str
    dtype: str
    item_shape: tuple[int, ...]
    total: int
    submitted_at: float
    policy: Policy | None = None  # made when the job is validated, for the workers then eligible
    digest: str = ""  # the content hash of the model's files, set when the job is validated
    item_bytes: int = 0
    starts: list[int] = field(default_factory=list)  # block starts, sorted
    blocks: list[Any] = field(default_factory=list)  # zmq frames, parallel to starts
    received: int = 0  # items of input received, contiguous from 0
    unsent: list[ChunkRecord] = field(default_factory=list)  # assigned, input not all here
    shares: dict[str, Share] = field(default_factory=dict)
    eligible: dict[str, WorkerEntry] = field(default_factory=dict)  # workers offered this job
    output_shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self.item_bytes = protocol.check_array_spec(self.dtype, self.item_shape)

    @property
    def done(self) -> int:
        """Items computed so far."""
        return self.policy.completed if self.policy else 0

    def add_block(self, start: int, count: int, frame: Any) -> None:
        """Keep one block of input; blocks must come in order and fit the job."""
        if start != self.received:
            raise ProtocolError(f"job {self.id}: block at {start}, expected {self.received}")
        if start + count > self.total:
            raise ProtocolError(f"job {self.id}: block {start}+{count} past total {self.total}")
        if frame.buffer.nbytes != count * self.item_bytes:
            raise ProtocolError(f"job {self.id}: block of {frame.buffer.nbytes} bytes, "
                                f"expected {count} x {self.item_bytes}")
        self.starts.append(start)
        self.blocks.append(frame)
        self.received += count

    def slices(self, chunk: Chunk) -> list[memoryview] | None:
        """Zero-copy views of the chunk's input, or None while part of it has not arrived."""
        if chunk.stop > self.received:
            return None
        views, item_bytes = [], self.item_bytes
        index = bisect.bisect_right(self.starts, chunk.start) - 1
        position = chunk.start
        while position < chunk.stop:
            block_start, block = self.starts[index], self.blocks[index].buffer
            stop = min(chunk.stop, block_start + block.nbytes // item_bytes)
            views.append(block[(position - block_start) * item_bytes:
                               (stop - block_start) * item_bytes])
            position, index = stop, index + 1
        return views

    def check_result(self, record: ChunkRecord, header: dict[str, Any]) -> str | None:
        """Why a worker's RESULT cannot be accepted for ``record``, or None."""
        chunk = record.chunk
        if (header["start"], header["count"]) != (chunk.start, chunk.count):
            return f"answers items {header['start']}+{header['count']}, not the chunk's"
        if header["dtype"] != "float32":
            return f"outputs are {header['dtype']}, not float32"
        shape = tuple(header["item_shape"])
        if self.output_shape not in (None, shape):
            return f"output shape {shape} differs from earlier chunks' {self.output_shape}"
        compute = header["timings"].get("compute")
        if not isinstance(compute, (int, float)) or not math.isfinite(compute) or compute < 0:
            return f"compute time {compute!r} is not a time"
        self.output_shape = shape
        return None

    def account(self, worker: WorkerEntry, chunk: Chunk, compute: float) -> None:
        share = self.shares.get(worker.id)
        if share is None:
            share = self.shares[worker.id] = Share(worker.name, worker.device)
        share.items += chunk.count
        share.chunks += 1
        share.compute_s += compute
        worker.record(self.model, chunk.count, compute)

    def summary(self, now: float) -> dict[str, Any]:
        """Per-worker shares with each worker's standalone speed on this model.

        A worker that was offered the job but ran none of it still counts in the
        theoretical speed, at the speed it showed on this model before.
        """
        workers = []
        for worker_id, worker in self.eligible.items():
            share = self.shares.get(worker_id, Share(worker.name, worker.device))
            history = worker.history.get(self.model)
            rate = (share.items / share.compute_s if share.compute_s > 0
                    else history.rate if history else 0.0)
            workers.append({**vars(share), "standalone_rate": rate})
        return {"items": self.total, "broker_seconds": now - self.submitted_at,
                "policy": self.policy.name if self.policy else "?", "workers": workers}
