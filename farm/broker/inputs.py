"""A chunk's input: asked of its client (NEED, answered by DATA), or read by the worker
itself from shared storage; either way it goes out as the attempt's TASK."""

from __future__ import annotations

from typing import Any, Literal

from farm.broker import events as ev
from farm.broker.core import Farm
from farm.broker.jobs import ChunkRecord


def request_input(farm: Farm, record: ChunkRecord) -> None:
    """Ask the job's client for the attempt's items, or send the TASK at once when the
    worker reads them itself (a worker that cannot is sent the bytes)."""
    job, chunk = record.job, record.chunk
    if job.inputs is not None and record.worker.id not in job.unshared:
        located = job.inputs.locate(chunk.start, chunk.count)
        send_task(farm, record, located.payload, located.stored, located.place)
        return
    job.pending[record.id] = record
    farm.out.append(
        ev.SendNeed(
            client=job.client,
            job=job.id,
            chunk=record.id,
            start=chunk.start,
            count=chunk.count,
            stimulus=farm.stimulus,
        )
    )


def awaited_data(farm: Farm, event: ev.DataArrived) -> ChunkRecord | None:
    """The attempt a DATA answers, no longer awaited; None if nothing waits for it (its
    job ended, or its worker was lost and the chunk requeued)."""
    job = farm.jobs.get(event.job)
    if job is None or job.client != event.client:
        return None
    job.client_seen = event.at
    record = job.pending.pop(event.chunk, None)
    if record is None or record.id not in record.worker.in_flight:
        return None
    return record


def send_task(
    farm: Farm,
    record: ChunkRecord,
    payload: Any,
    stored: Literal["files", "npy"] | None = None,
    place: Any = None,
) -> None:
    """The attempt's TASK to its worker: its items (``payload``), or where they lie."""
    job, chunk = record.job, record.chunk
    record.sent_at = farm.now
    record.sent_seq = farm.next_seq_sent
    farm.next_seq_sent += 1
    job.items_run += chunk.count
    farm.out.append(
        ev.SendTask(
            worker=record.worker.identity,
            job=job.id,
            chunk=record.id,
            attempt=record.attempt,
            start=chunk.start,
            count=chunk.count,
            model=job.model,
            digest=job.digest,
            dtype=job.dtype,
            item_shape=job.item_shape,
            engine=job.options.engine,
            exif_rotate=job.options.exif_rotate,
            payload=payload,
            stored=stored,
            place=place,
            stimulus=farm.stimulus,
        )
    )
