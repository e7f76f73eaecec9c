"""A Caffe net as an ONNX graph, written from farm's own parsed ``Network``.

The graph computes what Caffe computes, layer by layer: pooling rounds up
(unless ``round_mode: FLOOR`` or ``ceil_mode: false``) and cuts a last window
that would start in the padding; average pooling divides by the window's
extent inside the padded input, as Caffe does; BatchNorm divides by its
stored scale factor; LRN within a channel uses Caffe's ``1 + alpha * mean``.
In-place layers get a fresh value name for each write, and the graph ends at
the model's output blob, which names the graph's output.  The batch dimension
is left free (``N``), so every batch size runs on one graph.  Only the ``onnx``
package is needed; no torch.

With ``fold``, the model's preprocessing (Caffe's ``Transformer``: layout, channel
swap, raw scale, mean, input scale) becomes the graph's first nodes, in the same
order and in f32: the graph then takes uint8 images as clients send them, and no
float32 copy of them is made on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from farm.engines.preprocess import Transformer
from farm.modelrepo import sealed
from farm.modelrepo.caffe_net import (
    Layer,
    Network,
    NetworkError,
    Shape,
    conv_geometry,
    pool_geometry,
)
from farm.modelrepo.modelstore import manifest_of
from farm.modelrepo.repository import ModelSpec, cache_root

#: The ONNX opset written (ONNX Runtime 1.14+ and OpenVINO 2023+ read it).
OPSET = 17
#: The IR version matching ``OPSET``; readers older than the ``onnx`` package accept it.
IR_VERSION = 8
#: Bumped whenever the graph farm writes for a net changes: cached exports carry it
#: (2: graphs with the preprocessing folded in).
FORMAT = 2
#: What a cached export's record calls it (``farm.modelrepo.sealed``).
CACHED = "ONNX export cache"


class ExportError(NetworkError):
    """A net that cannot be written as ONNX, with the layer and the reason."""


@dataclass
class GraphBuilder:
    """Nodes, initializers and the current ONNX value of every Caffe blob."""

    network: Network
    nodes: list[Any] = field(default_factory=list)
    initializers: list[Any] = field(default_factory=list)
    values: dict[str, str] = field(default_factory=dict)  # Caffe blob -> its latest value
    taken: set[str] = field(default_factory=set)

    def fresh(self, name: str) -> str:
        """A value name not used yet (in-place layers write a blob more than once)."""
        candidate, number = name, 1
        while candidate in self.taken:
            number += 1
            candidate = f"{name}:{number}"
        self.taken.add(candidate)
        return candidate

    def constant(self, name: str, array: np.ndarray | np.generic) -> str:
        from onnx import numpy_helper

        value = self.fresh(name)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), value))
        return value

    def node(self, op: str, inputs: list[str], name: str, **attributes: Any) -> str:
        """Add one node; its single output's value name."""
        from onnx import helper

        output = self.fresh(name)
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, **attributes))
        return output


Converter = Callable[[GraphBuilder, Layer, list[str], list[Shape]], str]


def export(network: Network, output: str | None = None, fold: Transformer | None = None) -> Any:
    """The ONNX ``ModelProto`` of ``network`` (weights attached) up to blob ``output``;
    with ``fold``, its input is uint8 images as clients send them (``fold_preprocessing``).

    ExportError names the layer that cannot be written.
    """
    from onnx import TensorProto, helper

    output = output or network.output
    if output not in network.shapes:
        raise ExportError(f"{network.source}: {output!r} is not a blob of the net")
    builder = GraphBuilder(network)
    # the graph's output takes the blob's own name, unless that is the input's too
    final = output if output != network.input else output + ":out"
    builder.taken.update({network.input, final})
    builder.values[network.input] = (
        network.input if fold is None else fold_preprocessing(builder, fold)
    )
    last = max(i for i, layer in enumerate(network.layers) if output in layer.tops)
    for layer in network.layers[: last + 1]:
        builder.values[layer.tops[0]] = convert_layer(builder, network, layer)
    builder.nodes.append(
        helper.make_node("Identity", [builder.values[output]], [final], name=final)
    )
    out_shape = network.shapes[output]
    in_shape = network.input_shape[1:]
    if fold is not None and fold.hwc:
        in_shape = (*in_shape[1:], in_shape[0])
    graph = helper.make_graph(
        builder.nodes,
        network.name or "caffe",
        [
            helper.make_tensor_value_info(
                network.input,
                TensorProto.FLOAT if fold is None else TensorProto.UINT8,
                ["N", *in_shape],
            )
        ],
        [helper.make_tensor_value_info(final, TensorProto.FLOAT, ["N", *out_shape[1:]])],
        builder.initializers,
    )
    model = helper.make_model(
        graph, producer_name="farm", opset_imports=[helper.make_opsetid("", OPSET)]
    )
    model.ir_version = IR_VERSION
    return model


def convert_layer(builder: GraphBuilder, network: Network, layer: Layer) -> str:
    """Write one layer's nodes; the value holding its output.  ExportError names the layer
    that cannot be written."""
    if layer.blob_shapes and not layer.blobs:
        raise ExportError(f"{network.source}: layer {layer.name!r} has no weights attached")
    if len(layer.tops) != 1:
        raise ExportError(
            f"{network.source}: layer {layer.name!r} has {len(layer.tops)} "
            f"outputs; farm exports layers with one"
        )
    inputs = [builder.values[name] for name in layer.bottoms]
    shapes = [network.shapes[name] for name in layer.bottoms]
    try:
        return CONVERTERS[layer.type](builder, layer, inputs, shapes)
    except ExportError as exc:
        raise ExportError(f"{network.source}: layer {layer.name!r} ({layer.type}): {exc}") from None


def fold_preprocessing(b: GraphBuilder, transform: Transformer) -> str:
    """``Transformer`` as the graph's first nodes, its steps in its order: uint8 images
    as clients send them in (``N x H x W x C`` for HWC), the net's float32 N x C x H x W
    out.  The layout and the channel swap move uint8 (4x fewer bytes than after the
    cast); the arithmetic is the host's, in f32."""
    from onnx import TensorProto

    name = b.network.input
    value = name
    if transform.hwc:
        value = b.node("Transpose", [value], name + ":chw", perm=[0, 3, 1, 2])
    if transform.channel_swap:
        swap = b.constant(name + ".swap", np.array(transform.channel_swap, np.int64))
        value = b.node("Gather", [value, swap], name + ":swapped", axis=1)
    value = b.node("Cast", [value], name + ":f32", to=TensorProto.FLOAT)
    steps = (
        ("Mul", "raw_scale", transform.raw_scale != 1.0, np.float32(transform.raw_scale)),
        ("Sub", "mean", transform.mean is not None, transform.mean),
        ("Mul", "input_scale", transform.input_scale != 1.0, np.float32(transform.input_scale)),
    )
    for op, step, applies, operand in steps:
        if applies:
            constant = b.constant(f"{name}.{step}", np.asarray(operand, np.float32))
            value = b.node(op, [value, constant], f"{name}:{step}")
    return value


def save(model: Any, path: str | Path, record: bool = False) -> Path:
    """Write ``model`` after ``onnx.checker`` has passed it, atomically; the path.
    ``record``: a cache file, its digest recorded beside it (``farm.modelrepo.sealed``)."""
    import onnx

    onnx.checker.check_model(model, full_check=True)
    data = model.SerializeToString()
    return sealed.write(
        Path(path), lambda partial: partial.write_bytes(data), cache_format() if record else None
    )


def cache_format() -> str:
    """The format a cached export's record names."""
    return f"farm onnx export v{FORMAT}"


def output_name(model: Any) -> str:
    return model.graph.output[0].name


# ------------------------------------------------------------------------------- layers


def _convolution(b: GraphBuilder, layer: Layer, x: list[str], shapes: list[Shape]) -> str:
    p = layer.param.convolution_param
    g = conv_geometry(p)
    inputs = [x[0], b.constant(layer.name + ".weight", layer.blobs[0])]
    if p.bias_term:
        inputs.append(b.constant(layer.name + ".bias", layer.blobs[1]))
    return b.node(
        "Conv",
        inputs,
        layer.tops[0],
        kernel_shape=list(g.kernel),
        strides=list(g.stride),
        pads=[*g.pad, *g.pad],
        dilations=list(g.dilation),
        group=p.group,
    )


def _pooling(b: GraphBuilder, layer: Layer, x: list[str], shapes: list[Shape]) -> str:
    """Caffe's pooling with explicit end padding, so no reader's rounding rule matters.

    The output size comes from farm's shape rule (Caffe's); the end of each axis is
    padded just enough for a floor-rounded pooling to give that size.  Average
    pooling excludes that extra end padding from its divisor but includes the
    declared padding (a Pad node), exactly as Caffe's ``pool_size``.
    """
    p = layer.param.pooling_param
    top = layer.tops[0]
    height, width = shapes[0][2:]
    out = b.network.shapes[top][2:]
    if p.global_pooling:
        return b.node("GlobalMaxPool" if p.pool == 0 else "GlobalAveragePool", x, top)
    g = pool_geometry(p, height, width)
    extra = [
        max(0, (o - 1) * s + k - (size + 2 * pad))
        for o, s, k, size, pad in zip(out, g.stride, g.kernel, (height, width), g.pad)
    ]
    window = {"kernel_shape": list(g.kernel), "strides": list(g.stride)}
    if p.pool == 0:
        return b.node(
            "MaxPool", x, top, pads=[*g.pad, g.pad[0] + extra[0], g.pad[1] + extra[1]], **window
        )
    source = x[0]
    if any(g.pad):
        pads = b.constant(layer.name + ".pads", np.array([0, 0, *g.pad, 0, 0, *g.pad], np.int64))
        source = b.node("Pad", [source, pads], top + ":padded")
    return b.node("AveragePool", [source], top, pads=[0, 0, *extra], count_include_pad=0, **window)


def _inner_product(b: GraphBuilder, layer: Layer, x: list[str], shapes: list[Shape]) -> str:
    p = layer.param.inner_product_param
    axis = p.axis % len(shapes[0])
    weight = layer.blobs[0]
    top = layer.tops[0]
    if axis == 1 and not p.transpose:
        flat = b.node("Flatten", x, top + ":flat", axis=1)
        inputs = [flat, b.constant(layer.name + ".weight", weight)]
        if p.bias_term:
            inputs.append(b.constant(layer.name + ".bias", layer.blobs[1]))
        return b.node("Gemm", inputs, top, transB=1)
    shape = b.constant(layer.name + ".shape", np.array([0] * axis + [-1], np.int64))
    flat = b.node("Reshape", [x[0], shape], top + ":flat")
    matrix = weight if p.transpose else weight.T
    product = b.node(
        "MatMul",
        [flat, b.constant(layer.name + ".weight", matrix)],
        top + (":matmul" if p.bias_term else ""),
    )
    if not p.bias_term:
        return product
    return b.node("Add", [product, b.constant(layer.name + ".bias", layer.blobs[1])], top)


def _relu(b: GraphBuilder, layer: Layer, x: list[str], shapes: list[Shape]) -> str:
    slope = layer.param.relu_param.negative_slope
    if slope:
        return b.node("LeakyRelu", x, layer.tops[0], alpha=slope)
    return b.node("Relu", x, layer.tops[0])


def _unary(op: str) -> Converter:
    return lambda b, layer, x, shapes: b.node(op, x, layer.tops[0])


def _softmax(b: GraphBuilder, layer: Layer, x: list[str], shapes: list[Shape]) -> str:
    return b.node("Softmax", x, layer.tops[0], axis=layer.param.softmax_param.axis % len(shapes[0]))


def _lrn(b: GraphBuilder, layer: Layer, x: list[str], shapes: list[Shape]) -> str:
    q = layer.param.lrn_param
    top = layer.tops[0]
    if q.norm_region == 0:  # ACROSS_CHANNELS: x / (k + alpha/size * window sum of x^2)^beta
        return b.node("LRN", x, top, size=q.local_size, alpha=q.alpha, beta=q.beta, bias=q.k)
    # WITHIN_CHANNEL: x * (1 + alpha * mean of x^2 over a size x size window)^-beta (no k)
    pad = (q.local_size - 1) // 2
    square = b.node("Mul", [x[0], x[0]], top + ":square")
    mean = b.node(
        "AveragePool",
        [square],
        top + ":mean",
        kernel_shape=[q.local_size] * 2,
        strides=[1, 1],
        pads=[pad] * 4,
        count_include_pad=1,
    )
    scaled = b.node(
        "Mul", [mean, b.constant(layer.name + ".alpha", np.float32(q.alpha))], top + ":scaled"
    )
    base = b.node("Add", [scaled, b.constant(layer.name + ".one", np.float32(1.0))], top + ":base")
    factor = b.node(
        "Pow", [base, b.constant(layer.name + ".beta", np.float32(-q.beta))], top + ":factor"
    )
    return b.node("Mul", [x[0], factor], top)


def _per_channel(array: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    """A parameter shaped to broadcast against an ``ndim`` tensor from ``axis`` on."""
    return array.reshape(array.shape + (1,) * (ndim - axis - array.ndim)).astype(np.float32)


def _batch_norm(b: GraphBuilder, layer: Layer, x: list[str], shapes: list[Shape]) -> str:
    """Caffe's test-time BatchNorm folded into one multiply and one add."""
    mean, variance, stored = (blob.astype(np.float64) for blob in layer.blobs)
    factor = 0.0 if stored.reshape(-1)[0] == 0 else 1.0 / stored.reshape(-1)[0]
    scale = 1.0 / np.sqrt(variance * factor + layer.param.batch_norm_param.eps)
    shift = -mean * factor * scale
    ndim = len(shapes[0])
    scaled = b.node(
        "Mul",
        [x[0], b.constant(layer.name + ".scale", _per_channel(scale, 1, ndim))],
        layer.tops[0] + ":bn",
    )
    return b.node(
        "Add",
        [scaled, b.constant(layer.name + ".shift", _per_channel(shift, 1, ndim))],
        layer.tops[0],
    )


def _scale(b: GraphBuilder, layer: Layer, x: list[str], shapes: list[Shape]) -> str:
    q = layer.param.scale_param
    ndim = len(shapes[0])
    axis = q.axis % ndim
    top = layer.tops[0]
    if len(x) > 1:  # the scale is the second input; a bias, if any, is the layer's one blob
        trailing = ndim - axis - len(shapes[1])
        factor = x[1]
        if trailing:
            axes = b.constant(
                layer.name + ".axes",
                np.arange(len(shapes[1]), len(shapes[1]) + trailing, dtype=np.int64),
            )
            factor = b.node("Unsqueeze", [x[1], axes], top + ":factor")
        bias = layer.blobs[0] if layer.blobs else None
    else:
        factor = b.constant(layer.name + ".scale", _per_channel(layer.blobs[0], axis, ndim))
        bias = layer.blobs[1] if len(layer.blobs) > 1 else None
    if bias is None:
        return b.node("Mul", [x[0], factor], top)
    scaled = b.node("Mul", [x[0], factor], top + ":scaled")
    return b.node(
        "Add", [scaled, b.constant(layer.name + ".bias", _per_channel(bias, axis, ndim))], top
    )


def _concat(b: GraphBuilder, layer: Layer, x: list[str], shapes: list[Shape]) -> str:
    q = layer.param.concat_param
    axis = q.axis if q.HasField("axis") or not q.HasField("concat_dim") else q.concat_dim
    return b.node("Concat", x, layer.tops[0], axis=axis % len(shapes[0]))


def _eltwise(b: GraphBuilder, layer: Layer, x: list[str], shapes: list[Shape]) -> str:
    q = layer.param.eltwise_param
    top = layer.tops[0]
    if q.operation == 2:
        return b.node("Max", x, top)
    if q.operation == 0:
        return b.node("Mul", x, top) if len(x) == 2 else _chain(b, "Mul", x, top)
    if q.coeff and any(c != 1.0 for c in q.coeff):
        x = [
            value
            if c == 1.0
            else b.node(
                "Mul",
                [value, b.constant(f"{layer.name}.coeff{i}", np.float32(c))],
                f"{top}:term{i}",
            )
            for i, (value, c) in enumerate(zip(x, q.coeff))
        ]
    return b.node("Sum", x, top)


def _chain(b: GraphBuilder, op: str, x: list[str], top: str) -> str:
    value = x[0]
    for i, other in enumerate(x[1:], 1):
        value = b.node(op, [value, other], top if i == len(x) - 1 else f"{top}:{i}")
    return value


def _flatten(b: GraphBuilder, layer: Layer, x: list[str], shapes: list[Shape]) -> str:
    q = layer.param.flatten_param
    shape = shapes[0]
    start, end = q.axis % len(shape), q.end_axis % len(shape)
    if start == 1 and end == len(shape) - 1:
        return b.node("Flatten", x, layer.tops[0], axis=1)
    target = [0] * start + [-1] + list(shape[end + 1 :])
    return b.node(
        "Reshape",
        [x[0], b.constant(layer.name + ".shape", np.array(target, np.int64))],
        layer.tops[0],
    )


def _dropout(b: GraphBuilder, layer: Layer, x: list[str], shapes: list[Shape]) -> str:
    return b.node("Identity", x, layer.tops[0])


#: Layer type -> the function that writes its nodes (every type in ``network.LAYERS``).
CONVERTERS: dict[str, Converter] = {
    "Convolution": _convolution,
    "Pooling": _pooling,
    "InnerProduct": _inner_product,
    "ReLU": _relu,
    "Sigmoid": _unary("Sigmoid"),
    "TanH": _unary("Tanh"),
    "Softmax": _softmax,
    "LRN": _lrn,
    "Dropout": _dropout,
    "BatchNorm": _batch_norm,
    "Scale": _scale,
    "Concat": _concat,
    "Eltwise": _eltwise,
    "Flatten": _flatten,
}


def shape_check(model: Any, network: Network, output: str) -> None:
    """onnx's shape inference must agree with farm's (Caffe's) shape of the output blob."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    dims = inferred.graph.output[0].type.tensor_type.shape.dim
    got = tuple(d.dim_value for d in dims[1:])
    expected = network.shapes[output][1:]
    if got != expected:
        raise ExportError(
            f"{network.source}: the ONNX graph's output {got} is not Caffe's {expected}"
        )


def onnx_path(spec: ModelSpec, folded: bool = False) -> Path:
    """Where farm's ONNX export of a model is cached: one file per model digest (which
    covers ``model.toml``'s preprocessing and the mean file), export format, and input:
    ``-u8``, uint8 images with the preprocessing folded in."""
    digest = manifest_of(spec).digest
    suffix = "-u8" if folded else ""
    return cache_root() / "onnx" / f"{spec.name}-{digest[:24]}-v{FORMAT}{suffix}.onnx"


def exported_onnx(spec: ModelSpec, network: Network | None = None, folded: bool = False) -> Path:
    """farm's ONNX export of a model, written once per model digest into the cache
    (``$FARM_CACHE/onnx``), so a process that starts again reads it without exporting;
    ``network``: the model already loaded, if at hand (used where its weights are still
    attached); ``folded``: the graph takes uint8 images, the preprocessing in it.

    A cached export is used only when its bytes match the digest recorded when it was
    written; one that does not (or has no record) is logged, removed and exported again.
    """
    path = onnx_path(spec, folded)
    if not sealed.verified(path, CACHED, cache_format()):
        if network is None or not has_weights(network):
            network = Network.load(spec.prototxt, spec.weights, spec.declared_input)
        fold = Transformer.for_model(spec) if folded else None
        path.parent.mkdir(parents=True, exist_ok=True)
        save(export(network, spec.output, fold), path, record=True)
    return path


def has_weights(network: Network) -> bool:
    """Whether every layer that takes weights still holds them (``drop_weights`` not run)."""
    return all(layer.blobs for layer in network.layers if layer.blob_shapes)
