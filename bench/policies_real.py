"""Every policy on the real farm of this machine, beside the simulator's prediction.

The farm: two workers pinned to the two cores and a third, unpinned worker
with OpenCV's default threads, so that speeds differ (it competes with both).
For each policy at each of the paper's parameter values (and ours), a fresh
local farm runs a warm-up job and then a LeNet job of ``--images`` images;
the table gives measured images/s and waste (from the job's own per-worker
speeds), and the simulator's images/s for the same setup.  The simulator's
devices are calibrated once, from a separate fifo run before the others:
each worker's images per compute second and its per-chunk time outside
compute.

Each configuration runs ``--repeat`` times (fresh farms, interleaved with the
other configurations' runs would be fairer still, but slower); the row is the
run with the median throughput, since this shared machine is noisy.

    python bench/policies_real.py [--images 40000] [--repeat 3] [--only fifo,...] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import csv
import time
from typing import Any

import numpy as np

from farm.benchsuite.measure import paper_configurations
from farm.modelrepo.repository import find
from farm.ops.local import LocalFarm, cores
from farm.ops.roles import policy_arguments
from farm.policies import POLICIES
from farm.simulation.simulator import DeviceModel, Scenario, simulate
from farm.summary import JobSummary

WARM_UP = 2000


def devices() -> list[str]:
    return [f"cpu:{core}" for core in cores()[:2]] + ["cpu"]


def run_real(algo: str, params: dict[str, Any], images: np.ndarray) -> JobSummary:
    """A fresh farm, a warm-up job, then the measured job; chunks as the policy cuts them
    (no broker cap: the paper's policies as docs/scheduling.md defines them)."""
    with (
        LocalFarm(
            devices=devices(),
            algo=algo,
            broker_options=[*policy_arguments(params), "--max-chunk-seconds", "0"],
            preload=["lenet"],
        ) as local,
        local.client(timeout=600) as client,
    ):
        client.run(images[:WARM_UP], "lenet")
        return client.run(images, "lenet").summary


def calibrate(summary: JobSummary) -> list[DeviceModel]:
    """Simulated devices from a real run: speed per compute second, per-chunk time outside it."""
    models = []
    for share in summary.workers:
        outside = max(0.0, summary.seconds - share.compute_s) / max(1, share.chunks)
        models.append(DeviceModel(share.device, share.rate, outside))
    return models


def predict(
    models: list[DeviceModel], algo: str, params: dict[str, Any], total: int, remembered: bool
) -> float:
    """The simulator's images/s for the same farm and job (2 slots per worker, as the farm)."""
    scenario = Scenario("this machine", tuple(models), total, latency=0.0, slots=2)
    speeds = {m.name: m.rate for m in models} if remembered else None
    return simulate(scenario, algo, 0, speeds, **params).rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=40_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", help="comma-separated policies to run (default: all)")
    parser.add_argument("--csv", help="also write the table here")
    args = parser.parse_args()
    sample = np.load(find("lenet").sample)
    images = np.resize(sample, (args.images, *sample.shape[1:]))
    started = time.perf_counter()
    calibration = run_real("fifo", {"chunk": 500}, images)
    models = calibrate(calibration)
    print(
        f"LeNet, {args.images} images, workers {', '.join(devices())}; calibration "
        f"(fifo 500): "
        + ", ".join(f"{m.name} {m.rate:,.0f}/s + {m.overhead * 1e3:.2f} ms/chunk" for m in models)
    )
    print(
        f"{'policy':<14}{'parameter':<16}{'images/s':>10}{'waste':>8}{'simulated':>11}"
        f"{'sim/real':>9}  shares"
    )
    rows = []
    chosen = set(args.only.split(",")) if args.only else set(POLICIES)
    for algo, params in [(c.algo, c.params) for c in paper_configurations() if c.algo in chosen]:
        runs = sorted(
            (run_real(algo, params, images) for _ in range(args.repeat)), key=lambda run: run.rate
        )
        summary = runs[len(runs) // 2]
        # the warm-up job left the broker each worker's speed: equal-finish starts with them
        simulated = predict(models, algo, params, args.images, remembered=algo == "equal-finish")
        label = ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()
        )
        shares = " ".join(f"{s.device}:{s.items / summary.items:.0%}" for s in summary.workers)
        print(
            f"{algo:<14}{label:<16}{summary.rate:>10,.0f}{summary.waste:>8.1%}"
            f"{simulated:>11,.0f}{simulated / summary.rate:>9.2f}  {shares}",
            flush=True,
        )
        rows.append(
            [
                algo,
                label,
                f"{summary.rate:.0f}",
                f"{summary.waste:.4f}",
                f"{summary.theoretical_rate:.0f}",
                f"{simulated:.0f}",
            ]
        )
    errors = [abs(float(r[5]) / float(r[2]) - 1) for r in rows]
    print(
        f"simulator vs measured: mean |error| {np.mean(errors):.1%}, worst {max(errors):.1%} "
        f"({time.perf_counter() - started:.0f} s)"
    )
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(
                [
                    "policy",
                    "parameters",
                    "images_per_s",
                    "waste",
                    "theoretical_per_s",
                    "simulated_per_s",
                ]
            )
            writer.writerows(rows)


if __name__ == "__main__":
    main()
