"""The Caffe backend: real pycaffe, when ``import caffe`` works here."""

from __future__ import annotations

import tempfile

import numpy as np

from farm.engines.engine import BackendUnavailable, Engine
from farm.modelrepo.repository import ModelSpec

INSTALL_HINT = (
    "install Caffe with its Python bindings (Debian/Ubuntu: apt-get install "
    "python3-caffe-cpu, or python3-caffe-cuda; from source: make pycaffe and put "
    "caffe/python on PYTHONPATH); the opencv and torch backends run the same "
    "models without it"
)


def require() -> None:
    try:
        import caffe  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailable(
            f"the caffe backend needs pycaffe, and 'import caffe' failed ({exc}): {INSTALL_HINT}"
        ) from exc


class CaffeEngine(Engine):
    backend = "caffe"

    @classmethod
    def precisions(cls, spec: ModelSpec, device: str) -> tuple[str, ...]:
        return ("f32",)  # pycaffe runs on the CPU or, built with CUDA, on a GPU

    def build(self) -> None:
        import caffe

        if self.device.startswith("cuda"):
            caffe.set_mode_gpu()
            caffe.set_device(int(self.device.partition(":")[2] or 0))
        else:
            caffe.set_mode_cpu()
        with tempfile.TemporaryDirectory() as folder:
            self.net = caffe.Net(self.clean_prototxt(folder), str(self.spec.weights), caffe.TEST)

    def forward(self, batch: np.ndarray) -> np.ndarray:
        blob = self.net.blobs[self.spec.input]
        blob.reshape(*batch.shape)
        blob.data[...] = batch
        self.net.forward()
        return self.net.blobs[self.spec.output].data.copy()

    def shrink(self) -> None:
        self.net.blobs[self.spec.input].reshape(self.spec.batch, *self.spec.input_shape)
        self.net.reshape()
