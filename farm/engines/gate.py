"""The precision gate: ``--precision auto`` runs a job in the fastest precision whose
answers agree with f32 on the user's own images, and never below that.

Each precision the gate's engine offers below f32 on this CPU is a candidate: bf16 and
f16 where OpenVINO lists them in the CPU's capabilities, int8 where the model has a
version made by ``farm models quantize`` and the CPU has VNNI or AMX (without them its
8-bit sums can saturate).  The validation images run in f32 and in each candidate on the
same engine, on one thread as a pinned worker runs (in a process of its own for a command
that starts a farm next: ``judge_apart``); a candidate's verdict is its top-1
agreement with f32, its largest output difference (relative to f32's largest
output), its speed over f32 timed in alternating windows of the same run, and its
accuracy where the images have labels.  It passes when it agrees on at least
``min_agreement`` of the images and is faster than f32.

The verdicts are remembered (``$FARM_CACHE/precision``), keyed by the model's digest, the
validation set's, the int8 version's calibration, the engine, this CPU (name and
precision flags) and the libraries' versions; the threshold is applied when they are
read, so another ``--min-agreement`` needs no new run.  The job carries the passed
precisions on the gate's engine, fastest first and ending in f32 (an ``EngineChoice``,
``openvino:int8@3fa9c1e2d4b5,bf16,f32`` as text): each CPU worker takes the first it
computes in, exactly the int8 version judged, so a farm of mixed CPUs runs
each worker at its own best gated precision; GPU workers run f32.

Each candidate also runs as a cascade (``bf16+f32``, ``farm.engines.cascade``): the
images whose fast top-1 to top-2 margin is small run again in f32.  Its margin is fitted
on each half of the validation images and checked on the other (the verdict's agreement
counts the images the other half's margin would miss); the job's margin is the larger,
which catches every changed image of the set.  Its speed comes from its parts' timed
speeds and its share re-run (``cascade_speedup``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from farm import defaults
from farm.engines import quantize
from farm.engines.autoselect import device_key, remember_file, time_batches, versions
from farm.engines.cascade import in_doubt, relative, split_check
from farm.engines.cpu import fast_int8, precision_flags
from farm.engines.engine import AUTO, Engine, engine_class
from farm.engines.tolerances import relative_difference
from farm.modelrepo.modelstore import manifest_of
from farm.modelrepo.repository import ModelError, ModelSpec, cache_root
from farm.wire.engines import (
    CALIBRATION_PREFIX,
    CASCADE,
    EngineChoice,
    fast_precision,
    is_cascade,
)

log = logging.getLogger("farm.engines.gate")

#: Top-1 agreement with f32 a precision needs by default (``--min-agreement``).
MIN_AGREEMENT = defaults.MIN_AGREEMENT / 100
#: Fewest validation images: below this one image moves the agreement by more than 1%.
MIN_VALIDATION = 100
#: Candidates below f32, in the order they are tried; each also as a cascade (``bf16+f32``).
CANDIDATES = ("bf16", "f16", "int8")
#: What the remembered verdicts hold: verdicts remembered before cascades are measured anew.
VERDICTS_VERSION = "cascades-1"
#: The backends that run lower precisions on a CPU, the first installed gating.
GATE_BACKENDS = ("openvino", "onnxruntime")
#: The compute batch of the timing windows, and the windows' rounds and seconds.
TIMING_BATCH, TIMING_ROUNDS, TIMING_WINDOW = 16, 3, 0.25


@dataclass
class Verdict:
    """One precision against f32 on the validation images."""

    precision: str
    images: int
    agreement: float = 0.0  # share of images whose top-1 class is f32's
    difference: float = 0.0  # largest output difference over f32's largest output
    speedup: float = 0.0  # images/s over f32's, same engine, same threads
    accuracy: float | None = None  # against the images' labels, where there are some
    problem: str | None = None  # why it was not run here
    # a cascade's: its margin, the share of the images it runs again in f32, and the
    # changed images its halves' margins missed on the other half (``agreement``'s count)
    margin: float | None = None
    rerun: float | None = None
    missed: int = 0

    def passes(self, min_agreement: float) -> bool:
        return self.problem is None and self.agreement >= min_agreement and self.speedup > 1.0

    def describe(self) -> str:
        """``int8: 3.4x f32, top-1 agrees on 99.4% of 300 images (largest difference 2e-2)``;
        a cascade: ``bf16+f32: 1.7x f32, 9.8% of images re-run in f32, top-1 agrees on
        100.0% of 300 validation images, each half checked with the margin fitted on the
        other (margin 0.41)``."""
        if self.problem is not None:
            return f"{self.precision}: not tried: {self.problem}"
        accuracy = "" if self.accuracy is None else f", accuracy {self.accuracy:.1%}"
        if self.margin is not None:
            return (
                f"{self.precision}: {self.speedup:.1f}x f32, {self.rerun or 0:.1%} of images "
                f"re-run in f32, top-1 agrees on {self.agreement:.1%} of {self.images} "
                f"validation images, each half checked with the margin fitted on the other "
                f"(margin {self.margin:.3g}{accuracy})"
            )
        return (
            f"{self.precision}: {self.speedup:.1f}x f32, top-1 agrees on {self.agreement:.1%} "
            f"of {self.images} images (largest difference {self.difference:.1e}{accuracy})"
        )


@dataclass
class Gate:
    """The verdicts on one model and validation set, and what they allow."""

    model: str
    validation: str  # the validation set's digest
    images: int
    backend: str
    verdicts: list[Verdict]
    f32_accuracy: float | None = None
    calibration: str | None = None  # the int8 version judged (its calibration digest)
    min_agreement: float = MIN_AGREEMENT
    cached: bool = field(default=False, compare=False)

    @property
    def passed(self) -> list[Verdict]:
        """The precisions that pass, fastest first."""
        passing = [v for v in self.verdicts if v.passes(self.min_agreement)]
        return sorted(passing, key=lambda verdict: -verdict.speedup)

    def engine_choice(self, backend: str = AUTO) -> EngineChoice:
        """What the job asks the workers for: f32 on ``backend``, or the passed precisions
        on the gate's backend, fastest first, int8 naming the version judged, then f32 on
        ``backend``."""
        passed = tuple(verdict.precision for verdict in self.passed)
        if not passed:
            return EngineChoice(backend)
        version = self.calibration[:CALIBRATION_PREFIX] if self.calibration else None
        int8 = any(fast_precision(name) == "int8" for name in passed)
        margins = tuple(v.margin or 0.0 for v in self.passed if is_cascade(v.precision))
        return EngineChoice(
            backend, (*passed, "f32"), self.backend, version if int8 else None, margins
        )

    @property
    def precision(self) -> str:
        """``engine_choice``'s precision as ``--precision`` takes it (``f32``, or
        ``openvino:int8@3fa9c1e2d4b5,bf16,f32``)."""
        return self.engine_choice().precision_text()

    def refuse(self, precision: str, reason: str) -> None:
        """Keep ``precision`` and its cascade out of this job (their verdicts stay remembered
        as measured)."""
        for verdict in self.verdicts:
            if fast_precision(verdict.precision) == precision and verdict.problem is None:
                verdict.problem = reason

    def lines(self) -> list[str]:
        """The gate as the job's output shows it, one line per precision, then the choice."""
        accuracy = "" if self.f32_accuracy is None else f"; f32's accuracy {self.f32_accuracy:.1%}"
        lines = [
            f"precision gate on {self.images} validation images ({self.backend}, one thread"
            f"{', remembered' if self.cached else ''}): top-1 agreement with f32 of at least "
            f"{self.min_agreement:.1%} needed{accuracy}"
        ]
        problems = {v.precision: v.problem for v in self.verdicts}
        for verdict in self.verdicts:
            fast = fast_precision(verdict.precision)
            same = fast != verdict.precision and verdict.problem == problems.get(fast)
            if verdict.problem is not None and same:
                continue  # its cascade is not tried for the same reason: one line
            mark = "passes" if verdict.passes(self.min_agreement) else "refused"
            lines.append(f"  {verdict.describe()}{'' if verdict.problem else f': {mark}'}")
        lines.append(f"  {self.choice()}")
        return lines

    def choice(self) -> str:
        best = self.passed
        if not best:
            return "running in f32: no lower precision passed"
        return f"running in {best[0].precision} on {self.backend} ({best[0].speedup:.1f}x f32)"

    def verdict(self, precision: str) -> Verdict | None:
        return next((v for v in self.verdicts if v.precision == precision), None)


def judge(
    spec: ModelSpec,
    images: np.ndarray,
    labels: np.ndarray | None = None,
    min_agreement: float = MIN_AGREEMENT,
    threads: int | None = 1,
    backend: str = AUTO,
    use_cache: bool = True,
    int8_anywhere: bool = False,
) -> Gate:
    """The gate's verdicts on ``images`` (uint8, the model's item shape) on ``backend``
    (``auto``: ``GATE_BACKENDS``' first), from the cache when this validation set was
    judged here before; ModelError for too few images.  ``int8_anywhere``: try int8 on a
    CPU without VNNI or AMX too (benches and tests: workers there do not run it)."""
    if len(images) < MIN_VALIDATION:
        raise ModelError(
            f"{len(images)} validation images are too few for the precision gate: below "
            f"{MIN_VALIDATION}, one image moves the agreement by more than 1%"
        )
    engine = engine_class(backend_name(backend))
    validation = set_digest(images, labels)
    path = cache_path(spec, validation, threads, engine.backend)
    gate = remembered(path) if use_cache and not int8_anywhere else None
    if gate is None:
        gate, transient = measure(spec, engine, images, labels, threads, validation, int8_anywhere)
        if use_cache and not transient and not int8_anywhere:
            remember_file(path, {**asdict(gate), "cached": True})
    gate.min_agreement = min_agreement
    return gate


def judge_input(
    spec: ModelSpec,
    input_key: str,
    sample: Callable[[], tuple[np.ndarray, np.ndarray | None]],
    min_agreement: float = MIN_AGREEMENT,
    backend: str = AUTO,
) -> Gate:
    """``judge`` for a command that starts a farm next: on the images ``sample`` decodes
    (and their labels), decoding them only when no verdicts are remembered for the input
    ``input_key`` names (its files' paths, sizes and times, or its rows), and measuring in
    a process of its own (``judge_apart``).  Reading remembered verdicts imports no
    inference library."""
    engine = backend_name(backend)
    index = cache_root() / "precision" / "inputs" / f"{spec.name}-{input_key[:32]}.json"
    try:
        validation = json.loads(index.read_text())["validation"]
        gate = remembered(cache_path(spec, validation, 1, engine))
    except (OSError, ValueError, KeyError, TypeError):
        gate = None
    if gate is None:
        images, labels = sample()
        gate = judge_apart(spec, images, labels, min_agreement, engine)
        remember_file(index, {"validation": gate.validation})
    gate.min_agreement = min_agreement
    return gate


def judge_apart(
    spec: ModelSpec,
    images: np.ndarray,
    labels: np.ndarray | None,
    min_agreement: float,
    backend: str,
) -> Gate:
    """``judge`` in a fresh interpreter (``spawn``), so that the inference libraries it
    loads never enter the caller: ``farm run`` forks its farm after the gate, and a library
    imported, with threads running, before a fork can deadlock the children's imports."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        try:
            return pool.submit(judge, spec, images, labels, min_agreement, 1, backend).result()
        except BrokenProcessPool as exc:
            raise ModelError(f"the precision gate's process died: {exc}") from exc


def set_digest(images: np.ndarray, labels: np.ndarray | None) -> str:
    hasher = hashlib.sha256(quantize.images_digest(images).encode())
    if labels is not None:
        hasher.update(np.ascontiguousarray(labels).data)
    return hasher.hexdigest()


def cache_path(spec: ModelSpec, validation: str, threads: int | None, backend: str) -> Path:
    """Where the verdicts are remembered: per model, validation set, int8 version, engine,
    CPU (name and precision flags), thread count and library versions."""
    digest = manifest_of(spec).digest
    record = quantize.recorded(spec, digest)
    key = hashlib.sha256(
        json.dumps(
            [
                validation,
                record.calibration_digest if record else None,
                backend,
                device_key("cpu", threads),
                precision_flags(),
                VERDICTS_VERSION,
                versions(),
                quantize.library_versions(),
            ]
        ).encode()
    ).hexdigest()
    return cache_root() / "precision" / f"{spec.name}-{digest[:16]}-{key[:16]}.json"


def remembered(path: Path) -> Gate | None:
    try:
        document = json.loads(path.read_text())
        verdicts = [Verdict(**verdict) for verdict in document.pop("verdicts")]
        return Gate(**document, verdicts=verdicts)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.warning("ignoring unreadable precision verdicts %s: %s", path, exc)
        return None


def remembered_for(spec: ModelSpec) -> list[Gate]:
    """Every gate remembered here for the model's current files, newest first."""
    digest = manifest_of(spec).digest
    paths = (cache_root() / "precision").glob(f"{spec.name}-{digest[:16]}-*.json")
    ordered = sorted(paths, key=lambda path: -path.stat().st_mtime)
    return [gate for gate in map(remembered, ordered) if gate is not None]


def backend_name(backend: str = AUTO) -> str:
    """The engine that judges: ``backend``, or for ``auto`` the first of ``GATE_BACKENDS``
    installed (OpenVINO offers every precision on the CPU, ONNX Runtime int8 only); found
    without importing it."""
    if backend != AUTO:
        return backend
    for name in GATE_BACKENDS:
        if importlib.util.find_spec(name) is not None:
            return name
    raise ModelError(f"the precision gate needs {' or '.join(GATE_BACKENDS)}: pip install openvino")


def measure(
    spec: ModelSpec,
    backend: type[Engine],
    images: np.ndarray,
    labels: np.ndarray | None,
    threads: int | None,
    validation: str,
    int8_anywhere: bool = False,
) -> tuple[Gate, bool]:
    """Run the validation images in f32 and in each candidate, fit each candidate's
    cascade, and time them all in turn.  Also whether a candidate failed to load (a
    verdict not to remember)."""
    f32 = backend.load(spec, TIMING_BATCH, "cpu", threads, "f32")
    reference = flat(f32.run(images))
    offered = backend.precisions(spec, "cpu")
    record = quantize.recorded(spec)
    verdicts: list[Verdict] = []
    engines: list[tuple[Verdict, Engine]] = []
    transient = False
    for precision in CANDIDATES:
        verdict = Verdict(precision, len(images))
        cascade = Verdict(f"{precision}{CASCADE}", len(images))
        verdicts += [verdict, cascade]
        verdict.problem = unavailable(precision, offered, backend.backend, int8_anywhere)
        engine = None
        try:
            if verdict.problem is None:
                engine = backend.load(spec, TIMING_BATCH, "cpu", threads, precision)
        except ModelError as exc:
            verdict.problem, transient = str(exc), True
        cascade.problem = verdict.problem
        if engine is None or verdict.problem is not None:
            continue
        outputs = flat(engine.run(images))
        judge_outputs(verdict, outputs, reference, labels)
        fit_cascade(cascade, outputs, reference, labels)
        engines.append((verdict, engine))
    rates = alternating_rates([f32, *(engine for _, engine in engines)], images)
    for (verdict, _), rate in zip(engines, rates[1:]):
        verdict.speedup = round(rate / rates[0], 3)
    for verdict, cascade in zip(verdicts[::2], verdicts[1::2]):
        if cascade.problem is None:
            cascade.speedup = cascade_speedup(verdict.speedup, cascade.rerun or 0.0)
    gate = Gate(
        spec.name,
        validation,
        len(images),
        backend.backend,
        verdicts,
        accuracy(reference, labels),
        record.calibration_digest if record else None,
    )
    return gate, transient


def cascade_speedup(fast: float, rerun: float) -> float:
    """A cascade's speed over f32 from its parts: an image costs the fast precision's time,
    and a share ``rerun`` of them f32's time again (``bench/precision.py`` times the
    cascade itself as workers run it, and finds the same within its noise)."""
    return round(1 / (1 / fast + rerun), 3) if fast > 0 else 0.0


def text_margin(margin: float) -> float:
    """``margin`` to the 6 digits a job's text carries, rounded up, never down: a margin
    rounded down would let the changed image that set it through."""
    rounded = float(f"{margin:.6g}")
    return rounded if rounded >= margin else float(f"{margin * (1 + 1e-5):.6g}")


def judge_outputs(
    verdict: Verdict, outputs: np.ndarray, reference: np.ndarray, labels: np.ndarray | None
) -> None:
    """A precision's agreement with f32, its largest difference and its accuracy."""
    verdict.agreement = float((outputs.argmax(1) == reference.argmax(1)).mean())
    verdict.difference = relative_difference(outputs, reference)
    verdict.accuracy = accuracy(outputs, labels)


def fit_cascade(
    verdict: Verdict, outputs: np.ndarray, reference: np.ndarray, labels: np.ndarray | None
) -> float:
    """A cascade's verdict from its fast precision's outputs: the margin fitted on each
    half and checked on the other, the larger kept (``cascade.split_check``); its
    agreement counts the changed images the halves' margins missed.  The margin."""
    scaled = relative(verdict.precision)
    margin, splits = split_check(outputs, reference, scaled)
    margin = text_margin(margin)
    doubtful = in_doubt(outputs, margin, scaled)
    answered = np.where(doubtful[:, np.newaxis], reference, outputs)
    verdict.margin, verdict.rerun = margin, round(float(doubtful.mean()), 4)
    verdict.missed = sum(split.missed for split in splits)
    verdict.agreement = 1 - verdict.missed / max(1, sum(split.checked for split in splits))
    verdict.difference = relative_difference(answered, reference)
    verdict.accuracy = accuracy(answered, labels)
    return margin


def unavailable(
    precision: str, offered: tuple[str, ...], backend: str, int8_anywhere: bool = False
) -> str | None:
    """Why a candidate is not run on this CPU, or None."""
    if precision == "int8":
        if not fast_int8() and not int8_anywhere:
            return "this CPU has no VNNI or AMX: its int8 sums can saturate (docs/precision.md)"
        if "int8" not in offered:
            return "no int8 version of the model here (farm models quantize)"
        return None
    if precision not in offered:
        return f"{backend} does not offer {precision} on this CPU"
    return None


def flat(outputs: np.ndarray) -> np.ndarray:
    return outputs.reshape(len(outputs), -1)


def accuracy(outputs: np.ndarray, labels: np.ndarray | None) -> float | None:
    if labels is None:
        return None
    return float((outputs.argmax(1) == np.asarray(labels).reshape(-1)).mean())


def alternating_rates(
    engines: list[Engine],
    images: np.ndarray,
    rounds: int = TIMING_ROUNDS,
    window: float = TIMING_WINDOW,
) -> list[float]:
    """Each engine's images/s at ``TIMING_BATCH``, the best of ``rounds`` windows of
    ``window`` seconds taken in turn, so that a neighbour's burst slows one window, not
    one engine."""
    best = [0.0] * len(engines)
    for _ in range(rounds):
        for index, engine in enumerate(engines):
            rate = time_batches(engine, images, (TIMING_BATCH,), window)[TIMING_BATCH]
            best[index] = max(best[index], rate)
    return best
