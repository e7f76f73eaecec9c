"""Each precision against f32, per model, on one pinned core; then `--precision auto` end
to end on a folder of JPEGs.

For each model: f32, bf16 and f16 (where OpenVINO offers them on this CPU) on OpenVINO,
and int8 (``farm models quantize``'s version, calibrated on ``--calibration`` crops of
real photos) on OpenVINO and on ONNX Runtime, each one thread in this process pinned to
one core, as a worker runs.  Printed per precision: images/s (the best of ``--rounds``
windows of ``--window`` s, taken in turn across the precisions, batch 16), the ratio to
f32 on the same engine, the top-1 agreement with f32 and the largest output difference
(relative to f32's largest output) on ``--images`` other crops of the photos (never
used for calibration: another seed), and the precision gate's verdict at 99%.  LeNet is
calibrated on digits 500-799 of its bundled sample and validated on digits 0-299, also
scored against their labels.  The public nets of bench/nets carry seeded weights, not
trained ones: their agreement measures the arithmetic, not a classifier's margins.

``--end-to-end``: 2 000 JPEGs of 500x375 to 800x600 (``bench/wholeprocess.py``'s
folder), SqueezeNet v1.0 (resize 256, centre crop), calibrated on 300 other JPEGs;
``farm run --precision auto`` (once per ``--min-agreement``, 99 and 95 by default)
against ``farm run`` in f32, in turn, ``--rounds`` times (the gate's verdicts remembered
after the first): wall time, the ratio, and the top-1 agreement over every file.

    python bench/precision.py [--models squeezenet_v1.0,lenet] [--end-to-end] [--save F]
    python bench/precision.py --models "" --end-to-end     # the end-to-end part alone
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from farm.benchsuite.common import cpu_line, machine, saved, shared_squeezenet
from farm.benchsuite.photos import crops
from farm.engines import gate, quantize
from farm.engines.autoselect import load_engine
from farm.engines.engine import Engine
from farm.engines.tolerances import relative_difference
from farm.modelrepo.repository import ModelSpec, find, load_spec, prepare
from farm.ops.local import cores, farm_command

NETS = Path(__file__).with_name("nets")
SHARED = Path(__file__).resolve().parents[2] / "shared" / "models" / "squeezenet_v1.0"
MODELS = ("squeezenet_v1.0", "resnet50", "googlenet", "mobilenet_v2", "lenet")
BATCH = gate.TIMING_BATCH


@dataclass
class Row:
    """One precision of one model."""

    label: str
    rate: float
    ratio: float
    agreement: float
    difference: float
    accuracy: float | None
    verdict: str


def model_spec(name: str, work: Path) -> ModelSpec:
    if name == "squeezenet_v1.0":
        if not SHARED.is_dir():
            raise SystemExit(f"the real SqueezeNet is not at {SHARED}")
        return load_spec(shared_squeezenet(work / "models", SHARED))
    spec = find(name, [NETS])
    prepare(spec)
    return spec


def image_sets(
    spec: ModelSpec, count: int, calibration: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Calibration images, validation images, and the validation labels where known."""
    if spec.name == "lenet":
        digits = np.load(spec.sample)[:, np.newaxis]
        labels = np.load(spec.sample_labels)
        return digits[500 : 500 + calibration], digits[:count], labels[:count]
    size = spec.item_shape[:2]  # HWC nets: height, width, 3
    return crops(calibration, 1, size), crops(count, 2, size), None


def bench_model(name: str, args: argparse.Namespace, work: Path) -> list[Row]:
    spec = model_spec(name, work)
    calibration, validation, labels = image_sets(spec, args.images, args.calibration)
    started = time.perf_counter()
    record = quantize.quantize(spec, calibration)
    print(
        f"\n{spec.name}: {record.describe()}, in {time.perf_counter() - started:.1f} s; "
        f"{len(validation)} validation images"
    )
    engines: dict[str, Engine] = {"openvino f32": load_engine(spec, "openvino", BATCH, threads=1)}
    offered = engines["openvino f32"].precisions(spec, "cpu")
    for precision in ("bf16", "f16", "int8"):
        if precision in offered:
            engines[f"openvino {precision}"] = load_engine(
                spec, "openvino", BATCH, threads=1, precision=precision
            )
    engines["onnxruntime f32"] = load_engine(spec, "onnxruntime", BATCH, threads=1)
    engines["onnxruntime int8"] = load_engine(
        spec, "onnxruntime", BATCH, threads=1, precision="int8"
    )
    outputs = {label: flat(engine.run(validation)) for label, engine in engines.items()}
    found = gate.alternating_rates(list(engines.values()), validation, args.rounds, args.window)
    rates = dict(zip(engines, found))
    rows = []
    for label in engines:
        backend, precision = label.split()
        reference = outputs[f"{backend} f32"]
        agreement = float((outputs[label].argmax(1) == reference.argmax(1)).mean())
        ratio = rates[label] / rates[f"{backend} f32"]
        verdict = gate.Verdict(precision, len(validation), agreement, 0.0, ratio)
        passes = verdict.passes(gate.MIN_AGREEMENT) if precision != "f32" else True
        rows.append(
            Row(
                label,
                rates[label],
                ratio,
                agreement,
                relative_difference(outputs[label], reference),
                None if labels is None else float((outputs[label].argmax(1) == labels).mean()),
                "-" if precision == "f32" else ("passes" if passes else "refused"),
            )
        )
    return rows


def flat(outputs: np.ndarray) -> np.ndarray:
    return outputs.reshape(len(outputs), -1)


def print_rows(rows: list[Row]) -> None:
    print(
        f"  {'engine, precision':<18} {'images/s':>9} {'vs f32':>7} {'top-1 agrees':>13} "
        f"{'largest diff':>13} {'accuracy':>9}  gate at 99%"
    )
    for row in rows:
        accuracy = "-" if row.accuracy is None else f"{row.accuracy:.1%}"
        print(
            f"  {row.label:<18} {row.rate:>9.1f} {row.ratio:>6.2f}x {row.agreement:>13.1%} "
            f"{row.difference:>13.1e} {accuracy:>9}  {row.verdict}"
        )


def end_to_end(args: argparse.Namespace, work: Path) -> None:
    """``farm run photos/ --precision auto`` against f32 on 2 000 JPEGs."""
    sys.path.insert(0, str(Path(__file__).parent))
    from wholeprocess import make_jpegs

    models = work / "e2e-models"
    shared_squeezenet(models, SHARED, resize=True)
    make_jpegs(work / "photos", 2000, seed=0)
    make_jpegs(work / "calibration", 300, seed=1)
    farm = farm_command()
    common = ["--model", "squeezenet_v1.0", "--models-dir", str(models), "--quiet"]
    made = subprocess.run(
        [*farm, "models", "quantize", "squeezenet_v1.0", "--calibration",
         str(work / "calibration"), "--models-dir", str(models)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    print(f"\nend to end: {made.stdout.splitlines()[0]}")
    photos = str(work / "photos")
    runs = {
        "f32": [*farm, "run", photos, *common],
        **{
            f"auto {least}%": [*farm, "run", photos, *common, "--precision", "auto",
                               "--min-agreement", str(least)]
            for least in args.min_agreement
        },
    }  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.rounds):
        for name, command in runs.items() if round_ % 2 == 0 else reversed(runs.items()):
            out = str(work / f"{name.replace(' ', '-')}.npy")
            started = time.perf_counter()
            done = subprocess.run([*command, "--out", out], capture_output=True, text=True)
            times[name].append(time.perf_counter() - started)
            if done.returncode != 0:
                raise SystemExit(f"{name} failed: {done.stderr}")
            if name != "f32" and round_ == 0:
                print(f"  {name}, first run:")
                print("\n".join(f"    {line}" for line in done.stderr.splitlines()[:8]))
    f32 = flat(np.load(work / "f32.npy")).argmax(1)
    best_f32 = min(times["f32"])
    print(f"  f32: {best_f32:.2f} s (best of {args.rounds})")
    for name in list(runs)[1:]:
        found = flat(np.load(work / f"{name.replace(' ', '-')}.npy")).argmax(1)
        first, later = times[name][0], min(times[name][1:] or times[name])
        print(
            f"  {name}: {first:.2f} s with the gate measured, {later:.2f} s with its verdicts "
            f"remembered (best); f32 / it = {best_f32 / later:.2f}x; top-1 agrees with f32 "
            f"on {(found == f32).mean():.1%} of {len(f32)} files"
        )


def main(args: argparse.Namespace) -> int:
    usable = set(cores())
    core = max(usable)
    os.sched_setaffinity(0, {core})
    print(f"{cpu_line()}\n{machine()}\none thread pinned to core {core}, batch {BATCH}")
    with tempfile.TemporaryDirectory(prefix="farm-precision-") as scratch:
        work = Path(scratch)
        os.environ["FARM_CACHE"] = str(work / "cache")
        for name in filter(None, args.models.split(",")):
            print_rows(bench_model(name, args, work))
        if args.end_to_end:
            os.sched_setaffinity(0, usable)  # the farm's workers: one per core
            end_to_end(args, work)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--images", type=int, default=300, help="validation images")
    parser.add_argument("--calibration", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=1.0)
    parser.add_argument("--end-to-end", action="store_true")
    parser.add_argument(
        "--min-agreement",
        type=float,
        nargs="+",
        default=[99.0, 95.0],
        help="end to end: the --min-agreement of each auto run",
    )
    parser.add_argument("--save", type=Path, default=Path("-"))
    arguments = parser.parse_args()
    sys.exit(saved(arguments.save, lambda: main(arguments)))
