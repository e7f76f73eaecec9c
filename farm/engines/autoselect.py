"""``--backend auto``: time every installed backend on the model, keep the fastest that agrees.

When a worker loads a model it builds the model on each backend installed
here, runs the same check images on each, and compares every output with the
reference backend's (the first in ``BACKENDS`` order that runs the model, in
f32) within a relative tolerance.  A backend that disagrees is left out, with
the reason logged; when no backend confirms the reference, the model is
refused, naming both sides, since farm cannot tell which is right.  Each
backend that agrees is then timed for a fraction of a second at a few compute
batch sizes; the two fastest are timed again in turn at their best batches, and
the faster wins.

The choice is remembered on disk (``$FARM_CACHE/engines``), keyed by the model's
digest, the device and the precision; it records the libraries' versions, and a
choice made with other versions is timed again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field, fields
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from farm import defaults
from farm.engines import onnx_export
from farm.engines.cascade import CascadeEngine
from farm.engines.cpu import cpu_name, fast_int8
from farm.engines.engine import (
    AUTO,
    BACKENDS,
    BackendUnavailable,
    Engine,
    engine_class,
    release_free_memory,
)
from farm.engines.modelcheck import check_inputs
from farm.engines.tolerances import TOLERANCES, relative_difference
from farm.modelrepo.caffe_net import Network, NetworkError
from farm.modelrepo.modelstore import manifest_of
from farm.modelrepo.repository import ModelError, ModelSpec, cache_root, prepare
from farm.wire.engines import EngineChoice, fast_precision, is_cascade
from farm.wire.shapes import chunk_items

log = logging.getLogger("farm.engines.autoselect")

#: Compute batches tried (plus the prototxt's own), while one forward stays short; a GPU
#: also tries larger ones (a small net keeps an H100 busy only from a few hundred images).
BATCHES = (1, 8, 32, 128)
GPU_BATCHES = (256, 1024)
#: Seconds of timing per backend, shared among its batch sizes.
BUDGET = 0.3
#: The two fastest are timed again in turn, this many times, for this many seconds each.
RUNOFF_ROUNDS, RUNOFF_WINDOW = 2, 0.05
#: A batch whose single forward takes longer than this is the last one tried.
LONGEST_FORWARD = 0.1
#: How a trial whose library is missing begins its problem.
NOT_INSTALLED = "not installed: "
#: Check images compared between backends.
CHECK_IMAGES = 8

#: The distributions whose versions a cached choice depends on, by backend.
DISTRIBUTIONS = {
    "caffe": (),
    "opencv": ("opencv-python-headless", "opencv-python"),
    "torch": ("torch",),
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu", "onnx"),
    "openvino": ("openvino", "onnx"),
}


@dataclass
class Trial:
    """One backend's showing: its speed by batch, its difference from the reference, or why
    it was left out."""

    backend: str
    rates: dict[int, float] = field(default_factory=dict)  # compute batch -> images/s
    difference: float | None = None  # relative to the reference's largest output
    problem: str | None = None

    @property
    def best_batch(self) -> int:
        return max(self.rates, key=lambda batch: self.rates[batch])

    @property
    def best_rate(self) -> float:
        return max(self.rates.values(), default=0.0)


@dataclass
class Choice:
    """The backend and compute batch ``auto`` chose for one model on one device."""

    model: str
    device: str
    precision: str
    backend: str
    batch: int
    reference: str
    trials: list[Trial]
    versions: dict[str, str]
    cached: bool = False
    engine: Engine | None = None

    def loaded(self) -> Engine:
        """The chosen engine, loaded (``choose`` returns its choice so)."""
        if self.engine is None:
            raise ModelError(f"{self.model}: the {self.backend} engine was chosen, not loaded")
        return self.engine

    def describe(self) -> str:
        rate = next(t.best_rate for t in self.trials if t.backend == self.backend)
        return (
            f"{self.backend} {self.precision} batch {self.batch} "
            f"({rate:,.0f} images/s{', remembered' if self.cached else ''})"
        )

    def to_json(self) -> dict[str, Any]:
        document = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("engine", "cached")
        }
        document["trials"] = [asdict(trial) for trial in self.trials]
        return document

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> Choice:
        trials = [
            Trial(
                t["backend"],
                {int(b): r for b, r in t["rates"].items()},
                t["difference"],
                t["problem"],
            )
            for t in document.pop("trials")
        ]
        return cls(**document, trials=trials, cached=True)


@functools.cache
def versions() -> dict[str, str]:
    """Installed versions of every backend's libraries (and farm's own), read once."""
    found = {"farm": _version("farm")}
    for names in DISTRIBUTIONS.values():
        for name in names:
            if (version := _version(name)) is not None:
                found[name] = version
    return {name: version for name, version in found.items() if version is not None}


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def device_key(device: str, threads: int | None) -> str:
    """What the speeds depend on besides the model: device, thread count, processor."""
    processor = cpu_name()
    if device.startswith("cuda"):
        processor = _gpu_name(device) or device
    return f"{device.split(':')[0]}-{threads or 'all'}t-{processor}"


def _gpu_name(device: str) -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(int(device.partition(":")[2] or 0))
    except Exception:  # no torch, or no such device: the device name alone keys the cache
        return None


def cache_path(
    spec: ModelSpec,
    digest: str,
    device: str,
    threads: int | None,
    precision: str,
    batch: int | None = None,
) -> Path:
    """Where the choice is remembered; a fixed ``batch`` (only backends timed) is a choice
    of its own, and so is each format of farm's ONNX export (it changes the ONNX backends'
    speeds)."""
    key = hashlib.sha256(
        f"{device_key(device, threads)}|{precision}|{batch or 'best'}|"
        f"onnx-v{onnx_export.FORMAT}".encode()
    ).hexdigest()
    return cache_root() / "engines" / f"{spec.name}-{digest[:16]}-{key[:16]}.json"


def remembered(path: Path, current: dict[str, str]) -> Choice | None:
    """The cached choice at ``path``, if it was made with the libraries installed now."""
    try:
        choice = Choice.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring unreadable engine choice %s: %s", path, exc)
        return None
    if choice.versions != current:
        changed = sorted(
            name
            for name in {*current, *choice.versions}
            if current.get(name) != choice.versions.get(name)
        )
        log.info(
            "%s: the remembered engine choice was made with other library versions "
            "(%s): timing the backends again",
            choice.model,
            ", ".join(
                f"{n} {choice.versions.get(n, 'absent')} -> {current.get(n, 'absent')}"
                for n in changed
            ),
        )
        return None
    return choice


def remember(path: Path, choice: Choice) -> None:
    remember_file(path, choice.to_json())


def remember_file(path: Path, document: dict[str, Any]) -> None:
    """Write a JSON document to the cache through a temporary name; a read-only cache costs
    the next start its measuring, nothing more."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(document, indent=1))
        partial.replace(path)
    except OSError as exc:
        log.warning("cannot remember %s: %s", path, exc)


def load_engine(
    spec: ModelSpec,
    backend: str = defaults.BACKEND,
    batch: int | None = None,
    device: str = "cpu",
    threads: int | None = None,
    precision: str = defaults.PRECISION,
    digest: str | None = None,
) -> Engine:
    """A loaded engine in one precision: the named backend's, or for ``auto`` the fastest
    that agrees (``digest``: the model's, when the caller knows it)."""
    return load_one(spec, backend, batch, device, threads, precision, digest)


def load_chosen(
    spec: ModelSpec,
    choice: EngineChoice,
    batch: int | None = None,
    device: str = "cpu",
    threads: int | None = None,
    digest: str | None = None,
) -> Engine:
    """A loaded engine for a job's choice: for the precision gate's list, the first of its
    gated precisions this device computes in, on the backend that measured them, and only
    on a CPU (int8 only with VNNI or AMX, and only the version judged); else the last
    precision (f32, or one cascade on any device) on ``choice.backend``."""
    *gated, last = choice.precisions
    for precision in gated:
        if device != "cpu":
            log.info(
                "%s: %s not used on %s: the gate judged it on a CPU", spec.name, precision, device
            )
            continue
        if fast_precision(precision) == "int8" and not fast_int8():
            log.info("%s: %s not used: this CPU has no VNNI or AMX", spec.name, precision)
            continue
        try:
            return load_precision(spec, choice, precision, batch, device, threads)
        except ModelError as exc:
            log.info("%s: %s not used on %s: %s", spec.name, precision, device, exc)
    if is_cascade(last):
        return load_precision(spec, choice, last, batch, device, threads)
    return load_one(spec, choice.backend, batch, device, threads, last, digest)


def load_precision(
    spec: ModelSpec,
    choice: EngineChoice,
    precision: str,
    batch: int | None,
    device: str,
    threads: int | None,
) -> Engine:
    """One precision of a choice on the backend that measured it; a cascade loads its
    fast engine and an f32 one there (``farm.engines.cascade``)."""
    backend = engine_class(choice.cascade_backend)
    fast = fast_precision(precision)
    engine = backend.load(spec, batch, device, threads, fast, choice.calibration(precision))
    if not is_cascade(precision):
        return engine
    exact = backend.load(spec, rerun_batch(engine.batch), device, threads, "f32")
    return CascadeEngine(engine, exact, choice.margin(precision), precision)


def rerun_batch(batch: int) -> int:
    """A cascade's f32 batch: a quarter of the fast one's, at least 16 (or the fast one's,
    if smaller).  It runs the images in doubt, usually a small share of a chunk, and its
    buffers are most of its memory: SqueezeNet's f32 on OpenVINO adds 503 MiB at batch 64
    and 145 MiB at 16, beside int8's 181 MiB at 64 (``docs/precision.md``)."""
    return max(min(batch, 16), batch // 4)


def load_one(
    spec: ModelSpec,
    backend: str,
    batch: int | None,
    device: str,
    threads: int | None,
    precision: str,
    digest: str | None,
) -> Engine:
    """An engine in one precision on one backend, or on the one ``auto`` chooses."""
    if backend == AUTO:
        return choose(spec, device, threads, precision, batch, digest).loaded()
    return engine_class(backend).load(spec, batch, device, threads, precision)


def choose(
    spec: ModelSpec,
    device: str = "cpu",
    threads: int | None = None,
    precision: str = defaults.PRECISION,
    batch: int | None = None,
    digest: str | None = None,
    use_cache: bool = True,
) -> Choice:
    """The fastest agreeing backend for ``spec`` on ``device``, loaded (``choice.engine``).

    ``batch`` fixes the compute batch (only the backends are timed, and the choice is
    remembered apart from the one over every batch).  ModelError when no
    backend can run the model, or when the backends disagree with no one confirming the
    reference.
    """
    if digest is None:
        prepare(spec)
        digest = manifest_of(spec).digest
    path = cache_path(spec, digest, device, threads, precision, batch)
    current = versions()
    choice = remembered(path, current) if use_cache else None
    if choice is not None:
        choice.engine = engine_class(choice.backend).load(
            spec, choice.batch, device, threads, precision
        )
        return choice
    choice = time_backends(spec, device, threads, precision, batch, current)
    if use_cache:
        remember(path, choice)
    return choice


def time_backends(
    spec: ModelSpec,
    device: str,
    threads: int | None,
    precision: str,
    batch: int | None,
    current: dict[str, str],
) -> Choice:
    """Load, check and time every installed backend; the winner stays loaded."""
    check_files(spec)
    images = check_inputs(spec, CHECK_IMAGES)
    trials: list[Trial] = []
    reference: tuple[str, np.ndarray] | None = None
    leaders: list[tuple[Trial, Engine]] = []  # the two fastest so far, still loaded
    for backend in BACKENDS:
        trial = Trial(backend)
        trials.append(trial)
        engine = _load(trial, spec, device, threads, precision, batch)
        if engine is None:
            continue
        outputs = engine.run(images)
        if reference is None:
            reference = (
                backend,
                _reference_outputs(engine, spec, device, threads, precision, images, outputs),
            )
        if agrees(trial, outputs, reference, precision):
            most = chunk_items(spec.item_shape)
            sizes = (batch,) if batch else candidate_batches(spec.batch, device, most)
            trial.rates = time_batches(engine, images, sizes)
            leaders = sorted([*leaders, (trial, engine)], key=lambda pair: -pair[0].best_rate)[:2]
        del engine
    release_free_memory()
    refuse_unconfirmed(spec, trials, reference, precision)
    if not leaders:
        raise no_backend(spec, device, precision, trials)
    trial, winner = runoff(leaders, images)
    winner.batch = trial.best_batch
    reference_name = reference[0] if reference else winner.backend  # set once a backend ran
    choice = Choice(
        spec.name,
        device,
        precision,
        winner.backend,
        winner.batch,
        reference_name,
        trials,
        current,
        engine=winner,
    )
    log_choice(choice)
    return choice


def agrees(
    trial: Trial, outputs: np.ndarray, reference: tuple[str, np.ndarray], precision: str
) -> bool:
    """Whether a backend's outputs are the reference's within the precision's tolerance
    (else ``trial.problem`` says by how much they differ)."""
    trial.difference = relative_difference(outputs, reference[1])
    if trial.difference <= TOLERANCES[precision]:
        return True
    trial.problem = (
        f"its outputs differ from {reference[0]}'s by "
        f"{trial.difference:.1e} of their largest magnitude (tolerance "
        f"{TOLERANCES[precision]:g})"
    )
    return False


def no_backend(spec: ModelSpec, device: str, precision: str, trials: list[Trial]) -> ModelError:
    """Why no backend runs the model: each installed one's problem."""
    problems = "; ".join(
        f"{t.backend}: {t.problem}"
        for t in trials
        if t.problem and not t.problem.startswith(NOT_INSTALLED)
    )
    return ModelError(
        f"model {spec.name!r}: no backend runs it on {device} in {precision} ({problems})"
    )


def log_choice(choice: Choice) -> None:
    """The backends left out, with their reasons, then the choice and every backend's speed."""
    for each in choice.trials:
        if each.problem:
            log.info("%s: %s left out: %s", choice.model, each.backend, each.problem)
    log.info(
        "%s on %s: %s (%s)",
        choice.model,
        choice.device,
        choice.describe(),
        ", ".join(f"{t.backend} {t.best_rate:,.0f}/s" for t in choice.trials if t.rates),
    )


def runoff(leaders: list[tuple[Trial, Engine]], images: np.ndarray) -> tuple[Trial, Engine]:
    """The two fastest timed again in turn at their best batches, each keeping its best
    window: a neighbour's burst of work slows one window, not every one."""
    for _ in range(RUNOFF_ROUNDS):
        for trial, engine in leaders:
            size = trial.best_batch
            rate = time_batches(engine, images, (size,), RUNOFF_WINDOW, warm_up=False)[size]
            trial.rates[size] = max(trial.rates[size], rate)
    return max(leaders, key=lambda pair: pair[0].best_rate)


def check_files(spec: ModelSpec) -> None:
    """A broken model fails with its own error, not once per backend."""
    prepare(spec)
    try:
        Network.load(spec.prototxt, spec.weights, spec.declared_input)
    except NetworkError as exc:
        raise ModelError(f"model {spec.name!r}: {exc}") from None


def _load(
    trial: Trial,
    spec: ModelSpec,
    device: str,
    threads: int | None,
    precision: str,
    batch: int | None,
) -> Engine | None:
    """The backend's engine, or None with ``trial.problem`` saying why it cannot run."""
    try:
        return engine_class(trial.backend).load(spec, batch, device, threads, precision)
    except BackendUnavailable as exc:
        trial.problem = f"{NOT_INSTALLED}{exc}"
    except ModelError as exc:
        trial.problem = str(exc)
    except Exception as exc:  # a library's own error while building: leave it out, say why
        trial.problem = f"{type(exc).__name__}: {exc}"
    return None


def _reference_outputs(
    engine: Engine,
    spec: ModelSpec,
    device: str,
    threads: int | None,
    precision: str,
    images: np.ndarray,
    outputs: np.ndarray,
) -> np.ndarray:
    """The reference's outputs in f32 (the engine's own when it already computes in f32)."""
    if precision == "f32":
        return outputs
    return engine_class(engine.backend).load(spec, None, device, threads, "f32").run(images)


def refuse_unconfirmed(
    spec: ModelSpec, trials: list[Trial], reference: tuple[str, np.ndarray] | None, precision: str
) -> None:
    """ModelError when backends disagree with the reference and none confirms it."""
    if reference is None:
        return
    compared = {
        t.backend: t.difference
        for t in trials
        if t.difference is not None and t.backend != reference[0]
    }
    disagreeing = {
        name: difference
        for name, difference in compared.items()
        if difference > TOLERANCES[precision]
    }
    if disagreeing and len(disagreeing) == len(compared):
        raise ModelError(
            f"model {spec.name!r}: backends {reference[0]} and "
            f"{', '.join(disagreeing)} disagree (outputs differ by up to "
            f"{max(disagreeing.values()):.1e} of their largest magnitude, tolerance "
            f"{TOLERANCES[precision]:g}) and no other backend confirms {reference[0]}'s "
            f"outputs; farm will not guess which is right. Compare them with `farm models "
            f"check {spec.name}`, or choose one with --backend"
        )


def candidate_batches(
    resting: int, device: str = "cpu", most: int | None = None
) -> tuple[int, ...]:
    """The compute batches timed: ``BATCHES``, the prototxt's, and on a GPU larger ones,
    none above ``most`` (what one chunk holds: a larger batch would never fill), which is
    tried itself in their place."""
    larger = GPU_BATCHES if device.startswith("cuda") else ()
    sizes = {*BATCHES, *larger, resting}
    if most is not None and max(sizes) > most:
        sizes = {size for size in sizes if size <= most} | {most}
    return tuple(sorted(sizes))


def time_batches(
    engine: Engine,
    images: np.ndarray,
    batches: tuple[int, ...],
    budget: float = BUDGET,
    warm_up: bool = True,
) -> dict[int, float]:
    """Images/s of ``engine.forward`` at each batch, on what ``Engine.feed`` makes of the
    images (after a warm-up forward unless the engine already ran that batch), spending
    about ``budget`` seconds; batches after one whose forward exceeds ``LONGEST_FORWARD``
    are skipped, and so are those from one that fails once a smaller batch ran: out of
    memory, mostly (a GPU's memory holds batch 1024 of some nets, not of others)."""
    rates: dict[int, float] = {}
    share = budget / len(batches)
    for size in batches:
        try:
            batch = engine.feed(np.resize(images, (size, *images.shape[1:])))
            if warm_up:
                engine.forward(batch)
        except Exception as exc:
            if not rates:
                raise
            log.warning("batch %d left out on %s: %s", size, engine.describe(), exc)
            break
        runs, started = 0, time.perf_counter()
        while True:
            engine.forward(batch)
            runs += 1
            elapsed = time.perf_counter() - started
            if elapsed >= share:
                break
        rates[size] = runs * size / elapsed
        if elapsed / runs > LONGEST_FORWARD:
            break
    engine.allocated = max(engine.allocated, max(rates))
    return rates
