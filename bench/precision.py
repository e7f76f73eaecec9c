"""What OpenVINO's default precision does to the bundled models on this CPU.

For each bundled model with a sample: its ONNX export compiled by OpenVINO with the
precision left at OpenVINO's default (bf16 on a CPU with AVX512_BF16 or AMX) and with f32
stated, and run by ONNX Runtime; the relative difference of the largest output and the
top-1 agreement between them (docs/precision.md).

    python bench/precision.py [--images 64]
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import numpy as np


def main() -> None:
    import onnxruntime
    import openvino

    from farm.engines.engine import exported_onnx
    from farm.engines.preprocess import Transformer
    from farm.engines.tolerances import relative_difference
    from farm.modelrepo.repository import available, load_spec

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=64)
    args = parser.parse_args()
    core = openvino.Core()
    default = core.get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()
    print(
        f"CPU: {cpu_name()}; OpenVINO {openvino.__version__} "
        f"offers {core.get_property('CPU', 'OPTIMIZATION_CAPABILITIES')}, default "
        f"precision {default}"
    )
    print(f"{'model':<16} {'default vs f32':>15} {'top-1 agrees':>13} {'ORT vs OV f32':>14}")
    for name, folder in sorted(available().items()):
        spec = load_spec(folder)
        if spec.sample is None:
            continue
        images = np.load(spec.sample)[: args.images]
        batch = Transformer.for_model(spec)(images if images.ndim == 4 else images[:, None])
        batch = np.ascontiguousarray(batch, dtype=np.float32)
        path = str(exported_onnx(spec))
        model = core.read_model(path)
        stated = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(batch)[0]
        # left to OpenVINO's default on purpose: what a script that states nothing gets
        left = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": default})(batch)[0]
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        by_ort = session.run(None, {session.get_inputs()[0].name: batch})[0]
        agree = float((left.argmax(1) == stated.argmax(1)).mean())
        print(
            f"{name:<16} {relative_difference(left, stated):>15.1e} {agree:>13.1%} "
            f"{relative_difference(by_ort, stated):>14.1e}"
        )


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the machine's architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


if __name__ == "__main__":
    main()
