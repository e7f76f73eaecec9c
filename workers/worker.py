"""A stateless DEALER worker: receive a chunk, run the model, reply with outputs and timings.

``--device cpu:N`` pins the process to core N and caps every compute library
at one thread; ``--device cpu`` runs unpinned with the libraries' defaults.
The worker keeps no job state: each TASK carries everything it needs.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from farm import protocol
from farm.engine import DEFAULT_BATCH, OpenCVEngine, limit_threads
from farm.protocol import Command, Message, ProtocolError
from farm.repository import ModelError, ModelSpec, available, find

log = logging.getLogger("farm.worker")

#: Commands a worker accepts from the broker.
ACCEPTED = frozenset({Command.TASK, Command.ERROR, Command.HEARTBEAT})

#: glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


@dataclass(frozen=True)
class Device:
    """A compute device: ``cpu`` (all cores) or ``cpu:N`` (pinned to core N)."""

    kind: str
    index: int | None = None

    @classmethod
    def parse(cls, text: str) -> Device:
        kind, _, index = text.partition(":")
        if kind != "cpu":
            raise ValueError(f"unsupported device {text!r}; use cpu or cpu:N")
        if index and not index.isdigit():
            raise ValueError(f"bad core number in {text!r}")
        return cls(kind, int(index) if index else None)

    @property
    def pinned(self) -> bool:
        return self.index is not None

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
        limit_threads(1)
        import cv2  # after limit_threads: OpenMP reads its variables when loaded

        cv2.setNumThreads(1)
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
    batch: int = DEFAULT_BATCH
    model_dirs: tuple[str, ...] = ()
    preload: tuple[str, ...] = ()
    slots: int = 2
    max_tasks: int | None = None  # exit after this many chunks (tests, benchmarks)


@dataclass
class Worker:
    """The worker's socket loop and its loaded engines."""

    config: WorkerConfig
    engines: dict[str, OpenCVEngine] = field(default_factory=dict)
    specs: dict[str, ModelSpec] = field(default_factory=dict)
    tasks_done: int = 0
    running: bool = True

    @property
    def threads(self) -> int | None:
        return 1 if self.config.device.pinned else None

    def engine(self, name: str) -> OpenCVEngine:
        """The loaded engine for a model, loading it the first time."""
        if name not in self.engines:
            spec = find(name, self.config.model_dirs)
            started = time.perf_counter()
            self.engines[name] = OpenCVEngine.load(spec, self.config.batch, self.threads)
            log.info("loaded model %s in %.3f s", name, time.perf_counter() - started)
        return self.engines[name]

    def advertised_models(self) -> dict[str, Any]:
        """Models this worker can run, with their input shapes."""
        models = {}
        for name in available(self.config.model_dirs):
            try:
                models[name] = find(name, self.config.model_dirs).summary()
            except ModelError as exc:
                log.warning("skipping model %s: %s", name, exc)
        return models

    def ready_header(self) -> dict[str, Any]:
        import cv2

        return {"device": str(self.config.device), "host": socket.gethostname(),
                "pid": os.getpid(), "backend": OpenCVEngine.backend,
                "threads": cv2.getNumThreads(), "models": self.advertised_models(),
                "loaded": sorted(self.engines), "slots": self.config.slots}

    def run(self, context: zmq.Context) -> None:
        """Serve chunks until stopped by a signal or ``max_tasks``."""
        for name in self.config.preload:
            self.engine(name)
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        sock.connect(self.config.broker)
        sock.send_multipart(protocol.encode(Command.READY, self.ready_header()))
        log.info("worker %s ready, broker %s", self.config.device, self.config.broker)
        try:
            while self.running:
                if not sock.poll(250):
                    continue
                received = time.perf_counter()
                frames = sock.recv_multipart(copy=False)
                reply = self.handle(frames, received)
                if reply:
                    sock.send_multipart(reply, copy=False)
                if self.config.max_tasks and self.tasks_done >= self.config.max_tasks:
                    break
        finally:
            sock.send_multipart(protocol.encode(Command.DISCONNECT))
            sock.close()

    def handle(self, frames: list[Any], received: float) -> list[Any] | None:
        """One incoming message (``received`` when its receive began) -> the reply frames."""
        try:
            message = protocol.decode(frames, allowed=ACCEPTED)
        except ProtocolError as exc:
            log.warning("dropped malformed message: %s", exc)
            return None
        if message.command is Command.ERROR:
            log.error("broker refused us: %s", message.header["error"])
            return None
        if message.command is Command.TASK:
            return self.run_task(message, received)
        return None

    def run_task(self, message: Message, received: float) -> list[Any]:
        """Run one chunk; FAILED with the reason when it cannot run.

        Timings: ``receive`` from the start of the receive to the decoded input
        (model loading excluded), ``compute`` the forward passes, ``send`` the
        building of the reply (the socket send itself is asynchronous).
        """
        header = message.header
        ids = {key: header[key] for key in ("job", "chunk", "start", "count")}
        try:
            if header["model"] not in self.engines:
                loading = time.perf_counter()
                self.engine(header["model"])
                received += time.perf_counter() - loading
            engine = self.engines[header["model"]]
            item_shape = tuple(header["item_shape"])
            if item_shape != engine.spec.input_shape:
                raise ValueError(f"item shape {item_shape} does not match model "
                                 f"{engine.spec.name!r} input {engine.spec.input_shape}")
            images = message.array(header["dtype"], item_shape)
            decoded = time.perf_counter()
            outputs = engine.run(images)
        except (ModelError, ValueError, ProtocolError) as exc:
            return protocol.encode(Command.FAILED, {**ids, "error": str(exc)})
        except Exception as exc:  # OpenCV errors and anything unforeseen stay per-chunk
            log.exception("chunk %s failed", ids)
            return protocol.encode(Command.FAILED, {**ids, "error": f"{type(exc).__name__}: {exc}"})
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
    worker = Worker(config)
    signal.signal(signal.SIGTERM, worker.stop)
    signal.signal(signal.SIGINT, worker.stop)
    context = zmq.Context()
    try:
        worker.run(context)
    finally:
        context.term()
