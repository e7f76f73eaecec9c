"""One core's images/s per model and engine, at its best compute batch, and auto's pick.

For each model (the bundled ones and the public nets of ``bench/nets``) and each
backend installed here, a fresh process pinned to one core (one thread, as a
worker) runs the model at several compute batch sizes.  Another fresh, pinned
process then lets ``--backend auto`` choose (nothing remembered), and the table
shows its pick beside the fastest engine of this run: the pick's own rate in
the sweep over the fastest rate, which should be 0.95 or more.  For the bundled
models the best batch of each backend is confirmed through the farm: one real
worker process with ``--backend B --batch best`` behind a real broker.  A last
part shows the net shrinking back after a large batch (resident memory of
CaffeNet at its resting batch, at batch 64, and after the shrink).

    python bench/models.py [--device gpu:0] [--models lenet,resnet50] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from farm.engines.engine import available_backends, limit_threads
from farm.engines.modelcheck import check_inputs
from farm.modelrepo.repository import available, find, prepare
from farm.ops.local import LocalFarm, cores
from farm.workers.config import Device

#: The public nets (prototxts from their original repositories, seeded weights).
NETS = Path(__file__).with_name("nets")
os.environ["FARM_MODELS"] = os.pathsep.join(
    p for p in (os.environ.get("FARM_MODELS", ""), str(NETS)) if p
)

#: Compute batches tried, and images per measurement, by model.
BATCHES = {
    "lenet": (1, 16, 64, 256),
    "cifar10_quick": (1, 16, 64, 256),
    "caffenet": (1, 4, 10, 32),
    "googlenet": (1, 4, 16),
    "mobilenet_v2": (1, 4, 16),
    "resnet50": (1, 4, 8),
    "densenet121": (1, 4, 8),
}
IMAGES = {
    "lenet": 6000,
    "cifar10_quick": 3000,
    "caffenet": 64,
    "googlenet": 32,
    "mobilenet_v2": 48,
    "resnet50": 16,
    "densenet121": 16,
}
BUNDLED = ("lenet", "cifar10_quick", "caffenet")


def images_for(model: str, count: int) -> np.ndarray:
    """``count`` images: the model's sample repeated, or seeded random ones (as ``models
    check``)."""
    spec = find(model)
    return np.resize(check_inputs(spec, count), (count, *spec.item_shape))


def sweep(model: str, backend: str, device: str) -> dict[int, float]:
    """In this (pinned) process: batch -> images/s, best of two runs each."""
    from farm.benchsuite.measure import engine_rates

    return dict(
        engine_rates(
            model,
            backend,
            device,
            None if device != "cpu" else 1,
            BATCHES[model],
            images_for(model, IMAGES[model]),
            repeats=2,
        )
    )


def auto_pick(model: str, threads: int) -> dict:
    """In this (pinned) process: what ``--backend auto`` picks, timing afresh."""
    from farm.engines.autoselect import choose

    choice = choose(find(model), "cpu", threads, use_cache=False)
    return {
        "backend": choice.backend,
        "batch": choice.batch,
        "left_out": {t.backend: t.problem for t in choice.trials if t.problem},
    }


def shrink_memory() -> dict[str, float]:
    """CaffeNet on opencv, ``--batch 64``: resident MB after a chunk of its prototxt's batch (10),
    after a chunk of 64, and once shrunk back (as a worker does when it falls idle)."""
    from farm.engines.autoselect import load_engine

    def rss_mb() -> float:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6

    spec = find("caffenet")
    images = images_for("caffenet", 64)
    engine = load_engine(spec, "opencv", batch=64, threads=1)
    engine.run(images[: spec.batch])
    figures = {"resting_mb": rss_mb()}
    engine.run(images)
    figures["batch64_mb"] = rss_mb()
    engine.rest()
    figures["after_shrink_mb"] = rss_mb()
    return figures


def in_child(*args: str) -> dict:
    """Run this script's ``--child`` mode in a fresh process (thread pools fixed at import)."""
    done = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def through_farm(model: str, backend: str, device: str, batch: int) -> float:
    """Images/s of one real worker behind a real broker, fifo chunks of 4 compute batches."""
    images = images_for(model, IMAGES[model])
    chunk = max(4 * batch, 20)
    worker = ["--backend", backend, "--batch", str(batch)]
    with (
        LocalFarm(
            devices=[device],
            algo="fifo",
            broker_options=["--chunk", str(chunk)],
            worker_options=worker,
            preload=[model],
        ) as farm,
        farm.client(timeout=600) as client,
    ):
        client.run(images[:chunk], model)  # warm-up
        return max(client.run(images, model).summary.rate for _ in range(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (one pinned core) or gpu:N")
    parser.add_argument(
        "--models", default=",".join([*BUNDLED, *sorted(set(available()) - set(BUNDLED))])
    )
    parser.add_argument("--csv", help="also write the table here")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return print(json.dumps(child(args.child)))
    gpu = args.device.startswith("gpu")
    engine_device = Device.parse(args.device).engine_device if gpu else "cpu"
    worker_device = args.device if gpu else f"cpu:{cores()[-1]}"
    backends = (
        ["torch"] if gpu else [b for b, problem in available_backends().items() if problem is None]
    )
    rows = []
    skipped = [
        f"{b} ({problem.split(':')[0]})"
        for b, problem in available_backends().items()
        if problem and not gpu
    ]
    print(
        f"one worker on {worker_device}; backends: {', '.join(backends)}"
        + (f"; not installed: {', '.join(skipped)}" if skipped else "")
    )
    print(
        f"{'model':<14} {'backend':<11} {'batch':>7} {'in-process/s':>13} {'worker/s':>10}   "
        f"all batches (images/s)"
    )
    for model in args.models.split(","):
        prepare(find(model))
        sweeps = {}
        for backend in backends:
            try:
                sweeps[backend] = {
                    int(k): v
                    for k, v in in_child(
                        "sweep", model, backend, engine_device, worker_device
                    ).items()
                }
            except subprocess.CalledProcessError as exc:
                print(
                    f"{model:<14} {backend:<11} cannot run it: "
                    f"{exc.stderr.strip().splitlines()[-1]}"
                )
                continue
            rates = sweeps[backend]
            best = max(rates, key=rates.get)
            farm_rate = (
                through_farm(model, backend, worker_device, best)
                if model in BUNDLED
                else float("nan")
            )
            spread = ", ".join(f"{b}: {r:,.0f}" for b, r in rates.items())
            print(
                f"{model:<14} {backend:<11} {best:>7} {rates[best]:>13,.0f} "
                f"{farm_rate:>10,.0f}   {spread}",
                flush=True,
            )
            rows.append(
                {
                    "model": model,
                    "backend": backend,
                    "device": worker_device,
                    "best_batch": best,
                    "in_process_rate": round(rates[best], 1),
                    "worker_rate": round(farm_rate, 1),
                    **{f"batch_{b}": round(r, 1) for b, r in rates.items()},
                }
            )
        if not gpu and sweeps:
            rows.append(auto_row(model, sweeps, worker_device))
    if "caffenet" in args.models and not gpu:
        memory = in_child("shrink", str(cores()[-1]))
        print(
            f"caffenet on opencv, resident memory: {memory['resting_mb']:,.0f} MB at batch "
            f"{find('caffenet').batch}, {memory['batch64_mb']:,.0f} MB after a batch of 64, "
            f"{memory['after_shrink_mb']:,.0f} MB after shrinking back"
        )
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=sorted({k for r in rows for k in r}))
            writer.writeheader()
            writer.writerows(rows)


def auto_row(model: str, sweeps: dict[str, dict[int, float]], worker_device: str) -> dict:
    """Auto's pick in a fresh pinned process, judged against this run's sweeps."""
    pick = in_child("auto", model, worker_device)
    fastest = max(sweeps, key=lambda b: max(sweeps[b].values()))
    top = max(sweeps[fastest].values())
    picked = max(sweeps.get(pick["backend"], {0: 0.0}).values())
    print(
        f"{model:<14} {'auto':<11} {pick['batch']:>7} picks {pick['backend']}: "
        f"{picked / top:.2f} of the fastest ({fastest}, {top:,.0f}/s)"
        + "".join(
            f"; {b} left out: {why[:80]}"
            for b, why in pick["left_out"].items()
            if not why.startswith("not installed")
        ),
        flush=True,
    )
    return {
        "model": model,
        "backend": "auto",
        "device": worker_device,
        "best_batch": pick["batch"],
        "auto_backend": pick["backend"],
        "auto_share_of_fastest": round(picked / top, 3),
        "fastest_backend": fastest,
    }


def child(args: list[str]) -> dict:
    """Pin to the worker's core and cap threads before any backend is imported, then measure."""
    from farm.workers.worker import Device, prepare_process

    if args[0] == "shrink":
        prepare_process(Device("cpu", int(args[1])))
        return shrink_memory()
    if args[0] == "auto":
        prepare_process(Device.parse(args[2]))
        return auto_pick(args[1], 1)
    model, backend, engine_device, worker_device = args[1:]
    if worker_device.startswith("cpu"):
        prepare_process(Device.parse(worker_device))
    else:
        limit_threads(None)
    return sweep(model, backend, engine_device)


if __name__ == "__main__":
    main()
