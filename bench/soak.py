"""A bounded soak: 4 client processes x 250 LeNet jobs of mixed sizes on one local farm.

A broker and 2 pinned workers (``LocalFarm``) serve 4 client processes at
once.  Each client runs 250 jobs whose sizes are drawn log-uniformly from 1 to
5 000 (a fixed seed per client), each a slice at a random offset of a base
array made of the bundled LeNet sample's digits in a seeded random order.  The
client computes the base array's reference outputs once, in-process (OpenCV,
one thread, the prototxt's batch: what a worker runs), and checks every job:
outputs within 1e-5 of the reference slice, no duplicates, no failed items.

Resident memory (VmRSS) of the broker, each worker and each client is read
twice: when every client has finished its first 50 jobs (they wait on a
barrier while it is read) and after all 250.  Growth above 10% between the two,
or any wrong job, fails the run (exit status 1).

    python bench/soak.py [--clients 4] [--jobs 250] [--checkpoint 50] [--max-size 5000]
                         [--algo equal-finish] [--save bench/results/DATE-soak.txt]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

from farm.benchsuite.common import machine, saved, status_kib
from farm.modelrepo.repository import find
from farm.ops.local import LocalFarm, cores

#: Allowed RSS growth between the checkpoint and the end.
GROWTH_LIMIT = 0.10
#: Images in each client's base array (jobs are slices of it).
BASE_IMAGES = 20_000
ATOL = 1e-5
#: Seconds the driver waits for the clients at a barrier before giving up.
BARRIER_TIMEOUT = 600.0


@dataclass(frozen=True)
class ClientPlan:
    index: int
    endpoint: str
    jobs: int
    checkpoint: int
    max_size: int
    seed: int


def job_sizes(rng: np.random.Generator, jobs: int, max_size: int) -> np.ndarray:
    """Sizes drawn log-uniformly from 1 to ``max_size``."""
    return np.clip(np.exp(rng.uniform(0, np.log(max_size + 1), jobs)).astype(int), 1, max_size)


def reference(base: np.ndarray) -> np.ndarray:
    """LeNet outputs of ``base`` in this process: OpenCV, one thread, the prototxt's batch."""
    from farm.engines.autoselect import load_engine
    from farm.engines.engine import limit_threads

    limit_threads(1)
    engine = load_engine(find("lenet"), "opencv", threads=1)
    return engine.run(base[:, np.newaxis] if base.ndim == 3 else base)


def client_main(plan: ClientPlan, checkpoint: Any, finish: Any, start: Any, results: Any) -> None:
    """One client process: make its jobs, wait at the barriers, report what it saw."""
    try:
        report = run_client(plan, checkpoint, finish, start)
    except Exception:  # noqa: BLE001  (any error: tell the driver, free the others)
        for barrier in (start, checkpoint, finish):
            barrier.abort()
        report = {"index": plan.index, "error": traceback.format_exc()}
    results.put(report)


def run_client(plan: ClientPlan, checkpoint: Any, finish: Any, start: Any) -> dict[str, Any]:
    from farm.client.client import Client

    rng = np.random.default_rng(plan.seed)
    sample = np.load(find("lenet").sample)
    base = sample[rng.integers(0, len(sample), BASE_IMAGES)]
    expected = reference(base)
    sizes = job_sizes(rng, plan.jobs, plan.max_size)
    offsets = [int(rng.integers(0, BASE_IMAGES - size + 1)) for size in sizes]
    problems: list[str] = []
    images = resubmissions = 0
    start.wait(BARRIER_TIMEOUT)
    with Client(plan.endpoint, timeout=120) as client:
        for number, (size, offset) in enumerate(zip(sizes, offsets), 1):
            result = client.run(base[offset : offset + size], "lenet")
            images += int(size)
            resubmissions += result.resubmissions
            problem = check_job(result, expected[offset : offset + size])
            if problem:
                problems.append(
                    f"client {plan.index} job {number} ({size} images at {offset}): {problem}"
                )
            if number == plan.checkpoint:
                checkpoint.wait(BARRIER_TIMEOUT)
    report = {
        "index": plan.index,
        "jobs": plan.jobs,
        "images": images,
        "resubmissions": resubmissions,
        "problems": problems,
        "error": None,
    }
    finish.wait(BARRIER_TIMEOUT)
    return report


def check_job(result: Any, expected: np.ndarray) -> str | None:
    """Why a job's result is wrong, or None."""
    if result.failed:
        return f"{sum(f.count for f in result.failed)} images failed: {result.failed[0].error}"
    if result.duplicates:
        return f"{result.duplicates} duplicate results"
    outputs = result.outputs.reshape(expected.shape)
    difference = float(np.abs(outputs - expected).max())
    if not np.isfinite(difference) or difference > ATOL:
        return f"outputs differ from the reference by up to {difference:.3g}"
    return None


def wait_for_parties(barrier: Any, processes: list[mp.Process]) -> None:
    """Block until every client waits at ``barrier``; RuntimeError if one died or broke it."""
    deadline = time.monotonic() + BARRIER_TIMEOUT
    while barrier.n_waiting < len(processes):
        if barrier.broken or any(not p.is_alive() for p in processes):
            raise RuntimeError("a client process failed before the barrier")
        if time.monotonic() > deadline:
            raise RuntimeError("clients did not reach the barrier in time")
        time.sleep(0.01)


def measure(local: LocalFarm, devices: list[str], processes: list[mp.Process]) -> dict[str, int]:
    """Process name -> VmRSS in KiB."""
    figures = {"broker": status_kib(local.broker.pid)}
    for device, worker in zip(devices, local.workers):
        figures[f"worker {device}"] = status_kib(worker.pid)
    for index, process in enumerate(processes):
        figures[f"client {index}"] = status_kib(process.pid)
    return figures


def print_memory(first: dict[str, int], last: dict[str, int], checkpoint: int, jobs: int) -> bool:
    """The RSS table; True when every process stayed within the growth limit."""
    within_all = True
    after_first, after_last = f"after {checkpoint} (MiB)", f"after {jobs} (MiB)"
    print(f"{'process':<16} {after_first:>16} {after_last:>16} {'change':>8}  within 10%")
    for name, before in first.items():
        after = last[name]
        change = (after - before) / before
        within = change <= GROWTH_LIMIT
        within_all &= within
        print(
            f"{name:<16} {before / 1024:>16.1f} {after / 1024:>16.1f} {change:>+8.1%}  "
            f"{'yes' if within else 'NO'}"
        )
    total_first, total_last = sum(first.values()), sum(last.values())
    print(
        f"{'all':<16} {total_first / 1024:>16.1f} {total_last / 1024:>16.1f} "
        f"{(total_last - total_first) / total_first:>+8.1%}"
    )
    return within_all


def soak(args: argparse.Namespace) -> int:
    """Run the soak and print the report; the exit status."""
    devices = [f"cpu:{core}" for core in cores()[: args.workers]]
    spawn = mp.get_context("spawn")
    parties = args.clients + 1
    start, checkpoint, finish = (spawn.Barrier(parties) for _ in range(3))
    results = spawn.Queue()
    print(machine())
    print(
        f"soak: {len(devices)} workers ({', '.join(devices)}), policy {args.algo}; "
        f"{args.clients} client processes x {args.jobs} LeNet jobs, sizes log-uniform "
        f"1-{args.max_size}, seeds {args.seed}..{args.seed + args.clients - 1}",
        flush=True,
    )
    with LocalFarm(devices=devices, algo=args.algo, preload=["lenet"]) as local:
        plans = [
            ClientPlan(i, local.endpoint, args.jobs, args.checkpoint, args.max_size, args.seed + i)
            for i in range(args.clients)
        ]
        processes = [
            spawn.Process(target=client_main, args=(plan, checkpoint, finish, start, results))
            for plan in plans
        ]
        for process in processes:
            process.start()
        try:
            wait_for_parties(start, processes)
            start.wait()
            started = time.perf_counter()
            wait_for_parties(checkpoint, processes)
            at_checkpoint = time.perf_counter() - started
            first = measure(local, devices, processes)
            checkpoint.wait()
            wait_for_parties(finish, processes)
            wall = time.perf_counter() - started
            last = measure(local, devices, processes)
            finish.wait()
        except (RuntimeError, threading.BrokenBarrierError):
            for barrier in (start, checkpoint, finish):
                barrier.abort()
            for process in processes:
                process.join(30)
            while not results.empty():
                report = results.get(timeout=5)
                if report.get("error"):
                    print(f"client {report['index']} failed:\n{report['error']}")
            print("FAILED: the soak did not finish")
            return 1
        reports = sorted((results.get(timeout=60) for _ in processes), key=lambda r: r["index"])
        for process in processes:
            process.join(60)
    jobs = sum(r["jobs"] for r in reports)
    images = sum(r["images"] for r in reports)
    problems = [p for r in reports for p in r["problems"]]
    print(
        f"\nresident memory (VmRSS) when every client had run {args.checkpoint} jobs "
        f"({at_checkpoint:.1f} s in) and after all {args.jobs}:"
    )
    within = print_memory(first, last, args.checkpoint, args.jobs)
    print(
        f"\njobs {jobs:,}, images {images:,}, wall {wall:.1f} s, "
        f"{images / wall:,.0f} images/s; resubmissions "
        f"{sum(r['resubmissions'] for r in reports)}"
    )
    print(f"wrong jobs (outputs off by > {ATOL:g}, duplicates or failures): {len(problems)}")
    for problem in problems[:20]:
        print(f"  {problem}")
    verdict = not problems and within
    print(
        "PASS"
        if verdict
        else "FAIL: "
        + "; ".join(
            part
            for part, bad in (("wrong jobs", problems), ("memory grew > 10%", not within))
            if bad
        )
    )
    return 0 if verdict else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=250, help="jobs per client")
    parser.add_argument(
        "--checkpoint", type=int, default=50, help="jobs per client before the first memory reading"
    )
    parser.add_argument("--max-size", type=int, default=5000, help="largest job, in images")
    parser.add_argument("--workers", type=int, default=2, help="pinned workers (one per core)")
    parser.add_argument("--algo", default="equal-finish", help="the broker's policy")
    parser.add_argument("--seed", type=int, default=1, help="seed of client 0 (client i: +i)")
    parser.add_argument(
        "--save",
        type=Path,
        default=Path(f"bench/results/{date.today()}-soak.txt"),
        help="also write the report here ('-': nowhere)",
    )
    args = parser.parse_args()
    if not 0 < args.checkpoint < args.jobs:
        parser.error("--checkpoint must be between 0 and --jobs")
    if not 0 < args.max_size <= BASE_IMAGES:
        parser.error(f"--max-size must be between 1 and {BASE_IMAGES}")
    sys.exit(saved(args.save, lambda: soak(args)))


if __name__ == "__main__":
    main()
