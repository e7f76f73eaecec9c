"""Each precision and cascade against f32, per model, on one pinned core; then
`--precision auto` end to end on a folder of JPEGs.

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

Cascades (``bf16+f32``, ``int8+f32``: ``farm.engines.cascade``): each reduced precision
with f32 behind it on the same engine, its margin fitted as the gate fits it on the
validation crops; then on ``--images`` held-out crops (a third seed; LeNet: digits
300-499 and 800-899) the share re-run, the top-1 agreement with f32, and images/s of
whole runs over the held-out images, timed in turn with f32's (and the gate's estimate
from the parts, ``gate.cascade_speedup``, beside it).  int8 is measured on every CPU
here, VNNI or not (without VNNI or AMX the gate and the workers leave it out).

``--end-to-end``: 2 000 JPEGs of 500x375 to 800x600 (``bench/wholeprocess.py``'s
folder), SqueezeNet v1.0 (resize 256, centre crop), calibrated on 300 other JPEGs;
``farm run --precision auto`` (once per ``--min-agreement``, the default and 95) and
each cascade with the margin the gate fits on the folder's first 300 images (on
OpenVINO, whatever the CPU) against ``farm run`` in f32, in turn, ``--rounds`` times
(the gate's verdicts remembered after the first): wall time, the ratio, and the top-1
agreement over every file.

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

from farm import defaults
from farm.benchsuite.common import cpu_line, machine, saved, shared_squeezenet
from farm.benchsuite.photos import crops
from farm.engines import gate, quantize
from farm.engines.autoselect import load_engine
from farm.engines.cascade import CascadeEngine, changed, relative, split_check
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
    rerun: float | None = None  # a cascade's share of images run again in f32
    estimate: float | None = None  # a cascade's speed over f32 as the gate estimates it


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
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """Calibration images, validation images, the validation labels where known, and
    held-out images the cascades' margins never saw."""
    if spec.name == "lenet":
        digits = np.load(spec.sample)[:, np.newaxis]
        labels = np.load(spec.sample_labels)
        held_out = np.concatenate([digits[300:500], digits[800:]])[:count]
        return digits[500 : 500 + calibration], digits[:count], labels[:count], held_out
    size = spec.item_shape[:2]  # HWC nets: height, width, 3
    return crops(calibration, 1, size), crops(count, 2, size), None, crops(count, 3, size)


def bench_model(name: str, args: argparse.Namespace, work: Path) -> list[Row]:
    spec = model_spec(name, work)
    calibration, validation, labels, held_out = image_sets(spec, args.images, args.calibration)
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
    return rows + cascade_rows(engines, outputs, rates, validation, held_out, args)


def cascade_rows(
    engines: dict[str, Engine],
    outputs: dict[str, np.ndarray],
    rates: dict[str, float],
    validation: np.ndarray,
    held_out: np.ndarray,
    args: argparse.Namespace,
) -> list[Row]:
    """Each reduced precision with f32 behind it: the margin fitted on the validation
    images (each half checked on the other, the larger kept), then measured on held-out
    images: share re-run, agreement with f32, and whole runs timed in turn with f32's."""
    rows = []
    for label, fast in engines.items():
        backend, precision = label.split()
        if precision == "f32":
            continue
        exact = engines[f"{backend} f32"]
        margin, _ = split_check(outputs[label], outputs[f"{backend} f32"], relative(precision))
        engine = CascadeEngine(fast, exact, margin, f"{precision}+f32")
        reference = flat(exact.run(held_out))
        answered = flat(engine.run(held_out))
        rerun = len(engine.last_run.rerun) / len(held_out)
        f32_rate, rate = whole_run_rates([exact, engine], held_out, args.rounds)
        ratio = rate / f32_rate
        agreement = 1 - float(changed(answered, reference).mean())
        verdict = gate.Verdict(f"{precision}+f32", len(held_out), agreement, 0.0, ratio)
        rows.append(
            Row(
                f"{backend} {precision}+f32",
                rate,
                ratio,
                agreement,
                relative_difference(answered, reference),
                None,
                "passes" if verdict.passes(gate.MIN_AGREEMENT) else "refused",
                rerun,
                gate.cascade_speedup(rates[label] / rates[f"{backend} f32"], rerun),
            )
        )
    return rows


def whole_run_rates(engines: list[Engine], images: np.ndarray, rounds: int) -> list[float]:
    """Images/s of ``Engine.run`` over all ``images``, the best of ``rounds`` runs taken in
    turn (a cascade's re-runs depend on the images, so it runs them all)."""
    best = [0.0] * len(engines)
    for _ in range(rounds):
        for index, engine in enumerate(engines):
            started = time.perf_counter()
            engine.run(images)
            best[index] = max(best[index], len(images) / (time.perf_counter() - started))
    return best


def flat(outputs: np.ndarray) -> np.ndarray:
    return outputs.reshape(len(outputs), -1)


def print_rows(rows: list[Row]) -> None:
    print(
        f"  {'engine, precision':<22} {'images/s':>9} {'vs f32':>7} {'re-run':>7} "
        f"{'top-1 agrees':>13} {'largest diff':>13} {'accuracy':>9}  "
        f"gate at {gate.MIN_AGREEMENT:.1%}"
    )
    for row in rows:
        accuracy = "-" if row.accuracy is None else f"{row.accuracy:.1%}"
        rerun = "-" if row.rerun is None else f"{row.rerun:.1%}"
        estimate = "" if row.estimate is None else f" (parts: {row.estimate:.2f}x)"
        print(
            f"  {row.label:<22} {row.rate:>9.1f} {row.ratio:>6.2f}x {rerun:>7} "
            f"{row.agreement:>13.1%} {row.difference:>13.1e} {accuracy:>9}  {row.verdict}"
            f"{estimate}"
        )
    print("  (cascades: margin fitted on the validation images, measured on held-out ones)")


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
        **{
            name: [*farm, "run", photos, *common, "--backend", "openvino", "--precision", text]
            for name, text in cascades(models / "squeezenet_v1.0", photos).items()
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
                reruns = [line for line in done.stdout.splitlines() if "cascade:" in line]
                print("\n".join(f"    {line}" for line in reruns))
    f32 = flat(np.load(work / "f32.npy")).argmax(1)
    best_f32 = min(times["f32"])
    print(f"  f32: {best_f32:.2f} s (best of {args.rounds})")
    for name in list(runs)[1:]:
        found = flat(np.load(work / f"{name.replace(' ', '-')}.npy")).argmax(1)
        first, later = times[name][0], min(times[name][1:] or times[name])
        print(
            f"  {name}: {first:.2f} s the first run (the gate measured, if auto), {later:.2f} s "
            f"later (best); f32 / it = {best_f32 / later:.2f}x; top-1 agrees with f32 "
            f"on {(found == f32).mean():.1%} of {len(f32)} files"
        )


def cascades(model: Path, photos: str) -> dict[str, str]:
    """Each cascade with the margin the gate fits on the folder's first images, measured
    here whatever the CPU (int8 too): name -> ``--precision`` text, run on OpenVINO."""
    from farm.client.inputs import open_input
    from farm.client.samples import first_images

    spec = load_spec(model)
    sample = first_images(open_input([photos]), spec, gate.MIN_VALIDATION * 3, "photos")
    judged = gate.judge(spec, sample.images, int8_anywhere=True, use_cache=False)
    fitted = {
        verdict.precision: f"{verdict.precision}={verdict.margin:.6g}"
        for verdict in judged.verdicts
        if verdict.margin is not None and verdict.problem is None
    }
    for verdict in judged.verdicts:
        print(f"  gate, job's first {judged.images}: {verdict.describe()}")
    return fitted


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
        default=[defaults.MIN_AGREEMENT, 95.0],
        help="end to end: the --min-agreement of each auto run",
    )
    parser.add_argument("--save", type=Path, default=Path("-"))
    arguments = parser.parse_args()
    sys.exit(saved(arguments.save, lambda: main(arguments)))
