"""What a user writes instead of farm: one process, one engine on every core, as a whole process.

    python bench/user_script.py ENGINE MODEL.onnx IMAGES OUT.npy MODEL [BATCH [MODELS_DIR]]

ENGINE is ``onnxruntime`` or ``openvino``.  IMAGES is a ``.npy`` array or a folder of
image files.  A folder's files are taken in ``farm run``'s order (``find_image_files``)
and decoded by farm's own ``ImageDecoder`` (resize and crop as the model's
``model.toml`` says) in a pool of one thread per core (``cv2.imdecode`` releases the
GIL), a few batches ahead of the engine: decoding overlaps inference.  The images are
preprocessed by farm's own ``Transformer``, so both sides pay the same (unless the ONNX
graph takes uint8, the preprocessing folded in: then they go in as they are), the ONNX
file from ``farm models export`` runs, and the outputs are written in input order.  The
model is found as farm finds it: MODELS_DIR first (farm's ``--models-dir``), then
``$FARM_MODELS``, the user's and the bundled models.

- ``onnxruntime``: one intra-op thread per core, f32 (its CPU provider computes an f32
  model in f32 on x86);
- ``openvino``: the THROUGHPUT hint, ``INFERENCE_PRECISION_HINT`` f32 (without it a
  CPU with bf16 runs bf16), an ``AsyncInferQueue`` of its optimal number of requests.

It prints on stdout the engine, its precision and its settings (and, for a folder, the
decoding pool).  ``bench/wholeprocess.py`` times it beside ``farm run``.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from farm.modelrepo.repository import ModelSpec

#: Decoded images a folder's pool may hold ahead of the engine, in batches (or in
#: threads, if more).
AHEAD = 4


#: Makes the batches: ``True`` for the images as they are (uint8: a graph with the
#: preprocessing folded in), ``False`` for farm's ``Transformer`` applied on the host.
Batches = Callable[[bool], Iterable[np.ndarray]]


def threads() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0))


def raw_images(images: np.ndarray) -> np.ndarray:
    """Images as they are: for a graph that preprocesses its uint8 input itself."""
    return np.ascontiguousarray(images)


def input_text(raw: bool) -> str:
    """What the engine is fed."""
    return "uint8 input (preprocessing in the graph)" if raw else "f32 input (Transformer)"


def npy_batches(
    path: str, transform: Callable[[np.ndarray], np.ndarray], batch: int
) -> Iterator[np.ndarray]:
    """The array's batches, preprocessed one at a time as the engine asks for them."""
    images = np.load(path, mmap_mode="r")
    for start in range(0, len(images), batch):
        yield transform(images[start : start + batch])


def decoded_in_order(
    files: list[Path], spec: ModelSpec, pool: ThreadPoolExecutor, ahead: int
) -> Iterator[np.ndarray]:
    """Each file's net input (``(crops, *item_shape)`` uint8), in order, decoded by the pool
    at most ``ahead`` files ahead of the reader."""
    from farm.engines.images import ImageDecoder

    decoder = ImageDecoder(spec)
    pending: deque[Future[np.ndarray]] = deque()
    for path in files:
        pending.append(pool.submit(lambda p: decoder.decode_one(p.read_bytes()), path))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def folder_batches(
    folder: str, spec: ModelSpec, transform: Callable[[np.ndarray], np.ndarray], batch: int
) -> Iterator[np.ndarray]:
    """A folder's image files in ``farm run``'s order, decoded in a thread pool ahead of the
    engine, preprocessed, in batches."""
    import cv2

    from farm.client.imagefiles import find_image_files

    cv2.setNumThreads(1)  # the pool is the parallelism: no thread pool per resize
    files = find_image_files([folder])
    with ThreadPoolExecutor(threads()) as pool:
        images: list[np.ndarray] = []
        for image in decoded_in_order(files, spec, pool, AHEAD * max(batch, threads())):
            images.append(image)
            if len(images) == batch:
                yield transform(np.concatenate(images))
                images = []
        if images:
            yield transform(np.concatenate(images))


def run_onnxruntime(path: str, batches: Batches, batch: int) -> list[np.ndarray]:
    """ONNX Runtime, one intra-op thread per core, each batch in turn."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads()
    session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    print(
        f"onnxruntime {onnxruntime.__version__}: precision f32 (CPU provider, f32 model), "
        f"{options.intra_op_num_threads} intra-op threads, batch {batch}, "
        + input_text(raw := session.get_inputs()[0].type == "tensor(uint8)"),
        flush=True,
    )
    name = session.get_inputs()[0].name
    return [session.run(None, {name: item})[0] for item in batches(raw)]


def run_openvino(path: str, batches: Batches, batch: int) -> list[np.ndarray]:
    """OpenVINO, THROUGHPUT hint, f32 stated, batches fed to an ``AsyncInferQueue`` of its
    optimal number of requests; each output kept at its index as its request completes."""
    import openvino

    core = openvino.Core()
    compiled = core.compile_model(
        core.read_model(path),
        "CPU",
        {"PERFORMANCE_HINT": "THROUGHPUT", "INFERENCE_PRECISION_HINT": "f32"},
    )
    queue = openvino.AsyncInferQueue(compiled)  # jobs=0: OPTIMAL_NUMBER_OF_INFER_REQUESTS
    print(
        f"openvino {openvino.get_version().split('-')[0]}: precision "
        f"{compiled.get_property('INFERENCE_PRECISION_HINT').get_type_name()} "
        "(INFERENCE_PRECISION_HINT), "
        f"THROUGHPUT hint, {compiled.get_property('NUM_STREAMS')} streams, "
        f"{len(queue)} infer requests, batch {batch}, "
        + input_text(raw := compiled.input(0).get_element_type() == openvino.Type.u8),
        flush=True,
    )
    outputs: dict[int, np.ndarray] = {}

    def done(request: openvino.InferRequest, index: int) -> None:
        outputs[index] = request.get_output_tensor(0).data.copy()

    queue.set_callback(done)
    count = 0
    for count, item in enumerate(batches(raw), 1):
        queue.start_async({0: item}, userdata=count - 1)
    queue.wait_all()
    return [outputs[index] for index in range(count)]


RUNNERS = {"onnxruntime": run_onnxruntime, "openvino": run_openvino}


def main() -> None:
    engine, onnx_path, images_path, out_path, model = sys.argv[1:6]
    batch = int(sys.argv[6]) if len(sys.argv) > 6 else 64
    models_dirs = sys.argv[7:8]
    from farm.engines.preprocess import Transformer
    from farm.modelrepo.repository import find

    spec = find(model, models_dirs)
    transform = Transformer.for_model(spec)
    folder = Path(images_path).is_dir()
    if folder:
        print(f"decoding: a pool of {threads()} threads, farm's ImageDecoder", flush=True)

    def batches(raw: bool) -> Iterator[np.ndarray]:
        preprocess = raw_images if raw else transform
        if folder:
            return folder_batches(images_path, spec, preprocess, batch)
        return npy_batches(images_path, preprocess, batch)

    np.save(out_path, np.concatenate(RUNNERS[engine](onnx_path, batches, batch)))


if __name__ == "__main__":
    main()
