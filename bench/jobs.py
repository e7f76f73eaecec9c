"""Several jobs on one farm: a small job behind a big one, and jobs whose tails overlap.

1. Latency: a big job runs; at its first result a second client submits a
   small job.  The small job's wall time with ``--sharing fair`` (the default)
   and ``fifo``, against the same small job alone on an idle farm.
2. Overlap: several clients submit a job each at the same moment; the farm's
   aggregate images/s against the same jobs run one after another, and its
   waste against the sum of the workers' standalone speeds (images over
   compute seconds, measured in the same runs).  Barrier policies (hat) leave
   workers idle at each job's tail; with several jobs another job's chunks
   fill those gaps.
3. Cancellation: seconds from ``Client.cancel`` until no worker holds a chunk
   of the cancelled job (asked over INFO), while another job runs on.

    python bench/jobs.py [--big 200000] [--small 5000] [--jobs 4] [--each 25000]
                         [--save bench/results/DATE-jobs.txt]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from farm import defaults
from farm.benchsuite.common import Tee, machine
from farm.client.client import JobResult
from farm.modelrepo.repository import find
from farm.ops.local import LocalFarm, cores


def start_farm(algo: str, sharing: str = defaults.SHARING) -> LocalFarm:
    devices = [f"cpu:{core}" for core in cores()]
    return LocalFarm(
        devices=devices, algo=algo, broker_options=["--sharing", sharing], preload=["lenet"]
    )


def small_behind_big(local: LocalFarm, big: np.ndarray, small: np.ndarray) -> float:
    """Seconds the small job takes when submitted at the big job's first result."""
    first_result = threading.Event()
    with local.client(timeout=600) as big_client:
        runner = threading.Thread(
            target=big_client.run,
            args=(big, "lenet"),
            kwargs={"progress": lambda count: first_result.set()},
        )
        runner.start()
        first_result.wait()
        with local.client(timeout=600) as client:
            started = time.perf_counter()
            client.run(small, "lenet")
            seconds = time.perf_counter() - started
        runner.join()
    return seconds


def run_together(local: LocalFarm, jobs: list[np.ndarray]) -> tuple[float, list[JobResult]]:
    """Every job from a client of its own, all submitted at once: wall seconds, results."""
    results: list[JobResult | None] = [None] * len(jobs)
    ready = threading.Barrier(len(jobs) + 1)

    def run(index: int) -> None:
        with local.client(timeout=600) as client:
            ready.wait()
            results[index] = client.run(jobs[index], "lenet")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    ready.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, results


def run_one_by_one(local: LocalFarm, jobs: list[np.ndarray]) -> tuple[float, list[JobResult]]:
    with local.client(timeout=600) as client:
        started = time.perf_counter()
        results = [client.run(images, "lenet") for images in jobs]
    return time.perf_counter() - started, results


def seconds_to_free_workers(local: LocalFarm, big: np.ndarray, other: np.ndarray) -> float:
    """Cancel a running job beside another; seconds until its chunks left every worker."""
    first_result = threading.Event()
    with (
        local.client(timeout=600) as doomed,
        local.client(timeout=600) as bystander,
        local.client() as watcher,
    ):
        runners = [
            threading.Thread(
                target=doomed.run,
                args=(big, "lenet"),
                kwargs={"progress": lambda count: first_result.set()},
            ),
            threading.Thread(target=bystander.run, args=(other, "lenet")),
        ]
        for runner in runners:
            runner.start()
        first_result.wait()
        [job] = [job["job"] for job in watcher.info()["jobs"] if job["total"] == len(big)]
        started = time.perf_counter()
        doomed.cancel()
        while any(job in worker["jobs"] for worker in watcher.info()["workers"]):
            pass
        seconds = time.perf_counter() - started
        for runner in runners:
            runner.join()
    return seconds


def standalone_rate(results: list[JobResult]) -> float:
    """The sum over workers of images per compute second, over all the jobs."""
    items: dict[str, float] = defaultdict(float)
    compute: dict[str, float] = defaultdict(float)
    for result in results:
        for share in result.summary.workers:
            items[share.name] += share.items
            compute[share.name] += share.compute_s
    return sum(items[name] / compute[name] for name in items if compute[name] > 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", type=int, default=200_000)
    parser.add_argument("--small", type=int, default=5_000)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--each", type=int, default=25_000)
    parser.add_argument("--save", help="Also write the report here ('-': the default path).")
    args = parser.parse_args()
    out = sys.stdout
    if args.save:
        path = Path(
            args.save if args.save != "-" else f"bench/results/{datetime.date.today()}-jobs.txt"
        )
        out = Tee(sys.stdout, path.open("w"))
    sample = np.load(find("lenet").sample)
    big = np.resize(sample, (args.big, *sample.shape[1:]))
    small = np.resize(sample, (args.small, *sample.shape[1:]))
    print(f"{machine()}; LeNet, {len(cores())} pinned workers", file=out)

    print(
        f"\n1. a {args.small:,}-image job submitted at the first result of a "
        f"{args.big:,}-image job (policy equal-finish):",
        file=out,
    )
    for sharing in ("fair", "fifo"):
        with start_farm("equal-finish", sharing) as local:
            with local.client(timeout=600) as client:
                client.run(small, "lenet")  # warm-up: speeds known, models loaded
                started = time.perf_counter()
                client.run(small, "lenet")
                alone = time.perf_counter() - started
            behind = small_behind_big(local, big, small)
        print(
            f"  --sharing {sharing}: {behind:6.2f} s (alone on the farm: {alone:.2f} s, "
            f"{behind / alone:.1f}x)",
            file=out,
            flush=True,
        )

    jobs = [np.resize(sample, (args.each + 17 * i, *sample.shape[1:])) for i in range(args.jobs)]
    total = sum(len(images) for images in jobs)
    print(
        f"\n2. {args.jobs} jobs of about {args.each:,} images: one after another, then "
        f"all at once from {args.jobs} clients:",
        file=out,
    )
    for algo in ("hat", "equal-finish"):
        with start_farm(algo) as local:
            run_one_by_one(local, jobs[:1])  # warm-up
            for label, runner in (("one by one", run_one_by_one), ("all at once", run_together)):
                seconds, results = runner(local, jobs)
                rate, theoretical = total / seconds, standalone_rate(results)
                print(
                    f"  {algo:<13} {label:<12} {rate:>8,.0f} images/s, waste "
                    f"{1 - rate / theoretical:6.1%} (theoretical {theoretical:,.0f})",
                    file=out,
                    flush=True,
                )

    print(
        f"\n3. a {args.big:,}-image job cancelled at its first result while a "
        f"{args.each:,}-image job runs:",
        file=out,
    )
    with start_farm("equal-finish") as local:
        run_one_by_one(local, jobs[:1])  # warm-up: speeds known, chunks capped
        freed = [seconds_to_free_workers(local, big, jobs[0]) for _ in range(3)]
    print(
        f"  every worker free of its chunks after {', '.join(f'{s * 1000:.0f}' for s in freed)}"
        f" ms (three runs)",
        file=out,
        flush=True,
    )


if __name__ == "__main__":
    main()
