"""Cache files farm loads as graphs or weights are checked against the digest recorded when
they were written: a tampered or unrecorded one is logged, removed and built anew, on real
files of the bundled LeNet (``farm.modelrepo.sealed``)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from farm.engines import quantize
from farm.engines.autoselect import load_engine
from farm.engines.backends import openvino
from farm.engines.onnx_export import cache_format, onnx_path
from farm.modelrepo import sealed
from farm.modelrepo.repository import ModelError, ModelSpec, load_spec, prepare

#: each test its own $FARM_CACHE (``tests/conftest.py``)
pytestmark = pytest.mark.usefixtures("own_cache")


@pytest.fixture
def warnings(caplog) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING, "farm.modelrepo.sealed")
    return caplog


def flip_a_byte(path: Path, where: float = 0.5) -> None:
    """Change one bit of one byte, in place (LeNet's exports are mostly ip1's weights)."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x01
    path.write_bytes(bytes(data))


def onnxruntime_outputs(path: Path, images: np.ndarray) -> np.ndarray:
    """The export at ``path`` run as it is, with no check (what farm did before)."""
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: images})[0]


def test_a_tampered_onnx_export_is_rebuilt_and_answers_as_a_fresh_one(
    lenet, digits, warnings
) -> None:
    images = digits[:16, None]
    fresh = load_engine(lenet, "onnxruntime", threads=1).run(images)
    path = onnx_path(lenet, folded=True)
    digest = sealed.sha256_of(path)
    assert sealed.recorded(path) == sealed.Record(digest, path.stat().st_size, cache_format())
    flip_a_byte(path)
    assert not np.array_equal(onnxruntime_outputs(path, images), fresh)  # it matters unchecked

    again = load_engine(lenet, "onnxruntime", threads=1).run(images)
    assert (
        f"ONNX export cache {path} does not match its recorded digest (tampered or damaged): "
        f"expected sha256 {digest[:16]}" in warnings.text
    )
    assert warnings.text.rstrip().endswith("rebuilding it")
    assert sealed.sha256_of(path) == digest and sealed.mismatch(path, cache_format()) is None
    assert np.array_equal(again, fresh)


def test_an_export_without_a_record_is_rebuilt_not_adopted(
    lenet, digits, warnings, tmp_path
) -> None:
    """An export cached before farm recorded digests cannot be told from a tampered one."""
    images = digits[:8, None]
    fresh = load_engine(lenet, "onnxruntime", threads=1).run(images)
    path = onnx_path(lenet, folded=True)
    digest, inode = sealed.sha256_of(path), path.stat().st_ino
    (tmp_path / "old.onnx").hardlink_to(path)  # its inode stays taken
    sealed.record_path(path).unlink()

    again = load_engine(lenet, "onnxruntime", threads=1).run(images)
    assert f"ONNX export cache {path} has no recorded digest" in warnings.text
    assert path.stat().st_ino != inode  # written anew, not taken as it was
    assert sealed.recorded(path).sha256 == sealed.sha256_of(path) == digest
    assert np.array_equal(again, fresh)


def test_an_untouched_export_is_loaded_without_a_word(lenet, digits, warnings) -> None:
    load_engine(lenet, "onnxruntime", threads=1)
    path = onnx_path(lenet, folded=True)
    inode = path.stat().st_ino
    load_engine(lenet, "openvino", threads=1)
    assert path.stat().st_ino == inode and not warnings.records


def test_a_tampered_openvino_blob_is_compiled_again(lenet, digits, warnings) -> None:
    images = digits[:16, None]
    fresh = load_engine(lenet, "openvino", threads=1).run(images)
    folder = openvino.blob_folder(str(onnx_path(lenet, folded=True)))
    [blob] = sealed.entries(folder)
    assert sealed.mismatch(blob, openvino.BLOB_FORMAT) is None  # recorded after the compile
    flip_a_byte(blob)

    again = load_engine(lenet, "openvino", threads=1).run(images)
    assert f"OpenVINO compiled blob {blob} does not match its recorded digest" in warnings.text
    assert sealed.mismatch(blob, openvino.BLOB_FORMAT) is None  # compiled and recorded anew
    assert np.array_equal(again, fresh)


def test_a_tampered_int8_version_is_made_again(lenet, digits, warnings) -> None:
    calibration = np.ascontiguousarray(digits[500:600, None])
    made = quantize.quantize(lenet, calibration)
    digest = sealed.sha256_of(made.path)
    flip_a_byte(made.path, 0.9)
    assert quantize.quantized_file(lenet) == made.path
    assert f"int8 version {made.path} does not match its recorded digest" in warnings.text
    assert sealed.mismatch(made.path, quantize.cache_format()) is None
    assert quantize.recorded(lenet).calibration_digest == made.calibration_digest
    assert sealed.sha256_of(made.path) == digest  # the same file as made from the same images

    flip_a_byte(made.path)
    flip_a_byte(made.calibration_path, 0.9)  # an image's pixel: not the version judged
    with pytest.raises(ModelError, match="no longer hash to .*tampered or damaged"):
        quantize.quantized_file(lenet)


def generated_lenet(tmp_path: Path, lenet: ModelSpec) -> ModelSpec:
    """LeNet whose weights farm makes from its fillers (seed 1) into the cache."""
    folder = tmp_path / "lenet_generated"
    shutil.copytree(lenet.folder, folder, ignore=shutil.ignore_patterns("*.caffemodel"))
    with open(folder / "model.toml", "a") as toml:
        toml.write("\n[generate]\nseed = 1\n")
    return load_spec(folder)


def test_tampered_generated_weights_are_made_again(tmp_path, lenet, warnings) -> None:
    spec = generated_lenet(tmp_path, lenet)
    assert not spec.weights.is_relative_to(spec.folder)
    digest = sealed.sha256_of(prepare(spec))
    flip_a_byte(spec.weights)
    assert prepare(spec) == spec.weights
    assert f"generated weights {spec.weights} does not match its recorded digest" in warnings.text
    assert sealed.sha256_of(spec.weights) == digest

    toml = spec.folder / "model.toml"  # another seed: other weights, at the same path
    toml.write_text(toml.read_text().replace("seed = 1", "seed = 2"))
    reseeded = load_spec(spec.folder)
    assert prepare(reseeded) == spec.weights
    assert "recorded as 'farm generated caffemodel seed 1'" in warnings.text
    assert sealed.sha256_of(spec.weights) != digest


def test_a_cache_write_leaves_the_file_and_its_record_only(tmp_path) -> None:
    path = tmp_path / "graph.onnx"
    sealed.write(path, lambda partial: partial.write_bytes(b"graph"), "test v1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph.onnx", "graph.onnx.sha256.json"]
    assert sealed.verified(path, "test file", "test v1")
    assert not sealed.verified(path, "test file", "test v2") and not path.exists()


class Heard(logging.Handler):
    """The messages logged to it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def load_and_listen(cache: str) -> tuple[list[str], np.ndarray]:
    """In a process of its own: load LeNet on OpenVINO (export, compile) into ``cache``; the
    warnings about cache files, and the outputs."""
    import os

    from farm.modelrepo.repository import find

    os.environ["FARM_CACHE"] = cache
    heard = Heard()
    logging.getLogger("farm.modelrepo.sealed").addHandler(heard)
    spec = find("lenet")
    outputs = load_engine(spec, "openvino", threads=1).run(np.load(spec.sample)[:8, None])
    return heard.messages, outputs


def test_workers_building_the_same_caches_at_once_agree_without_a_warning(own_cache) -> None:
    """Two processes export and compile LeNet into one empty cache together: records go
    down before their files, the blob folder is locked, so neither sees the other's work
    half done."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=context) as pool:
        (heard, first), (heard_too, second) = pool.map(load_and_listen, [str(own_cache)] * 2)
    assert heard == heard_too == [] and np.array_equal(first, second)
    for cached in [*(own_cache / "onnx").glob("*.onnx"), *(own_cache / "openvino").glob("*/*")]:
        if not cached.name.startswith(".") and not cached.name.endswith(sealed.SUFFIX):
            assert sealed.recorded(cached).sha256 == sealed.sha256_of(cached), cached
