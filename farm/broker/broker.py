"""The ROUTER broker: a thin I/O loop around ``FarmState``.

One ROUTER socket serves workers and clients alike.  The loop is
socket -> decode -> event -> ``FarmState.handle`` -> carry out the instructions
-> timers.  All scheduling (registry, jobs, arbitration, attempts, caps) lives in
``farm.broker.state``, which the simulator drives too; this module only speaks
the protocol, reads the clock, serves model files and INFO, and heartbeats.

Liveness is the ZeroMQ guide's Paranoid Pirate pattern both ways: the broker
heartbeats every worker and client it serves; the state drops a worker (its
chunks go back to their jobs) or a job (its client vanished) once the peer has
been silent for ``liveness`` heartbeats.

The broker holds no job input.  When a policy assigns a chunk, the broker asks
the job's client for exactly those items (NEED), and forwards the DATA frame
it gets back to the worker as the TASK payload, untouched.  So its memory is
bounded by the chunks in flight (workers x slots x ``MAX_TASK_BYTES``), and
an input far larger than RAM streams through it.
"""

from __future__ import annotations

import logging
import mmap
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from farm import defaults, protocol
from farm.broker import events as ev
from farm.broker.connections import Connections, source_fd
from farm.broker.jobs import JobOptions
from farm.broker.catalog import ModelCatalog
from farm.broker.registry import check_models
from farm import messages
from farm.messages import Options, job_of
from farm.broker.state import FarmState, SchedulingConfig
from farm.link import limit_socket, send_frames
from farm.protocol import Command, Message, ProtocolError
from farm.modelrepo.repository import ModelError
from farm.wakeup import Wakeup

log = logging.getLogger("farm.broker")

#: Most INFO requests that may wait for workers at once.
MAX_INFO_WAITERS = 1000
#: Most messages handled in one loop pass before the timers run.
MAX_BATCH = 1000
#: Seconds an INFO request waits for workers before it is forgotten (its client gave up).
INFO_WAIT_LIMIT = 120.0
#: Longest error text sent: a reply must stay within the protocol's own string limits.
MAX_ERROR_CHARS = 1000


@dataclass(kw_only=True)
class BrokerConfig(SchedulingConfig):
    """The state machine's configuration, plus where and how the broker listens."""

    bind: str = defaults.BROKER_ENDPOINT
    model_dirs: tuple[str, ...] = ()  # searched before $FARM_MODELS and the bundled models
    curve: str | None = None  # a `farm keys` folder: CurveZMQ with its allowed keys
    metrics: tuple[str, int] | None = None  # (host, port) of the Prometheus endpoint


class Broker:
    """Socket, decoding, timers and model files around a ``FarmState``."""

    def __init__(self, config: BrokerConfig, context: zmq.Context,
                 clock: Callable[[], float] = time.monotonic) -> None:
        config.check()  # fail fast on a bad policy name, parameter or sharing rule
        self.config = config
        self.clock = clock
        self.socket = context.socket(zmq.ROUTER)
        limit_socket(self.socket)
        try:
            if config.curve:
                from farm.ops.keys import make_server

                make_server(self.socket, config.curve)
            self.socket.bind(config.bind)
        except Exception:
            self.socket.close()
            raise
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        # connections closing (a peer's process died) name their peer through ``connections``
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_ACCEPTED
                                                      | zmq.EVENT_DISCONNECTED)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.connections = Connections()
        self.wakeup: Wakeup | None = None  # serve() ends the loop's wait on SIGINT/SIGTERM
        self.models = ModelCatalog(config.model_dirs)
        self.info_waiters: list[tuple[bytes, int, float]] = []  # identity, workers, since
        self.started_at = self.clock()
        self.metrics = None
        self.metrics_url = ""
        if config.metrics:
            from farm.broker.metrics import BrokerMetrics

            self.metrics = BrokerMetrics(self)
            try:
                self.metrics_url = self.metrics.serve(*config.metrics)
            except OSError as exc:
                self.socket.close()
                raise OSError(f"cannot serve metrics on {config.metrics[0]}:"
                              f"{config.metrics[1]}: {exc.strerror or exc}") from exc
        # attempt ids differ from any a previous broker on this address handed out, so a
        # worker's reply to one of those can never pass for a reply to a new attempt
        self.state = FarmState(config, first_chunk_id=secrets.randbits(48),
                               observer=self.metrics)
        # every event fed to the state and what it answered, when set to a list (tests)
        self.recorded: list[tuple[ev.Event, list[ev.Instruction]]] | None = None
        self.next_heartbeat = self.clock()
        self.running = True
        #: what peers may send a broker: everything but what only the broker sends
        self.accepted = frozenset({
            Command.READY, Command.RESULT, Command.FAILED, Command.SUBMIT, Command.DATA,
            Command.INFO, Command.DISCONNECT, Command.HEARTBEAT, Command.FETCH, Command.CANCEL})

    # ----------------------------------------------------------------- loop

    def serve(self) -> None:
        """Run until ``stop`` is called (SIGINT/SIGTERM in the CLI)."""
        config = self.config
        log.info("broker listening on %s: policy %s%s, sharing %s, CURVE %s%s", self.endpoint,
                 config.algo, f" {config.params}" if config.params else "", config.sharing,
                 "on" if config.curve else "off",
                 f", metrics {self.metrics_url}" if self.metrics_url else "",
                 extra={"event": "broker_started", "endpoint": self.endpoint,
                        "policy": config.algo})
        while self.running:
            wait = max(0.0, self.next_heartbeat - self.clock())
            self.poll_once(int(wait * 1000) + 1)
            self.tick()
        self.close()

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close()

    def tick(self) -> None:
        """The timers, run on every loop pass: heartbeats out, silent peers dropped."""
        now = self.clock()
        if now >= self.next_heartbeat:
            self.heartbeat_peers()
            self.next_heartbeat = now + self.config.heartbeat
        self.feed(ev.Tick(now))
        if self.info_waiters and self.info_waiters[0][2] < now - INFO_WAIT_LIMIT:
            self.answer_info_waiters()

    def heartbeat_peers(self) -> None:
        """Tell every worker, and each client with a running job, that the broker is alive."""
        interval = self.config.heartbeat
        for identity in self.state.workers:
            self.send(identity, Command.HEARTBEAT, {"interval": interval})
        workers = len(self.state.workers)  # a client waiting on none says so to its user
        for job in self.state.jobs.values():
            self.send(job.client, Command.HEARTBEAT, {"job": job.id, "interval": interval,
                                                      "workers": workers})

    def poll_once(self, timeout_ms: int) -> None:
        """Handle the messages waiting (or arriving within the timeout), at most ``MAX_BATCH``;
        a stop signal ends the wait."""
        ready = dict(self.poller.poll(timeout_ms))
        if self.socket not in ready and self.monitor not in ready:
            if self.wakeup is not None:
                self.wakeup.drain()
            return
        if self.monitor in ready:
            self.read_monitor()
        for _ in range(MAX_BATCH):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:  # all read: what a dead peer sent before it died is handled
                for peer in self.connections.closed_peers():
                    self.connection_closed(peer)
                return
            self.handle(frames)

    def read_monitor(self) -> None:
        """The connections accepted and closed since the last read, in order."""
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.connections.on_accepted(int(event["value"]))
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.connections.on_closed(int(event["value"]))

    def connection_closed(self, peer: bytes) -> None:
        """A peer's connection closed: a worker crashed, or a client's jobs end."""
        now = self.clock()
        if peer in self.state.workers:
            self.feed(ev.WorkerLeft(peer, now, "its connection closed", crashed=True))
        elif any(job.client == peer for job in self.state.jobs.values()):
            self.feed(ev.ClientLeft(peer, now))

    def stop(self, *_: Any) -> None:
        self.running = False

    def handle(self, frames: list[Any]) -> None:
        """Decode one message into an event for the state; a bad one gets an ERROR, never a
        crash."""
        identity, body = frames[0].bytes, frames[1:]
        message = None
        try:
            message = protocol.decode(body, allowed=self.accepted)
            now = self.clock()
            if isinstance(message.header, (messages.Ready, messages.Submit)):
                self.read_monitor()  # its connection's accept came before this message
                self.connections.seen(source_fd(frames[0]), identity)
            match message.header:
                case messages.Info() as info:
                    self.on_info(identity, info, now)
                case messages.Fetch() as fetch:
                    self.on_fetch(identity, fetch, now)
                case messages.Submit() as submit:
                    self.on_submit(identity, submit, now)
                case _:
                    self.feed(event_of(identity, message, now))
        except ProtocolError as exc:
            self.state.stats.bad_messages += 1
            log.warning("bad message from %s: %s", identity.hex(), exc)
            job = job_of(message.header) if message else None
            self.send(identity, Command.ERROR, {"error": str(exc), **(
                {"job": job} if job is not None else {})})
        except Exception:  # a bug must not take the farm down; log it and keep serving
            log.exception("error handling a message from %s", identity.hex())

    def feed(self, event: ev.Event) -> None:
        """Give the state one event and carry out what it says."""
        instructions = self.state.handle(event)
        if self.recorded is not None:
            self.recorded.append((event, instructions))
        for instruction in instructions:
            self.carry_out(instruction)
        if isinstance(event, ev.WorkerJoined):
            self.send(event.worker, Command.HEARTBEAT, {"interval": self.config.heartbeat})
            self.answer_info_waiters()

    def carry_out(self, instruction: ev.Instruction) -> None:
        """Send what one instruction says."""
        match instruction:
            case ev.SendNeed(client, job, chunk, start, count):
                self.send(client, Command.NEED, {"job": job, "chunk": chunk, "start": start,
                                                 "count": count})
            case ev.SendTask():
                self.send(instruction.worker, Command.TASK, task_header(instruction),
                          instruction.payload)
            case ev.SendResult():
                self.send(instruction.client, Command.RESULT, result_header(instruction),
                          instruction.result.payload)
            case ev.SendFailed(client, job, chunk, start, count, error):
                self.send(client, Command.FAILED, {"job": job, "chunk": chunk, "start": start,
                                                   "count": count, "error": error})
            case ev.SendDone(client, job, summary):
                self.send(client, Command.DONE, {"job": job}, protocol.document_frames(summary))
            case ev.SendCancel(peer, job, reason, summary):
                header: dict[str, Any] = {"job": job}
                if reason is not None:
                    header["reason"] = reason
                self.send(peer, Command.CANCEL, header,
                          protocol.document_frames(summary) if summary is not None else ())
            case ev.SendError(peer, error, job, unknown_job):
                header = {"error": error}
                if job is not None:
                    header["job"] = job
                if unknown_job:
                    header["unknown_job"] = True
                self.send(peer, Command.ERROR, header)
            case ev.DropWorker(worker):
                self.send(worker, Command.DISCONNECT, {})

    def send(self, identity: bytes, command: Command, header: dict[str, Any],
             payload: list[Any] | tuple = ()) -> None:
        error = header.get("error")
        if isinstance(error, str) and len(error) > MAX_ERROR_CHARS:  # it may quote the peer
            header = {**header, "error": error[:MAX_ERROR_CHARS - 3] + "..."}
        send_frames(self.socket, [identity, *protocol.encode(command, header, payload)])

    # ------------------------------------------------------------ decoding

    def on_submit(self, identity: bytes, header: messages.Submit, now: float) -> None:
        """A SUBMIT becomes a job; one whose dtype or item shape cannot cross the wire is
        refused with an ERROR: a well-formed request refused, not a bad message."""
        try:
            protocol.check_array_spec(header.dtype, header.item_shape)
        except ProtocolError as exc:
            log.info("job %s refused: %s", header.job, exc)
            self.send(identity, Command.ERROR, {"error": str(exc), "job": header.job})
            return
        self.feed(self.submitted(identity, header, now))

    def submitted(self, identity: bytes, header: messages.Submit, now: float) -> ev.Event:
        """A SUBMIT, with what the repository says of its model."""
        return ev.JobSubmitted(identity, header.job, header.model, header.dtype,
                               tuple(header.item_shape), header.total,
                               header.heartbeat or self.config.heartbeat,
                               job_options(header.options), self.find_model(header.model), now)

    def find_model(self, name: str) -> ev.ModelFound | str:
        """What the repository says of a job's model: its shape and digest, or why not."""
        try:
            spec, manifest = self.models.lookup(name)
        except Exception as exc:  # ModelError, or a bug: either way the client hears why
            return (str(exc) if isinstance(exc, ModelError) else
                    f"cannot use model {name!r}: {type(exc).__name__}: {exc}")
        return ev.ModelFound(tuple(spec.item_shape), manifest.digest, spec.preprocess.layout,
                             spec.resize.crops)

    # ---------------------------------------------------------------- files

    def on_fetch(self, identity: bytes, header: messages.Fetch, now: float) -> None:
        """Send a registered worker a model's files; an error reply if it is gone or changed.

        An empty digest asks for the broker's current copy (a worker preloading a model by
        name); the reply's manifest carries its digest.

        The files go out memory-mapped: however many workers fetch a model at once, its
        bytes are in memory once, in the page cache.
        """
        entry = self.state.workers.get(identity)
        if entry is not None:
            entry.last_seen = now
        name, digest = header.model, header.digest
        try:
            if entry is None:
                raise ModelError("models are sent to registered workers only")
            spec, manifest = self.models.lookup(name)
            if digest and manifest.digest != digest:  # "": whatever the broker has now
                raise ModelError(f"model {name!r} changed on the broker (now {manifest.digest[:12]}"
                                 f", asked for {digest[:12]})")
            size = sum(f.size for f in manifest.files)
            largest = max((f.size for f in manifest.files), default=0)
            if largest > protocol.MAX_MESSAGE_BYTES:
                raise ModelError(f"model {name!r} has a file of {largest:,} bytes, over the "
                                 f"{protocol.MAX_MESSAGE_BYTES:,}-byte frame limit")
            contents = [mapped(spec.files()[f.name]) for f in manifest.files]
        except (ModelError, OSError) as exc:
            self.send(identity, Command.MODEL, {"model": name, "digest": digest, "files": [],
                                                "error": str(exc)})
            return None
        entry.fetched[name] = entry.fetched.get(name, 0) + 1
        log.info("sending model %s (%d bytes) to %s", name, size, entry.name)
        self.send(identity, Command.MODEL, manifest.header(), contents)
        return None

    # ----------------------------------------------------------------- info

    def on_info(self, identity: bytes, header: messages.Info, now: float) -> None:
        """A snapshot of the farm; with ``wait_workers`` it is sent once that many joined; with
        ``model``, that model's card at once."""
        wanted = header.wait_workers
        if header.model is not None:
            self.send(identity, Command.INFO, {},
                      protocol.document_frames({"model": self.model_card(header.model)}))
        elif len(self.state.workers) >= wanted:
            self.send(identity, Command.INFO, {}, protocol.document_frames(self.snapshot()))
        elif len(self.info_waiters) >= MAX_INFO_WAITERS:
            raise ProtocolError("too many INFO requests waiting for workers")
        else:
            self.info_waiters.append((identity, wanted, now))
        return None

    def answer_info_waiters(self) -> None:
        """Answer INFO requests whose workers have joined; forget those waiting too long."""
        waiting, self.info_waiters = self.info_waiters, []
        oldest = self.clock() - INFO_WAIT_LIMIT
        for identity, wanted, since in waiting:
            if len(self.state.workers) >= wanted:
                self.send(identity, Command.INFO, {}, protocol.document_frames(self.snapshot()))
            elif since > oldest:
                self.info_waiters.append((identity, wanted, since))

    def model_card(self, name: str) -> dict[str, Any]:
        """What a client needs to name a model's answers: its labels and whether its output
        is already a softmax; or why the model cannot be used."""
        from farm.modelrepo.repository import find

        try:
            spec = find(name, self.config.model_dirs)  # no weights made, no files hashed
        except Exception as exc:  # ModelError, or a bug: either way the client hears why
            return {"name": name, "error": str(exc)}
        return {"name": name, "labels": list(spec.labels), "softmax": spec.softmax}

    def snapshot(self) -> dict[str, Any]:
        """What ``farm status`` shows: the broker, its workers and its jobs (in slot order)."""
        now = self.clock()
        return {"endpoint": self.endpoint, "uptime_s": now - self.started_at,
                "metrics": self.metrics_url, **self.state.describe(now)}


# ---------------------------------------------------------------- decoding, one per command


def worker_facts(header: messages.Ready) -> ev.WorkerFacts:
    """A READY header's facts; ProtocolError if its models do not fit or do not add up."""
    check_models(header.models)
    if not all(name in header.models for name in header.loaded):
        raise ProtocolError("READY 'loaded' must list advertised models")
    return ev.WorkerFacts(header.device, header.host, header.pid, header.backend,
                          header.threads, dict(header.models), frozenset(header.loaded),
                          header.slots, header.heartbeat, dict(header.engines),
                          {model: (images, seconds) for model, (images, seconds)
                           in header.speeds.items()
                           if model in header.models and images > 0 and seconds > 0})


def job_options(options: Options) -> JobOptions:
    """SUBMIT options (types and ranges checked on decode), with the engine checked;
    ProtocolError if the workers have no such engine."""
    from farm.engines.engine import job_engine  # the engines' names, not the engines: cheap

    try:
        engine = job_engine(options.engine) if options.engine is not None else None
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    params = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in options.params.items())
    return JobOptions(options.algo, params, options.priority, options.timeout, options.client,
                      engine)


def event_of(identity: bytes, message: Message, now: float) -> ev.Event:
    """The state's event for a message from a worker or a client; ProtocolError if its
    facts do not add up."""
    payload = message.payload
    match message.header:
        case messages.Ready() as ready:
            return ev.WorkerJoined(identity, worker_facts(ready), now)
        case messages.Heartbeat(job=None, computed=computed, engines=engines):
            return ev.WorkerHeard(identity, now, computed, engines)
        case messages.Heartbeat(job=str(job)):
            return ev.ClientHeard(identity, job, now)
        case messages.Result() as result:
            try:
                message.failures()  # the client relies on it: a bad list fails the job here
                problem = None
            except ProtocolError as exc:
                problem = str(exc)
            return ev.ChunkDone(identity, result.job, result.chunk, result.start, result.count,
                                result.dtype, tuple(result.item_shape), result.timings, now,
                                payload, result.failed, problem)
        case messages.Failed() as failed:
            return ev.ChunkFailed(identity, failed.job, failed.chunk, failed.error,
                                  failed.fatal, now, failed.charge)
        case messages.Data() as data:
            return ev.DataArrived(identity, data.job, data.chunk, data.start, data.count,
                                  payload_bytes(payload), len(payload), now, payload)
        case messages.Disconnect():
            return ev.WorkerLeft(identity, now)
        case messages.Cancel() as cancel:
            return ev.JobCancelled(identity, cancel.job, now)
    raise ProtocolError(f"{message.command.name} is not accepted here")


def payload_bytes(frames: list[Any]) -> int:
    return sum(f.buffer.nbytes if hasattr(f, "buffer") else len(f) for f in frames)


def task_header(task: ev.SendTask) -> dict[str, Any]:
    header = {"job": task.job, "chunk": task.chunk, "attempt": task.attempt,
              "start": task.start, "count": task.count, "model": task.model,
              "digest": task.digest, "dtype": task.dtype, "item_shape": list(task.item_shape)}
    if task.engine:
        header["engine"] = list(task.engine)
    return header


def result_header(forward: ev.SendResult) -> dict[str, Any]:
    result = forward.result
    return {"job": result.job, "chunk": result.chunk, "start": result.start,
            "count": result.count, "dtype": result.dtype, "item_shape": list(result.item_shape),
            "timings": result.timings, "worker": forward.worker, "attempt": forward.attempt,
            "trace": list(forward.trace), **({"failed": result.failed} if result.failed else {})}


def mapped(path: Path) -> Any:
    """A read-only memory map of a file (b"" for an empty one): a zero-copy frame."""
    with open(path, "rb") as handle:
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if path.stat().st_size \
            else b""


def serve(config: BrokerConfig, on_bound: Callable[[Broker], None] | None = None) -> None:
    """Bind, report the endpoints, and serve until SIGINT/SIGTERM."""
    context = zmq.Context()
    authenticator = None
    if config.curve:
        from farm.ops.keys import start_authenticator

        authenticator = start_authenticator(context, config.curve)
    broker = None
    try:
        broker = Broker(config, context)
        broker.wakeup = Wakeup(broker.stop)
        broker.wakeup.watch(broker.poller)
        if on_bound:
            on_bound(broker)
        broker.serve()
    finally:
        if broker is not None and broker.wakeup is not None:
            broker.wakeup.close()
        if authenticator is not None:
            authenticator.stop()
        context.term()
