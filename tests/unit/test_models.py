"""Caffe models: file formats, the layer set on every backend, preprocessing, load-time errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest

from farm.engines.autoselect import load_engine
from farm.engines.engine import BackendUnavailable, engine_class
from farm.engines.modelcheck import check_inputs, check_model
from farm.engines.preprocess import Transformer
from farm.engines.tolerances import TOLERANCE
from farm.modelrepo import caffe_proto
from farm.modelrepo.caffe_net import Network, generated_weights
from farm.modelrepo.repository import ModelError, find, load_spec
from tests.conftest import available_bundled

#: The models shipped in farm/models (not the user's nor $FARM_MODELS').
BUNDLED = sorted(available_bundled())

#: Every supported layer type in one small net (two branches, so Concat and Eltwise have
#: something to join), with the parameters that change what a backend must compute.
EVERY_LAYER = """
name: "every_layer"
layer { name: "data" type: "Input" top: "data"
        input_param { shape: { dim: 4 dim: 4 dim: 17 dim: 17 } } }
layer { name: "conv_g" type: "Convolution" bottom: "data" top: "conv_g"
        convolution_param { num_output: 8 kernel_size: 3 pad: 2 stride: 2 dilation: 2
                            group: 2 } }
layer { name: "bn" type: "BatchNorm" bottom: "conv_g" top: "conv_g" }
layer { name: "scale" type: "Scale" bottom: "conv_g" top: "conv_g"
        scale_param { bias_term: true } }
layer { name: "leaky" type: "ReLU" bottom: "conv_g" top: "conv_g"
        relu_param { negative_slope: 0.1 } }
layer { name: "lrn_across" type: "LRN" bottom: "conv_g" top: "lrn_across"
        lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 } }
layer { name: "lrn_within" type: "LRN" bottom: "conv_g" top: "lrn_within"
        lrn_param { local_size: 3 alpha: 0.3 beta: 0.6 norm_region: WITHIN_CHANNEL } }
layer { name: "sum" type: "Eltwise" bottom: "lrn_across" bottom: "lrn_within" top: "sum"
        eltwise_param { operation: SUM coeff: 0.5 coeff: -2 } }
layer { name: "prod" type: "Eltwise" bottom: "lrn_across" bottom: "sum" top: "prod"
        eltwise_param { operation: PROD } }
layer { name: "max" type: "Eltwise" bottom: "prod" bottom: "sum" top: "max"
        eltwise_param { operation: MAX } }
layer { name: "sig" type: "Sigmoid" bottom: "max" top: "sig" }
layer { name: "tanh" type: "TanH" bottom: "sum" top: "tanh" }
layer { name: "cat" type: "Concat" bottom: "sig" bottom: "tanh" top: "cat"
        concat_param { axis: 1 } }
layer { name: "pool_max" type: "Pooling" bottom: "cat" top: "pool_max"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "pool_ave" type: "Pooling" bottom: "pool_max" top: "pool_ave"
        pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "conv_1x1" type: "Convolution" bottom: "pool_ave" top: "conv_1x1"
        convolution_param { num_output: 6 kernel_h: 1 kernel_w: 2 bias_term: false } }
layer { name: "pool_global" type: "Pooling" bottom: "conv_1x1" top: "pool_global"
        pooling_param { pool: AVE global_pooling: true } }
layer { name: "flat" type: "Flatten" bottom: "pool_global" top: "flat" }
layer { name: "drop" type: "Dropout" bottom: "flat" top: "flat" }
layer { name: "ip" type: "InnerProduct" bottom: "flat" top: "ip"
        inner_product_param { num_output: 5 } }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
"""


def write_model(folder: Path, prototxt: str, layers=None, seed: int = 3, config: str = "") -> Path:
    """A model folder: the prototxt, seeded weights (BatchNorm/Scale made non-trivial),
    model.toml."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "deploy.prototxt").write_text(prototxt)
    if layers is None:
        net = Network.load(folder / "deploy.prototxt")
        rng = np.random.default_rng(seed)
        layers = []
        for name, kind, blobs in generated_weights(net, seed):
            if kind in ("BatchNorm", "Scale"):
                blobs = [rng.uniform(0.5, 1.5, b.shape).astype(np.float32) for b in blobs]
            layers.append((name, kind, blobs))
    caffe_proto.write_caffemodel(folder / "weights.caffemodel", "test", layers)
    (folder / "model.toml").write_text(
        f'prototxt = "deploy.prototxt"\nweights = "weights.caffemodel"\n{config}'
    )
    return folder


def inline_net(body: str, shape: str = "dim: 2 dim: 3") -> str:
    """A prototxt: an Input layer of ``shape``, then ``body``."""
    return (
        f'layer {{ name: "data" type: "Input" top: "data" input_param {{ shape: {{ {shape} '
        f"}} }} }}\n{body}"
    )


def torch_available() -> bool:
    try:
        engine_class("torch")
        return True
    except BackendUnavailable:
        return False


needs_torch = pytest.mark.skipif(not torch_available(), reason="torch is not installed")


@needs_torch
@pytest.mark.parametrize("name", BUNDLED)
def test_every_bundled_model_agrees_on_opencv_and_torch(name) -> None:
    spec = find(name)
    inputs = check_inputs(spec, count=4)
    opencv, torch = check_model(spec, inputs, ("opencv", "torch"))
    assert opencv.problem is None and torch.problem is None
    assert opencv.outputs.shape == (4, *Network.load(spec.prototxt).shapes[spec.output][1:])
    np.testing.assert_allclose(torch.outputs, opencv.outputs, rtol=0, atol=TOLERANCE)
    assert opencv.outputs.std() > 1e-3, "outputs too flat to tell the backends apart"


@needs_torch
def test_every_supported_layer_agrees_on_opencv_and_torch(tmp_path) -> None:
    spec = load_spec(write_model(tmp_path / "every_layer", EVERY_LAYER))
    types = {layer.type for layer in Network.load(spec.prototxt).layers}
    assert types == {
        "Convolution",
        "Pooling",
        "InnerProduct",
        "ReLU",
        "Sigmoid",
        "TanH",
        "Softmax",
        "LRN",
        "Dropout",
        "BatchNorm",
        "Scale",
        "Concat",
        "Eltwise",
        "Flatten",
    }
    inputs = np.random.default_rng(0).normal(0, 2, (6, 4, 17, 17)).astype(np.float32)
    opencv, torch = check_model(spec, inputs, ("opencv", "torch"))
    np.testing.assert_allclose(torch.outputs, opencv.outputs, rtol=0, atol=TOLERANCE)
    assert opencv.outputs.std() > 1e-2


def caffe_lrn(x: np.ndarray, size: int, alpha: float, beta: float, k: float) -> np.ndarray:
    """Caffe's LRN across channels, written out: x / (k + alpha/size * window sum of x^2)^beta."""
    before = (size - 1) // 2
    padded = np.pad(x * x, ((0, 0), (before, size - 1 - before), (0, 0), (0, 0)))
    window = sum(padded[:, i : i + x.shape[1]] for i in range(size))
    return x / (k + alpha / size * window) ** beta


@needs_torch
def test_lrn_k_is_honoured_by_torch_and_refused_by_opencv(tmp_path) -> None:
    """OpenCV's importer drops LRN's k; the opencv backend says so instead of answering wrong."""
    prototxt = inline_net(
        'layer { name: "norm" type: "LRN" bottom: "data" top: "norm" '
        "lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 k: 2 } }\n",
        "dim: 2 dim: 8 dim: 5 dim: 5",
    )
    spec = load_spec(write_model(tmp_path / "lrn", prototxt, layers=[]))
    x = np.random.default_rng(0).normal(0, 2, (2, 8, 5, 5)).astype(np.float32)
    np.testing.assert_allclose(
        load_engine(spec, "torch").run(x), caffe_lrn(x, 3, 0.5, 0.75, 2.0), rtol=1e-5
    )
    with pytest.raises(ModelError, match="layer 'norm' is an LRN with k = 2.*another backend"):
        load_engine(spec, "opencv")


def test_caffemodel_round_trips_bit_exact_and_opencv_reads_it(tmp_path, lenet, digits) -> None:
    original = caffe_proto.read_caffemodel(lenet.weights)
    layers = [
        (name, "Convolution" if name.startswith("conv") else "InnerProduct", blobs)
        for name, blobs in original.items()
    ]
    copy = tmp_path / "copy.caffemodel"
    caffe_proto.write_caffemodel(copy, "LeNet", layers)
    again = caffe_proto.read_caffemodel(copy)
    for name, blobs in original.items():
        for before, after in zip(blobs, again[name]):
            assert before.shape == after.shape
            assert before.view(np.uint32).tobytes() == after.view(np.uint32).tobytes()
    caffe_proto.write_caffemodel(
        tmp_path / "twice.caffemodel", "LeNet", [(n, k, again[n]) for n, k, _ in layers]
    )
    assert (tmp_path / "twice.caffemodel").read_bytes() == copy.read_bytes()
    net = cv2.dnn.readNetFromCaffe(str(lenet.prototxt), str(copy))
    net.setInput(digits[:8, None].astype(np.float32) * lenet.input_scale)
    reference = load_engine(lenet, "opencv").run(digits[:8, None])
    np.testing.assert_array_equal(net.forward(), reference)


def test_upstream_field_numbers() -> None:
    """Field numbers as in BVLC caffe.proto: what makes our files real Caffe files."""
    net = caffe_proto.NetParameter.DESCRIPTOR.fields_by_name
    assert (
        net["name"].number,
        net["layer"].number,
        net["layers"].number,
        net["input_dim"].number,
    ) == (1, 100, 2, 4)
    layer = net["layer"].message_type.fields_by_name
    assert {
        name: layer[name].number
        for name in (
            "name",
            "type",
            "bottom",
            "top",
            "blobs",
            "convolution_param",
            "pooling_param",
            "inner_product_param",
            "lrn_param",
            "batch_norm_param",
            "scale_param",
            "input_param",
        )
    } == {
        "name": 1,
        "type": 2,
        "bottom": 3,
        "top": 4,
        "blobs": 7,
        "convolution_param": 106,
        "pooling_param": 121,
        "inner_product_param": 117,
        "lrn_param": 118,
        "batch_norm_param": 139,
        "scale_param": 142,
        "input_param": 143,
    }
    blob = layer["blobs"].message_type.fields_by_name
    assert (blob["data"].number, blob["shape"].number, blob["num"].number) == (5, 7, 1)
    v1 = net["layers"].message_type.fields_by_name
    assert (
        v1["name"].number,
        v1["type"].number,
        v1["blobs"].number,
        v1["convolution_param"].number,
    ) == (4, 5, 6, 10)


V1_PROTOTXT = """
name: "old"
input: "data"
input_dim: 2 input_dim: 1 input_dim: 8 input_dim: 8
layers { name: "conv" type: CONVOLUTION bottom: "data" top: "conv"
         blobs_lr: 1 convolution_param { num_output: 3 kernel_size: 3 engine: CAFFE } }
layers { name: "relu" type: RELU bottom: "conv" top: "conv" }
layers { name: "pool" type: POOLING bottom: "conv" top: "pool"
         pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layers { name: "fc" type: INNER_PRODUCT bottom: "pool" top: "fc"
         inner_product_param { num_output: 4 } }
layers { name: "prob" type: SOFTMAX bottom: "fc" top: "prob" }
"""


def write_v1_caffemodel(path: Path, rng: np.random.Generator) -> None:
    """The old V1 form, with the legacy 4-D num/channels/height/width blob dimensions."""
    net = caffe_proto.NetParameter(name="old")
    for name, kind, shape in (("conv", 4, (3, 1, 3, 3)), ("fc", 14, (1, 1, 4, 27))):
        layer = net.layers.add(name=name, type=kind)
        for dims in (shape, (1, 1, 1, shape[0] if kind == 4 else shape[2])):
            blob = layer.blobs.add(num=dims[0], channels=dims[1], height=dims[2], width=dims[3])
            blob.data.append(rng.normal(0, 1, dims).astype("<f4").tobytes())
    path.write_bytes(net.SerializeToString())


@needs_torch
def test_v1_prototxt_and_caffemodel_are_upgraded(tmp_path) -> None:
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "deploy.prototxt").write_text(V1_PROTOTXT)
    write_v1_caffemodel(folder / "weights.caffemodel", np.random.default_rng(4))
    (folder / "model.toml").write_text(
        'prototxt = "deploy.prototxt"\nweights = "weights.caffemodel"\n'
    )
    net = Network.load(folder / "deploy.prototxt", folder / "weights.caffemodel")
    assert [(layer.name, layer.type) for layer in net.layers] == [
        ("conv", "Convolution"),
        ("relu", "ReLU"),
        ("pool", "Pooling"),
        ("fc", "InnerProduct"),
        ("prob", "Softmax"),
    ]
    assert net.layers[3].blobs[0].shape == (4, 27)  # legacy (1, 1, 4, 27) reshaped
    spec = load_spec(folder)
    inputs = np.random.default_rng(5).normal(0, 1, (3, 1, 8, 8)).astype(np.float32)
    opencv, torch = check_model(spec, inputs, ("opencv", "torch"))
    np.testing.assert_allclose(torch.outputs, opencv.outputs, rtol=0, atol=TOLERANCE)


def test_transformer_follows_caffe_order(tmp_path) -> None:
    """HWC -> CHW, channel swap, raw scale, mean (file), input scale, in that order."""
    prototxt = inline_net(
        'layer { name: "flat" type: "Flatten" bottom: "data" top: "flat" }\n',
        "dim: 1 dim: 3 dim: 2 dim: 2",
    )
    folder = write_model(
        tmp_path / "t",
        prototxt,
        layers=[],
        config=(
            '[preprocess]\nlayout = "HWC"\nchannel_swap = [2, 1, 0]\nraw_scale = 2.0\n'
            'mean_file = "mean.binaryproto"\ninput_scale = 0.5\n'
        ),
    )
    mean = np.arange(12, dtype=np.float32).reshape(1, 3, 2, 2)
    caffe_proto.write_blobproto(folder / "mean.binaryproto", mean)
    spec = load_spec(folder)
    assert spec.item_shape == (2, 2, 3)
    images = np.random.default_rng(0).integers(0, 256, (5, 2, 2, 3), dtype=np.uint8)
    expected = (images.transpose(0, 3, 1, 2)[:, ::-1] * 2.0 - mean[0]) * 0.5
    np.testing.assert_allclose(Transformer.for_model(spec)(images), expected)
    np.testing.assert_allclose(
        load_engine(spec, "opencv").run(images), expected.reshape(5, -1), rtol=1e-6
    )


def test_cifar10_quick_takes_rgb_as_caffe_stored_cifar10() -> None:
    """No channel swap: Caffe trained the net on RGB.  BVLC/caffe
    examples/cifar10/convert_cifar_data.cpp (commit 037b724) reads each record's 3072 bytes
    as they come (read_image, lines 30-36) and stores them unchanged in the datum
    (``datum.set_data(str_buffer, kCIFARImageNBytes)``, line 62); the binary files hold an
    R plane, a G plane, then a B plane, so channel 0 of the LMDB, of the mean image
    ``compute_image_mean`` makes from it and of the net's input is red."""
    spec = find("cifar10_quick")
    transformer = Transformer.for_model(spec)
    assert transformer.channel_swap == ()
    image = np.empty((1, 32, 32, 3), np.uint8)
    image[...] = (200, 100, 50)  # R, G, B
    mean = caffe_proto.read_blobproto(spec.preprocess.mean_file).reshape(3, 32, 32)
    np.testing.assert_allclose(
        transformer(image)[0], np.array([200, 100, 50], np.float32)[:, None, None] - mean
    )
    # the mean image is the bundled sample's, in the same RGB order
    sample = np.load(spec.sample).transpose(0, 3, 1, 2).astype(np.float64)
    np.testing.assert_allclose(mean, sample.mean(axis=0), rtol=1e-6)


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncate", "is not a Caffe NetParameter"),
        ("unknown_layer", "layer 'odd' has type 'Crop', which farm does not support"),
        ("mismatch", "blob 0 has shape (20, 1, 5, 5), the prototxt needs (30, 1, 5, 5)"),
        ("missing_blobs", "layer 'ip2' needs 2 blob(s), the file has 0"),
        ("extra_blob", "layer 'ip2' needs 1 blob(s), the file has 2"),
    ],
)
def test_broken_models_fail_at_load_naming_the_file(tmp_path, lenet, damage, message) -> None:
    folder = break_model(tmp_path / "broken", lenet.folder, damage)
    with pytest.raises(ModelError) as error:
        load_engine(load_spec(folder), "opencv")
    assert message in str(error.value)
    named = "weights.caffemodel" if damage != "unknown_layer" else "deploy.prototxt"
    assert str(folder / named) in str(error.value)


def break_model(folder: Path, source: Path, damage: str) -> Path:
    """A copy of LeNet with one thing wrong (shared with the farm-level tests)."""
    folder.mkdir(parents=True)
    prototxt = (source / "deploy.prototxt").read_text()
    weights = (source / "lenet.caffemodel").read_bytes()
    if damage == "truncate":
        weights = weights[: len(weights) // 2 + 7]
    elif damage == "unknown_layer":
        prototxt += 'layer { name: "odd" type: "Crop" bottom: "prob" top: "odd" }\n'
    elif damage == "mismatch":
        prototxt = prototxt.replace("num_output: 20", "num_output: 30")
    elif damage == "extra_blob":  # Caffe refuses a bias the prototxt does not ask for
        prototxt = prototxt.replace("num_output: 10 }", "num_output: 10 bias_term: false }")
    elif damage == "missing_blobs":
        blobs = caffe_proto.read_caffemodel(source / "lenet.caffemodel")
        del blobs["ip2"]
        caffe_proto.write_caffemodel(
            folder / "weights.caffemodel",
            "LeNet",
            [(name, "InnerProduct", arrays) for name, arrays in blobs.items()],
        )
        weights = (folder / "weights.caffemodel").read_bytes()
    (folder / "deploy.prototxt").write_text(prototxt)
    (folder / "weights.caffemodel").write_bytes(weights)
    shutil.copy(source / "model.toml", folder / "model.toml")
    text = (folder / "model.toml").read_text().replace('"lenet.caffemodel"', '"weights.caffemodel"')
    (folder / "model.toml").write_text(text)
    return folder


def test_a_large_chunk_shrinks_the_net_back(lenet, digits) -> None:
    engine = load_engine(lenet, "opencv", batch=500)
    outputs = engine.run(digits[:, None])
    assert engine.grown and engine.allocated == 500
    engine.rest()
    assert not engine.grown and engine.allocated == lenet.batch == 64  # the prototxt's batch
    np.testing.assert_allclose(
        outputs, load_engine(lenet, "opencv").run(digits[:, None]), atol=1e-6
    )
    np.testing.assert_allclose(engine.run(digits[:, None]), outputs, atol=1e-6)
    small = load_engine(lenet, "opencv", batch=32)
    small.run(digits[:100, None])
    assert not small.grown  # never above the resting batch: nothing to shrink


def test_missing_caffe_backend_says_how_to_install() -> None:
    try:
        import caffe  # noqa: F401

        pytest.skip("pycaffe is installed here")
    except ImportError:
        pass
    with pytest.raises(BackendUnavailable, match="apt-get install python3-caffe-cpu"):
        engine_class("caffe")


@needs_torch
def test_pooling_round_mode_floor(tmp_path) -> None:
    """BVLC's round_mode: FLOOR drops the partial last window that CEIL (the default) keeps."""
    prototxt = inline_net(
        'layer { name: "pool" type: "Pooling" bottom: "data" top: "pool" '
        "pooling_param { pool: MAX kernel_size: 3 stride: 2 "
        "round_mode: FLOOR } }\n",
        "dim: 1 dim: 1 dim: 6 dim: 6",
    )
    spec = load_spec(write_model(tmp_path / "floor", prototxt, layers=[]))
    assert Network.load(spec.prototxt).shapes["pool"] == (1, 1, 2, 2)
    x = np.arange(36, dtype=np.float32).reshape(1, 1, 6, 6)
    np.testing.assert_array_equal(load_engine(spec, "torch").run(x), [[[[14, 16], [26, 28]]]])
    with pytest.raises(ModelError, match="round_mode FLOOR"):
        load_engine(spec, "opencv")
    (tmp_path / "floor" / "deploy.prototxt").write_text(prototxt.replace(" round_mode: FLOOR", ""))
    assert Network.load(spec.prototxt).shapes["pool"] == (1, 1, 3, 3)


WILD_PROTOTXT = """
name: "wild"
input: "data"
input_shape { dim: 1 dim: 1 dim: 28 dim: 28 }
force_backward: true
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        convolution_param { num_output: 20 kernel_size: 5 engine: CUDNN
                            weight_filler { type: "gaussian" std: 0.01 } }
        some_fork_only_field { with_a: "message" } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 50 kernel_size: 5 } }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1"
        inner_product_param { num_output: 500 } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" relu_param { engine: CAFFE } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 10 } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip2" bottom: "label" top: "accuracy"
        include { phase: TRAIN } }
layer { name: "prob" type: "Softmax" bottom: "ip2" top: "prob" }
"""


def test_prototxts_from_the_wild_load(tmp_path, lenet, digits, caplog) -> None:
    """Legacy input_shape, fields this subset lacks, a TRAIN-only layer: LeNet's outputs."""
    folder = tmp_path / "wild"
    folder.mkdir()
    (folder / "deploy.prototxt").write_text(WILD_PROTOTXT)
    shutil.copy(lenet.weights, folder / "weights.caffemodel")
    (folder / "model.toml").write_text(
        'prototxt = "deploy.prototxt"\nweights = '
        '"weights.caffemodel"\n[preprocess]\n'
        "input_scale = 0.00390625\n"
    )
    spec = load_spec(folder)
    assert (spec.input, spec.input_shape, spec.batch, spec.output) == (
        "data",
        (1, 28, 28),
        1,
        "prob",
    )
    warned = [r.message for r in caplog.records if "ignoring fields" in r.getMessage()]
    assert warned and "some_fork_only_field" in caplog.text and "lr_mult" not in caplog.text
    np.testing.assert_allclose(
        load_engine(spec, "opencv").run(digits[:20, None]),
        load_engine(lenet, "opencv").run(digits[:20, None]),
        atol=1e-6,
    )


def test_the_output_blob_is_taken_after_its_last_in_place_layer(tmp_path) -> None:
    """A net ending in fc, then ReLU in place on fc: the output is the rectified fc, as in Caffe."""
    prototxt = inline_net(
        'layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc" '
        "inner_product_param { num_output: 3 } }\n"
        'layer { name: "relu" type: "ReLU" bottom: "fc" top: "fc" }\n'
    )
    weight = np.array([[1, 0, 0], [-1, 0, 0], [0, 0, 2]], np.float32)
    bias = np.zeros(3, np.float32)
    spec = load_spec(
        write_model(tmp_path / "relu", prototxt, [("fc", "InnerProduct", [weight, bias])])
    )
    x = np.array([[1, 5, 1], [-2, 0, -1]], np.float32)
    expected = np.maximum(x @ weight.T, 0)
    for backend in ("opencv", "torch") if torch_available() else ("opencv",):
        np.testing.assert_allclose(load_engine(spec, backend).run(x), expected, atol=1e-6)


def test_a_pooling_window_past_the_input_is_refused(tmp_path) -> None:
    prototxt = inline_net(
        'layer { name: "pool" type: "Pooling" bottom: "data" top: "pool" '
        "pooling_param { pool: MAX kernel_size: 1 stride: 2 } }\n",
        "dim: 1 dim: 1 dim: 6 dim: 6",
    )
    (tmp_path / "deploy.prototxt").write_text(prototxt)
    with pytest.raises(Exception, match="would start past the input of size 6"):
        Network.load(tmp_path / "deploy.prototxt")


@pytest.mark.parametrize("key", ["prototxt", "weights"])
def test_model_files_must_stay_inside_the_model_folder(tmp_path, lenet, key) -> None:
    folder = write_model(tmp_path / "m", (lenet.folder / "deploy.prototxt").read_text(), layers=[])
    config = (folder / "model.toml").read_text()
    target = '"../../etc/passwd"' if key == "weights" else f'"{lenet.prototxt}"'
    (folder / "model.toml").write_text(
        config.replace('"deploy.prototxt"' if key == "prototxt" else '"weights.caffemodel"', target)
    )
    with pytest.raises(ModelError, match="is outside the model folder"):
        load_spec(folder)


def flatten_model(folder: Path, shape: str, config: str) -> Path:
    """A net that only flattens its input: its output is the preprocessed image itself."""
    prototxt = inline_net(
        'layer { name: "flat" type: "Flatten" bottom: "data" top: "flat" }\n', shape
    )
    return write_model(folder, prototxt, layers=[], config=config)


@pytest.mark.parametrize("kind", ["binaryproto", "npy"])
def test_a_larger_mean_file_is_centre_cropped_as_caffe_does(tmp_path, kind) -> None:
    """ImageNet's 3 x 256 x 256 mean on a 227 x 227 net: the middle 227 x 227, as Caffe's data
    layer and classify.py take it; pycaffe's ilsvrc_2012_mean.npy is float64 (3, 256, 256)."""
    mean = np.random.default_rng(1).uniform(0, 255, (3, 256, 256))
    name = f"mean.{kind}"
    folder = flatten_model(
        tmp_path / "m", "dim: 1 dim: 3 dim: 227 dim: 227", f'[preprocess]\nmean_file = "{name}"\n'
    )
    if kind == "npy":
        np.save(folder / name, mean)
    else:
        caffe_proto.write_blobproto(folder / name, mean[None].astype(np.float32))
    images = np.random.default_rng(2).integers(0, 256, (2, 3, 227, 227), dtype=np.uint8)
    expected = images - mean[:, 14:241, 14:241].astype(np.float32)  # (256 - 227) // 2 = 14
    np.testing.assert_allclose(
        Transformer.for_model(load_spec(folder))(images), expected, rtol=1e-6
    )


@pytest.mark.parametrize("shape", [(3,), (3, 1, 1)])
def test_a_npy_mean_of_channel_values_is_a_per_channel_mean(tmp_path, shape) -> None:
    folder = flatten_model(
        tmp_path / "m",
        "dim: 1 dim: 3 dim: 4 dim: 4",
        '[preprocess]\nmean_file = "mean.binaryproto"\n',
    )
    np.save(folder / "mean.npy", np.array([1.0, 2.0, 3.0]).reshape(shape))
    (folder / "mean.npy").rename(folder / "mean.binaryproto")  # read by content, not suffix
    images = np.full((1, 3, 4, 4), 10, np.uint8)
    np.testing.assert_array_equal(
        Transformer.for_model(load_spec(folder))(images)[0, :, 0, 0], [9, 8, 7]
    )


def test_a_smaller_mean_file_is_refused(tmp_path) -> None:
    folder = flatten_model(
        tmp_path / "m", "dim: 1 dim: 3 dim: 8 dim: 8", '[preprocess]\nmean_file = "mean.npy"\n'
    )
    np.save(folder / "mean.npy", np.zeros((3, 6, 8)))
    with pytest.raises(
        ModelError,
        match=r"has shape \(3, 6, 8\); the input \(3, 8, 8\) needs "
        r"3 x H x W with H >= 8 and W >= 8",
    ):
        Transformer.for_model(load_spec(folder))


def test_model_toml_gives_an_input_without_a_shape_its_shape(tmp_path, lenet, digits) -> None:
    """A prototxt naming its input without dimensions loads with input_shape = [C, H, W]."""
    folder = Path(shutil.copytree(lenet.folder, tmp_path / "bare"))
    text = (folder / "deploy.prototxt").read_text()
    start = text.index("layer {", text.index('type: "Input"'))
    (folder / "deploy.prototxt").write_text('input: "data"\n' + text[start:])  # no dimensions
    with pytest.raises(ModelError, match="input_shape"):
        load_spec(folder)
    config = folder / "model.toml"
    config.write_text("input_shape = [1, 28, 28]\n" + config.read_text())
    spec = load_spec(folder)
    assert spec.input_shape == (1, 28, 28) and spec.batch == 1
    np.testing.assert_allclose(
        load_engine(spec, "opencv").run(digits[:5, None]),
        load_engine(lenet, "opencv").run(digits[:5, None]),
        atol=1e-6,
    )
