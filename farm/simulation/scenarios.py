"""Simulated farms calibrated from the paper's Table 2 (docs/scheduling.md).

The paper's testbed ran 3 CPU workers (one core each; the fourth core fed
the GPU) and 1 GPU worker.  Each device's per-chunk cost ``t(n) = a + n/v``
is fitted by least squares on the time per image ``1/speed(n) = a/n + 1/v``
over the five submitted sizes of Table 2.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from farm.simulation.simulator import DeviceModel, Scenario, steady

#: Table 2: images/second on 10 000 images by how many are submitted at once.
TABLE2_SIZES = (10_000, 1_000, 100, 10, 1)
TABLE2: dict[str, dict[str, tuple[float, ...]]] = {
    "mnist": {
        "cpu": (1191.9, 1187.2, 1181.9, 1140.1, 953.8),
        "gpu": (2714.4, 2711.7, 2568.2, 2441.5, 1798.6),
    },
    "cifar10": {
        "cpu": (397.2, 396.9, 397.0, 393.1, 364.2),
        "gpu": (2475.2, 2448.4, 2441.1, 2195.5, 1652.9),
    },
}

#: Tables 4/5: each policy's speed relative to one CPU core, minus one (averaged over parameters).
PAPER_RELATIVE: dict[str, dict[str, float]] = {
    "mnist": {
        "gpu": 1.277,
        "static": 2.623,
        "quick": 3.599,
        "sliced": 3.668,
        "hat": 3.742,
        "fifo": 3.534,
        "fast-split": 3.781,
    },
    "cifar10": {
        "gpu": 5.232,
        "static": 2.621,
        "quick": 6.312,
        "sliced": 7.082,
        "hat": 7.133,
        "fifo": 6.666,
        "fast-split": 7.364,
    },
}

CPU_WORKERS = 3
JOB_SIZE = 100_000


@dataclass(frozen=True)
class Fit:
    """``t(n) = overhead + n / rate``."""

    rate: float
    overhead: float


def fit_chunk_cost(sizes: tuple[int, ...], speeds: tuple[float, ...]) -> Fit:
    """Least-squares fit of ``1/speed = overhead/n + 1/rate``."""
    n = np.asarray(sizes, dtype=float)
    per_item = 1.0 / np.asarray(speeds, dtype=float)
    design = np.column_stack([1.0 / n, np.ones_like(n)])
    (overhead, inverse_rate), *_ = np.linalg.lstsq(design, per_item, rcond=None)
    return Fit(1.0 / inverse_rate, max(0.0, overhead))


def paper_devices(dataset: str) -> dict[str, Fit]:
    return {kind: fit_chunk_cost(TABLE2_SIZES, speeds) for kind, speeds in TABLE2[dataset].items()}


def cpu_core_speed(dataset: str) -> float:
    """One CPU core's standalone speed, the paper's unit for Tables 4/5 (10 000 images)."""
    return TABLE2[dataset]["cpu"][0]


def paper_scenario(
    dataset: str,
    total: int = JOB_SIZE,
    noise: float = 0.0,
    gpu_drift: float | None = None,
    latency: float = 0.0,
    slots: int = 1,
) -> Scenario:
    """3 CPU workers + 1 GPU worker on ``dataset`` ("mnist" or "cifar10").

    ``gpu_drift``: the GPU runs at this fraction of its speed from the middle
    of the job on (the middle of the ideal schedule).
    """
    fits = paper_devices(dataset)
    devices = [
        DeviceModel(f"cpu{i}", fits["cpu"].rate, fits["cpu"].overhead, noise)
        for i in range(CPU_WORKERS)
    ]
    devices.append(DeviceModel("gpu", fits["gpu"].rate, fits["gpu"].overhead, noise))
    name = dataset
    scenario = Scenario(name, tuple(devices), total, latency, slots)
    if gpu_drift is not None:
        middle = scenario.ideal_seconds() / 2
        devices[-1] = replace(devices[-1], drift_at=middle, drift_factor=gpu_drift)
        scenario = replace(scenario, devices=tuple(devices))
    return scenario


def many_devices(
    count: int, dataset: str = "mnist", per_device: int = 25_000, noise: float = 0.05
) -> Scenario:
    """``count`` workers in the paper's mix (3 CPU cores per GPU), ``per_device`` items each."""
    fits = paper_devices(dataset)
    devices = tuple(
        DeviceModel(f"gpu{i}", fits["gpu"].rate, fits["gpu"].overhead, noise)
        if i % 4 == 3
        else DeviceModel(f"cpu{i}", fits["cpu"].rate, fits["cpu"].overhead, noise)
        for i in range(count)
    )
    return Scenario(f"{dataset} x{count} devices", devices, per_device * count)


def spread_devices(
    count: int = 8, spread: float = 10.0, total: int = JOB_SIZE, noise: float = 0.05, seed: int = 0
) -> Scenario:
    """``count`` workers whose speeds spread log-uniformly over ``spread`` times
    (100..100*spread/s)."""
    rng = np.random.default_rng(seed)
    rates = 100.0 * spread ** rng.random(count)
    devices = tuple(
        DeviceModel(f"w{i}", steady(float(rate)), 0.0002, noise) for i, rate in enumerate(rates)
    )
    return Scenario(f"{count} devices, speeds x{spread:g} apart", devices, total)


@dataclass(frozen=True)
class Case:
    """A scenario to compare policies on, and the seeds to average its noise over."""

    label: str
    scenario: Scenario
    seeds: tuple[int, ...] = (0,)


def comparison_cases() -> list[Case]:
    """Every scenario the policy comparison runs (bench/policies.py)."""
    noisy = tuple(range(5))
    many_seeds = tuple(range(20))  # small farms run fast: more seeds, less luck
    cases = []
    for dataset in ("mnist", "cifar10"):
        cases += [
            Case(f"{dataset}: calibrated", paper_scenario(dataset)),
            Case(f"{dataset}: 5% noise", paper_scenario(dataset, noise=0.05), noisy),
            Case(f"{dataset}: GPU halves mid-job", paper_scenario(dataset, gpu_drift=0.5)),
            Case(
                f"{dataset}: GPU halves, 5% noise",
                paper_scenario(dataset, noise=0.05, gpu_drift=0.5),
                noisy,
            ),
            Case(
                f"{dataset}: 1 ms latency, 2 slots", paper_scenario(dataset, latency=0.001, slots=2)
            ),
            Case(f"{dataset}: 10 000 images", paper_scenario(dataset, total=10_000)),
        ]
    cases += [
        Case(
            f"mnist mix: {n} devices",
            many_devices(n),
            many_seeds if n <= 4 else noisy if n <= 16 else noisy[:2] if n <= 100 else noisy[:1],
        )
        for n in (1, 4, 16, 100, 1000)
    ]
    cases += [
        Case("8 devices, speeds 10x apart", spread_devices(8), many_seeds),
        Case("64 devices, speeds 30x apart", spread_devices(64, 30.0, 400_000), noisy),
    ]
    return cases
