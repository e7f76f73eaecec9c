"""``farm models check``: load a model on every backend here and compare their outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from farm import defaults
from farm.engines.engine import BACKENDS, BackendUnavailable, engine_class
from farm.engines.onnx_export import OPSET, export, save, shape_check
from farm.engines.preprocess import Transformer
from farm.engines.tolerances import TOLERANCE, TOLERANCES, relative_difference
from farm.modelrepo.caffe_net import Network, NetworkError
from farm.modelrepo.repository import ModelError, ModelSpec, prepare


@dataclass
class BackendCheck:
    backend: str
    outputs: np.ndarray | None = None
    seconds: float = 0.0  # forward time for the check inputs
    problem: str | None = None  # why it did not run
    skipped: bool = False  # the backend's library is not installed
    difference: float | None = None  # max |outputs - reference| / max |reference|
    top1_agreement: float | None = None  # share of images whose top class is the reference's
    tolerance: float = TOLERANCE

    @property
    def ok(self) -> bool:
        return self.skipped or (self.problem is None and (self.difference or 0.0) <= self.tolerance)


def check_inputs(spec: ModelSpec, count: int = 8, seed: int = 0) -> np.ndarray:
    """The model's sample (first ``count`` images), or seeded random uint8 images."""
    if spec.sample is not None and spec.sample.is_file():
        sample = np.load(spec.sample)
        if sample.ndim == len(spec.item_shape):  # N x H x W for a one-channel model
            sample = sample[:, np.newaxis]
        return np.ascontiguousarray(sample[:count])
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (count, *spec.item_shape), dtype=np.uint8)


def check_model(
    spec: ModelSpec,
    inputs: np.ndarray,
    backends: tuple[str, ...] = tuple(BACKENDS),
    threads: int | None = None,
    precision: str = defaults.PRECISION,
) -> list[BackendCheck]:
    """Run ``inputs`` on each backend; differences are against the first backend that ran,
    which runs in f32 (the others in ``precision``)."""
    checks = []
    reference = None
    for backend in backends:
        check = BackendCheck(backend, tolerance=TOLERANCES[precision])
        checks.append(check)
        try:
            engine = engine_class(backend).load(
                spec, threads=threads, precision="f32" if reference is None else precision
            )
            started = time.perf_counter()
            check.outputs = engine.run(inputs)
            check.seconds = time.perf_counter() - started
        except BackendUnavailable as exc:
            check.skipped, check.problem = True, str(exc)
            continue
        except ModelError as exc:
            check.problem = str(exc)
            continue
        if reference is None:
            reference = check.outputs
            if precision != "f32":  # the reference itself is not compared in reduced precision
                check.tolerance = TOLERANCE
        check.difference = relative_difference(check.outputs, reference)
        check.top1_agreement = top1_agreement(check.outputs, reference)
    return checks


def top1_agreement(outputs: np.ndarray, reference: np.ndarray) -> float:
    """The share of images whose highest-scoring class is the reference's."""
    if outputs.shape != reference.shape:
        return 0.0
    flat = outputs.reshape(len(outputs), -1).argmax(axis=1)
    return float((flat == reference.reshape(len(reference), -1).argmax(axis=1)).mean())


@dataclass
class ExportCheck:
    """A written ONNX file and how its outputs compare with the reference backend's."""

    size: int
    opset: int
    input: str
    output: str
    reference: str
    difference: float

    @property
    def ok(self) -> bool:
        return self.difference <= TOLERANCE


def export_checked(spec: ModelSpec, path: Path, inputs: np.ndarray) -> ExportCheck:
    """Write ``spec`` as ONNX at ``path`` (``onnx.checker`` passes it first), run it in ONNX
    Runtime, and compare with the first other backend that runs the model."""
    import onnxruntime

    prepare(spec)
    try:
        network = Network.load(spec.prototxt, spec.weights, spec.declared_input)
        model = export(network, spec.output)
        shape_check(model, network, spec.output)
    except NetworkError as exc:
        raise ModelError(f"model {spec.name!r}: {exc}") from None
    save(model, path)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    outputs = session.run(None, {network.input: Transformer.for_model(spec)(inputs)})[0]
    others = tuple(b for b in BACKENDS if b not in ("onnxruntime", "openvino"))
    reference = next((c for c in check_model(spec, inputs, others) if c.outputs is not None), None)
    if reference is None or reference.outputs is None:
        raise ModelError(f"model {spec.name!r}: no reference backend runs it to compare with")
    return ExportCheck(
        path.stat().st_size,
        OPSET,
        network.input,
        model.graph.output[0].name,
        reference.backend,
        relative_difference(outputs, reference.outputs),
    )
