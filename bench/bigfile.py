"""An input larger than the farm's memory: a whole farm in a memory cgroup runs a big `.npy`.

Writes a `.npy` of LeNet-shaped uint8 images (N x 28 x 28, 1.5 GiB by default,
the bundled sample repeated, written a block at a time and dropped from the
page cache), then runs a broker, 2 pinned workers and ``farm submit big.npy
--model lenet --out out.npy --quiet`` inside a cgroup-v1 memory cgroup limited
to 768 MiB by default.  The page cache counts in the cgroup too, so the kernel
must evict the input's pages behind the client as it streams through: nothing
fits unless every process's memory is bounded by the chunks in flight.

At the end it reads each process's peak resident memory (VmHWM of the broker
and workers before they are stopped; the client's "Maximum resident set size"
from ``/usr/bin/time -v``), the cgroup's peak usage and failcnt, and checks
out.npy: N rows, no NaN, and every 10 000th row and the last against outputs
computed here for the same input rows.

The cgroup is made as a child of this process's own memory cgroup (the root
of the hierarchy when that is where it runs), so the farm stays inside
whatever accounts for this session.  Without root or a memory controller the
farm runs without a limit, and the report says so.

    python bench/bigfile.py [--size-gib 1.5] [--limit-mib 768] [--dir /tmp] [--keep]
                            [--save bench/results/DATE-bigfile.txt]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import numpy as np

from farm.benchsuite.common import machine, saved, status_kib
from farm.client.npy import NpyReader, NpyWriter
from farm.modelrepo.repository import find
from farm.ops.local import LocalFarm, cores, farm_command
from farm.wire import protocol

MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
#: Images written per block when making the input.
WRITE_BLOCK = 65_536
#: Check every this many output rows (and the last).
CHECK_STRIDE = 10_000
ATOL = 1e-5
SLOTS = 2  # the workers' default --slots
MIB = 1 << 20

#: Runs a command and prints its peak RSS like ``/usr/bin/time -v`` (when that is missing).
RUSAGE_LAUNCHER = (
    "import resource, subprocess, sys\n"
    "code = subprocess.call(sys.argv[1:])\n"
    "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
    "print(f'Maximum resident set size (kbytes): {peak}', file=sys.stderr)\n"
    "sys.exit(code)\n"
)


@dataclass
class MemoryCgroup:
    """A cgroup-v1 memory cgroup made for this run, or ``path`` None when it cannot be made."""

    path: Path | None
    limit: int
    why_not: str = ""

    @classmethod
    def make(cls, limit: int) -> MemoryCgroup:
        if os.geteuid() != 0:
            return cls(None, limit, "not root")
        if not (MEMORY_ROOT / "cgroup.procs").exists():
            return cls(None, limit, f"no cgroup-v1 memory controller at {MEMORY_ROOT}")
        path = own_memory_cgroup() / f"farm-bigfile-{os.getpid()}"
        try:
            path.mkdir()
            (path / "memory.limit_in_bytes").write_text(str(limit))
        except OSError as exc:
            if path.exists():
                path.rmdir()
            return cls(None, limit, f"cannot make {path}: {exc}")
        return cls(path, limit)

    def wrap(self, command: list[str]) -> list[str]:
        """``command``, started inside the cgroup (its shell joins, then execs it)."""
        if self.path is None:
            return command
        procs = shlex.quote(str(self.path / "cgroup.procs"))
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *command]

    def read(self, name: str) -> int | None:
        return int((self.path / name).read_text()) if self.path else None

    def remove(self) -> None:
        """Drop what is still charged (the page cache) and remove the cgroup."""
        if self.path is None:
            return
        try:
            (self.path / "memory.force_empty").write_text("0")
        except OSError:
            pass
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:  # a process not quite gone yet
                time.sleep(0.1)
        print(f"warning: could not remove {self.path}")


def own_memory_cgroup() -> Path:
    """This process's memory cgroup folder (from /proc/self/cgroup)."""
    with open("/proc/self/cgroup") as handle:
        for line in handle:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                folder = MEMORY_ROOT / path.lstrip("/")
                if folder.is_dir():
                    return folder
    return MEMORY_ROOT


def make_input(path: Path, count: int) -> None:
    """N x 28 x 28 uint8 LeNet digits (image i is sample[i % len(sample)]), written a block at
    a time, synced and dropped from the page cache (so the farm's reads are charged to it)."""
    sample = np.load(find("lenet").sample)
    writer = NpyWriter(path, count)
    try:
        for start in range(0, count, WRITE_BLOCK):
            size = min(WRITE_BLOCK, count - start)
            rolled = np.roll(sample, -(start % len(sample)), axis=0)
            writer.write(start, np.resize(rolled, (size, *sample.shape[1:])))
        os.fsync(writer.fd)
        os.posix_fadvise(writer.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        writer.close()


def submit(cgroup: MemoryCgroup, endpoint: str, images: Path, out: Path) -> tuple[float, int, str]:
    """Run ``farm submit`` in the cgroup; its wall seconds, peak RSS (KiB) and stdout."""
    command = farm_command(
        "--log-level",
        "WARNING",
        "submit",
        str(images),
        "--model",
        "lenet",
        "--out",
        str(out),
        "--quiet",
        "--broker",
        endpoint,
        "--timeout",
        "120",
    )
    timer = shutil.which("time")  # GNU time: "-v" prints the peak RSS
    wrapped = (
        [timer, "-v", *command] if timer else [sys.executable, "-c", RUSAGE_LAUNCHER, *command]
    )
    started = time.perf_counter()
    done = subprocess.run(cgroup.wrap(wrapped), check=False, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(
            f"farm submit failed (exit code {done.returncode}):\n{done.stdout}{done.stderr}"
        )
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    return wall, int(peak.group(1)) if peak else 0, done.stdout


def verify(images: Path, out: Path, count: int) -> list[str]:
    """Problems with out.npy: row count, NaNs, sampled rows against in-process outputs."""
    from farm.engines.autoselect import load_engine
    from farm.engines.engine import limit_threads

    outputs = np.load(out, mmap_mode="r")
    if len(outputs) != count:
        return [f"out.npy has {len(outputs)} rows, the input {count}"]
    nans = sum(int(np.isnan(outputs[i : i + (1 << 20)]).sum()) for i in range(0, count, 1 << 20))
    rows = sorted({*range(0, count, CHECK_STRIDE), count - 1})
    reader = NpyReader.open(images)
    inputs = np.concatenate([reader.read(row, 1) for row in rows])
    reader.close()
    limit_threads(1)
    expected = load_engine(find("lenet"), "opencv", threads=1).run(inputs[:, np.newaxis])
    difference = float(np.abs(outputs[rows].reshape(expected.shape) - expected).max())
    print(
        f"checked: {len(outputs):,} rows, {nans} NaN values; {len(rows)} sampled rows "
        f"(every {CHECK_STRIDE:,}th and the last) within {difference:.2g} of in-process "
        f"outputs"
    )
    problems = [f"{nans} NaN values in out.npy"] if nans else []
    if not difference <= ATOL:
        problems.append(f"sampled rows differ from in-process outputs by {difference:.3g}")
    return problems


def bigfile(args: argparse.Namespace, folder: Path) -> int:
    """Make the input, run the farm on it in the cgroup, print the report; the exit status."""
    item_bytes = 28 * 28
    count = int(args.size_gib * (1 << 30)) // item_bytes
    images, out = folder / "big.npy", folder / "out.npy"
    print(machine())
    started = time.perf_counter()
    make_input(images, count)
    size = images.stat().st_size
    print(
        f"input: {images} {count:,} x 28 x 28 uint8, {size / MIB:,.0f} MiB, written in "
        f"{time.perf_counter() - started:.1f} s",
        flush=True,
    )
    cgroup = MemoryCgroup.make(args.limit_mib * MIB)
    if cgroup.path:
        limit = cgroup.read("memory.limit_in_bytes")
        print(
            f"memory cgroup {cgroup.path}: limit {limit / MIB:,.0f} MiB (the input is "
            f"{size / limit:.1f}x that); the page cache counts"
        )
    else:
        print(
            f"NO MEMORY LIMIT: cannot make a memory cgroup ({cgroup.why_not}); the farm runs "
            f"unconstrained, peak RSS figures only"
        )
    devices = [f"cpu:{core}" for core in cores()[: args.workers]]
    try:
        with LocalFarm(devices=devices, preload=["lenet"], launcher=cgroup.wrap([])) as local:
            wall, client_peak, summary = submit(cgroup, local.endpoint, images, out)
            peaks = {"broker": status_kib(local.broker.pid, "VmHWM")}
            for device, worker in zip(devices, local.workers):
                peaks[f"worker {device}"] = status_kib(worker.pid, "VmHWM")
            peaks["client (farm submit)"] = client_peak
            cgroup_peak, failcnt = (
                cgroup.read("memory.max_usage_in_bytes"),
                cgroup.read("memory.failcnt"),
            )
    finally:
        cgroup.remove()
    print(f"farm: broker + {len(devices)} workers ({', '.join(devices)}), policy equal-finish")
    print("farm submit's summary:")
    print("  " + summary.strip().replace("\n", "\n  "))
    print(
        f"\nimages {count:,}, wall {wall:.1f} s (farm submit, start to exit), "
        f"{count / wall:,.0f} images/s"
    )
    print(f"{'process':<22} {'peak RSS (MiB)':>15}")
    for name, peak in peaks.items():
        print(f"{name:<22} {peak / 1024:>15.1f}")
    print(f"{'sum':<22} {sum(peaks.values()) / 1024:>15.1f}")
    if cgroup_peak is not None:
        print(
            f"cgroup: peak usage {cgroup_peak / MIB:,.1f} MiB of {cgroup.limit / MIB:,.0f} "
            f"MiB (page cache included), failcnt {failcnt} (times usage hit the limit and "
            f"the kernel reclaimed)"
        )
    chunk_items = protocol.MAX_TASK_BYTES // item_bytes
    in_flight = len(devices) * SLOTS
    print(
        f"claimed bounds: chunks of at most {protocol.MAX_TASK_BYTES / MIB:.0f} MiB "
        f"(MAX_TASK_BYTES, {chunk_items:,} images); {len(devices)} workers x {SLOTS} slots = "
        f"{in_flight} chunks in flight, {in_flight * protocol.MAX_TASK_BYTES / MIB:.0f} MiB "
        f"through the broker and the client, {SLOTS * protocol.MAX_TASK_BYTES / MIB:.0f} MiB "
        f"per worker"
    )
    problems = verify(images, out, count)
    for problem in problems:
        print(f"  {problem}")
    print("PASS" if not problems else "FAIL")
    return 1 if problems else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.5, help="input size")
    parser.add_argument(
        "--limit-mib",
        type=int,
        default=768,
        help="memory limit of the farm's cgroup (page cache included)",
    )
    parser.add_argument("--workers", type=int, default=2, help="pinned workers (one per core)")
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where the temporary folder for big.npy and out.npy goes",
    )
    parser.add_argument("--keep", action="store_true", help="keep big.npy and out.npy")
    parser.add_argument(
        "--save",
        type=Path,
        default=Path(f"bench/results/{date.today()}-bigfile.txt"),
        help="also write the report here ('-': nowhere)",
    )
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="farm-bigfile-", dir=args.dir))
    try:
        status = saved(args.save, lambda: bigfile(args, folder))
    finally:
        if args.keep:
            print(f"kept {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    sys.exit(status)


if __name__ == "__main__":
    main()
