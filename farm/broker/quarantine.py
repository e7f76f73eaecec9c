"""Answers the broker refuses, and workers it stops trusting.

A RESULT that fails the wire's checks (``farm.broker.wire.answer_problem``: the wrong
items, shape, dtype or row count; times that are not times; non-finite outputs of images
that did not fail; probabilities outside 0..1) is *refused*: that attempt fails on that
worker alone.  Its items are not charged (the answer says nothing about them), and the
range runs again on another device through the job's retry line (``farm.broker.blame``).

Each refused answer is a *strike* against its worker: at once for its form, and for its
values only once another device answered the same items well (a net may overflow on an
image anywhere; then every device fails it, and the images are given up after
``max_runs``, blaming no worker).  ``QUARANTINE_STRIKES`` strikes quarantine a worker:
it keeps its connection but gets no more tasks, its chunks in flight run elsewhere, and
``farm status``, the metrics and the summaries of the jobs it served say why.  The
quarantine holds for the worker's process (its name, host:pid/device, registering again
keeps it); a restarted process, or a restarted broker, starts afresh.
"""

from __future__ import annotations

import logging

from farm.broker import caps
from farm.broker import events as ev
from farm.broker.attempts import give_up, promote_backup, worker_lost
from farm.broker.blame import Mark
from farm.broker.core import Farm
from farm.broker.jobs import ChunkRecord, Worker
from farm.broker.scheduling import fill, fill_all, step
from farm.policies import ChunkFailed, WorkerLost

log = logging.getLogger("farm.broker")

#: Refused answers that quarantine a worker.  BOINC trusts a host after 10 valid results
#: in a row; one bad answer in three chunks is no flaky link but a wrong engine, and
#: three keep a worker that overflowed on one odd image in service.
QUARANTINE_STRIKES = 3


def answer_refused(farm: Farm, record: ChunkRecord, event: ev.ResultArrived) -> None:
    """The attempt's answer failed the checks: a strike (now, or on settling for its
    values), and its range runs again on another device, its items uncharged."""
    job, chunk, entry = record.job, record.chunk, record.worker
    problem = event.problem or "refused"
    farm.stats.bad_answers += 1
    job.bad_answers += 1
    log.warning(
        "job %s: worker %s answered items %d..%d badly (%s): running them elsewhere",
        job.id,
        entry.name,
        chunk.start,
        chunk.stop - 1,
        problem,
        extra={"event": "answer_refused", "job": job.id, "worker": entry.name},
    )
    error = f"{entry.name} answered badly: {problem}"
    mark = Mark(chunk.start, chunk.stop, entry.place, error, False, entry.id, event.in_values)
    job.evidence.add(mark)
    runs = job.evidence.tally(chunk).runs
    if record.backups:  # backups run it already
        promote_backup(farm, record)
    elif runs >= farm.config.max_runs:
        give_up(
            farm,
            record,
            f"ran {runs} times without an answer that passed the checks; last: {error}",
        )
    else:
        if not record.retry:
            step(farm, job, ChunkFailed(entry.id, chunk, False, at=farm.now))
            job.retry_items += chunk.count
        farm.stats.requeued_chunks += 1
        farm.refill = True
        job.retries.appendleft(chunk)
    if not event.in_values:
        strike(farm, entry, problem)
    fill(farm, entry)


def blame_settled(farm: Farm, marks: list[Mark]) -> None:
    """Refused answers of items another device has now answered well: their workers'
    strikes."""
    for mark in marks:
        entry = farm.by_id.get(mark.refused)
        if entry is not None:
            strike(farm, entry, mark.error)


def strike(farm: Farm, entry: Worker, problem: str) -> None:
    """One more refused answer against ``entry``; quarantined at ``QUARANTINE_STRIKES``."""
    entry.strikes += 1
    if entry.strikes >= QUARANTINE_STRIKES and entry.quarantined is None:
        quarantine(farm, entry, f"{entry.strikes} answers failed the checks; last: {problem}")


def quarantine(farm: Farm, entry: Worker, reason: str) -> None:
    """No more tasks for ``entry``; what it holds runs elsewhere, uncharged."""
    entry.quarantined = farm.quarantined[entry.name] = reason
    if entry.owner:  # registering again under another name does not clear it
        farm.quarantined[entry.owner] = reason
    farm.stats.quarantined_workers += 1
    log.warning(
        "worker %s quarantined: %s; it gets no more tasks (restart its process to clear it)",
        entry.name,
        reason,
        extra={"event": "worker_quarantined", "worker": entry.name, "reason": reason},
    )
    farm.places[entry.place] -= 1  # no retry waits for it as "another device"
    if not farm.places[entry.place]:
        del farm.places[entry.place]
    caps.worker_lost(farm, entry)
    records = list(entry.in_flight.values())
    entry.in_flight.clear()
    for record in records:
        if record.sent_at is not None:
            farm.out.append(
                ev.SendCancel(
                    peer=entry.identity, job=record.job.id, chunk=record.id, stimulus=farm.stimulus
                )
            )
    worker_lost(farm, entry, records, reason, crashed=False)
    for job in list(farm.running.values()):
        if entry.id in job.eligible:
            job.quarantined[entry.name] = reason
        step(farm, job, WorkerLost(entry.id, at=farm.now))
    fill_all(farm)


__all__ = ["QUARANTINE_STRIKES", "answer_refused", "blame_settled", "quarantine", "strike"]
