"""The OpenCV backend: ``cv2.dnn`` reads the Caffe files itself; CPU only."""

from __future__ import annotations

import tempfile

import numpy as np

from farm.engines.engine import BackendUnavailable, Engine
from farm.modelrepo.caffe_net import Network
from farm.modelrepo.repository import ModelError


def require() -> None:
    try:
        import cv2  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailable(
            f"the opencv backend needs OpenCV ({exc}); install 'opencv-python-headless>=4.8,<5'"
        ) from exc


def refuse_what_opencv_gets_wrong(network: Network) -> None:
    """What OpenCV's Caffe importer gets wrong: refuse it rather than answer wrongly.

    It drops LRN's ``k`` (computes with k = 1), does not know BVLC's ``round_mode``, and
    ignores InnerProduct's ``transpose`` (it multiplies by the untransposed weights).
    """
    for layer in network.layers:
        if layer.type == "Pooling" and layer.param.pooling_param.round_mode != 0:
            raise ModelError(
                f"{network.source}: layer {layer.name!r} pools with round_mode "
                f"FLOOR, which OpenCV's Caffe importer does not read; run this "
                f"model with another backend"
            )
        if layer.type == "InnerProduct" and layer.param.inner_product_param.transpose:
            raise ModelError(
                f"{network.source}: layer {layer.name!r} is an InnerProduct with "
                f"transpose: true, which OpenCV's Caffe importer ignores; run "
                f"this model with another backend"
            )
        if layer.type == "LRN" and layer.param.lrn_param.k != 1:
            raise ModelError(
                f"{network.source}: layer {layer.name!r} is an LRN with k = "
                f"{layer.param.lrn_param.k:g}, which OpenCV's Caffe importer "
                f"ignores (it uses k = 1); run this model with another backend"
            )


class OpenCVEngine(Engine):
    backend = "opencv"

    def build(self) -> None:
        import cv2

        refuse_what_opencv_gets_wrong(self.network)
        if self.threads is not None:
            cv2.setNumThreads(self.threads)
        try:
            with tempfile.TemporaryDirectory() as folder:  # OpenCV rejects unknown fields
                self.net = cv2.dnn.readNetFromCaffe(
                    self.clean_prototxt(folder), str(self.spec.weights)
                )
        except cv2.error as exc:
            raise ModelError(
                f"OpenCV cannot load model {self.spec.name!r} "
                f"({self.spec.prototxt}, {self.spec.weights}): {exc}"
            ) from exc
        self.net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
        self.net.setPreferableTarget(cv2.dnn.DNN_TARGET_CPU)
        self.output_layer = self.network.last_writer(self.spec.output)  # forward() takes a layer

    def forward(self, batch: np.ndarray) -> np.ndarray:
        self.net.setInput(batch, self.spec.input)
        return self.net.forward(self.output_layer)

    def shrink(self) -> None:
        """OpenCV sizes its buffers at the next forward, so run one at the resting shape."""
        self.forward(np.zeros((self.spec.batch, *self.spec.input_shape), np.float32))
