"""Every policy as a pure state machine: scripted events in, exact assignments out.

The scripted tests are tables of numbers worked out by hand from the policies' rules
(docs/scheduling.md); the property tests drive every policy with random speeds, job sizes,
joins and losses.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from farm.policies import (
    BARRIER_POLICIES,
    POLICIES,
    Assign,
    Chunk,
    ChunkDone,
    ChunkFailed,
    WorkerBusy,
    WorkerLost,
    WorkerReady,
    make_policy,
    proportional_split,
)


def done(worker: str, start: int, count: int, seconds: float, at: float = 0.0) -> ChunkDone:
    return ChunkDone(worker, Chunk(start, count), seconds, at)


def give(worker: str, start: int, count: int) -> list[Assign]:
    return [Assign(worker, Chunk(start, count))]


# ------------------------------------------------------------------ splitting


@pytest.mark.parametrize(
    "total, weights, floor, expected",
    [
        (1000, {"a": 1, "b": 1, "c": 1}, 1, {"a": 334, "b": 333, "c": 333}),
        (1000, {"a": 1, "b": 1, "c": 2}, 1, {"a": 250, "b": 250, "c": 500}),
        (2000, {"a": 1000, "b": 333.3}, 100, {"a": 1500, "b": 500}),
        (300, {"a": 10, "b": 1, "c": 1}, 100, {"a": 300}),  # b and c would get 25 each
        (50, {"a": 1, "b": 3}, 100, {"b": 50}),  # less than the floor: all to the fastest
        (0, {"a": 1}, 100, {}),
    ],
)
def test_proportional_split(total, weights, floor, expected) -> None:
    assert proportional_split(total, weights, floor) == expected


# ------------------------------------------------------------ scripted tables


def test_static_cuts_the_job_once_by_ratio() -> None:
    policy = make_policy("static", 1000, ["a", "b", "c"], ratio=(1, 1, 2))
    assert policy.handle(WorkerReady("a")) == give("a", 0, 250)
    assert policy.handle(WorkerReady("b")) == give("b", 250, 250)
    assert policy.handle(WorkerReady("c")) == give("c", 500, 500)
    assert policy.handle(done("a", 0, 250, 0.1)) == []
    assert policy.handle(WorkerReady("a")) == []  # nothing is ever re-balanced
    assert policy.handle(WorkerReady("d")) == []  # a latecomer gets nothing: all is planned


def test_static_default_is_equal_and_a_lost_share_goes_to_the_next_idle_worker() -> None:
    policy = make_policy("static", 1000, ["a", "b", "c"])
    assert policy.handle(WorkerReady("a")) == give("a", 0, 334)
    assert policy.handle(WorkerReady("b")) == give("b", 334, 333)
    assert policy.handle(done("a", 0, 334, 0.1)) == []
    assert policy.handle(WorkerReady("a")) == []
    assert policy.handle(WorkerLost("c")) == give("a", 667, 333)  # c never came: a does its part
    assert policy.handle(WorkerLost("b")) == []  # a is busy: b's chunk waits for an idle worker
    assert policy.handle(done("a", 667, 333, 0.1)) == []
    assert policy.handle(WorkerReady("a")) == give("a", 334, 333)


def test_quick_probes_then_splits_the_rest_by_speed() -> None:
    policy = make_policy("quick", 3000, ["a", "b"], probe=500)
    assert policy.handle(WorkerReady("a")) == give("a", 0, 500)
    assert policy.handle(WorkerReady("b")) == give("b", 500, 500)
    assert policy.handle(done("a", 0, 500, 0.5)) == []  # a: 1000/s
    assert policy.handle(WorkerReady("a")) == []  # barrier: b is still probing
    assert policy.handle(done("b", 500, 500, 1.5)) == give("a", 1000, 1500)  # b: 333/s
    assert policy.handle(WorkerReady("b")) == give("b", 2500, 500)
    assert policy.handle(done("b", 2500, 500, 1.5)) == []
    assert policy.handle(done("a", 1000, 1500, 1.5)) == []
    assert policy.finished


def test_sliced_rounds_split_by_measured_speed() -> None:
    policy = make_policy("sliced", 5000, ["a", "b"], slice=2000)
    assert policy.handle(WorkerReady("a")) == give("a", 0, 1000)  # round 1: equal
    assert policy.handle(WorkerReady("b")) == give("b", 1000, 1000)
    assert policy.handle(done("b", 1000, 1000, 0.5)) == []  # b: 2000/s
    assert policy.handle(WorkerReady("b")) == []  # barrier
    assert policy.handle(done("a", 0, 1000, 1.0)) == give("b", 2000, 1333)  # a: 1000/s
    assert policy.handle(WorkerReady("a")) == give("a", 3333, 667)
    assert policy.handle(done("a", 3333, 667, 0.667)) == []
    assert policy.handle(WorkerReady("a")) == []
    assert policy.handle(done("b", 2000, 1333, 0.6665)) == give("a", 4000, 333)  # last 1000
    assert policy.handle(WorkerReady("b")) == give("b", 4333, 667)


def test_sliced_takes_a_worker_that_joins_mid_round_at_the_next_round() -> None:
    policy = make_policy("sliced", 4000, ["a"], slice=1000)
    assert policy.handle(WorkerReady("a")) == give("a", 0, 1000)
    assert policy.handle(WorkerReady("c")) == []  # joins mid-round: waits for the barrier
    assert policy.handle(done("a", 0, 1000, 1.0)) == give("c", 1000, 500)  # unknown: mean speed
    assert policy.handle(WorkerReady("a")) == give("a", 1500, 500)


def test_hat_doubles_until_finish_times_are_close_then_splits_all() -> None:
    policy = make_policy("hat", 10_000, ["a", "b"], slice=1000, tolerance=0.1)
    assert policy.handle(WorkerReady("a")) == give("a", 0, 500)
    assert policy.handle(WorkerReady("b")) == give("b", 500, 500)
    assert policy.handle(done("b", 500, 500, 0.25)) == []  # b: 2000/s
    assert policy.handle(WorkerReady("b")) == []
    # finish times 0.5 and 0.25 s are not close: the slice doubles to 2000, split 1:2
    assert policy.handle(done("a", 0, 500, 0.5)) == give("b", 1000, 1333)
    assert policy.handle(WorkerReady("a")) == give("a", 2333, 667)
    assert policy.handle(done("a", 2333, 667, 0.667)) == []
    assert policy.handle(WorkerReady("a")) == []
    # 0.667 and 0.6665 s are close: everything left (7000) goes out, split 1:2
    assert policy.handle(done("b", 1000, 1333, 0.6665)) == give("a", 3000, 2333)
    assert policy.handle(WorkerReady("b")) == give("b", 5333, 4667)


def test_hat_lost_worker_leaves_its_chunk_to_the_idle_one_within_the_round() -> None:
    policy = make_policy("hat", 10_000, ["a", "b"], slice=1000)
    policy.handle(WorkerReady("a"))
    policy.handle(WorkerReady("b"))
    policy.handle(done("a", 0, 500, 0.5))
    assert policy.handle(WorkerReady("a")) == []
    assert policy.handle(WorkerLost("b")) == give("a", 500, 500)  # same round, no new slice
    assert policy.round == 1


def test_fast_split_probes_until_every_worker_has_a_speed() -> None:
    policy = make_policy("fast-split", 10_000, ["a", "b"], ratio=0.5, probe=500)
    assert policy.handle(WorkerReady("a")) == give("a", 0, 500)
    assert policy.handle(WorkerReady("b")) == give("b", 500, 500)
    assert policy.handle(done("a", 0, 500, 0.5)) == []  # a: 1000/s
    assert policy.handle(WorkerReady("a")) == give("a", 1000, 500)  # b has no speed yet: probe
    assert policy.handle(done("b", 500, 500, 0.25)) == []  # b: 2000/s
    # remaining 8500 * 0.5 * 2000/2000
    assert policy.handle(WorkerReady("b")) == give("b", 1500, 4250)
    assert policy.handle(done("a", 1000, 500, 0.5)) == []
    # remaining 4250 * 0.5 * 1000/2000 = 1062.5
    assert policy.handle(WorkerReady("a")) == give("a", 5750, 1063)


def test_fast_split_never_leaves_less_than_the_floor() -> None:
    policy = make_policy("fast-split", 1000, ["a"], ratio=0.5, probe=500)
    assert policy.handle(WorkerReady("a")) == give("a", 0, 500)
    policy.handle(done("a", 0, 500, 0.5))
    assert policy.handle(WorkerReady("a")) == give("a", 500, 250)  # 500 * 0.5
    policy.handle(done("a", 500, 250, 0.25))
    assert policy.handle(WorkerReady("a")) == give("a", 750, 125)
    policy.handle(done("a", 750, 125, 0.125))
    # 62.5 is raised to the floor (100), which would leave 25: all 125 go
    assert policy.handle(WorkerReady("a")) == give("a", 875, 125)


def test_equal_finish_shares_by_remembered_speed_without_probing() -> None:
    policy = make_policy(
        "equal-finish", 10_000, ["a", "b"], {"a": 1000.0, "b": 3000.0}, overhead=0.0
    )
    # T = 10000 / 4000 = 2.5 s: a's share 2500, half of it now
    assert policy.handle(WorkerReady("a", at=0.0)) == give("a", 0, 1250)
    # a is busy until 1.25 s: T = (8750 + 1000 * 1.25) / 4000 = 2.5, b's share 7500
    assert policy.handle(WorkerReady("b", at=0.0)) == give("b", 1250, 3750)


def test_equal_finish_probes_unknown_workers() -> None:
    policy = make_policy("equal-finish", 10_000, ["a", "b"], probe=200)
    assert policy.handle(WorkerReady("a")) == give("a", 0, 200)
    assert policy.handle(WorkerReady("b")) == give("b", 200, 200)


def test_equal_finish_leaves_the_end_to_the_worker_that_finishes_first() -> None:
    policy = make_policy("equal-finish", 150, ["a", "b"], {"a": 1000.0, "b": 10.0})
    assert policy.handle(WorkerReady("b")) == []  # b would need 15 s, a 0.15 s
    # pieces of at most the even share (75), which a job this small is cut to
    assert policy.handle(WorkerReady("a")) == give("a", 0, 75)
    assert policy.handle(done("a", 0, 75, 0.075, at=0.075)) == []  # b still waits
    assert policy.handle(WorkerReady("a", at=0.075)) == give("a", 75, 75)


def test_equal_finish_prefetches_while_its_share_lasts() -> None:
    policy = make_policy(
        "equal-finish", 10_000, ["a", "b"], {"a": 1000.0, "b": 1000.0}, overhead=0.0
    )
    assert policy.handle(WorkerReady("a")) == give("a", 0, 2500)  # T = 5 s, share 5000
    # a is busy until 2.5 s: its share after that is 2500, half of it now
    assert policy.handle(WorkerReady("a")) == give("a", 2500, 1250)


def test_equal_finish_alone_takes_everything_at_once() -> None:
    policy = make_policy("equal-finish", 10_000, ["a"])
    assert policy.handle(WorkerReady("a")) == give("a", 0, 10_000)


def test_equal_finish_caps_the_speed_of_an_overdue_worker() -> None:
    policy = make_policy(
        "equal-finish", 100_000, ["a", "b"], {"a": 1000.0, "b": 1000.0}, overhead=0.0
    )
    first = policy.handle(WorkerReady("a", at=0.0))[0].chunk  # 25 000 items: 25 s
    assert policy.rate("a") == 1000.0
    policy.handle(WorkerReady("a", at=50.0))  # still not done at 50 s: at most 500/s
    assert policy.rate("a") == first.count / 50.0


# ------------------------------------------------------------ tiny jobs

#: A fixed chunk larger than N / W cannot, by definition, reach every worker.
SPLITS_A_TINY_JOB = [name for name in POLICIES if name != "fifo"]


def first_shares(name: str, total: int, workers: int, **params) -> dict[str, int]:
    """Items each of ``workers`` free workers gets when they all ask at the start."""
    names = [f"w{i}" for i in range(workers)]
    policy = make_policy(name, total, names, **params)
    shares: dict[str, int] = {}
    for worker in names:
        for a in policy.handle(WorkerReady(worker)):
            shares[a.worker] = shares.get(a.worker, 0) + a.chunk.count
    return shares


@pytest.mark.parametrize("name", SPLITS_A_TINY_JOB)
@pytest.mark.parametrize(
    "total, workers", [(9, 2), (2, 2), (10, 3), (150, 2), (800, 2), (1000, 16), (64, 64)]
)
def test_a_job_smaller_than_the_first_round_reaches_every_free_worker(name, total, workers) -> None:
    """9 images on two workers used to go whole to one of them: a floor (100), a probe
    (500 / 200) or a minimum chunk per worker was more than the job.  These are cut to the
    job's even share now, so every worker gets a piece of the first round."""
    shares = first_shares(name, total, workers)
    assert len(shares) == workers and sum(shares.values()) <= total
    if total < 100 * workers:  # smaller than a round of floor-sized chunks: it all goes out
        assert sum(shares.values()) == total and min(shares.values()) >= total // workers


@pytest.mark.parametrize(
    "speeds, first", [({"a": 6000.0, "b": 6000.0}, 4), ({"a": 5900.0, "b": 6100.0}, 5)]
)
def test_equal_finish_with_remembered_speeds_splits_a_tiny_job(speeds, first) -> None:
    """Pieces of the even share, each to the worker that would finish it first; a worker
    three times slower than the other still waits (it would finish later: by definition)."""
    policy = make_policy("equal-finish", 9, ["a", "b"], speeds)
    assert policy.handle(WorkerReady("a")) + policy.handle(WorkerReady("b")) == [
        *give("a", 0, first),
        *give("b", first, 9 - first),
    ]
    slow = make_policy("equal-finish", 9, ["a", "b"], {"a": 1000.0, "b": 3000.0})
    assert slow.handle(WorkerReady("a")) == []


def test_a_tiny_job_keeps_the_floor_for_a_lone_worker_and_fifo_its_chunk() -> None:
    assert first_shares("static", 9, 1) == {"w0": 9}
    assert first_shares("fifo", 9, 2) == {"w0": 9}  # chunk 500: by definition all to one
    assert first_shares("fifo", 9, 2, chunk=4) == {"w0": 4, "w1": 4}
    assert first_shares("static", 9, 2, ratio=(1, 3)) == {"w0": 2, "w1": 7}


def test_a_job_big_enough_for_the_floor_keeps_it() -> None:
    policy = make_policy("sliced", 100_000, ["a", "b", "c"], slice=250)
    assert [a.chunk.count for w in "abc" for a in policy.handle(WorkerReady(w))] == [125, 125]


# ------------------------------------------------------------ properties


def fewest(total: int) -> int:
    """The smallest chunk size or cap drawn (fifo's chunk, a slice, a max_chunk) for a job of
    ``total`` items: one that makes at most 100 chunks.  Each chunk costs a few drawn
    events, and jobs cut into thousands (slices of 1 on 20 000 items) took most of the
    test's time, or ran out of hypothesis's choices and were thrown away, without reaching
    any other code."""
    return -(-total // 100)


def policy_parameters(name: str, floor: int, total: int) -> st.SearchStrategy[dict]:
    """Random but valid parameters for each policy (at most 100 chunks of a fixed size)."""
    probe = st.integers(floor, 3000)
    least = max(floor, fewest(total))
    return {
        "static": st.fixed_dictionaries({"floor": st.just(floor)}),
        "quick": st.fixed_dictionaries({"floor": st.just(floor), "probe": probe}),
        "sliced": st.fixed_dictionaries(
            {"floor": st.just(floor), "slice": st.integers(least, 6000)}
        ),
        "hat": st.fixed_dictionaries(
            {
                "floor": st.just(floor),
                "slice": st.integers(least, 3000),
                "tolerance": st.floats(0, 0.5),
            }
        ),
        "fifo": st.fixed_dictionaries({"chunk": st.integers(fewest(total), 3000)}),
        "fast-split": st.fixed_dictionaries(
            {"floor": st.just(floor), "probe": probe, "ratio": st.floats(0.05, 1.0)}
        ),
        "equal-finish": st.fixed_dictionaries(
            {
                "floor": st.just(floor),
                "probe": probe,
                "fraction": st.floats(0.05, 1.0),
                "speed_window": st.floats(0, 5),
            }
        ),
    }[name]


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(list(POLICIES)),
    total=st.integers(1, 20_000),
    speeds=st.lists(st.floats(10, 20_000), min_size=1, max_size=6),
    slots=st.integers(1, 2),
    remembered=st.booleans(),
    floor=st.integers(1, 200),
    data=st.data(),
)
def test_every_policy_assigns_every_item_exactly_once(
    name, total, speeds, slots, remembered, floor, data
) -> None:
    """Random speeds, job sizes, joins, losses, failed chunks (retried or given up) and caps
    on chunk size: exact coverage, floors, caps and barriers hold."""
    params = data.draw(policy_parameters(name, floor, total))
    names = [f"w{i}" for i in range(len(speeds))]
    speed = dict(zip(names, speeds))
    policy = make_policy(name, total, names, speed if remembered else None, **params)
    policy.max_chunk = data.draw(st.none() | st.integers(max(floor, fewest(total)), 5000))
    abandoned: list[Chunk] = []
    held: dict[str, list[Chunk]] = {}
    round_of: dict[Chunk, int] = {}
    issued: set[Chunk] = set()
    completed: list[Chunk] = []
    alive: set[str] = set()
    most_members = len(names)
    clock = 0.0

    def apply(assignments: list[Assign]) -> None:
        for a in assignments:
            assert a.worker in alive
            chunk = a.chunk
            # the floor is lowered only for a job too small to give every member that much
            assert policy.cut_floor() == policy.floor or total < floor * most_members
            smallest = min(params.get("chunk", policy.cut_floor()), policy.max_chunk or total)
            assert policy.max_chunk is None or chunk.count <= policy.max_chunk
            assert chunk.count >= smallest or chunk.stop == total or chunk in issued, (
                f"{chunk} is below the floor {smallest}"
            )
            if name in BARRIER_POLICIES:
                earlier = [
                    c for chunks in held.values() for c in chunks if round_of[c] < policy.round
                ]
                assert not earlier, f"round {policy.round} began while {earlier} ran"
                round_of[chunk] = policy.round
            held[a.worker].append(chunk)
            issued.add(chunk)

    def join(worker: str) -> None:
        alive.add(worker)
        held.setdefault(worker, [])
        for _ in range(slots):
            apply(policy.handle(WorkerReady(worker, at=clock)))

    for worker in names:
        join(worker)
    for _ in range(10_000):
        if policy.finished:
            break
        busy = [w for w in sorted(alive) if held[w]]
        action = data.draw(st.integers(0, 30))
        if action == 0 and len(alive) > 1:
            lost = data.draw(st.sampled_from(sorted(alive)))
            alive.remove(lost)
            held[lost] = []
            apply(policy.handle(WorkerLost(lost, at=clock)))
            continue
        if action == 1 and len(held) < 10:
            newcomer = f"w{len(held)}"
            speed[newcomer] = data.draw(st.floats(10, 20_000))
            most_members = max(most_members, len(alive) + 1)
            join(newcomer)
            continue
        if action == 4:  # another job took the worker's free slot, then gave it back
            taken = data.draw(st.sampled_from(sorted(alive)))
            assert policy.handle(WorkerBusy(taken, at=clock)) == []
            assert taken not in policy.idle
            apply(policy.handle(WorkerReady(taken, at=clock)))
            continue
        assert busy, f"{policy.remaining} items left but no worker holds any"
        worker = data.draw(st.sampled_from(busy))
        chunk = held[worker].pop(0)
        if action in (2, 3):  # the chunk failed: retried, or given up as poison
            if action == 3:
                abandoned.append(chunk)
            apply(policy.handle(ChunkFailed(worker, chunk, retry=action == 2, at=clock)))
            apply(policy.handle(WorkerReady(worker, at=clock)))
            continue
        completed.append(chunk)
        clock += chunk.count / speed[worker]
        apply(policy.handle(ChunkDone(worker, chunk, chunk.count / speed[worker], at=clock)))
        apply(policy.handle(WorkerReady(worker, at=clock)))
    assert policy.finished
    covered = sorted(i for c in completed + abandoned for i in range(c.start, c.stop))
    assert covered == list(range(total))
    assert policy.abandoned == sum(c.count for c in abandoned)
