"""The link from a worker or a client to the broker: the ZeroMQ guide's Paranoid Pirate.

One DEALER socket (CurveZMQ when a keys folder is given), heartbeats on every
interval whatever else happens, and an expiry: any message from the broker
counts as a heartbeat, and once the broker has been silent for ``liveness``
intervals (the longer of this peer's and the broker's) it counts as lost.  The
link then closes its socket, opens a fresh one (nothing queued for the old
connection is sent or read) and greets the broker anew: a worker registers
again, a client submits again what it still misses.  While the broker stays
silent each new try waits twice as long as the one before, up to a cap.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.backend
from zmq.utils.monitor import recv_monitor_message

from farm.wire import protocol
from farm.wire.messages import Header, Heartbeat
from farm.wire.protocol import Command

log = logging.getLogger("farm.wire.link")

#: Longest wait between reconnection attempts while the broker is silent, in seconds.
MAX_RECONNECT_INTERVAL = 32.0
#: Milliseconds a replaced socket may still try to deliver its goodbye.
RECONNECT_LINGER_MS = 100


#: Transports a farm endpoint may name (ZeroMQ's own; tcp:// is what HOST:PORT means).
TRANSPORTS = ("tcp://", "ipc://", "inproc://")


def parse_endpoint(text: str, bind: bool = False) -> str:
    """A ZeroMQ endpoint from what a user typed: ``HOST:PORT`` means ``tcp://HOST:PORT``;
    ValueError, saying what is expected, for anything ZeroMQ would refuse.  ``bind``: a
    port may be ``*`` (any free one) and the host ``*`` (every interface)."""
    text = text.strip()
    expected = (
        f"{text!r} is not an endpoint: give tcp://HOST:PORT (or HOST:PORT), e.g. "
        f"{'tcp://127.0.0.1:5555' if not bind else 'tcp://*:5555'}"
    )
    if text.startswith(("ipc://", "inproc://")):
        if len(text.split("://", 1)[1]) == 0:
            raise ValueError(expected)
        return text
    if "://" in text and not text.startswith("tcp://"):
        raise ValueError(
            f"{text!r}: farm speaks {', '.join(TRANSPORTS)}, not {text.split('://', 1)[0]}://"
        )
    address = text.removeprefix("tcp://")
    host, colon, port = address.rpartition(":")
    if not colon or not host or host.startswith("[") != host.endswith("]"):
        raise ValueError(expected)
    if not (bind and port == "*") and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"{text!r}: port {port!r} is not a number from 1 to 65535")
    return f"tcp://{address}"


def endpoint_host(endpoint: str) -> str:
    """The host of a ``tcp://HOST:PORT`` endpoint, without an IPv6 literal's brackets; ""
    for another transport."""
    if not endpoint.startswith("tcp://"):
        return ""
    return endpoint.removeprefix("tcp://").rpartition(":")[0].removeprefix("[").removesuffix("]")


def is_ipv6(endpoint: str) -> bool:
    """Whether a TCP endpoint names an IPv6 address (``tcp://[::1]:5555``): its socket
    needs ``zmq.IPV6``, else ZeroMQ answers ``No such device``."""
    return ":" in endpoint_host(endpoint)


def is_loopback(endpoint: str) -> bool:
    """Whether a TCP endpoint is reachable from this machine only: 127.0.0.0/8, ::1, the
    ``lo`` interface or ``localhost``."""
    host = endpoint_host(endpoint)
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, an interface, or *
        return False


def enable_ipv6(socket: zmq.Socket, endpoint: str) -> None:
    """Let ``socket`` bind or connect to ``endpoint`` if it is an IPv6 address."""
    if is_ipv6(endpoint):
        socket.setsockopt(zmq.IPV6, 1)


class BrokerRefused(ValueError):
    """The broker refused this peer's handshake: its CURVE key, or plain text where the
    broker speaks CURVE (libzmq does not retry such a connection)."""


#: Handshake failures libzmq does not retry: the broker refused this peer (a failure without
#: detail is a broken connection, which libzmq connects again).
REFUSED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


#: Numbers for the handshake monitors' inproc addresses: one per socket ever monitored.
MONITOR_NUMBERS = itertools.count()

#: Handshakes in a row that the broker ends without a word before a peer gives up.  A broker
#: that speaks CURVE to a plain-text peer (or the reverse) either says why (a protocol
#: error) or, when its side notices first, just closes: libzmq then connects again, and
#: again, each try with the same chance of ending either way.
SILENT_REFUSALS = 3


class Handshakes:
    """Watches a link's socket: a broker that refuses its handshake is an error, not a hang.

    libzmq does not retry a connection whose handshake was refused (a CURVE key the
    broker does not allow, or a mechanism it does not speak), so without this a peer
    would wait forever without a word.  ``name``: the CURVE key it connects as (None:
    plain text).
    """

    EVENTS = REFUSED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_SUCCEEDED

    def __init__(self, socket: zmq.Socket, name: str | None) -> None:
        self.socket, self.name = socket, name
        self.silent = 0  # handshakes in a row the broker ended without a reason
        # an address of its own: pyzmq's default names it after the socket's file descriptor,
        # which the next socket of a reconnect may reuse while libzmq still holds the old
        # monitor's endpoint (binding it again can fail or hang: libzmq#1315)
        address = f"inproc://farm-handshakes-{next(MONITOR_NUMBERS)}"
        self.monitor = socket.get_monitor_socket(self.EVENTS, address)

    def failure(self) -> str | None:
        """Why the broker refused us, if a handshake failed since the last call (or
        ``SILENT_REFUSALS`` in a row ended without a reason)."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] & REFUSED:
                return handshake_failure(event["event"], event["value"], self.name)
            if event["event"] & zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.silent = 0
            elif event["event"] & zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self.silent += 1
                if self.silent >= SILENT_REFUSALS:
                    return silent_refusal(self.silent, self.name)
        return None

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)


def silent_refusal(count: int, name: str | None) -> str:
    """What ``count`` handshakes in a row that the broker closed without a reason most
    likely mean, for a peer connecting as CURVE key ``name`` (None: plain text)."""
    closed = f"the broker closed {count} handshakes in a row without a reason: "
    if name is None:
        return closed + (
            "it most likely uses CURVE: give --curve with a `farm keys` folder (or the "
            "address is not a farm broker's)"
        )
    return closed + (
        "it most likely does not use CURVE (started without --curve), or does not allow "
        f"key {name!r} (or the address is not a farm broker's)"
    )


def handshake_failure(event: int, value: int, name: str | None) -> str:
    """What a failed handshake means, for a peer connecting as CURVE key ``name`` (None:
    plain text)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"the broker refused key {name!r} (status {value}): its public key is not in "
            "the broker's authorized/ folder"
        )
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return (
            "the broker uses CURVE: give --curve with a `farm keys` folder"
            if name is None
            else "the broker does not use CURVE (started without --curve), but --curve was given"
        )
    return f"the handshake with the broker failed ({zmq.Event(event).name}, {value:#x})" + (
        ": do broker.key and the broker's key pair match?" if name is not None else ""
    )


@dataclass(frozen=True)
class LinkConfig:
    """Where the broker is, the link's timers, and the keys to connect with."""

    broker: str
    heartbeat: float = 1.0  # seconds between this peer's heartbeats
    liveness: int = 5  # silent heartbeat intervals before the broker counts as lost
    curve: str | None = None  # a `farm keys` folder: connect with CurveZMQ ...
    curve_name: str = "client"  # ... as this key
    linger_ms: int = 0  # how long a socket closed with a goodbye may still send
    max_retry: float = MAX_RECONNECT_INTERVAL  # back-off cap (0: try again every expiry)


class BrokerLink:
    """One peer's end of the link: socket, poller, heartbeats, expiry, back-off.

    ``greeting`` gives the header (or header and payload) sent on every new connection
    (None: nothing to say); ``heartbeat`` the heartbeat sent every interval (None: none now).  The
    owner registers its own sockets or descriptors in ``poller``; the link keeps
    its current socket, and the CURVE handshake monitor, registered there.
    """

    def __init__(
        self,
        context: zmq.Context,
        config: LinkConfig,
        greeting: Callable[[], Header | tuple[Header, Sequence[Any]] | None],
        heartbeat: Callable[[], Heartbeat | None],
    ) -> None:
        self.context, self.config = context, config
        self.greeting, self.heartbeat = greeting, heartbeat
        self.poller = zmq.Poller()
        self.generation = 0  # connections opened before the current one
        self.interval = config.heartbeat  # the broker's heartbeat interval, once heard
        self.retry_interval = self.expiry
        self.answered = False  # whether the broker ever spoke on this link
        self.handshakes: Handshakes | None = None
        self.socket: zmq.Socket
        self._open()

    @property
    def expiry(self) -> float:
        """Seconds of broker silence after which the broker counts as lost."""
        return self.config.liveness * max(self.config.heartbeat, self.interval)

    def _open(self) -> None:
        """A fresh socket, connected and greeted, with the timers started afresh."""
        sock = self.context.socket(zmq.DEALER)
        limit_socket(sock, linger_ms=self.config.linger_ms)
        try:
            if self.config.curve:
                from farm.wire.curve import make_client

                make_client(sock, self.config.curve, self.config.curve_name)
            enable_ipv6(sock, self.config.broker)
            handshakes = Handshakes(sock, self.config.curve_name if self.config.curve else None)
            try:
                sock.connect(self.config.broker)
            except BaseException:
                handshakes.close()
                raise
        except BaseException:
            sock.close(linger=0)
            raise
        self.handshakes = handshakes
        self.poller.register(handshakes.monitor, zmq.POLLIN)
        self.poller.register(sock, zmq.POLLIN)
        self.socket = sock
        now = time.monotonic()
        self.last_heard, self.next_beat = now, now + self.config.heartbeat
        self.deadline = now + self.retry_interval
        greeting = self.greeting()
        if greeting is not None:
            header, payload = greeting if isinstance(greeting, tuple) else (greeting, ())
            self.send(protocol.encode(protocol.command_of(header), header, payload))

    def heard(self, interval: float | None = None) -> None:
        """The broker spoke: it counts as alive for another expiry, and the back-off starts
        over.  ``interval``: the heartbeat interval it announced (in range: its message was
        decoded), if it did."""
        if interval is not None:
            self.interval = interval
        self.answered = True
        self._start_expiry()

    def _start_expiry(self) -> None:
        """A full expiry from now, and the back-off from the start."""
        now = time.monotonic()
        self.last_heard = now
        self.retry_interval = self.expiry
        self.deadline = now + self.expiry

    def restart_timers(self) -> None:
        """A request went out: a heartbeat now, and a full expiry for the broker to answer."""
        self._start_expiry()
        self.next_beat = self.last_heard

    def wait(self) -> float:
        """Seconds until the next timer: a heartbeat, or the broker's expiry."""
        return max(0.0, min(self.next_beat, self.deadline) - time.monotonic())

    def beat(self) -> None:
        """Send a heartbeat if one is due."""
        now = time.monotonic()
        if now < self.next_beat:
            return
        header = self.heartbeat()
        if header is not None:
            self.send(protocol.encode(Command.HEARTBEAT, header))
        self.next_beat = now + self.config.heartbeat

    def tick(self) -> bool:
        """Heartbeat when due; reconnect when the broker has been silent past its expiry
        (True then), and wait longer before the next try."""
        self.beat()
        now = time.monotonic()
        if now < self.deadline:
            return False
        # a broker that never answered is not news yet: its owner says so once, clearly
        log.log(
            logging.WARNING if self.answered else logging.DEBUG,
            "no word from broker %s for %.1f s: reconnecting",
            self.config.broker,
            now - self.last_heard,
        )
        self.retry_interval = min(self.retry_interval * 2, max(self.config.max_retry, self.expiry))
        self.reconnect()
        return True

    def reconnect(self) -> None:
        """A fresh socket, greeted anew; replies meant for the old connection are lost.  The
        old one says goodbye first: a broker that was only slow must not take its closing
        for a crash (which charges the chunk being computed)."""
        self.send(protocol.encode(Command.DISCONNECT))
        self._close(linger_ms=RECONNECT_LINGER_MS)
        self.generation += 1
        self._open()

    def send(self, frames: list[Any]) -> None:
        """Send without blocking; with no broker connection to take it, drop it (the silence
        that follows makes up for it: the broker requeues a lost worker's chunks, a client
        submits again)."""
        try:
            send_frames(self.socket, frames, int(zmq.NOBLOCK))
        except zmq.Again:
            log.debug("no connection to broker %s: a message was dropped", self.config.broker)

    def poll(self, seconds: float | None) -> dict[Any, int]:
        """Events on the poller within ``seconds`` (None: no limit).  BrokerRefused if the
        broker refused this peer's CURVE key: libzmq will not retry, so waiting would hang."""
        timeout = None if seconds is None else max(0, math.ceil(seconds * 1000))
        events = dict(self.poller.poll(timeout))
        if self.handshakes is not None and (refused := self.handshakes.failure()):
            raise BrokerRefused(f"broker {self.config.broker}: {refused}")
        return events

    def close(self, goodbye: bool = False) -> None:
        """Close the socket; with ``goodbye``, tell the broker first (DISCONNECT) and let the
        socket send for up to ``linger_ms``."""
        if goodbye:
            self.send(protocol.encode(Command.DISCONNECT))
        self._close(self.config.linger_ms if goodbye else 0)

    def _close(self, linger_ms: int) -> None:
        self.poller.unregister(self.socket)
        if self.handshakes is not None:
            self.poller.unregister(self.handshakes.monitor)
            self.handshakes.close()
            self.handshakes = None
        self.socket.close(linger=linger_ms)


def limit_socket(socket: Any, linger_ms: int = 0) -> None:
    """Bound what a peer can make this socket hold: frame size and queued messages."""
    socket.setsockopt(zmq.LINGER, linger_ms)
    socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
    socket.setsockopt(zmq.RCVHWM, protocol.QUEUE_LIMIT)
    socket.setsockopt(zmq.SNDHWM, protocol.QUEUE_LIMIT)


#: ``zmq.SNDMORE`` as a plain int: pyzmq's ``send_multipart`` combines enum flags per
#: frame, which costs more than the send itself for small frames.
_SNDMORE = int(zmq.SNDMORE)


def recv_frames(socket: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """``recv_multipart(flags, copy=False)``, reading each frame's ``more`` flag instead of
    the socket's RCVMORE option (an enum conversion a frame in pyzmq 27: about 5% of the
    broker's time a chunk, measured by bench/broker_scale.py)."""
    frame = socket.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = socket.recv(flags, copy=False)
        frames.append(frame)
    return frames


#: pyzmq's compiled ``Socket.send``: its Python wrapper only adds the DRAFT ``routing_id``
#: and ``group`` arguments, which farm never uses, and costs 0.3 us a frame.
_send = zmq.backend.Socket.send


def send_frames(socket: zmq.Socket, frames: list[Any], flags: int = 0) -> None:
    """``send_multipart(frames, copy=False)``, frame by frame with int flags and the
    compiled send (about 15 us a message less in pyzmq 27; measured by
    bench/broker_scale.py's real broker)."""
    last = len(frames) - 1
    for index, frame in enumerate(frames):
        _send(socket, frame, flags | _SNDMORE if index < last else flags, False)
