"""What users would pick instead of farm, each at its best settings, timed the same way.

Each peer runs in a fresh process (``spawn``), makes the same images from the
model's sample, and is timed from "images in memory" to "every output in
memory, in input order", as a farm job is.  Settings are tuned first on a
slice of the images; the full array then runs once at the best of them.  Every
peer computes through farm's own engine (``farm.engines.engine``), so outputs can be
compared with the farm's and only the way work is spread differs.

- ``opencv-threads``: one process, OpenCV's own thread pool on every core,
  the whole array in batches of the best size;
- ``process-pool``: a ``multiprocessing`` pool of single-thread OpenCV
  processes, one per core, chunks of the best size;
- ``ray-data``: Ray Data ``map_batches`` with an actor pool of one
  single-thread actor per core, batches of the best size (needs ``ray[data]``);
- ``onnxruntime-threads``: one process, ONNX Runtime on farm's ONNX export with one
  intra-op thread per core, the whole array in batches of the best size;
- ``openvino-throughput``: one process, OpenVINO on farm's ONNX export compiled with
  ``PERFORMANCE_HINT: THROUGHPUT``, batches of the best size fed to an
  ``AsyncInferQueue`` of its optimal number of requests, each output written at its
  index as its request completes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from farm.benchsuite.measure import in_fresh_process
from farm.benchsuite.setups import make_images
from farm.engines.autoselect import load_engine
from farm.engines.engine import Engine, exported_onnx
from farm.engines.preprocess import Transformer
from farm.modelrepo.repository import find

PEERS = ("opencv-threads", "process-pool", "ray-data", "onnxruntime-threads", "openvino-throughput")
#: Settings each peer tries on the tuning slice.
CANDIDATES: dict[str, tuple[int, ...]] = {
    "opencv-threads": (16, 64, 256, 1024),  # compute batch
    "process-pool": (500, 2000, 8000),  # images per task
    "ray-data": (500, 2000, 8000),  # images per batch
    "onnxruntime-threads": (16, 64, 256, 1024),  # compute batch
    "openvino-throughput": (1, 8, 32, 128),  # images per inference request
}
#: Modules a peer needs beyond farm's own, and how to install them.
_NEEDS = {
    "ray-data": (("ray",), "pip install 'ray[data]', or farm's bench extra"),
    "onnxruntime-threads": (("onnxruntime", "onnx"), "pip install onnxruntime onnx"),
    "openvino-throughput": (("openvino", "onnx"), "pip install openvino onnx"),
}


@dataclass(frozen=True)
class PeerResult:
    peer: str
    setting: str  # the best setting, "batch 256"
    rate: float  # images/s on the full array
    seconds: float
    tuning: tuple[tuple[int, float], ...]  # (setting, images/s on the tuning slice)
    outputs: np.ndarray | None  # None once read back from a results folder
    note: str = ""
    best: int = 0  # the chosen setting, as a number
    round_: int = 0


def missing(peer: str) -> str | None:
    """Why ``peer`` cannot run here, or None."""
    modules, hint = _NEEDS.get(peer, ((), ""))
    absent = [name for name in modules if importlib.util.find_spec(name) is None]
    if absent:
        verb = "is" if len(absent) == 1 else "are"
        return f"{' and '.join(absent)} {verb} not installed ({hint})"
    return None


def run_peer(
    peer: str,
    model: str,
    total: int,
    tune: int,
    cores: int,
    setting: int | None = None,
    round_: int = 0,
) -> PeerResult:
    """Tune ``peer`` on ``tune`` images (among its candidates, or just ``setting``), then
    time it on ``total``, in a fresh process."""
    candidates = CANDIDATES[peer] if setting is None else (setting,)
    result = in_fresh_process(_RUNNERS[peer], model, total, tune, cores, candidates)
    return dataclasses.replace(result, round_=round_)


def _best(trials: Sequence[tuple[int, float]]) -> int:
    return max(trials, key=lambda trial: trial[1])[0]


def _timed(
    function: Callable[[np.ndarray], np.ndarray], images: np.ndarray
) -> tuple[np.ndarray, float]:
    started = time.perf_counter()
    outputs = function(images)
    return outputs, time.perf_counter() - started


def _single_thread_engine(model: str, batch: int | None = None) -> Engine:
    import cv2

    cv2.setNumThreads(1)
    return load_engine(find(model), "opencv", batch=batch, threads=1)


# ---- opencv-threads ---------------------------------------------------------------------


def _opencv_threads(
    model: str, total: int, tune: int, cores: int, candidates: Sequence[int]
) -> PeerResult:
    return _one_engine("opencv-threads", "opencv", None, model, total, tune, cores, candidates)


def _one_engine(
    peer: str,
    backend: str,
    threads: int | None,
    model: str,
    total: int,
    tune: int,
    cores: int,
    candidates: Sequence[int],
) -> PeerResult:
    """One process, one engine on every core (its own thread pool), at its best batch."""
    images = make_images(model, total)
    engines = {
        batch: load_engine(find(model), backend, batch=batch, threads=threads)
        for batch in candidates
    }
    trials = []
    for batch, engine in engines.items():
        engine.run(images[:batch])  # warm-up: buffers sized
        _, seconds = _timed(engine.run, images[:tune])
        trials.append((batch, tune / seconds))
    best = _best(trials)
    outputs, seconds = _timed(engines[best].run, images)
    return PeerResult(
        peer,
        f"batch {best}, {cores} threads",
        total / seconds,
        seconds,
        tuple(trials),
        outputs,
        best=best,
    )


# ---- process-pool -----------------------------------------------------------------------

_pool_engine: Engine | None = None


def _pool_start(model: str) -> None:
    global _pool_engine
    os.environ["OMP_NUM_THREADS"] = "1"
    _pool_engine = _single_thread_engine(model)


def _pool_task(images: np.ndarray) -> np.ndarray:
    if _pool_engine is None:
        raise RuntimeError("a pool task ran before the pool's initializer (_pool_start)")
    return _pool_engine.run(images)


def _pool_map(pool: multiprocessing.pool.Pool, images: np.ndarray, size: int) -> np.ndarray:
    pieces = (images[start : start + size] for start in range(0, len(images), size))
    return np.concatenate(list(pool.imap(_pool_task, pieces)))


def _process_pool(
    model: str, total: int, tune: int, cores: int, candidates: Sequence[int]
) -> PeerResult:
    images = make_images(model, total)
    context = multiprocessing.get_context("spawn")
    with context.Pool(cores, initializer=_pool_start, initargs=(model,)) as pool:
        _pool_map(pool, images[: cores * 64], 64)  # warm-up: every process loaded
        trials = []
        for size in candidates:
            _, seconds = _timed(partial(_pool_map, pool, size=size), images[:tune])
            trials.append((size, tune / seconds))
        best = _best(trials)
        outputs, seconds = _timed(lambda part: _pool_map(pool, part, best), images)
    return PeerResult(
        "process-pool",
        f"{cores} processes, chunks of {best}",
        total / seconds,
        seconds,
        tuple(trials),
        outputs,
        best=best,
    )


# ---- ray-data ---------------------------------------------------------------------------


class _RayPredictor:
    """A Ray Data actor: one single-thread engine."""

    def __init__(self, model: str) -> None:
        self.engine = _single_thread_engine(model)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"outputs": self.engine.run(batch["data"])}


def _ray_map(images: np.ndarray, model: str, size: int, cores: int) -> np.ndarray:
    import ray

    # one block per batch: a single block (from_numpy of one array) feeds one actor only
    blocks = np.array_split(images, max(cores, -(-len(images) // size)))
    dataset = ray.data.from_numpy(blocks).map_batches(
        _RayPredictor,
        fn_constructor_args=(model,),
        batch_size=size,
        num_cpus=1,
        compute=ray.data.ActorPoolStrategy(size=cores),
        batch_format="numpy",
    )
    return np.concatenate(
        [batch["outputs"] for batch in dataset.iter_batches(batch_size=None, batch_format="numpy")]
    )


def _ray_data(
    model: str, total: int, tune: int, cores: int, candidates: Sequence[int]
) -> PeerResult:
    import ray

    images = make_images(model, total)
    ray.init(
        num_cpus=cores, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR
    )
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # outputs in input order, as farm's
    context.enable_progress_bars = False
    try:
        started = time.perf_counter()
        _ray_map(images[:cores], model, 1, cores)
        startup = time.perf_counter() - started
        trials = []
        for size in candidates:
            _, seconds = _timed(
                partial(_ray_map, model=model, size=size, cores=cores), images[:tune]
            )
            trials.append((size, tune / seconds))
        best = _best(trials)
        outputs, seconds = _timed(lambda part: _ray_map(part, model, best, cores), images)
    finally:
        ray.shutdown()
    return PeerResult(
        "ray-data",
        f"{cores} actors, batches of {best}",
        total / seconds,
        seconds,
        tuple(trials),
        outputs,
        note=f"each run starts its actor pool: {startup:.1f} s for a {cores}-image run",
        best=best,
    )


# ---- onnxruntime-threads ----------------------------------------------------------------


def _onnxruntime_threads(
    model: str, total: int, tune: int, cores: int, candidates: Sequence[int]
) -> PeerResult:
    return _one_engine(
        "onnxruntime-threads", "onnxruntime", cores, model, total, tune, cores, candidates
    )


# ---- openvino-throughput ----------------------------------------------------------------


class _OpenVINOQueue:
    """OpenVINO's throughput mode as its documentation shows it: a model compiled with
    ``PERFORMANCE_HINT: THROUGHPUT`` (several streams over the cores) and an
    ``AsyncInferQueue`` of its optimal number of requests, kept full."""

    def __init__(self, model: str, cores: int) -> None:
        import openvino

        spec = find(model)
        self.transform = Transformer.for_model(spec)
        core = openvino.Core()
        self.compiled = core.compile_model(
            core.read_model(str(exported_onnx(spec))),
            "CPU",
            {
                "PERFORMANCE_HINT": "THROUGHPUT",
                "INFERENCE_NUM_THREADS": cores,
                "INFERENCE_PRECISION_HINT": "f32",
            },
        )  # stated: a bf16 CPU's default is bf16
        self.jobs = int(self.compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS"))
        self.streams = int(self.compiled.get_property("NUM_STREAMS"))
        self.queue = openvino.AsyncInferQueue(self.compiled, self.jobs)
        self.queue.set_callback(self._done)
        probe = self.transform(np.zeros((1, *spec.item_shape), np.float32))
        self.output_shape = self.compiled({0: probe})[0].shape[1:]
        self.outputs: np.ndarray | None = None

    def _done(self, request, userdata: tuple[int, np.ndarray]) -> None:
        begin, batch = userdata  # the batch rides along: its memory is shared with the request
        if self.outputs is not None:  # None: no run waits for it any more
            self.outputs[begin : begin + len(batch)] = request.get_output_tensor(0).data

    def run(self, images: np.ndarray, size: int) -> np.ndarray:
        self.outputs = np.empty((len(images), *self.output_shape), np.float32)
        for begin in range(0, len(images), size):
            batch = self.transform(images[begin : begin + size])
            self.queue.start_async({0: batch}, (begin, batch), share_inputs=True)
        self.queue.wait_all()
        outputs, self.outputs = self.outputs, None
        return outputs


def _openvino_throughput(
    model: str, total: int, tune: int, cores: int, candidates: Sequence[int]
) -> PeerResult:
    images = make_images(model, total)
    runner = _OpenVINOQueue(model, cores)
    trials = []
    for size in candidates:
        runner.run(images[: size * runner.jobs], size)  # warm-up: every request at this shape
        _, seconds = _timed(partial(runner.run, size=size), images[:tune])
        trials.append((size, tune / seconds))
    best = _best(trials)
    outputs, seconds = _timed(lambda part: runner.run(part, best), images)
    return PeerResult(
        "openvino-throughput",
        f"batches of {best}, {runner.jobs} requests, {runner.streams} streams",
        total / seconds,
        seconds,
        tuple(trials),
        outputs,
        best=best,
    )


_RUNNERS: dict[str, Callable[..., PeerResult]] = {
    "opencv-threads": _opencv_threads,
    "process-pool": _process_pool,
    "ray-data": _ray_data,
    "onnxruntime-threads": _onnxruntime_threads,
    "openvino-throughput": _openvino_throughput,
}
