"""One ``farm run`` command, timed two ways, alternated: two versions of farm's code, or
the same code with two sets of arguments.

    python bench/versions.py --old 8534f57 [--new WORKTREE] [--rounds 7] [--images 100000]
    python bench/versions.py --old 8534f57 --jpegs 2000          # the SqueezeNet JPEG folder
    python bench/versions.py --args-b "--verify 0.01" [--jpegs 2000]   # one version, A/B

``--old`` is a commit: it is checked out once into a temporary worktree.  Both versions run
with this checkout's virtual environment; ``PYTHONPATH`` puts the version's source first,
so every process it starts (the broker and the workers of ``farm run``) runs that code.
Without ``--old`` both sides run this checkout, "a" with ``--args-a`` and "b" with
``--args-b`` (the cost of an option).
The job: LeNet on ``--images`` seeded random digits in a ``.npy`` file, or (``--jpegs N``)
ImageNet SqueezeNet v1.0 (``../shared/models/squeezenet_v1.0``, resized to 256 and
centre-cropped) on a folder of N seeded JPEG photos (``bench/wholeprocess.py``'s); a fresh
local farm per run (broker and one pinned worker per core), start-up included, written
to ``--out``.  One warm-up of each side fills the caches.  The order alternates from
round to round.

Printed: each side's median and spread in seconds, and b over a (new over old; above 1:
b is slower).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "models" / "squeezenet_v1.0"


def run_seconds(source: Path, job: list[str], out: Path, models: Path | None) -> float:
    """Wall seconds of one ``farm run`` with farm's code taken from ``source``."""
    env = dict(os.environ, PYTHONPATH=str(source), FARM_RUNTIME_DIR=str(out.parent / "rt"))
    if models is not None:
        env["FARM_MODELS"] = str(models)
    command = [sys.executable, "-m", "farm", "run", *job, "--out", str(out)]
    started = time.perf_counter()
    subprocess.run(command, env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def worktree(commit: str, folder: Path) -> Path:
    """``commit`` checked out at ``folder`` (detached, outside this checkout's tree)."""
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), commit],
        check=True,
        capture_output=True,
    )
    return folder


def job_input(args: argparse.Namespace, folder: Path) -> tuple[list[str], Path | None]:
    """The job's arguments (input and model) and a model folder to search, if any."""
    if args.jpegs:
        sys.path.insert(0, str(ROOT / "bench"))
        from wholeprocess import make_jpegs

        from farm.benchsuite.common import shared_squeezenet

        models = folder / "models"
        models.mkdir()
        shared_squeezenet(models, SHARED, resize=True)
        make_jpegs(folder / "jpegs", args.jpegs)
        return [str(folder / "jpegs"), "--model", "squeezenet_v1.0"], models
    images = folder / "digits.npy"
    rng = np.random.default_rng(0)
    np.save(images, rng.integers(0, 256, (args.images, 28, 28), dtype=np.uint8))
    return [str(images), "--model", "lenet"], None


def time_sides(sides: dict, job: list[str], models: Path | None, folder: Path, rounds: int):
    """Each side's wall seconds per round, alternating the order."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for name, (source, extra) in sides.items():  # warm-up
        run_seconds(source, [*job, *extra], folder / f"{name}.npy", models)
    for round_number in range(rounds):
        order = list(sides) if round_number % 2 == 0 else list(sides)[::-1]
        for name in order:
            source, extra = sides[name]
            times[name].append(run_seconds(source, [*job, *extra], folder / "o.npy", models))
        print(
            f"round {round_number + 1}: "
            + ", ".join(f"{name} {times[name][-1]:.2f} s" for name in sides),
            flush=True,
        )
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", help="the commit to compare with (else: A/B of arguments)")
    parser.add_argument("--new", type=Path, default=ROOT, help="the new code's checkout")
    parser.add_argument("--args-a", default="", help="farm run arguments of side a (old)")
    parser.add_argument("--args-b", default="", help="farm run arguments of side b (new)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--images", type=int, default=100_000)
    parser.add_argument("--jpegs", type=int, default=0, help="a folder of N JPEG photos")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="farm-versions-") as scratch:
        folder = Path(scratch)
        old = worktree(args.old, folder / "old") if args.old else args.new.resolve()
        try:
            job, models = job_input(args, folder)
            names = ("old", "new") if args.old else ("a", "b")
            sides = {
                names[0]: (old, shlex.split(args.args_a)),
                names[1]: (args.new.resolve(), shlex.split(args.args_b)),
            }
            times = time_sides(sides, job, models, folder, args.rounds)
        finally:
            if args.old:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                    capture_output=True,
                )
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        print(
            f"{name}: median {medians[name]:.2f} s (min {min(values):.2f}, max {max(values):.2f})"
        )
    a, b = list(medians)
    print(f"{b} / {a}: {medians[b] / medians[a]:.3f} (above 1: {b} is slower)")


if __name__ == "__main__":
    main()
