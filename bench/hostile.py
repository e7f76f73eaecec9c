"""Hostile and buggy peers against a real farm: the issue's table, row by row.

Each row starts a fresh local farm (a ``farm broker`` and two pinned ``farm worker``
processes, LeNet preloaded), starts the row's hostile peer (``tests.system.hostile``, a
real process speaking farm's protocol), waits until it is in place, then runs a real
``farm submit x.npy --model lenet --out y.npy`` beside it.  Printed per row: what the peer
did, ``farm submit``'s exit status, the rows of y.npy that differ from an in-process
forward (``tests.conftest.reference_forward``; a missing or NaN row counts as wrong), the
job's wall time (and its ratio to the same job alone, with ``--baseline``), and what the
broker reported: its counters that moved, the workers it quarantined, and the lines of
the job's summary about refused answers, quarantine, spot checks and parked jobs.

Rows (the issue's sizes; ``--images`` and the flood options shrink them):

   1  a peer that never registered sends kept RESULTs of zeros for the job's ids (INFO)
   2  the same with --curve and an authorized client key (registering as a worker too)
   3  a registered worker answers NaN rows, failed=0
   4  a registered worker answers plausible random softmax rows (farm submit --verify)
   5  a worker's first result has outputs of shape (7,)
   6  a worker's RESULT counts one item off
   7  a worker reports 0.001 s of compute per chunk (its answers real)
   8  a peer SUBMITs 4 jobs, then only heartbeats (a 20 000-image job)
   9  a peer SUBMITs 1 000 jobs
  10  8 connections each send 3 frames of 250 MB; the broker's RSS before and at its peak
  11  a registered worker sends 205 FETCHes; the bytes it got back
  12  a registered worker whose engine runs bf16 while it says f32 (farm submit --verify):
      found by the spot checks and quarantined within the job?
      (a tampered ONNX export cache: tests/unit/test_cache_digests.py, not run here)

    python bench/hostile.py [--rows 1,3,8] [--images 100000] [--silent-images 20000]
                            [--baseline] [--flood-mb 250] [--flood-connections 8]
                            [--fetches 205] [--mass-jobs 1000] [--verify 0.01]
                            [--save bench/results/DATE-hostile.txt]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.system.hostile: the peers

from farm.benchsuite.common import machine, saved  # noqa: E402
from farm.client.client import Client  # noqa: E402
from farm.modelrepo.repository import find  # noqa: E402
from farm.ops.local import LocalFarm, cores, farm_command  # noqa: E402
from tests.system.hostile import HostilePeer, reset_peak_rss, rss_bytes  # noqa: E402

ATOL = 1e-5
#: Seconds after which the broker cancels the real job (the issue saw up to 59 s).
JOB_TIMEOUT = 600.0


@dataclass
class Row:
    """One row of the table: its number, what the peer does, how to start the peer."""

    number: int
    did: str
    kind: str
    options: Callable[[argparse.Namespace, Path], list[str]]
    ready: str
    silent_size: bool = False  # the real job has --silent-images images
    curve: bool = False
    submit: Callable[[argparse.Namespace], list[str]] = lambda args: []


ROWS = [
    Row(
        1,
        "a peer that never registered sends kept RESULTs of zeros for every job in INFO",
        "forger",
        lambda args, keys: ["--value", "0"],
        "watching",
    ),
    Row(
        2,
        "row 1 with --curve and the authorized client key, which also tries to register",
        "forger",
        lambda args, keys: [
            "--curve",
            str(keys),
            "--curve-name",
            "client",
            "--register",
            "--info-curve-name",
            "operator",
        ],
        "watching",
        curve=True,
    ),
    Row(
        3, "a registered worker answers NaN rows, failed=0", "nan-worker", lambda a, k: [], "ready"
    ),
    Row(
        4,
        "a registered worker answers plausible random softmax rows",
        "random-worker",
        lambda a, k: [],
        "ready",
        submit=lambda args: ["--verify", str(args.verify)] if args.verify else [],
    ),
    Row(
        12,
        "a registered worker whose engine runs bf16 but says f32 (--verify)",
        "bf16-worker",
        lambda a, k: [],
        "ready",
        submit=lambda args: ["--verify", str(args.verify)] if args.verify else [],
    ),
    Row(
        5,
        "a worker's first result has outputs of shape (7,), then real ones",
        "wrong-shape",
        lambda a, k: [],
        "ready",
    ),
    Row(6, "a worker's RESULTs count one item off", "off-by-one", lambda a, k: [], "ready"),
    Row(
        7,
        "a worker reports 0.001 s of compute per chunk (its answers real)",
        "fast-liar",
        lambda a, k: [],
        "ready",
    ),
    Row(
        8,
        "a peer SUBMITs 4 jobs, then only heartbeats, never answering NEED",
        "submitter",
        lambda args, keys: ["--jobs", "4", "--total", str(args.silent_images)],
        "submitted",
        silent_size=True,
    ),
    Row(
        9,
        "a peer SUBMITs {mass_jobs:,} jobs, then only heartbeats",
        "submitter",
        lambda args, keys: ["--jobs", str(args.mass_jobs), "--total", str(args.silent_images)],
        "submitted",
    ),
    Row(
        10,
        "{flood_connections} connections each send 3 frames of {flood_mb:g} MB",
        "frame-flooder",
        lambda args, keys: [
            "--connections",
            str(args.flood_connections),
            "--frames",
            "3",
            "--megabytes",
            str(args.flood_mb),
        ],
        "sent round",
    ),
    Row(
        11,
        "a registered worker sends {fetches} FETCHes of LeNet at once",
        "fetch-flooder",
        lambda args, keys: ["--fetches", str(args.fetches)],
        "ready",
    ),
]


@dataclass
class Inputs:
    """The real jobs' images (saved as .npy) and their forward, by size."""

    folder: Path
    digits: np.ndarray
    reference: np.ndarray
    files: dict[int, tuple[Path, np.ndarray]] = field(default_factory=dict)

    def of(self, count: int) -> tuple[Path, np.ndarray]:
        """``count`` digits in a seeded order, as a file, with their expected outputs."""
        if count not in self.files:
            order = np.random.default_rng(count).integers(0, len(self.digits), count)
            path = self.folder / f"images-{count}.npy"
            np.save(path, self.digits[order])
            self.files[count] = (path, self.reference[order])
        return self.files[count]


@dataclass
class JobRun:
    returncode: int
    seconds: float
    wrong: int
    total: int
    stdout: str
    stderr: str
    trace: dict[str, Any]


def submit(
    local: LocalFarm, source: Path, expected: np.ndarray, folder: Path, extra: list[str]
) -> JobRun:
    """``farm submit`` of ``source`` on the farm; its rows compared with ``expected``."""
    out, trace = folder / "out.npy", folder / "trace.json"
    for path in (out, trace):
        path.unlink(missing_ok=True)
    command = farm_command(
        "submit",
        str(source),
        "--model",
        "lenet",
        "--out",
        str(out),
        "--trace",
        str(trace),
        "--broker",
        local.endpoint,
        "--job-timeout",
        str(JOB_TIMEOUT),
        *(["--curve", str(local.curve)] if local.curve else []),
        *extra,
    )
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=JOB_TIMEOUT + 120)
    seconds = time.monotonic() - started
    wrong = len(expected)
    if out.exists():
        outputs = np.load(out)
        if outputs.shape == expected.shape:
            wrong = int((~np.isclose(outputs, expected, atol=ATOL, rtol=0).all(axis=1)).sum())
    document = json.loads(trace.read_text()) if trace.exists() else {}
    return JobRun(
        done.returncode, seconds, wrong, len(expected), done.stdout, done.stderr, document
    )


def start_farm(args: argparse.Namespace, keys: Path | None) -> LocalFarm:
    devices = [f"cpu:{core}" for core in cores()][: args.workers]
    while len(devices) < args.workers:  # fewer cores than workers: they share
        devices.append(devices[len(devices) % len(cores())])
    options = ["--algo", args.algo] if args.algo else []
    return LocalFarm(
        devices=devices,
        preload=["lenet"],
        broker_options=options,
        curve=str(keys) if keys else None,
        log_level="ERROR",
        ready_timeout=300.0,
    )


def snapshot(local: LocalFarm) -> dict[str, Any]:
    curve_name = "operator" if local.curve else "client"
    with Client(local.endpoint, timeout=60.0, curve=local.curve, curve_name=curve_name) as client:
        return client.info()


def moved(before: dict[str, int], after: dict[str, int]) -> str:
    """The broker's counters that moved: ``name +N``."""
    parts = [
        f"{name} +{after[name] - before.get(name, 0):,}"
        for name in after
        if isinstance(after[name], int) and after[name] != before.get(name, 0)
    ]
    return ", ".join(parts) or "no counter moved"


SUMMARY_WORDS = ("quarantin", "verified", "disagree", "parked", "refused", "answered badly")


def reported(run: JobRun, info: dict[str, Any], before: dict[str, int]) -> list[str]:
    """What the broker said: counters, quarantined workers, summary lines worth quoting."""
    lines = [f"broker counters: {moved(before, info.get('stats', {}))}"]
    theirs = [j for j in info.get("jobs", []) if j.get("client", "").startswith("hostile-")]
    if theirs:
        lines.append(
            f"the peer's {len(theirs)} jobs: {sum(bool(j.get('parked')) for j in theirs)} "
            f"parked, {sum(j.get('in_flight', 0) for j in theirs)} chunks in flight, "
            f"{sum(j.get('done', 0) for j in theirs):,} images done"
        )
    for worker in info.get("workers", []):
        if worker.get("quarantined"):
            lines.append(f"quarantined {worker['name']}: {worker['quarantined']}")
    for line in (run.stdout + run.stderr).splitlines():
        if any(word in line.lower() for word in SUMMARY_WORDS):
            lines.append(f"farm submit: {line.strip()}")
    errors = [line for line in run.stderr.splitlines() if line.startswith("Error")]
    lines += [f"farm submit: {line}" for line in errors[:2]]
    return lines


def liar_line(run: JobRun, peer: HostilePeer, stats: dict[str, Any]) -> str:
    """Row 7: what the summary credits the liar with, against its real compute."""
    name = next((line.split(" ", 1)[1] for line in peer.lines if line.startswith("ready ")), "")
    share = next((w for w in run.trace.get("workers", []) if w.get("name") == name), None)
    if share is None:
        return "the liar ran none of the job"
    busy = stats.get("busy_s", 0.0)
    return (
        f"liar credited {share['items']:,} images in {share['compute_s']:.3f} s = "
        f"{share['standalone_rate']:,.0f} images/s ({share['items'] / run.total:.0%} share); "
        f"it really spent {busy:.3f} s ({share['items'] / busy:,.0f} images/s)"
        if busy
        else "the liar reported no busy time"
    )


def peer_line(row: Row, peer: HostilePeer, stats: dict[str, Any]) -> str:
    """What the peer itself counted."""
    keys = (
        "forged_jobs forged_results registration_refused disconnects tasks results errors "
        "needs refused later_errors jobs_lost models model_bytes model_errors sent_bytes "
        "dropped unanswered submit_seconds fetch_seconds flood_seconds"
    ).split()
    shown = ", ".join(
        f"{key} {stats[key]:,.3f}" if isinstance(stats[key], float) else f"{key} {stats[key]:,}"
        for key in keys
        if isinstance(stats.get(key), (int, float))
    )
    if stats.get("error_texts"):
        shown += f"; first errors: {stats['error_texts'][:2]}"
    extra = [line for line in peer.lines if line.startswith(("submitted", "flooded", "fetched"))]
    return f"peer: {shown}" + (f"; {extra[0]}" if extra else "")


def run_row(
    row: Row,
    args: argparse.Namespace,
    inputs: Inputs,
    keys: Path | None,
    alone: dict[int, float],
    folder: Path,
) -> bool:
    """Run one row and print it; whether the real job came back exact with exit 0."""
    size = args.silent_images if row.silent_size else args.images
    source, expected = inputs.of(size)
    print(f"\nrow {row.number}: {row.did.format(**vars(args))}", flush=True)
    with start_farm(args, keys if row.curve else None) as local:
        before = snapshot(local)["stats"]
        broker = local.running_broker().pid
        watched = row.kind == "frame-flooder" and reset_peak_rss(broker)
        base = rss_bytes(broker)
        peer = HostilePeer(row.kind, local.endpoint, *row.options(args, keys or folder))
        try:
            peer.await_line(row.ready, timeout=600)
            run = submit(local, source, expected, folder, row.submit(args))
            peak = rss_bytes(broker, "VmHWM") if watched else rss_bytes(broker)
            if row.kind in ("frame-flooder", "fetch-flooder"):
                peer.await_line(("flooded" if row.kind == "frame-flooder" else "fetched"), 600)
                peak = rss_bytes(broker, "VmHWM") if watched else max(peak, rss_bytes(broker))
            info = snapshot(local)
        finally:
            stats = peer.stop()
    ratio = f" (x{run.seconds / alone[size]:.2f} of the job alone)" if size in alone else ""
    print(
        f"  farm submit exit {run.returncode}; rows wrong {run.wrong:,} of {run.total:,}; "
        f"{run.seconds:.2f} s{ratio}"
    )
    print(f"  {peer_line(row, peer, stats)}")
    if row.kind == "fast-liar":
        print(f"  {liar_line(run, peer, stats)}")
    if row.kind == "frame-flooder":
        what = "peak (VmHWM)" if watched else "after"
        print(f"  broker RSS {base / 2**20:,.0f} MB before, {peak / 2**20:,.0f} MB {what}")
    for line in reported(run, info, before):
        print(f"  {line}")
    return run.returncode == 0 and run.wrong == 0


def baseline(args: argparse.Namespace, inputs: Inputs, folder: Path) -> dict[int, float]:
    """The real jobs alone: seconds by size."""
    alone = {}
    with start_farm(args, None) as local:
        for size in sorted({args.images, args.silent_images}):
            source, expected = inputs.of(size)
            run = submit(local, source, expected, folder, [])
            alone[size] = run.seconds
            print(
                f"baseline: {size:,} images alone: exit {run.returncode}, rows wrong "
                f"{run.wrong:,}, {run.seconds:.2f} s",
                flush=True,
            )
    return alone


def make_keys(folder: Path) -> Path | None:
    """A keys folder with the default worker and client keys and an operator key (the
    forger reads INFO with it: a client key sees only its own jobs); None without roles."""
    from farm.wire import curve

    if not hasattr(curve, "KeyRoles"):
        return None
    keys = folder / "keys"
    curve.init_keys(keys)
    curve.add_key(keys, "operator", curve.ROLE_OPERATOR)
    return keys


def hostile(args: argparse.Namespace) -> int:
    print(machine())
    print("command: python bench/hostile.py " + " ".join(sys.argv[1:]))
    rows = [row for row in ROWS if row.number in args.rows]
    with tempfile.TemporaryDirectory(prefix="farm-hostile-") as scratch:
        folder = Path(scratch)
        spec = find("lenet")
        from tests.conftest import reference_forward

        digits = np.load(spec.sample)
        inputs = Inputs(folder, digits, reference_forward(spec, digits))
        print(
            f"real job: farm submit of {args.images:,} LeNet images ({args.silent_images:,} in "
            f"row 8) on a broker and {args.workers} workers; each row on a fresh farm",
            flush=True,
        )
        alone = baseline(args, inputs, folder) if args.baseline else {}
        keys = make_keys(folder) if any(row.curve for row in rows) else None
        results = {}
        for row in rows:
            if row.curve and keys is None:
                print(f"\nrow {row.number}: skipped: CURVE keys carry no roles here")
                continue
            results[row.number] = run_row(row, args, inputs, keys, alone, folder)
    print("\nrow 12: a tampered ONNX export cache: tests/unit's, not run here")
    bad = [number for number, ok in results.items() if not ok]
    print(
        f"\n{len(results)} rows run: {len(results) - len(bad)} real jobs exact with exit 0"
        + (f"; not in rows {', '.join(map(str, bad))}" if bad else "")
    )
    return 1 if bad else 0


def row_list(text: str) -> list[int]:
    numbers = [int(part) for part in text.split(",") if part]
    if not all(1 <= number <= 11 for number in numbers):
        raise argparse.ArgumentTypeError("rows are 1..11 (12 is tests/unit's)")
    return numbers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=row_list, default=list(range(1, 13)), help="e.g. 1,3,8")
    parser.add_argument("--images", type=int, default=100_000, help="the real job's images")
    parser.add_argument("--silent-images", type=int, default=20_000, help="row 8's (and 9's)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--algo", help="the broker's policy [default: the broker's]")
    parser.add_argument("--baseline", action="store_true", help="the real jobs alone first")
    parser.add_argument(
        "--verify", type=float, default=0.01, help="rows 4 and 12's --verify (0: none)"
    )
    parser.add_argument("--flood-mb", type=float, default=250.0, help="row 10's frame size")
    parser.add_argument("--flood-connections", type=int, default=8)
    parser.add_argument("--fetches", type=int, default=205)
    parser.add_argument("--mass-jobs", type=int, default=1000)
    parser.add_argument(
        "--save",
        type=Path,
        default=Path(f"bench/results/{date.today()}-hostile.txt"),
        help="also write the report here ('-': nowhere)",
    )
    args = parser.parse_args()
    sys.exit(saved(args.save, lambda: hostile(args)))


if __name__ == "__main__":
    main()
