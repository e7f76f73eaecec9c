"""DenseNet-121 (bench/nets/densenet121): its pooling shapes are Caffe's, and it runs.

pool1 pools with the Caffe fork's ``ceil_mode: false``: 112 -> 56, where Caffe's default
rounding up would give 57.  Every pooling layer's output is checked against Caffe's own rule,
computed here from the layer's kernel, stride and pad (BVLC/caffe
src/caffe/layers/pooling_layer.cpp, LayerSetUp, commit 0323844, lines 66-75): rounded up
(down under ``ceil_mode: false``), then, when the layer pads, a last window starting at or
past the input plus its padding is cut.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import numpy as np
import pytest

from farm.engines.autoselect import load_engine
from farm.engines.engine import BackendUnavailable
from farm.modelrepo.caffe_net import Network
from farm.modelrepo.repository import load_spec, prepare

FOLDER = Path(__file__).resolve().parents[2] / "bench" / "nets" / "densenet121"


def caffe_pooled(size: int, kernel: int, stride: int, pad: int, ceil: bool) -> int:
    """Caffe's pooling output size along one axis."""
    steps = (size + 2 * pad - kernel) / stride
    out = (math.ceil(steps) if ceil else math.floor(steps)) + 1
    if pad and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def expected_pool_shape(layer, bottom: tuple[int, ...]) -> tuple[int, ...]:
    p = layer.param.pooling_param
    n, c, h, w = bottom
    if p.global_pooling:
        return n, c, 1, 1
    ceil = p.ceil_mode and p.round_mode == 0  # CEIL is round_mode 0, Caffe's default
    stride = p.stride or 1
    return n, c, *(caffe_pooled(size, p.kernel_size, stride, p.pad, ceil) for size in (h, w))


def test_every_pooling_layer_has_caffes_shape_and_no_field_is_unknown(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        net = Network.load(FOLDER / "deploy.prototxt")
    assert not [r for r in caplog.records if "ignoring fields" in r.getMessage()]
    pools = [layer for layer in net.layers if layer.type == "Pooling"]
    assert [layer.name for layer in pools] == ["pool1", "pool2", "pool3", "pool4", "pool5"]
    for layer in pools:
        assert net.shapes[layer.tops[0]] == expected_pool_shape(
            layer, net.shapes[layer.bottoms[0]]
        ), layer.name
    assert not pools[0].param.pooling_param.ceil_mode
    assert net.shapes["conv1"] == (1, 64, 112, 112)
    assert net.shapes["pool1"] == (1, 64, 56, 56)  # rounded up it would be 57
    assert [net.shapes[f"pool{i}"][1:] for i in range(2, 6)] == [
        (128, 28, 28),
        (256, 14, 14),
        (512, 7, 7),
        (1024, 1, 1),
    ]
    assert net.shapes["fc6"] == (1, 1000, 1, 1)


def test_round_mode_floor_reads_as_ceil_mode_false(tmp_path) -> None:
    """shicai/DenseNet-Caffe's 121 file at ba9e0fc says BVLC's ``round_mode: FLOOR`` where its
    other nets say ``ceil_mode: false``: the same shapes either way."""
    text = (FOLDER / "deploy.prototxt").read_text()
    assert text.count("ceil_mode: false") == 1
    bvlc = tmp_path / "deploy.prototxt"
    bvlc.write_text(text.replace("ceil_mode: false", "round_mode: FLOOR"))
    assert Network.load(bvlc).shapes == Network.load(FOLDER / "deploy.prototxt").shapes


def test_densenet_runs_on_onnxruntime_and_opencv_alike_with_seeded_weights() -> None:
    spec = load_spec(FOLDER)
    started = time.monotonic()
    prepare(spec)
    try:
        engines = [load_engine(spec, backend) for backend in ("onnxruntime", "opencv")]
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    image = np.random.default_rng(0).integers(0, 256, (1, 224, 224, 3), dtype=np.uint8)
    onnx, opencv = (engine.run(image).reshape(-1) for engine in engines)
    assert onnx.size == 1000 and np.isfinite(onnx).all() and np.abs(onnx).max() > 0.01
    np.testing.assert_allclose(opencv, onnx, atol=1e-5)
    assert time.monotonic() - started < 30  # about 2 s on the 2-core test machine
