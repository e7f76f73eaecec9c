"""A subset of Caffe's ``caffe.proto`` schema, built in Python with upstream field numbers.

The descriptors are built at import time from a ``FileDescriptorProto``, so no
``protoc``-generated module (and no tie to one protobuf major version) is
involved.  Files written with these messages are ordinary Caffe
``NetParameter`` binaries: real Caffe and OpenCV's importer read them.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto

#: message name -> [(field name, number, type, label, type name or None, packed)]
_MESSAGES = {
    "BlobShape": [("dim", 1, _F.TYPE_INT64, _F.LABEL_REPEATED, None, True)],
    "BlobProto": [
        ("num", 1, _F.TYPE_INT32, _F.LABEL_OPTIONAL, None, False),
        ("channels", 2, _F.TYPE_INT32, _F.LABEL_OPTIONAL, None, False),
        ("height", 3, _F.TYPE_INT32, _F.LABEL_OPTIONAL, None, False),
        ("width", 4, _F.TYPE_INT32, _F.LABEL_OPTIONAL, None, False),
        ("data", 5, _F.TYPE_FLOAT, _F.LABEL_REPEATED, None, True),
        ("diff", 6, _F.TYPE_FLOAT, _F.LABEL_REPEATED, None, True),
        ("shape", 7, _F.TYPE_MESSAGE, _F.LABEL_OPTIONAL, ".caffe.BlobShape", False),
        ("double_data", 8, _F.TYPE_DOUBLE, _F.LABEL_REPEATED, None, True),
    ],
    "LayerParameter": [
        ("name", 1, _F.TYPE_STRING, _F.LABEL_OPTIONAL, None, False),
        ("type", 2, _F.TYPE_STRING, _F.LABEL_OPTIONAL, None, False),
        ("bottom", 3, _F.TYPE_STRING, _F.LABEL_REPEATED, None, False),
        ("top", 4, _F.TYPE_STRING, _F.LABEL_REPEATED, None, False),
        ("blobs", 7, _F.TYPE_MESSAGE, _F.LABEL_REPEATED, ".caffe.BlobProto", False),
    ],
    "NetParameter": [
        ("name", 1, _F.TYPE_STRING, _F.LABEL_OPTIONAL, None, False),
        ("input", 3, _F.TYPE_STRING, _F.LABEL_REPEATED, None, False),
        ("input_dim", 4, _F.TYPE_INT32, _F.LABEL_REPEATED, None, False),
        ("input_shape", 8, _F.TYPE_MESSAGE, _F.LABEL_REPEATED, ".caffe.BlobShape", False),
        ("layer", 100, _F.TYPE_MESSAGE, _F.LABEL_REPEATED, ".caffe.LayerParameter", False),
    ],
}


def _build_classes() -> dict[str, type]:
    file_proto = descriptor_pb2.FileDescriptorProto(
        name="farm_caffe_subset.proto", package="caffe", syntax="proto2")
    for message_name, fields in _MESSAGES.items():
        message = file_proto.message_type.add(name=message_name)
        for name, number, kind, label, type_name, packed in fields:
            field = message.field.add(name=name, number=number, type=kind, label=label)
            if type_name:
                field.type_name = type_name
            if packed:
                field.options.packed = True
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_proto)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"caffe.{name}"))
            for name in _MESSAGES}


_CLASSES = _build_classes()
NetParameter = _CLASSES["NetParameter"]
LayerParameter = _CLASSES["LayerParameter"]
BlobProto = _CLASSES["BlobProto"]


def write_caffemodel(path: str, net_name: str,
                     layers: Iterable[tuple[str, str, list[np.ndarray]]]) -> None:
    """Write a binary ``.caffemodel`` from ``(layer name, layer type, [blobs])``."""
    net = NetParameter(name=net_name)
    for name, kind, blobs in layers:
        layer = net.layer.add(name=name, type=kind)
        for array in blobs:
            blob = layer.blobs.add()
            blob.shape.dim.extend(int(d) for d in array.shape)
            blob.data.extend(np.asarray(array, dtype=np.float32).ravel().tolist())
    with open(path, "wb") as handle:
        handle.write(net.SerializeToString())


def read_caffemodel(path: str) -> dict[str, list[np.ndarray]]:
    """Blobs of a binary ``.caffemodel`` by layer name (new-style ``layer`` field)."""
    net = NetParameter()
    with open(path, "rb") as handle:
        net.ParseFromString(handle.read())
    weights = {}
    for layer in net.layer:
        arrays = []
        for blob in layer.blobs:
            shape = list(blob.shape.dim) or [d for d in (blob.num, blob.channels, blob.height,
                                                          blob.width) if d]
            arrays.append(np.asarray(blob.data, dtype=np.float32).reshape(shape))
        if arrays:
            weights[layer.name] = arrays
    return weights
