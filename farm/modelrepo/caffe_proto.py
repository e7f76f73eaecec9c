"""Caffe's file formats: a subset of ``caffe.proto`` built in Python, with upstream field numbers.

The schema is declared here and turned into protobuf classes at import time
through a ``FileDescriptorProto``: no ``protoc``-generated module is involved,
so there is no tie to one protobuf runtime version.

- ``deploy.prototxt`` (text) is parsed with unknown fields skipped: prototxts in
  the wild carry fields (``engine``, ``param { lr_mult }``, ...) this subset lacks.
- ``.caffemodel`` (binary ``NetParameter``) is read and written, in both the
  current ``layer`` form and the old V1 ``layers`` form, which is upgraded.
- ``BlobProto.data`` is declared ``repeated bytes``: upstream declares it
  ``repeated float [packed = true]``, and a packed field is one length-delimited
  record on the wire, exactly what a ``bytes`` field is.  So a blob's floats are
  read with one ``np.frombuffer`` and written from ``ndarray.tobytes()``: a
  233 MB CaffeNet loads in about a second instead of a minute, and the files are
  byte-for-byte what Caffe writes.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format
from google.protobuf.message import DecodeError

log = logging.getLogger("farm.caffe")

_F = descriptor_pb2.FieldDescriptorProto
_KINDS = {
    "int32": _F.TYPE_INT32,
    "int64": _F.TYPE_INT64,
    "uint32": _F.TYPE_UINT32,
    "uint64": _F.TYPE_UINT64,
    "float": _F.TYPE_FLOAT,
    "bool": _F.TYPE_BOOL,
    "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
}


class CaffeFormatError(ValueError):
    """A Caffe file that cannot be parsed."""


def _field(
    label: str, kind: str, name: str, number: int, default: str | None = None, packed: bool = False
) -> tuple:
    return label, kind, name, number, default, packed


def opt(kind: str, name: str, number: int, default: Any = None) -> tuple:
    text = (
        None
        if default is None
        else str(default).lower()
        if isinstance(default, bool)
        else str(default)
    )
    return _field("optional", kind, name, number, text)


def rep(kind: str, name: str, number: int, packed: bool = False) -> tuple:
    return _field("repeated", kind, name, number, packed=packed)


#: Enums nested in a message: message -> {enum name: [value names in number order]}.
_ENUMS = {
    "FillerParameter": {"VarianceNorm": ["FAN_IN", "FAN_OUT", "AVERAGE"]},
    "PoolingParameter": {
        "PoolMethod": ["MAX", "AVE", "STOCHASTIC"],
        "RoundMode": ["CEIL", "FLOOR"],
    },
    "LRNParameter": {"NormRegion": ["ACROSS_CHANNELS", "WITHIN_CHANNEL"]},
    "EltwiseParameter": {"EltwiseOp": ["PROD", "SUM", "MAX"]},
}

#: V1LayerParameter.LayerType: value name -> number (upstream numbering is not dense).
V1_LAYER_TYPES = {
    "NONE": 0,
    "ACCURACY": 1,
    "BNLL": 2,
    "CONCAT": 3,
    "CONVOLUTION": 4,
    "DATA": 5,
    "DROPOUT": 6,
    "EUCLIDEAN_LOSS": 7,
    "FLATTEN": 8,
    "HDF5_DATA": 9,
    "HDF5_OUTPUT": 10,
    "IM2COL": 11,
    "IMAGE_DATA": 12,
    "INFOGAIN_LOSS": 13,
    "INNER_PRODUCT": 14,
    "LRN": 15,
    "MULTINOMIAL_LOGISTIC_LOSS": 16,
    "POOLING": 17,
    "RELU": 18,
    "SIGMOID": 19,
    "SOFTMAX": 20,
    "SOFTMAX_LOSS": 21,
    "SPLIT": 22,
    "TANH": 23,
    "WINDOW_DATA": 24,
    "ELTWISE": 25,
    "POWER": 26,
    "SIGMOID_CROSS_ENTROPY_LOSS": 27,
    "HINGE_LOSS": 28,
    "MEMORY_DATA": 29,
    "ARGMAX": 30,
    "THRESHOLD": 31,
    "DUMMY_DATA": 32,
    "SLICE": 33,
    "MVN": 34,
    "ABSVAL": 35,
    "SILENCE": 36,
    "CONTRASTIVE_LOSS": 37,
    "EXP": 38,
    "DECONVOLUTION": 39,
}

#: V1 type names whose current spelling is not a plain CamelCase of the enum name.
_V1_SPELLINGS = {
    "RELU": "ReLU",
    "LRN": "LRN",
    "TANH": "TanH",
    "BNLL": "BNLL",
    "MVN": "MVN",
    "ABSVAL": "AbsVal",
    "ARGMAX": "ArgMax",
    "HDF5_DATA": "HDF5Data",
    "HDF5_OUTPUT": "HDF5Output",
    "SOFTMAX_LOSS": "SoftmaxWithLoss",
    "IM2COL": "Im2col",
}

#: Layer parameter messages shared by LayerParameter and V1LayerParameter: name -> (new, V1).
_LAYER_PARAMS = {
    "concat_param": ("ConcatParameter", 104, 9),
    "convolution_param": ("ConvolutionParameter", 106, 10),
    "dropout_param": ("DropoutParameter", 108, 12),
    "eltwise_param": ("EltwiseParameter", 110, 24),
    "inner_product_param": ("InnerProductParameter", 117, 17),
    "lrn_param": ("LRNParameter", 118, 18),
    "pooling_param": ("PoolingParameter", 121, 19),
    "relu_param": ("ReLUParameter", 123, 30),
    "softmax_param": ("SoftmaxParameter", 125, 39),
    "flatten_param": ("FlattenParameter", 135, None),
    "batch_norm_param": ("BatchNormParameter", 139, None),
    "scale_param": ("ScaleParameter", 142, None),
    "input_param": ("InputParameter", 143, None),
}

_MESSAGES: dict[str, list[tuple]] = {
    "BlobShape": [rep("int64", "dim", 1, packed=True)],
    "BlobProto": [
        opt(".caffe.BlobShape", "shape", 7),
        rep("bytes", "data", 5),
        rep("bytes", "diff", 6),  # packed floats, see the module doc
        rep("bytes", "double_data", 8),
        rep("bytes", "double_diff", 9),
        opt("int32", "num", 1, 0),
        opt("int32", "channels", 2, 0),
        opt("int32", "height", 3, 0),
        opt("int32", "width", 4, 0),
    ],
    "BlobProtoVector": [rep(".caffe.BlobProto", "blobs", 1)],
    "NetState": [
        opt(".caffe.Phase", "phase", 1, "TEST"),
        opt("int32", "level", 2, 0),
        rep("string", "stage", 3),
    ],
    "NetStateRule": [
        opt(".caffe.Phase", "phase", 1),
        opt("int32", "min_level", 2),
        opt("int32", "max_level", 3),
        rep("string", "stage", 4),
        rep("string", "not_stage", 5),
    ],
    "NetParameter": [
        opt("string", "name", 1),
        rep("string", "input", 3),
        rep(".caffe.BlobShape", "input_shape", 8),
        rep("int32", "input_dim", 4),
        opt("bool", "force_backward", 5, False),
        opt(".caffe.NetState", "state", 6),
        rep(".caffe.LayerParameter", "layer", 100),
        rep(".caffe.V1LayerParameter", "layers", 2),
    ],
    "LayerParameter": [
        opt("string", "name", 1),
        opt("string", "type", 2),
        rep("string", "bottom", 3),
        rep("string", "top", 4),
        opt(".caffe.Phase", "phase", 10),
        rep(".caffe.BlobProto", "blobs", 7),
        rep(".caffe.NetStateRule", "include", 8),
        rep(".caffe.NetStateRule", "exclude", 9),
        *(opt(f".caffe.{kind}", name, number) for name, (kind, number, _) in _LAYER_PARAMS.items()),
    ],
    "V1LayerParameter": [
        rep("string", "bottom", 2),
        rep("string", "top", 3),
        opt("string", "name", 4),
        rep(".caffe.NetStateRule", "include", 32),
        rep(".caffe.NetStateRule", "exclude", 33),
        opt(".caffe.V1LayerParameter.LayerType", "type", 5),
        rep(".caffe.BlobProto", "blobs", 6),
        *(
            opt(f".caffe.{kind}", name, number)
            for name, (kind, _, number) in _LAYER_PARAMS.items()
            if number is not None
        ),
    ],
    "FillerParameter": [
        opt("string", "type", 1, "constant"),
        opt("float", "value", 2, 0),
        opt("float", "min", 3, 0),
        opt("float", "max", 4, 1),
        opt("float", "mean", 5, 0),
        opt("float", "std", 6, 1),
        opt("int32", "sparse", 7, -1),
        opt(".caffe.FillerParameter.VarianceNorm", "variance_norm", 8, "FAN_IN"),
    ],
    "ConvolutionParameter": [
        opt("uint32", "num_output", 1),
        opt("bool", "bias_term", 2, True),
        rep("uint32", "pad", 3),
        rep("uint32", "kernel_size", 4),
        opt("uint32", "group", 5, 1),
        rep("uint32", "stride", 6),
        opt(".caffe.FillerParameter", "weight_filler", 7),
        opt(".caffe.FillerParameter", "bias_filler", 8),
        opt("uint32", "pad_h", 9, 0),
        opt("uint32", "pad_w", 10, 0),
        opt("uint32", "kernel_h", 11),
        opt("uint32", "kernel_w", 12),
        opt("uint32", "stride_h", 13),
        opt("uint32", "stride_w", 14),
        opt("int32", "axis", 16, 1),
        rep("uint32", "dilation", 18),
    ],
    "PoolingParameter": [
        opt(".caffe.PoolingParameter.PoolMethod", "pool", 1, "MAX"),
        opt("uint32", "pad", 4, 0),
        opt("uint32", "pad_h", 9, 0),
        opt("uint32", "pad_w", 10, 0),
        opt("uint32", "kernel_size", 2),
        opt("uint32", "kernel_h", 5),
        opt("uint32", "kernel_w", 6),
        opt("uint32", "stride", 3, 1),
        opt("uint32", "stride_h", 7),
        opt("uint32", "stride_w", 8),
        opt("bool", "global_pooling", 12, False),
        opt(".caffe.PoolingParameter.RoundMode", "round_mode", 13, "CEIL"),
        # the forks' `ceil_mode: false` (BVLC/caffe pull request 3057, as DenseNet-Caffe
        # uses); 13 there clashes with round_mode, so it gets a number of its own
        opt("bool", "ceil_mode", 1013, True),
    ],
    "InnerProductParameter": [
        opt("uint32", "num_output", 1),
        opt("bool", "bias_term", 2, True),
        opt(".caffe.FillerParameter", "weight_filler", 3),
        opt(".caffe.FillerParameter", "bias_filler", 4),
        opt("int32", "axis", 5, 1),
        opt("bool", "transpose", 6, False),
    ],
    "InputParameter": [rep(".caffe.BlobShape", "shape", 1)],
    "LRNParameter": [
        opt("uint32", "local_size", 1, 5),
        opt("float", "alpha", 2, 1),
        opt("float", "beta", 3, 0.75),
        opt(".caffe.LRNParameter.NormRegion", "norm_region", 4, "ACROSS_CHANNELS"),
        opt("float", "k", 5, 1),
    ],
    "DropoutParameter": [
        opt("float", "dropout_ratio", 1, 0.5),
        opt("bool", "scale_train", 2, True),
    ],
    "ReLUParameter": [opt("float", "negative_slope", 1, 0)],
    "SoftmaxParameter": [opt("int32", "axis", 2, 1)],
    "ScaleParameter": [
        opt("int32", "axis", 1, 1),
        opt("int32", "num_axes", 2, 1),
        opt(".caffe.FillerParameter", "filler", 3),
        opt("bool", "bias_term", 4, False),
        opt(".caffe.FillerParameter", "bias_filler", 5),
    ],
    "BatchNormParameter": [
        opt("bool", "use_global_stats", 1),
        opt("float", "moving_average_fraction", 2, 0.999),
        opt("float", "eps", 3, 1e-5),
    ],
    "ConcatParameter": [opt("uint32", "concat_dim", 1, 1), opt("int32", "axis", 2, 1)],
    "EltwiseParameter": [
        opt(".caffe.EltwiseParameter.EltwiseOp", "operation", 1, "SUM"),
        rep("float", "coeff", 2),
        opt("bool", "stable_prod_grad", 3, True),
    ],
    "FlattenParameter": [opt("int32", "axis", 1, 1), opt("int32", "end_axis", 2, -1)],
}


#: Full names of the enum types, so that fields of those types are declared as enums.
_ENUM_TYPES = {
    f".caffe.{message}.{enum}" for message, enums in _ENUMS.items() for enum in enums
} | {".caffe.Phase", ".caffe.V1LayerParameter.LayerType"}


def _add_field(message: Any, spec: tuple) -> None:
    label, kind, name, number, default, packed = spec
    field = message.field.add(
        name=name,
        number=number,
        label=(_F.LABEL_REPEATED if label == "repeated" else _F.LABEL_OPTIONAL),
    )
    if kind in _KINDS:
        field.type = _KINDS[kind]
    else:
        field.type = _F.TYPE_ENUM if kind in _ENUM_TYPES else _F.TYPE_MESSAGE
        field.type_name = kind
    if default is not None:
        field.default_value = default
    if packed:
        field.options.packed = True


def _build_classes() -> dict[str, type]:
    file_proto = descriptor_pb2.FileDescriptorProto(
        name="farm_caffe_subset.proto", package="caffe", syntax="proto2"
    )
    phase = file_proto.enum_type.add(name="Phase")
    for number, name in enumerate(("TRAIN", "TEST")):
        phase.value.add(name=name, number=number)
    for message_name, fields in _MESSAGES.items():
        message = file_proto.message_type.add(name=message_name)
        for enum_name, values in _ENUMS.get(message_name, {}).items():
            enum = message.enum_type.add(name=enum_name)
            for number, value in enumerate(values):
                enum.value.add(name=value, number=number)
        if message_name == "V1LayerParameter":
            enum = message.enum_type.add(name="LayerType")
            for value, number in V1_LAYER_TYPES.items():
                enum.value.add(name=value, number=number)
        for spec in fields:
            _add_field(message, spec)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_proto)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"caffe.{name}"))
        for name in _MESSAGES
    }


_CLASSES = _build_classes()
NetParameter = _CLASSES["NetParameter"]
LayerParameter = _CLASSES["LayerParameter"]
BlobProto = _CLASSES["BlobProto"]
FillerParameter = _CLASSES["FillerParameter"]


# ------------------------------------------------------------------ reading

#: Fields outside the schema that never change what a deploy net computes: training
#: settings, and the parameters of the training-only layers that farm skips.
HARMLESS_FIELDS = frozenset(
    {
        "engine",
        "param",
        "lr_mult",
        "decay_mult",
        "blobs_lr",
        "weight_decay",
        "loss_weight",
        "propagate_down",
        "share_mode",
        "transform_param",
        "data_param",
        "image_data_param",
        "memory_data_param",
        "hdf5_data_param",
        "window_data_param",
        "dummy_data_param",
        "loss_param",
        "accuracy_param",
        "source",
        "batch_size",
        "backend",
        "mirror",
        "crop_size",
        "mean_value",
        "mean_file",
        "scale",
        "top_k",
        "ignore_label",
        "normalize",
        "normalization",
        "new_height",
        "new_width",
        "is_color",
        "root_folder",
        "shuffle",
        "rand_skip",
        "force_color",
        "force_gray",
        "debug_info",
    }
)

_KNOWN_FIELDS = frozenset(spec[2] for fields in _MESSAGES.values() for spec in fields)


def unknown_fields(text: str) -> list[str]:
    """Field names in a prototxt that the schema lacks and that may change the net's result."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"|#[^\n]*', " ", text)  # drop strings and comments
    names = set(re.findall(r"\b([A-Za-z_][A-Za-z0-9_]*)\s*(?::|\{)", bare))
    return sorted(names - _KNOWN_FIELDS - HARMLESS_FIELDS)


def parse_prototxt(path: str | Path) -> Any:
    """A ``NetParameter`` from a text prototxt, V1 ``layers`` upgraded; unknown fields skipped."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CaffeFormatError(f"cannot read {path}: {exc}") from exc
    net = NetParameter()
    try:
        text_format.Parse(text, net, allow_unknown_field=True)
    except text_format.ParseError as exc:
        raise CaffeFormatError(f"{path} is not a valid prototxt: {exc}") from exc
    ignored = unknown_fields(text)
    if ignored:
        log.warning(
            "%s: ignoring fields farm does not know: %s (if they change what the net "
            "computes, farm's outputs will differ from Caffe's)",
            path,
            ", ".join(ignored),
        )
    return upgrade_v1(net)


def read_net_binary(path: str | Path) -> Any:
    """A ``NetParameter`` from a binary ``.caffemodel``, V1 ``layers`` upgraded."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CaffeFormatError(f"cannot read {path}: {exc}") from exc
    net = NetParameter()
    try:
        net.ParseFromString(data)
    except DecodeError as exc:
        raise CaffeFormatError(
            f"{path} is not a Caffe NetParameter (corrupt or truncated caffemodel): {exc}"
        ) from exc
    return upgrade_v1(net)


def v1_type_name(number: int) -> str:
    """The current layer type string for a V1 ``LayerType`` number (``INNER_PRODUCT`` ->
    ``InnerProduct``)."""
    names = {value: name for name, value in V1_LAYER_TYPES.items()}
    name = names.get(number, f"V1Type{number}")
    return _V1_SPELLINGS.get(name) or "".join(part.capitalize() for part in name.split("_"))


def upgrade_v1(net: Any) -> Any:
    """Move V1 ``layers`` entries into ``layer`` (what Caffe's ``UpgradeNetAsNeeded`` does)."""
    for old in net.layers:
        layer = net.layer.add(name=old.name, type=v1_type_name(old.type))
        layer.bottom.extend(old.bottom)
        layer.top.extend(old.top)
        layer.blobs.extend(old.blobs)
        layer.include.extend(old.include)
        layer.exclude.extend(old.exclude)
        for name, (_, _, v1_number) in _LAYER_PARAMS.items():
            if v1_number is not None and old.HasField(name):
                getattr(layer, name).CopyFrom(getattr(old, name))
    del net.layers[:]
    return net


def blob_shape(blob: Any) -> tuple[int, ...]:
    """A blob's shape: ``shape.dim``, or the legacy num/channels/height/width."""
    if blob.HasField("shape"):
        return tuple(int(d) for d in blob.shape.dim)
    return tuple(int(d) for d in (blob.num, blob.channels, blob.height, blob.width))


def blob_array(blob: Any, where: str = "blob") -> np.ndarray:
    """A blob's values as a float32 array of its shape (no per-value Python work)."""
    shape = blob_shape(blob)
    if blob.data:
        values = np.frombuffer(b"".join(blob.data), dtype="<f4")
    elif blob.double_data:
        values = np.frombuffer(b"".join(blob.double_data), dtype="<f8").astype(np.float32)
    else:
        values = np.zeros(0, np.float32)
    if values.size != math.prod(shape):
        raise CaffeFormatError(
            f"{where} declares shape {shape} ({math.prod(shape)} values) but holds {values.size}"
        )
    return values.reshape(shape).astype(np.float32, copy=False)


def read_caffemodel(path: str | Path) -> dict[str, list[np.ndarray]]:
    """Blobs of a binary ``.caffemodel`` by layer name (current and V1 forms)."""
    weights = {}
    for layer in read_net_binary(path).layer:
        arrays = [
            blob_array(blob, f"{path}: layer {layer.name!r} blob {index}")
            for index, blob in enumerate(layer.blobs)
        ]
        if arrays:
            weights[layer.name] = arrays
    return weights


def read_blobproto(path: str | Path) -> np.ndarray:
    """One ``BlobProto`` file, such as a ``mean.binaryproto``."""
    blob = BlobProto()
    try:
        blob.ParseFromString(Path(path).read_bytes())
        return blob_array(blob, str(path))
    except (OSError, DecodeError) as exc:
        raise CaffeFormatError(f"cannot read blob file {path}: {exc}") from exc


# ------------------------------------------------------------------ writing


def fill_blob(blob: Any, array: np.ndarray) -> Any:
    """Put an array in a ``BlobProto``: its shape and its float32 values, packed."""
    blob.shape.dim.extend(int(d) for d in array.shape)
    blob.data.append(np.ascontiguousarray(array, dtype="<f4").tobytes())
    return blob


def write_caffemodel(
    path: str | Path, net_name: str, layers: Iterable[tuple[str, str, list[np.ndarray]]]
) -> None:
    """Write a binary ``.caffemodel`` from ``(layer name, layer type, [blobs])``."""
    net = NetParameter(name=net_name)
    for name, kind, blobs in layers:
        layer = net.layer.add(name=name, type=kind)
        for array in blobs:
            fill_blob(layer.blobs.add(), array)
    Path(path).write_bytes(net.SerializeToString())


def write_blobproto(path: str | Path, array: np.ndarray) -> None:
    """Write one ``BlobProto`` file (a mean file is N x C x H x W with N = 1)."""
    Path(path).write_bytes(fill_blob(BlobProto(), array).SerializeToString())
