"""Results workers kept across a lost broker, a lost worker or a vanished client
(``Result.kept``): passed to the job's client, or held (``farm.broker.kept``) until a
resubmission naming the lost job comes; the ranges they cover are done without running
again (``Job.delivered``).
"""

from __future__ import annotations

import logging

from farm.broker import events as ev
from farm.broker.core import Farm
from farm.broker.jobs import Job, Ranges, Worker
from farm.broker.kept import translate
from farm.broker.scheduling import complete_delivered, fill
from farm.policies import Chunk

log = logging.getLogger("farm.broker")


def take_kept(farm: Farm, event: ev.ResultArrived) -> None:
    """A result a worker kept and offers again: of a job this broker runs (the worker
    was counted lost meanwhile), or of one lost with a broker: to its resubmission's
    client if it came, else held until it does (or for a while)."""
    entry = farm.heard_worker(event.worker)
    # only registered workers' are taken (the broker refuses others'), not quarantined ones'
    why = event.problem or ("not from a registered worker" if entry is None else entry.quarantined)
    if entry is None or why:
        log.info("dropped a kept result: %s", why)
        return
    running = farm.running.get(event.job)
    if running is not None:
        take_late(farm, running, event, entry)
        return
    hold_or_pass(farm, event, entry.name)


def keep_vanished(farm: Farm, event: ev.ResultArrived) -> None:
    """A result of a job whose client vanished: its slot frees, and it is kept for a
    client that resumes the job naming it."""
    entry = farm.heard_worker(event.worker)
    record = entry.in_flight.pop(event.chunk, None) if entry else None
    if record is None or record.job.id != event.job:
        farm.stats.late_replies += 1
        return
    if not event.problem:
        hold_or_pass(farm, event, record.worker.name)
    fill(farm, record.worker)


def pass_on_kept(farm: Farm, event: ev.JobSubmitted) -> bool:
    """A resubmission after a lost broker, with results of its earlier submissions held
    here: they go to the client, which submits again what is still missing (True).  The
    job is not made: its items would be computed twice."""
    kept = farm.kept.take(tuple(event.earlier)) if event.earlier else []
    for result in kept:
        entry = farm.workers.get(result.worker)
        forward_kept(farm, event.client, result, entry.name if entry else "")
    if kept:
        farm.out.append(
            ev.SendError(
                peer=event.client,
                job=event.job,
                error=f"{len(kept)} results kept from before the broker restarted were "
                f"passed on: submit what is still missing",
                resubmit=True,
                stimulus=farm.stimulus,
            )
        )
    return bool(kept)


def expire(farm: Farm, now: float) -> None:
    """Drop kept results, and jobs whose client vanished, older than ``kept.seconds``."""
    farm.kept.expire(now)
    vanished = farm.vanished
    while vanished and next(iter(vanished.values())) < now - farm.kept.seconds:
        del vanished[next(iter(vanished))]


def hold_or_pass(farm: Farm, event: ev.ResultArrived, worker: str) -> None:
    """A kept result of a job this state no longer runs: to the job that resubmitted it,
    if one did, else held for one that will."""
    farm.stats.kept_results += 1
    job = farm.jobs.get(farm.aliases.get(event.job, ""))
    if job is None:
        farm.kept.add(event)
    else:
        pass_kept(farm, job, event, worker)


def pass_kept(farm: Farm, job: Job, event: ev.ResultArrived, worker: str) -> None:
    """A kept result of an earlier submission of ``job``: to its client, and the items
    both hold are done in ``job`` when next handed out."""
    runs = job.earlier.get(event.job)
    forward_kept(farm, job.client, event, worker)
    if runs and job.runs:
        for first, stop in translate(runs, job.runs, event.start, event.count):
            job.delivered.add(first, stop)
        settle_delivered(farm, job)


def take_late(farm: Farm, job: Job, event: ev.ResultArrived, entry: Worker) -> None:
    """A kept result of a running job, from a worker counted lost when it was computing
    it (the same CURVE key or connection: ``Job.lost_by``): the client gets it now, and
    the range, wherever its policy holds it, is done when next assigned.  A range
    delivered before is not sent twice."""
    chunk, worker = Chunk(event.start, event.count), entry.name
    if not job.lost_by.get(entry.owner or worker, Ranges()).covers(chunk.start, chunk.stop):
        log.info(
            "dropped a kept result of job %s: %s was not computing items %d..%d when it was lost",
            job.id,
            worker,
            chunk.start,
            chunk.stop - 1,
        )
        return
    if job.delivered.covers(chunk.start, chunk.stop):
        return
    job.output_shape = event.output_shape
    job.delivered.add(chunk.start, chunk.stop)
    farm.stats.kept_results += 1
    forward_kept(farm, job.client, event, worker)
    settle_delivered(farm, job)


def settle_delivered(farm: Farm, job: Job) -> None:
    """The job's attempts in flight whose items kept results delivered are answered now:
    their workers drop them (CANCEL of the attempt) and take other chunks."""
    for entry in list(farm.workers.values()):
        if job.outcome is not None:
            return
        covered = [
            record
            for record in entry.in_flight.values()
            if record.job is job
            and record.check is None
            and job.delivered.covers(record.chunk.start, record.chunk.stop)
        ]
        for record in covered:
            del entry.in_flight[record.id]
            job.pending.pop(record.id, None)
            if record.sent_at is not None:
                farm.out.append(
                    ev.SendCancel(
                        peer=entry.identity, job=job.id, chunk=record.id, stimulus=farm.stimulus
                    )
                )
            complete_delivered(farm, job, record.chunk, entry, record.retry)
        if covered:
            fill(farm, entry)


def forward_kept(farm: Farm, client: bytes, result: ev.ResultArrived, worker: str) -> None:
    farm.stats.kept_delivered += 1
    log.debug(
        "delivered kept items %d..%d of job %s",
        result.start,
        result.start + result.count - 1,
        result.job,
    )
    farm.out.append(
        ev.SendResult(
            client=client,
            result=result,
            worker=worker,
            attempt=1,
            trace=None,
            kept=True,
            stimulus=farm.stimulus,
        )
    )
