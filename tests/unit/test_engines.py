"""ONNX Runtime and OpenVINO through farm's own ONNX export, and ``--backend auto``."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import openvino
import pytest

from farm.benchsuite.common import shared_squeezenet
from farm.engines import autoselect
from farm.engines.autoselect import Choice, choose, load_engine
from farm.engines.engine import PRECISIONS, Engine, onnx_path
from farm.engines.modelcheck import check_inputs, check_model
from farm.engines.onnx_export import FORMAT, export, save
from farm.engines.tolerances import TOLERANCE, relative_difference
from farm.modelrepo import caffe_proto
from farm.modelrepo.caffe_net import Network, NetworkError
from farm.modelrepo.repository import ModelError, ModelSpec, find, load_spec, prepare
from tests.conftest import available_bundled
from tests.unit.test_models import EVERY_LAYER, inline_net, needs_torch, write_model

#: The models shipped in farm/models (not the user's nor $FARM_MODELS').
BUNDLED = sorted(available_bundled())
ONNX_BACKENDS = ("onnxruntime", "openvino")
#: The shared ImageNet SqueezeNet v1.0 (not in the repository: its weights have no licence).
SQUEEZENET = Path(__file__).resolve().parents[3] / "shared" / "models" / "squeezenet_v1.0"


def assert_agree(checks, reference: str = "opencv") -> None:
    """Every check ran, and each differs from ``reference`` by at most TOLERANCE (relative)."""
    by_name = {check.backend: check for check in checks}
    for check in checks:
        assert check.problem is None, f"{check.backend}: {check.problem}"
        difference = relative_difference(check.outputs, by_name[reference].outputs)
        assert difference <= TOLERANCE, f"{check.backend} differs by {difference:.1e}"


@pytest.mark.parametrize("name", BUNDLED)
def test_every_bundled_model_agrees_on_every_backend(name) -> None:
    spec = find(name)
    checks = check_model(spec, check_inputs(spec, count=4), ("opencv", *ONNX_BACKENDS))
    assert_agree(checks)
    assert checks[0].outputs.std() > 1e-3, "outputs too flat to tell the backends apart"


@needs_torch
def test_every_supported_layer_agrees_on_every_backend(tmp_path) -> None:
    spec = load_spec(write_model(tmp_path / "every_layer", EVERY_LAYER))
    inputs = np.random.default_rng(0).normal(0, 2, (6, 4, 17, 17)).astype(np.float32)
    checks = check_model(spec, inputs, ("opencv", "torch", *ONNX_BACKENDS))
    assert_agree(checks)
    assert checks[0].outputs.std() > 1e-2


#: Layers whose Caffe semantics a reader's defaults get wrong, each beside torch's answer
#: (torch's ops are written from Caffe's formulas; OpenCV refuses or ignores some of these).
SEMANTICS = {
    # pooling's end: average windows that overhang the padded input divide by their part
    # inside it; a last window that would start in the padding is cut
    "ave_pad_ceil": ("pool: AVE kernel_size: 3 stride: 2 pad: 1", "dim: 2 dim: 3 dim: 8 dim: 8"),
    "ave_ceil": ("pool: AVE kernel_size: 3 stride: 2", "dim: 2 dim: 3 dim: 8 dim: 8"),
    "max_pad_cut": ("pool: MAX kernel_size: 2 stride: 2 pad: 1", "dim: 2 dim: 3 dim: 6 dim: 6"),
    "max_floor": (
        "pool: MAX kernel_size: 3 stride: 2 round_mode: FLOOR",
        "dim: 2 dim: 3 dim: 8 dim: 8",
    ),
    "ave_ceil_mode_false": (
        "pool: AVE kernel_size: 3 stride: 2 pad: 1 ceil_mode: false",
        "dim: 2 dim: 3 dim: 8 dim: 8",
    ),
    "global_max": ("pool: MAX global_pooling: true", "dim: 2 dim: 3 dim: 5 dim: 7"),
}


@needs_torch
@pytest.mark.parametrize("case", sorted(SEMANTICS))
def test_pooling_rounds_as_caffe_does_on_every_backend(tmp_path, case) -> None:
    params, shape = SEMANTICS[case]
    prototxt = inline_net(
        f'layer {{ name: "pool" type: "Pooling" bottom: "data" top: "pool" '
        f"pooling_param {{ {params} }} }}\n",
        shape,
    )
    spec = load_spec(write_model(tmp_path / case, prototxt, layers=[]))
    dims = [int(d) for d in shape.replace("dim:", "").split()]
    inputs = np.random.default_rng(1).normal(0, 2, (3, *dims[1:])).astype(np.float32)
    assert_agree(check_model(spec, inputs, ("torch", *ONNX_BACKENDS)), reference="torch")


#: Other layers with parameters an export must carry: (body, input shape).
LAYER_CASES = {
    "ip_transpose": (
        'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
        "inner_product_param { num_output: 5 transpose: true } }",
        "dim: 2 dim: 3 dim: 4 dim: 4",
    ),
    "ip_axis2": (
        'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
        "inner_product_param { num_output: 5 axis: 2 } }",
        "dim: 2 dim: 3 dim: 4 dim: 4",
    ),
    "softmax_axis2": (
        'layer { name: "sm" type: "Softmax" bottom: "data" top: "sm" softmax_param { axis: 2 } }',
        "dim: 2 dim: 3 dim: 4 dim: 4",
    ),
    "flatten_end": (
        'layer { name: "f" type: "Flatten" bottom: "data" top: "f" '
        "flatten_param { axis: 1 end_axis: 2 } }",
        "dim: 2 dim: 3 dim: 4 dim: 4",
    ),
    "scale_axis2_bias": (
        'layer { name: "s" type: "Scale" bottom: "data" top: "s" '
        "scale_param { axis: 2 num_axes: 1 bias_term: true } }",
        "dim: 2 dim: 3 dim: 4 dim: 4",
    ),
    "scale_no_bias": (
        'layer { name: "s" type: "Scale" bottom: "data" top: "s" }',
        "dim: 2 dim: 3 dim: 4 dim: 4",
    ),
    "batchnorm_factor": (
        'layer { name: "bn" type: "BatchNorm" bottom: "data" top: "bn" '
        "batch_norm_param { eps: 0.01 } }",
        "dim: 2 dim: 3 dim: 4 dim: 4",
    ),
    "lrn_k": (
        'layer { name: "n" type: "LRN" bottom: "data" top: "n" '
        "lrn_param { local_size: 5 alpha: 0.01 beta: 0.75 k: 2 } }",
        "dim: 2 dim: 7 dim: 4 dim: 4",
    ),
    "eltwise_three_coeffs": (
        'layer { name: "r" type: "ReLU" bottom: "data" top: "r" }\n'
        'layer { name: "e" type: "Eltwise" bottom: "data" bottom: "r" bottom: "data" top: "e" '
        "eltwise_param { coeff: 2 coeff: -1 coeff: 0.5 } }",
        "dim: 2 dim: 3 dim: 4 dim: 4",
    ),
    "eltwise_prod_three": (
        'layer { name: "r" type: "Sigmoid" bottom: "data" top: "r" }\n'
        'layer { name: "e" type: "Eltwise" bottom: "data" bottom: "r" bottom: "r" top: "e" '
        "eltwise_param { operation: PROD } }",
        "dim: 2 dim: 3 dim: 4 dim: 4",
    ),
    "in_place_chain": (
        'layer { name: "c" type: "Convolution" bottom: "data" top: "c" '
        "convolution_param { num_output: 4 kernel_size: 3 } }\n"
        'layer { name: "r" type: "ReLU" bottom: "c" top: "c" }\n'
        'layer { name: "s" type: "Scale" bottom: "c" top: "c" }\n'
        'layer { name: "t" type: "TanH" bottom: "c" top: "c" }',
        "dim: 2 dim: 3 dim: 6 dim: 6",
    ),
}


@needs_torch
@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_layer_parameters_survive_the_export(tmp_path, case) -> None:
    body, shape = LAYER_CASES[case]
    spec = load_spec(write_model(tmp_path / case, inline_net(body + "\n", shape)))
    dims = [int(d) for d in shape.replace("dim:", "").split()]
    inputs = np.random.default_rng(2).normal(0, 2, (3, *dims[1:])).astype(np.float32)
    checks = check_model(spec, inputs, ("torch", *ONNX_BACKENDS))
    assert_agree(checks, reference="torch")
    assert checks[0].outputs.std() > 1e-3


def test_ceil_mode_false_gives_densenet_its_56x56(tmp_path) -> None:
    """DenseNet-121's stem: 224 -> conv 7x7/2 -> 112 -> max pool 3x3/2 pad 1 with the forks'
    ``ceil_mode: false`` -> 56 (rounding up would give 57)."""
    body = (
        'layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1" '
        "convolution_param { num_output: 2 kernel_size: 7 stride: 2 pad: 3 } }\n"
        'layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" '
        "pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 ceil_mode: false } }\n"
    )
    prototxt = inline_net(body, "dim: 1 dim: 3 dim: 224 dim: 224")
    spec = load_spec(write_model(tmp_path / "stem", prototxt))
    net = Network.load(spec.prototxt)
    assert net.shapes["pool1"] == (1, 2, 56, 56)
    (tmp_path / "stem" / "deploy.prototxt").write_text(prototxt.replace(" ceil_mode: false", ""))
    assert Network.load(spec.prototxt).shapes["pool1"] == (1, 2, 57, 57)
    (tmp_path / "stem" / "deploy.prototxt").write_text(prototxt)
    images = np.random.default_rng(3).integers(0, 255, (2, 3, 224, 224), dtype=np.uint8)
    checks = check_model(spec, images, ("opencv", *ONNX_BACKENDS))
    assert all(check.outputs.shape == (2, 2, 56, 56) for check in checks)
    assert_agree(checks)


def test_export_is_checked_and_runs_alike_in_both_engines(tmp_path, lenet, digits) -> None:
    from click.testing import CliRunner

    from farm.cli import main

    path = tmp_path / "lenet.onnx"
    result = CliRunner().invoke(main, ["models", "export", "lenet", "--onnx", str(path)])
    assert result.exit_code == 0, result.output
    assert "onnx.checker passed" in result.output and "ONNX Runtime against opencv" in result.output
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert [o.name for o in model.graph.output] == ["prob"]  # the blob model.toml names
    batch = digits[:37, None].astype(np.float32) * lenet.input_scale  # any batch size
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    by_ort = session.run(None, {"data": batch})[0]
    core = openvino.Core()
    by_openvino = core.compile_model(
        core.read_model(str(path)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
    )(batch)[0]
    reference = load_engine(lenet, "opencv").run(digits[:37, None])
    assert by_ort.shape == by_openvino.shape == (37, 10)
    assert relative_difference(by_ort, reference) <= TOLERANCE
    assert relative_difference(by_openvino, by_ort) <= TOLERANCE
    assert (by_ort.argmax(1) == reference.argmax(1)).all()


def test_export_of_an_intermediate_blob_and_missing_weights(tmp_path, lenet) -> None:
    net = Network.load(lenet.prototxt, lenet.weights)
    model = export(net, "pool1")
    assert [o.name for o in model.graph.output] == ["pool1"]
    assert [n.op_type for n in model.graph.node] == ["Conv", "MaxPool", "Identity"]
    save(model, tmp_path / "pool1.onnx")
    with pytest.raises(NetworkError, match="'nowhere' is not a blob"):
        export(net, "nowhere")
    with pytest.raises(NetworkError, match="layer 'conv1' has no weights attached"):
        export(Network.load(lenet.prototxt), "prob")


# ------------------------------------------------------- preprocessing folded into the graph


@pytest.fixture(scope="module")
def squeezenet(tmp_path_factory) -> ModelSpec:
    """The shared SqueezeNet v1.0 as a model folder: HWC RGB in, BGR minus channel means."""
    if not (SQUEEZENET / "squeezenet_v1.0.caffemodel").is_file():
        pytest.skip(f"no SqueezeNet v1.0 in {SQUEEZENET}")
    return load_spec(shared_squeezenet(tmp_path_factory.mktemp("models"), SQUEEZENET))


@pytest.fixture(scope="module")
def lenet_scaled(tmp_path_factory) -> ModelSpec:
    """The bundled LeNet with every arithmetic step: raw scale, a mean, the input scale."""
    folder = tmp_path_factory.mktemp("models") / "lenet_scaled"
    shutil.copytree(find("lenet").folder, folder)
    toml = folder / "model.toml"
    toml.write_text(
        toml.read_text().replace(
            "input_scale = 0.00390625", "raw_scale = 0.5\nmean = [3.0]\ninput_scale = 0.0078125"
        )
    )
    return load_spec(folder)


#: The models run with folded preprocessing: the bundled ones and two from fixtures.
FIXTURE_MODELS = ("squeezenet", "lenet_scaled")


def host_path(engine: Engine, images: np.ndarray, transform=None) -> np.ndarray:
    """The outputs by the host's ``Transformer`` (or ``transform``) and the plain export, in
    the engine's compute batches: the path every image took before folding."""
    transform = transform or engine.transform
    return np.concatenate(
        [
            engine.forward(transform(images[begin : begin + engine.batch]))
            for begin in range(0, len(images), engine.batch)
        ]
    )


#: Each preprocessing step, undone: the folded graph must not agree with the host path
#: without it (so a step left out of the graph would fail the comparison).
UNDONE = {"channel_swap": (), "raw_scale": 1.0, "mean": None, "input_scale": 1.0}


def applies(transform, step: str) -> bool:
    """Whether a model's preprocessing has ``step`` (a mean is an array: None when absent)."""
    value = getattr(transform, step)
    return value is not None if step == "mean" else value != UNDONE[step]


@pytest.mark.parametrize("backend", ONNX_BACKENDS)
@pytest.mark.parametrize("name", [*BUNDLED, *FIXTURE_MODELS])
def test_uint8_images_go_into_the_graph_and_agree_with_the_host_path(
    name, backend, request
) -> None:
    """uint8 images go into the folded graph as they are, and its outputs are the host
    path's within the engines' tolerance; undoing any step of the model's preprocessing
    on the host path puts it outside, so the comparison sees every step."""
    spec = request.getfixturevalue(name) if name in FIXTURE_MODELS else find(name)
    prepare(spec)  # generated weights are made, as a worker has them made
    engine = load_engine(spec, backend, batch=4, threads=1)
    sample = check_inputs(spec, 6)
    # and dimmed copies: a confident net's softmax saturates on its sample, where a step
    # left out can change little; on these it changes much
    images = np.concatenate([sample, sample // 16])
    assert images.dtype == np.uint8 and engine.feed(images) is images  # no host copy
    graph = onnx.load(engine.onnx_file(folded=True)).graph
    assert graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.UINT8
    folded = engine.run(images)
    assert relative_difference(folded, host_path(engine, images)) <= TOLERANCE
    steps = [step for step in UNDONE if applies(engine.transform, step)]
    assert steps
    for step in steps:
        undone = replace(engine.transform, **{step: UNDONE[step]})
        difference = relative_difference(folded, host_path(engine, images, undone))
        assert difference > TOLERANCE, f"{name} without its {step} differs by {difference:.1e}"


@pytest.mark.parametrize("backend", ONNX_BACKENDS)
def test_float32_images_keep_the_host_preprocessing_and_the_plain_export(
    backend, tmp_path, monkeypatch
) -> None:
    """float32 pixels are preprocessed on the host and run on the plain export, as before the
    folding; ``prepare`` compiles that graph (a worker does so before it times a chunk), from
    the weights again when the engine was loaded from a cached folded export (no weights)."""
    monkeypatch.setenv("FARM_CACHE", str(tmp_path))
    spec = find("cifar10_quick")  # HWC and a mean file
    load_engine(spec, backend, threads=1)  # caches the folded export
    engine = load_engine(spec, backend, batch=4, threads=1)
    assert engine.network.parameter_count() and not any(
        layer.blobs for layer in engine.network.layers
    )
    images = check_inputs(spec, 6).astype(np.float32)
    assert sorted(engine.graphs) == [True]  # uint8 images' graph, compiled at load
    assert engine.prepare(images.dtype) > 0.0 and sorted(engine.graphs) == [False, True]
    assert engine.prepare(images.dtype) == engine.prepare(np.dtype(np.uint8)) == 0.0
    fed = engine.feed(images)
    assert fed.dtype == np.float32 and fed.shape == (6, *spec.input_shape)
    assert np.array_equal(fed, engine.transform(images))
    outputs = engine.run(images)
    graph = onnx.load(engine.onnx_file(folded=False)).graph
    assert graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert np.array_equal(outputs, host_path(engine, images))
    uint8 = engine.run(images.astype(np.uint8))
    assert relative_difference(outputs, uint8) <= TOLERANCE


def test_exports_are_cached_by_format_and_input(lenet, digits, tmp_path, monkeypatch) -> None:
    """An export cached by an older farm (plain, format 1) is never read for the folded
    graph; the folded and the plain export are two files, each with its input type."""
    monkeypatch.setenv("FARM_CACHE", str(tmp_path))
    stale = onnx_path(lenet).with_name(onnx_path(lenet).name.replace(f"-v{FORMAT}", "-v1"))
    assert FORMAT > 1 and stale != onnx_path(lenet)
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an export cached before the preprocessing was folded")
    engine = load_engine(lenet, "onnxruntime", threads=1)
    engine.run(digits[:3, None])
    engine.run(digits[:3, None].astype(np.float32))
    inputs = {
        path.name: onnx.load(str(path)).graph.input[0].type.tensor_type.elem_type
        for path in stale.parent.glob("*.onnx")
        if path != stale
    }
    assert inputs == {
        onnx_path(lenet, folded=True).name: onnx.TensorProto.UINT8,
        onnx_path(lenet).name: onnx.TensorProto.FLOAT,
    }
    choice = autoselect.cache_path(lenet, "d" * 64, "cpu", 1, "f32")
    monkeypatch.setattr("farm.engines.onnx_export.FORMAT", FORMAT + 1)
    assert autoselect.cache_path(lenet, "d" * 64, "cpu", 1, "f32") != choice  # timed again


# ------------------------------------------------------------------------------- auto


def test_auto_picks_the_fastest_agreeing_backend_and_remembers(
    lenet, caplog, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("FARM_CACHE", str(tmp_path))  # nothing remembered yet
    caplog.set_level(logging.INFO, "farm.engines.autoselect")
    choice = choose(lenet, threads=1)
    assert not choice.cached and choice.engine.backend == choice.backend
    timed = [trial for trial in choice.trials if trial.rates]
    assert {t.backend for t in timed} >= {"opencv", *ONNX_BACKENDS}
    assert choice.backend == max(timed, key=lambda t: t.best_rate).backend
    winner = next(t for t in timed if t.backend == choice.backend)
    assert choice.batch == winner.best_batch == choice.engine.batch
    assert all(t.difference <= TOLERANCE for t in timed)
    assert f"lenet on cpu: {choice.backend} f32 batch {choice.batch}" in caplog.text
    digits = check_inputs(lenet, 50)
    assert (
        relative_difference(choice.engine.run(digits), load_engine(lenet, "opencv").run(digits))
        <= TOLERANCE
    )

    again = choose(lenet, threads=1)
    assert again.cached and (again.backend, again.batch) == (choice.backend, choice.batch)
    assert again.describe().endswith("remembered)")


def test_a_choice_made_with_other_library_versions_is_timed_again(lenet, caplog) -> None:
    choose(lenet, threads=1)
    from farm.modelrepo.modelstore import manifest_of

    path = autoselect.cache_path(lenet, manifest_of(lenet).digest, "cpu", 1, "f32")
    document = json.loads(path.read_text())
    document["versions"]["onnxruntime"] = "0.0.1"
    path.write_text(json.dumps(document))
    caplog.set_level(logging.INFO, "farm.engines.autoselect")
    choice = choose(lenet, threads=1)
    assert not choice.cached
    assert "made with other library versions (onnxruntime 0.0.1 -> " in caplog.text
    assert json.loads(path.read_text())["versions"] == autoselect.versions()


@needs_torch
def test_auto_leaves_out_a_backend_that_cannot_run_a_layer(tmp_path, caplog) -> None:
    """OpenCV ignores LRN's k; it refuses such a net, and auto says so and goes on."""
    prototxt = inline_net(
        'layer { name: "norm" type: "LRN" bottom: "data" top: "norm" '
        "lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 k: 2 } }\n",
        "dim: 1 dim: 4 dim: 5 dim: 5",
    )
    spec = load_spec(write_model(tmp_path / "lrn_k", prototxt, layers=[]))
    caplog.set_level(logging.INFO, "farm.engines.autoselect")
    choice = choose(spec, threads=1, use_cache=False)
    opencv = next(t for t in choice.trials if t.backend == "opencv")
    assert "LRN with k = 2" in opencv.problem and not opencv.rates
    assert choice.reference == "torch" and choice.backend != "opencv"
    assert "lrn_k: opencv left out:" in caplog.text


def ill_conditioned_model(folder: Path) -> Path:
    """Two nearly equal large convolutions subtracted: the answer is rounding noise, which
    each library's kernels make differently."""
    body = (
        'layer { name: "a" type: "Convolution" bottom: "data" top: "a" '
        "convolution_param { num_output: 4 kernel_size: 3 } }\n"
        'layer { name: "b" type: "Convolution" bottom: "data" top: "b" '
        "convolution_param { num_output: 4 kernel_size: 3 } }\n"
        'layer { name: "diff" type: "Eltwise" bottom: "a" bottom: "b" top: "diff" '
        "eltwise_param { operation: SUM coeff: 1 coeff: -1 } }\n"
    )
    folder.mkdir(parents=True)
    (folder / "deploy.prototxt").write_text(inline_net(body, "dim: 1 dim: 64 dim: 8 dim: 8"))
    rng = np.random.default_rng(0)
    weights = rng.normal(0, 1000, (4, 64, 3, 3)).astype(np.float32)
    nearly = (weights * (1 + rng.normal(0, 1e-7, weights.shape))).astype(np.float32)
    bias = np.zeros(4, np.float32)
    caffe_proto.write_caffemodel(
        folder / "weights.caffemodel",
        "ill",
        [("a", "Convolution", [weights, bias]), ("b", "Convolution", [nearly, bias])],
    )
    (folder / "model.toml").write_text(
        'prototxt = "deploy.prototxt"\nweights = "weights.caffemodel"\n'
    )
    return folder


def test_auto_refuses_a_model_whose_backends_disagree(tmp_path) -> None:
    spec = load_spec(ill_conditioned_model(tmp_path / "ill"))
    with pytest.raises(
        ModelError,
        match=r"backends opencv and [a-z, ]*onnxruntime[a-z, ]* "
        r"disagree .* farm will not guess",
    ):
        choose(spec, threads=1, use_cache=False)
    assert load_engine(spec, "onnxruntime").run(check_inputs(spec, 2)).shape == (2, 4, 6, 6)


def test_reduced_precision_is_offered_or_refused_with_the_reason(lenet) -> None:
    """bf16 where the CPU lists it (checked against f32 within the bf16 tolerance); elsewhere
    a refusal that names what the CPU offers.  f32 stays the default."""
    offered = "BF16" in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    assert PRECISIONS[0] == "f32"
    if not offered:
        with pytest.raises(
            ModelError,
            match=r"does not compute in bf16 on cpu \(this CPU "
            r"offers FP32",
        ):
            load_engine(lenet, "openvino", precision="bf16")
        with pytest.raises(ModelError, match="no backend runs it on cpu in bf16"):
            choose(lenet, threads=1, precision="bf16", use_cache=False)
        return
    checks = check_model(lenet, check_inputs(lenet, 16), ("opencv", "openvino"), 1, "bf16")
    assert checks[1].ok and checks[1].top1_agreement >= 0.9


def test_openvino_runs_f32_whatever_the_cpu_default(lenet, digits, monkeypatch) -> None:
    """On a CPU with bf16, OpenVINO's default precision is bf16: farm's engine states f32
    (and checks what was compiled), so a Core whose default is bf16 changes nothing."""
    from farm.engines.backends import openvino as backend

    def core_defaulting_to_bf16() -> openvino.Core:
        core = openvino.Core()
        core.set_property("CPU", {"INFERENCE_PRECISION_HINT": "bf16"})
        return core

    images = digits[:64, None]
    reference = load_engine(lenet, "opencv").run(images)
    monkeypatch.setattr(backend, "new_core", core_defaulting_to_bf16)
    engine = load_engine(lenet, "openvino", threads=1)
    assert relative_difference(engine.run(images), reference) <= 1e-5
    assert relative_difference(engine.run(images.astype(np.float32)), reference) <= 1e-5
    assert sorted(engine.graphs) == [False, True]  # the float32 graph, compiled on demand
    for request in engine.graphs.values():
        assert backend.compiled_precision(request.get_compiled_model()) == "f32"


def test_every_openvino_compile_states_its_precision() -> None:
    """farm, its benchmarks' peers and its tests never compile with OpenVINO's default
    precision (bf16 on some CPUs): each function calling ``compile_model`` names the hint."""
    import ast

    root = Path(__file__).resolve().parents[2]
    calls = []
    for path in [
        *root.glob("farm/**/*.py"),
        *root.glob("bench/**/*.py"),
        *root.glob("tests/**/*.py"),
    ]:
        text = path.read_text()
        for function in ast.walk(ast.parse(text)):
            if not isinstance(function, ast.FunctionDef):
                continue
            compiles = [
                node
                for node in ast.walk(function)
                if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "compile_model"
            ]
            if compiles:
                source = ast.get_source_segment(text, function) or ""
                calls.append(
                    (
                        f"{path.relative_to(root)}:{function.name}",
                        "INFERENCE_PRECISION_HINT" in source,
                    )
                )
    assert len(calls) >= 4, calls  # the engine, two peers, the export test
    assert all(stated for _, stated in calls), [name for name, stated in calls if not stated]


def test_choice_round_trips_through_json(lenet) -> None:
    choice = choose(lenet, threads=1)
    copy = Choice.from_json(json.loads(json.dumps(choice.to_json())))
    assert copy.cached and copy.engine is None
    assert (copy.backend, copy.batch, copy.trials) == (choice.backend, choice.batch, choice.trials)


# ------------------------------------------------------------------------ in the farm


def test_a_fixed_batch_is_remembered_apart_from_the_free_choice(
    lenet, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("FARM_CACHE", str(tmp_path))
    fixed = choose(lenet, threads=1, batch=3)
    assert fixed.batch == fixed.engine.batch == 3
    assert all(set(t.rates) == {3} for t in fixed.trials if t.rates)
    free = choose(lenet, threads=1)
    assert not free.cached and len(next(t for t in free.trials if t.rates).rates) > 1
    assert choose(lenet, threads=1, batch=3).cached and choose(lenet, threads=1).cached


@pytest.mark.parametrize("backend", ["opencv", "openvino", "onnxruntime", "torch"])
def test_a_backend_that_cannot_use_the_device_refuses_before_reading_the_model(
    tmp_path, monkeypatch, backend
) -> None:
    """This machine has no CUDA device (and an ONNX Runtime without a CUDA provider): each
    backend refuses cuda:0 from the device alone. The model's weights are cut short, so a
    backend that read them would fail on them instead, and no ONNX export is written."""
    if backend == "torch":
        pytest.importorskip("torch")
        if __import__("torch").cuda.is_available():
            pytest.skip("this machine has a CUDA device")
    monkeypatch.setenv("FARM_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "lenet"
    shutil.copytree(find("lenet").folder, folder)
    weights = folder / "lenet.caffemodel"
    weights.write_bytes(weights.read_bytes()[:100])
    spec = load_spec(folder)
    with pytest.raises(ModelError, match=r"does not compute in f32 on cuda:0 \(.+\); it offers"):
        autoselect.engine_class(backend).load(spec, device="cuda:0")
    assert not onnx_path(spec, folded=True).exists() and not onnx_path(spec, folded=False).exists()


def test_auto_on_a_device_no_backend_runs_names_each_refusal(tmp_path, monkeypatch, lenet) -> None:
    monkeypatch.setenv("FARM_CACHE", str(tmp_path))
    with pytest.raises(ModelError, match="no backend runs it on cuda:0") as raised:
        choose(lenet, "cuda:0", use_cache=False)
    message = str(raised.value)
    assert "farm runs opencv on CPUs only" in message and "OpenVINO on CPUs only" in message
    assert "no CUDA execution provider" in message
    assert not onnx_path(lenet, folded=True).exists()  # ONNX Runtime exported nothing


def test_gpu_batches_stay_within_what_one_chunk_holds() -> None:
    from farm.engines.autoselect import candidate_batches
    from farm.wire.shapes import MAX_TASK_BYTES, chunk_items

    caffenet = chunk_items((227, 227, 3))
    assert caffenet == MAX_TASK_BYTES // (227 * 227 * 3) < 1024
    assert candidate_batches(10, "cuda:0", caffenet) == (1, 8, 10, 32, 128, 256, caffenet)
    assert candidate_batches(64, "cuda:0", chunk_items((1, 28, 28)))[-2:] == (256, 1024)
    assert candidate_batches(64, "cpu", caffenet) == (1, 8, 32, 64, 128)
