"""The tail: backup attempts, stragglers, the last chunks.

A job ends when its last chunk answers.  A device that slows down or stops after its
chunk was sized keeps the whole farm waiting; backup attempts (farm/broker/backups.py,
``farm broker --backup-share``) let a worker idle at the end of a job run that chunk
again, the first answer winning.  This bench measures the tail (from the first worker
idle with nothing left to the job's end, as a share of the job's span, the figure of the
summary ``farm submit`` prints), the extra work the backups cost, and the job times,
with backups off (``--backup-share 0``) against on (the default, 5%).

``--sim`` (on by default; fast and deterministic): the simulator, which drives the
broker's own scheduling code, on the paper's farms (3 CPU workers + 1 GPU worker, MNIST
and CIFAR-10, noise 0.05, equal-finish, chunks capped at 1 s, heartbeat 0.1 s, the
workers' speeds known) in four cases: (a) nothing more; (b) the GPU slows 2x mid-job;
(c) one CPU slows 2x mid-job; (d) the GPU slows 20x at 90% of the ideal time (a stopped
process stand-in).  Over ``--sim-seeds`` seeds, backups off against on: mean makespan,
on/off, mean and max tail share, extra work (images the backed-up attempts had computed,
over the job's), backups and their wins.  Verdicts for the goals, cases (a)-(c) with
backups on: tail <= 2% of the span and extra work <= 5%, for every job.

``--real``: a real farm (a ``farm broker`` and 2 ``farm worker`` processes pinned to
one core each) runs LeNet on the bundled sample's digits tiled to ``--images`` in a
seeded order.  One fault-free job first measures T (the whole ``farm submit``).  Then
``--pairs`` pairs, in alternating order (AB, BA, ...), each job on a fresh farm whose
worker 1 runs ``--slow 4@T/2`` (4x slower from half the job on, a straggler stand-in),
with A the broker at ``--backup-share 0`` and B at its default.  Per job: the wall time
of the whole ``farm submit`` process, its exit status, the tail and backups its summary
printed, the broker's straggler and backup counters, and whether its outputs equal the
fault-free run's (bit for bit, else within 1e-5); the fault-free outputs are checked
against an in-process forward.  Printed: the ratio of medians B/A of job time and of
tail share.  Exit status 1 if a job failed or its outputs differ.

    python bench/tail.py [--sim | --no-sim] [--sim-seeds 10] [--real] [--pairs 5]
                         [--images 100000] [--save bench/results/DATE-tail.txt]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import date
from pathlib import Path

import numpy as np
from faults import ATOL, Job, TailFigures, make_job, tail_figures

from farm.benchsuite.common import machine, saved
from farm.defaults import BACKUP_SHARE
from farm.ops.local import LocalFarm, cores, farm_command
from farm.simulation.scenarios import paper_scenario
from farm.simulation.simulator import Scenario, simulate

DATASETS = ("mnist", "cifar10")
NOISE = 0.05
#: The goals, cases (a)-(c) with backups on: the tail's share of the span, the extra work.
TAIL_GOAL = 0.02
EXTRA_GOAL = 0.05
GOAL_CASES = ("a", "b", "c")
#: The straggler of the real part: worker 1 this many times slower from half the job on.
SLOW_FACTOR = 4
JOB_TIMEOUT = 600.0


# -- the simulator ----------------------------------------------------------------------


def sim_cases(dataset: str) -> list[tuple[str, str, Scenario]]:
    """(letter, what happens, scenario) of the four cases on ``dataset``'s paper farm."""
    base = paper_scenario(dataset, noise=NOISE)
    ideal = base.ideal_seconds()
    cpu, *others = base.devices
    gpu = base.devices[-1]
    return [
        ("a", "nothing more", base),
        ("b", "GPU slows 2x mid-job", paper_scenario(dataset, noise=NOISE, gpu_drift=0.5)),
        (
            "c",
            "one CPU slows 2x mid-job",
            replace(base, devices=(replace(cpu, drift_at=ideal / 2, drift_factor=0.5), *others)),
        ),
        (
            "d",
            "GPU slows 20x at 90% (stopped)",
            replace(
                base,
                devices=(
                    *base.devices[:-1],
                    replace(gpu, drift_at=0.9 * ideal, drift_factor=0.05),
                ),
            ),
        ),
    ]


@dataclass
class SimRuns:
    """One case's jobs at one backup share, one per seed."""

    seconds: list[float] = field(default_factory=list)
    tails: list[float] = field(default_factory=list)  # tail share of the span
    extra: list[float] = field(default_factory=list)  # backup images over the job's
    backups: int = 0
    wins: int = 0


def sim_runs(scenario: Scenario, share: float, seeds: int) -> SimRuns:
    speeds = {device.name: device.rate for device in scenario.devices}
    runs = SimRuns()
    for seed in range(seeds):
        result = simulate(
            scenario,
            "equal-finish",
            seed=seed,
            speeds=speeds,
            max_chunk_seconds=1.0,
            heartbeat=0.1,
            backup_share=share,
        )
        summary = result.summary
        assert summary is not None
        runs.seconds.append(result.seconds)
        runs.tails.append(summary.tail_share)
        runs.extra.append(summary.backup_extra / summary.total if summary.total else 0.0)
        runs.backups += summary.backups
        runs.wins += summary.backup_wins
    return runs


def sim_part(seeds: int) -> bool:
    """The table and the verdicts; whether every goal was met."""
    print(
        f"\nsimulator: paper farms (3 CPU + 1 GPU), noise {NOISE:g}, equal-finish, chunks "
        f"<= 1 s, heartbeat 0.1 s; {seeds} seeds per row; backups off (share 0) vs on "
        f"(share {BACKUP_SHARE:g})"
    )
    print(
        f"{'farm':<8} {'case':<34} {'ideal s':>7} {'off s':>7} {'on s':>7} {'on/off':>6}  "
        f"{'tail off mean/max':>17}  {'tail on mean/max':>16}  {'extra mean/max':>14}  "
        f"{'backups':>7} {'won':>4}"
    )
    worst_tail: tuple[float, str] = (0.0, "")
    worst_extra: tuple[float, str] = (0.0, "")
    goal_tails: list[float] = []
    goal_extra: list[float] = []
    for dataset in DATASETS:
        for letter, what, scenario in sim_cases(dataset):
            off = sim_runs(scenario, 0.0, seeds)
            on = sim_runs(scenario, BACKUP_SHARE, seeds)
            off_s, on_s = statistics.mean(off.seconds), statistics.mean(on.seconds)
            print(
                f"{dataset:<8} ({letter}) {what:<30} {scenario.ideal_seconds():7.2f} "
                f"{off_s:7.2f} {on_s:7.2f} {on_s / off_s:6.3f}  "
                f"{statistics.mean(off.tails):8.1%}/{max(off.tails):7.1%}  "
                f"{statistics.mean(on.tails):7.1%}/{max(on.tails):7.1%}  "
                f"{statistics.mean(on.extra):6.1%}/{max(on.extra):6.1%}  "
                f"{on.backups:7d} {on.wins:4d}",
                flush=True,
            )
            if letter in GOAL_CASES:
                goal_tails += on.tails
                goal_extra += on.extra
                seed = int(np.argmax(on.tails))
                if on.tails[seed] >= worst_tail[0]:
                    worst_tail = (on.tails[seed], f"{dataset} ({letter}) seed {seed}")
                seed = int(np.argmax(on.extra))
                if on.extra[seed] >= worst_extra[0]:
                    worst_extra = (on.extra[seed], f"{dataset} ({letter}) seed {seed}")
    tail_met = max(goal_tails) <= TAIL_GOAL
    extra_met = max(goal_extra) <= EXTRA_GOAL
    print(
        f"goal: tail <= {TAIL_GOAL:.0%} of the span, cases (a)-(c), backups on: worst job "
        f"{worst_tail[0]:.1%} ({worst_tail[1]}), mean {statistics.mean(goal_tails):.1%}: "
        f"{'MET' if tail_met else 'NOT MET'}"
    )
    print(
        f"goal: extra work <= {EXTRA_GOAL:.0%}, cases (a)-(c), backups on: worst job "
        f"{worst_extra[0]:.1%} ({worst_extra[1]}), mean {statistics.mean(goal_extra):.1%}: "
        f"{'MET' if extra_met else 'NOT MET'}"
    )
    return tail_met and extra_met


# -- the real farm ----------------------------------------------------------------------


@dataclass
class RealRun:
    """One ``farm submit`` on a fresh farm."""

    name: str
    seconds: float  # the whole farm submit process
    exit_code: int
    figures: TailFigures
    stats: dict  # the broker's counters after the job
    outputs: np.ndarray | None
    stderr: str

    def counters(self) -> str:
        keys = ("stragglers", "backup_attempts", "backup_wins")
        return ", ".join(f"{key} {self.stats.get(key, 'n/a')}" for key in keys)


def real_job(job: Job, folder: Path, name: str, broker: list[str], slow: list[str]) -> RealRun:
    """A fresh farm (worker 1 with ``slow``'s options), one timed ``farm submit``."""
    available = cores()
    devices = [f"cpu:{available[i % len(available)]}" for i in range(2)]
    out = folder / f"{name}.npy"
    out.unlink(missing_ok=True)
    with LocalFarm(
        devices=devices,
        preload=["lenet"],
        broker_options=broker,
        device_options=[[], slow],
        log_level="WARNING",
        ready_timeout=300.0,
    ) as local:
        command = farm_command(
            "submit",
            str(job.path),
            "--model",
            "lenet",
            "--broker",
            local.endpoint,
            "--out",
            str(out),
            "--quiet",
            "--job-timeout",
            str(JOB_TIMEOUT),
        )
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, timeout=JOB_TIMEOUT + 60)
        seconds = time.perf_counter() - started
        try:
            with local.client(timeout=30.0) as client:
                stats = client.info().get("stats", {})
        except Exception as exc:  # the counters are extra: say why they are missing
            stats = {"error": str(exc)}
    outputs = np.load(out) if out.exists() else None
    return RealRun(
        name, seconds, done.returncode, tail_figures(done.stdout), stats, outputs, done.stderr
    )


def compared(run: RealRun, clean: np.ndarray | None) -> tuple[bool, str]:
    """Whether the run's outputs equal the fault-free run's (within ATOL), and how."""
    if run.outputs is None:
        return False, "no outputs"
    if clean is None:
        return False, "no fault-free outputs to compare with"
    if run.outputs.shape != clean.shape:
        return False, f"outputs of shape {run.outputs.shape}, not {clean.shape}"
    if np.array_equal(run.outputs, clean):
        return True, "outputs equal to the fault-free run's"
    diff = float(np.nanmax(np.abs(run.outputs - clean)))
    close = bool(np.allclose(run.outputs, clean, atol=ATOL, rtol=0))
    return close, f"outputs {'within' if close else 'NOT within'} {ATOL:g} (max diff {diff:.3g})"


def job_line(label: str, run: RealRun, check: str) -> str:
    return (
        f"  {label:<28} {run.seconds:7.2f} s, exit {run.exit_code}, {run.figures.long()}; "
        f"broker: {run.counters()}; {check}"
    )


def real_part(args: argparse.Namespace, folder: Path) -> bool:
    """The fault-free job, then the pairs; whether every job exited 0 with equal outputs."""
    job = make_job(folder, args.images, seed=0)
    print(
        f"\nreal farm: a broker and 2 workers (one per core: {', '.join(map(str, cores()[:2]))}), "
        f"LeNet on {job.count:,} sample digits tiled; a fresh farm per job; whole `farm "
        f"submit` timed",
        flush=True,
    )
    clean = real_job(job, folder, "fault-free", [], [])
    reference_diff = (
        float(np.abs(clean.outputs.reshape(job.reference.shape) - job.reference).max())
        if clean.outputs is not None and clean.outputs.size == job.reference.size
        else float("inf")
    )
    ok = clean.exit_code == 0 and reference_diff <= ATOL
    print(
        job_line(
            "fault-free (backups default)",
            clean,
            f"max diff from an in-process forward {reference_diff:.3g}",
        ),
        flush=True,
    )
    T = clean.seconds
    slow = ["--slow", f"{SLOW_FACTOR}@{T / 2:.1f}"]
    print(
        f"T = {T:.2f} s; then worker 1 started with `--slow {slow[1]}`; A: broker "
        f"--backup-share 0, B: the broker's default ({BACKUP_SHARE:g}); {args.pairs} pairs, "
        f"order alternating",
        flush=True,
    )
    sides = {"A": ["--backup-share", "0"], "B": []}
    runs: dict[str, list[RealRun]] = {"A": [], "B": []}
    for pair in range(args.pairs):
        order = "AB" if pair % 2 == 0 else "BA"
        for side in order:
            run = real_job(job, folder, f"pair{pair + 1}{side}", sides[side], slow)
            equal, check = compared(run, clean.outputs)
            ok = ok and equal and run.exit_code == 0
            runs[side].append(run)
            label = f"pair {pair + 1} {side} ({'backups off' if side == 'A' else 'backups on'})"
            print(job_line(label, run, check), flush=True)
            if run.exit_code:
                for line in run.stderr.strip().splitlines()[-4:]:
                    print(f"    farm submit: {line}")
    times = {side: statistics.median(r.seconds for r in runs[side]) for side in runs}
    tails = {
        side: [r.figures.tail_share for r in runs[side] if r.figures.tail_share is not None]
        for side in runs
    }
    print(
        f"job time: median A {times['A']:.2f} s, B {times['B']:.2f} s; B/A "
        f"{times['B'] / times['A']:.3f} (below 1: backups made the job shorter); T "
        f"{T:.2f} s, B/T {times['B'] / T:.2f}"
    )
    if tails["A"] and tails["B"]:
        a, b = statistics.median(tails["A"]), statistics.median(tails["B"])
        ratio = f"{b / a:.3f}" if a > 0 else "n/a (A's is 0)"
        print(f"tail share: median A {a:.1%}, B {b:.1%}; B/A {ratio}")
    else:
        print("tail share: n/a (a summary lacked it)")
    backups = sum(r.figures.backups or 0 for r in runs["B"])
    wins = sum(r.figures.wins or 0 for r in runs["B"])
    print(
        f"backups on (B): {backups} backup attempts over {len(runs['B'])} jobs, {wins} won; "
        f"off (A): {sum(r.figures.backups or 0 for r in runs['A'])}"
    )
    print(f"real: {'every job exit 0 with equal outputs' if ok else 'FAILED'}")
    return ok


def tail(args: argparse.Namespace) -> int:
    print(machine())
    print("command: python bench/tail.py " + " ".join(sys.argv[1:]))
    ok = True
    if args.sim:
        sim_part(args.sim_seeds)  # goals missed are a finding, not a failure of the bench
    if args.real:
        with tempfile.TemporaryDirectory(prefix="farm-tail-") as scratch:
            ok = real_part(args, Path(scratch))
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sim",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the simulator's part [default: on]",
    )
    parser.add_argument("--sim-seeds", type=int, default=10)
    parser.add_argument("--real", action="store_true", help="the real farm's part")
    parser.add_argument("--pairs", type=int, default=5, help="real: A/B pairs")
    parser.add_argument("--images", type=int, default=100_000, help="real: the job's images")
    parser.add_argument(
        "--save",
        type=Path,
        default=Path(f"bench/results/{date.today()}-tail.txt"),
        help="also write the report here ('-': nowhere)",
    )
    args = parser.parse_args()
    if args.sim_seeds < 1 or args.pairs < 1 or args.images < 1:
        parser.error("--sim-seeds, --pairs and --images must be positive")
    sys.exit(saved(args.save, lambda: tail(args)))


if __name__ == "__main__":
    main()
