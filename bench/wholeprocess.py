"""``farm run`` as a whole process beside the best in-process scripts, on the same images.

    python bench/wholeprocess.py [--rounds 5] [--jobs NAME,...] [--warm | --no-warm]

The jobs (``--jobs``, default all): ``cifar10-20k`` (20 000 CIFAR-10 quick images),
``lenet-100k``, ``caffenet-500`` (``.npy`` arrays: the model's sample, or seeded random
images, repeated to the count), ``squeezenet-jpeg-2k`` (a folder of 2 000 JPEGs of
500x375 to 800x600 cut from scikit-image's photos, seeded, on the ImageNet SqueezeNet
v1.0 of ``../shared/models/squeezenet_v1.0``, resized to 256 and centre-cropped) and
``cifar10-10`` (10 CIFAR-10 quick images: the fixed cost).  For each job the images are
written once and ``farm models export`` writes the ONNX file the scripts read.  One
warm-up of each command fills the caches (``auto``'s choice, generated weights, the
page cache).  Then each round times, in turn (the order rotates from round to round),
as whole processes with start-up included:

- ``farm run IMAGES --model M --out OUT.npy`` (its default: a broker and one pinned
  worker per core on ``auto``, f32), whose summary also gives the job's waste;
- ``bench/user_script.py onnxruntime``: ONNX Runtime f32, all threads, one process;
- ``bench/user_script.py openvino``: OpenVINO f32, THROUGHPUT hint, async queue (for the
  folder: decoding in a thread pool ahead of it).

With ``--warm`` (the default, when this farm has ``farm up``), ``farm up --model M``
then starts a background farm (not timed) and the same rounds run again with
``farm run`` on it, beside the peers again; ``farm down`` stops it.  Every command runs
with ``FARM_RUNTIME_DIR`` in a folder of this bench's own, so no other background farm of
this user is used, and the cold ``farm run`` starts its own farm.

Printed per job and farm (cold, warm): each command's median seconds, farm's speed over
the best peer's (above 1: farm faster), CPU seconds per image of farm and of the best
peer (medians) and their ratio, ``farm run``'s waste, and the largest difference between
farm's outputs and the peers'.  CPU seconds are ``getrusage(RUSAGE_CHILDREN)`` deltas
around each process: they include the broker and workers of a cold ``farm run``, which
are its children and are reaped (checked at the start against ``/proc``); a warm farm's
processes are not, so their ``/proc`` CPU times are added.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from farm.benchsuite.common import shared_squeezenet
from farm.engines.cpu import cpu_flags
from farm.engines.modelcheck import check_inputs
from farm.engines.tolerances import relative_difference
from farm.modelrepo.repository import find, prepare
from farm.ops.local import farm_command

SCRIPT = Path(__file__).with_name("user_script.py")
SHARED = Path(__file__).resolve().parents[2] / "shared" / "models" / "squeezenet_v1.0"
PEERS = ("onnxruntime", "openvino")
#: The peers' batch per model and engine, as their authors would tune it: the best CPU
#: seconds per image of batches 64-1024 (LeNet, CIFAR-10 quick) or 1-32 (227 x 227 nets)
#: on the 2-core AMD EPYC, 2026-11-26 (a busy machine: near-ties kept the old batch).
PEER_BATCH = {
    "lenet": {"onnxruntime": 1024, "openvino": 256},
    "cifar10_quick": {"onnxruntime": 256, "openvino": 64},
    "caffenet": {"onnxruntime": 32, "openvino": 16},
    "squeezenet_v1.0": {"onnxruntime": 32, "openvino": 1},
}
RUNTIME_VARIABLE = "FARM_RUNTIME_DIR"
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Job:
    """A job of the race: ``images`` images of ``model``."""

    name: str
    model: str
    images: int
    jpegs: bool = False  # a folder of JPEG files, else one .npy array


JOBS = {
    job.name: job
    for job in (
        Job("cifar10-20k", "cifar10_quick", 20_000),
        Job("lenet-100k", "lenet", 100_000),
        Job("caffenet-500", "caffenet", 500),
        Job("squeezenet-jpeg-2k", "squeezenet_v1.0", 2_000, jpegs=True),
        Job("cifar10-10", "cifar10_quick", 10),
    )
}


@dataclass(frozen=True)
class Run:
    """One timed process: wall seconds, CPU seconds (its reaped children's included), its
    stdout and stderr."""

    seconds: float
    cpu: float
    stdout: str
    stderr: str


@dataclass
class Rounds:
    """The runs of one phase (farm cold or warm, beside the peers), by command."""

    farm: str  # "cold" or "warm"
    runs: dict[str, list[Run]] = field(default_factory=dict)


# --- the machine -------------------------------------------------------------------------


def cpu_line() -> str:
    """lscpu's model name, the cores, and the flags that decide a CPU engine's precision."""
    found = re.search(r"Model name:\s*(.+)", lscpu())
    flags = cpu_flags()
    marks = ", ".join(
        f"{name} {'yes' if any(flag.startswith(name) for flag in flags) else 'no'}"
        for name in ("avx512_bf16", "avx512_vnni", "amx")
    )
    return (
        f"CPU: {found.group(1).strip() if found else 'unknown'}, {os.cpu_count()} CPUs "
        f"({len(os.sched_getaffinity(0))} usable here); {marks}"
    )


def lscpu() -> str:
    """lscpu's printout, or nothing where it is missing."""
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return ""


def load_average() -> str:
    """The 1, 5 and 15 minute load averages."""
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


# --- CPU seconds ---------------------------------------------------------------------------


def children_cpu() -> float:
    """User + system seconds of this process's reaped children (and theirs, reaped)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def proc_stat(pid: int) -> tuple[int, float] | None:
    """A live process's parent pid and its own CPU seconds; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS


def tagged(runtime: str) -> list[int]:
    """The live processes started with ``FARM_RUNTIME_DIR=runtime``: this bench's."""
    mark = f"{RUNTIME_VARIABLE}={runtime}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def tagged_cpu(runtime: str) -> float:
    """CPU seconds the live processes of this bench's background farm have used so far."""
    return sum(stat[1] for pid in tagged(runtime) if (stat := proc_stat(pid)))


def reaping_check(command: list[str], env: dict[str, str]) -> str:
    """Run ``farm run`` once, watching its processes in ``/proc``: are its broker and workers
    its descendants, and does ``RUSAGE_CHILDREN`` count their CPU?"""
    runtime = env[RUNTIME_VARIABLE]
    before = children_cpu()
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    seen: dict[int, tuple[int, float]] = {}
    while process.poll() is None:  # poll() reaps it at the end
        for pid in tagged(runtime):
            if stat := proc_stat(pid):
                seen[pid] = stat
        time.sleep(0.02)
    counted = children_cpu() - before
    descendants = {process.pid}
    for _ in range(len(seen)):  # parents before children, whatever the order seen
        descendants |= {pid for pid, (parent, _) in seen.items() if parent in descendants}
    strangers = set(seen) - descendants
    sampled = sum(cpu for _, cpu in seen.values())
    counts = not strangers and counted >= 0.9 * sampled
    return (
        f"CPU check: farm run started {len(descendants) - 1} processes (broker, workers...), "
        + (
            "all its descendants and reaped: RUSAGE_CHILDREN counts their CPU"
            if counts
            else "NOT all counted by RUSAGE_CHILDREN: farm's CPU per image is too low"
        )
        + f" ({counted:.2f} CPU-s counted, {sampled:.2f} seen in /proc, a lower bound"
        + (f"; {len(strangers)} not its descendants" if strangers else "")
        + ")"
    )


# --- the jobs' inputs ----------------------------------------------------------------------


def photos() -> list[np.ndarray]:
    """scikit-image's colour photos, as bench/images.py cuts them."""
    import skimage.data

    return [
        skimage.data.chelsea(),
        skimage.data.coffee(),
        skimage.data.astronaut(),
        skimage.data.rocket(),
        skimage.data.immunohistochemistry(),
    ]


def make_jpegs(folder: Path, count: int, seed: int = 0) -> None:
    """``count`` JPEGs (quality 90) of 500x375 to 800x600 (4:3): random crops of
    scikit-image's photos, resized, some mirrored, colours shifted; seeded."""
    import cv2

    sources = photos()
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for index in range(count):
        photo = sources[index % len(sources)]
        width = int(rng.integers(500, 801))
        height = width * 3 // 4
        crop_w = int(min(photo.shape[1], photo.shape[0] * 4 / 3) * rng.uniform(0.6, 1.0))
        crop_h = crop_w * 3 // 4
        top = int(rng.integers(0, photo.shape[0] - crop_h + 1))
        left = int(rng.integers(0, photo.shape[1] - crop_w + 1))
        crop = photo[top : top + crop_h, left : left + crop_w]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        crop = np.clip(crop * rng.uniform(0.8, 1.2, 3), 0, 255).astype(np.uint8)
        image = cv2.resize(crop, (width, height), interpolation=cv2.INTER_AREA)
        path = str(folder / f"{index:05d}.jpg")
        cv2.imwrite(path, image[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 90])


def model_folder(job: Job, folder: Path) -> Path | None:
    """For the JPEG job, a model folder holding the shared SqueezeNet (resize 256, centre
    crop): farm's commands get it as ``--models-dir``, the peers as their MODELS_DIR."""
    if not job.jpegs:
        return None
    if not SHARED.is_dir():
        raise SystemExit(f"the real SqueezeNet is not at {SHARED}")
    shared_squeezenet(folder / "models", SHARED, resize=True)
    return folder / "models"


def folder_options(models_dir: Path | None) -> list[str]:
    """``--models-dir`` for farm's commands, where the job's model needs it."""
    return ["--models-dir", str(models_dir)] if models_dir else []


def write_inputs(job: Job, folder: Path, models_dir: Path | None, env: dict[str, str]) -> str:
    """The job's images in ``folder`` (a .npy, or a folder of JPEGs) and its ONNX export;
    the IMAGES argument of its commands."""
    if job.jpegs:
        make_jpegs(folder / "photos", job.images)
        images = folder / "photos"
    else:
        spec = find(job.model)
        prepare(spec)
        images = folder / "images.npy"
        np.save(images, np.resize(check_inputs(spec, 1000), (job.images, *spec.item_shape)))
    subprocess.run(
        farm_command(
            "models",
            "export",
            job.model,
            "--onnx",
            str(folder / "model.onnx"),
            *folder_options(models_dir),
        ),
        check=True,
        capture_output=True,
        env=env,
    )
    return str(images)


def commands(
    job: Job, images: str, folder: Path, models_dir: Path | None, farm: str
) -> dict[str, list[str]]:
    """``farm run`` (its outputs to ``farm-<cold|warm>.npy``) and each peer's command."""
    out = str(folder / f"farm-{farm}.npy")
    options = ["--model", job.model, "--quiet", "--out", out, *folder_options(models_dir)]
    runs = {f"farm run {farm}": farm_command("run", images, *options)}
    for peer in PEERS:
        onnx, peer_out = str(folder / "model.onnx"), str(folder / f"{peer}.npy")
        batch = str(PEER_BATCH.get(job.model, {}).get(peer, 16))
        runs[peer] = [sys.executable, str(SCRIPT), peer, onnx, images, peer_out, job.model, batch]
        runs[peer] += [str(models_dir)] if models_dir else []
    return runs


# --- timing --------------------------------------------------------------------------------


def timed(command: list[str], env: dict[str, str], warm: bool) -> Run:
    """One whole process: wall seconds, and CPU seconds (a warm farm's included)."""
    runtime = env[RUNTIME_VARIABLE]
    farm_before = tagged_cpu(runtime) if warm else 0.0
    before = children_cpu()
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    cpu = children_cpu() - before + (tagged_cpu(runtime) - farm_before if warm else 0.0)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return Run(seconds, cpu, done.stdout, done.stderr)


def rotated(names: Sequence[str], round_: int) -> list[str]:
    """The commands' order in round ``round_``: each round starts one further on."""
    shift = round_ % len(names)
    return [*names[shift:], *names[:shift]]


def run_rounds(runs: dict[str, list[str]], env: dict[str, str], rounds: int, farm: str) -> Rounds:
    """One warm-up of each command, then ``rounds`` rounds in rotating order."""

    def run(name: str) -> Run:  # a warm farm's CPU counts for farm run, not for the peers
        return timed(runs[name], env, warm=farm == "warm" and name.startswith("farm run"))

    for name in runs:
        run(name)
    result = Rounds(farm, {name: [] for name in runs})
    for round_ in range(rounds):
        for name in rotated(list(runs), round_):
            result.runs[name].append(run(name))
    return result


# --- the warm farm -------------------------------------------------------------------------


def up_known(env: dict[str, str]) -> bool:
    """Whether this farm has ``farm up`` and ``farm down``."""
    return all(
        subprocess.run(farm_command(name, "--help"), capture_output=True, env=env).returncode == 0
        for name in ("up", "down")
    )


@contextmanager
def warm_farm(job: Job, models_dir: Path | None, env: dict[str, str]) -> Iterator[str]:
    """``farm up --model M`` for the job (what it printed), ``farm down`` after."""
    try:
        started = subprocess.run(
            farm_command("up", "--model", job.model, *folder_options(models_dir)),
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        if started.returncode:
            raise SystemExit(f"farm up failed ({started.returncode}):\n{started.stderr[-3000:]}")
        yield started.stderr.strip().splitlines()[-1] if started.stderr.strip() else ""
    finally:
        subprocess.run(farm_command("down"), capture_output=True, env=env, timeout=120)


# --- the figures ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One job on one farm (cold or warm) beside the peers: the printed figures."""

    job: Job
    farm: str
    medians: dict[str, float]
    best_peer: str
    cpu_farm: float  # CPU seconds per image, medians
    cpu_peer: float
    waste: float | None
    difference: float
    notes: list[str]
    every: dict[str, list[float]]

    @property
    def speed(self) -> float:
        """farm's images/s over the best peer's."""
        return self.medians[self.best_peer] / self.medians[self.farm_name]

    @property
    def farm_name(self) -> str:
        """The farm's command, as ``Rounds.runs`` names it."""
        return f"farm run {self.farm}"


def summarize(job: Job, rounds: Rounds, folder: Path) -> Row:
    """Medians, the best peer, CPU per image, waste and the outputs' difference."""
    runs = rounds.runs
    farm_name = f"farm run {rounds.farm}"
    medians = {name: statistics.median(r.seconds for r in values) for name, values in runs.items()}
    best_peer = min(PEERS, key=medians.__getitem__)
    wastes = [
        float(found.group(1))
        for run in runs[farm_name]
        if (found := re.search(r"waste (-?[\d.]+)%", run.stdout + run.stderr))
    ]
    return Row(
        job=job,
        farm=rounds.farm,
        medians=medians,
        best_peer=best_peer,
        cpu_farm=statistics.median(r.cpu for r in runs[farm_name]) / job.images,
        cpu_peer=statistics.median(r.cpu for r in runs[best_peer]) / job.images,
        waste=statistics.median(wastes) if wastes else None,
        difference=largest_difference(folder, rounds.farm),
        notes=notes(runs, rounds.farm),
        every={name: [r.seconds for r in values] for name, values in runs.items()},
    )


def largest_difference(folder: Path, farm: str) -> float:
    """The largest relative difference between farm's outputs and any peer's."""
    reference = np.load(folder / f"farm-{farm}.npy")
    differences = []
    for peer in PEERS:
        outputs = np.load(folder / f"{peer}.npy")
        if outputs.size == reference.size:
            outputs = outputs.reshape(reference.shape)
        differences.append(relative_difference(reference, outputs))
    return max(differences)


def notes(runs: dict[str, list[Run]], farm: str) -> list[str]:
    """What each side said about itself: farm's first lines (where its farm came from, its
    engines), the peers' settings; a warning when farm did not run on the farm meant."""
    lines = runs[f"farm run {farm}"][-1].stderr.splitlines()
    first = lines[0] if lines else "(nothing on stderr)"
    found = [f"farm: {first}"]
    found += [f"farm: {line}" for line in lines[1:] if line.startswith("farm ready")][:1]
    meant = "starting a local farm" if farm == "cold" else "using the local farm"
    if not first.startswith(meant):
        found.append(f"WARNING: this farm run did not run on a {farm} farm")
    for peer in PEERS:
        found += [f"{peer}: {line}" for line in runs[peer][-1].stdout.splitlines()]
    return found


HEADER = (
    f"{'job':<19} {'farm':<4} {'images':>7}  {'farm run':>8} {'onnxrt':>7} {'openvino':>8}"
    f"  {'farm/best':>9}  {'CPU ms/image farm':>17} {'peer':>7} {'farm/peer':>9}"
    f"  {'waste':>6}  difference"
)


def row_text(row: Row) -> str:
    """The row of the table."""
    medians = row.medians
    waste = f"{row.waste:.1f}%" if row.waste is not None else "-"
    return (
        f"{row.job.name:<19} {row.farm:<4} {row.job.images:>7,}  "
        f"{medians[row.farm_name]:>7.2f}s {medians['onnxruntime']:>6.2f}s "
        f"{medians['openvino']:>7.2f}s  {row.speed:>8.2f}x  "
        f"{row.cpu_farm * 1e3:>17.4g} {row.cpu_peer * 1e3:>7.4g} "
        f"{row.cpu_farm / row.cpu_peer:>8.2f}x  {waste:>6}  {row.difference:.1e}"
    )


def details(row: Row) -> list[str]:
    """The lines under a row: what each side said of itself, every round's seconds."""
    every = "; ".join(
        f"{name} {', '.join(f'{value:.2f}' for value in values)}"
        for name, values in row.every.items()
    )
    return [
        *(f"    {note}" for note in row.notes),
        f"    best peer {row.best_peer}; every round (s): {every}",
    ]


# --- main ----------------------------------------------------------------------------------


def bench_job(job: Job, rounds: int, warm: bool, work: Path, env: dict[str, str]) -> list[Row]:
    """The job's cold rounds, then (``warm``) its rounds on a ``farm up`` farm."""
    folder = work / job.name
    folder.mkdir()
    models_dir = model_folder(job, folder)
    images = write_inputs(job, folder, models_dir, env)
    cold = run_rounds(commands(job, images, folder, models_dir, "cold"), env, rounds, "cold")
    rows = [summarize(job, cold, folder)]
    if warm:
        with warm_farm(job, models_dir, env) as said:
            runs = commands(job, images, folder, models_dir, "warm")
            row = summarize(job, run_rounds(runs, env, rounds, "warm"), folder)
        rows.append(dataclasses.replace(row, notes=[f"farm up: {said}", *row.notes]))
    return rows


def header(asked: bool, warm: bool, env: dict[str, str]) -> None:
    """The CPU, the precisions, the load, the CPU accounting check, the table's header."""
    print(cpu_line())
    print(
        "precision: farm f32 (farm run's default --precision; each job's engines below); "
        "peers f32: ONNX Runtime f32, OpenVINO INFERENCE_PRECISION_HINT f32 (this CPU's "
        "default would be bf16)"
    )
    print(f"load average at the start: {load_average()} (a shared machine: compare with the end)")
    print(reaping_check(farm_command("run", "--model", "lenet", "--quiet"), env))
    if not warm:
        print(
            "warm farm: skipped, `farm up` is not a command of this farm yet"
            if asked
            else "warm farm: not run (--no-warm)"
        )
    print()
    print(HEADER, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"of {', '.join(JOBS)}")
    parser.add_argument(
        "--warm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time farm run on a warm `farm up` farm",
    )
    args = parser.parse_args()
    unknown = set(args.jobs.split(",")) - set(JOBS)
    if unknown:
        parser.error(f"unknown jobs {', '.join(sorted(unknown))}; jobs: {', '.join(JOBS)}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="farm-wholeprocess-") as name:
        work = Path(name)
        (work / "runtime").mkdir(mode=0o700)
        env = {**os.environ, RUNTIME_VARIABLE: str(work / "runtime")}
        warm = args.warm and up_known(env)
        header(args.warm, warm, env)
        for job in (JOBS[name] for name in args.jobs.split(",")):
            for row in bench_job(job, args.rounds, warm, work, env):
                print(row_text(row), flush=True)
                print("\n".join(details(row)), flush=True)
    minutes = (time.perf_counter() - started) / 60
    print(f"\nload average at the end: {load_average()}; the whole run took {minutes:.1f} min")


if __name__ == "__main__":
    main()
