"""A Caffe net as farm sees it: its layers in order, every blob's shape, its weights checked.

``Network.load`` parses ``deploy.prototxt`` (and the weights, when given),
keeps the layers of the TEST phase, infers each blob's shape with Caffe's
formulas, and checks that every weight blob has the shape the prototxt asks
for.  Every backend builds from this one description, so an unsupported layer
or a weights file that does not fit is found once, at load time, with a
message that names the file and the layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import text_format

from farm.modelrepo import caffe_proto
from farm.modelrepo.caffe_proto import CaffeFormatError

Shape = tuple[int, ...]


class NetworkError(ValueError):
    """A prototxt or weights file that farm cannot run, with the reason."""


class InputShapeError(NetworkError):
    """The net's one input has no shape, or an invalid one: a declared shape would fix it."""


@dataclass
class Layer:
    """One layer: its type, the blobs it reads and writes, its parameters and weights."""

    name: str
    type: str
    bottoms: tuple[str, ...]
    tops: tuple[str, ...]
    param: Any  # the LayerParameter message
    blobs: list[np.ndarray] = field(default_factory=list)
    blob_shapes: list[Shape] = field(default_factory=list)  # what the prototxt asks for


@dataclass
class Geometry:
    """Kernel, stride, pad and dilation of a 2-D convolution or pooling, as (h, w) pairs."""

    kernel: tuple[int, int]
    stride: tuple[int, int]
    pad: tuple[int, int]
    dilation: tuple[int, int] = (1, 1)


def _pair(repeated: Any, h: int, w: int, has_hw: bool, default: int) -> tuple[int, int]:
    if has_hw:
        return h, w
    values = list(repeated) if not isinstance(repeated, int) else [repeated]
    if not values:
        return default, default
    return (values[0], values[0]) if len(values) == 1 else (values[0], values[1])


def conv_geometry(p: Any) -> Geometry:
    if not (p.kernel_size or p.HasField("kernel_h")):
        raise NetworkError("convolution_param needs kernel_size or kernel_h/kernel_w")
    return Geometry(
        _pair(p.kernel_size, p.kernel_h, p.kernel_w, p.HasField("kernel_h"), 0),
        _pair(p.stride, p.stride_h, p.stride_w, p.HasField("stride_h"), 1),
        _pair(p.pad, p.pad_h, p.pad_w, p.HasField("pad_h"), 0),
        _pair(p.dilation, 0, 0, False, 1),
    )


def pool_geometry(p: Any, height: int, width: int) -> Geometry:
    if p.global_pooling:
        return Geometry((height, width), (1, 1), (0, 0))
    if not (p.HasField("kernel_size") or p.HasField("kernel_h")):
        raise NetworkError("pooling_param needs kernel_size, kernel_h/kernel_w or global_pooling")
    return Geometry(
        _pair(p.kernel_size, p.kernel_h, p.kernel_w, p.HasField("kernel_h"), 0),
        _pair(p.stride, p.stride_h, p.stride_w, p.HasField("stride_h"), 1),
        _pair(p.pad, p.pad_h, p.pad_w, p.HasField("pad_h"), 0),
    )


def pools_with_ceil(p: Any) -> bool:
    """Whether a pooling layer rounds its output size up: Caffe's default, unless BVLC's
    ``round_mode: FLOOR`` or the forks' ``ceil_mode: false`` says otherwise."""
    return p.round_mode == 0 and p.ceil_mode


def pooled_size(
    size: int, kernel: int, stride: int, pad: int, ceil: bool = True, padded: bool = False
) -> int:
    """Caffe's pooling output size: rounded up unless ``ceil`` is False; when the layer has any
    padding (``padded``), a last window starting past the input and its padding is cut."""
    steps = (size + 2 * pad - kernel) / stride
    out = (math.ceil(steps) if ceil else math.floor(steps)) + 1
    if (out - 1) * stride >= size + pad:
        if not padded:  # Caffe keeps an empty window here; no backend can reproduce it
            raise NetworkError(
                f"the last pooling window (kernel {kernel}, stride {stride}) "
                f"would start past the input of size {size}"
            )
        out -= 1
    return out


def _axis(axis: int, ndim: int) -> int:
    return axis + ndim if axis < 0 else axis


# Shape rules: (layer, bottom shapes) -> (top shapes, weight blob shapes).
ShapeRule = Callable[[Layer, list[Shape]], tuple[list[Shape], list[Shape]]]


def _convolution(layer: Layer, bottoms: list[Shape]) -> tuple[list[Shape], list[Shape]]:
    p = layer.param.convolution_param
    n, c, h, w = _four_d(layer, bottoms[0])
    g = conv_geometry(p)
    if min(g.stride) <= 0 or min(g.kernel) <= 0 or min(g.dilation) <= 0:
        raise NetworkError(
            f"kernel {g.kernel}, stride {g.stride} and dilation {g.dilation} must be positive"
        )
    if p.num_output <= 0 or p.group <= 0 or c % p.group or p.num_output % p.group:
        raise NetworkError(
            f"num_output {p.num_output} and {c} input channels must both divide by group {p.group}"
        )
    out = [
        (size + 2 * pad - (dil * (k - 1) + 1)) // s + 1
        for size, k, s, pad, dil in zip((h, w), g.kernel, g.stride, g.pad, g.dilation)
    ]
    if min(out) <= 0:
        raise NetworkError(f"kernel {g.kernel} does not fit input {h}x{w}")
    blobs: list[Shape] = [(p.num_output, c // p.group, *g.kernel)]
    blobs += [(p.num_output,)] if p.bias_term else []
    return [(n, p.num_output, *out)], blobs


def _pooling(layer: Layer, bottoms: list[Shape]) -> tuple[list[Shape], list[Shape]]:
    p = layer.param.pooling_param
    if p.pool == 2:
        raise NetworkError(
            "STOCHASTIC pooling is not supported (it is random at test time "
            "only in Caffe's GPU code)"
        )
    n, c, h, w = _four_d(layer, bottoms[0])
    g = pool_geometry(p, h, w)
    if min(g.stride) <= 0 or any(
        k > size + 2 * pad for k, size, pad in zip(g.kernel, (h, w), g.pad)
    ):
        raise NetworkError(f"pooling window {g.kernel} does not fit input {h}x{w}")
    ceil, padded = pools_with_ceil(p), any(g.pad)
    out = [
        pooled_size(size, k, s, pad, ceil, padded)
        for size, k, s, pad in zip((h, w), g.kernel, g.stride, g.pad)
    ]
    return [(n, c, *out)], []


def _inner_product(layer: Layer, bottoms: list[Shape]) -> tuple[list[Shape], list[Shape]]:
    p = layer.param.inner_product_param
    shape = bottoms[0]
    axis = _axis(p.axis, len(shape))
    inputs = math.prod(shape[axis:])
    weight = (inputs, p.num_output) if p.transpose else (p.num_output, inputs)
    blobs: list[Shape] = [weight, *([(p.num_output,)] if p.bias_term else [])]
    return [(*shape[:axis], p.num_output)], blobs


def _same(layer: Layer, bottoms: list[Shape]) -> tuple[list[Shape], list[Shape]]:
    return [bottoms[0]], []


def _batch_norm(layer: Layer, bottoms: list[Shape]) -> tuple[list[Shape], list[Shape]]:
    channels = bottoms[0][1]
    return [bottoms[0]], [(channels,), (channels,), (1,)]


def _scale(layer: Layer, bottoms: list[Shape]) -> tuple[list[Shape], list[Shape]]:
    p = layer.param.scale_param
    shape = bottoms[0]
    if len(bottoms) == 2:  # the scale is the second input; a bias, if any, is a blob of its shape
        return [shape], [bottoms[1]] if p.bias_term else []
    axis = _axis(p.axis, len(shape))
    end = len(shape) if p.num_axes == -1 else axis + p.num_axes
    param_shape = tuple(shape[axis:end])
    return [shape], [param_shape] + ([param_shape] if p.bias_term else [])


def _concat(layer: Layer, bottoms: list[Shape]) -> tuple[list[Shape], list[Shape]]:
    p = layer.param.concat_param
    axis = _axis(
        p.axis if p.HasField("axis") or not p.HasField("concat_dim") else p.concat_dim,
        len(bottoms[0]),
    )
    rest = {shape[:axis] + shape[axis + 1 :] for shape in bottoms}
    if len(rest) != 1:
        raise NetworkError(f"inputs {bottoms} differ outside the concat axis {axis}")
    total = sum(shape[axis] for shape in bottoms)
    return [bottoms[0][:axis] + (total,) + bottoms[0][axis + 1 :]], []


def _eltwise(layer: Layer, bottoms: list[Shape]) -> tuple[list[Shape], list[Shape]]:
    p = layer.param.eltwise_param
    if len(set(bottoms)) != 1:
        raise NetworkError(f"inputs must have one shape, got {bottoms}")
    if p.coeff and (len(p.coeff) != len(bottoms) or p.operation != 1):
        raise NetworkError("coeff needs the SUM operation and one value per input")
    return [bottoms[0]], []


def _flatten(layer: Layer, bottoms: list[Shape]) -> tuple[list[Shape], list[Shape]]:
    p = layer.param.flatten_param
    shape = bottoms[0]
    start, end = _axis(p.axis, len(shape)), _axis(p.end_axis, len(shape))
    return [shape[:start] + (math.prod(shape[start : end + 1]),) + shape[end + 1 :]], []


def _four_d(layer: Layer, shape: Shape) -> Shape:
    if len(shape) != 4:
        raise NetworkError(f"needs a 4-D input (N x C x H x W), got {shape}")
    return shape


#: Layer type -> (shape rule, number of bottoms: exact, or None for one or more).
LAYERS: dict[str, tuple[ShapeRule, int | None]] = {
    "Convolution": (_convolution, 1),
    "Pooling": (_pooling, 1),
    "InnerProduct": (_inner_product, 1),
    "ReLU": (_same, 1),
    "Sigmoid": (_same, 1),
    "TanH": (_same, 1),
    "Softmax": (_same, 1),
    "LRN": (_same, 1),
    "Dropout": (_same, 1),
    "BatchNorm": (_batch_norm, 1),
    "Scale": (_scale, None),
    "Concat": (_concat, None),
    "Eltwise": (_eltwise, None),
    "Flatten": (_flatten, 1),
}

#: Every type a prototxt may use (Input is the data entry point, not a computing layer).
SUPPORTED = ("Input", *LAYERS)

#: Types that only matter for training; a deploy net may carry them and they are skipped.
TRAINING_ONLY = frozenset(
    {
        "Data",
        "ImageData",
        "HDF5Data",
        "MemoryData",
        "Accuracy",
        "SoftmaxWithLoss",
        "EuclideanLoss",
        "Silence",
    }
)


@dataclass
class Network:
    """A parsed deploy net: one input, layers in order, blob shapes at the prototxt's batch."""

    name: str
    source: Path
    input: str
    input_shape: Shape  # with the batch dimension, as the prototxt declares it
    layers: list[Layer]
    shapes: dict[str, Shape]

    @classmethod
    def load(
        cls,
        prototxt: str | Path,
        weights: str | Path | None = None,
        input_shape: Sequence[int] | None = None,
    ) -> Network:
        """Parse and check a net; NetworkError names the file and what is wrong.

        ``input_shape`` (C x H x W) declares the input's shape where the prototxt does not.
        """
        prototxt = Path(prototxt)
        try:
            message = caffe_proto.parse_prototxt(prototxt)
        except CaffeFormatError as exc:
            raise NetworkError(str(exc)) from None
        net = cls._from_message(message, prototxt, input_shape)
        if weights is not None:
            net.attach_weights(Path(weights))
        return net

    @classmethod
    def _from_message(
        cls, message: Any, source: Path, declared: Sequence[int] | None = None
    ) -> Network:
        layers = [layer for layer in message.layer if _in_test_phase(layer)]
        input_name, input_shape = _find_input(message, layers, source, declared)
        net = cls(message.name or source.stem, source, input_name, input_shape, [], {})
        for param in layers:
            if param.type == "Input" or param.type in TRAINING_ONLY:
                continue
            if param.type not in LAYERS:
                raise NetworkError(
                    f"{source}: layer {param.name!r} has type {param.type!r}, which farm does "
                    f"not support; supported types: {', '.join(SUPPORTED)}"
                )
            net.layers.append(
                Layer(param.name, param.type, tuple(param.bottom), tuple(param.top), param)
            )
        if not net.layers:
            raise NetworkError(f"{source}: the net has no layers")
        net.shapes = net.infer_shapes(input_shape[0])
        return net

    @property
    def output(self) -> str:
        """The net's output blob: the top of its last layer."""
        return self.layers[-1].tops[0]

    @property
    def batch(self) -> int:
        return self.input_shape[0]

    def infer_shapes(self, batch: int) -> dict[str, Shape]:
        """Every blob's shape for an input batch of ``batch``; records each layer's weight
        shapes."""
        shapes = {self.input: (batch, *self.input_shape[1:])}
        for layer in self.layers:
            rule, bottom_count = LAYERS[layer.type]
            missing = [name for name in layer.bottoms if name not in shapes]
            if missing or not layer.bottoms or not layer.tops:
                raise NetworkError(
                    f"{self.source}: layer {layer.name!r} reads "
                    f"{missing or 'no'} blob(s) that no earlier layer makes"
                )
            if bottom_count is not None and len(layer.bottoms) != bottom_count:
                raise NetworkError(
                    f"{self.source}: layer {layer.name!r} ({layer.type}) takes "
                    f"{bottom_count} input(s), got {len(layer.bottoms)}"
                )
            try:
                tops, layer.blob_shapes = rule(layer, [shapes[b] for b in layer.bottoms])
            except NetworkError as exc:
                raise NetworkError(
                    f"{self.source}: layer {layer.name!r} ({layer.type}): {exc}"
                ) from None
            shapes.update(zip(layer.tops, tops))
        return shapes

    def attach_weights(self, path: Path) -> None:
        """Read a caffemodel and give each layer its blobs, checked against the prototxt."""
        try:
            weights = caffe_proto.read_caffemodel(path)
        except CaffeFormatError as exc:
            raise NetworkError(str(exc)) from None
        for layer in self.layers:
            found = weights.get(layer.name, [])
            if len(found) != len(layer.blob_shapes):
                raise NetworkError(
                    f"weights file {path} does not match {self.source}: layer {layer.name!r} "
                    f"needs {len(layer.blob_shapes)} blob(s), the file has {len(found)}"
                )
            layer.blobs = [
                _fit(array, expected, path, layer, index)
                for index, (array, expected) in enumerate(zip(found, layer.blob_shapes))
            ]

    def deploy_text(self) -> str:
        """The net as a clean deploy prototxt: an Input layer, then the layers farm runs.

        Fields outside farm's schema, training-only layers and the V1 form are gone,
        so backends that parse prototxts themselves (OpenCV, pycaffe) see exactly the
        net the shape checks and the torch backend see.
        """
        net = caffe_proto.NetParameter(name=self.name)
        data = net.layer.add(name=self.input, type="Input", top=[self.input])
        data.input_param.shape.add().dim.extend(self.input_shape)
        for layer in self.layers:
            copy = net.layer.add()
            copy.CopyFrom(layer.param)
            copy.ClearField("blobs")
            copy.ClearField("include")
            copy.ClearField("exclude")
        return text_format.MessageToString(net)

    def drop_weights(self) -> None:
        """Forget the blobs (shapes stay): once a backend has built its net they are a copy."""
        for layer in self.layers:
            layer.blobs = []

    def last_writer(self, blob: str) -> str:
        """The name of the last layer that writes ``blob`` (in-place layers write their input)."""
        return [layer.name for layer in self.layers if blob in layer.tops][-1]

    def weight_layers(self) -> list[Layer]:
        return [layer for layer in self.layers if layer.blob_shapes]

    def parameter_count(self) -> int:
        return sum(math.prod(shape) for layer in self.layers for shape in layer.blob_shapes)


def _fit(array: np.ndarray, expected: Shape, path: Path, layer: Layer, index: int) -> np.ndarray:
    """The blob in the expected shape; old 4-D blobs are the expected shape padded with 1s."""
    if array.shape == expected:
        return array
    if len(expected) < 4 and array.shape == (1,) * (4 - len(expected)) + expected:
        return array.reshape(expected)
    raise NetworkError(
        f"weights file {path} does not match the prototxt: layer {layer.name!r} "
        f"blob {index} has shape {array.shape}, the prototxt needs {expected}"
    )


def _in_test_phase(layer: Any) -> bool:
    """Caffe's NetStateRule check for phase TEST (levels and stages ignored)."""
    if layer.include:
        return any(not rule.HasField("phase") or rule.phase == 1 for rule in layer.include)
    return not any(rule.HasField("phase") and rule.phase == 1 for rule in layer.exclude)


def _find_input(
    message: Any, layers: list[Any], source: Path, declared: Sequence[int] | None = None
) -> tuple[str, Shape]:
    """The one input blob and its shape: an Input layer, or the legacy input/input_dim fields.

    ``declared`` (C x H x W, model.toml's ``input_shape``) gives the shape of an input the
    prototxt names without one, or replaces the prototxt's; the batch stays (else 1).
    """
    inputs = [
        (layer.top[0], tuple(layer.input_param.shape[0].dim) if layer.input_param.shape else ())
        for layer in layers
        if layer.type == "Input" and layer.top
    ]
    if message.input:
        dims = (
            [tuple(s.dim) for s in message.input_shape]
            if message.input_shape
            else [tuple(message.input_dim[i : i + 4]) for i in range(0, len(message.input_dim), 4)]
        )
        inputs += [(name, dims[i] if i < len(dims) else ()) for i, name in enumerate(message.input)]
    if declared is not None and len(inputs) == 1:
        name, shape = inputs[0]
        inputs = [(name, (shape[0] if shape else 1, *declared))]
    if len(inputs) == 1 and (not inputs[0][1] or min(inputs[0][1]) <= 0):
        name, shape = inputs[0]
        raise InputShapeError(
            f"{source}: input {name!r} has {f'an invalid shape {shape}' if shape else 'no shape'}"
        )
    inputs = [(name, shape) for name, shape in inputs if shape]
    if len(inputs) != 1:
        raise NetworkError(
            f"{source}: farm runs nets with exactly one input blob with a "
            f"declared shape; found {len(inputs)}"
        )
    name, shape = inputs[0]
    if min(shape) <= 0:
        raise NetworkError(f"{source}: input {name!r} has an invalid shape {shape}")
    return name, tuple(int(d) for d in shape)


# ------------------------------------------------------------------ weights made from fillers


def filled(filler: Any, shape: Shape, rng: np.random.Generator) -> np.ndarray:
    """Values for a blob from a Caffe ``FillerParameter`` (constant, uniform, gaussian, xavier,
    msra)."""
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
    fan_out = shape[0] * math.prod(shape[2:]) if len(shape) > 1 else shape[0]
    n = {0: fan_in, 1: fan_out, 2: (fan_in + fan_out) / 2}[filler.variance_norm]
    kind = filler.type
    if kind == "constant":
        return np.full(shape, filler.value, np.float32)
    if kind == "uniform":
        return rng.uniform(filler.min, filler.max, shape).astype(np.float32)
    if kind == "gaussian":
        return rng.normal(filler.mean, filler.std, shape).astype(np.float32)
    if kind == "xavier":
        scale = math.sqrt(3.0 / n)
        return rng.uniform(-scale, scale, shape).astype(np.float32)
    if kind == "msra":
        return rng.normal(0.0, math.sqrt(2.0 / n), shape).astype(np.float32)
    raise NetworkError(f"filler type {kind!r} is not supported")


def generated_weights(net: Network, seed: int) -> list[tuple[str, str, list[np.ndarray]]]:
    """Seeded weights for every layer, from the prototxt's fillers (xavier where none is given).

    BatchNorm gets mean 0, variance 1 and scale factor 1; Scale gets 1 and bias 0.
    """
    rng = np.random.default_rng(seed)
    xavier = caffe_proto.FillerParameter(type="xavier")
    layers = []
    for layer in net.weight_layers():
        shapes = layer.blob_shapes
        if layer.type == "BatchNorm":
            blobs = [
                np.zeros(shapes[0], np.float32),
                np.ones(shapes[1], np.float32),
                np.ones(shapes[2], np.float32),
            ]
        elif layer.type == "Scale":
            blobs = [np.ones(shape, np.float32) for shape in shapes[:1]] + [
                np.zeros(shape, np.float32) for shape in shapes[1:]
            ]
        else:
            p = (
                layer.param.convolution_param
                if layer.type == "Convolution"
                else layer.param.inner_product_param
            )
            weight = p.weight_filler if p.HasField("weight_filler") else xavier
            blobs = [filled(weight, shapes[0], rng)]
            if len(shapes) > 1:
                blobs.append(filled(p.bias_filler, shapes[1], rng))
        layers.append((layer.name, layer.type, blobs))
    return layers
