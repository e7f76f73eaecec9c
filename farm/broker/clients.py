"""What a job's client sends after its SUBMIT (DATA, CANCEL, heartbeats), and its leaving
or falling silent.

A job whose client vanished ends, but its chunks in flight finish: their results are
held for a client resuming it (``farm.broker.keeping``).
"""

from __future__ import annotations

import logging

from farm.broker import events as ev
from farm.broker.attempts import lost_check
from farm.broker.core import Farm
from farm.broker.inputs import PARK_SECONDS, awaited_data, need_deadline, probe, send_task
from farm.broker.jobs import Job
from farm.broker.scheduling import cancel_job, end_job, fail_job, fill_all, step
from farm.policies import ChunkFailed

log = logging.getLogger("farm.broker")


def on_data_arrived(farm: Farm, event: ev.DataArrived) -> None:
    """A chunk's input from its client: forward it to the chunk's worker as the TASK."""
    record = awaited_data(farm, event)
    if record is None:
        return  # its job ended, or its worker was lost meanwhile and the chunk requeued
    if event.problem is not None:
        fail_job(farm, record.job, event.problem)
        return
    send_task(farm, record, event.payload)


def on_job_cancelled(farm: Farm, event: ev.JobCancelled) -> None:
    """A client stops its job."""
    job = client_job(farm, event.client, event.job)
    if job is not None:
        cancel_job(farm, job, "cancelled", "cancelled by the client")


def on_client_heard(farm: Farm, event: ev.ClientHeard) -> None:
    job = client_job(farm, event.client, event.job)
    if job is not None:
        job.client_seen = event.at


def on_client_left(farm: Farm, event: ev.ClientLeft) -> None:
    """A client's connection closed: nobody takes its jobs' results any more."""
    for job in [job for job in farm.jobs.values() if job.client == event.client]:
        expire_job(farm, job, "its client's connection closed")


def expire_silent(farm: Farm, now: float) -> None:
    """End the jobs whose client went silent, and cancel those past their timeout."""
    for job in list(farm.jobs.values()):
        silent = now - job.client_seen
        if silent > job.client_expiry:
            expire_job(farm, job, f"its client was silent for {silent:.1f} s")
        elif job.deadline is not None and now > job.deadline:
            cancel_job(
                farm, job, "timed_out", f"the job's timeout of {job.options.timeout:g} s passed"
            )


def overdue_needs(farm: Farm, now: float) -> None:
    """Park the running jobs whose oldest unanswered NEED is past its deadline, and probe
    again those parked long enough (``farm.broker.inputs``)."""
    parked = False
    for job in list(farm.running.values()):
        if job.parked_until is not None and now >= job.parked_until:
            job.parked_until = None
            probe(farm, job)
        oldest = next(iter(job.pending.values()), None)
        if oldest is not None and now - oldest.assigned_at > need_deadline(job):
            park(farm, job, now)
            parked = True
    if parked:
        fill_all(farm)


def park(farm: Farm, job: Job, now: float) -> None:
    """No slots for the job until its client answers a probe; the chunks whose input it
    left unanswered go back to the job, uncharged."""
    waited = now - next(iter(job.pending.values())).assigned_at
    job.proven = False
    job.parks += 1
    job.parked_until = now + min(PARK_SECONDS[1], PARK_SECONDS[0] * 2.0 ** (job.parks - 1))
    farm.stats.parked_jobs += 1
    log.warning(
        "job %s parked: its client left a NEED unanswered for %.1f s; its slots go to "
        "other jobs, and it is asked again in %.0f s",
        job.id,
        waited,
        job.parked_until - now,
        extra={"event": "job_parked", "job": job.id},
    )
    records, job.pending = list(job.pending.values()), {}
    for record in records:
        del record.worker.in_flight[record.id]
        if record.check is not None:
            lost_check(farm, record)
        elif record.retry:
            job.retries.appendleft(record.chunk)
        else:
            step(farm, job, ChunkFailed(record.worker.id, record.chunk, True, at=farm.now))


def expire_job(farm: Farm, job: Job, why: str) -> None:
    farm.stats.jobs_expired += 1
    log.warning(
        "job %s dropped: %s",
        job.id,
        why,
        extra={"event": "job_ended", "job": job.id, "outcome": "expired"},
    )
    end_job(farm, job, "expired")


def client_job(farm: Farm, client: bytes, job_id: str) -> Job | None:
    """The client's job, or None after telling the client the farm has no such job."""
    job = farm.jobs.get(job_id)
    if job is None or job.client != client:
        farm.out.append(
            ev.SendError(
                peer=client,
                error=f"the broker has no job {job_id[:100]}",
                job=job_id[:100],
                unknown_job=True,
                stimulus=farm.stimulus,
            )
        )
        return None
    return job
