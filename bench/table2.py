"""The paper's Table 2 on this machine: one worker through the farm vs the model in-process.

For each chunk size (1, 10, 100, 1 000, 10 000) one pinned worker runs the job
through a real broker with compute batches equal to the chunk, beside the same
model run in-process, pinned to the same core, at the same batch size.  The
farm's per-chunk overhead is the extra time divided by the chunk count.  The
last column is the farm as users run it: the worker cuts chunks into compute
batches of its default size, which is what keeps big chunks fast.
Measurements alternate farm / in-process and keep the best of ``--repeat``.

    python bench/table2.py [--images 10000] [--repeat 3] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import numpy as np

from farm.engines.autoselect import load_engine
from farm.modelrepo.repository import find
from farm.ops.local import LocalFarm, cores
from farm.workers.worker import Device, prepare_process

CHUNKS = (1, 10, 100, 1000, 10000)
GOALS = {1000: 0.97, 100: 0.95, 10: 0.80}


def in_process_rate(images: np.ndarray, batch: int, core: int) -> float:
    """Images/s of the engine run here, pinned to ``core``, one thread, batches of ``batch``."""
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        engine = load_engine(find("lenet"), "opencv", batch=batch, threads=1)
        engine.run(images[:batch])  # warm-up
        started = time.perf_counter()
        engine.run(images)
        return len(images) / (time.perf_counter() - started)
    finally:
        os.sched_setaffinity(0, saved)
        import cv2

        cv2.setNumThreads(-1)


def farm_rate(
    images: np.ndarray, chunk: int, core: int, repeat: int, batch: int | None
) -> list[float]:
    """Images/s of whole jobs through a broker and one worker pinned to ``core``.

    ``batch`` is the worker's compute batch; None keeps the worker's default.
    """
    options = [] if batch is None else ["--batch", str(batch)]
    with (
        LocalFarm(
            devices=[f"cpu:{core}"],
            algo="fifo",
            broker_options=["--chunk", str(chunk)],
            worker_options=options,
            preload=["lenet"],
        ) as local,
        local.client(timeout=600) as client,
    ):
        client.run(images[:chunk], "lenet")  # warm-up
        return [client.run(images, "lenet").summary.rate for _ in range(repeat)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--csv", help="also write the table here")
    args = parser.parse_args()
    core = cores()[-1]
    prepare_process(Device("cpu", None))  # same malloc settings as a worker
    sample = np.load(find("lenet").sample)[:, None]
    images = np.resize(sample, (args.images, *sample.shape[1:]))
    rows = []
    batched = f"farm, batch {find('lenet').batch}/s"
    print(
        f"LeNet, {args.images} images, one worker pinned to core {core}, best of {args.repeat}",
        file=sys.stderr,
    )
    print(
        f"{'chunk':>6} {'in-process/s':>13} {'farm/s':>9} {'farm/in-process':>16} "
        f"{'overhead/chunk':>15} {'goal':>8}   {batched:>16}"
    )
    for chunk in CHUNKS:
        farm = max(farm_rate(images, chunk, core, args.repeat, chunk))
        batched = max(farm_rate(images, chunk, core, args.repeat, None))
        local = max(in_process_rate(images, chunk, core) for _ in range(args.repeat))
        chunks = -(-args.images // chunk)
        overhead_us = (args.images / farm - args.images / local) / chunks * 1e6
        goal = GOALS.get(chunk)
        verdict = (
            "" if goal is None else ("ok" if farm / local >= goal else "MISS") + f" {goal:.0%}"
        )
        rows.append(
            {
                "chunk": chunk,
                "in_process_per_s": round(local, 1),
                "farm_per_s": round(farm, 1),
                "ratio": round(farm / local, 4),
                "overhead_us_per_chunk": round(overhead_us, 1),
                "farm_default_batch_per_s": round(batched, 1),
            }
        )
        print(
            f"{chunk:>6} {local:>13,.0f} {farm:>9,.0f} {farm / local:>16.1%} "
            f"{overhead_us:>12,.0f} us {verdict:>8}   {batched:>16,.0f}",
            flush=True,
        )
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
