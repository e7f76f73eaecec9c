"""Inference engines: a loaded model that turns an input array into outputs.

OpenCV's DNN module reads Caffe ``deploy.prototxt`` + ``.caffemodel`` files.
It is imported lazily so that commands which never run a model start fast.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from farm.repository import ModelError, ModelSpec

#: Environment variables that cap the thread pools of OpenMP and the BLAS libraries.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                    "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")

#: Compute batch size used when a chunk is larger (fastest for LeNet on one core here).
DEFAULT_BATCH = 64


def limit_threads(threads: int | None) -> None:
    """Cap compute threads; call before OpenCV is imported. None keeps the library defaults."""
    if threads is None:
        return
    for name in THREAD_VARIABLES:
        os.environ[name] = str(threads)


@dataclass
class OpenCVEngine:
    """One model loaded in OpenCV's DNN module, run in compute batches."""

    spec: ModelSpec
    net: Any
    batch: int
    output_shape: tuple[int, ...]

    backend = "opencv"

    @classmethod
    def load(cls, spec: ModelSpec, batch: int = DEFAULT_BATCH,
             threads: int | None = None) -> OpenCVEngine:
        """Read the Caffe files; probe the output shape with one zero image."""
        import cv2

        if threads is not None:
            cv2.setNumThreads(threads)
        try:
            net = cv2.dnn.readNetFromCaffe(str(spec.prototxt), str(spec.weights))
        except cv2.error as exc:
            raise ModelError(f"OpenCV cannot load model {spec.name!r}: {exc}") from exc
        net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
        net.setPreferableTarget(cv2.dnn.DNN_TARGET_CPU)
        engine = cls(spec, net, max(1, batch), ())
        probe = engine._forward(np.zeros((1, *spec.input_shape), dtype=np.float32))
        engine.output_shape = probe.shape[1:]
        return engine

    def run(self, images: np.ndarray) -> np.ndarray:
        """Outputs for ``images`` (N x input_shape, uint8 or float32), in batches."""
        count = images.shape[0]
        outputs = np.empty((count, *self.output_shape), dtype=np.float32)
        for begin in range(0, count, self.batch):
            end = min(begin + self.batch, count)
            outputs[begin:end] = self._forward(images[begin:end])
        return outputs

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        blob = batch.astype(np.float32, copy=False)
        self.net.setInput(blob, self.spec.input, self.spec.input_scale)
        return self.net.forward(self.spec.output)
