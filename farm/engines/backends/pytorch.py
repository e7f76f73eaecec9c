"""The PyTorch backend: the net built from the parsed prototxt and the caffemodel's blobs.

Runs on the CPU or on CUDA (``farm worker --device gpu:0``).  ``CaffeModule`` is
also what ``scripts/train_lenet.py`` trains, so the bundled LeNet's weights go
straight from a torch training loop into a ``.caffemodel``.  torch fixes its
thread pool when it is imported: a pinned worker caps the thread variables
before the import (``prepare_process``) and calls ``torch.set_num_threads``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from farm.engines.backends.torchfeed import DeviceTransform, Feeder
from farm.engines.engine import BackendUnavailable, Engine
from farm.modelrepo.caffe_net import Layer, Network, conv_geometry, pool_geometry, pools_with_ceil
from farm.modelrepo.repository import ModelError, ModelSpec

INSTALL_HINT = "pip install 'farm[torch]' (CPU build: pip install torch==2.13.0)"


def require() -> None:
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailable(
            f"the torch backend needs PyTorch ({exc}): {INSTALL_HINT}"
        ) from exc


Op = Callable[[list[Any], list[Any]], Any]  # (bottom tensors, weight tensors) -> top tensor


def _axis_view(tensor: Any, axis: int, ndim: int) -> Any:
    """A per-axis parameter shaped to broadcast against an ``ndim`` tensor from ``axis`` on."""
    shape = [1] * axis + list(tensor.shape) + [1] * (ndim - axis - tensor.dim())
    return tensor.reshape(shape)


def make_op(layer: Layer, shapes: dict[str, tuple[int, ...]]) -> Op:
    """The function that computes one layer (its parameters read once, here)."""
    import torch
    import torch.nn.functional as F

    p = layer.param
    kind = layer.type
    in_shape = shapes[layer.bottoms[0]]
    if kind == "Convolution":
        g = conv_geometry(p.convolution_param)
        group = p.convolution_param.group
        return lambda x, w: F.conv2d(
            x[0], w[0], w[1] if len(w) > 1 else None, g.stride, g.pad, g.dilation, group
        )
    if kind == "Pooling":
        g = pool_geometry(p.pooling_param, *in_shape[2:])
        ceil = pools_with_ceil(p.pooling_param)
        if p.pooling_param.pool == 0:
            return lambda x, w: F.max_pool2d(x[0], g.kernel, g.stride, g.pad, ceil_mode=ceil)
        return lambda x, w: F.avg_pool2d(
            x[0], g.kernel, g.stride, g.pad, ceil_mode=ceil, count_include_pad=True
        )
    if kind == "InnerProduct":
        q = p.inner_product_param
        axis = q.axis % len(in_shape)
        if q.transpose:
            return lambda x, w: x[0].flatten(axis) @ w[0] + (w[1] if len(w) > 1 else 0)
        return lambda x, w: F.linear(x[0].flatten(axis), w[0], w[1] if len(w) > 1 else None)
    if kind == "ReLU":
        slope = p.relu_param.negative_slope
        return (lambda x, w: F.leaky_relu(x[0], slope)) if slope else (lambda x, w: F.relu(x[0]))
    if kind == "Sigmoid":
        return lambda x, w: torch.sigmoid(x[0])
    if kind == "TanH":
        return lambda x, w: torch.tanh(x[0])
    if kind == "Softmax":
        axis = p.softmax_param.axis % len(in_shape)
        return lambda x, w: F.softmax(x[0], dim=axis)
    if kind == "Dropout":
        return lambda x, w: x[0]
    if kind == "LRN":
        return _lrn(p.lrn_param)
    if kind == "BatchNorm":
        eps = p.batch_norm_param.eps
        return lambda x, w: _batch_norm(x[0], w, eps)
    if kind == "Scale":
        return _scale(p.scale_param, len(in_shape))
    if kind == "Concat":
        q = p.concat_param
        axis = q.axis if q.HasField("axis") or not q.HasField("concat_dim") else q.concat_dim
        return lambda x, w: torch.cat(x, dim=axis % len(in_shape))
    if kind == "Eltwise":
        return _eltwise(p.eltwise_param)
    if kind == "Flatten":
        q = p.flatten_param
        start, end = q.axis % len(in_shape), q.end_axis % len(in_shape)
        return lambda x, w: x[0].flatten(start, end)
    raise ModelError(f"layer {layer.name!r}: type {kind!r} has no torch implementation")


def _lrn(q: Any) -> Op:
    import torch.nn.functional as F

    size, alpha, beta, k = q.local_size, q.alpha, q.beta, q.k
    # computed in f32 whatever the net's precision: squares of activations above 256
    # overflow f16
    if q.norm_region == 0:  # ACROSS_CHANNELS: Caffe and torch share the formula
        return lambda x, w: F.local_response_norm(x[0].float(), size, alpha, beta, k).to(x[0].dtype)
    pad = (size - 1) // 2  # WITHIN_CHANNEL: Caffe's average of squares over a size x size window

    def within(x: list[Any], w: list[Any]) -> Any:
        wide = x[0].float()
        square_mean = F.avg_pool2d(wide * wide, size, 1, pad, count_include_pad=True)
        return (wide * (1 + alpha * square_mean).pow(-beta)).to(x[0].dtype)

    return within


def fold_batch_norm(blobs: list[np.ndarray]) -> list[np.ndarray]:
    """Caffe's BatchNorm blobs (mean and variance sums, and the scale factor they are divided
    by; 0 means no statistics) as the mean and variance themselves, with a factor of 1.
    Folded once, in f32: the sums overflow f16, and the forward pass does not repeat it."""
    mean, var, scale = (np.asarray(blob, np.float32) for blob in blobs[:3])
    factor = np.float32(0.0 if scale.reshape(-1)[0] == 0 else 1.0 / scale.reshape(-1)[0])
    return [mean * factor, var * factor, np.ones_like(scale)]


def _batch_norm(x: Any, w: list[Any], eps: float) -> Any:
    """Caffe's BatchNorm at test time, on blobs folded by ``fold_batch_norm``."""
    mean = _axis_view(w[0], 1, x.dim())
    var = _axis_view(w[1], 1, x.dim())
    return (x - mean) / (var + eps).sqrt()


def _scale(q: Any, ndim: int) -> Op:
    axis = q.axis % ndim

    def scale(x: list[Any], w: list[Any]) -> Any:
        if len(x) > 1:  # the scale is the second input; a bias, if any, is the one blob
            factor, bias = x[1], (w[0] if w else None)
        else:
            factor, bias = w[0], (w[1] if len(w) > 1 else None)
        out = x[0] * _axis_view(factor, axis, ndim)
        return out if bias is None else out + _axis_view(bias, axis, ndim)

    return scale


def _eltwise(q: Any) -> Op:
    import torch

    operation, coeffs = q.operation, list(q.coeff)

    def eltwise(x: list[Any], w: list[Any]) -> Any:
        if operation == 0:
            out = x[0]
            for other in x[1:]:
                out = out * other
            return out
        if operation == 2:
            return torch.stack(x).amax(dim=0)
        factors = coeffs or [1.0] * len(x)
        out = x[0] * factors[0]
        for factor, other in zip(factors[1:], x[1:]):
            out = out + factor * other
        return out

    return eltwise


def build_module(network: Network, trainable: bool = False) -> Any:
    """A ``torch.nn.Module`` computing the net; weights from the network's blobs (zeros if none)."""
    import torch

    class CaffeModule(torch.nn.Module):
        """The Caffe net as a torch module; ``forward(x, until=blob)`` stops at a blob."""

        def __init__(self) -> None:
            super().__init__()
            self.network = network
            self.weights = torch.nn.ParameterList()
            self.steps: list[tuple[Layer, Op, list[int]]] = []
            for layer in network.layers:
                blobs = layer.blobs or [np.zeros(s, np.float32) for s in layer.blob_shapes]
                if layer.type == "BatchNorm":
                    blobs = fold_batch_norm(blobs)
                indices = []
                for blob in blobs:
                    indices.append(len(self.weights))
                    self.weights.append(
                        torch.nn.Parameter(torch.from_numpy(blob.copy()), requires_grad=trainable)
                    )
                self.steps.append((layer, make_op(layer, network.shapes), indices))
            # the last step that reads each blob: after it, the blob is dropped, so a batch
            # holds a few blobs at a time, not the whole net's (GoogLeNet's: 27 MB an image)
            self.last_read = {
                name: i for i, (layer, _, _) in enumerate(self.steps) for name in layer.bottoms
            }

        def forward(self, x: Any, until: str | None = None) -> Any:
            """The blob ``until`` (default: the net's output) after its last writer has run."""
            target = until or network.output
            last = max(i for i, (layer, _, _) in enumerate(self.steps) if target in layer.tops)
            blobs = {network.input: x}
            for i, (layer, op, indices) in enumerate(self.steps[: last + 1]):
                blobs[layer.tops[0]] = op(
                    [blobs[name] for name in layer.bottoms], [self.weights[i] for i in indices]
                )
                for name in layer.bottoms:
                    if self.last_read[name] == i and name not in layer.tops and name != target:
                        blobs.pop(name, None)
            return blobs[target]

        def caffe_blobs(self) -> list[tuple[str, str, list[np.ndarray]]]:
            """(layer, type, blobs) for ``write_caffemodel``."""
            return [
                (layer.name, layer.type, [self.weights[i].detach().cpu().numpy() for i in indices])
                for layer, _, indices in self.steps
                if indices
            ]

    return CaffeModule()


class TorchEngine(Engine):
    """The net as a torch module; ``run`` feeds it through ``farm.engines.backends.torchfeed``
    (pinned memory, a copy stream and preprocessing on the GPU when on CUDA), ``forward``
    takes batches already preprocessed on the host (``autoselect`` times it so)."""

    backend = "torch"

    @classmethod
    def precisions(cls, spec: ModelSpec, device: str) -> tuple[str, ...]:
        if not device.startswith("cuda"):
            return ("f32",)
        import torch

        if not torch.cuda.is_available():
            return ()
        return ("f32", "f16", "bf16") if torch.cuda.is_bf16_supported() else ("f32", "f16")

    @classmethod
    def precision_note(cls, spec: ModelSpec, device: str) -> str:
        if not device.startswith("cuda"):
            return " (farm's torch backend computes in f32 on the CPU)"
        import torch

        if not torch.cuda.is_available():
            return f" (this torch, {torch.__version__}, sees no CUDA device)"
        return ""

    def build(self) -> None:
        import torch

        if self.threads is not None:
            torch.set_num_threads(self.threads)
        on_gpu = self.device.startswith("cuda")  # refused before here where CUDA is missing
        if on_gpu:
            torch.cuda.set_device(self.device)  # gpu:N's context, not GPU 0's
        if on_gpu and self.precision == "f32":
            exact_f32(torch)
        self.torch = torch
        self.dtype = DTYPES[self.precision](torch)
        module = build_module(self.network).to(self.device, self.dtype).eval()
        if on_gpu:
            module = module.to(memory_format=torch.channels_last)
        self.module = module
        # the feeder gets the module, not a bound method: a bound method would tie it back to
        # this engine, and a dropped engine's GPU weights would then wait for the collector
        self.feeder = Feeder(
            partial(module, until=self.spec.output),
            DeviceTransform.on(self.transform, self.device),
            self.device,
            self.dtype,
        )

    def call(self, batch: Any) -> Any:
        """The module on one preprocessed batch already on the device."""
        return self.module(batch, until=self.spec.output)

    def forward(self, batch: np.ndarray) -> np.ndarray:
        with self.torch.inference_mode():
            tensor = self.torch.from_numpy(batch).to(self.device, self.dtype, non_blocking=True)
            return self.call(tensor).float().cpu().numpy()

    def run(
        self,
        images: np.ndarray,
        stop: Callable[[], bool] | None = None,
        tally: Callable[[int, float], None] | None = None,
        then: Callable[[], None] | None = None,
    ) -> np.ndarray:
        """Outputs for ``images`` as clients send them; preprocessing runs on the device,
        and ``then`` may launch the next chunk before this one's last batches are in."""
        done = self.feeder.run(images, self.batch, self.output_shape, stop, tally, then)
        self.last_run = done.stats
        self.allocated = max(self.allocated, min(self.batch, images.shape[0]))
        return done.outputs

    @property
    def feeds_ahead(self) -> bool:
        return self.feeder.overlap

    def start_ahead(self, images: np.ndarray, stop: Callable[[], bool] | None = None) -> None:
        self.feeder.start_ahead(images, self.batch, self.output_shape, stop)

    def shrink(self) -> None:
        """On the CPU, free what the feeder holds; a GPU worker keeps its pinned buffers and
        the GPU's memory cache (the GPU is its own, and reallocating them would make the
        next job's first batches wait)."""
        if not self.device.startswith("cuda"):
            self.feeder.release()


def exact_f32(torch: Any) -> None:
    """f32 means f32 on a GPU: no TensorFloat-32 (a 10-bit mantissa) in convolutions and
    matrix products (f16 and bf16 are there for speed).  torch 2.9 and later name it
    ``fp32_precision``; earlier ones ``allow_tf32``."""
    if hasattr(torch.backends.cudnn, "conv") and hasattr(
        torch.backends.cudnn.conv, "fp32_precision"
    ):
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    else:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False


#: Compute precision -> the torch dtype (read from torch once it is imported).
DTYPES: dict[str, Callable[[Any], Any]] = {
    "f32": lambda torch: torch.float32,
    "f16": lambda torch: torch.float16,
    "bf16": lambda torch: torch.bfloat16,
}
