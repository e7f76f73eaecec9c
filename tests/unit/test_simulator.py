"""The simulator's arithmetic, the calibration, and our policy's goals on the calibrated farms."""

from __future__ import annotations

from pathlib import Path
from statistics import mean

import pytest

from farm.policies import PAPER_PARAMETERS
from farm.simulation.scenarios import (
    comparison_cases,
    fit_chunk_cost,
    paper_devices,
    paper_scenario,
)
from farm.simulation.simulator import DeviceModel, Scenario, simulate

ROOT = Path(__file__).resolve().parents[2]


def run(scenario: Scenario, name: str, seed: int = 0, **params):
    return simulate(scenario, name, seed, **params)


def test_one_device_fifo_costs_overhead_per_chunk_plus_items_over_speed() -> None:
    scenario = Scenario("one", (DeviceModel("d", rate=1000.0, overhead=0.01),), total=2500)
    result = run(scenario, "fifo", chunk=1000)
    assert [c.chunk.count for c in result.chunks] == [1000, 1000, 500]
    assert result.seconds == pytest.approx(3 * 0.01 + 2.5)


def test_latency_is_paid_each_way_per_chunk_with_one_slot() -> None:
    scenario = Scenario("one", (DeviceModel("d", rate=1000.0),), total=2000, latency=0.1)
    assert run(scenario, "fifo", chunk=1000).seconds == pytest.approx(2 * (1.0 + 0.2))


def test_drift_slows_a_chunk_from_the_drift_on() -> None:
    device = DeviceModel("d", rate=100.0, drift_at=1.0, drift_factor=0.5)
    assert device.finish_time(0.0, 300, 1.0) == pytest.approx(1.0 + 200 / 50)
    assert device.finish_time(2.0, 100, 1.0) == pytest.approx(4.0)
    scenario = Scenario("drift", (device,), total=300)
    assert scenario.ideal_seconds() == pytest.approx(5.0)


def test_calibration_recovers_a_known_chunk_cost() -> None:
    sizes = (10_000, 1000, 100, 10, 1)
    speeds = tuple(n / (0.0002 + n / 1200) for n in sizes)
    fit = fit_chunk_cost(sizes, speeds)
    assert fit.rate == pytest.approx(1200, rel=1e-6)
    assert fit.overhead == pytest.approx(0.0002, rel=1e-6)
    assert paper_devices("mnist")["cpu"].overhead == pytest.approx(0.0002, rel=0.1)


def test_waste_matches_the_papers_definition_for_static() -> None:
    """Equal static split: the CPU cores set the pace, so waste = 1 - 4 * v_cpu / sum(v)."""
    scenario = paper_scenario("mnist")
    cpu, gpu = paper_devices("mnist")["cpu"], paper_devices("mnist")["gpu"]
    expected = 1 - 4 * cpu.rate / (3 * cpu.rate + gpu.rate)
    assert run(scenario, "static").waste == pytest.approx(expected, abs=0.002)


@pytest.mark.parametrize("dataset", ["mnist", "cifar10"])
def test_equal_finish_meets_its_waste_goals(dataset) -> None:
    assert run(paper_scenario(dataset), "equal-finish").waste <= 0.03
    assert run(paper_scenario(dataset, gpu_drift=0.5), "equal-finish").waste <= 0.05


def test_equal_finish_is_never_worse_than_fast_split_on_average() -> None:
    """Every comparison case with fewer than 100 devices (the bench runs them all)."""
    for case in comparison_cases():
        if len(case.scenario.devices) >= 100:
            continue
        ours = mean(run(case.scenario, "equal-finish", s).waste for s in case.seeds)
        fast = mean(
            run(case.scenario, "fast-split", s, ratio=r).waste
            for r in PAPER_PARAMETERS["fast-split"][1]
            for s in case.seeds
        )
        assert ours <= fast, f"{case.label}: equal-finish {ours:.2%} > fast-split {fast:.2%}"
