"""A cascade: f32's answers at a reduced precision's speed.

The fast engine (bf16, f16 or int8) runs every image of a chunk; the images whose answer
is in doubt run again in f32 on the same backend, in the same chunk, and their f32
outputs replace the fast ones.  An image is in doubt when the fast output's top-1 score
exceeds its top-2 score by at most the cascade's margin, or when the fast output is not
finite (an f16 overflow).  The margin comes from the user's own images
(``fit_margin``, run by the precision gate): the smallest that catches every image
whose top-1 class the fast precision changed.

For bf16 and f16 the gap is relative to the top-1 score (their rounding errors are
relative to a value's size); for int8 it is absolute (its steps are fixed by each
layer's scale).  On SqueezeNet's photo crops with bf16, the relative gap re-ran 13% and
8% of held-out images where the absolute one re-ran 16% and 11%, with the same answers
missed (docs/precision.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from farm.engines.engine import Engine, RunStats
from farm.wire.engines import fast_precision

#: The fast precisions whose margin is relative to the top-1 score (floating point).
RELATIVE = ("bf16", "f16")


def relative(cascade: str) -> bool:
    """Whether a cascade's (or a fast precision's) margin is relative to the top-1 score."""
    return fast_precision(cascade) in RELATIVE


def top_margins(outputs: np.ndarray, relative: bool = False) -> np.ndarray:
    """Each image's top-1 score minus its top-2 score, over the top-1 score's magnitude
    if ``relative`` (NaN for an output that is not finite; +inf for one of one value)."""
    rows = outputs.reshape(len(outputs), -1).astype(np.float64)
    if rows.shape[1] < 2:
        margins = np.full(len(rows), np.inf)
    else:
        top_two = np.partition(rows, -2, axis=1)[:, -2:]
        margins = top_two[:, 1] - top_two[:, 0]
        if relative:
            scale = np.maximum(np.abs(top_two).max(axis=1), np.finfo(np.float32).tiny)
            with np.errstate(invalid="ignore"):  # inf / inf: the row is not finite anyway
                margins /= scale
    margins[~np.isfinite(rows).all(axis=1)] = np.nan
    return margins


def in_doubt(outputs: np.ndarray, margin: float, relative: bool = False) -> np.ndarray:
    """Which images run again in f32: top-1 to top-2 margin at most ``margin``, or an
    output that is not finite."""
    margins = top_margins(outputs, relative)
    return np.isnan(margins) | (margins <= margin)


def changed(outputs: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Which images' top-1 class differs from the reference's (or is not finite)."""
    fast, exact = (rows.reshape(len(rows), -1) for rows in (outputs, reference))
    return (fast.argmax(1) != exact.argmax(1)) | ~np.isfinite(fast).all(axis=1)


def fit_margin(outputs: np.ndarray, reference: np.ndarray, relative: bool = False) -> float:
    """The smallest margin that sends every image whose top-1 class ``outputs`` changed
    (against f32's ``reference``) to f32: the largest fast margin among them (0 when none
    changed; a non-finite output is caught whatever the margin)."""
    margins = top_margins(outputs, relative)[changed(outputs, reference)]
    finite = margins[np.isfinite(margins)]
    return float(finite.max()) if len(finite) else 0.0


@dataclass
class Split:
    """A margin fitted on one half of the validation images and checked on the other."""

    margin: float  # fitted on the images of ``fitted``
    caught: bool  # it sends every changed image of its own half to f32
    checked: int  # the other half's images
    missed: int  # of them, images whose top-1 class would still differ from f32's


def missed(outputs: np.ndarray, reference: np.ndarray, margin: float, relative: bool) -> np.ndarray:
    """The images whose top-1 class would still differ from f32's after the cascade."""
    return changed(outputs, reference) & ~in_doubt(outputs, margin, relative)


def split_check(
    outputs: np.ndarray, reference: np.ndarray, relative: bool = False
) -> tuple[float, list[Split]]:
    """Fit a margin on each half of the images and check it on the other; the margin the
    job runs with is the larger, which catches every changed image of both halves.  Its
    agreement is at least the halves' checked agreement (a larger margin re-runs more)."""
    half = len(outputs) // 2
    halves = (slice(0, half), slice(half, len(outputs)))
    splits = []
    for fitted, other in (halves, halves[::-1]):
        margin = fit_margin(outputs[fitted], reference[fitted], relative)
        splits.append(
            Split(
                margin,
                not missed(outputs[fitted], reference[fitted], margin, relative).any(),
                len(outputs[other]),
                int(missed(outputs[other], reference[other], margin, relative).sum()),
            )
        )
    return max(split.margin for split in splits), splits


class CascadeEngine(Engine):
    """A fast engine with f32 behind it on the same backend (see the module's doc)."""

    def __init__(self, fast: Engine, exact: Engine, margin: float, name: str) -> None:
        super().__init__(fast.spec, fast.network, fast.batch, fast.device, fast.threads, name)
        self.fast, self.exact, self.margin = fast, exact, margin
        self.relative = relative(name)
        self.calibration = fast.calibration
        self.output_shape = fast.output_shape
        self.allocated = fast.allocated

    def describe(self) -> str:
        """``openvino bf16+f32 batch 16``."""
        return f"{self.fast.backend} {self.precision} batch {self.batch}"

    def feed(self, images: np.ndarray) -> np.ndarray:
        return images  # each engine feeds itself

    def forward(self, batch: np.ndarray) -> np.ndarray:
        return self.run(batch)

    def prepare(self, dtype: np.dtype) -> float:
        return self.fast.prepare(dtype) + self.exact.prepare(dtype)

    def run(
        self,
        images: np.ndarray,
        stop: Callable[[], bool] | None = None,
        tally: Callable[[int, float], None] | None = None,
        then: Callable[[], None] | None = None,
    ) -> np.ndarray:
        """The fast outputs, with those in doubt replaced by f32's; ``last_run`` counts the
        images re-run (``RunStats.rerun``) and both engines' seconds."""
        outputs = self.fast.run(images, stop, tally)
        doubtful = np.flatnonzero(in_doubt(outputs, self.margin, self.relative))
        stats = RunStats(self.fast.last_run.device, self.fast.last_run.copy)
        if len(doubtful):
            outputs[doubtful] = self.exact.run(images[doubtful], stop)
            stats.device += self.exact.last_run.device
            stats.copy += self.exact.last_run.copy
        stats.rerun = tuple(doubtful.tolist())
        self.last_run = stats
        self.allocated = max(self.fast.allocated, self.exact.allocated)
        return outputs

    @property
    def grown(self) -> bool:
        return self.fast.grown or self.exact.grown

    def rest(self) -> None:
        for engine in (self.fast, self.exact):
            if engine.grown:
                engine.rest()
        self.allocated = self.spec.batch
