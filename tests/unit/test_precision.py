"""int8 versions of a model and the precision gate, on the bundled LeNet: real weights and
its held-out digits (calibration on digits 500-799, validation on digits 0-299)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import numpy as np
import onnx
import pytest

from farm.engines import gate, quantize
from farm.engines.autoselect import load_chosen, load_engine
from farm.engines.cpu import fast_int8
from farm.engines.engine import PRECISIONS, engine_class
from farm.modelrepo.repository import ModelError, ModelSpec, load_spec
from farm.wire.engines import EngineChoice
from tests.unit.test_models import inline_net, write_model

needs_int8 = pytest.mark.skipif(
    not fast_int8(), reason="this CPU has no VNNI or AMX: the gate does not try int8"
)

#: each test its own $FARM_CACHE (``tests/conftest.py``)
pytestmark = pytest.mark.usefixtures("own_cache")


@pytest.fixture(scope="module")
def calibration(digits) -> np.ndarray:
    return np.ascontiguousarray(digits[500:800, np.newaxis])


@pytest.fixture(scope="module")
def validation(digits) -> np.ndarray:
    return np.ascontiguousarray(digits[:300, np.newaxis])


def agreement(outputs: np.ndarray, reference: np.ndarray) -> float:
    return float((outputs.argmax(1) == reference.argmax(1)).mean())


def test_an_int8_version_runs_on_both_cpu_engines_and_keeps_the_answers(
    lenet, calibration, validation
) -> None:
    record = quantize.quantize(lenet, calibration)
    assert record.quantized_layers == 4  # conv1, conv2, ip1, ip2: every computing layer
    assert record.float_layers == [] and record.images == 300
    graph = onnx.load(str(record.path)).graph
    assert sum(node.op_type == "QuantizeLinear" for node in graph.node) >= 4
    assert graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.UINT8
    for backend in ("openvino", "onnxruntime"):
        int8 = load_engine(lenet, backend, precision="int8")
        assert int8.describe().startswith(f"{backend} int8")
        outputs = int8.run(validation)
        reference = load_engine(lenet, backend).run(validation)
        assert agreement(outputs, reference) >= 0.98
        assert not np.array_equal(outputs, reference)  # computed in int8, not f32


def test_int8_without_a_quantized_version_is_refused_saying_how_to_make_one(lenet) -> None:
    with pytest.raises(ModelError, match="int8 after `farm models quantize`.*offers f32"):
        load_engine(lenet, "onnxruntime", precision="int8")


def test_too_few_or_wrong_calibration_images_are_refused(lenet, calibration) -> None:
    few = quantize.MIN_CALIBRATION - 1
    with pytest.raises(quantize.QuantizeError, match=f"{few} calibration images are too few"):
        quantize.quantize(lenet, calibration[:few])
    with pytest.raises(quantize.QuantizeError, match="must be uint8 images"):
        quantize.quantize(lenet, calibration.astype(np.float32))
    assert quantize.recorded(lenet) is None  # nothing was written


def pooling_only(folder: Path) -> ModelSpec:
    """A net with no layer that has an int8 kernel: max pooling, then a softmax."""
    body = (
        'layer { name: "pool" type: "Pooling" bottom: "data" top: "pool" '
        "pooling_param { pool: MAX kernel_size: 2 stride: 2 } }\n"
        'layer { name: "prob" type: "Softmax" bottom: "pool" top: "prob" }'
    )
    return load_spec(write_model(folder, inline_net(body, "dim: 1 dim: 1 dim: 28 dim: 28"), []))


def test_a_net_without_int8_layers_stays_in_f32_with_the_reason(tmp_path) -> None:
    spec = pooling_only(tmp_path / "pooling")
    images = np.random.default_rng(0).integers(0, 256, (100, *spec.item_shape), np.uint8)
    with pytest.raises(quantize.Unquantizable, match="no layer of the net has an int8 kernel"):
        quantize.quantize(spec, images)
    assert quantize.recorded(spec) is None
    assert not [p.name for p in quantize.export_folder().iterdir() if "int8" in p.name]
    # a job's gated preference falls through to f32 on it
    assert load_chosen(spec, gated("int8")).precision == "f32"


def make_stale(spec: ModelSpec) -> None:
    """Make the int8 record say another ONNX Runtime made it."""
    record = quantize.record_path(spec)
    document = json.loads(record.read_text())
    document["versions"]["onnxruntime"] = "1.0.0"
    record.write_text(json.dumps(document))


def test_a_version_made_by_other_library_versions_is_made_again_when_opened(
    lenet, calibration
) -> None:
    made = quantize.quantize(lenet, calibration)
    make_stale(lenet)
    made.path.write_bytes(b"not the graph any more")
    assert not quantize.recorded(lenet).fresh  # reading the record makes nothing
    assert load_engine(lenet, "openvino").precision == "f32"  # f32 loads as it is
    int8 = load_engine(lenet, "openvino", precision="int8")  # opening int8 makes it again
    again = quantize.recorded(lenet)
    assert again.fresh and again.calibration_digest == made.calibration_digest
    assert int8.run(calibration[:4]).shape == (4, 10)


def test_a_stale_version_that_cannot_be_made_again_blocks_only_int8(lenet, calibration) -> None:
    made = quantize.quantize(lenet, calibration)
    make_stale(lenet)
    made.calibration_path.unlink()
    assert load_engine(lenet, "onnxruntime").precision == "f32"
    with pytest.raises(ModelError, match="calibration images cannot be read"):
        load_engine(lenet, "onnxruntime", precision="int8")
    assert load_chosen(lenet, gated("int8")).precision == "f32"


def test_a_gated_job_runs_only_the_int8_version_the_gate_judged(lenet, calibration) -> None:
    judged = quantize.quantize(lenet, calibration)
    version = judged.calibration_digest[:12]
    choice = gated("int8", version=version)
    if fast_int8():
        assert load_chosen(lenet, choice).precision == "int8"
    quantize.quantize(lenet, calibration[::-1])  # another version since the gate ran
    assert load_chosen(lenet, choice).precision == "f32"
    with pytest.raises(ModelError, match="not the one the precision gate judged"):
        engine_class("openvino").load(lenet, precision="int8", calibration=version)


def gated(*precisions: str, version: str | None = None) -> EngineChoice:
    """The precision gate's list as a job carries it: measured on OpenVINO, then f32."""
    return EngineChoice("auto", (*precisions, "f32"), "openvino", version)


def test_a_job_precision_is_one_or_the_gates_list() -> None:
    assert PRECISIONS[0] == "f32" and "int8" in PRECISIONS
    text = "openvino:int8@0123456789ab,bf16,f32"
    choice = EngineChoice.parse("auto", text)
    assert choice == EngineChoice("auto", ("int8", "bf16", "f32"), "openvino", "0123456789ab")
    assert choice.gated and choice.precision_text() == text and str(choice) == f"auto {text}"
    assert choice.calibration("int8") == "0123456789ab" and choice.calibration("bf16") == ""
    assert EngineChoice.parse("onnxruntime", "bf16") == EngineChoice("onnxruntime", ("bf16",))
    assert EngineChoice.parse("auto", "onnxruntime:int8,f32") == EngineChoice(
        "auto", ("int8", "f32"), "onnxruntime"
    )
    for bad in (
        "int8,bf16,f32",  # a list names the backend the gate measured
        "openvino:f32,int8",  # f32 comes last
        "openvino:int8,int8,f32",
        "openvino:int4,f32",
        "caffe9:int8,f32",
        "openvino:bf16@0123456789ab,f32",  # only int8 names a version
        "openvino:int8@12,f32",
        "openvino:int8@0123456789AZ,f32",  # hex digits
        "openvino:int8",  # one precision takes no backend
        "int8@0123456789ab",
        "",
    ):
        with pytest.raises(ValueError):
            EngineChoice.parse("auto", bad)
    with pytest.raises(ValueError, match="backend 'caffe9' is not auto"):
        EngineChoice.parse("caffe9", "f32")


def test_a_malformed_engine_choice_is_refused_when_decoded() -> None:
    """A peer's choice is checked as it is decoded: the struct's own check, named by field."""
    good = msgspec.msgpack.encode(EngineChoice("auto", ("bf16", "f32"), "openvino"))
    assert msgspec.msgpack.decode(good, type=EngineChoice).measured_on == "openvino"
    for fields in (
        {"precisions": ["int8", "bf16"], "measured_on": "openvino"},  # no f32 last
        {"precisions": ["f32"], "measured_on": "openvino"},
        {"backend": "tensorflow"},
        {"precisions": ["int8", "f32"], "measured_on": "openvino", "int8_version": "x" * 12},
    ):
        with pytest.raises(msgspec.ValidationError, match="engine choice"):
            msgspec.msgpack.decode(msgspec.msgpack.encode(fields), type=EngineChoice)
    with pytest.raises(msgspec.ValidationError, match=r"length <= 4 - at `\$.precisions`"):
        msgspec.msgpack.decode(
            msgspec.msgpack.encode({"precisions": ["f32"] * 5}), type=EngineChoice
        )


def verdict(precision: str, agreement: float, speedup: float) -> gate.Verdict:
    return gate.Verdict(precision, 300, agreement, 0.01, speedup)


def test_the_gate_passes_the_fastest_precision_at_the_threshold_and_never_below() -> None:
    verdicts = [verdict("bf16", 0.995, 1.9), verdict("int8", 0.989, 3.4)]
    judged = gate.Gate(
        "net", "digest", 300, "openvino", verdicts, calibration="c" * 64, min_agreement=0.99
    )
    assert judged.precision == "openvino:bf16,f32"
    judged.min_agreement = 0.985
    assert judged.precision == f"openvino:int8@{'c' * 12},bf16,f32"
    assert judged.engine_choice("onnxruntime") == EngineChoice(
        "onnxruntime", ("int8", "bf16", "f32"), "openvino", "c" * 12
    )
    judged.refuse("int8", "the job's images are float32")
    assert judged.precision == "openvino:bf16,f32"
    assert "int8: not tried: the job's images are float32" in "\n".join(judged.lines())
    slower = gate.Gate("net", "d", 300, "openvino", [verdict("bf16", 1.0, 0.9)])
    assert slower.precision == "f32" and "no lower precision passed" in slower.lines()[-1]
    assert slower.engine_choice() == EngineChoice("auto", ("f32",))


@needs_int8
def test_the_gate_refuses_an_int8_version_whose_answers_disagree(lenet, validation) -> None:
    """Calibrated on blank images, LeNet's int8 ranges are wrong for digits: many answers
    change, and the gate keeps it out of the job."""
    quantize.quantize(lenet, np.zeros((100, *lenet.item_shape), np.uint8))
    judged = gate.judge(lenet, validation)
    int8 = next(v for v in judged.verdicts if v.precision == "int8")
    assert int8.problem is None and int8.agreement < gate.MIN_AGREEMENT
    assert not int8.passes(judged.min_agreement)
    assert "int8" not in judged.precision and judged.precision.endswith("f32")
    assert f"int8: {int8.speedup:.1f}x f32" in "\n".join(judged.lines())
    assert "refused" in next(line for line in judged.lines() if "int8:" in line)


@needs_int8
def test_the_gate_passes_a_good_int8_version_and_scores_labels(
    lenet, calibration, validation, digits
) -> None:
    labels = np.load(lenet.sample_labels)[:300]
    quantize.quantize(lenet, calibration)
    judged = gate.judge(lenet, validation, labels)
    int8 = next(v for v in judged.verdicts if v.precision == "int8")
    assert int8.agreement >= gate.MIN_AGREEMENT and int8.accuracy is not None
    assert judged.f32_accuracy is not None and judged.f32_accuracy > 0.9
    assert abs(int8.accuracy - judged.f32_accuracy) <= 1 - int8.agreement
    if int8.speedup > 1:
        assert f"int8@{judged.calibration[:12]}" in judged.precision


def test_the_gates_verdicts_are_cached_by_validation_set_and_int8_version(
    lenet, calibration, validation, own_cache
) -> None:
    first = gate.judge(lenet, validation)
    assert not first.cached
    again = gate.judge(lenet, validation, min_agreement=0.5)
    assert again.cached and again.verdicts == first.verdicts and again.min_agreement == 0.5
    other_set = gate.judge(lenet, validation[:200])
    assert not other_set.cached and other_set.images == 200
    quantize.quantize(lenet, calibration)  # a new int8 version: its verdict is measured anew
    with_int8 = gate.judge(lenet, validation)
    assert not with_int8.cached
    assert len(list((own_cache / "precision").glob("lenet-*.json"))) == 3
    assert gate.judge(lenet, validation).cached
    assert [g.validation for g in gate.remembered_for(lenet)].count(first.validation) == 2


def test_too_few_validation_images_are_refused(lenet, validation) -> None:
    with pytest.raises(ModelError, match="too few for the precision gate"):
        gate.judge(lenet, validation[: gate.MIN_VALIDATION - 1])


def test_a_job_run_again_is_judged_without_decoding_its_images(lenet, validation) -> None:
    decoded: list[int] = []

    def sample() -> tuple[np.ndarray, None]:
        decoded.append(len(validation))
        return validation, None

    first = gate.judge_input(lenet, "input-a", sample)
    again = gate.judge_input(lenet, "input-a", sample, min_agreement=0.5)
    assert decoded == [300] and not first.cached
    assert again.cached and again.verdicts == first.verdicts and again.min_agreement == 0.5
    gate.judge_input(lenet, "input-b", sample)  # another input is decoded, then remembered
    assert decoded == [300, 300]


def test_an_input_is_named_by_its_files_or_its_rows(tmp_path, digits) -> None:
    from farm.client.inputs import ArraySource, FileSource
    from farm.client.samples import input_key

    files = [tmp_path / "a.png", tmp_path / "b.png"]
    for path in files:
        path.write_bytes(b"\x89PNG")
    before = input_key(FileSource(files), 300)
    assert input_key(FileSource(files), 300) == before
    os.utime(files[1], ns=(1, 1))  # the same name, another file
    assert input_key(FileSource(files), 300) != before
    rows = input_key(ArraySource(digits[:300]), 300)
    assert input_key(ArraySource(digits[:400]), 300) == rows  # only the first 300 count
    assert input_key(ArraySource(digits[1:301]), 300) != rows
    assert input_key(ArraySource(digits[:300]), 300, np.zeros(300)) != rows


def test_python_clients_resolve_auto_through_the_gate_not_the_wire() -> None:
    from farm.client.client import engine_choice

    with pytest.raises(ValueError, match=r"farm.engines.gate.judge\(spec, images\).precision"):
        engine_choice(None, "auto")
    assert engine_choice(None, None) is None
    assert engine_choice(None, "openvino:int8,bf16,f32") == gated("int8", "bf16")
    assert engine_choice("onnxruntime", None) == EngineChoice("onnxruntime", ("f32",))
