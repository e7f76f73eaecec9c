"""Chunk caps: the fastest rate per model, and the longest chunk each job may hand out.

Chunks are capped at ``max_chunk_seconds`` of compute on the job's fastest worker (a
quarter of that while jobs share the farm), under churn at the length that loses least
to it (``farm/broker/churn.py``), and always at the byte limit of a message.
"""

from __future__ import annotations

from farm.broker.core import Farm
from farm.broker.jobs import Job, Worker

#: Part of ``max_chunk_seconds`` that caps chunks while several jobs share the farm.
SHARED_CHUNK_FRACTION = 0.25


def note_rate(farm: Farm, model: str, entry: Worker) -> None:
    """Keep the fastest rate per model current as one worker's rate moves (O(1) unless
    the fastest worker slowed down).  A rate of a worker since lost stands until a
    connected worker has one: new processes must not run uncapped chunks."""
    rate = entry.history[model].rate
    best = farm.fastest.get(model)
    if best is None or rate >= best[0] or best[1] not in farm.by_id:
        farm.fastest[model] = (rate, entry.id)
    elif best[1] == entry.id:
        find_fastest(farm, model)


def find_fastest(farm: Farm, model: str) -> None:
    rates = [
        (entry.history[model].rate, entry.id)
        for entry in farm.workers.values()
        if model in entry.history and entry.quarantined is None
    ]
    if rates:
        farm.fastest[model] = max(rates)


def worker_joined(farm: Farm, entry: Worker) -> None:
    """The speeds a worker brought: chunks are capped at once if they name a new model."""
    known = set(farm.fastest)
    for model in entry.history:
        note_rate(farm, model, entry)
    if set(farm.fastest) != known:
        cap_all(farm)


def worker_lost(farm: Farm, entry: Worker) -> None:
    """Caps anew if the fastest worker on a model, or the rate of losses per worker,
    changed."""
    slowed = [model for model, (_, fastest) in farm.fastest.items() if fastest == entry.id]
    for model in slowed:
        find_fastest(farm, model)
    if slowed or farm.churn.losses:
        cap_all(farm)


def cap_all(farm: Farm) -> None:
    for job in farm.running.values():
        cap_chunks(farm, job)


def cap_chunks(farm: Farm, job: Job) -> None:
    """Cap the job's chunks at its byte limit and at ``max_chunk_seconds`` of compute on
    its fastest worker, once a speed on its model is known; while several jobs share
    the farm, at ``SHARED_CHUNK_FRACTION`` of that, so every job's turn on a worker
    comes round quickly (a chunk queued on a worker waits for the one running); and
    under churn, at the length that loses least to it."""
    assert job.policy is not None
    job.policy.max_chunk = job.max_chunk
    fastest = farm.fastest.get(job.model, (0.0, ""))[0]
    seconds = farm.config.max_chunk_seconds
    if len(farm.running) > 1:
        seconds *= SHARED_CHUNK_FRACTION
    churn = farm.churn.chunk_seconds(len(farm.workers), farm.now)
    if churn is not None and seconds > 0:
        seconds = min(seconds, churn)
    if fastest > 0 and seconds > 0:  # min() first: a rate may be huge, even inf
        job.policy.max_chunk = max(1, int(min(job.max_chunk, fastest * seconds)))
