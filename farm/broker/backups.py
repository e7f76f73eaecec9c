"""Backup attempts: a second run of a job's last chunks, so that no device idles at its end.

No policy can foresee a device that slows down or stops after its chunk was sized (a
noisy neighbour, throttling, a stopped or swapping process, a worker about to be lost);
then the whole farm waits for its last chunk.  MapReduce's sort took 44% longer without
backup tasks (OSDI 2004).

* **When.**  A worker that holds nothing asks for work, and a job has none left to hand
  out (its policy's pool and its retry line are empty): the workers holding nothing
  may take a *backup* of that job's attempt in flight projected to answer last, its
  range cut among them in proportion to their speeds, if they would finish it sooner
  by at least ``MIN_SAVING`` of their own time.  Idle workers are asked again on every
  tick, as attempts fall behind.
* **Projections.**  An attempt starts when its TASK went out, or when the attempt
  queued before it on its worker is projected to end, and takes its count over its
  worker's speed on the model.  Past that (overdue), or while its worker is silent for
  more than two heartbeats (stopped, cut off), it is assumed at most half done: it
  ends no sooner than ``now + max(elapsed, predicted)``.
* **Stragglers.**  An attempt past ``STRAGGLER_FACTOR`` times its predicted time is a
  straggler: logged, counted (``FarmStats.stragglers``) and shown in ``farm status``;
  it is overdue by then, so it is the first a backup goes to.
* **The first answer wins** (``farm.broker.results``): the other attempt leaves its
  worker's slot and is cancelled (per-attempt CANCEL); its late answer is dropped.  A
  backup piece that answers first wins for all: the first attempt is cancelled, and
  the other pieces carry the rest of its range on as retries.  The job's policy hears
  the first attempt done after the time it took so far, so the straggler's speed drops
  at once.  Backups whose first attempt failed or was lost carry its range on as
  retries (``attempts.promote_backup``); a piece that fails cancels its group, and the
  first attempt runs on.
* **Bounded and uncharged.**  A job's backups run at most ``backup_share`` of its
  images (``--backup-share``, 5% by default); a backup's failure or loss marks nothing
  against its images.  Spot checks (``farm.broker.verify``) run a range a second time
  the same way (``scheduling.run_again``).
* **The tail**: from the first moment a worker holding nothing found a job with
  nothing left to hand out, to the job's end (``Job.tail_from``, in its summary).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from farm.broker.core import Farm
from farm.broker.jobs import ChunkRecord, Job, Worker
from farm.policies import Chunk
from farm.policies.base import DEFAULT_FLOOR, proportional_split

log = logging.getLogger("farm.broker")

#: An attempt past this many times its predicted time is a straggler.  Spark's
#: speculation calls a task slow at 1.5x the median task; our prediction is the worker's
#: own speed, which already tells fast devices from slow, so a wider margin suffices
#: and noise on a shared core (chunk times +-40% here) does not count as straggling.
STRAGGLER_FACTOR = 2.0
#: A backup must be projected to answer sooner than the attempt it backs up by at least
#: this share of its own compute time.
MIN_SAVING = 0.2
#: Heartbeats of silence after which a worker's attempts count as making no progress.
SILENT_HEARTBEATS = 2.0


def nothing_left(job: Job) -> bool:
    """The job has nothing left to hand out, yet is not computed: its last chunks run."""
    return (
        job.proven
        and job.policy is not None
        and job.policy.remaining == 0
        and not job.retries
        and not job.computed
    )


def note_idle(farm: Farm, job: Job, entry: Worker) -> None:
    """``entry`` holds nothing and ``job`` has nothing left for it: its tail begins, if it
    had not."""
    if job.tail_from is None and not entry.in_flight:
        job.tail_from = farm.now


def rate_of(entry: Worker, model: str) -> float:
    """The worker's speed on the model in images/s; 0 if it has none."""
    history = entry.history.get(model)
    return history.rate if history is not None else 0.0


def projections(
    farm: Farm, entry: Worker, model: str
) -> Iterator[tuple[ChunkRecord, float, float]]:
    """``(attempt, start, predicted end)`` for the worker's attempts sent, in the order it
    computes them, each starting when it was sent or the one before it ends."""
    rate = rate_of(entry, model) or farm.fastest.get(model, (0.0, ""))[0]
    if rate <= 0:
        return
    free = 0.0
    for record in sorted(entry.in_flight.values(), key=lambda r: r.sent_seq):
        if record.sent_at is None or record.job.model != model:
            continue
        start = max(record.sent_at, free)
        free = start + record.chunk.count / rate
        yield record, start, free


def projected_end(farm: Farm, entry: Worker, start: float, end: float) -> float:
    """When an attempt predicted to run ``start..end`` will answer: ``end``, unless it is
    overdue or its worker silent; then no sooner than ``now + max(elapsed, predicted)``."""
    silent = farm.now - entry.last_seen > SILENT_HEARTBEATS * entry.heartbeat
    if farm.now <= end and not silent:
        return end
    return farm.now + max(farm.now - start, end - start)


def last_attempt(farm: Farm, job: Job) -> tuple[ChunkRecord, float] | None:
    """The job's attempt projected to answer last that may be backed up (a first run, no
    backup yet), with its projection; None if none."""
    latest: tuple[ChunkRecord, float] | None = None
    for holder in job.eligible.values():
        if holder.identity not in farm.workers:
            continue
        for record, start, end in projections(farm, holder, job.model):
            if record.job is not job or record.extra or record.backups:
                continue
            projected = projected_end(farm, holder, start, end)
            if latest is None or projected > latest[1]:
                latest = record, projected
    return latest


@dataclass(frozen=True)
class Plan:
    """A backup of ``original``, projected to answer at ``projected``: its range cut into
    ``pieces``, one per idle worker, in proportion to their speeds."""

    original: ChunkRecord
    projected: float
    pieces: list[tuple[Worker, Chunk]]


def plan(farm: Farm, job: Job, idle: list[Worker]) -> Plan | None:
    """A backup for the ``idle`` workers (those holding nothing) of the job's attempt
    projected to answer last; None if nothing is projected later than they would finish
    it, by ``MIN_SAVING`` of their time, or the job's backups would pass ``backup_share``
    of its images.  Pieces are at least ``DEFAULT_FLOOR`` images."""
    latest = last_attempt(farm, job)
    rates = {entry.id: rate_of(entry, job.model) for entry in idle}
    rates = {worker: rate for worker, rate in rates.items() if rate > 0}
    if latest is None or not rates:
        return None
    original, projected = latest
    chunk = original.chunk
    if chunk.count > farm.config.backup_share * job.total - job.backup_items:
        return None
    shares = proportional_split(chunk.count, rates, min(DEFAULT_FLOOR, chunk.count))
    if farm.now + max(n / rates[w] for w, n in shares.items()) * (1 + MIN_SAVING) > projected:
        return None
    by_id = {entry.id: entry for entry in idle}
    pieces, start = [], chunk.start
    for worker, count in shares.items():
        pieces.append((by_id[worker], Chunk(start, count)))
        start += count
    return Plan(original, projected, pieces)


def started(farm: Farm, backup: Plan) -> None:
    """Count a backup just started."""
    original = backup.original
    job, chunk = original.job, original.chunk
    job.backups += 1
    job.backup_items += chunk.count
    farm.stats.backup_attempts += 1
    log.info(
        "job %s: backup of items %d..%d on %s (first attempt on %s, projected to answer in %.2f s)",
        job.id,
        chunk.start,
        chunk.stop - 1,
        ", ".join(entry.name for entry, _ in backup.pieces),
        original.worker.name,
        backup.projected - farm.now,
        extra={"event": "backup_started", "job": job.id, "worker": original.worker.name},
    )


def won(farm: Farm, backup: ChunkRecord) -> None:
    """Count a backup that answered before the attempt it backed up."""
    job = backup.job
    job.backup_wins += 1
    job.backup_saved += max(0.0, backup.projected - farm.now)
    farm.stats.backup_wins += 1


def flag_stragglers(farm: Farm) -> None:
    """Mark each worker's attempt in progress once it is past ``STRAGGLER_FACTOR`` times
    its predicted time."""
    for entry in farm.workers.values():
        sent = [record for record in entry.in_flight.values() if record.sent_at is not None]
        if not sent:
            continue
        record = min(sent, key=lambda r: r.sent_seq)
        if record.straggler or record.extra:
            continue
        for first, start, end in projections(farm, entry, record.job.model):
            if first is record and farm.now - start > STRAGGLER_FACTOR * (end - start):
                record.straggler = True
                farm.stats.stragglers += 1
                log.info(
                    "job %s: items %d..%d on %s straggle: %.2f s so far, predicted %.2f s",
                    record.job.id,
                    record.chunk.start,
                    record.chunk.stop - 1,
                    entry.name,
                    farm.now - start,
                    end - start,
                    extra={"event": "straggler", "job": record.job.id, "worker": entry.name},
                )
            break


__all__ = [
    "MIN_SAVING",
    "STRAGGLER_FACTOR",
    "Plan",
    "plan",
    "flag_stragglers",
    "note_idle",
    "nothing_left",
    "started",
    "won",
]
