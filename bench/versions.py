"""One ``farm run`` command, timed on two versions of farm's code, alternated.

    python bench/versions.py --old 8534f57 [--new WORKTREE] [--rounds 7] [--images 100000]

``--old`` is a commit: it is checked out once into a temporary worktree.  Both versions run
with this checkout's virtual environment; ``PYTHONPATH`` puts the version's source first,
so every process it starts (the broker and the workers of ``farm run``) runs that code.
The job: LeNet on ``--images`` seeded random digits in a ``.npy`` file, a fresh local farm
per run (broker and one pinned worker per core), start-up included, written to ``--out``.
One warm-up of each version fills the caches.  The order alternates from round to round.

Printed: each version's median and spread in seconds, and new over old (above 1: the new
code is slower).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def run_seconds(source: Path, images: Path, out: Path) -> float:
    """Wall seconds of one ``farm run`` with farm's code taken from ``source``."""
    env = dict(os.environ, PYTHONPATH=str(source), FARM_RUNTIME_DIR=str(out.parent / "rt"))
    command = [sys.executable, "-m", "farm", "run", str(images), "--model", "lenet"]
    started = time.perf_counter()
    subprocess.run([*command, "--out", str(out)], env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def worktree(commit: str, folder: Path) -> Path:
    """``commit`` checked out at ``folder`` (detached, outside this checkout's tree)."""
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), commit],
        check=True,
        capture_output=True,
    )
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the commit to compare with")
    parser.add_argument("--new", type=Path, default=ROOT, help="the new code's checkout")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--images", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="farm-versions-") as scratch:
        folder = Path(scratch)
        old = worktree(args.old, folder / "old")
        try:
            images = folder / "digits.npy"
            rng = np.random.default_rng(0)
            np.save(images, rng.integers(0, 256, (args.images, 28, 28), dtype=np.uint8))
            versions = {"old": old, "new": args.new.resolve()}
            times: dict[str, list[float]] = {name: [] for name in versions}
            for name, source in versions.items():  # warm-up
                run_seconds(source, images, folder / f"{name}.npy")
            for round_number in range(args.rounds):
                order = list(versions) if round_number % 2 == 0 else list(versions)[::-1]
                for name in order:
                    times[name].append(run_seconds(versions[name], images, folder / "o.npy"))
                print(
                    f"round {round_number + 1}: "
                    + ", ".join(f"{name} {times[name][-1]:.2f} s" for name in versions),
                    flush=True,
                )
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                capture_output=True,
            )
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        print(
            f"{name}: median {medians[name]:.2f} s (min {min(values):.2f}, max {max(values):.2f})"
        )
    print(f"new / old: {medians['new'] / medians['old']:.3f} (above 1: the new code is slower)")


if __name__ == "__main__":
    main()
