"""Which int8 method keeps SqueezeNet's answers: ONNX Runtime's static quantization (farm's
recipe and its variants) against NNCF's, on one pinned core.

Each method quantizes farm's export of the real SqueezeNet v1.0 (uint8 images in, the
preprocessing folded in) on 300 crops of scikit-image's photos (``farm.benchsuite.photos``,
seed 1), and runs on OpenVINO, one thread, batch 16, against the f32 export in the same
process.  Printed per method: the speed over f32 (the best of ``--rounds`` windows taken
in turn), the top-1 agreement with f32 on 300 other crops (seed 2), how often f32's top-1
is among the method's top 5, and the seconds the quantizing took.  NNCF's rows need
``pip install nncf`` (farm does not depend on it); ``--accuracy-control`` adds NNCF's
accuracy-controlled mode (minutes), its agreement checked on half the calibration crops.

    python bench/quantizers.py [--rounds 3] [--accuracy-control] [--save FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from farm.benchsuite.common import cpu_line, machine, saved, shared_squeezenet
from farm.benchsuite.photos import crops
from farm.engines import quantize
from farm.engines.onnx_export import exported_onnx
from farm.modelrepo.repository import load_spec
from farm.ops.local import cores

SHARED = Path(__file__).resolve().parents[2] / "shared" / "models" / "squeezenet_v1.0"
BATCH = 16
SETTINGS = {
    "PERFORMANCE_HINT": "LATENCY",
    "INFERENCE_NUM_THREADS": 1,
    "NUM_STREAMS": 1,
    "ENABLE_CPU_PINNING": False,
}

Run = Callable[[np.ndarray], np.ndarray]


def compiled(model: object) -> Run:
    """A path or an in-memory OpenVINO model, compiled as a pinned worker compiles it."""
    import openvino

    # the layers left unquantized compute in f32, stated: a bf16 CPU's default is bf16
    settings = {**SETTINGS, "INFERENCE_PRECISION_HINT": "f32"}
    request = openvino.Core().compile_model(model, "CPU", settings).create_infer_request()
    return lambda batch: request.infer({0: batch})[0].copy()


def outputs(run: Run, images: np.ndarray) -> np.ndarray:
    parts = [run(images[start : start + BATCH]) for start in range(0, len(images), BATCH)]
    return np.concatenate(parts).reshape(len(images), -1)


def rate(run: Run, images: np.ndarray, seconds: float = 1.0) -> float:
    run(images[:BATCH])
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        start = done % (len(images) - BATCH)
        run(images[start : start + BATCH])
        done += BATCH
    return done / (time.perf_counter() - started)


def onnxruntime_method(
    source: Path, work: Path, name: str, calibration: np.ndarray, **options: object
) -> Path:
    """ONNX Runtime's ``quantize_static`` (QDQ, per channel, uint8 activations)."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    prepared, target = work / f"{name}-prepared.onnx", work / f"{name}.onnx"
    quant_pre_process(str(source), str(prepared), skip_symbolic_shape=True)
    batches = quantize.calibration_batches(calibration, "data")

    class Reader:
        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(batches, None)

    quantize_static(
        str(prepared),
        str(target),
        Reader(),  # type: ignore[arg-type]
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        **options,  # type: ignore[arg-type]
    )
    return target


def nncf_method(
    source: Path, calibration: np.ndarray, reference: Run, accuracy: bool
) -> object | str:
    """NNCF's post-training quantization (PERFORMANCE preset, fast bias correction), or its
    accuracy-controlled mode; why not, when NNCF is not installed."""
    try:
        import nncf
        import openvino
    except ImportError as exc:
        return f"skipped: {exc} (pip install nncf)"
    model = openvino.Core().read_model(str(source))
    items = [calibration[index : index + 1] for index in range(len(calibration))]
    if not accuracy:
        return nncf.quantize(
            model,
            nncf.Dataset(items),
            preset=nncf.QuantizationPreset.PERFORMANCE,
            subset_size=len(items),
            fast_bias_correction=True,
        )
    half = len(items) // 2
    check = calibration[half:]
    expected = outputs(reference, check).argmax(1)
    pairs = [(check[index : index + 1], int(expected[index])) for index in range(len(check))]

    def agreement(model: Any, data: Any) -> tuple[float, list[float]]:
        """Top-1 agreement with f32, and each image's, as NNCF's validation function."""
        request = model.create_infer_request()
        each = [float(request.infer({0: image})[0].argmax() == label) for image, label in data]
        return float(np.mean(each)), each

    return nncf.quantize_with_accuracy_control(
        model,
        nncf.Dataset(items[:half]),
        nncf.Dataset(pairs, lambda item: item[0]),
        validation_fn=agreement,
        max_drop=0.01,
        drop_type=nncf.DropType.ABSOLUTE,
        subset_size=half,
    )


def main(args: argparse.Namespace) -> int:
    core = cores()[-1]
    os.sched_setaffinity(0, {core})
    print(cpu_line())
    print(f"{machine()}; one thread pinned to core {core}, OpenVINO, batch {BATCH}")
    with tempfile.TemporaryDirectory(prefix="farm-quantizers-") as scratch:
        work = Path(scratch)
        os.environ["FARM_CACHE"] = str(work / "cache")
        spec = load_spec(shared_squeezenet(work / "models", SHARED))
        source = exported_onnx(spec, folded=True)
        calibration, validation = crops(300, 1, (227, 227)), crops(300, 2, (227, 227))
        f32 = compiled(str(source))
        reference = outputs(f32, validation)
        methods: dict[str, Callable[[], object]] = {
            "onnxruntime MinMax (farm's)": lambda: onnxruntime_method(
                source, work, "minmax", calibration
            ),
            "onnxruntime Entropy": lambda: onnxruntime_method(
                source, work, "entropy", calibration, calibrate_method=entropy()
            ),
            "onnxruntime MinMax, conv1 in f32": lambda: onnxruntime_method(
                source, work, "noconv1", calibration, nodes_to_exclude=["conv1"]
            ),
            "NNCF PERFORMANCE": lambda: nncf_method(source, calibration, f32, False),
        }
        if args.accuracy_control:
            methods["NNCF accuracy control, 1%"] = lambda: nncf_method(
                source, calibration, f32, True
            )
        runs: dict[str, Run] = {"f32": f32}
        notes: dict[str, str] = {"f32": "-"}
        for name, make in methods.items():
            started = time.perf_counter()
            made = make()
            if isinstance(made, str):
                print(f"  {name}: {made}")
                continue
            notes[name] = f"{time.perf_counter() - started:.1f} s"
            runs[name] = compiled(str(made) if isinstance(made, Path) else made)
        best = dict.fromkeys(runs, 0.0)
        for _ in range(args.rounds):
            for name, run in runs.items():
                best[name] = max(best[name], rate(run, validation))
        print(f"  {'method':<34} {'vs f32':>7} {'top-1 agrees':>13} {'in top 5':>9} {'made in':>8}")
        for name, run in runs.items():
            found = outputs(run, validation)
            agree = (found.argmax(1) == reference.argmax(1)).mean()
            top5 = np.argsort(found, 1)[:, -5:]
            within = np.mean([reference[i].argmax() in top5[i] for i in range(len(found))])
            print(
                f"  {name:<34} {best[name] / best['f32']:>6.2f}x {agree:>13.1%} "
                f"{within:>9.1%} {notes[name]:>8}"
            )
    return 0


def entropy() -> object:
    from onnxruntime.quantization import CalibrationMethod

    return CalibrationMethod.Entropy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--accuracy-control", action="store_true")
    parser.add_argument("--save", type=Path, default=Path("-"))
    arguments = parser.parse_args()
    if not SHARED.is_dir():
        sys.exit(f"the real SqueezeNet is not at {SHARED}")
    sys.exit(saved(arguments.save, lambda: main(arguments)))
