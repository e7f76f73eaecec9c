"""A SUBMIT: refused, answered with results kept for it, or made a job, checked against
its model and given its policy."""

from __future__ import annotations

import logging
import math

from farm.broker import events as ev
from farm.broker.caps import cap_all
from farm.broker.checks import checks_of
from farm.broker.core import Farm
from farm.broker.inputs import probe
from farm.broker.jobs import Job
from farm.broker.keeping import pass_on_kept
from farm.broker.scheduling import fail_job, fill_all
from farm.policies import make_policy
from farm.wire.shapes import ENCODED, input_mismatch

log = logging.getLogger("farm.broker")

#: Most jobs the farm holds at once.
MAX_JOBS = 1000
#: Most jobs one client (a CURVE key, else a connection) holds at once.
MAX_CLIENT_JOBS = 32


def on_job_submitted(farm: Farm, event: ev.JobSubmitted) -> None:
    refused = refusal(farm, event)
    if refused:
        farm.stats.bad_messages += 1
        farm.out.append(
            ev.SendError(
                peer=event.client,
                error=refused,
                job=event.job[:100] or None,
                stimulus=farm.stimulus,
            )
        )
        return
    if pass_on_kept(farm, event):
        return
    job = new_job(farm, event)
    if start_job(farm, job, event.model):
        probe(farm, job)
        fill_all(farm)


def refusal(farm: Farm, event: ev.JobSubmitted) -> str | None:
    """Why a SUBMIT cannot even become a job, or None."""
    if not 0 < len(event.job) <= 100:
        return "SUBMIT 'job' must be an id of 1 to 100 characters"
    if event.job in farm.jobs:
        return f"job {event.job} already exists"
    if len(farm.jobs) >= MAX_JOBS:
        return f"the broker holds {MAX_JOBS} jobs already; try later"
    if (
        event.owner
        and sum(job.owner == event.owner for job in farm.jobs.values()) >= MAX_CLIENT_JOBS
    ):
        return (
            f"this client holds {MAX_CLIENT_JOBS} jobs already, the most one client may: "
            "wait for one to end"
        )
    return None


def new_job(farm: Farm, event: ev.JobSubmitted) -> Job:
    """The SUBMIT's job, held by the farm (its policy not made yet)."""
    config = farm.config
    algo, params = event.options.policy(config.algo, config.params)
    job = Job(
        event.job,
        event.client,
        event.model_name,
        event.dtype,
        event.item_shape,
        event.total,
        event.at,
        config.liveness * max(config.heartbeat, event.heartbeat),
        event.options,
        algo,
        params,
        farm.next_seq,
        inputs=event.inputs,
        runs=event.runs,
        earlier=event.earlier,
        owner=event.owner,
    )
    farm.next_seq += 1
    farm.jobs[job.id] = job
    for earlier in job.earlier:
        farm.aliases[earlier] = job.id
    if len(farm.jobs) > 1:
        for each in farm.jobs.values():
            each.shared = True
    log_submitted(job)
    return job


def log_submitted(job: Job) -> None:
    log.info(
        "job %s: %d x %s %s for model %s, policy %s, priority %d",
        job.id,
        job.total,
        job.item_shape,
        job.dtype,
        job.model,
        job.algo,
        job.priority,
        extra={
            "event": "job_submitted",
            "job": job.id,
            "model": job.model,
            "items": job.total,
            "policy": job.algo,
            "priority": job.priority,
            "client": job.options.client,
        },
    )


def start_job(farm: Farm, job: Job, model: ev.ModelFound | str) -> bool:
    """Check the job against its model and make its policy; fail the job if it cannot run.

    Every worker can run every model (it fetches the files it lacks), so a valid job
    gets its policy at once, told the workers connected now and their speeds on this
    model from earlier jobs.
    """
    problem = model if isinstance(model, str) else model_mismatch(job, model)
    if problem is not None:  # a model the broker lacks, or items that do not fit it
        fail_job(farm, job, problem)
        return False
    eligible = [entry for entry in farm.workers.values() if entry.quarantined is None]
    speeds = {
        entry.id: entry.history[job.model].rate for entry in eligible if job.model in entry.history
    }
    try:
        job.policy = make_policy(
            job.algo, job.total, [e.id for e in eligible], speeds, **job.params
        )
    except Exception as exc:  # a job's own parameters: ValueError, or what odd values provoke
        fail_job(farm, job, f"job policy: {exc}")
        return False
    fraction = job.options.verify if job.options.verify is not None else farm.config.verify
    job.checks = checks_of(job.id, fraction)
    farm.running[job.id] = job
    farm.order.place(job)
    cap_all(farm)  # a second job shortens everyone's chunks
    return True


def model_mismatch(job: Job, model: ev.ModelFound) -> str | None:
    """Why the job's items do not fit its model, or None, the job then told the model's
    item shape, decoded size and digest."""
    problem = input_mismatch(job.model, model.item_shape, model.layout, job.dtype, job.item_shape)
    if problem:
        return problem
    if job.dtype != ENCODED:  # a 1-channel model's 1 x H x W items are its H x W x 1
        job.item_shape = tuple(model.item_shape)
    if job.dtype == ENCODED:
        job.decoded_bytes = math.prod(model.item_shape) * model.crops
    job.digest = model.digest
    job.output_shape, job.softmax = model.output_shape, model.softmax
    return None
