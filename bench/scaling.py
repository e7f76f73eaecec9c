"""Two pinned workers against one on a 20 000-image LeNet job, as ``farm run`` starts them.

Alternates one-worker and two-worker farms ``--repeat`` times and prints the
best throughput of each and their ratio (goal on this 2-core machine: >= 1.8x),
with the measured waste of each two-worker run.

    python bench/scaling.py [--images 20000] [--repeat 3] [--chunk 500]
"""

from __future__ import annotations

import argparse

import numpy as np

from farm.local import LocalFarm, cores
from farm.repository import find
from farm.summary import JobSummary


def run_farm(devices: list[str], images: np.ndarray, chunk: int) -> JobSummary:
    with LocalFarm(devices, "fifo", ["--chunk", str(chunk)], preload=["lenet"]) as local, \
            local.client(timeout=600) as client:
        client.run(images[:chunk], "lenet")  # warm-up
        return client.run(images, "lenet").summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=500)
    args = parser.parse_args()
    sample = np.load(find("lenet").sample)
    images = np.resize(sample, (args.images, *sample.shape[1:]))
    available = cores()
    one, many = [f"cpu:{available[-1]}"], [f"cpu:{core}" for core in available]
    best: dict[int, JobSummary] = {}
    for attempt in range(args.repeat):
        for devices in (one, many):
            summary = run_farm(devices, images, args.chunk)
            print(f"run {attempt + 1}: {len(devices)} worker(s) {summary.rate:>9,.0f} images/s, "
                  f"waste {summary.waste:6.1%}", flush=True)
            if len(devices) not in best or summary.rate > best[len(devices)].rate:
                best[len(devices)] = summary
    ratio = best[len(many)].rate / best[1].rate
    print(f"\nLeNet, {args.images} images, fifo chunk {args.chunk}: 1 worker "
          f"{best[1].rate:,.0f}/s, {len(many)} workers {best[len(many)].rate:,.0f}/s, "
          f"ratio {ratio:.2f}x (goal >= 1.8x on 2 cores), waste {best[len(many)].waste:.1%}")
    print(best[len(many)].format())


if __name__ == "__main__":
    main()
