"""Every policy in the simulator, on the paper's two calibrated farms and more.

Prints, for MNIST and CIFAR-10 on 3 CPU workers + 1 GPU worker (fitted from
the paper's Table 2), every policy at each of the paper's parameter values:
simulated images/s, speed relative to one CPU core (the layout of the
paper's Tables 4 and 5, with the paper's own figure beside it) and waste.
Then our policy against fast-split on every scenario of
``farm.simulation.scenarios.comparison_cases``.  Writes the same as CSV and a PNG
(bars like the paper's Figures 3 to 5) into the output folder.

    python bench/policies.py [--out bench/results] [--total 100000] [--quick]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

from farm.policies import PAPER_PARAMETERS, POLICIES
from farm.simulation.scenarios import (
    PAPER_RELATIVE,
    Case,
    comparison_cases,
    cpu_core_speed,
    paper_devices,
    paper_scenario,
)
from farm.simulation.simulator import Scenario, SimResult, simulate

OURS = "equal-finish"
DATASETS = ("mnist", "cifar10")


@dataclass
class Row:
    scenario: str
    policy: str
    parameter: str
    value: Any
    rate: float
    waste: float
    chunks: float
    relative: float | None = None  # speed / one CPU core - 1


def run(
    scenario: Scenario,
    policy: str,
    params: dict[str, Any],
    seeds: tuple[int, ...],
    speeds: dict[str, float] | None = None,
) -> tuple[float, float, float]:
    """Mean images/s, waste and chunk count over the seeds."""
    results: list[SimResult] = [
        simulate(scenario, policy, seed, speeds, **params) for seed in seeds
    ]
    return (
        mean(r.rate for r in results),
        mean(r.waste for r in results),
        mean(len(r.chunks) for r in results),
    )


def measured_speeds(scenario: Scenario, policy: str) -> dict[str, float]:
    """Each device's speed as a first job under ``policy`` measured it (items / compute s)."""
    result = simulate(scenario, policy, seed=99)
    items: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for chunk in result.chunks:
        items[chunk.worker] = items.get(chunk.worker, 0) + chunk.chunk.count
        seconds[chunk.worker] = seconds.get(chunk.worker, 0) + chunk.finished - chunk.started
    return {name: items[name] / seconds[name] for name in items}


def paper_rows(dataset: str, total: int) -> list[Row]:
    """Every policy at each paper parameter value, plus ours cold and warm."""
    scenario = paper_scenario(dataset, total=total)
    unit = cpu_core_speed(dataset)
    rows = [Row(dataset, "gpu alone", "", "", paper_devices(dataset)["gpu"].rate, 0.0, 1)]
    for name in POLICIES:
        parameter, values = PAPER_PARAMETERS.get(name, ("", (None,)))
        for value in values:
            params = {parameter: value} if parameter and value != () else {}
            rows.append(Row(dataset, name, parameter, value, *run(scenario, name, params, (0,))))
    warm = measured_speeds(scenario, OURS)
    rows.append(Row(dataset, OURS, "speeds", "remembered", *run(scenario, OURS, {}, (0,), warm)))
    for row in rows:
        row.relative = row.rate / unit - 1
    return rows


def comparison_rows(cases: list[Case]) -> list[Row]:
    """Ours and fast-split (each paper ratio) on every case."""
    rows = []
    for case in cases:
        for ratio in PAPER_PARAMETERS["fast-split"][1]:
            rows.append(
                Row(
                    case.label,
                    "fast-split",
                    "ratio",
                    ratio,
                    *run(case.scenario, "fast-split", {"ratio": ratio}, case.seeds),
                )
            )
        rows.append(Row(case.label, OURS, "", "", *run(case.scenario, OURS, {}, case.seeds)))
    return rows


def value_text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "equal" if value == () else str(value)


def print_paper_table(dataset: str, rows: list[Row]) -> None:
    print(f"\n{dataset}: 3 CPU workers + 1 GPU worker, simulated")
    print(
        f"{'policy':<14}{'parameter':<18}{'images/s':>10}{'vs 1 core':>11}{'paper':>9}"
        f"{'waste':>8}{'chunks':>8}"
    )
    for row in rows:
        paper = PAPER_RELATIVE[dataset].get("gpu" if row.policy == "gpu alone" else row.policy)
        paper_text = f"{paper:+.1%}" if paper is not None else ""
        parameter = f"{row.parameter}={value_text(row.value)}" if row.parameter else ""
        print(
            f"{row.policy:<14}{parameter:<18}{row.rate:>10,.0f}{row.relative:>+11.1%}"
            f"{paper_text:>9}{row.waste:>8.1%}{row.chunks:>8.0f}"
        )
    print("mean over the paper's parameter values (the paper's Tables 4/5 average the same way):")
    for name in POLICIES:
        mine = [r for r in rows if r.policy == name and r.parameter != "speeds"]
        relative = mean(r.relative for r in mine)
        waste = mean(r.waste for r in mine)
        if name in PAPER_RELATIVE[dataset]:
            print(
                f"  {name:<13} {relative:+7.1%} (paper {PAPER_RELATIVE[dataset][name]:+.1%})"
                f"   waste {waste:5.1%} (paper {paper_waste(dataset, name):.1%})"
            )
        else:
            print(f"  {name:<13} {relative:+7.1%} (ours)   waste {waste:5.1%}")


def paper_waste(dataset: str, policy: str) -> float:
    """The paper's waste for a policy: 1 - its speed / (3 CPU cores + GPU), from Tables 2, 4, 5."""
    cpu = cpu_core_speed(dataset)
    gpu = cpu * (1 + PAPER_RELATIVE[dataset]["gpu"])
    return 1 - cpu * (1 + PAPER_RELATIVE[dataset][policy]) / (3 * cpu + gpu)


def print_comparison(rows: list[Row]) -> None:
    print(f"\n{OURS} against fast-split (waste; noisy cases are means over seeds):")
    print(f"{'scenario':<36}{'fast-split mean':>16}{'best':>8}{'worst':>8}{OURS:>14}")
    for label in dict.fromkeys(r.scenario for r in rows):
        fast = [r.waste for r in rows if r.scenario == label and r.policy == "fast-split"]
        ours = next(r.waste for r in rows if r.scenario == label and r.policy == OURS)
        print(f"{label:<36}{mean(fast):>16.2%}{min(fast):>8.2%}{max(fast):>8.2%}{ours:>14.2%}")


def write_csv(path: Path, rows: list[Row]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            [
                "scenario",
                "policy",
                "parameter",
                "value",
                "images_per_s",
                "relative_to_one_core",
                "waste",
                "chunks",
            ]
        )
        for r in rows:
            writer.writerow(
                [
                    r.scenario,
                    r.policy,
                    r.parameter,
                    value_text(r.value),
                    f"{r.rate:.1f}",
                    "" if r.relative is None else f"{r.relative:.4f}",
                    f"{r.waste:.5f}",
                    f"{r.chunks:.0f}",
                ]
            )


def plot(path: Path, paper: dict[str, list[Row]]) -> None:
    """Figures 3 and 4 (images/s per policy and parameter) and 5 (waste per policy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    for axis, dataset in zip(axes[:2], DATASETS):
        rows = [r for r in paper[dataset] if r.policy != "gpu alone"]
        labels = [f"{r.policy}\n{value_text(r.value)}" if r.parameter else r.policy for r in rows]
        colours = [plt.cm.tab10(list(POLICIES).index(r.policy)) for r in rows]
        axis.bar(range(len(rows)), [r.rate for r in rows], color=colours)
        ideal = paper_scenario(dataset).standalone_rate
        axis.axhline(ideal, color="black", linestyle="--", linewidth=1)
        axis.text(0, ideal, " sum of standalone speeds", va="bottom", fontsize=8)
        axis.set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
        axis.set_ylabel("images/s")
        axis.set_title(f"{dataset}: 3 CPU + 1 GPU workers (simulated from Table 2)")
    width = 0.38
    names = list(POLICIES)
    for offset, dataset in ((-width / 2, "mnist"), (width / 2, "cifar10")):
        wastes = [
            mean(r.waste for r in paper[dataset] if r.policy == n and r.parameter != "speeds")
            for n in names
        ]
        axes[2].bar(
            [i + offset for i in range(len(names))],
            [100 * w for w in wastes],
            width,
            label=f"{dataset} (simulated)",
        )
    for marker, dataset in (("o", "mnist"), ("s", "cifar10")):
        axes[2].scatter(
            [i for i, n in enumerate(names) if n in PAPER_RELATIVE[dataset]],
            [100 * paper_waste(dataset, n) for n in names if n in PAPER_RELATIVE[dataset]],
            marker=marker,
            color="black",
            zorder=3,
            label=f"{dataset} (paper)",
        )
    axes[2].set_xticks(range(len(names)), names, rotation=30, fontsize=8)
    axes[2].set_ylabel("waste, % (mean over parameter values)")
    axes[2].set_title("waste per policy")
    axes[2].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--total", type=int, default=100_000, help="images per paper job")
    parser.add_argument(
        "--quick", action="store_true", help="skip the scenarios with 100 and 1 000 devices"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print("calibration (least squares on Table 2, t(n) = a + n/v):")
    for dataset in DATASETS:
        for kind, fit in paper_devices(dataset).items():
            print(
                f"  {dataset:<8} {kind}: v = {fit.rate:7.1f} images/s, a = "
                f"{fit.overhead * 1e3:.3f} ms"
            )
    paper = {dataset: paper_rows(dataset, args.total) for dataset in DATASETS}
    for dataset in DATASETS:
        print_paper_table(dataset, paper[dataset])
    cases = comparison_cases()
    if args.quick:
        cases = [c for c in cases if len(c.scenario.devices) < 100]
    comparison = comparison_rows(cases)
    print_comparison(comparison)
    stem = args.out / f"{datetime.date.today()}-policies-sim"
    write_csv(stem.with_suffix(".csv"), [*paper["mnist"], *paper["cifar10"], *comparison])
    plot(stem.with_suffix(".png"), paper)
    print(f"\nwrote {stem}.csv and {stem}.png in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
