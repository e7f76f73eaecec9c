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
* **Projections, by each attempt's own pace** (as LATE does, Zaharia et al., OSDI
  2008).  The attempt a worker computes is projected from its progress: the images its
  heartbeats' running counters (counted batch by batch) show since it began, at the
  pace they show.  Without counters, it takes its count over the worker's speed on the
  model, and once past that counts as at most half done.  A worker silent for two
  heartbeats (stopped, cut off) makes no progress: its attempt ends no sooner than
  ``now + max(elapsed, predicted)``.  An attempt queued behind another starts when
  that one is projected to end.
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
* **Bounded and uncharged.**  A job's backups may cost at most ``backup_share`` of its
  images in extra work (``--backup-share``, 5% by default): the images the first
  attempts are projected to have computed when their backups end, which a winning
  backup computes twice.  A backup's failure or loss marks nothing against its images.
  Spot checks (``farm.broker.verify``) run a range a second time the same way
  (``scheduling.run_again``).
* **The tail**: from the first moment a worker holding nothing found a job with
  nothing left to hand out, to the job's end (``Job.tail_from``, in its summary).
"""

from __future__ import annotations

import itertools
import logging
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


def progress(entry: Worker, since: float, now: float, pace: float) -> float:
    """Images the worker computed from ``since`` to ``now``, by its heartbeats' running
    counters (counted batch by batch), the last one carried on to ``now`` at ``pace``;
    0 without a heartbeat since."""
    samples = entry.samples
    if len(samples) < 2 or samples[-1][0] <= since:
        return 0.0
    before: float = samples[0][1]
    for (t0, i0, _), (t1, i1, _) in itertools.pairwise(samples):
        if t1 >= since:
            before = i0 + (i1 - i0) * max(0.0, since - t0) / (t1 - t0) if t1 > t0 else i1
            break
    last_at, last_images, _ = samples[-1]
    return max(0.0, last_images - before + pace * max(0.0, now - last_at))


@dataclass(frozen=True)
class Projection:
    """An attempt in flight as the broker projects it: it ``start``-s (started, or will,
    after the attempts before it on its worker), would end at ``predicted`` at its
    worker's speed on the model, and is projected to answer at ``end``; ``done`` of its
    images are computed, at ``rate`` images/s (0: not progressing)."""

    record: ChunkRecord
    start: float
    predicted: float
    end: float
    done: float
    rate: float

    def done_by(self, when: float, now: float) -> float:
        """Its images computed by ``when`` (from ``now`` on)."""
        running = max(0.0, when - max(now, self.start))
        return min(float(self.record.chunk.count), self.done + self.rate * running)


def projections(farm: Farm, entry: Worker) -> list[Projection]:
    """The worker's attempts sent, in the order it computes them.  The first is
    projected by its progress: what its heartbeats counted since it began, at the pace
    they show; without counters, by its speed on the model, and once past that as at
    most half done.  A silent worker (stopped, cut off) makes no progress: its attempt
    ends no sooner than ``now + max(elapsed, predicted)``.  Each later one starts when
    the one before it is projected to end."""
    now = farm.now
    silent = now - entry.last_seen > SILENT_HEARTBEATS * entry.heartbeat
    recent = 0.0 if silent else entry.recent_load()[0]
    found: list[Projection] = []
    free = max(entry.last_answer_at, entry.joined_at)
    for record in sorted(entry.in_flight.values(), key=lambda r: r.sent_seq):
        speed = rate_of(entry, record.job.model) or farm.fastest.get(record.job.model, (0.0,))[0]
        if record.sent_at is None or speed <= 0:
            continue
        count = record.chunk.count
        start = max(record.sent_at, free)
        predicted = start + count / speed
        done, rate = 0.0, recent or speed
        if silent:
            end, rate = now + max(now - start, predicted - start), 0.0
        elif found:  # queued behind another
            end = start + count / rate
        elif recent > 0:
            done = min(float(count), progress(entry, start, now, recent))
            end = now + (count - done) / recent
        else:
            end = predicted if now <= predicted else now + (now - start)
        found.append(Projection(record, start, predicted, max(end, now), done, rate))
        free = max(end, now)
    return found


def last_attempt(farm: Farm, job: Job) -> Projection | None:
    """The job's attempt projected to answer last that may be backed up (a first run, no
    backup yet); None if none."""
    latest: Projection | None = None
    for holder in job.eligible.values():
        if holder.identity not in farm.workers:
            continue
        for projection in projections(farm, holder):
            record = projection.record
            if record.job is not job or record.extra or record.backups:
                continue
            if latest is None or projection.end > latest.end:
                latest = projection
    return latest


@dataclass(frozen=True)
class Plan:
    """A backup of ``original``, projected to answer at ``projected``: its range cut into
    ``pieces``, one per idle worker, in proportion to their speeds.  ``extra``: the
    images the first attempt is expected to have computed by the time the pieces end
    (computed twice if the backup wins)."""

    original: ChunkRecord
    projected: float
    pieces: list[tuple[Worker, Chunk]]
    extra: float


def plan(farm: Farm, job: Job, idle: list[Worker]) -> Plan | None:
    """A backup for the ``idle`` workers (those holding nothing) of the job's attempt
    projected to answer last; None if nothing is projected later than they would finish
    it, by ``MIN_SAVING`` of their time, or the job's backups would pass ``backup_share``
    of its images in extra work (what the first attempts had computed).  Pieces are at
    least ``DEFAULT_FLOOR`` images."""
    if farm.config.backup_share <= 0:
        return None
    latest = last_attempt(farm, job)
    rates = {entry.id: rate_of(entry, job.model) for entry in idle}
    rates = {worker: rate for worker, rate in rates.items() if rate > 0}
    if latest is None or not rates:
        return None
    chunk = latest.record.chunk
    shares = proportional_split(chunk.count, rates, min(DEFAULT_FLOOR, chunk.count))
    own = max(n / rates[w] for w, n in shares.items())
    if farm.now + own * (1 + MIN_SAVING) > latest.end:
        return None
    extra = latest.done_by(farm.now + own, farm.now)
    if job.backup_extra + extra > farm.config.backup_share * job.total:
        return None
    by_id = {entry.id: entry for entry in idle}
    pieces, start = [], chunk.start
    for worker, count in shares.items():
        pieces.append((by_id[worker], Chunk(start, count)))
        start += count
    return Plan(latest.record, latest.end, pieces, extra)


def started(farm: Farm, backup: Plan) -> None:
    """Count a backup just started."""
    original = backup.original
    job, chunk = original.job, original.chunk
    job.backups += 1
    job.backup_items += chunk.count
    job.backup_extra += backup.extra
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
    its predicted time (at the worker's speed on the model)."""
    for entry in farm.workers.values():
        found = projections(farm, entry) if entry.in_flight else []
        if not found:
            continue
        first = found[0]
        record = first.record
        late = farm.now - first.start > STRAGGLER_FACTOR * (first.predicted - first.start)
        if late and not record.straggler and not record.extra:
            record.straggler = True
            farm.stats.stragglers += 1
            log.info(
                "job %s: items %d..%d on %s straggle: %.2f s so far, predicted %.2f s",
                record.job.id,
                record.chunk.start,
                record.chunk.stop - 1,
                entry.name,
                farm.now - first.start,
                first.predicted - first.start,
                extra={"event": "straggler", "job": record.job.id, "worker": entry.name},
            )


__all__ = [
    "MIN_SAVING",
    "STRAGGLER_FACTOR",
    "Plan",
    "Projection",
    "plan",
    "flag_stragglers",
    "note_idle",
    "nothing_left",
    "started",
    "won",
]
