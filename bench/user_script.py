"""What a user writes instead of farm: one process, one engine on every core, as a whole process.

    python bench/user_script.py onnxruntime|openvino MODEL.onnx IMAGES.npy OUT.npy MODEL [BATCH]

Reads the images, preprocesses them as the model's ``model.toml`` says (farm's own
``Transformer``, so both sides pay the same), runs the ONNX file from
``farm models export`` and writes the outputs.  ONNX Runtime runs with one
intra-op thread per core; OpenVINO with its THROUGHPUT hint and an
``AsyncInferQueue`` of its optimal number of requests.  ``bench/wholeprocess.py``
times it beside ``farm run``.
"""

from __future__ import annotations

import os
import sys

import numpy as np


def run_onnxruntime(path: str, batches: list[np.ndarray]) -> list[np.ndarray]:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = len(os.sched_getaffinity(0))
    session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return [session.run(None, {name: batch})[0] for batch in batches]


def run_openvino(path: str, batches: list[np.ndarray]) -> list[np.ndarray]:
    import openvino

    core = openvino.Core()
    compiled = core.compile_model(
        core.read_model(path),
        "CPU",
        {
            "PERFORMANCE_HINT": "THROUGHPUT",
            # f32, stated: on a CPU with bf16 OpenVINO's default is bf16
            "INFERENCE_PRECISION_HINT": "f32",
        },
    )
    outputs: list[np.ndarray | None] = [None] * len(batches)

    def done(request: openvino.InferRequest, index: int) -> None:
        outputs[index] = request.get_output_tensor(0).data.copy()

    queue = openvino.AsyncInferQueue(compiled)
    queue.set_callback(done)
    for index, batch in enumerate(batches):
        queue.start_async({0: batch}, userdata=index)
    queue.wait_all()
    return outputs


def main() -> None:
    engine, onnx_path, images_path, out_path, model = sys.argv[1:6]
    batch = int(sys.argv[6]) if len(sys.argv) > 6 else 64
    from farm.engines.preprocess import Transformer
    from farm.modelrepo.repository import find

    transform = Transformer.for_model(find(model))
    images = np.load(images_path, mmap_mode="r")
    batches = [transform(images[start : start + batch]) for start in range(0, len(images), batch)]
    runner = run_onnxruntime if engine == "onnxruntime" else run_openvino
    np.save(out_path, np.concatenate(runner(onnx_path, batches)))


if __name__ == "__main__":
    main()
