"""Workers registering, heard from, leaving and falling silent.

Silent workers expire after ``liveness`` heartbeats; a lost worker's chunks go back to
their jobs (``farm.broker.attempts``), and its losses shorten chunks under churn.
"""

from __future__ import annotations

import logging

from farm.broker import caps
from farm.broker import events as ev
from farm.broker.attempts import worker_lost
from farm.broker.core import Farm
from farm.broker.jobs import Worker
from farm.broker.registry import WorkerEntry
from farm.broker.scheduling import fill, fill_all, step
from farm.policies import WorkerLost

log = logging.getLogger("farm.broker")


def on_worker_joined(farm: Farm, event: ev.WorkerJoined) -> None:
    if event.worker in farm.workers:
        lose_worker(farm, event.worker, "re-registered")
    entry: Worker = WorkerEntry.from_facts(event.worker, event.facts)
    entry.last_seen = entry.joined_at = event.at
    farm.workers[event.worker] = farm.by_id[entry.id] = entry
    reason = farm.quarantined.get(entry.name) or farm.quarantined.get(entry.owner or entry.name)
    if reason is not None:  # the same process again: still not trusted
        entry.quarantined = reason
        log.warning("worker %s registered again, still quarantined: %s", entry.name, reason)
        return
    farm.places[entry.place] += 1
    caps.worker_joined(farm, entry)
    if farm.observer:
        farm.observer.worker_joined(entry)
    log.info(
        "worker %s joined (%s, %d compute thread%s; loaded: %s; can run: %s)",
        entry.name,
        entry.backend,
        entry.threads,
        "" if entry.threads == 1 else "s",
        ", ".join(sorted(entry.loaded)) or "none",
        ", ".join(sorted(entry.models)),
        extra={"event": "worker_joined", "worker": entry.name, "backend": entry.backend},
    )
    fill(farm, entry)


def on_worker_left(farm: Farm, event: ev.WorkerLeft) -> None:
    if event.crashed and event.worker in farm.workers:
        farm.stats.workers_crashed += 1
        farm.churn.lost(event.at)
    lose_worker(farm, event.worker, event.reason, event.crashed)


def on_worker_heard(farm: Farm, event: ev.WorkerHeard) -> None:
    entry = farm.heard_worker(event.worker)
    if entry is None:  # we dropped it: re-register
        farm.out.append(ev.DropWorker(worker=event.worker, stimulus=farm.stimulus))
        return
    if event.computed is not None:
        entry.note_computed(event.computed, event.at)
    if event.engines is not None:
        entry.note_engines(event.engines)


def expire_silent(farm: Farm, now: float) -> None:
    """Drop the workers silent for longer than ``liveness`` of their heartbeats."""
    for identity, entry in list(farm.workers.items()):
        silent = now - entry.last_seen
        if silent > farm.config.liveness * max(farm.config.heartbeat, entry.heartbeat):
            farm.stats.workers_expired += 1
            farm.churn.lost(now)
            lose_worker(farm, identity, f"silent for {silent:.1f} s")


def lose_worker(farm: Farm, identity: bytes, reason: str, crashed: bool = False) -> None:
    """Forget a worker; its chunks go back to their jobs (``attempts.worker_lost``)."""
    entry = forget(farm, identity)
    if entry is None:
        return
    records = list(entry.in_flight.values())
    entry.in_flight.clear()
    log.info(
        "worker %s left (%s) with %d chunks in flight",
        entry.name,
        reason,
        len(records),
        extra={"event": "worker_left", "worker": entry.name, "reason": reason},
    )
    worker_lost(farm, entry, records, reason, crashed)
    # a worker that reconnected (a new socket, the same name) keeps its metrics series
    if farm.observer and all(other.name != entry.name for other in farm.workers.values()):
        farm.observer.worker_left(entry)
    caps.worker_lost(farm, entry)
    for job in list(farm.running.values()):
        step(farm, job, WorkerLost(entry.id, at=farm.now))
    fill_all(farm)


def forget(farm: Farm, identity: bytes) -> Worker | None:
    """Take the worker out of the registry; None if it was not in it."""
    entry = farm.workers.pop(identity, None)
    if entry is None:
        return None
    del farm.by_id[entry.id]
    if entry.quarantined is None:  # a quarantined worker left the places already
        farm.places[entry.place] -= 1
        if not farm.places[entry.place]:
            del farm.places[entry.place]
    return entry
