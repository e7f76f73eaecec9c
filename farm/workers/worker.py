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

Its parts live beside it: ``config`` (the device and settings), ``engines`` (the loaded
engines), ``fetching`` (the model files), ``chunks`` (running a chunk, on the compute
thread) and ``conversation`` (the broker's messages, on the I/O thread).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from farm.engines.engine import AUTO, engine_class
from farm.modelrepo.modelstore import manifest_of
from farm.modelrepo.repository import ModelError, ModelSpec, find_local, prepare
from farm.startup import Timeline
from farm.wire import messages
from farm.wire.link import BrokerLink, LinkConfig, recv_frames
from farm.wire.protocol import Command, Message
from farm.wire.wakeup import Wakeup
from farm.workers.chunks import (
    NON_FINITE,
    Cancellations,
    ChunkRunner,
    QueuedMessage,
    Throttle,
    failed,
    finite_items,
)
from farm.workers.config import Device, WorkerConfig, prepare_process
from farm.workers.conversation import ACCEPTED, BrokerConversation, WorkerRefused
from farm.workers.engines import EngineKey, LoadedEngines
from farm.workers.fetching import FETCH_TIMEOUT, ModelFetches
from farm.workers.kept import SentResults, as_kept

#: What other modules take from here: the worker, its settings and the wire's view of it.
__all__ = [
    "ACCEPTED",
    "NON_FINITE",
    "Device",
    "QueuedMessage",
    "Worker",
    "WorkerConfig",
    "WorkerRefused",
    "finite_items",
    "prepare_process",
    "serve",
]

log = logging.getLogger("farm.worker")

Reply = list[Any]


@dataclass
class Worker:
    """A worker: its engines, its model files, the chunks it runs (compute thread) and its
    conversation with the broker (I/O thread)."""

    config: WorkerConfig
    startup: Timeline = field(default_factory=Timeline.of_this_process)  # sent with READY
    sent: SentResults = field(default_factory=SentResults)  # offered again to a new broker
    running: bool = True

    def __post_init__(self) -> None:
        if self.config.backend != AUTO:
            engine_class(self.config.backend)  # fail at start if its library is missing
        self.engines = LoadedEngines(self.config, self.config.own_engine())
        self.fetches = ModelFetches(self.config)
        self.cancels = Cancellations()
        slow = self.config.slow
        self.runner = ChunkRunner(
            self.engines,
            self.fetches,
            self.cancels,
            fail_items=self.config.fail_items,
            throttle=Throttle(*slow) if slow else None,
        )
        self.conversation = BrokerConversation(self.config, self.cancels, self.sent)

    def preload(self) -> None:
        """Load the ``--model`` models this host has; the others are fetched from the broker
        once connected (``ModelFetches.preload_fetches``)."""
        for name in self.config.preload:
            spec = find_local(name, self.config.model_dirs)
            if spec is None:
                log.info("model %s is not on this host: fetching it from the broker", name)
                self.fetches.preloading.add(name)
                continue
            prepare(spec)
            self.load_preloaded(spec, manifest_of(spec).digest)

    def load_preloaded(self, spec: ModelSpec, digest: str) -> None:
        """Load a ``--model`` model on this worker's own engine, before any chunk needs it."""
        self.engines.load(spec, EngineKey(digest, self.engines.own))

    def ready_header(self) -> messages.Ready:
        """The registration sent on every new connection to the broker: the models it can
        run (its disk's, and those it loaded, fetched ones included: ``loaded`` lists only
        advertised models, or the broker would ignore them), and what it brings."""
        engines = list(self.engines.loaded.values())
        models = {
            engine.spec.name: messages.ModelFacts(input_shape=engine.spec.item_shape)
            for engine in engines
        }
        local = self.fetches.local_models()
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
            backend=self.config.backend,
            models=models,
            slots=self.config.slots or self.config.device.default_slots,
            threads=self.engines.threads or len(os.sched_getaffinity(0)),
            loaded=tuple(sorted({engine.spec.name for engine in engines})),
            engines=self.engines.names(),
            heartbeat=self.config.heartbeat,
            speeds=dict(self.runner.speeds),
            startup=dict(self.startup.stamps),
        )

    def heartbeat_header(self) -> messages.Heartbeat:
        """Every heartbeat carries the compute counters and the engines loaded."""
        computed = (self.runner.computed_images, self.runner.computed_seconds)
        return messages.Heartbeat(computed=computed, engines=self.engines.names())

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
        self.runner.upcoming = tasks
        address = f"inproc://farm-worker-{id(self)}"
        pipe = context.socket(zmq.PAIR)
        pipe.bind(address)
        compute = threading.Thread(
            target=self.compute_loop,
            name="compute",
            daemon=True,
            args=(context, address, tasks, link),
        )
        compute.start()
        log.info(
            "worker %s (%s) started: waiting for the broker at %s (no answer yet)",
            config.device,
            config.backend,
            config.broker,
        )
        self.conversation.started_waiting = time.monotonic()
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
        max_tasks = self.config.max_tasks
        while self.running:
            events = link.poll(link.wait())
            if link.socket in events:
                self.conversation.receive(link, tasks)
            if pipe in events:
                reply = recv_frames(pipe)
                self.sent.note(reply)
                link.send(reply)
                if max_tasks and self.runner.tasks_done >= max_tasks:
                    return
            if link.tick():  # a new connection: the old one's fetches died
                self.conversation.report_silence()
                self.conversation.reconnected(link, tasks)

    def compute_loop(
        self, context: zmq.Context, address: str, tasks: queue.Queue, link: BrokerLink
    ) -> None:
        """The compute thread: run tasks of the current connection, send the replies back."""
        pipe = context.socket(zmq.PAIR)
        pipe.connect(address)
        try:
            send_all(pipe, self.fetches.preload_fetches())
            while self.running:
                send_all(pipe, self.expire_fetches())
                try:
                    queued = tasks.get(timeout=0.25)
                except queue.Empty:
                    self.engines.rest()
                    continue
                if queued is None:
                    return
                if queued.message is None:  # a new connection: parked chunks and fetches are void
                    self.fetches.forget()
                    send_all(pipe, self.fetches.preload_fetches())
                    continue
                if queued.generation != link.generation:
                    continue  # sent over a connection that was replaced: the broker requeued it
                self.runner.serving = queued.generation
                for reply in self.dispatch(queued.message, queued.received):
                    if queued.generation != link.generation:  # the connection went meanwhile
                        reply = kept_reply(reply)
                    send_all(pipe, [reply])
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
        if self.cancels.stopped(task):  # nothing to load or fetch for it
            return [failed(message, "job cancelled", fatal=False, charge=False)]
        if task.digest in self.fetches.waiting:
            self.fetches.waiting[task.digest].append((message, received))
            return []
        key = self.engines.key(task)
        if key in self.engines.loaded or key in self.engines.broken:
            return [self.runner.run_task(message, received)]
        try:
            spec = self.fetches.find_files(task.model, task.digest)
        except ModelError as exc:  # a name or digest that cannot be a cache folder
            return [failed(message, str(exc))]
        if spec is None:
            return [self.fetches.fetch(message, task, received)]
        return [self.runner.run_task(message, received, spec)]

    def on_model(self, message: Message, header: messages.Model) -> list[Reply]:
        """A model's files arrived: check and cache them, then run the chunks that waited."""
        parked = self.fetches.arrived(header.digest)
        preloading = self.fetches.preloading
        try:
            spec, manifest = self.fetches.install(message, header)
        except ModelError as exc:  # not remembered: the next chunk of the model fetches again
            if not header.digest and header.model in preloading:
                preloading.discard(header.model)
                log.error("cannot preload --model %s: %s; serving other models", header.model, exc)
            else:
                log.error("%s", exc)
            return [failed(task, str(exc)) for task, _ in parked]
        if header.model in preloading:
            preloading.discard(header.model)
            try:
                self.load_preloaded(spec, manifest.digest)
            except ModelError as exc:
                log.error("cannot preload --model %s: %s", header.model, exc)
        now = time.perf_counter()
        # the wait for the files counts as loading, as the engine's build does
        run = self.runner.run_task
        return [run(task, now, spec, waited=now - received) for task, received in parked]

    def expire_fetches(self) -> list[Reply]:
        """FAILED for the chunks parked on a FETCH the broker has not answered in time."""
        error = f"no model files from the broker within {FETCH_TIMEOUT:.0f} s"
        return [
            failed(task, error, fatal=False, charge=False) for task, _ in self.fetches.expired()
        ]

    def stop(self, *_: Any) -> None:
        self.running = False


def send_all(pipe: zmq.Socket, replies: list[Reply]) -> None:
    """Hand replies to the I/O thread (an empty one is dropped)."""
    for reply in replies:
        if reply:
            pipe.send_multipart(reply, copy=False)


def kept_reply(reply: Reply) -> Reply:
    """A reply to a chunk of a connection since replaced: a RESULT goes out marked kept (its
    broker may be gone, and a new one holds it for the job's client); anything else is
    dropped (empty)."""
    if bytes(memoryview(reply[1])) != Command.RESULT.value:
        return []
    return as_kept(reply)


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
