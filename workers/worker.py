"""A stateless DEALER worker: receive a chunk, run the model, reply with outputs and timings.

``--device cpu:N`` pins the process to core N and caps every compute library
at one thread; ``--device cpu`` runs unpinned with the libraries' defaults;
``--device gpu:N`` runs the torch backend on CUDA device N.  The worker keeps
no job state: each TASK carries everything it needs, down to the digest of its
model's files, which the worker fetches from the broker when it lacks them.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from farm import protocol
from farm.engine import (DEFAULT_BACKEND, GPU_BACKEND, Engine, engine_class, limit_threads,
                         load_engine)
from farm.modelstore import Manifest, ModelCache, manifest_of
from farm.protocol import Command, Message, ProtocolError
from farm.repository import ModelError, ModelSpec, available, find, load_spec, prepare

log = logging.getLogger("farm.worker")

#: Commands a worker accepts from the broker.
ACCEPTED = frozenset({Command.TASK, Command.MODEL, Command.ERROR, Command.HEARTBEAT})

#: Seconds a chunk waits for its model's files before it is reported FAILED.
FETCH_TIMEOUT = 120.0

#: glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


@dataclass(frozen=True)
class Device:
    """``cpu`` (all cores), ``cpu:N`` (pinned to core N) or ``gpu:N`` (CUDA device N)."""

    kind: str
    index: int | None = None

    @classmethod
    def parse(cls, text: str) -> Device:
        kind, _, index = text.partition(":")
        if kind not in ("cpu", "gpu"):
            raise ValueError(f"unsupported device {text!r}; use cpu, cpu:N or gpu:N")
        if index and not index.isdigit():
            raise ValueError(f"bad device number in {text!r}")
        return cls(kind, int(index) if index else (0 if kind == "gpu" else None))

    @property
    def pinned(self) -> bool:
        return self.kind == "cpu" and self.index is not None

    @property
    def engine_device(self) -> str:
        """The device name the engines take: ``cpu`` or ``cuda:N``."""
        return f"cuda:{self.index}" if self.kind == "gpu" else "cpu"

    @property
    def default_backend(self) -> str:
        return GPU_BACKEND if self.kind == "gpu" else DEFAULT_BACKEND

    def check(self) -> None:
        """A GPU must be visible to torch; ValueError says what torch sees instead."""
        if self.kind != "gpu":
            return
        engine_class(GPU_BACKEND)  # BackendUnavailable if torch is not installed
        import torch

        count = torch.cuda.device_count()
        if self.index >= count:
            raise ValueError(f"device {self}: torch {torch.__version__} sees "
                             f"{count} CUDA device(s)"
                             + ("" if count else " (a CPU-only build, or no GPU driver)"))

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


def prepare_process(device: Device) -> None:
    """Pin to the device's core, cap threads, and keep glibc from returning big buffers.

    Without the mallopt calls glibc maps and unmaps every large activation
    buffer on each batch, which costs a third of LeNet's speed at batch 256+.
    """
    if device.pinned:
        if device.index not in os.sched_getaffinity(0):
            raise ValueError(f"core {device.index} is not available to this process "
                             f"(allowed: {sorted(os.sched_getaffinity(0))})")
        os.sched_setaffinity(0, {device.index})
        limit_threads(1)  # before OpenCV or torch is imported: both read these when loaded
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)
    except OSError:
        log.debug("not glibc: malloc left as it is")


@dataclass
class WorkerConfig:
    broker: str
    device: Device
    batch: int | None = None  # None: each model's own prototxt batch
    model_dirs: tuple[str, ...] = ()
    preload: tuple[str, ...] = ()
    slots: int = 2
    max_tasks: int | None = None  # exit after this many chunks (tests, benchmarks)
    backend: str | None = None  # None: the device's default (opencv on CPUs, torch on GPUs)
    cache_dir: str | None = None  # None: $FARM_CACHE/models or ~/.cache/farm/models


Reply = list[Any]


@dataclass
class Worker:
    """The worker's socket loop, its loaded engines (by model digest) and its model cache.

    A TASK names its model and the model's digest.  The worker runs it from an
    engine it has already loaded, else from a local folder or cached copy with
    that digest, else it asks the broker for the files (FETCH), parks the task
    and every later one for that model, and runs them when the MODEL arrives.
    """

    config: WorkerConfig
    engines: dict[str, Engine] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)  # digest -> why it cannot load
    waiting: dict[str, list[tuple[Message, float]]] = field(default_factory=dict)
    fetch_sent: dict[str, float] = field(default_factory=dict)  # digest -> when FETCH went out
    fetched: dict[str, int] = field(default_factory=dict)  # model -> times fetched
    tasks_done: int = 0
    running: bool = True

    def __post_init__(self) -> None:
        self.cache = (ModelCache(Path(self.config.cache_dir)) if self.config.cache_dir
                      else ModelCache.default())
        self.backend = self.config.backend or self.config.device.default_backend
        engine_class(self.backend)  # fail at start if the backend's library is missing

    @property
    def threads(self) -> int | None:
        return 1 if self.config.device.pinned else None

    def local_models(self) -> dict[str, ModelSpec]:
        """Models in this host's repository folders, by name (broken ones skipped)."""
        specs = {}
        for name, folder in available(self.config.model_dirs).items():
            try:
                specs[name] = load_spec(folder)
            except ModelError as exc:
                log.warning("skipping model %s: %s", name, exc)
        return specs

    def load(self, spec: ModelSpec | None, digest: str) -> Engine:
        """Load a model once per digest; a failure is remembered and reported again."""
        if digest in self.broken:
            raise ModelError(self.broken[digest])
        if spec is None:
            raise ModelError(f"no files for model digest {digest[:12]}")
        if digest not in self.engines:
            try:
                self.engines[digest] = load_engine(spec, self.backend, self.config.batch,
                                                   self.config.device.engine_device, self.threads)
            except ModelError as exc:
                self.broken[digest] = str(exc)
                raise
            log.info("loaded model %s (%s) on %s", spec.name, digest[:12], self.backend)
        return self.engines[digest]

    def find_files(self, model: str, digest: str) -> ModelSpec | None:
        """A local or cached copy of the model with exactly this digest, if there is one."""
        folder = available(self.config.model_dirs).get(model)
        if folder is not None:
            try:
                spec = load_spec(folder)
                # generated weights not made here yet: fetch them rather than remake them
                if spec.weights.is_file() and manifest_of(spec).digest == digest:
                    return spec
            except (ModelError, OSError) as exc:
                log.warning("local model %s unusable: %s", model, exc)
        return self.cache.lookup(model, digest)

    def preload(self) -> None:
        for name in self.config.preload:
            spec = find(name, self.config.model_dirs)
            prepare(spec)
            self.load(spec, manifest_of(spec).digest)

    def ready_header(self) -> dict[str, Any]:
        return {"device": str(self.config.device), "host": socket.gethostname(),
                "pid": os.getpid(), "backend": self.backend, "threads": self.thread_count(),
                "models": {name: spec.summary() for name, spec in self.local_models().items()},
                "loaded": sorted({e.spec.name for e in self.engines.values()}),
                "slots": self.config.slots}

    def thread_count(self) -> int:
        if self.backend == "torch":
            import torch

            return torch.get_num_threads()
        import cv2

        return cv2.getNumThreads()

    def run(self, context: zmq.Context) -> None:
        """Serve chunks until stopped by a signal or ``max_tasks``."""
        self.preload()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        sock.connect(self.config.broker)
        sock.send_multipart(protocol.encode(Command.READY, self.ready_header()))
        log.info("worker %s (%s) ready, broker %s", self.config.device, self.backend,
                 self.config.broker)
        try:
            while self.running:
                for reply in self.expire_fetches():
                    sock.send_multipart(reply, copy=False)
                if not sock.poll(250):
                    continue
                received = time.perf_counter()
                frames = sock.recv_multipart(copy=False)
                for reply in self.handle(frames, received):
                    sock.send_multipart(reply, copy=False)
                if self.config.max_tasks and self.tasks_done >= self.config.max_tasks:
                    break
        finally:
            sock.send_multipart(protocol.encode(Command.DISCONNECT))
            sock.close()

    def handle(self, frames: list[Any], received: float) -> list[Reply]:
        """One incoming message (``received`` when its receive began) -> the replies to send."""
        try:
            message = protocol.decode(frames, allowed=ACCEPTED)
        except ProtocolError as exc:
            log.warning("dropped malformed message: %s", exc)
            return []
        if message.command is Command.ERROR:
            log.error("broker refused us: %s", message.header["error"])
        elif message.command is Command.TASK:
            return self.on_task(message, received)
        elif message.command is Command.MODEL:
            return self.on_model(message)
        return []

    def on_task(self, message: Message, received: float) -> list[Reply]:
        """Run a chunk now, or park it while its model's files are fetched."""
        model, digest = message.header["model"], message.header["digest"]
        if digest in self.waiting:
            self.waiting[digest].append((message, received))
            return []
        if digest not in self.engines and digest not in self.broken:
            try:
                spec = self.find_files(model, digest)
            except ModelError as exc:  # a name or digest that cannot be a cache folder
                return [self.failed(message, str(exc))]
            if spec is None:
                self.waiting[digest] = [(message, received)]
                self.fetch_sent[digest] = time.monotonic()
                log.info("fetching model %s (%s) from the broker", model, digest[:12])
                return [protocol.encode(Command.FETCH, {"model": model, "digest": digest})]
            return [self.run_task(message, received, spec)]
        return [self.run_task(message, received)]

    def on_model(self, message: Message) -> list[Reply]:
        """A model's files arrived: check and cache them, then run the chunks that waited."""
        header = message.header
        parked = self.waiting.pop(header["digest"], [])
        self.fetch_sent.pop(header["digest"], None)
        try:
            if "error" in header:
                raise ModelError(f"the broker cannot send model {header['model']!r}: "
                                 f"{header['error']}")
            manifest = Manifest.from_header(header)
            spec = self.cache.install(manifest, message.payload)
            self.fetched[manifest.model] = self.fetched.get(manifest.model, 0) + 1
        except ModelError as exc:  # not remembered: the next chunk of the model fetches again
            log.error("%s", exc)
            return [self.failed(task, str(exc)) for task, _ in parked]
        now = time.perf_counter()
        return [self.run_task(task, now, spec) for task, _ in parked]

    def expire_fetches(self) -> list[Reply]:
        """FAILED for the chunks parked on a FETCH the broker has not answered in time."""
        now, replies = time.monotonic(), []
        for digest, sent in list(self.fetch_sent.items()):
            if now - sent > FETCH_TIMEOUT:
                del self.fetch_sent[digest]
                error = f"no model files from the broker within {FETCH_TIMEOUT:.0f} s"
                replies += [self.failed(task, error) for task, _ in self.waiting.pop(digest, [])]
        return replies

    @staticmethod
    def failed(message: Message, error: str) -> Reply:
        ids = {key: message.header[key] for key in ("job", "chunk", "start", "count")}
        return protocol.encode(Command.FAILED, {**ids, "error": error})

    def run_task(self, message: Message, received: float,
                 spec: ModelSpec | None = None) -> Reply:
        """Run one chunk; FAILED with the reason when it cannot run.

        Timings: ``receive`` from the start of the receive to the decoded input
        (model loading excluded), ``compute`` the forward passes, ``send`` the
        building of the reply (the socket send itself is asynchronous).
        """
        header = message.header
        ids = {key: header[key] for key in ("job", "chunk", "start", "count")}
        try:
            if header["digest"] not in self.engines:
                loading = time.perf_counter()
                self.load(spec, header["digest"])
                received += time.perf_counter() - loading
            engine = self.engines[header["digest"]]
            item_shape = tuple(header["item_shape"])
            if item_shape != engine.spec.item_shape:
                raise ValueError(f"item shape {item_shape} does not match model "
                                 f"{engine.spec.name!r} input {engine.spec.item_shape}")
            images = message.array(header["dtype"], item_shape)
            decoded = time.perf_counter()
            outputs = engine.run(images)
        except (ModelError, ValueError, ProtocolError) as exc:
            return self.failed(message, str(exc))
        except Exception as exc:  # backend errors and anything unforeseen stay per-chunk
            log.exception("chunk %s failed", ids)
            return self.failed(message, f"{type(exc).__name__}: {exc}")
        computed = time.perf_counter()
        self.tasks_done += 1
        frames = protocol.array_frames(outputs)
        timings = {"receive": decoded - received, "compute": computed - decoded,
                   "send": time.perf_counter() - computed}
        return protocol.encode(Command.RESULT, {
            **ids, "dtype": "float32", "item_shape": list(outputs.shape[1:]),
            "timings": timings}, frames)

    def stop(self, *_: Any) -> None:
        self.running = False


def serve(config: WorkerConfig) -> None:
    """Prepare the process for its device and serve until SIGINT/SIGTERM."""
    prepare_process(config.device)
    config.device.check()
    worker = Worker(config)
    signal.signal(signal.SIGTERM, worker.stop)
    signal.signal(signal.SIGINT, worker.stop)
    context = zmq.Context()
    try:
        worker.run(context)
    finally:
        context.term()
