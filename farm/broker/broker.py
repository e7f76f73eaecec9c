"""The ROUTER broker: a thin I/O loop around ``FarmState``.

One ROUTER socket serves workers and clients alike.  The loop is
socket -> decode -> event -> ``FarmState.handle`` -> instructions -> messages ->
socket, then the timers.  All scheduling (registry, jobs, arbitration, attempts, caps)
lives in ``farm.broker.state``, which the simulator drives too; the mapping between
messages and the state's events and instructions, with the checks that go with it, is
``farm.broker.wire``'s.  This module only moves frames, reads the clock, serves model
files and INFO, and heartbeats.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from farm import defaults
from farm.broker import events as ev
from farm.broker import wire
from farm.broker.catalog import ModelCatalog
from farm.broker.connections import Connections, source_fd
from farm.broker.facts import ModelFound
from farm.broker.peers import Peer, Peers
from farm.broker.state import FarmState, SchedulingConfig
from farm.modelrepo.repository import ModelError
from farm.wire import messages, protocol
from farm.wire.link import (
    REFUSED,
    enable_ipv6,
    limit_socket,
    recv_frames,
    send_frames,
)
from farm.wire.messages import Header, job_of
from farm.wire.protocol import Command, ProtocolError
from farm.wire.wakeup import Wakeup

log = logging.getLogger("farm.broker")

#: Most INFO requests that may wait for workers at once.
MAX_INFO_WAITERS = 1000
#: Most messages handled in one loop pass before the timers run.
MAX_BATCH = 1000
#: Seconds an INFO request waits for workers before it is forgotten (its client gave up).
INFO_WAIT_LIMIT = 120.0
#: Seconds between two log lines about refused handshakes of the same kind.
REFUSAL_LOG_INTERVAL = 60.0
#: Times one worker connection is sent one model's files: a worker fetches a model once,
#: and again if its cache was damaged or a slow link outlasted its wait for the files (a
#: refusal fails its chunk's job: the budget must not bind an honest worker).
MAX_FETCHES_PER_MODEL = 4
#: Seconds the repository's answer about a model is reused for SUBMITs, and the most
#: names remembered (a model changed on disk is seen within that time).
FOUND_SECONDS = 1.0
MAX_FOUND = 1000

#: What peers may send a broker: everything but what only the broker sends.
ACCEPTED = frozenset(
    {
        Command.READY,
        Command.RESULT,
        Command.FAILED,
        Command.SUBMIT,
        Command.DATA,
        Command.INFO,
        Command.DISCONNECT,
        Command.HEARTBEAT,
        Command.FETCH,
        Command.CANCEL,
    }
)


#: Messages that carry jobs' inputs, or where they lie: their bytes are counted (``Traffic``).
INPUT_HEADERS = frozenset({messages.Submit, messages.Data, messages.Need, messages.Task})
#: ``zmq.NOBLOCK`` as a plain int (an enum costs a conversion a call).
NOBLOCK = int(zmq.NOBLOCK)


@dataclass
class Traffic:
    """What crossed the broker's socket: messages by kind, in and out, and the bytes of
    those that carry jobs' inputs (``INPUT_HEADERS``: results and heartbeats are not
    counted byte by byte, to keep the count cheap)."""

    received: dict[type, int] = field(default_factory=dict)  # header class -> messages
    sent: dict[type, int] = field(default_factory=dict)
    input_bytes: int = 0  # of INPUT_HEADERS' frames, in and out

    def count(self, table: dict[type, int], kind: type, frames: Sequence[Any]) -> None:
        table[kind] = table.get(kind, 0) + 1
        if kind in INPUT_HEADERS:
            self.input_bytes += protocol.payload_bytes(frames)

    def describe(self) -> dict[str, Any]:
        def named(table: dict[type, int]) -> dict[str, int]:
            # a copy first: the HTTP thread of the metrics reads it while the loop counts
            return {protocol.command_of_class(kind).name: n for kind, n in list(table.items())}

        return {
            "received": named(self.received),
            "sent": named(self.sent),
            "input_bytes": self.input_bytes,
        }


@dataclass(kw_only=True)
class BrokerConfig(SchedulingConfig):
    """The state machine's configuration, plus where and how the broker listens."""

    bind: str = defaults.BROKER_ENDPOINT
    model_dirs: tuple[str, ...] = ()  # searched before $FARM_MODELS and the bundled models
    curve: str | None = None  # a `farm keys` folder: CurveZMQ with its allowed keys
    metrics: tuple[str, int] | None = None  # (host, port) of the Prometheus endpoint


class Broker:
    """Socket, decoding, timers and model files around a ``FarmState``."""

    def __init__(
        self,
        config: BrokerConfig,
        context: zmq.Context,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config.check()  # fail fast on a bad policy name, parameter or sharing rule
        self.config = config
        self.clock = clock
        self.socket = context.socket(zmq.ROUTER)
        limit_socket(self.socket)
        self.socket.setsockopt(zmq.RCVHWM, protocol.BROKER_RECEIVE_QUEUE)
        self.socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_BROKER_FRAME_BYTES)
        try:
            if config.curve:
                from farm.wire.curve import make_server

                make_server(self.socket, config.curve)
            enable_ipv6(self.socket, config.bind)
            self.socket.bind(config.bind)
        except Exception:
            self.socket.close()
            raise
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        # connections closing (a peer's process died) name their peer through ``connections``;
        # refused handshakes (a peer without the right CURVE keys) are logged
        self.monitor = self.socket.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | REFUSED
        )
        self.refusals = Refusals(bool(config.curve))
        self.poller.register(self.monitor, zmq.POLLIN)
        self.connections = Connections()
        self.peers = Peers(
            roles=load_roles(config.curve) if config.curve else None,
            local=self.endpoint.startswith(("ipc://", "inproc://")),
        )
        self.fetches: dict[tuple[bytes, str], int] = {}  # (worker, model digest) -> sends
        self.found: dict[str, tuple[float, ModelFound | str]] = {}  # name -> when, answer
        self.wakeup: Wakeup | None = None  # serve() ends the loop's wait on SIGINT/SIGTERM
        self.models = ModelCatalog(config.model_dirs)
        self.info_waiters: list[tuple[Peer, int, float]] = []  # peer, workers, since
        self.traffic = Traffic()
        self.started_at = self.clock()
        self.metrics_url = ""
        self.metrics = self.start_metrics(config.metrics) if config.metrics else None
        # attempt ids differ from any a previous broker on this address handed out, so a
        # worker's reply to one of those can never pass for a reply to a new attempt
        self.state = FarmState(config, first_chunk_id=secrets.randbits(48), observer=self.metrics)
        # every event fed to the state and what it answered, when set to a list (tests)
        self.recorded: list[tuple[ev.FarmEvent, list[ev.Instruction]]] | None = None
        self.next_heartbeat = self.clock()
        self.running = True

    def start_metrics(self, where: tuple[str, int]) -> Any:
        """The Prometheus endpoint (``farm.broker.metrics``, imported only when asked for)."""
        from farm.broker.metrics import BrokerMetrics

        metrics = BrokerMetrics(self.clock, lambda: self.state.counts(), self.traffic.describe)
        try:
            self.metrics_url = metrics.serve(*where)
        except OSError as exc:
            self.socket.close()
            raise OSError(
                f"cannot serve metrics on {where[0]}:{where[1]}: {exc.strerror or exc}"
            ) from exc
        return metrics

    # ----------------------------------------------------------------- loop

    def serve(self) -> None:
        """Run until ``stop`` is called (SIGINT/SIGTERM in the CLI)."""
        config = self.config
        log.info(
            "broker listening on %s: policy %s%s, sharing %s, CURVE %s%s",
            self.endpoint,
            config.algo,
            f" {config.params}" if config.params else "",
            config.sharing,
            "on" if config.curve else "off",
            f", metrics {self.metrics_url}" if self.metrics_url else "",
            extra={"event": "broker_started", "endpoint": self.endpoint, "policy": config.algo},
        )
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
        self.feed(ev.Tick(at=now))
        if self.info_waiters and self.info_waiters[0][2] < now - INFO_WAIT_LIMIT:
            self.answer_info_waiters()

    def heartbeat_peers(self) -> None:
        """Tell every worker, and each client with a running job, that the broker is alive."""
        interval = self.config.heartbeat
        for identity in self.state.workers:
            self.send(identity, messages.Heartbeat(interval=interval))
        workers = len(self.state.workers)  # a client waiting on none says so to its user
        for job in self.state.jobs.values():
            self.send(
                job.client, messages.Heartbeat(job=job.id, interval=interval, workers=workers)
            )

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
                frames = recv_frames(self.socket, NOBLOCK)
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
            elif event["event"] & REFUSED:
                self.refusals.note(int(event["event"]), int(event["value"]), self.clock())

    def connection_closed(self, peer: bytes) -> None:
        """A peer's connection closed: a worker crashed, or a client's jobs end."""
        now = self.clock()
        self.peers.forget(peer)
        for key in [key for key in self.fetches if key[0] == peer]:
            del self.fetches[key]
        if peer in self.state.workers:
            self.feed(
                ev.WorkerLeft(worker=peer, at=now, reason="its connection closed", crashed=True)
            )
        elif any(job.client == peer for job in self.state.jobs.values()):
            self.feed(ev.ClientLeft(client=peer, at=now))

    def stop(self, *_: Any) -> None:
        self.running = False

    def handle(self, frames: list[Any]) -> None:
        """Decode one message into an event for the state; a bad one gets an ERROR, never a
        crash."""
        identity, body = frames[0].bytes, frames[1:]
        message = None
        try:
            message = protocol.decode(body, allowed=ACCEPTED)
            self.traffic.count(self.traffic.received, type(message.header), body)
            now = self.clock()
            if isinstance(message.header, (messages.Ready, messages.Submit)):
                self.read_monitor()  # its connection's accept came before this message
                self.connections.seen(source_fd(frames[0]), identity)
            peer = self.peers.of(identity, body[0])
            refused = peer.refusal(message.header, self.state)
            if refused is not None:
                self.refuse(peer, message.header, refused)
                return
            match message.header:
                case messages.Info() as info:
                    self.on_info(peer, info, now)
                case messages.Fetch() as fetch:
                    self.on_fetch(peer, fetch, now)
                case messages.Submit():
                    self.on_submit(peer, message, now)
                case _:
                    self.feed(wire.event_of(identity, message, now, self.state, peer.owner))
        except ProtocolError as exc:
            self.state.stats.bad_messages += 1
            log.warning("bad message from %s: %s", identity.hex(), exc)
            if isinstance(exc.header, messages.Result) and identity in self.state.workers:
                self.feed(wire.malformed_result(identity, exc.header, str(exc), self.clock()))
            job = job_of(message.header) if message else None
            self.send(
                identity, messages.Error(error=str(exc), job=job, registration=is_ready(body))
            )
        except Exception:  # a bug must not take the farm down; log it and keep serving
            log.exception("error handling a message from %s", identity.hex())

    def refuse(self, peer: Peer, header: Header, why: str) -> None:
        """A message this peer's role may not send: nothing counts.  A worker's reply gets
        DISCONNECT (a worker the broker dropped registers again); anything else an ERROR."""
        self.state.stats.refused_messages += 1
        log.info("refused a message from %s: %s", peer.identity.hex(), why)
        if isinstance(header, (messages.Result, messages.Failed)):
            self.send(peer.identity, messages.Disconnect())
        else:
            self.send(
                peer.identity,
                messages.Error(
                    error=why, job=job_of(header), registration=isinstance(header, messages.Ready)
                ),
            )

    def feed(self, event: ev.FarmEvent) -> None:
        """Give the state one event and send what it says."""
        instructions = self.state.handle(event)
        if self.recorded is not None:
            self.recorded.append((event, instructions))
        if instructions and log.isEnabledFor(logging.DEBUG):  # one look per event, not each
            for instruction in instructions:
                log.debug(
                    "instruction %s caused by event #%d (%s)",
                    type(instruction).__name__,
                    instruction.stimulus,
                    type(event).__name__,
                )
        for instruction in instructions:
            self.send(*wire.message_of(instruction))
        if isinstance(event, ev.WorkerJoined):
            self.send(event.worker, messages.Heartbeat(interval=self.config.heartbeat))
            self.warn_if_shared(event.worker)
            self.answer_info_waiters()

    def warn_if_shared(self, identity: bytes) -> None:
        """A worker joined on a device (host and ``--device``) that another registered
        worker serves already: they compete for it, each slower than it says."""
        entry = self.state.workers.get(identity)
        if entry is None or self.state.places[entry.place] < 2:
            return
        others = [  # its own earlier entry (a reconnect whose goodbye was lost) is no other
            other.name
            for other in self.state.workers.values()
            if other.place == entry.place and (other.host, other.pid) != (entry.host, entry.pid)
        ]
        if not others:
            return
        log.warning(
            "worker %s runs on %s of host %s, which %s serve%s already: they compete for "
            "it; give each worker a device of its own (--device cpu:N)",
            entry.name,
            entry.device,
            entry.host,
            ", ".join(others),
            "s" if len(others) == 1 else "",
            extra={"event": "device_shared", "worker": entry.name},
        )

    def send(self, identity: bytes, header: Header, payload: Sequence[Any] = ()) -> None:
        frames = wire.frames(header, payload)
        self.traffic.count(self.traffic.sent, type(header), frames)
        send_frames(self.socket, [identity, *frames])

    # ----------------------------------------------------------------- jobs

    def on_submit(self, peer: Peer, message: protocol.Message, now: float) -> None:
        """A SUBMIT becomes a job; one whose dtype or item shape cannot cross the wire is
        refused with an ERROR: a well-formed request refused, not a bad message."""
        header = message.header
        assert isinstance(header, messages.Submit)
        refusal = wire.refusal(header)
        if refusal is not None:
            log.info("job %s refused: %s", header.job, refusal)
            self.send(peer.identity, messages.Error(error=refusal, job=header.job))
            return
        self.feed(
            wire.job_submitted(
                peer.identity, message, now, self.config.heartbeat, self.find_model, peer.owner
            )
        )

    def find_model(self, name: str) -> ModelFound | str:
        """What the repository says of a job's model: its shape and digest, or why not;
        the same answer for ``FOUND_SECONDS`` (a SUBMIT must not cost a prototxt parse:
        a peer sending thousands would stall the loop)."""
        now = self.clock()
        cached = self.found.get(name)
        if cached is not None and now - cached[0] < FOUND_SECONDS:
            return cached[1]
        if len(self.found) >= MAX_FOUND:
            self.found.clear()
        found = self.look_up(name)
        self.found[name] = (now, found)
        return found

    def look_up(self, name: str) -> ModelFound | str:
        try:
            spec, manifest = self.models.lookup(name)
        except Exception as exc:  # ModelError, or a bug: either way the client hears why
            return (
                str(exc)
                if isinstance(exc, ModelError)
                else f"cannot use model {name!r}: {type(exc).__name__}: {exc}"
            )
        return ModelFound(
            item_shape=tuple(spec.item_shape),
            digest=manifest.digest,
            layout=spec.preprocess.layout,
            crops=spec.resize.crops,
            output_shape=self.models.output_shape(spec, manifest.digest),
            softmax=spec.softmax,
        )

    # ---------------------------------------------------------------- files

    def on_fetch(self, peer: Peer, header: messages.Fetch, now: float) -> None:
        """Send a registered worker a model's files; an error reply if it is gone or changed,
        or was sent this connection ``MAX_FETCHES_PER_MODEL`` times already.

        An empty digest asks for the broker's current copy (a worker preloading a model by
        name); the reply's manifest carries its digest.

        The files go out memory-mapped: however many workers fetch a model at once, its
        bytes are in memory once, in the page cache.
        """
        identity = peer.identity
        entry = self.state.workers[identity]  # the peer's role was checked
        entry.last_seen = now
        name, digest = header.model, header.digest
        try:
            spec, manifest = self.models.lookup(name)
            sent = self.fetches.get((identity, manifest.digest), 0)
            if sent >= MAX_FETCHES_PER_MODEL:
                self.state.stats.refused_fetches += 1
                raise ModelError(
                    f"model {name!r} ({manifest.digest[:12]}) was sent to this worker {sent} "
                    f"times already, the most a connection is sent one model"
                )
            if digest and manifest.digest != digest:  # "": whatever the broker has now
                raise ModelError(
                    f"model {name!r} changed on the broker (now {manifest.digest[:12]}"
                    f", asked for {digest[:12]})"
                )
            size = sum(f.size for f in manifest.files)
            largest = max((f.size for f in manifest.files), default=0)
            if largest > protocol.MAX_MESSAGE_BYTES:
                raise ModelError(
                    f"model {name!r} has a file of {largest:,} bytes, over the "
                    f"{protocol.MAX_MESSAGE_BYTES:,}-byte frame limit"
                )
            contents = [mapped(spec.files()[f.name]) for f in manifest.files]
        except (ModelError, OSError) as exc:
            self.send(identity, messages.Model(model=name, digest=digest, files=[], error=str(exc)))
            return None
        entry.fetched[name] = entry.fetched.get(name, 0) + 1
        self.fetches[identity, manifest.digest] = sent + 1
        log.info("sending model %s (%d bytes) to %s", name, size, entry.name)
        self.send(identity, manifest.header(), contents)
        return None

    # ----------------------------------------------------------------- info

    def on_info(self, peer: Peer, header: messages.Info, now: float) -> None:
        """A snapshot of the farm (an operator's whole, else with the peer's own jobs); with
        ``wait_workers`` it is sent once that many joined; with ``model``, that model's
        card at once."""
        identity, wanted = peer.identity, header.wait_workers
        if header.model is not None:
            self.send(
                identity,
                messages.Info(),
                protocol.document_frames({"model": self.model_card(header.model)}),
            )
        elif len(self.state.workers) >= wanted:
            self.send(identity, messages.Info(), protocol.document_frames(self.snapshot(peer)))
        elif len(self.info_waiters) >= MAX_INFO_WAITERS:
            raise ProtocolError("too many INFO requests waiting for workers")
        else:
            self.info_waiters.append((peer, wanted, now))
        return None

    def answer_info_waiters(self) -> None:
        """Answer INFO requests whose workers have joined; forget those waiting too long."""
        waiting, self.info_waiters = self.info_waiters, []
        oldest = self.clock() - INFO_WAIT_LIMIT
        for peer, wanted, since in waiting:
            if len(self.state.workers) >= wanted:
                self.send(
                    peer.identity, messages.Info(), protocol.document_frames(self.snapshot(peer))
                )
            elif since > oldest:
                self.info_waiters.append((peer, wanted, since))

    def model_card(self, name: str) -> dict[str, Any]:
        """What a client needs to name a model's answers: its labels and whether its output
        is already a softmax; or why the model cannot be used."""
        from farm.modelrepo.repository import find

        try:
            spec = find(name, self.config.model_dirs)  # no weights made, no files hashed
        except Exception as exc:  # ModelError, or a bug: either way the client hears why
            return {"name": name, "error": str(exc)}
        return {"name": name, "labels": list(spec.labels), "softmax": spec.softmax}

    def snapshot(self, peer: Peer | None = None) -> dict[str, Any]:
        """What ``farm status`` shows: the broker, its workers and its jobs (in slot order);
        each worker with how many registered workers serve its device
        (``device_shared_by``: 1 when it has the device to itself).  A ``peer`` that is
        no operator sees its own jobs only (``farm.broker.peers``)."""
        now = self.clock()
        described = self.state.describe(now)
        if peer is not None and not peer.operator:
            described["jobs"] = [job for job in described["jobs"] if job["owner"] == peer.owner]
            described["view"] = "own jobs"
        processes: dict[str, set[tuple[str, int]]] = {}  # place -> its workers' processes
        for worker in described["workers"]:
            place = f"{worker['host']}/{worker['device']}"
            processes.setdefault(place, set()).add((worker["host"], worker["pid"]))
        for worker in described["workers"]:
            worker["device_shared_by"] = len(processes[f"{worker['host']}/{worker['device']}"])
        return {
            "endpoint": self.endpoint,
            "uptime_s": now - self.started_at,
            "metrics": self.metrics_url,
            "traffic": self.traffic.describe(),
            **described,
        }


@dataclass
class Refusals:
    """Handshakes the broker's socket refused (a peer without the right CURVE keys, or with
    keys where the broker has none), logged as warnings: the first of each kind at once,
    then at most one line a ``REFUSAL_LOG_INTERVAL`` with how many more came (a refused
    peer that retries would flood the log)."""

    curve: bool  # whether the broker speaks CURVE
    logged: dict[str, float] = field(default_factory=dict)  # reason -> when last logged
    since: dict[str, int] = field(default_factory=dict)  # reason -> refusals not logged

    def note(self, event: int, value: int, now: float) -> None:
        reason = self.reason(event, value)
        last = self.logged.get(reason)
        if last is not None and now - last < REFUSAL_LOG_INTERVAL:
            self.since[reason] = self.since.get(reason, 0) + 1
            return
        more = self.since.pop(reason, 0)
        self.logged[reason] = now
        log.warning(
            "refused a connection: %s%s",
            reason,
            f" ({more} more since the last such line)" if more else "",
            extra={"event": "handshake_refused"},
        )

    def reason(self, event: int, value: int) -> str:
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (
                f"a CURVE key that is not in the --curve folder's authorized/ (status {value}); "
                "authorize it with `farm keys add`, or give the peer a key from there"
            )
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return (
                "a peer without CURVE keys (start workers and clients with --curve KEYS)"
                if self.curve
                else "a peer with CURVE keys, but this broker runs without --curve"
            )
        return f"handshake failed ({zmq.Event(event).name}, {value:#x})" + (
            ": does the peer's broker.key match this broker's key pair?" if self.curve else ""
        )


def load_roles(folder: str) -> Any:
    """What each authorized CURVE key may do (``farm.wire.curve.KeyRoles``), with a line
    for each key that still has both roles."""
    from farm.wire.curve import KeyRoles

    roles = KeyRoles.load(folder)
    for line in roles.migration_lines():
        log.warning("%s", line)
    return roles


def is_ready(body: list[Any]) -> bool:
    """Whether a message is a READY of this protocol version, decodable or not: refusing
    it refuses the worker's registration (``Error.registration``), and the worker exits."""
    if len(body) < 2:
        return False
    signature, command = memoryview(body[0]), memoryview(body[1])  # no copy of a huge frame
    return signature == protocol.SIGNATURE and command == Command.READY.value


def mapped(path: Path) -> Any:
    """A read-only memory map of a file (b"" for an empty one): a zero-copy frame."""
    with open(path, "rb") as handle:
        return (
            mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if path.stat().st_size else b""
        )


def serve(config: BrokerConfig, on_bound: Callable[[Broker], None] | None = None) -> None:
    """Bind, report the endpoints, and serve until SIGINT/SIGTERM."""
    context = zmq.Context()
    authenticator = None
    if config.curve:
        from farm.wire.curve import start_authenticator

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
