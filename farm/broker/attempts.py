"""How attempts end: a reply matched to the attempt it answers, or an attempt failed or
lost, marked against its items (``farm.broker.blame``), then run again, narrowed down
or given up.

* A reply to an attempt no longer in flight is dropped, so every item is delivered once.
* Only what the evidence supports is charged to a chunk's items: a FAILED, or its
  worker dying while computing it.  A charged range leaves its policy for the job's
  retry line, which runs it on another device; a range charged on two devices is
  narrowed down by halves to the images that fail by themselves, which alone are given
  up and reported (FAILED).  Lost workers charge nothing, but no item runs more than
  ``max_runs`` times.
"""

from __future__ import annotations

import logging

from farm.broker import events as ev
from farm.broker.blame import Mark, halves, suspect
from farm.broker.core import Farm
from farm.broker.jobs import ChunkRecord, Ranges, Worker
from farm.broker.scheduling import cancel_attempt, fill, finish_if_done, step
from farm.policies import ChunkFailed
from farm.summary import FailedItems

log = logging.getLogger("farm.broker")

#: Failed attempts at retried ranges a job may spend; past it, a failing range is given up
#: whole (failures everywhere are not a few bad images).
RETRY_LIMIT = 1000


def answered_record(farm: Farm, identity: bytes, job_id: str, chunk_id: int) -> ChunkRecord | None:
    """The attempt a RESULT or FAILED answers, out of its worker's slot; None for a late,
    duplicate or unknown one.

    A reply from a worker the state no longer knows (declared dead, then back)
    gets DropWorker: the worker registers afresh.
    """
    entry = farm.heard_worker(identity)
    record = entry.in_flight.get(chunk_id) if entry else None
    if (
        entry is not None
        and record is not None
        and record.sent_at is not None
        and record.job.outcome
        and record.job.id == job_id
    ):
        del entry.in_flight[record.id]  # a chunk of a job that ended: its slot is free
        fill(farm, entry)
        return None
    if (
        entry is None
        or record is None
        or record.sent_at is None
        or record.job.id not in farm.jobs
        or record.job.id != job_id
    ):
        drop_reply(farm, identity, entry, chunk_id)
        return None
    del entry.in_flight[record.id]
    return record


def drop_reply(farm: Farm, identity: bytes, entry: Worker | None, chunk_id: int) -> None:
    """A late, duplicate or unknown reply; a worker not known is told to register."""
    farm.stats.late_replies += 1
    log.info(
        "dropped a reply for chunk %s from %s (late, duplicate or cancelled)",
        chunk_id,
        entry.name if entry else identity.hex(),
    )
    if entry is None:
        farm.out.append(ev.DropWorker(worker=identity, stimulus=farm.stimulus))


def worker_lost(
    farm: Farm, entry: Worker, records: list[ChunkRecord], reason: str, crashed: bool
) -> None:
    """The attempts a lost worker held go back to their jobs.  Only the one it was
    computing when it ``crashed`` is charged: the others waited behind it, and a worker
    lost to silence or a goodbye says nothing about its chunks."""
    sent = [
        record for record in records if record.sent_at is not None and record.job.outcome is None
    ]
    computing = min(sent, key=lambda r: r.sent_seq) if crashed and sent else None
    for record in sent:  # a kept result of these may come back from it (``keeping``)
        if not record.extra:
            lost = record.job.lost_by.setdefault(entry.owner or entry.name, Ranges())
            lost.add(record.chunk.start, record.chunk.stop)
    for record in records:
        job = record.job
        job.pending.pop(record.id, None)
        if job.outcome is not None or job.policy is None:
            continue
        if record.check is not None:  # a spot check: it waits for another worker
            lost_check(farm, record)
        elif record.backup_of is not None:  # a backup: the first attempt runs on
            backup_dropped(farm, record)
        elif record is computing:
            error = f"worker {entry.name} died while computing it ({reason})"
            attempt_failed(farm, record, error, charged=True, worker_lost=True)
        elif record.sent_at is not None:
            error = f"worker {entry.name} was lost ({reason})"
            attempt_failed(farm, record, error, charged=False, worker_lost=True)
        elif record.retry:  # it never left: back in line, uncharged
            job.retries.appendleft(record.chunk)


def lost_check(farm: Farm, record: ChunkRecord, tried: bool = False) -> None:
    """A spot check's attempt ended without an answer: the check waits for another
    worker (``farm.broker.verify``); ``tried``: not on this device again (it failed the
    images, or answered what cannot be compared)."""
    checks = record.job.checks
    if checks is not None and record.check is not None:
        checks.running -= 1
        if tried:
            record.check.tried.add(record.worker.place)
        checks.waiting.insert(0, record.check)
        farm.refill = True


def backup_dropped(farm: Farm, record: ChunkRecord) -> None:
    """A backup attempt ended without a result (failed, refused, or its worker lost): its
    other pieces are cancelled, and the attempt they backed up runs on; nothing is
    charged."""
    original = record.backup_of
    if original is not None:
        for piece in original.backups:
            if piece is not record:
                cancel_attempt(farm, piece)
        original.backups = []
    record.backup_of = None
    log.info(
        "job %s: the backup of items %d..%d on %s ended without a result",
        record.job.id,
        record.chunk.start,
        record.chunk.stop - 1,
        record.worker.name,
    )


def promote_backup(farm: Farm, record: ChunkRecord) -> None:
    """The attempt backups run for ended without a result: the backups carry its range on,
    as attempts of the job's retry line (outside the policy)."""
    job, pieces = record.job, record.backups
    record.backups = []
    for piece in pieces:
        piece.backup_of, piece.retry = None, True
    if not record.retry:  # the range leaves the policy for the retry line
        step(farm, job, ChunkFailed(record.worker.id, record.chunk, False, at=farm.now))
        job.retry_items += record.chunk.count
    log.info(
        "job %s: items %d..%d: attempt on %s ended; its backups on %s carry on",
        job.id,
        record.chunk.start,
        record.chunk.stop - 1,
        record.worker.name,
        ", ".join(piece.worker.name for piece in pieces),
    )


def inputs_unshared(farm: Farm, record: ChunkRecord, error: str) -> None:
    """The worker cannot read the job's shared inputs: it gets their bytes from now on
    (NEED and DATA), and the chunk runs again, uncharged."""
    job, entry = record.job, record.worker
    if entry.id not in job.unshared:
        job.unshared.add(entry.id)
        farm.stats.unshared_workers += 1
        log.warning(
            "job %s: worker %s cannot read the shared inputs (%s): sending it their bytes",
            job.id,
            entry.name,
            error,
            extra={"event": "inputs_unshared", "job": job.id, "worker": entry.name},
        )
    attempt_failed(farm, record, f"{entry.name}: {error}", charged=False)
    fill(farm, entry)


def attempt_failed(
    farm: Farm, record: ChunkRecord, error: str, charged: bool, worker_lost: bool = False
) -> None:
    """Mark the attempt; then run the range again, cut it, or give it up.

    A charged range leaves its policy for the job's retry line, which runs it on
    another device; a suspect one is cut in halves first.  ``worker_lost``: the
    policy's ``WorkerLost`` (which follows) returns the worker's other chunks.
    """
    job, chunk = record.job, record.chunk
    job.evidence.add(Mark(chunk.start, chunk.stop, record.worker.place, error, charged))
    if charged:
        farm.stats.charged_attempts += 1
        if farm.observer:
            farm.observer.chunk_failed(record.worker)
    else:
        farm.stats.lost_attempts += 1
    if record.backups:  # backups run it already
        promote_backup(farm, record)
        return
    runs = job.evidence.tally(chunk).runs
    if runs >= farm.config.max_runs:
        give_up(
            farm,
            record,
            f"ran {runs} times without a result, its workers lost or "
            f"failing each time (the images may be fine); last: {error}",
        )
        return
    if not record.retry:
        if not charged:
            farm.stats.requeued_chunks += 1
            if not worker_lost:
                step(farm, job, ChunkFailed(record.worker.id, chunk, True, at=farm.now))
            return
        step(farm, job, ChunkFailed(record.worker.id, chunk, False, at=farm.now))
        job.retry_items += chunk.count
        record.retry = True  # its range belongs to the retry line now
    log.info(
        "job %s: items %d..%d: attempt %d %s (%s)",
        job.id,
        chunk.start,
        chunk.stop - 1,
        record.attempt,
        "failed" if charged else "lost",
        error,
    )
    retry(farm, record, error, charged)


def retry(farm: Farm, record: ChunkRecord, error: str, charged: bool) -> None:
    """Put a range in its job's retry line: as it is, or (suspect) in halves; a single
    image charged by itself on two devices (or ``max_attempts`` times) is given up."""
    job, chunk = record.job, record.chunk
    farm.refill = True
    if not charged:
        farm.stats.requeued_chunks += 1
        job.retries.appendleft(chunk)
        return
    job.retry_failures += 1
    tally = job.evidence.tally(chunk, alone=chunk.count == 1)
    if job.retry_failures > RETRY_LIMIT:
        give_up(
            farm,
            record,
            f"{error} (retries stopped after {RETRY_LIMIT} failed "
            f"attempts: the failures are not confined to a few images)",
        )
    elif not suspect(tally, farm.config.max_attempts):
        farm.stats.requeued_chunks += 1
        job.retries.appendleft(chunk)
    elif chunk.count == 1:
        give_up(
            farm,
            record,
            f"failed by itself {tally.charges} times on {tally.devices} device(s); last: {error}",
        )
    else:
        farm.stats.narrowed_chunks += 1
        log.warning(
            "job %s: items %d..%d failed on %d device(s); narrowing them down",
            job.id,
            chunk.start,
            chunk.stop - 1,
            tally.devices,
        )
        for piece in reversed(halves(chunk)):
            job.retries.appendleft(piece)


def give_up(farm: Farm, record: ChunkRecord, message: str) -> None:
    """Report the record's items failed (FAILED to the client) with ``message``."""
    job, chunk = record.job, record.chunk
    farm.stats.abandoned_chunks += 1
    job.abandoned.append(FailedItems(chunk.start, chunk.count, message))
    log.warning(
        "job %s: items %d..%d given up: %s",
        job.id,
        chunk.start,
        chunk.stop - 1,
        message,
        extra={
            "event": "chunk_abandoned",
            "job": job.id,
            "start": chunk.start,
            "count": chunk.count,
        },
    )
    farm.out.append(
        ev.SendFailed(
            client=job.client,
            job=job.id,
            chunk=record.id,
            start=chunk.start,
            count=chunk.count,
            error=message,
            stimulus=farm.stimulus,
        )
    )
    if record.retry:
        job.retry_items -= chunk.count
    else:
        step(farm, job, ChunkFailed(record.worker.id, chunk, False, at=farm.now))
    finish_if_done(farm, job)
