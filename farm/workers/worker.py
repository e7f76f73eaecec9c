"""A stateless DEALER worker: receive a chunk, run the model, reply with outputs and timings.

Two threads: the main thread owns the broker socket and keeps the link alive
(``farm.wire.link``, the ZeroMQ guide's Paranoid Pirate: heartbeats out on every interval,
the broker declared lost after ``liveness`` silent intervals, then a fresh
socket and a new READY, with back-off); the compute thread runs the chunks,
so a long chunk never silences the heartbeats.  Replies come back to the
main thread over an inproc pipe.  Chunks that arrived over a connection since
replaced are not run (the broker has requeued them); a result computed across
the reconnect goes out marked *kept*, and the results sent last are offered again
on every new connection (``farm.workers.kept``): a broker that restarted passes them
to the job's client, and the broker, which alone decides what counts, takes or drops
them.  A TASK of shared inputs (``farm.wire.storage``) names where its items lie; the
worker reads them itself, and a chunk it cannot read fails uncharged as
``unshared`` (the broker then sends it the bytes).

``--device cpu:N`` pins the process to core N and caps every compute library
at one thread; ``--device cpu`` runs unpinned with the libraries' defaults;
``--device gpu:N`` runs on CUDA device N.  Unless ``--backend`` names one, each
model runs on the backend ``auto`` picks when the model loads (the fastest that
agrees with the reference, remembered on disk).  The worker keeps
no job state: each TASK carries everything it needs, down to the digest of its
model's files, which the worker fetches from the broker when it lacks them.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import zmq

from farm import defaults
from farm.engines.autoselect import load_engine
from farm.engines.engine import (
    AUTO,
    GPU_BACKEND,
    Engine,
    RunStats,
    Stopped,
    engine_class,
    job_engine,
    limit_threads,
)
from farm.modelrepo.modelstore import Manifest, ModelCache, manifest_of
from farm.modelrepo.repository import (
    ModelError,
    ModelSpec,
    available,
    find_local,
    load_spec,
    prepare,
)
from farm.startup import Timeline
from farm.wire import messages, protocol
from farm.wire.link import BrokerLink, LinkConfig, recv_frames
from farm.wire.protocol import Command, Message, ProtocolError
from farm.wire.storage import ArrayFiles, UnsharedError, read_files
from farm.wire.wakeup import Wakeup
from farm.workers.kept import SentResults, as_kept

if TYPE_CHECKING:
    from farm.engines.images import ImageDecoder

log = logging.getLogger("farm.worker")

#: Commands a worker accepts from the broker.
ACCEPTED = frozenset(
    {
        Command.TASK,
        Command.MODEL,
        Command.ERROR,
        Command.HEARTBEAT,
        Command.DISCONNECT,
        Command.CANCEL,
    }
)

#: Cancelled job ids a worker remembers (its chunks of them are not run).
CANCELLED_MEMORY = 1000

#: Seconds a chunk waits for its model's files before it is reported FAILED.
FETCH_TIMEOUT = 120.0

#: Longest reason a worker gives for one image file that failed.
MAX_REASON = 500

#: Why a float32 item with a NaN or infinite pixel fails (its outputs are NaN).
NON_FINITE = "NaN or infinite pixels"

#: glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


#: ``--device cpu:bound``: the core this process was bound to (by ``srun --cpu-bind``).
BOUND = "bound"


def bound_core() -> int:
    """The core a ``cpu:bound`` worker pins itself to: the one it was bound to; of several
    (a core's hyperthreads shared by two tasks, or a whole step's cores where Slurm binds
    nothing), the one at its task's index on the node (``SLURM_LOCALID``), so that tasks
    sharing a set spread over it; else the first."""
    allowed = sorted(os.sched_getaffinity(0))
    local = os.environ.get("SLURM_LOCALID", "")
    if len(allowed) > 1 and local.isdigit():
        return allowed[int(local) % len(allowed)]
    return allowed[0]


@dataclass(frozen=True)
class Device:
    """``cpu`` (all cores), ``cpu:N`` (pinned to core N), ``cpu:bound`` (pinned to the core
    this process was bound to: ``bound_core``) or ``gpu:N`` (CUDA device N)."""

    kind: str
    index: int | None = None

    @classmethod
    def parse(cls, text: str) -> Device:
        kind, _, index = text.partition(":")
        if kind not in ("cpu", "gpu"):
            raise ValueError(f"unsupported device {text!r}; use cpu, cpu:N, cpu:bound or gpu:N")
        if kind == "cpu" and index == BOUND:
            return cls("cpu", bound_core())
        if index and not index.isdigit():
            raise ValueError(f"bad device number in {text!r}")
        return cls(kind, int(index) if index else (0 if kind == "gpu" else None))

    @property
    def pinned(self) -> bool:
        return self.kind == "cpu" and self.index is not None

    @property
    def default_slots(self) -> int:
        return defaults.GPU_SLOTS if self.kind == "gpu" else defaults.SLOTS

    @property
    def engine_device(self) -> str:
        """The device name the engines take: ``cpu`` or ``cuda:N``."""
        return f"cuda:{self.index}" if self.kind == "gpu" else "cpu"

    def check(self) -> None:
        """A GPU must be visible to torch (ValueError says what torch sees instead); it is
        then this process's current device, so that nothing lands on GPU 0 by default."""
        if self.kind != "gpu":
            return
        engine_class(GPU_BACKEND)  # BackendUnavailable if torch is not installed
        import torch

        count = torch.cuda.device_count()
        if (self.index or 0) >= count:
            raise ValueError(
                f"device {self}: torch {torch.__version__} sees "
                f"{count} CUDA device(s)"
                + ("" if count else " (a CPU-only build, or no GPU driver)")
            )
        torch.cuda.set_device(self.index or 0)

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


def prepare_process(device: Device) -> None:
    """Pin to the device's core, cap threads, and keep glibc from returning big buffers.

    Without the mallopt calls glibc maps and unmaps every large activation
    buffer on each batch, which costs a third of LeNet's speed at batch 256+.
    """
    if device.pinned:
        if device.index not in os.sched_getaffinity(0):
            raise ValueError(
                f"core {device.index} is not available to this process "
                f"(allowed: {sorted(os.sched_getaffinity(0))})"
            )
        os.sched_setaffinity(0, {device.index})
        limit_threads(1)  # before OpenCV or torch is imported: both read these when loaded
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)
        # one arena for every thread: a thread's own arena grows in 64 MB heaps and maps
        # anything larger afresh on each batch, which cost the compute thread a third of
        # LeNet's speed at batch 1 000
        libc.mallopt(_M_ARENA_MAX, 1)
    except OSError:
        log.debug("not glibc: malloc left as it is")


@dataclass(kw_only=True)
class WorkerConfig:
    broker: str
    device: Device
    batch: int | None = None  # None: each model's own prototxt batch
    model_dirs: tuple[str, ...] = ()
    preload: tuple[str, ...] = ()
    slots: int | None = None  # None: the device's default (Device.default_slots)
    max_tasks: int | None = None  # exit after this many chunks (tests, benchmarks)
    backend: str = defaults.BACKEND  # auto: the fastest agreeing backend, chosen per model
    cache_dir: str | None = None  # None: $FARM_CACHE/models or ~/.cache/farm/models
    heartbeat: float = defaults.HEARTBEAT  # seconds between heartbeats to the broker
    liveness: int = defaults.LIVENESS  # silent broker heartbeats before the worker reconnects
    curve: str | None = None  # a `farm keys` folder: connect with CurveZMQ ...
    curve_name: str = defaults.WORKER_KEY  # ... as this key
    fail_items: tuple[int, int] | None = None  # fault injection: chunks touching [a, b) fail
    precision: str = defaults.PRECISION  # f16 / bf16 where the engine and device offer them


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
    engines: dict[EngineKey, Engine] = field(default_factory=dict)
    broken: dict[EngineKey, str] = field(default_factory=dict)  # why it cannot load
    waiting: dict[str, list[tuple[Message, float]]] = field(default_factory=dict)
    fetch_sent: dict[str, float] = field(default_factory=dict)  # digest -> when FETCH went out
    fetched: dict[str, int] = field(default_factory=dict)  # model -> times fetched
    # --model names this host lacks: asked of the broker by name on every new connection
    # until it answers (compute thread)
    preloading: set[str] = field(default_factory=set)
    tasks_done: int = 0
    running: bool = True
    # jobs the broker cancelled, oldest first: written by the I/O thread, read by compute
    cancelled: dict[str, None] = field(default_factory=dict)
    cancelled_chunks: dict[int, None] = field(default_factory=dict)  # attempts, likewise
    # images computed and seconds spent computing them, counted batch by batch (compute
    # thread) and sent with every heartbeat (I/O thread): the broker's live view
    computed_images: int = 0
    computed_seconds: float = 0.0
    # model -> (images, compute seconds) of the chunks run: sent with READY, so a broker
    # that (re)starts knows this worker's speed before its first chunk (compute thread)
    speeds: dict[str, tuple[int, float]] = field(default_factory=dict)
    decoders: dict[str, ImageDecoder] = field(default_factory=dict)  # by model digest
    arrays: ArrayFiles = field(default_factory=ArrayFiles)  # shared .npy files (compute thread)
    sent: SentResults = field(default_factory=SentResults)  # offered again to a new broker
    startup: Timeline = field(default_factory=Timeline.of_this_process)  # sent with READY
    # the compute thread's queue, and the connection of the message it runs: a GPU engine
    # launches the next queued chunk before the current one's last batches are in
    upcoming: queue.Queue[QueuedMessage | None] | None = None
    serving: int = 0
    # the next chunk's message and pixels, launched ahead: its run_task takes these pixels
    prefetched: tuple[Message, np.ndarray] | None = None
    # whether the broker took this connection's READY (its first heartbeat came), whether
    # it ever did, and whether the silence of this wait was reported (I/O thread)
    registered: bool = False
    was_registered: bool = False
    silence_reported: bool = False
    started_waiting: float = 0.0  # monotonic clock when this worker began to wait

    def __post_init__(self) -> None:
        self.cache = (
            ModelCache(Path(self.config.cache_dir))
            if self.config.cache_dir
            else ModelCache.default()
        )
        self.backend = self.config.backend
        if self.backend != AUTO:
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

    def engine_key(self, task: messages.Task) -> EngineKey:
        """The engine a TASK runs on: its job's choice, else this worker's; ValueError for
        a malformed choice."""
        backend, precision = (
            job_engine(task.engine)
            if task.engine is not None
            else (self.backend, self.config.precision)
        )
        return EngineKey(task.digest, backend, precision)

    def load(self, spec: ModelSpec | None, key: EngineKey) -> Engine:
        """Load a model once per digest and engine; a failure is remembered and reported
        again."""
        if key in self.broken:
            raise ModelError(self.broken[key])
        if spec is None:
            raise ModelError(f"no files for model digest {key.digest[:12]}")
        if key not in self.engines:
            try:
                self.engines[key] = self.build_engine(spec, key)
            except ModelError as exc:
                self.broken[key] = str(exc)
                raise
            log.info(
                "loaded model %s (%s): %s", spec.name, key.digest[:12], self.engines[key].describe()
            )
        return self.engines[key]

    def build_engine(self, spec: ModelSpec, key: EngineKey) -> Engine:
        """The model on the key's backend, or on the one ``auto`` chooses."""
        return load_engine(
            spec,
            key.backend,
            self.config.batch,
            self.config.device.engine_device,
            self.threads,
            key.precision,
            key.digest,
        )

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
        """Load the ``--model`` models this host has; the others are fetched from the broker
        once connected (``preload_fetches``)."""
        for name in self.config.preload:
            spec = find_local(name, self.config.model_dirs)
            if spec is None:
                log.info("model %s is not on this host: fetching it from the broker", name)
                self.preloading.add(name)
                continue
            prepare(spec)
            self.load_preloaded(spec, manifest_of(spec).digest)

    def load_preloaded(self, spec: ModelSpec, digest: str) -> None:
        """Load a ``--model`` model on this worker's own engine, before any chunk needs it."""
        self.load(spec, EngineKey(digest, self.backend, self.config.precision))

    def preload_fetches(self) -> list[Reply]:
        """FETCH by name (empty digest: the broker's current copy) for each ``--model`` model
        still missing."""
        return [
            protocol.encode(Command.FETCH, messages.Fetch(model=name, digest=""))
            for name in sorted(self.preloading)
        ]

    def ready_header(self) -> messages.Ready:
        """The registration sent on every new connection to the broker: the models it can
        run (its disk's, and those it loaded, fetched ones included: ``loaded`` lists only
        advertised models, or the broker would ignore them), and what it brings."""
        models = {
            engine.spec.name: messages.ModelFacts(input_shape=engine.spec.item_shape)
            for engine in list(self.engines.values())
        }
        local = self.local_models()
        for name, spec in local.items():
            if len(models) < messages.MAX_MAP or name in models:  # a READY names at most 64
                models[name] = messages.ModelFacts(input_shape=spec.item_shape)
        if len(models) < len(local.keys() | models.keys()):
            log.warning(
                "this host has %d models; a READY names at most %d: the others are not "
                "advertised (jobs for them still run: the broker sends their files)",
                len(local.keys() | models.keys()),
                messages.MAX_MAP,
            )
        return messages.Ready(
            device=str(self.config.device),
            host=socket.gethostname(),
            pid=os.getpid(),
            backend=self.backend,
            models=models,
            slots=self.config.slots or self.config.device.default_slots,
            threads=self.thread_count(),
            loaded=tuple(sorted({e.spec.name for e in list(self.engines.values())})),
            engines=self.engine_names(),
            heartbeat=self.config.heartbeat,
            speeds=dict(self.speeds),
            startup=dict(self.startup.stamps),
        )

    def engine_names(self) -> dict[str, str]:
        """Model -> the engines running it (``openvino f32 batch 64``), for ``farm status``."""
        names: dict[str, list[str]] = {}
        for engine in list(self.engines.values()):
            names.setdefault(engine.spec.name, []).append(engine.describe())
        return {model: " + ".join(described) for model, described in names.items()}

    def thread_count(self) -> int:
        return self.threads or len(os.sched_getaffinity(0))

    def run(self, context: zmq.Context, wakeup: Wakeup | None = None) -> None:
        """Serve chunks until stopped by a signal (``wakeup`` ends a wait at once) or
        ``max_tasks``."""
        self.preload()
        self.startup.mark("loaded")
        config = self.config
        link = BrokerLink(
            context,
            LinkConfig(
                config.broker,
                config.heartbeat,
                config.liveness,
                config.curve,
                config.curve_name,
                linger_ms=1000,
            ),
            self.ready_header,
            self.heartbeat_header,
        )
        tasks: queue.Queue[QueuedMessage | None] = queue.Queue()
        self.upcoming = tasks
        pipe = context.socket(zmq.PAIR)
        pipe.bind(f"inproc://farm-worker-{id(self)}")
        compute = threading.Thread(
            target=self.compute_loop,
            name="compute",
            daemon=True,
            args=(context, f"inproc://farm-worker-{id(self)}", tasks, link),
        )
        compute.start()
        log.info(
            "worker %s (%s) started: waiting for the broker at %s (no answer yet)",
            self.config.device,
            self.backend,
            self.config.broker,
        )
        self.started_waiting = time.monotonic()
        try:
            self.io_loop(link, pipe, tasks, wakeup)
        finally:
            self.running = False
            tasks.put(None)
            compute.join(timeout=5.0)
            link.close(goodbye=True)
            pipe.close()

    def io_loop(
        self, link: BrokerLink, pipe: zmq.Socket, tasks: queue.Queue, wakeup: Wakeup | None = None
    ) -> None:
        """The main thread: broker messages in, replies out, the link's timers."""
        link.poller.register(pipe, zmq.POLLIN)
        if wakeup is not None:
            wakeup.watch(link.poller)
        while self.running:
            events = link.poll(link.wait())
            if link.socket in events:
                self.receive(link, tasks)
            if pipe in events:
                reply = recv_frames(pipe)
                self.sent.note(reply)
                link.send(reply)
                if self.config.max_tasks and self.tasks_done >= self.config.max_tasks:
                    return
            if link.tick():  # a new connection: the old one's fetches died
                self.report_silence(link)
                self.reconnected(link, tasks)

    def report_silence(self, link: BrokerLink) -> None:
        """A connection expired before the broker took its READY: say once what may be
        wrong (a broker that was lost is reported by the link itself)."""
        if self.registered or self.was_registered or self.silence_reported:
            return
        self.silence_reported = True
        keys = (
            f"the keys in {self.config.curve} are not the broker's"
            if self.config.curve
            else "the broker runs with --curve (this worker has no --curve keys)"
        )
        log.warning(
            "no answer from the broker at %s after %.0f s: is it running, and at that "
            "address? Or %s.  Still trying.",
            self.config.broker,
            time.monotonic() - self.started_waiting,
            keys,
        )

    def on_registered(self) -> None:
        """The broker took this connection's READY (its first heartbeat came)."""
        self.registered = True
        log.info(
            "registered with the broker at %s%s",
            self.config.broker,
            " again" if self.was_registered else "",
        )
        self.was_registered = True

    def reconnected(self, link: BrokerLink, tasks: queue.Queue) -> None:
        """A new connection (READY sent): the old one's fetches died; the results sent last
        are offered again, in case the broker that took them was lost."""
        self.registered = False
        tasks.put(QueuedMessage(link.generation, None, 0.0))
        for offer in self.sent.offers():
            link.send(offer)

    def receive(self, link: BrokerLink, tasks: queue.Queue) -> None:
        """One message from the broker: liveness, a reconnect order, or work for compute."""
        received = time.perf_counter()
        frames = recv_frames(link.socket)
        link.heard()
        try:
            message = protocol.decode(frames, allowed=ACCEPTED)
        except ProtocolError as exc:
            log.warning("dropped malformed message: %s", exc)
            return
        header = message.header
        if isinstance(header, messages.Heartbeat):
            link.heard(header.interval)
            if not self.registered:
                self.on_registered()
        elif isinstance(header, messages.Error) and header.registration:
            raise WorkerRefused(
                f"the broker at {self.config.broker} refused this worker's registration: "
                f"{header.error}.  Exiting, so that a fresh start (supervisord restarts "
                "it) registers anew"
            )
        elif isinstance(header, messages.Cancel) and header.chunk is not None:
            self.cancel_chunk(header.chunk)
        elif isinstance(header, messages.Cancel):
            self.cancel(header.job)
        elif message.command is Command.DISCONNECT:
            log.warning(
                "the broker does not know this worker (it restarted, or declared us "
                "dead): registering again"
            )
            link.reconnect()
            self.reconnected(link, tasks)
        else:
            tasks.put(QueuedMessage(link.generation, message, received))

    def cancel_chunk(self, chunk: int) -> None:
        """Remember an attempt the broker no longer wants (kept results answered it)."""
        self.cancelled_chunks[chunk] = None
        if len(self.cancelled_chunks) > CANCELLED_MEMORY:
            del self.cancelled_chunks[next(iter(self.cancelled_chunks))]

    def stopped(self, task: messages.Task) -> bool:
        """Whether the task's job, or the task itself, was cancelled."""
        return task.job in self.cancelled or task.chunk in self.cancelled_chunks

    def cancel(self, job: str) -> None:
        """Remember a cancelled job: its queued chunks are not run, its running one stops."""
        self.cancelled[job] = None
        if len(self.cancelled) > CANCELLED_MEMORY:
            del self.cancelled[next(iter(self.cancelled))]

    def compute_loop(
        self, context: zmq.Context, address: str, tasks: queue.Queue, link: BrokerLink
    ) -> None:
        """The compute thread: run tasks of the current connection, send the replies back."""
        pipe = context.socket(zmq.PAIR)
        pipe.connect(address)
        try:
            for reply in self.preload_fetches():
                pipe.send_multipart(reply, copy=False)
            while self.running:
                for reply in self.expire_fetches():
                    pipe.send_multipart(reply, copy=False)
                try:
                    queued = tasks.get(timeout=0.25)
                except queue.Empty:
                    self.rest_engines()
                    continue
                if queued is None:
                    return
                if queued.message is None:  # a new connection: parked chunks and fetches are void
                    self.waiting.clear()
                    self.fetch_sent.clear()
                    for reply in self.preload_fetches():
                        pipe.send_multipart(reply, copy=False)
                    continue
                if queued.generation != link.generation:
                    continue  # sent over a connection that was replaced: the broker requeued it
                self.serving = queued.generation
                for reply in self.dispatch(queued.message, queued.received):
                    if queued.generation != link.generation:  # the connection went meanwhile
                        reply = kept_reply(reply)
                    if reply:
                        pipe.send_multipart(reply, copy=False)
        finally:
            pipe.close(linger=0)

    def dispatch(self, message: Message, received: float) -> list[Reply]:
        match message.header:
            case messages.Error(error=error):
                log.error("broker refused us: %s", error)
            case messages.Task() as task:
                return self.on_task(message, task, received)
            case messages.Model() as model:
                return self.on_model(message, model)
        return []

    def on_task(self, message: Message, task: messages.Task, received: float) -> list[Reply]:
        """Run a chunk now, or park it while its model's files are fetched."""
        if self.stopped(task):  # nothing to load or fetch for it
            return [self.failed(message, "job cancelled", fatal=False, charge=False)]
        model, digest = task.model, task.digest
        if digest in self.waiting:
            self.waiting[digest].append((message, received))
            return []
        try:
            key = self.engine_key(task)
        except ValueError as exc:
            return [self.failed(message, str(exc))]
        if key not in self.engines and key not in self.broken:
            try:
                spec = self.find_files(model, digest)
            except ModelError as exc:  # a name or digest that cannot be a cache folder
                return [self.failed(message, str(exc))]
            if spec is None:
                self.waiting[digest] = [(message, received)]
                self.fetch_sent[digest] = time.monotonic()
                log.info("fetching model %s (%s) from the broker", model, digest[:12])
                return [protocol.encode(Command.FETCH, messages.Fetch(model=model, digest=digest))]
            return [self.run_task(message, received, spec)]
        return [self.run_task(message, received)]

    def on_model(self, message: Message, header: messages.Model) -> list[Reply]:
        """A model's files arrived: check and cache them, then run the chunks that waited."""
        parked = self.waiting.pop(header.digest, [])
        self.fetch_sent.pop(header.digest, None)
        try:
            if header.error is not None:
                raise ModelError(f"the broker cannot send model {header.model!r}: {header.error}")
            manifest = Manifest.from_header(header)
            spec = self.cache.install(manifest, message.payload)
            self.fetched[manifest.model] = self.fetched.get(manifest.model, 0) + 1
        except ModelError as exc:  # not remembered: the next chunk of the model fetches again
            if not header.digest and header.model in self.preloading:
                self.preloading.discard(header.model)
                log.error("cannot preload --model %s: %s; serving other models", header.model, exc)
            else:
                log.error("%s", exc)
            return [self.failed(task, str(exc)) for task, _ in parked]
        if header.model in self.preloading:
            self.preloading.discard(header.model)
            try:
                self.load_preloaded(spec, manifest.digest)
            except ModelError as exc:
                log.error("cannot preload --model %s: %s", header.model, exc)
        now = time.perf_counter()
        # the wait for the files counts as loading, as the engine's build does
        return [self.run_task(task, now, spec, waited=now - received) for task, received in parked]

    def expire_fetches(self) -> list[Reply]:
        """FAILED for the chunks parked on a FETCH the broker has not answered in time."""
        now, replies = time.monotonic(), []
        for digest, sent in list(self.fetch_sent.items()):
            if now - sent > FETCH_TIMEOUT:
                del self.fetch_sent[digest]
                error = f"no model files from the broker within {FETCH_TIMEOUT:.0f} s"
                replies += [
                    self.failed(task, error, fatal=False, charge=False)
                    for task, _ in self.waiting.pop(digest, [])
                ]
        return replies

    @staticmethod
    def failed(
        message: Message,
        error: str,
        fatal: bool = True,
        charge: bool = True,
        unshared: bool = False,
    ) -> Reply:
        """FAILED for a TASK's chunk: ``fatal`` when no worker could run it (the model is
        unusable), not fatal when another attempt may succeed; ``charge`` False when the
        chunk's items are not to blame (a cancelled job, a fetch that timed out);
        ``unshared`` when this worker cannot read the chunk's shared inputs."""
        task = message.header
        assert isinstance(task, messages.Task)  # only a TASK names a chunk to run
        return protocol.encode(
            Command.FAILED,
            messages.Failed(
                job=task.job,
                chunk=task.chunk,
                start=task.start,
                count=task.count,
                error=error,
                fatal=fatal,
                charge=charge,
                unshared=unshared,
            ),
        )

    def run_task(
        self, message: Message, received: float, spec: ModelSpec | None = None, waited: float = 0.0
    ) -> Reply:
        """Run one chunk; FAILED with the reason when it cannot run.

        Timings: ``load`` the seconds the chunk waited for its model's files
        (``waited``) and engine (a fresh worker's first chunk of a model: ``auto``
        times the engines then), ``receive`` from the start of the receive to the
        decoded input (model loading excluded), ``compute`` the forward passes (and the decoding of
        image files: the policies see a worker's whole cost per image), ``send`` the
        building of the reply (the socket send itself is asynchronous); ``device`` the
        part of ``compute`` the device spent computing (a GPU's, from CUDA events) and
        ``copy`` the host-device copies (a trace's GPU busy share comes from these).
        """
        task = message.header
        assert isinstance(task, messages.Task)
        try:
            key = self.engine_key(task)
            if key not in self.engines:
                loading = time.perf_counter()
                self.load(spec, key)
                loaded = time.perf_counter() - loading
                waited, received = waited + loaded, received + loaded
            engine = self.engines[key]
            engine.last_run = RunStats()  # a chunk whose every file fails computes nothing
            failures: list[tuple[int, int, str]] = []
            oriented = 0  # image files with an EXIF orientation
            if task.dtype == protocol.ENCODED:
                files, unread = self.chunk_files(message, task)
                decoded = time.perf_counter()  # decoding the files counts as compute
                outputs, failures, oriented = self.run_files(engine, files, unread, task)
            else:
                if task.item_shape != engine.spec.item_shape:
                    raise ValueError(
                        f"item shape {task.item_shape} does not match model "
                        f"{engine.spec.name!r} input {engine.spec.item_shape}"
                    )
                images = self.chunk_array(message, task)
                compiled = engine.prepare(images.dtype)  # a graph for a new dtype: loading
                waited, received = waited + compiled, received + compiled
                decoded = time.perf_counter()
                outputs, failures = self.run_array(engine, images, task)
            log.debug(
                "computed items %d..%d of job %s in %.3f s",
                task.start,
                task.start + task.count - 1,
                task.job,
                time.perf_counter() - decoded,
            )
            self.inject_fault(task.start, task.count)  # after the compute, which it wastes
        except Stopped as exc:
            return self.failed(message, f"job cancelled ({exc})", fatal=False, charge=False)
        except UnsharedError as exc:  # the broker sends this worker the bytes instead
            return self.failed(message, str(exc), fatal=False, charge=False, unshared=True)
        except (ModelError, ValueError, ProtocolError) as exc:
            return self.failed(message, str(exc))
        except Exception as exc:  # backend errors and anything unforeseen: worth a retry
            log.exception("chunk %d of job %s failed", task.chunk, task.job)
            return self.failed(message, f"{type(exc).__name__}: {exc}", fatal=False)
        computed = time.perf_counter()
        self.tasks_done += 1
        done, spent = self.speeds.get(task.model, (0, 0.0))
        self.speeds[task.model] = (done + task.count, spent + computed - decoded)
        frames = protocol.array_frames(outputs)
        if failures:
            frames.append(protocol.failures_frame(failures))
        timings = {
            "load": waited,
            "receive": decoded - received,
            "compute": computed - decoded,
            "device": engine.last_run.device,
            "copy": engine.last_run.copy,
            "send": time.perf_counter() - computed,
        }
        return protocol.encode(
            Command.RESULT,
            messages.Result(
                job=task.job,
                chunk=task.chunk,
                start=task.start,
                count=task.count,
                dtype="float32",
                item_shape=outputs.shape[1:],
                timings=timings,
                failed=sum(count for _, count, _ in failures),
                oriented=oriented,
            ),
            frames,
        )

    def chunk_files(
        self, message: Message, task: messages.Task
    ) -> tuple[list[Any], dict[int, str]]:
        """A chunk's image files: sent, or read here from shared storage; with the reasons of
        those that could not be read (UnsharedError if none could)."""
        if task.stored is None:
            return message.files(), {}
        files, unread = read_files(memoryview(message.payload[0]), memoryview(message.payload[1]))
        return files, dict(unread)

    def chunk_array(self, message: Message, task: messages.Task) -> np.ndarray:
        """A chunk's pixels: sent, or read here from a shared `.npy` file."""
        prefetched, self.prefetched = self.prefetched, None
        if prefetched is not None and prefetched[0] is message:
            return prefetched[1]  # read already, and launched ahead
        if task.place is None:
            return message.array(task.dtype, task.item_shape)
        item_bytes = protocol.check_array_spec(task.dtype, task.item_shape)
        rows = self.arrays.read_rows(task.place, memoryview(message.payload[0]), item_bytes)
        images = np.frombuffer(rows, dtype=task.dtype).reshape(-1, *task.item_shape)
        if len(images) != task.count:
            raise ProtocolError(
                f"the chunk's row ranges hold {len(images)} items, not {task.count}"
            )
        return images

    def run_files(
        self, engine: Engine, files: list[Any], unread: dict[int, str], task: messages.Task
    ) -> tuple[np.ndarray, list[tuple[int, int, str]], int]:
        """Decode a chunk of image files and run the ones that decode: their outputs (NaN
        for the others; the mean over the crops when the model oversamples), the runs
        of files that failed, with their reasons (``unread``: read failures, by index), and
        how many had an EXIF orientation (applied unless the job said not to)."""
        decoder = self.decoders.get(task.digest)
        if decoder is None:
            from farm.engines.images import ImageDecoder

            decoder = self.decoders[task.digest] = ImageDecoder(engine.spec)
        batch = decoder.decode(files, task.exif_rotate)
        outputs = np.full((task.count, *engine.output_shape), np.nan, dtype=np.float32)
        if len(batch.ok):
            computed = engine.run(
                batch.images,
                stop=lambda: self.stopped(task),
                tally=self.tally,
                then=self.ahead_of(engine),
            )
            if batch.crops > 1:
                computed = computed.reshape(len(batch.ok), batch.crops, *engine.output_shape).mean(
                    axis=1
                )
            outputs[batch.ok] = computed
        failures = [(index, unread.get(index, reason)) for index, reason in batch.failures]
        return outputs, failure_runs(failures), batch.oriented

    def run_array(
        self, engine: Engine, images: np.ndarray, task: messages.Task
    ) -> tuple[np.ndarray, list[tuple[int, int, str]]]:
        """Run a chunk of pixels: the outputs of its finite items (NaN for the others), and
        the runs of float32 items that hold a NaN or an infinite pixel."""
        finite = finite_items(images)
        if finite.all():
            return (
                engine.run(
                    images,
                    stop=lambda: self.stopped(task),
                    tally=self.tally,
                    then=self.ahead_of(engine),
                ),
                [],
            )
        outputs = np.full((task.count, *engine.output_shape), np.nan, dtype=np.float32)
        if finite.any():
            outputs[finite] = engine.run(
                images[finite], stop=lambda: self.stopped(task), tally=self.tally
            )
        bad = np.flatnonzero(~finite).tolist()
        return outputs, failure_runs([(index, NON_FINITE) for index in bad])

    def ahead_of(self, engine: Engine) -> Callable[[], None] | None:
        """What ``engine.run`` calls once a chunk's batches are launched, for an engine that
        ``feeds_ahead``: launch the next chunk's first batches behind them."""
        return (lambda: self.launch_ahead(engine)) if engine.feeds_ahead else None

    def launch_ahead(self, engine: Engine) -> None:
        """Launch the next queued chunk's first batches on ``engine`` while the current
        chunk's last ones compute, when that chunk is ready to run there; its ``run_task``
        goes on from them.  Anything else waits for its turn, and is reported then."""
        found = self.next_array_chunk(engine)
        if found is None:
            return
        message, task, images = found
        try:
            engine.start_ahead(images, stop=lambda: self.stopped(task))
        except Exception as exc:  # its own run_task tries again, and reports
            log.warning("could not launch chunk %d ahead: %s", task.chunk, exc)
            return
        self.prefetched = (message, images)

    def next_array_chunk(self, engine: Engine) -> tuple[Message, messages.Task, np.ndarray] | None:
        """The next queued message, when it is a chunk of pixels from the connection being
        served, for ``engine``, not cancelled, and read without a problem: with its pixels.
        Its pixels are not checked for NaNs here (``run_array`` does, once): a chunk that
        holds some runs its finite items afresh, and the batches launched ahead are lost."""
        if self.upcoming is None:
            return None
        with self.upcoming.mutex:
            queued = self.upcoming.queue[0] if self.upcoming.queue else None
        if queued is None or queued.message is None or queued.generation != self.serving:
            return None
        task = queued.message.header
        if (
            not isinstance(task, messages.Task)
            or task.dtype == protocol.ENCODED
            or task.item_shape != engine.spec.item_shape
            or task.digest in self.waiting
            or self.stopped(task)
        ):
            return None
        try:
            if self.engines.get(self.engine_key(task)) is not engine:
                return None
            images = self.chunk_array(queued.message, task)
        except Exception:  # a bad chunk: its run_task reports it
            return None
        return queued.message, task, images

    def tally(self, images: int, seconds: float) -> None:
        """One compute batch done (compute thread)."""
        self.computed_images += images
        self.computed_seconds += seconds

    def heartbeat_header(self) -> messages.Heartbeat:
        """Every heartbeat carries the compute counters and the engines loaded."""
        return messages.Heartbeat(
            computed=(self.computed_images, self.computed_seconds), engines=self.engine_names()
        )

    def rest_engines(self) -> None:
        """Idle: shrink every net that grew for large batches back to its resting batch."""
        for engine in list(self.engines.values()):
            if engine.grown:
                engine.rest()

    def inject_fault(self, start: int, count: int) -> None:
        """Fail a chunk that touches ``fail_items`` (chaos tests: a poison chunk)."""
        if self.config.fail_items:
            low, high = self.config.fail_items
            if start < high and low < start + count:
                raise RuntimeError(f"injected fault on items {low}..{high - 1}")

    def stop(self, *_: Any) -> None:
        self.running = False


class WorkerRefused(ValueError):
    """The broker refused this worker's READY: the worker exits (status 1) rather than
    register again, unheard, forever."""


def kept_reply(reply: Reply) -> Reply:
    """A reply to a chunk of a connection since replaced: a RESULT goes out marked kept (its
    broker may be gone, and a new one holds it for the job's client); anything else is
    dropped (empty)."""
    if bytes(memoryview(reply[1])) != Command.RESULT.value:
        return []
    return as_kept(reply)


def finite_items(images: np.ndarray) -> np.ndarray:
    """Which items of a chunk hold finite pixels only (uint8 ones always do): one pass."""
    if images.dtype.kind != "f":
        return np.ones(len(images), dtype=bool)
    return np.isfinite(images.reshape(len(images), -1)).all(axis=1)


def failure_runs(failures: list[tuple[int, str]]) -> list[tuple[int, int, str]]:
    """Per-item failures ``(index, reason)``, in index order, as runs ``(offset, count,
    reason)`` of consecutive items with the same reason (reasons cut to ``MAX_REASON``)."""
    runs: list[tuple[int, int, str]] = []
    for index, reason in failures:
        reason = reason[:MAX_REASON]
        if runs and runs[-1][0] + runs[-1][1] == index and runs[-1][2] == reason:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, reason)
        else:
            runs.append((index, 1, reason))
    return runs


class EngineKey(NamedTuple):
    """A loaded engine: the model's digest, the backend (or auto) and the precision."""

    digest: str
    backend: str
    precision: str


@dataclass
class QueuedMessage:
    """A message for the compute thread, from connection ``generation``; ``message`` None:
    a new connection began."""

    generation: int
    message: Message | None
    received: float


def serve(config: WorkerConfig) -> None:
    """Prepare the process for its device and serve until SIGINT/SIGTERM."""
    startup = Timeline.of_this_process()
    startup.mark("imported")
    prepare_process(config.device)
    config.device.check()
    worker = Worker(config, startup=startup)
    wakeup = Wakeup(worker.stop)
    context = zmq.Context()
    try:
        worker.run(context, wakeup)
    finally:
        wakeup.close()
        context.term()
