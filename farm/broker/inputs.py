"""A chunk's input: asked of its client (NEED, answered by DATA), or read by the worker
itself from shared storage; either way it goes out as the attempt's TASK.

Fair admission: a worker's slot waits for its chunk's input, so a client that does not
answer would hold slots other jobs could use.  So a job whose client sends the items
first answers a *probe* (a NEED of one item, holding no slot: ``PROBE``) and only then
is offered slots (``Job.proven``).  A proven client that leaves a NEED unanswered past
its deadline (``need_deadline``) has its job *parked*: the slots its NEEDs held go to
other jobs, and after a back-off (``PARK_SECONDS``) it is probed again.  Its late DATA
proves it alive at once, and its deadline doubles.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from farm.broker import events as ev
from farm.broker.core import Farm
from farm.broker.jobs import ChunkRecord, Job

log = logging.getLogger("farm.broker")

#: The chunk id of a probe (attempt ids start at 1).
PROBE = 0
#: Least seconds a client has to answer a NEED, and its multiple of the client's slowest
#: answer so far; doubled for each time the job was parked.
NEED_DEADLINE = 2.0
NEED_DEADLINE_FACTOR = 10.0
#: Seconds a parked job waits before its client is probed again: the first, and the most
#: (doubling in between).
PARK_SECONDS = (1.0, 60.0)


def probe(farm: Farm, job: Job) -> None:
    """Ask the job's client for one item before the job holds any slot; a job whose
    workers read its items themselves needs no client to run, and is proven at once."""
    if job.inputs is not None:
        job.proven = True
        return
    job.probes += 1  # asked again after a back-off until it answers (``overdue_needs``)
    job.parked_until = farm.now + min(PARK_SECONDS[1], PARK_SECONDS[0] * 2.0 ** (job.probes - 1))
    farm.out.append(
        ev.SendNeed(
            client=job.client, job=job.id, chunk=PROBE, start=0, count=1, stimulus=farm.stimulus
        )
    )


def proven(farm: Farm, job: Job) -> bool:
    """The client answered (a probe, or late): the job may hold slots again; True if it
    could not before."""
    was = job.proven
    job.proven, job.parked_until = True, None
    return not was


def need_deadline(job: Job) -> float:
    return max(NEED_DEADLINE, NEED_DEADLINE_FACTOR * job.slowest_input) * 2.0**job.parks


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
        if job.id in farm.running and proven(farm, job):  # a probe's answer, or a late one
            farm.refill = True  # offer the slots again
        return None
    job.slowest_input = max(job.slowest_input, event.at - record.assigned_at)
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
