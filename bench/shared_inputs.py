"""Shared-storage inputs against sent ones: the broker's bytes per image and the job's time.

A local farm (a broker and one pinned worker per core) runs each job twice per round, its
client sending the images (NEED, DATA, TASK: each image crosses the broker twice) and the
workers reading them themselves (``--shared``: the broker carries paths and row ranges).
Printed per job: the broker's bytes of input per image (its own count, ``farm status``'s
``traffic``), its messages per chunk, the job's wall time (best of the rounds, taken in
turn) and whether both runs' outputs are equal.

Jobs: 100 000 LeNet digits in a `.npy`; a folder of JPEGs (500 by default) on the shared
SqueezeNet v1.0 when it is there (``../shared/models``), skipped saying so otherwise.

    python bench/shared_inputs.py [--images 100000] [--jpegs 500] [--rounds 3]
                                  [--save bench/results/DATE-shared-inputs.txt]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
from wholeprocess import make_jpegs

from farm.benchsuite.common import machine, saved, shared_squeezenet
from farm.client.client import Client
from farm.client.inputs import open_input
from farm.modelrepo.repository import find
from farm.ops.local import LocalFarm, cores

ROOT = Path(__file__).resolve().parents[1]
SQUEEZENET = ROOT.parent / "shared" / "models" / "squeezenet_v1.0"


@dataclass
class Run:
    seconds: float
    bytes_per_image: float
    messages_per_chunk: float
    outputs: np.ndarray


def run_once(farm: LocalFarm, inputs: list[str], model: str, shared: bool) -> Run:
    """One job; the broker's input bytes and messages it added."""
    before = traffic(farm)
    started = time.perf_counter()
    with Client(farm.endpoint, timeout=600) as client:
        result = client.run(open_input(inputs), model, shared=shared)
    seconds = time.perf_counter() - started
    after = traffic(farm)
    if result.failed:
        raise SystemExit(f"{len(result.failed)} images failed: {result.failed[0].reason}")
    images = len(result.outputs)
    sent = {
        kind: after["sent"].get(kind, 0) - before["sent"].get(kind, 0) for kind in after["sent"]
    }
    received = {
        kind: after["received"].get(kind, 0) - before["received"].get(kind, 0)
        for kind in after["received"]
    }
    chunks = max(1, sent.get("TASK", 0))
    chunk_messages = sum(
        table.get(kind, 0)
        for table, kinds in ((sent, ("TASK", "NEED", "RESULT")), (received, ("DATA", "RESULT")))
        for kind in kinds
    )
    return Run(
        seconds,
        (after["input_bytes"] - before["input_bytes"]) / images,
        chunk_messages / chunks,
        np.asarray(result.outputs),
    )


def traffic(farm: LocalFarm) -> dict[str, Any]:
    with farm.client() as client:
        return client.info()["traffic"]


def measure(name: str, farm: LocalFarm, inputs: list[str], model: str, rounds: int) -> None:
    best: dict[bool, Run] = {}
    for _ in range(rounds):
        for shared in (False, True):
            run = run_once(farm, inputs, model, shared)
            if shared not in best or run.seconds < best[shared].seconds:
                best[shared] = run
    sent, shared = best[False], best[True]
    equal = np.array_equal(sent.outputs, shared.outputs)
    print(
        f"{name:<28}{sent.bytes_per_image:>12,.1f}{shared.bytes_per_image:>14,.1f}"
        f"{sent.messages_per_chunk:>8.1f}{shared.messages_per_chunk:>8.1f}"
        f"{sent.seconds:>9.2f}{shared.seconds:>9.2f}{sent.seconds / shared.seconds:>9.2f}x"
        f"   {'equal' if equal else 'DIFFERENT'}",
        flush=True,
    )
    if not equal:
        raise SystemExit(f"{name}: the shared run's outputs differ from the sent run's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=100_000, help="LeNet digits in the .npy")
    parser.add_argument("--jpegs", type=int, default=500, help="JPEGs in the folder (0: none)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--save", type=Path, default=Path(f"bench/results/{date.today()}-shared-inputs.txt")
    )
    args = parser.parse_args()
    sys.exit(saved(args.save, lambda: bench(args)))


def bench(args: argparse.Namespace) -> int:
    print(machine())
    print("command: python bench/shared_inputs.py " + " ".join(sys.argv[1:]))
    devices = [f"cpu:{core}" for core in cores()]
    print(
        f"a local farm of {len(devices)} pinned workers; best of {args.rounds} rounds, sent "
        f"and shared taken in turn; bytes: the broker's input bytes per image (SUBMIT, NEED, "
        f"DATA, TASK frames, in and out; results not counted)"
    )
    print(
        f"{'job':<28}{'sent B/img':>12}{'shared B/img':>14}{'msg/ch':>8}{'shared':>8}"
        f"{'sent s':>9}{'shared s':>9}{'speed':>10}"
    )
    with tempfile.TemporaryDirectory(prefix="farm-shared-") as folder:
        root = Path(folder)
        digits = np.load(find("lenet").sample)
        np.save(root / "digits.npy", np.resize(digits, (args.images, *digits.shape[1:])))
        with LocalFarm(devices=devices, preload=["lenet"]) as farm:
            measure(
                f"LeNet .npy {args.images:,}",
                farm,
                [str(root / "digits.npy")],
                "lenet",
                args.rounds,
            )
        if args.jpegs and (SQUEEZENET / "deploy.prototxt").exists():
            shared_squeezenet(root / "models", SQUEEZENET, resize=True)
            models = root / "models"
            make_jpegs(root / "photos", args.jpegs)
            with LocalFarm(
                devices=devices,
                preload=["squeezenet_v1.0"],
                broker_options=["--models-dir", str(models)],
                worker_options=["--models-dir", str(models)],
            ) as farm:
                measure(
                    f"SqueezeNet {args.jpegs:,} JPEGs",
                    farm,
                    [str(root / "photos")],
                    "squeezenet_v1.0",
                    args.rounds,
                )
        elif args.jpegs:
            print(f"JPEG job skipped: no SqueezeNet at {SQUEEZENET}")
    return 0


if __name__ == "__main__":
    main()
