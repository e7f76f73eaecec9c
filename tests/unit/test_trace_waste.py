"""farm.client.trace.idle_share: a job's waste from its own trace (idle worker time over
workers x span), which the workers' standalone speeds cannot move."""

from __future__ import annotations

import pytest

from farm.client.trace import TRACE_FORMAT, ChunkTrace, Trace, idle_share
from farm.summary import WorkerShare


def chunk(worker: str, started: float, finished: float, count: int = 100) -> ChunkTrace:
    """A chunk that computed from ``started`` to ``finished``, sent just before it."""
    sent = max(0.0, started - 0.01)
    return ChunkTrace(
        worker=worker,
        start=0,
        count=count,
        attempt=1,
        assigned=sent,
        sent=sent,
        arrived=sent,
        started=started,
        finished=finished,
        received=finished + 0.01,
        delivered=finished + 0.02,
    )


def share(name: str, rate: float = 1000.0) -> WorkerShare:
    return WorkerShare(name=name, device=name, items=0, chunks=0, compute_s=1.0, rate=rate)


def trace(
    seconds: float, chunks: list[ChunkTrace], workers: tuple[str, ...] = (), rate: float = 1000.0
) -> Trace:
    """A job of ``seconds`` on the broker's clock, offered to ``workers`` (default: those
    that ran a chunk), each listed at standalone speed ``rate``."""
    names = workers or tuple(dict.fromkeys(c.worker for c in chunks))
    return Trace(
        format=TRACE_FORMAT,
        items=sum(c.count for c in chunks),
        broker_seconds=seconds,
        workers=tuple(share(name, rate) for name in names),
        chunks=chunks,
    )


def test_one_worker_idle_half_the_span_of_two_wastes_a_quarter() -> None:
    job = trace(10.0, [chunk("a", 0.0, 5.0), chunk("a", 5.0, 10.0), chunk("b", 0.0, 5.0)])
    assert idle_share(job) == pytest.approx(0.25)


def test_idle_counts_the_start_the_gaps_and_the_tail() -> None:
    # a: idle 0-1 (start), 3-4 (gap), 8-10 (tail) = 4 s; b: idle 0-2 and 6-10 = 6 s
    job = trace(10.0, [chunk("a", 1.0, 3.0), chunk("a", 4.0, 8.0), chunk("b", 2.0, 6.0)])
    assert idle_share(job) == pytest.approx((4 + 6) / 20)


def test_overlapping_chunks_count_once_and_time_outside_the_span_not_at_all() -> None:
    job = trace(
        10.0,
        [
            chunk("a", 1.0, 4.0),
            chunk("a", 3.0, 6.0),  # overlaps the first: a is busy 1-6, 5 s
            chunk("a", 5.0, 5.5),  # inside the busy stretch: nothing more
            chunk("b", -1.0, 2.0),  # placed before the job's start: 0-2 counts
            chunk("b", 9.0, 12.0),  # past its end: 9-10 counts
            chunk("b", 11.0, 12.0),  # wholly past the end: nothing
        ],
    )
    assert idle_share(job) == pytest.approx(1 - (5 + 2 + 1) / 20)


def test_a_worker_offered_the_job_that_ran_nothing_is_idle_throughout() -> None:
    job = trace(4.0, [chunk("a", 0.0, 4.0), chunk("b", 0.0, 4.0)], workers=("a", "b", "c"))
    assert idle_share(job) == pytest.approx(1 / 3)


def test_a_worker_missing_from_the_list_still_counts() -> None:
    job = trace(4.0, [chunk("a", 0.0, 4.0), chunk("ghost", 0.0, 1.0)], workers=("a",))
    assert idle_share(job) == pytest.approx(3 / 8)


def test_it_never_goes_negative_and_ignores_the_standalone_speeds() -> None:
    """Chunks reported longer than the job, and standalone speeds far below what the job
    achieved (the drift that sent the old figure negative): still within 0..1, the same."""
    chunks = [chunk("a", -0.5, 10.5), chunk("b", 0.0, 10.2), chunk("b", 0.1, 9.0)]
    slow, fast = trace(10.0, chunks, rate=1.0), trace(10.0, chunks, rate=1e6)
    assert idle_share(slow) == idle_share(fast) == 0.0


def test_a_job_with_no_span_or_no_worker_wastes_nothing() -> None:
    assert idle_share(trace(0.0, [chunk("a", 0.0, 1.0)])) == 0.0
    assert idle_share(trace(5.0, [])) == 0.0
