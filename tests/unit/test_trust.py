"""The state's side of trust: answers refused and workers quarantined, spot checks across
devices, and fair admission (probes, parked jobs, a limit per client), driven by plain
events as the broker and the simulator drive it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from farm.broker import events as ev
from farm.broker import wire
from farm.broker.admission import MAX_CLIENT_JOBS
from farm.broker.inputs import NEED_DEADLINE, PROBE
from farm.broker.quarantine import QUARANTINE_STRIKES
from farm.broker.state import FarmState, SchedulingConfig
from farm.broker.verify import agree
from farm.simulation import kit

#: What an honest worker answers for items start..start+count: one row per item.
Rows = Callable[[bytes, int, int], np.ndarray]


def honest(worker: bytes, start: int, count: int) -> np.ndarray:
    items = np.arange(start, start + count, dtype=np.float32)[:, None]
    return np.hstack([items % 7, items % 3]).astype(np.float32)


def farm_of(workers: int, **config) -> tuple[FarmState, kit.Driver, list[bytes]]:
    state = FarmState(
        SchedulingConfig(algo="fifo", params={"chunk": 50}, max_chunk_seconds=0, **config)
    )
    driver = kit.Driver(state)
    names = [f"w{n}".encode() for n in range(workers)]
    for n, name in enumerate(names):
        driver.join(name, device=f"cpu:{n}", pid=n + 1)
    return state, driver, names


def run(
    driver: kit.Driver, job: str, total: int, rows: Rows = honest, **how
) -> list[ev.Instruction]:
    """Submit ``job`` and answer every NEED and TASK at once, each worker's rows as
    ``rows`` makes them; every instruction that went out."""
    pending = driver.submit(job, total, **how)
    out: list[ev.Instruction] = list(pending)
    at = 1.0
    while pending:
        instruction = pending.pop(0)
        at += 0.01
        if isinstance(instruction, ev.SendNeed):
            more = driver.feed(kit.data_for(instruction, at))
        elif isinstance(instruction, ev.SendTask):
            values = rows(instruction.worker, instruction.start, instruction.count)
            problem = wire.values_problem(values, [], softmax=False)  # as the broker checks
            result = dataclasses.replace(
                kit.result_for(instruction, at, 0.005),
                outputs=None if problem else values,
                output_shape=(2,),
                problem=problem.text if problem else None,
                in_values=bool(problem),
            )
            more = driver.feed(result)
        else:
            continue
        out += more
        pending += more
    return out


def delivered(out: list[ev.Instruction], total: int) -> np.ndarray:
    """The client's outputs: each result's rows written in order, corrections over them."""
    outputs = np.full((total, 2), np.nan, np.float32)
    for send in ev.matching(out, ev.SendResult):
        result = send.result
        outputs[result.start : result.start + result.count] = result.outputs
    return outputs


def done(out: list[ev.Instruction]) -> ev.SendDone:
    (finished,) = ev.matching(out, ev.SendDone)
    return finished


def test_spot_checks_find_the_worker_that_answers_otherwise_and_correct_its_chunks() -> None:
    """Three devices; one answers 1 too high.  Its first disagreement goes to a third
    device, it is quarantined, and every chunk it computed comes again as a correction."""
    state, driver, (w0, w1, liar) = farm_of(3)

    def rows(worker: bytes, start: int, count: int) -> np.ndarray:
        return honest(worker, start, count) + (worker == liar)

    out = run(driver, "j", 3000, rows, options=kit.JobOptions(verify=0.05))
    summary = done(out).summary
    assert np.array_equal(delivered(out, 3000), honest(w0, 0, 3000))
    assert state.workers[liar].quarantined and "spot check" in state.workers[liar].quarantined
    assert summary.disagreements >= 1 and summary.corrected > 0 and summary.verified > 0
    corrections = [s.result for s in ev.matching(out, ev.SendResult) if s.corrects]
    assert sum(r.count for r in corrections) == summary.corrected
    assert all(s.worker != "host:3/cpu:2" for s in ev.matching(out, ev.SendResult) if s.corrects)


def test_honest_devices_agree_and_checks_cost_about_their_fraction() -> None:
    state, driver, _ = farm_of(2)
    out = run(driver, "j", 10_000, options=kit.JobOptions(verify=0.01))
    summary = done(out).summary
    assert summary.disagreements == 0 and not any(e.quarantined for e in state.workers.values())
    assert 50 <= summary.verified <= 200  # 1% of 10 000, drawn per chunk
    checked = sum(t.count for t in ev.matching(out, ev.SendTask)) - 10_000
    assert checked == summary.verified


def test_two_devices_that_disagree_with_no_third_are_reported_not_quarantined() -> None:
    state, driver, (_, other) = farm_of(2)

    def rows(worker: bytes, start: int, count: int) -> np.ndarray:
        return honest(worker, start, count) * (2.0 if worker == other else 1.0)

    summary = done(run(driver, "j", 1000, rows, options=kit.JobOptions(verify=0.1))).summary
    assert summary.disagreements >= 1 and summary.unverified > 0
    assert not any(entry.quarantined for entry in state.workers.values())


def test_a_worker_with_non_finite_answers_is_quarantined_and_the_outputs_stay_exact() -> None:
    """Its NaN rows are refused; another device answers them well, each refusal then
    counts against it, and at QUARANTINE_STRIKES it gets no more tasks."""
    state, driver, (good, bad) = farm_of(2)

    def rows(worker: bytes, start: int, count: int) -> np.ndarray:
        values = honest(worker, start, count)
        return np.full_like(values, np.nan) if worker == bad else values

    out = run(driver, "j", 2000, rows)
    assert np.array_equal(delivered(out, 2000), honest(good, 0, 2000))
    entry = state.workers[bad]
    assert entry.quarantined and entry.strikes >= QUARANTINE_STRIKES
    summary = done(out).summary
    assert summary.bad_answers >= QUARANTINE_STRIKES and summary.failed_items == 0
    assert summary.quarantined and summary.quarantined[0].startswith("host:2/cpu:1")


def test_images_that_give_non_finite_outputs_everywhere_blame_no_worker() -> None:
    state, driver, _ = farm_of(2, max_runs=4)

    def rows(worker: bytes, start: int, count: int) -> np.ndarray:
        values = honest(worker, start, count)
        values[(np.arange(start, start + count) == 7)] = np.inf  # item 7 overflows anywhere
        return values

    summary = done(run(driver, "j", 100, rows)).summary
    assert summary.failed_items >= 1 and summary.items == 100
    assert not any(e.quarantined or e.strikes for e in state.workers.values())


def test_agreement_within_a_precision_is_a_tolerance_and_across_precisions_the_top_classes() -> (
    None
):
    first = np.array([[0.7, 0.2, 0.1], [0.1, 0.5, 0.4]], np.float32)
    assert agree(first, first * (1 + 1e-4), same_precision=True)
    assert not agree(first, first + 0.01, same_precision=True)
    swapped = np.array([[0.6, 0.3, 0.1], [0.1, 0.4, 0.5]], np.float32)  # a near tie flips
    assert agree(first, swapped, same_precision=False)
    assert not agree(first, swapped[:, ::-1], same_precision=False)


def test_a_job_holds_no_slot_until_its_client_answers_the_probe() -> None:
    state, driver, _ = farm_of(1)
    (probe,) = driver.feed(kit.submitted("silent", 100, client=b"silent"))
    assert (probe.chunk, probe.start, probe.count) == (PROBE, 0, 1)
    out = driver.submit("real", 100)  # its probe answered at once
    assert [n.job for n in ev.matching(out, ev.SendNeed)] == ["real"]
    assert not state.jobs["silent"].proven


def test_a_client_that_leaves_a_need_unanswered_is_parked_and_its_slots_go_on() -> None:
    state, driver, _ = farm_of(1)
    (need,) = driver.submit("slow", 100)
    others = driver.submit("other", 100, client=b"other")
    assert not ev.matching(others, ev.SendNeed)  # the one slot waits for slow's input
    out = driver.feed(ev.Tick(at=NEED_DEADLINE + 0.1))
    (given,) = ev.matching(out, ev.SendNeed)
    assert given.job == "other" and state.jobs["slow"].parked_until is not None
    late = driver.feed(kit.data_for(need, NEED_DEADLINE + 0.2))  # alive after all
    assert not ev.matching(late, ev.SendTask) and state.jobs["slow"].proven
    assert state.stats.parked_jobs == 1


def test_one_client_may_hold_only_so_many_jobs() -> None:
    _, driver, _ = farm_of(1)
    for n in range(MAX_CLIENT_JOBS):
        driver.feed(dataclasses.replace(kit.submitted(f"j{n}", 10), owner="peer"))
    (refused,) = driver.feed(dataclasses.replace(kit.submitted("one-more", 10), owner="peer"))
    assert isinstance(refused, ev.SendError) and "holds 32 jobs already" in refused.error
    (probe,) = driver.feed(dataclasses.replace(kit.submitted("theirs", 10), owner="another"))
    assert isinstance(probe, ev.SendNeed)


def test_a_job_whose_checks_lost_their_only_other_device_ends_on_the_next_tick() -> None:
    """A check runs on the one other device, which dies with it: the check has nowhere
    left to run, so it is dropped (counted unverified) and the job ends (at the latest on
    the next tick) instead of waiting for ever."""
    state, driver, _ = farm_of(2)
    pending = driver.submit("j", 200, options=kit.JobOptions(verify=0.1))
    out: list[ev.Instruction] = []
    at, died = 1.0, None
    while pending:
        instruction = pending.pop(0)
        at += 0.01
        if isinstance(instruction, ev.SendNeed):
            more = driver.feed(kit.data_for(instruction, at))
        elif isinstance(instruction, ev.SendTask):
            record = state.awaited_result(instruction.worker, instruction.chunk)
            if died is None and record is not None and record.check is not None:
                died = instruction.worker
                more = driver.feed(ev.WorkerLeft(worker=died, at=at, crashed=True))
            else:
                values = honest(instruction.worker, instruction.start, instruction.count)
                result = kit.result_for(instruction, at, 0.005)
                more = driver.feed(dataclasses.replace(result, outputs=values))
        else:
            continue
        out += more
        pending += more
    assert died is not None
    if "j" in state.jobs:  # nothing came after the death: the tick ends it
        assert state.jobs["j"].computed
        out += driver.feed(ev.Tick(at=at + 0.1))
    summary = done(out).summary
    assert summary.unverified > 0 and summary.items == 200


def test_a_check_that_fails_on_a_device_is_not_run_there_again() -> None:
    state, driver, (first, checker, third) = farm_of(3)
    pending = driver.submit("j", 100, options=kit.JobOptions(verify=0.1))
    seen: list[tuple[bytes, int]] = []
    at = 1.0
    while pending:
        instruction = pending.pop(0)
        at += 0.01
        if isinstance(instruction, ev.SendNeed):
            pending += driver.feed(kit.data_for(instruction, at))
        elif isinstance(instruction, ev.SendTask):
            record = state.awaited_result(instruction.worker, instruction.chunk)
            if record is not None and record.check is not None:
                seen.append((instruction.worker, instruction.start))
                if instruction.worker != third:  # checks fail everywhere but on the third
                    pending += driver.feed(kit.failure_for(instruction, at, "cannot decode"))
                    continue
            values = honest(instruction.worker, instruction.start, instruction.count)
            result = kit.result_for(instruction, at, 0.005)
            pending += driver.feed(dataclasses.replace(result, outputs=values))
    assert len(seen) == len(set(seen)), "a check ran twice on one device"
    assert "j" not in state.jobs, "the job ended"
