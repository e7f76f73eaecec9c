"""Caffe model files written by our schema subset are read back by us and by OpenCV."""

from __future__ import annotations

import cv2
import numpy as np

from farm.caffe_proto import NetParameter, read_caffemodel, write_caffemodel

PROTOTXT = """
name: "tiny"
layer { name: "data" type: "Input" top: "data" input_param { shape: { dim: 1 dim: 3 } } }
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc"
        inner_product_param { num_output: 2 } }
"""


def test_written_caffemodel_round_trips_and_opencv_runs_it(tmp_path) -> None:
    weight = np.array([[1, 2, 3], [-1, 0, 0.5]], np.float32)
    bias = np.array([0.25, -0.5], np.float32)
    model, prototxt = tmp_path / "tiny.caffemodel", tmp_path / "deploy.prototxt"
    prototxt.write_text(PROTOTXT)
    write_caffemodel(str(model), "tiny", [("fc", "InnerProduct", [weight, bias])])
    blobs = read_caffemodel(str(model))
    np.testing.assert_array_equal(blobs["fc"][0], weight)
    np.testing.assert_array_equal(blobs["fc"][1], bias)
    net = cv2.dnn.readNetFromCaffe(str(prototxt), str(model))
    x = np.array([[1.0, 2.0, -1.0]], np.float32)
    net.setInput(x)
    np.testing.assert_allclose(net.forward(), x @ weight.T + bias, rtol=1e-6)


def test_upstream_field_numbers() -> None:
    """NetParameter.layer is 100, LayerParameter.blobs 7, BlobProto.data 5, shape 7 (caffe.proto)."""
    fields = NetParameter.DESCRIPTOR.fields_by_name
    assert fields["name"].number == 1 and fields["layer"].number == 100
    layer = fields["layer"].message_type.fields_by_name
    assert (layer["name"].number, layer["type"].number, layer["blobs"].number) == (1, 2, 7)
    blob = layer["blobs"].message_type.fields_by_name
    assert (blob["data"].number, blob["shape"].number) == (5, 7)


def test_bundled_lenet_has_caffe_shapes(lenet) -> None:
    blobs = read_caffemodel(str(lenet.weights))
    assert {name: blobs[name][0].shape for name in blobs} == {
        "conv1": (20, 1, 5, 5), "conv2": (50, 20, 5, 5), "ip1": (500, 800), "ip2": (10, 500)}
