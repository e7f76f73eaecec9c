"""What workers answer for an attempt: a RESULT, forwarded to the job's client and
counted (shares, speeds, the policy), or a FAILED, failing the job or the attempt."""

from __future__ import annotations

import logging

from farm.broker import backups
from farm.broker import events as ev
from farm.broker.attempts import (
    answered_record,
    attempt_failed,
    backup_dropped,
    inputs_unshared,
    lost_check,
)
from farm.broker.caps import cap_chunks, note_rate
from farm.broker.core import Farm
from farm.broker.jobs import ChunkRecord
from farm.broker.keeping import keep_vanished, take_kept
from farm.broker.quarantine import answer_refused, blame_settled, strike
from farm.broker.scheduling import cancel_attempt, fail_job, fill, finish_if_done, step
from farm.broker.verify import check_answered, sample
from farm.policies import ChunkDone

log = logging.getLogger("farm.broker")


def on_result_arrived(farm: Farm, event: ev.ResultArrived) -> None:
    if event.kept:
        take_kept(farm, event)
        return
    if event.job in farm.vanished:
        keep_vanished(farm, event)
        return
    record = answered_record(farm, event.worker, event.job, event.chunk)
    if record is None:
        return
    if record.check is not None:
        record.worker.last_answer_at = event.at
        if event.problem or event.failed:  # another device checks it; a wrong form strikes
            if event.problem and not event.in_values:
                strike(farm, record.worker, event.problem)
            lost_check(farm, record, tried=True)
            fill(farm, record.worker)
        else:
            check_answered(farm, record, event.outputs)
        return
    if record.backup_of is not None:
        backup_answered(farm, record, event)
        return
    if event.problem:
        record.worker.last_answer_at = event.at
        answer_refused(farm, record, event)
        return
    for piece in record.backups:  # it answered first: its backups are not needed
        cancel_attempt(farm, piece)
    record.backups = []
    take_result(farm, record, event)


def backup_answered(farm: Farm, record: ChunkRecord, event: ev.ResultArrived) -> None:
    """A backup attempt answered before the attempt it backs up: that attempt is
    cancelled; this piece's result counts, and the other pieces carry the rest of its
    range on as retries.  A backup's refused answer is dropped (a wrong form strikes), its
    other pieces are cancelled, and the first attempt runs on."""
    original = record.backup_of
    assert original is not None
    if event.problem or event.failed:
        record.worker.last_answer_at = event.at
        if event.problem and not event.in_values:
            strike(farm, record.worker, event.problem)
        backup_dropped(farm, record)
        fill(farm, record.worker)
        return
    job = record.job
    cancel_attempt(farm, original)
    others = [piece for piece in original.backups if piece is not record]
    original.backups = []
    for piece in others:
        piece.backup_of, piece.retry = None, True
    if not original.retry:  # the policy hears the whole range done: the rest runs as retries
        job.retry_items += sum(piece.chunk.count for piece in others)
    backups.won(farm, record)
    take_result(farm, record, event, holder=original)


#: The least part of the time the broker saw a chunk take that its worker is credited
#: with: a worker cannot claim more than 1 / 0.8 = 1.25 times its speed.  An honest
#: worker's compute is the time seen less the result's way back, well above it.
OBSERVED_SHARE = 0.8


def credited_compute(record: ChunkRecord, event: ev.ResultArrived) -> float:
    """The compute seconds the attempt is credited with: what the worker reports, but at
    least ``OBSERVED_SHARE`` of what the broker's clock saw it take (from its TASK, or the
    worker's previous answer if later, to its RESULT; a first load of the model aside)."""
    entry = record.worker
    reported = float(event.timings["compute"])
    began = max(record.sent_at or record.assigned_at, entry.last_answer_at)
    load = float(event.timings.get("load", 0.0)) if record.job.model not in entry.loaded else 0.0
    entry.last_answer_at = event.at
    return max(reported, (event.at - began - load) * OBSERVED_SHARE)


def take_result(
    farm: Farm, record: ChunkRecord, event: ev.ResultArrived, holder: ChunkRecord | None = None
) -> None:
    """The attempt's result counts: to the client (unless a kept result delivered its
    items), into the worker's share and speed, and to the job's policy.  ``holder``: the
    attempt the policy (or the retry line) gave the range to, if ``record`` is its
    backup; the policy hears it done after the time it ran, so its speed drops."""
    job, chunk, entry = record.job, record.chunk, record.worker
    job.output_shape = event.output_shape
    compute = credited_compute(record, event)
    job.account(entry, chunk, compute, float(event.timings.get("load", 0.0)))
    note_rate(farm, job.model, entry)
    forward_result(farm, record, event)
    if not event.failed:  # failed items' rows are NaN by design: nothing to compare
        sample(farm, record, event.outputs)
    cap_chunks(farm, job)  # speeds changed
    if farm.observer:
        sent = record.sent_at or record.assigned_at
        farm.observer.chunk_done(
            entry, chunk.count, compute, event.timings, sent - record.assigned_at, event.at - sent
        )
    blame_settled(farm, job.evidence.settle(chunk))
    holder = holder or record
    if holder.retry:
        job.retry_items -= chunk.count
    else:
        if holder is not record:  # its worker ran it this long, and is not done
            compute = farm.now - (holder.sent_at or holder.assigned_at)
        step(farm, job, ChunkDone(holder.worker.id, holder.chunk, compute, at=farm.now))
    finish_if_done(farm, job)
    fill(farm, entry)


def forward_result(farm: Farm, record: ChunkRecord, event: ev.ResultArrived) -> None:
    """The result to the job's client, with the attempt's trace, unless a kept result
    delivered its items already."""
    job, chunk = record.job, record.chunk
    origin, sent = job.submitted_at, record.sent_at or record.assigned_at
    if not job.delivered or not job.delivered.covers(chunk.start, chunk.stop):
        farm.out.append(
            ev.SendResult(
                client=job.client,
                result=event,
                worker=record.worker.name,
                attempt=record.attempt,
                trace=(record.assigned_at - origin, sent - origin, event.at - origin),
                corrects=bool(job.corrections) and job.corrections.covers(chunk.start, chunk.stop),
                stimulus=farm.stimulus,
            )
        )
    log.debug("delivered items %d..%d of job %s", chunk.start, chunk.stop - 1, job.id)


def on_failure_arrived(farm: Farm, event: ev.FailureArrived) -> None:
    """A chunk failed on its worker: a model error fails the job, anything else retries."""
    record = answered_record(farm, event.worker, event.job, event.chunk)
    if record is None:
        return
    chunk = record.chunk
    if record.backup_of is not None:  # the first attempt runs on
        backup_dropped(farm, record)
        fill(farm, record.worker)
        return
    if record.check is not None:  # the check waits for another worker
        if event.unshared:
            record.job.unshared.add(record.worker.id)
        lost_check(farm, record, tried=not event.unshared)
        fill(farm, record.worker)
        return
    if event.unshared:
        inputs_unshared(farm, record, event.error)
        return
    if event.fatal:
        fail_job(
            farm,
            record.job,
            f"items {chunk.start}..{chunk.stop - 1} failed on {record.worker.name}: {event.error}",
        )
        return
    attempt_failed(farm, record, f"{record.worker.name}: {event.error}", event.charge)
    fill(farm, record.worker)
