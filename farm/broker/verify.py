"""Spot checks across devices (``--verify FRACTION``): a sample of each chunk's images runs
again on another worker, and the two answers must agree.

After a chunk's result is taken, a run of about ``FRACTION`` of its images at a random
offset (at least one image with probability ``FRACTION x count`` when that is under one)
joins the job's check line, with the first answer's rows.  A worker on another device
(``place``), preferably of another backend, runs it as a *check* attempt: outside the
job's policy, uncharged, never making an image suspect, and not in any share.  Answers
agree within the f32 tolerance of ``farm.engines.tolerances`` when both ran the same
precision, else when each image's top class is among the other's two highest.

A disagreement goes to a third device.  The worker the third answer contradicts loses:
it is quarantined (``farm.broker.quarantine``), and every chunk it computed for a running
job runs again, its results sent as corrections (``Result.corrects``).  Without a third
device the disagreement is reported, unresolved.  A job ends once its checks are
answered; checks no connected device may run are dropped, and counted.

The same attempt machinery (a second run of a range outside the policy, first answer
wins) serves backup attempts for a job's last chunks.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from farm.broker.checks import Answer, Check
from farm.broker.core import Farm
from farm.broker.jobs import ChunkRecord, Job, Worker
from farm.broker.quarantine import quarantine
from farm.broker.scheduling import fill, finish_if_done
from farm.policies import Chunk
from farm.wire.engines import fast_precision

log = logging.getLogger("farm.broker")

#: Relative difference within which two answers in one precision agree (f32's bound in
#: ``farm.engines.tolerances``: correct backends differ by 8e-5 at most on ResNet-50).
TOLERANCE = 1e-3
#: Where precisions differ: each image's top class must be among the other's this many.
TOP_K = 2
#: Precisions as engines name them (``Worker.engines``: "openvino f32 batch 64"); a
#: cascade's answers (``bf16+f32``) are its fast precision's where not run again.
PRECISIONS = ("f32", "bf16", "f16", "int8")


def precision_of(entry: Worker, model: str) -> str:
    """The precision ``entry`` runs ``model`` in, as its engine names it ("f32" if unnamed)."""
    return engine_precision(entry.engines.get(model, ""))


def engine_precision(engine: str) -> str:
    """The precision an engine's description names ("f32" if none): a cascade's answers
    are its fast precision's where they were not run again."""
    named = (fast_precision(word) for word in engine.split())
    return next((word for word in named if word in PRECISIONS), "f32")


def sample(farm: Farm, record: ChunkRecord, outputs: Any) -> None:
    """After a result is taken: maybe a check of a run of its images."""
    checks, chunk = record.job.checks, record.chunk
    if checks is None or outputs is None:
        return
    checks.computed_by.setdefault(record.worker.id, []).append(chunk)
    wanted = checks.fraction * chunk.count
    count = math.floor(wanted) + (checks.rng.random() < wanted - math.floor(wanted))
    if count == 0:
        return
    offset = checks.rng.randrange(chunk.count - count + 1)
    entry = record.worker
    rows = np.array(outputs[offset : offset + count])  # a copy: the frame goes on
    answer = (entry.id, entry.place, precision_of(entry, record.job.model), rows)
    checks.waiting.append(Check(Chunk(chunk.start + offset, count), [answer], names=[entry.name]))
    farm.refill = True  # an idle worker on another device may take it


def check_answered(farm: Farm, record: ChunkRecord, outputs: Any) -> None:
    """A check's answer: compared with the answers before it."""
    job, check, entry = record.job, record.check, record.worker
    assert check is not None and job.checks is not None
    checks = job.checks
    checks.running -= 1
    if not any(worker_quarantined(farm, answer[0]) for answer in check.answers):
        compare(farm, record, outputs)  # else its chunk runs again, or its answer is not trusted
    fill(farm, entry)
    finish_if_done(farm, job)


def compare(farm: Farm, record: ChunkRecord, outputs: Any) -> None:
    """The check's new answer against the earlier ones: agreed, to a third device, or
    settled."""
    job, check, entry = record.job, record.check, record.worker
    assert check is not None and job.checks is not None
    checks = job.checks
    rows = np.asarray(outputs) if outputs is not None else check.answers[0][3]  # (simulated)
    check.answers.append((entry.id, entry.place, precision_of(entry, job.model), rows))
    check.names.append(entry.name)
    if len(check.answers) == 2:
        checks.verified += check.chunk.count
    if not disagreeing(check.answers):
        return
    if len(check.answers) == 2:
        checks.disagreements += 1
        log.warning(
            "job %s: items %d..%d: %s and %s disagree; asking a third device",
            job.id,
            check.chunk.start,
            check.chunk.stop - 1,
            worker_name(farm, check.answers[0][0]),
            entry.name,
        )
        checks.waiting.append(check)
        farm.refill = True
    else:
        settle_disagreement(farm, job, check)


def disagreeing(answers: list[Answer]) -> bool:
    """Whether the last answer disagrees with any answer before it."""
    *earlier, (_, _, precision, rows) = answers
    return any(not agree(rows, other, precision == p) for _, _, p, other in earlier)


def agree(first: np.ndarray, second: np.ndarray, same_precision: bool) -> bool:
    """Two answers for the same images: within ``TOLERANCE`` of the larger magnitude in one
    precision; else each top class among the other's ``TOP_K`` highest."""
    if first.shape != second.shape:
        return False
    a, b = first.reshape(len(first), -1), second.reshape(len(second), -1)
    if same_precision:
        scale = max(float(np.abs(a).max(initial=0.0)), float(np.abs(b).max(initial=0.0)))
        return float(np.abs(a.astype(np.float64) - b).max(initial=0.0)) <= TOLERANCE * max(
            scale, 1e-30
        )
    k = min(TOP_K, a.shape[1])
    top_a, top_b = np.argsort(-a, axis=1)[:, :k], np.argsort(-b, axis=1)[:, :k]
    return bool(
        (top_a[:, :1] == top_b).any(axis=1).all() and (top_b[:, :1] == top_a).any(axis=1).all()
    )


def settle_disagreement(farm: Farm, job: Job, check: Check) -> None:
    """Three answers: the one the third contradicts loses; if the third agrees with
    neither, nobody can be told wrong."""
    assert job.checks is not None
    (first, _, p1, rows1), (second, _, p2, rows2), (_, _, p3, rows3) = check.answers[:3]
    first_ok = agree(rows3, rows1, p3 == p1)
    second_ok = agree(rows3, rows2, p3 == p2)
    if first_ok == second_ok:
        job.checks.unresolved += 1
        log.warning(
            "job %s: items %d..%d: three devices gave answers none of which two confirm",
            job.id,
            check.chunk.start,
            check.chunk.stop - 1,
        )
        return
    loser = second if first_ok else first
    reason = (
        f"its answer to items {check.chunk.start}..{check.chunk.stop - 1} of job "
        f"{job.id} disagreed with two other devices' (a spot check)"
    )
    entry = farm.by_id.get(loser)
    if entry is None:  # it left: it stays quarantined if it comes back
        farm.quarantined[check.names[1 if first_ok else 0]] = reason
    elif entry.quarantined is None:
        quarantine(farm, entry, reason)
    correct(farm, loser)


def correct(farm: Farm, loser: str) -> None:
    """Every chunk the loser computed for a running job runs again; the results replace
    the ones delivered (corrections).  Checks of its answers are dropped."""
    for job in list(farm.running.values()):
        checks = job.checks
        if checks is None:
            continue
        chunks = checks.computed_by.pop(loser, [])
        checks.waiting = [c for c in checks.waiting if c.answers[0][0] != loser]
        for chunk in chunks:
            job.corrections.add(chunk.start, chunk.stop)
            job.corrected += chunk.count
            job.retry_items += chunk.count
            job.retries.appendleft(chunk)
        if chunks:
            farm.refill = True
            log.warning(
                "job %s: %d chunks of the quarantined worker run again as corrections",
                job.id,
                len(chunks),
            )


def worker_quarantined(farm: Farm, worker_id: str) -> bool:
    entry = farm.by_id.get(worker_id)
    return entry is not None and entry.quarantined is not None


def worker_name(farm: Farm, worker_id: str) -> str:
    entry = farm.by_id.get(worker_id)
    return entry.name if entry is not None else worker_id


__all__ = ["agree", "check_answered", "sample"]
