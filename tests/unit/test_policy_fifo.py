"""async-FIFO as a pure state machine: scripted events in, exact assignments out."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from farm.policies import Assign, Chunk, ChunkDone, WorkerLost, WorkerReady, make_policy


def test_scripted_fifo_sequence() -> None:
    policy = make_policy("fifo", 1200, chunk=500)
    assert policy.handle(WorkerReady("a")) == [Assign("a", Chunk(0, 500))]
    assert policy.handle(WorkerReady("b")) == [Assign("b", Chunk(500, 500))]
    assert policy.handle(ChunkDone("a", Chunk(0, 500), 0.05)) == []
    assert policy.handle(WorkerReady("a")) == [Assign("a", Chunk(1000, 200))]
    assert policy.handle(WorkerReady("c")) == []  # nothing left: c waits
    assert not policy.finished
    assert policy.handle(ChunkDone("b", Chunk(500, 500), 0.05)) == []
    assert policy.handle(ChunkDone("a", Chunk(1000, 200), 0.02)) == []
    assert policy.finished


def test_a_lost_workers_chunk_goes_to_an_idle_worker() -> None:
    policy = make_policy("fifo", 1000, chunk=600)
    assert policy.handle(WorkerReady("a")) == [Assign("a", Chunk(0, 600))]
    assert policy.handle(WorkerReady("b")) == [Assign("b", Chunk(600, 400))]
    assert policy.handle(WorkerReady("b")) == []  # b has a second free slot, nothing to fill it
    assert policy.handle(WorkerLost("a")) == [Assign("b", Chunk(0, 600))]
    policy.handle(ChunkDone("b", Chunk(600, 400), 0.1))
    policy.handle(ChunkDone("b", Chunk(0, 600), 0.1))
    assert policy.finished


def test_unknown_completion_is_an_error() -> None:
    policy = make_policy("fifo", 10, chunk=5)
    policy.handle(WorkerReady("a"))
    try:
        policy.handle(ChunkDone("a", Chunk(5, 5), 0.1))
    except ValueError as exc:
        assert "did not hold" in str(exc)
    else:
        raise AssertionError("a chunk the worker never held was accepted")


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 5000), workers=st.integers(1, 6), data=st.data())
def test_every_item_assigned_exactly_once(total, workers, data) -> None:
    """Random interleavings of ready/done/lost: items covered exactly once, in full chunks."""
    # at most 100 chunks a job: each one is a drawn step, and thousands of them (chunks of
    # 1 to 5 in a job of 5000) took most of the test's time and covered nothing more
    chunk = data.draw(st.integers(-(-total // 100), 700), label="chunk")
    policy = make_policy("fifo", total, chunk=chunk)
    names = [f"w{i}" for i in range(workers)]
    held: dict[str, list[Chunk]] = {name: [] for name in names}
    completed: list[Chunk] = []
    alive = set(names)

    def apply(assignments):
        for a in assignments:
            assert a.worker in alive
            held[a.worker].append(a.chunk)

    for name in names:
        apply(policy.handle(WorkerReady(name)))
    steps = 0
    while not policy.finished:
        steps += 1
        assert steps < 10_000
        busy = [n for n in sorted(alive) if held[n]]
        if len(alive) > 1 and data.draw(st.integers(0, 20)) == 0:
            lost = data.draw(st.sampled_from(sorted(alive)))
            alive.remove(lost)
            held[lost] = []
            apply(policy.handle(WorkerLost(lost)))
            continue
        assert busy, "work remains but no worker holds any"
        worker = data.draw(st.sampled_from(busy))
        done = held[worker].pop(0)
        completed.append(done)
        apply(policy.handle(ChunkDone(worker, done, done.count / 1000)))
        apply(policy.handle(WorkerReady(worker)))
    covered = sorted(i for c in completed for i in range(c.start, c.stop))
    assert covered == list(range(total))
    assert all(c.count == chunk or c.stop == total for c in completed)  # only the tail is short


def test_a_second_chunk_goes_out_only_while_every_worker_can_get_one() -> None:
    """Prefetch hides the round trip, but never starves an idle worker at the tail."""
    policy = make_policy("fifo", 1000, chunk=300)
    assert policy.handle(WorkerReady("a")) == [Assign("a", Chunk(0, 300))]
    assert policy.handle(WorkerReady("b")) == [Assign("b", Chunk(300, 300))]
    assert policy.handle(WorkerReady("a")) == []  # 400 left < 2 workers x 300: keep it
    assert policy.handle(WorkerReady("b")) == []
    assert policy.handle(ChunkDone("a", Chunk(0, 300), 0.03)) == [Assign("a", Chunk(600, 300))]
    assert policy.handle(ChunkDone("b", Chunk(300, 300), 0.03)) == [Assign("b", Chunk(900, 100))]


def test_prefetch_while_plenty_remains() -> None:
    policy = make_policy("fifo", 10_000, chunk=500)
    policy.handle(WorkerReady("a"))
    policy.handle(WorkerReady("b"))
    assert policy.handle(WorkerReady("a")) == [Assign("a", Chunk(1000, 500))]
