"""Free slots offered to the jobs; what their policies assign becomes attempts; jobs end.

These call each other in a loop (a slot offered steps a policy, a policy that fails ends
its job, a job that ends frees slots to offer), so they share this module; the modules
beside it call in here.

* Every free slot is offered to the running jobs in order (``SlotOrder``): highest
  priority first, then (``sharing="fair"``) the job holding the fewest chunks, then the
  oldest; the job's retry line first, then its policy, decides whether to take it.
* A chunk assigned takes its worker's slot at once, as a new attempt with its own id; its
  input is asked for (``farm.broker.inputs``).  A range a kept result delivered is done
  at once instead.
"""

from __future__ import annotations

import logging

from farm.broker import backups
from farm.broker import events as ev
from farm.broker.blame import retry_index
from farm.broker.caps import cap_all
from farm.broker.checks import Check
from farm.broker.core import Farm
from farm.broker.inputs import request_input
from farm.broker.jobs import ChunkRecord, Job, Worker
from farm.policies import Assign, Chunk, ChunkDone, ChunkFailed, Event, WorkerBusy, WorkerReady

log = logging.getLogger("farm.broker")


# ------------------------------------------------------------------------------ slots


def fill(farm: Farm, entry: Worker) -> None:
    """Offer all of one worker's free slots to the jobs."""
    while entry.free_slots > 0 and offer_slot(farm, entry):
        pass


def fill_all(farm: Farm) -> None:
    """Offer free slots breadth-first: every worker's first slot before anyone's second."""
    if not farm.running:
        return
    progress = True
    while progress:
        progress = False
        for entry in list(farm.workers.values()):
            if entry.free_slots > 0 and offer_slot(farm, entry):
                progress = True


def offer_slot(farm: Farm, entry: Worker) -> bool:
    """Offer one slot to the jobs in their order; True if one took it."""
    if entry.identity not in farm.workers or entry.quarantined is not None:
        return False
    before, done_before = len(entry.in_flight), farm.stats.kept_used
    for job in list(farm.order.jobs):
        if not job.proven:  # its client has not answered yet (``farm.broker.inputs``)
            continue
        job.eligible[entry.id] = entry
        if job.retries and run_retry(farm, job, entry):
            return True
        if job.checks is not None and job.checks.waiting and run_check(farm, job, entry):
            return True
        step(farm, job, WorkerReady(entry.id, at=farm.now))
        if len(entry.in_flight) > before or farm.stats.kept_used > done_before:
            return True  # a chunk, or a range a kept result had done: offer the slot again
        entry.offered.add(job.id)  # its policy keeps the worker as idle
    return not entry.in_flight and run_backup_for(farm, entry)


def slots_taken(farm: Farm, entry: Worker, taker: Job | None) -> None:
    """The worker's last free slot went to ``taker`` (None: a range from a retry line,
    which no policy knows of): other jobs' policies that counted it as idle (jobs it was
    offered to and declined) hear it is busy."""
    offered, entry.offered = entry.offered, set()
    for job_id in sorted(offered, key=lambda j: farm.running[j].seq if j in farm.running else -1):
        job = farm.running.get(job_id)
        if (
            job is not None
            and job is not taker
            and job.policy is not None
            and entry.id in job.policy.idle
        ):
            step(farm, job, WorkerBusy(entry.id, at=farm.now))


def run_retry(farm: Farm, job: Job, entry: Worker) -> bool:
    """Give the worker's free slot to the first range in the job's retry line that it may
    run (``blame.retry_index``).  The job's policy, which does not know of it, hears the
    worker is busy if it thought it idle.  False if the worker may run none."""
    index = retry_index(job.retries, job.evidence, entry.place, farm.places)
    if index is None:
        return False
    chunk = job.retries[index]
    del job.retries[index]
    assign(farm, job, chunk, entry, retry=True)
    if entry.free_slots <= 0:
        slots_taken(farm, entry, None)
    return True


def run_check(farm: Farm, job: Job, entry: Worker) -> bool:
    """Give the worker's free slot to a waiting spot check of the job it may run (one on a
    device none of its answers came from: ``farm.broker.verify``); False if none."""
    assert job.checks is not None
    check = next((c for c in job.checks.waiting if entry.place not in c.places), None)
    if check is None:
        return False
    job.checks.waiting.remove(check)
    job.checks.running += 1
    run_again(farm, job, check.chunk, entry, check=check)
    return True


def run_backup_for(farm: Farm, entry: Worker) -> bool:
    """Give the idle worker's slot, and other idle workers' with it, to a backup of the
    last chunk of a job with nothing left to hand out (``farm.broker.backups``), in the
    jobs' order; False if none."""
    for job in list(farm.order.jobs):
        if not backups.nothing_left(job):
            continue
        backups.note_idle(farm, job, entry)
        if job.no_backup_at == farm.stimulus:  # planned for every idle worker already
            continue
        idle = [entry] + [
            other
            for other in farm.workers.values()
            if other is not entry and not other.in_flight and other.quarantined is None
        ]
        backup = backups.plan(farm, job, idle)
        if backup is not None:
            for worker, piece in backup.pieces:
                record = run_again(farm, job, piece, worker, backup_of=backup.original)
                record.projected = backup.projected
                backup.original.backups.append(record)
            backups.started(farm, backup)
            return True
        job.no_backup_at = farm.stimulus
    return False


def offer_idle(farm: Farm) -> None:
    """On every tick: idle workers' slots are offered to the jobs again, as time passes (a
    policy's plan may change once an attempt is overdue; a worker all jobs decline may
    take a backup of an attempt fallen behind: ``offer_slot``)."""
    if not farm.running:
        return
    if any(backups.nothing_left(job) for job in farm.running.values()):
        backups.flag_stragglers(farm)
    for entry in [e for e in farm.workers.values() if not e.in_flight and e.quarantined is None]:
        fill(farm, entry)


def run_again(
    farm: Farm,
    job: Job,
    chunk: Chunk,
    entry: Worker,
    check: Check | None = None,
    backup_of: ChunkRecord | None = None,
) -> ChunkRecord:
    """A second run of a range outside the job's policy, uncharged: a spot check or a
    backup attempt.  It takes the worker's slot and asks for its input."""
    record = start_attempt(farm, job, chunk, entry)
    record.check, record.backup_of = check, backup_of
    request_input(farm, record)
    if entry.free_slots <= 0:
        slots_taken(farm, entry, None)
    return record


def cancel_attempt(farm: Farm, record: ChunkRecord) -> None:
    """Take an attempt out of its worker's slot: the other run of its range answered.  A
    worker computing it is told to drop it; its answer, if one comes, is dropped."""
    entry = record.worker
    if entry.in_flight.pop(record.id, None) is None:
        return
    record.job.pending.pop(record.id, None)
    if record.sent_at is not None:
        farm.out.append(
            ev.SendCancel(
                peer=entry.identity, job=record.job.id, chunk=record.id, stimulus=farm.stimulus
            )
        )
    farm.refill = True  # its slot is free


def drop_unrunnable_checks(farm: Farm, job: Job) -> None:
    """Spot checks waiting that no connected, trusted worker may run: dropped, and
    counted (the job would wait for them for ever)."""
    checks = job.checks
    if checks is None or not checks.waiting:
        return
    places = {e.place for e in farm.workers.values() if e.quarantined is None}
    runnable = [c for c in checks.waiting if places - c.places]
    checks.dropped += sum(c.chunk.count for c in checks.waiting if c not in runnable)
    checks.waiting = runnable


# --------------------------------------------------------------------------- policies


def step(farm: Farm, job: Job, event: Event) -> None:
    """Feed one event to the job's policy and carry out its assignments.  A policy that
    raises (on parameters a client chose, say) fails its own job, not the farm."""
    if job.outcome is not None or job.policy is None:
        return
    try:
        assignments = job.policy.handle(event)
        farm.order.moved(job)  # it holds more, or fewer
    except Exception as exc:
        log.exception("job %s: policy %s failed on %s", job.id, job.algo, event)
        fail_job(farm, job, f"policy {job.algo} failed: {type(exc).__name__}: {exc}")
        return
    dispatch(farm, job, assignments)


def dispatch(farm: Farm, job: Job, assignments: list[Assign]) -> None:
    """Carry out a policy's assignments: each takes a slot now and asks the client for
    its input; the TASK goes out when the DATA comes back."""
    for assignment in assignments:
        entry = farm.by_id.get(assignment.worker)
        if entry is None or not job.proven:  # the worker is being lost, and the policy
            # hears of it next, or the job is parked: take the chunk back and the worker
            # out of its idle ones (a WorkerLost now would return the worker's other
            # chunks while they are being settled)
            step(farm, job, WorkerBusy(assignment.worker, at=farm.now))
            step(farm, job, ChunkFailed(assignment.worker, assignment.chunk, True, at=farm.now))
            continue
        assign(farm, job, assignment.chunk, entry)
        if entry.free_slots <= 0 and len(farm.running) > 1:
            slots_taken(farm, entry, job)


# --------------------------------------------------------------------------- attempts


def assign(farm: Farm, job: Job, chunk: Chunk, entry: Worker, retry: bool = False) -> None:
    """A new attempt: it takes the worker's slot now and asks for its input.  A range a
    kept result delivered is done at once instead."""
    if job.delivered and job.delivered.covers(chunk.start, chunk.stop):
        complete_delivered(farm, job, chunk, entry, retry)
        return
    request_input(farm, start_attempt(farm, job, chunk, entry, retry))


def start_attempt(
    farm: Farm, job: Job, chunk: Chunk, entry: Worker, retry: bool = False
) -> ChunkRecord:
    """The attempt's record, with the next id, in the worker's slot."""
    record = ChunkRecord(
        farm.next_chunk_id,
        job,
        chunk,
        entry,
        job.attempt_of(chunk),
        assigned_at=farm.now,
        retry=retry,
    )
    farm.next_chunk_id += 1
    entry.in_flight[record.id] = record
    if job.started_at is None:
        job.started_at = farm.now
    return record


def complete_delivered(farm: Farm, job: Job, chunk: Chunk, entry: Worker, retry: bool) -> None:
    """A range kept results delivered, handed out again: done now, in no worker's
    share; the policy hears it done at ``entry``'s own speed (it learns nothing)."""
    farm.stats.kept_used += 1
    job.kept_items += chunk.count
    rate = entry.history[job.model].rate if job.model in entry.history else 0.0
    rate = rate or farm.fastest.get(job.model, (0.0, ""))[0]
    compute = chunk.count / rate if rate > 0 else 0.0
    job.evidence.settle(chunk)
    if job.started_at is None:
        job.started_at = farm.now
    if retry:
        job.retry_items -= chunk.count
    else:
        step(farm, job, ChunkDone(entry.id, chunk, compute, at=farm.now))
    finish_if_done(farm, job)


# ------------------------------------------------------------------------------- ends


def finish_if_done(farm: Farm, job: Job) -> None:
    if job.outcome is None and job.computed:
        drop_unrunnable_checks(farm, job)
    if job.outcome is None and job.finished:
        summary = job.summary(farm.now)
        end_job(farm, job, "done")
        log.info(
            "job %s done: %d items in %.3f s",
            job.id,
            job.total,
            summary.broker_seconds,
            extra={
                "event": "job_ended",
                "job": job.id,
                "outcome": "done",
                "seconds": summary.broker_seconds,
            },
        )
        farm.out.append(
            ev.SendDone(client=job.client, job=job.id, summary=summary, stimulus=farm.stimulus)
        )


def fail_job(farm: Farm, job: Job, error: str) -> None:
    """Tell the client why its job failed; free the slots its chunks held."""
    log.warning(
        "job %s failed: %s",
        job.id,
        error,
        extra={"event": "job_ended", "job": job.id, "outcome": "failed"},
    )
    farm.out.append(ev.SendError(peer=job.client, error=error, job=job.id, stimulus=farm.stimulus))
    end_job(farm, job, "failed")


def cancel_job(farm: Farm, job: Job, outcome: str, reason: str) -> None:
    """Stop a job and tell its client why, with what finished."""
    log.info(
        "job %s %s: %s",
        job.id,
        outcome.replace("_", " "),
        reason,
        extra={"event": "job_ended", "job": job.id, "outcome": outcome},
    )
    summary = job.summary(farm.now)
    end_job(farm, job, outcome)
    farm.out.append(
        ev.SendCancel(
            peer=job.client, job=job.id, reason=reason, summary=summary, stimulus=farm.stimulus
        )
    )


def end_job(farm: Farm, job: Job, outcome: str) -> None:
    """Forget a job.  Chunks still waiting for input are dropped; workers running its
    chunks are told to stop, and their slots free when they answer."""
    farm.jobs.pop(job.id, None)
    for earlier in job.earlier:
        farm.aliases.pop(earlier, None)
    if farm.running.pop(job.id, None) is not None:
        farm.order.unplace(job)
    job.outcome = outcome
    farm.outcomes[outcome] += 1
    job.pending.clear()
    job.retries.clear()
    stop_attempts(farm, job, cancel=outcome not in ("done", "expired"))
    if outcome == "expired":  # what its workers are computing is kept for a resumption
        farm.vanished[job.id] = farm.now
    cap_all(farm)  # one job fewer: longer chunks may do
    fill_all(farm)


def stop_attempts(farm: Farm, job: Job, cancel: bool) -> None:
    """Free the slots of the ended job's attempts still waiting for input; ``cancel``:
    tell the workers computing its chunks to drop them."""
    for entry in farm.workers.values():
        records = [r for r in entry.in_flight.values() if r.job is job]
        for record in records:
            if record.sent_at is None:
                del entry.in_flight[record.id]
        if cancel and any(r.sent_at is not None for r in records):
            farm.out.append(ev.SendCancel(peer=entry.identity, job=job.id, stimulus=farm.stimulus))
