"""Cascades (``int8+f32``): the fast precision first, f32 again for the images in doubt.

On the bundled LeNet, real weights and held-out digits.  An int8 version calibrated on
blank images has wrong ranges for digits, so it changes many answers: the cascade has
real doubts to catch.  int8 runs on any x86-64 (VNNI only makes it faster), so these
tests hold on every CPU; ``int8_anywhere`` lets the gate try it where workers would not.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from farm.engines import cascade, gate, quantize
from farm.engines.autoselect import load_chosen, load_engine, rerun_batch
from farm.engines.cascade import CascadeEngine, changed, in_doubt, split_check, top_margins
from farm.engines.engine import Engine
from farm.wire.engines import EngineChoice

#: each test its own $FARM_CACHE (``tests/conftest.py``)
pytestmark = pytest.mark.usefixtures("own_cache")


@pytest.fixture(scope="module")
def validation(digits) -> np.ndarray:
    return np.ascontiguousarray(digits[:300, np.newaxis])


@pytest.fixture
def blank_int8(lenet) -> Engine:
    """LeNet in int8 calibrated on blank images: many answers change."""
    quantize.quantize(lenet, np.zeros((100, *lenet.item_shape), np.uint8))
    return load_engine(lenet, "openvino", 16, threads=1, precision="int8")


@pytest.fixture
def f32(lenet) -> Engine:
    return load_engine(lenet, "openvino", 16, threads=1)


def test_margins_are_the_gap_between_the_two_highest_scores() -> None:
    outputs = np.array([[0.1, 0.7, 0.2], [0.5, 0.5, 0.0], [np.nan, 1.0, 0.0], [3.0, -1.0, np.inf]])
    margins = top_margins(outputs)
    assert margins[0] == pytest.approx(0.5) and margins[1] == 0.0
    assert np.isnan(margins[2:]).all()
    assert in_doubt(outputs, 0.4).tolist() == [False, True, True, True]
    assert in_doubt(outputs, 0.5).tolist() == [True, True, True, True]
    # bf16 and f16 round relative to a value's size: their margin is relative to the top-1
    scaled = np.array([[10.0, 9.0, 0.0], [1.0, 0.95, 0.0], [-2.0, -3.0, -4.0]])
    assert top_margins(scaled, relative=True) == pytest.approx([0.1, 0.05, 1 / 3])
    assert cascade.relative("bf16+f32") and cascade.relative("f16")
    assert not cascade.relative("int8+f32")


def test_a_margin_is_rounded_up_for_the_job_s_text() -> None:
    for margin in (0.1234564, 0.1234566, 2.0, 0.0, 9.9999996e-3, 123456.51):
        kept = gate.text_margin(margin)
        assert kept >= margin and kept == float(f"{kept:.6g}")
        assert kept - margin <= 2e-5 * max(margin, 1e-30)


def test_each_half_s_margin_catches_every_changed_answer_of_its_half(
    blank_int8, f32, validation
) -> None:
    fast, exact = blank_int8.run(validation), f32.run(validation)
    wrong = changed(fast, exact)
    assert 10 < wrong.sum() < len(validation)  # a real set of doubts, not all or none
    margin, splits = split_check(fast, exact)
    half = len(validation) // 2
    for split, fitted in zip(splits, (slice(0, half), slice(half, None))):
        assert split.caught
        caught = in_doubt(fast[fitted], split.margin)
        assert caught[wrong[fitted]].all()
        assert split.margin == max(top_margins(fast[fitted])[wrong[fitted]])
    assert margin == max(split.margin for split in splits)
    assert in_doubt(fast, margin)[wrong].all()  # the job's margin: every changed answer
    # what each half's margin misses on the other half is counted, not assumed
    other = in_doubt(fast[half:], splits[0].margin)
    assert splits[0].missed == int((wrong[half:] & ~other).sum())


def test_the_cascade_answers_as_f32_and_its_reruns_are_f32_s_outputs(
    lenet, blank_int8, f32, validation
) -> None:
    fast, exact = blank_int8.run(validation), f32.run(validation)
    margin, _ = split_check(fast, exact)
    engine = CascadeEngine(blank_int8, f32, margin, "int8+f32")
    outputs = engine.run(validation)
    rerun = np.array(engine.last_run.rerun)
    assert rerun.tolist() == np.flatnonzero(in_doubt(fast, margin)).tolist()
    assert 0 < len(rerun) < len(validation)
    alone = load_engine(lenet, "openvino", 16, threads=1).run(validation[rerun])
    np.testing.assert_allclose(outputs[rerun], alone, rtol=1e-5, atol=1e-6)
    kept = np.setdiff1d(np.arange(len(validation)), rerun)
    np.testing.assert_array_equal(outputs[kept], fast[kept])  # the rest: int8's own
    assert (outputs.argmax(1) == exact.argmax(1)).all()  # fitted here: every answer f32's
    assert engine.describe() == "openvino int8+f32 batch 16"


class Overflowing(Engine):
    """A fast engine some of whose outputs overflow, as f16 does on a GPU (farm's CPU
    engines offer no f16 here, so the overflow is put into a real int8 engine's outputs)."""

    def __init__(self, real: Engine, rows: list[int]) -> None:
        super().__init__(real.spec, real.network, real.batch, "cpu", 1, "f16")
        self.real, self.rows, self.output_shape = real, rows, real.output_shape

    def run(self, images, stop=None, tally=None, then=None) -> np.ndarray:
        outputs = self.real.run(images, stop, tally)
        self.last_run = self.real.last_run
        outputs[self.rows, 0] = np.inf
        outputs[self.rows[:1], 1] = np.nan
        return outputs


def test_an_output_that_is_not_finite_always_runs_again_in_f32(lenet, f32, validation) -> None:
    quantize.quantize(lenet, np.ascontiguousarray(validation))
    good = load_engine(lenet, "openvino", 16, threads=1, precision="int8")
    engine = CascadeEngine(Overflowing(good, [3, 7, 200]), f32, 0.0, "f16+f32")
    outputs = engine.run(validation)
    assert set(engine.last_run.rerun) >= {3, 7, 200}
    assert np.isfinite(outputs).all()
    np.testing.assert_allclose(outputs[[3, 7, 200]], f32.run(validation[[3, 7, 200]]), rtol=1e-5)
    assert cascade.fit_margin(Overflowing(good, [5]).run(validation), f32.run(validation)) >= 0


def test_a_job_s_cascade_loads_both_engines_with_its_margin(lenet, blank_int8) -> None:
    record = quantize.recorded(lenet)
    assert record is not None
    version = record.calibration_digest[:12]
    choice = EngineChoice.parse("auto", f"openvino:int8+f32@{version}=0.25,f32")
    assert choice.margins == (0.25,) and choice.calibration("int8+f32") == version
    engine = load_chosen(lenet, choice, 16, "cpu", 1)
    explicit = load_chosen(lenet, EngineChoice.parse("onnxruntime", "int8+f32=0.5"), 16, "cpu", 1)
    assert isinstance(explicit, CascadeEngine) and explicit.margin == 0.5
    assert explicit.exact.batch == rerun_batch(explicit.fast.batch) == 16  # fast: 16
    assert [rerun_batch(batch) for batch in (4, 64, 1024)] == [4, 16, 256]
    assert explicit.describe().startswith("onnxruntime int8+f32")
    if isinstance(engine, CascadeEngine):  # a CPU with VNNI or AMX runs the gated int8
        assert engine.margin == 0.25 and engine.exact.precision == "f32"
    else:
        assert engine.precision == "f32"


def test_cascade_choices_travel_as_text_and_on_the_wire() -> None:
    text = "openvino:int8+f32@3fa9c1e2d4b5=2.5,bf16+f32=0.125,bf16,f32"
    choice = EngineChoice.parse("auto", text)
    assert choice.precision_text() == text and choice.margin("bf16+f32") == 0.125
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(choice), type=EngineChoice)
    assert decoded == choice
    for bad, why in (
        ("openvino:bf16+f32,f32", "each cascade names its margin"),
        ("openvino:bf16+f32=-1,f32", "a number >= 0"),
        ("openvino:bf16+f32=nan,f32", "a number >= 0"),
        ("bf16+f32=0.5", "a cascade runs on a named backend"),
        ("openvino:bf16=0.5,f32", "each cascade names its margin"),
    ):
        with pytest.raises(ValueError, match=why):
            EngineChoice.parse("auto", bad)
    for margin in (float("nan"), float("inf"), -1.0):
        fields = {"backend": "openvino", "precisions": ["bf16+f32"], "margins": [margin]}
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(msgspec.msgpack.encode(fields), type=EngineChoice)


def cascade_verdict(name: str, agreement: float, speedup: float, margin: float) -> gate.Verdict:
    return gate.Verdict(name, 300, agreement, 0.01, speedup, margin=margin, rerun=0.1)


def test_auto_takes_the_fastest_candidate_at_the_gate_and_never_one_below() -> None:
    verdicts = [
        gate.Verdict("bf16", 300, 0.993, 0.01, 1.93),
        cascade_verdict("bf16+f32", 1.0, 1.7, 0.4),
        gate.Verdict("int8", 300, 0.84, 0.1, 3.7),
        cascade_verdict("int8+f32", 0.996, 2.2, 2.5),
    ]
    judged = gate.Gate("net", "d", 300, "openvino", verdicts, calibration="c" * 64)
    for least, first in ((0.999, "bf16+f32"), (0.995, "int8+f32"), (0.8, "int8")):
        judged.min_agreement = least
        passed = judged.passed
        assert passed[0].precision == first
        assert all(v.agreement >= least and v.speedup > 1 for v in passed)
        assert not [v for v in verdicts if v.agreement < least and v in passed]
    judged.min_agreement = 0.999
    assert judged.precision == "openvino:bf16+f32=0.4,f32"
    judged.min_agreement = 0.995
    choice = judged.engine_choice()
    assert choice.precisions == ("int8+f32", "bf16+f32", "f32")
    assert choice.margins == (2.5, 0.4) and choice.int8_version == "c" * 12
    line = next(line for line in judged.lines() if line.strip().startswith("bf16+f32"))
    assert "10.0% of images re-run in f32, top-1 agrees on 100.0% of 300" in line


def test_the_gate_fits_and_times_each_cascade(lenet, validation) -> None:
    quantize.quantize(lenet, np.zeros((100, *lenet.item_shape), np.uint8))
    judged = gate.judge(lenet, validation, int8_anywhere=True)
    int8, both = judged.verdict("int8"), judged.verdict("int8+f32")
    assert int8 is not None and both is not None and both.problem is None
    assert int8.agreement < 0.99 and both.margin is not None and both.margin > 0
    assert both.agreement > int8.agreement and both.speedup > 0
    assert 0 < (both.rerun or 0) < 1
    checked = both.agreement * 300 + both.missed
    assert checked == pytest.approx(300)
    assert both.difference < int8.difference


def test_spot_checks_compare_a_cascade_s_answers_as_its_fast_precision_s() -> None:
    from farm.broker.verify import engine_precision

    assert engine_precision("openvino bf16+f32 batch 64") == "bf16"
    assert engine_precision("onnxruntime int8+f32 batch 16 + torch f32 batch 8") == "int8"
    assert engine_precision("openvino f32 batch 64") == engine_precision("") == "f32"


def test_remembered_verdicts_keep_each_cascade_s_margin(tmp_path) -> None:
    from dataclasses import asdict

    from farm.engines.autoselect import remember_file

    verdicts = [
        gate.Verdict("bf16", 300, 0.97, 0.01, 1.9),
        cascade_verdict("bf16+f32", 1.0, 1.7, 0.41),
    ]
    judged = gate.Gate("net", "d", 300, "openvino", verdicts)
    remember_file(tmp_path / "gate.json", {**asdict(judged), "cached": True})
    again = gate.remembered(tmp_path / "gate.json")
    assert again is not None and again.cached and again.verdicts == verdicts
    assert again.precision == "openvino:bf16+f32=0.41,f32"
