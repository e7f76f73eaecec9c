"""``farm models check``: load a model on every backend here and compare their outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from farm.engine import BACKENDS, BackendUnavailable, load_engine
from farm.repository import ModelError, ModelSpec

#: Largest absolute difference between two backends' outputs that counts as the same.
TOLERANCE = 1e-4


@dataclass
class BackendCheck:
    backend: str
    outputs: np.ndarray | None = None
    seconds: float = 0.0  # forward time for the check inputs
    problem: str | None = None  # why it did not run
    skipped: bool = False  # the backend's library is not installed
    difference: float | None = None  # max |outputs - reference outputs|

    @property
    def ok(self) -> bool:
        return self.skipped or (self.problem is None and (self.difference or 0.0) <= TOLERANCE)


def check_inputs(spec: ModelSpec, count: int = 8, seed: int = 0) -> np.ndarray:
    """The model's sample (first ``count`` images), or seeded random uint8 images."""
    if spec.sample is not None and spec.sample.is_file():
        sample = np.load(spec.sample)
        if sample.ndim == len(spec.item_shape):  # N x H x W for a one-channel model
            sample = sample[:, np.newaxis]
        return np.ascontiguousarray(sample[:count])
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (count, *spec.item_shape), dtype=np.uint8)


def check_model(spec: ModelSpec, inputs: np.ndarray, backends: tuple[str, ...] = tuple(BACKENDS),
                threads: int | None = None) -> list[BackendCheck]:
    """Run ``inputs`` on each backend; differences are against the first backend that ran."""
    checks = []
    reference = None
    for backend in backends:
        check = BackendCheck(backend)
        checks.append(check)
        try:
            engine = load_engine(spec, backend, threads=threads)
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
        check.difference = float(np.abs(check.outputs - reference).max())
    return checks
