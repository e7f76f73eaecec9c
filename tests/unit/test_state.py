"""FarmState in-process: events in, instructions out, no sockets and no clock.

The same state runs in the broker (a system test records a real broker's events and
replays them) and in the simulator (the simulated farms below).  Events come from the
kit that drives the state (``farm.simulation.kit``).
"""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from typing import get_args

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from farm.broker import events as ev
from farm.broker.events import matching
from farm.broker.facts import JobOptions
from farm.broker.inputs import PROBE
from farm.broker.state import FarmState, SchedulingConfig
from farm.policies import POLICIES
from farm.simulation import kit
from farm.simulation.kit import data_for, failure_for, joined, result_for, submitted
from farm.simulation.simulator import DeviceModel, FarmSimulation, Scenario

CLIENT, OTHER = b"client-1", b"client-2"
A, B = b"worker-a", b"worker-b"
#: The scheduling core: it speaks neither the protocol nor its messages (farm.broker.wire
#: maps them onto its events and instructions).
CORE = (
    "farm.broker.state",
    "farm.broker.core",
    "farm.broker.admission",
    "farm.broker.attempts",
    "farm.broker.caps",
    "farm.broker.clients",
    "farm.broker.inputs",
    "farm.broker.keeping",
    "farm.broker.membership",
    "farm.broker.order",
    "farm.broker.results",
    "farm.broker.scheduling",
    "farm.broker.jobs",
    "farm.broker.registry",
    "farm.broker.events",
    "farm.broker.facts",
    "farm.broker.blame",
    "farm.broker.backups",
    "farm.broker.churn",
    "farm.policies",
)
WIRE = {"farm.wire.protocol", "farm.wire.messages"}


def submit(
    job: str, total: int, at: float = 0.0, client: bytes = CLIENT, **options
) -> ev.JobSubmitted:
    return submitted(job, total, at=at, client=client, options=JobOptions(**options))


def started(state: FarmState, event: ev.JobSubmitted) -> list[ev.Instruction]:
    """What a SUBMIT causes once its client answered the probe (``farm.broker.inputs``)."""
    return kit.answer_probes(state.handle, state.handle(event))


def need(job: str, chunk: int, start: int, count: int, client: bytes = CLIENT) -> ev.SendNeed:
    return ev.SendNeed(client=client, job=job, chunk=chunk, start=start, count=count)


def task(
    worker: bytes, job: str, chunk: int, start: int, count: int, attempt: int = 1
) -> ev.SendTask:
    return ev.SendTask(
        worker=worker,
        job=job,
        chunk=chunk,
        attempt=attempt,
        start=start,
        count=count,
        model=kit.MODEL,
        digest=kit.DIGEST,
        dtype="float32",
        item_shape=kit.ITEM_SHAPE,
        engine=None,
    )


def fifo(chunk: int, **config) -> FarmState:
    return FarmState(
        SchedulingConfig(algo="fifo", params={"chunk": chunk}, max_chunk_seconds=0.0, **config),
        first_chunk_id=1,
    )


def imports_of(path: str) -> set[str]:
    """The modules a file imports (``from farm import x``: ``farm.x`` too)."""
    tree = ast.parse(open(path).read())
    names = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_the_core_imports_neither_the_protocol_nor_its_messages() -> None:
    """The state and every farm module it loads import neither ``farm.wire.protocol`` nor
    ``farm.wire.messages`` (not even for types), and neither is loaded."""
    code = (
        "import sys, json; import farm.broker.state, farm.simulation.kit; "
        f"print(json.dumps([sorted(n for n in {sorted(WIRE)!r} if n in sys.modules), "
        "{n: m.__file__ for n, m in sys.modules.items() if n.startswith('farm')}]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    loaded, files = json.loads(out)
    assert loaded == []
    assert all(any(name == core or name.startswith(f"{core}.") for name in files) for core in CORE)
    for path in files.values():
        assert not imports_of(path) & WIRE, path


def test_a_chunk_goes_need_data_task_result_done() -> None:
    state = fifo(100)
    assert state.handle(joined(A)) == []
    assert started(state, submit("j", 150)) == [need("j", 1, 0, 100)]
    assert state.handle(data_for(need("j", 1, 0, 100), 0.1)) == [task(A, "j", 1, 0, 100)]
    result = result_for(task(A, "j", 1, 0, 100), 0.5, 0.25)
    out = state.handle(result)
    assert out == [
        ev.SendResult(
            client=CLIENT, result=result, worker="host:1/cpu", attempt=1, trace=(0.0, 0.1, 0.5)
        ),
        need("j", 2, 100, 50),
    ]
    state.handle(data_for(out[1], 0.6))
    out = state.handle(result_for(task(A, "j", 2, 100, 50), 0.8, 0.1))
    assert [type(i) for i in out] == [ev.SendResult, ev.SendDone]
    assert out[1].summary.workers[0].items == 150
    assert state.jobs == {} and state.outcomes["done"] == 1


def test_the_higher_priority_job_takes_the_free_slot() -> None:
    state = fifo(10)
    started(state, submit("low", 100))
    started(state, submit("high", 100, client=OTHER, priority=5))
    assert state.handle(joined(A)) == [need("high", 1, 0, 10, client=OTHER)]


def test_fair_sharing_alternates_slots_between_equal_jobs() -> None:
    state = fifo(10)
    started(state, submit("first", 100))
    started(state, submit("second", 100, client=OTHER))
    out = state.handle(joined(A, slots=2))
    assert [(i.job, i.start) for i in out] == [("first", 0), ("second", 0)]


def test_a_worker_lost_to_silence_or_goodbye_charges_nothing_and_its_chunk_moves() -> None:
    state = fifo(10, max_attempts=1)  # one charge would make the chunk suspect
    state.handle(joined(A))
    started(state, submit("j", 10))
    state.handle(data_for(need("j", 1, 0, 10), 0.1))
    assert state.handle(ev.WorkerLeft(worker=A, at=0.2)) == []
    assert state.handle(joined(B, 0.3)) == [need("j", 2, 0, 10)]
    out = state.handle(data_for(need("j", 2, 0, 10), 0.4))
    assert [(i.worker, i.attempt) for i in out] == [(B, 2)]  # its second run, uncharged
    # the lost worker's late answer is dropped, and it is told to register again
    late = result_for(task(A, "j", 1, 0, 10), 0.5, 0.1)
    assert state.handle(late) == [ev.DropWorker(worker=A)]
    assert state.stats.late_replies == 1
    out = state.handle(result_for(out[0], 0.6, 0.1))
    summary = out[-1].summary
    assert (summary.failed_attempts, summary.lost_attempts, summary.items_run) == (0, 1, 20)


def test_a_crashed_worker_charges_only_the_chunk_it_was_computing() -> None:
    state = fifo(10)
    state.handle(joined(A, slots=2))
    first, second = started(state, submit("j", 20))
    state.handle(data_for(first, 0.1))
    state.handle(data_for(second, 0.2))  # queued behind the first on the worker
    state.handle(ev.WorkerLeft(worker=A, at=0.3, reason="its connection closed", crashed=True))
    marks = state.jobs["j"].evidence.marks
    assert [(m.start, m.charged) for m in marks] == [(0, True), (10, False)]
    assert "died while computing it" in marks[0].error


def test_a_failed_chunk_runs_again_whole_on_another_device() -> None:
    state = fifo(10)
    state.handle(joined(A, device="cpu:0", pid=1))
    state.handle(joined(B, device="cpu:1", pid=2))
    first, second = started(state, submit("j", 20))
    (task_a,) = state.handle(data_for(first, 0.1))
    (task_b,) = state.handle(data_for(second, 0.1))
    # A fails its chunk and is free first, but the chunk waits for another device
    assert state.handle(failure_for(task_a, 0.2, "oom")) == []
    out = state.handle(result_for(task_b, 0.3, 0.1))
    assert len(out) == 2 and matching(out, ev.SendNeed, start=0, count=10) == out[1:]
    (retry,) = state.handle(data_for(out[1], 0.4))
    assert (retry.worker, retry.attempt) == (B, 2)  # whole, not narrowed: one device failed it
    assert state.stats.narrowed_chunks == 0


def run_with_poison(
    state: FarmState, workers: dict[bytes, dict], total: int, bad: set[int]
) -> tuple[list[int], list[ev.SendFailed]]:
    """Answer every NEED and TASK at once: a chunk holding a ``bad`` item fails on any
    worker (``workers``: each one's facts for ``kit.worker_facts``).  The items delivered
    (with repeats, if any) and the FAILED sent."""
    driver = kit.Driver(state)
    queue: list[ev.FarmEvent] = [joined(w, **facts) for w, facts in workers.items()]
    queue.append(submit("j", total))
    clock = 0.0
    while queue:
        clock += 0.01
        for instruction in driver.feed(queue.pop(0)):
            match instruction:
                case ev.SendNeed():
                    queue.append(data_for(instruction, clock))
                case ev.SendTask(start=start, count=count):
                    if bad & set(range(start, start + count)):
                        queue.append(
                            failure_for(instruction, clock, f"bad item in {start}+{count}")
                        )
                    else:
                        queue.append(result_for(instruction, clock, 0.001 * count))
    assert driver.sent is not None
    delivered = [
        item
        for forward in matching(driver.sent, ev.SendResult)
        for item in range(forward.result.start, forward.result.start + forward.result.count)
    ]
    return delivered, matching(driver.sent, ev.SendFailed)


def test_a_chunk_failing_on_two_devices_is_narrowed_to_its_bad_image() -> None:
    state = fifo(1000)
    workers = {A: {"device": "cpu:0", "pid": 1}, B: {"device": "cpu:1", "pid": 2}}
    delivered, failed = run_with_poison(state, workers, 5000, {1234})
    assert sorted(delivered) == [i for i in range(5000) if i != 1234]  # each exactly once
    assert [(f.start, f.count) for f in failed] == [(1234, 1)]
    assert failed[0].error.startswith("failed by itself 2 times on 2 device(s); last: ")
    assert "bad item in 1234+1" in failed[0].error  # the error of its own last attempt
    assert state.stats.narrowed_chunks == 10  # 1 000 items halved down to one
    assert state.outcomes["done"] == 1


def test_on_one_device_a_chunk_is_narrowed_after_max_attempts() -> None:
    state = fifo(100, max_attempts=3)
    delivered, failed = run_with_poison(state, {A: {}}, 300, {7, 250})
    assert sorted(delivered) == [i for i in range(300) if i not in (7, 250)]
    assert [(f.start, f.count) for f in failed] == [(7, 1), (250, 1)]
    assert all(f.error.startswith("failed by itself 3 times on 1 device(s)") for f in failed)


def test_no_item_runs_more_than_max_runs_times() -> None:
    state = fifo(10, max_runs=3)
    started(state, submit("j", 10))
    out: list[ev.Instruction] = []
    for run in range(3):
        worker = bytes([run])
        first = state.handle(joined(worker, run))[0]
        state.handle(data_for(first, run + 0.1))
        out = state.handle(ev.WorkerLeft(worker=worker, at=run + 0.2, reason="silent for 1.0 s"))
    assert [type(i) for i in out] == [ev.SendFailed, ev.SendDone]
    assert out[0].error.startswith("ran 3 times without a result, its workers lost or failing")
    assert out[1].summary.failed_items == 10


def test_a_closed_client_connection_ends_its_jobs_and_keeps_their_chunks_results() -> None:
    """The chunk its worker is computing still finishes: its result is held for a client
    that resumes the job naming it, and the worker's slot frees."""
    state = fifo(10)
    state.handle(joined(A))
    sent = state.handle(data_for(started(state, submit("j", 100))[0], 0.1))[0]
    assert state.handle(ev.ClientLeft(client=CLIENT, at=0.2)) == []
    assert state.jobs == {} and state.outcomes["expired"] == 1
    assert state.handle(result_for(sent, 0.5, 0.3)) == []
    assert state.stats.kept_results == 1 and len(state.kept) == 1
    assert state.workers[A].free_slots == 1


def test_a_fatal_failure_fails_the_job_and_frees_the_worker() -> None:
    state = fifo(10)
    state.handle(joined(A))
    started(state, submit("j", 20))
    state.handle(data_for(need("j", 1, 0, 10), 0.1))
    out = state.handle(failure_for(task(A, "j", 1, 0, 10), 0.2, "no such layer", fatal=True))
    assert out == [
        ev.SendError(peer=CLIENT, error="items 0..9 failed on host:1/cpu: no such layer", job="j")
    ]
    assert state.workers[A].free_slots == 1


def test_chunks_are_capped_at_seconds_of_the_fastest_worker_and_shorter_when_shared() -> None:
    state = FarmState(SchedulingConfig(algo="fifo", params={"chunk": 1000}, max_chunk_seconds=0.5))
    state.handle(joined(A))
    first = started(state, submit("j", 10_000))[0]
    assert first.count == 1000  # no speed known yet
    sent = state.handle(data_for(first, 0.0))[0]
    out = state.handle(result_for(sent, 1.0, 1.0))  # 1 000 items/s: chunks of 0.5 s are 500
    assert out[-1].count == 500
    started(state, submit("k", 10_000, at=1.0, client=OTHER))
    state.handle(data_for(out[-1], 1.1))
    out = state.handle(result_for(task(A, "j", out[-1].chunk, 1000, 500), 1.6, 0.5))
    assert out[-1].count == 125  # a quarter while two jobs share the farm


def test_silence_expires_workers_and_clients_on_the_tick() -> None:
    state = fifo(10, heartbeat=1.0, liveness=3)
    state.handle(joined(A))
    started(state, submit("j", 100))
    state.handle(data_for(need("j", 1, 0, 10), 0.1))
    state.handle(ev.WorkerHeard(worker=A, at=2.0))
    # the client: silent 4.5 s (the chunk in flight finishes, kept for a resumption)
    assert state.handle(ev.Tick(at=4.5)) == []
    assert state.outcomes["expired"] == 1 and A in state.workers
    assert state.handle(ev.Tick(at=5.5)) == [] and A not in state.workers


def test_a_job_past_its_timeout_is_cancelled_with_its_summary() -> None:
    state = fifo(10)
    started(state, submit("j", 100, timeout=2.0))
    state.handle(ev.ClientHeard(client=CLIENT, job="j", at=2.0))
    out = state.handle(ev.Tick(at=2.5))
    assert (
        len(out) == 1
        and matching(
            out, ev.SendCancel, peer=CLIENT, job="j", reason="the job's timeout of 2 s passed"
        )
        == out
    )
    assert out[0].summary is not None


def test_unknown_jobs_and_bad_submissions_are_refused_with_reasons() -> None:
    state = fifo(10)
    assert state.handle(ev.JobCancelled(client=CLIENT, job="nope", at=0.0)) == [
        ev.SendError(peer=CLIENT, error="the broker has no job nope", job="nope", unknown_job=True)
    ]
    started(state, submit("j", 10))
    assert started(state, submit("j", 10)) == [
        ev.SendError(peer=CLIENT, error="job j already exists", job="j")
    ]
    wrong = submitted("k", 10, client=CLIENT, item_shape=(2,))
    assert state.handle(wrong) == [
        ev.SendError(
            peer=CLIENT,
            error="images of shape (2,) do not match model 'm', which takes (1,)",
            job="k",
        )
    ]


def test_matching_picks_instructions_by_type_and_fields() -> None:
    out = [need("j", 1, 0, 10), ev.DropWorker(worker=A), need("j", 2, 10, 10), need("k", 3, 0, 10)]
    assert matching(out, ev.SendNeed, job="j") == [out[0], out[2]]
    assert matching(out, ev.SendNeed, job="j", start=10) == [out[2]]
    assert matching(out, ev.DropWorker) == [out[1]]
    with pytest.raises(TypeError, match="SendNeed has no field worker"):
        matching(out, ev.SendNeed, worker=A)


# ------------------------------------------------------------------------- simulated farms


def test_simulated_farm_runs_several_jobs_through_a_lost_worker_with_caps() -> None:
    devices = (
        DeviceModel("fast", 2000.0, 0.001),
        DeviceModel("slow", 500.0, 0.001),
        DeviceModel("doomed", 1000.0, 0.001),
    )
    farm = FarmSimulation(
        Scenario("three", devices, 0, latency=0.0005, slots=2),
        SchedulingConfig(algo="equal-finish", max_chunk_seconds=0.2),
    )
    farm.submit("a", 20_000)
    farm.submit("b", 5_000, at=1.0, options=JobOptions(priority=1))
    farm.lose("doomed", at=2.0)
    farm.run()
    assert set(farm.ended) == {"a", "b"} and not farm.failed and not farm.errors
    for job, total in (("a", 20_000), ("b", 5_000)):
        covered = np.zeros(total, int)
        for run in farm.runs[job]:
            covered[run.chunk.start : run.chunk.stop] += 1
            assert run.chunk.count <= 2000 * 0.2  # the cap, on the fastest worker
        assert (covered == 1).all()  # every item once: the lost worker's chunks were rerun
    assert not any(r.worker == "doomed" and r.finished > 2.0 for r in farm.runs["a"])
    assert farm.ended["b"] < farm.ended["a"]  # priority


@pytest.mark.parametrize("algo", [name for name in POLICIES if name != "fifo"])
@pytest.mark.parametrize("remembered", [False, True])
def test_a_nine_item_job_runs_on_both_workers_of_a_simulated_farm(algo, remembered) -> None:
    """The broker's own state, its slots filled breadth-first: a job smaller than the farm's
    first round is still split over every free worker (fifo's fixed chunk cannot be)."""
    devices = (DeviceModel("cpu0", 6000.0, 0.0002), DeviceModel("cpu1", 6000.0, 0.0002))
    farm = FarmSimulation(Scenario("two", devices, 0, slots=2), SchedulingConfig(algo=algo))
    if remembered:
        farm.remember({"cpu0": 6000.0, "cpu1": 6000.0})
    farm.submit("tiny", 9)
    farm.run()
    shares = {}
    for run in farm.runs["tiny"]:
        shares[run.worker] = shares.get(run.worker, 0) + run.chunk.count
    assert sorted(shares.values()) == [4, 5]


# --------------------------------------------------------------- the broker runs this state


@settings(max_examples=60, deadline=None)
@given(
    algo=st.sampled_from(sorted(POLICIES)),
    total=st.integers(1, 3000),
    rates=st.lists(st.floats(100, 5000), min_size=1, max_size=4),
    slots=st.integers(1, 2),
    poison=st.dictionaries(st.integers(0, 2999), st.sampled_from(["fail", "crash"]), max_size=3),
    losses=st.lists(st.tuples(st.floats(0, 3), st.integers(0, 3), st.booleans()), max_size=6),
    max_attempts=st.integers(1, 3),
    seed=st.integers(0, 1000),
)
def test_under_churn_and_poison_every_item_comes_back_once_and_only_poison_fails(
    algo, total, rates, slots, poison, losses, max_attempts, seed
) -> None:
    """Every policy, in a simulated farm whose workers die (charging the chunk they compute)
    or go silent (charging nothing) and are restarted, with items that fail or crash every
    worker: every clean item comes back exactly once, and exactly the poison items are
    reported, each alone."""
    devices = tuple(DeviceModel(f"cpu{i}", rate) for i, rate in enumerate(rates))
    poison = {item: kind for item, kind in poison.items() if item < total}
    farm = FarmSimulation(
        Scenario("churn", devices, 0, latency=0.001, slots=slots),
        SchedulingConfig(algo=algo, max_chunk_seconds=0.2, max_attempts=max_attempts),
        seed,
        poison=poison,
        restart=0.05,
    )
    farm.submit("j", total)
    charged = 0  # crashes charge the chunk computed: fewer than max_attempts fail no image
    for at, index, crashed in losses:
        crashed = crashed and charged < max_attempts - 1
        charged += crashed
        farm.lose(devices[index % len(devices)].name, at, crashed)
    farm.run()
    assert "j" in farm.ended and not farm.errors
    covered = np.zeros(total, int)
    for run in farm.runs.get("j", []):
        covered[run.chunk.start : run.chunk.stop] += 1
    failed = farm.failed.get("j", [])
    assert sorted((f.start, f.count) for f in failed) == [(item, 1) for item in sorted(poison)]
    for item in poison:
        covered[item] += 1
    assert (covered == 1).all()


def test_chunks_shorten_while_workers_keep_dying_and_not_for_one_death() -> None:
    """Three devices of 1 000 images/s with 1 s chunks; a crash every 0.5 s from 2 s on.
    Ten crashes within the 30 s window call for chunks of sqrt(2 x 0.01 / (10 / 90)) =
    0.42 s; every image still comes back once."""
    devices = tuple(DeviceModel(f"cpu{i}", 1000.0) for i in range(3))
    farm = FarmSimulation(
        Scenario("churn", devices, 0, latency=0.001, slots=2),
        SchedulingConfig(algo="fifo", params={"chunk": 100_000}, max_chunk_seconds=1.0),
        restart=0.05,
    )
    farm.remember({device.name: 1000.0 for device in devices})
    farm.submit("j", 60_000)
    crashes = [2.0 + 0.5 * k for k in range(20)]
    for k, at in enumerate(crashes):
        farm.lose(devices[k % 3].name, at, crashed=True)
    farm.run()
    runs = farm.runs["j"]
    covered = np.zeros(60_000, int)
    for run in runs:
        covered[run.chunk.start : run.chunk.stop] += 1
    assert (covered == 1).all() and "j" not in farm.failed
    before = [r.chunk.count for r in runs if r.assigned < crashes[0]]
    during = [r.chunk.count for r in runs if crashes[9] < r.assigned < crashes[-1]]
    assert before and max(before) == 1000  # one second of the fastest worker
    # chunks the policy cuts now (ranges run again keep the size they had)
    assert during and np.median(during) <= 1000 * math.sqrt(2 * 0.01 * 90 / 10) + 1


def test_one_death_does_not_shorten_chunks() -> None:
    state = FarmState(
        SchedulingConfig(algo="fifo", params={"chunk": 100_000}, max_chunk_seconds=1.0)
    )
    state.handle(joined(A, device="cpu:0", pid=1))
    (first,) = started(state, submit("j", 1_000_000))
    sent = state.handle(data_for(first, 0.0))[0]
    out = state.handle(result_for(sent, 100.0, 100.0))  # 1 000 images/s
    assert out[-1].count == 1000
    state.handle(joined(B, 100.0, device="cpu:1", pid=2))
    state.handle(joined(b"c", 100.0, device="cpu:2", pid=3))
    state.handle(ev.WorkerLeft(worker=B, at=100.1, reason="its connection closed", crashed=True))
    # one loss in 30 s among two workers: chunks of sqrt(2 x 0.01 x 60) = 1.1 s, over the cap
    assert state.churn.losses and state.jobs["j"].policy.max_chunk == 1000


def test_a_worker_brings_its_speed_and_its_first_chunk_is_capped() -> None:
    """After a broker restart the job comes back before its workers: their READY carries
    their speeds, so the first chunk is one second's worth, not the whole job."""
    state = FarmState(SchedulingConfig(algo="equal-finish", max_chunk_seconds=1.0))
    started(state, submit("j", 100_000))
    out = state.handle(joined(A, device="cpu:0", speeds={kit.MODEL: (5000, 1.0)}))
    assert [(need.start, need.count) for need in out] == [(0, 5000)]


def test_a_one_image_job_failing_is_given_up_once_without_upsetting_its_policy() -> None:
    state = fifo(10, max_attempts=1)
    state.handle(joined(A))
    first = started(state, submit("j", 1))[0]
    sent = state.handle(data_for(first, 0.1))[0]
    out = state.handle(failure_for(sent, 0.2, "bad pixels"))
    assert [type(i) for i in out] == [ev.SendFailed, ev.SendDone]
    assert out[0].error == "failed by itself 1 times on 1 device(s); last: host:1/cpu: bad pixels"


def test_every_instruction_names_the_event_that_caused_it() -> None:
    """The state numbers the events it handles from 1; each instruction, whichever module
    made it, carries its event's number (``stimulus``), which equality ignores."""
    state = fifo(10, max_attempts=1)
    first = need("j", 1, 0, 1)
    events: list[ev.FarmEvent] = [
        joined(A),
        submit("j", 1),  # the probe's NEED
        data_for(need("j", PROBE, 0, 1), 0.05),  # proven: NEED
        data_for(first, 0.1),
        failure_for(task(A, "j", 1, 0, 1), 0.2, "bad pixels"),  # FAILED, DONE
        submit("k", 20),
        data_for(need("k", PROBE, 0, 1), 0.25),
        data_for(need("k", 2, 0, 10), 0.3),
        result_for(task(A, "k", 2, 0, 10), 0.4, 0.1),  # RESULT, NEED
        ev.JobCancelled(client=CLIENT, job="k", at=0.5),
        ev.JobCancelled(client=CLIENT, job="nope", at=0.6),  # ERROR
        ev.WorkerHeard(worker=B, at=0.7),  # DropWorker
    ]
    kinds = set()
    for number, event in enumerate(events, start=1):
        out = state.handle(event)
        assert state.stimulus == number
        assert [i.stimulus for i in out] == [number] * len(out), event
        kinds |= {type(i) for i in out}
    assert kinds == set(get_args(ev.Instruction))
    assert first == ev.SendNeed(client=CLIENT, job="j", chunk=1, start=0, count=1, stimulus=3)


def test_a_close_names_the_peer_of_that_very_connection_not_of_its_descriptor() -> None:
    """fd 9 carried an INFO-only connection; it closed and a worker connected on fd 9
    before the broker read the close: the worker is not taken for dead."""
    from farm.broker.connections import Connections

    connections = Connections()
    connections.on_accepted(9)  # `farm status`, never filed
    connections.on_closed(9)
    connections.on_accepted(9)  # the worker
    connections.seen(9, A)
    assert connections.closed_peers() == []
    connections.on_closed(9)
    assert connections.closed_peers() == [A]
    assert connections.closed_peers() == []
