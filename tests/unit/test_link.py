"""The Paranoid Pirate link (farm.wire.link) against a real ROUTER on loopback that says nothing."""

from __future__ import annotations

import socket
import threading
import weakref
from collections.abc import Iterator

import pytest
import zmq

from farm.client.client import Client, FarmError
from farm.wire import messages, protocol
from farm.wire.link import SILENT_REFUSALS, BrokerLink, LinkConfig, is_ipv6, is_loopback
from farm.wire.protocol import Command

HEARTBEAT, LIVENESS = 0.02, 2  # the broker counts as lost after 0.04 s of silence


@pytest.fixture
def silent_broker() -> Iterator[tuple[zmq.Context, zmq.Socket, str]]:
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    yield context, router, f"tcp://127.0.0.1:{port}"
    router.close()
    context.term()


def greeted_by(router: zmq.Socket) -> bytes:
    """The identity of the next peer whose greeting (an INFO here) reaches the router."""
    while True:
        assert router.poll(10_000), "no greeting came"
        identity, *frames = router.recv_multipart()
        if protocol.decode(frames).command is Command.INFO:
            return identity


def reconnects(link: BrokerLink, count: int) -> list[float]:
    """Drive the link until it has reconnected ``count`` times; the seconds between tries,
    on the link's own clock (the moment each fresh socket started its timers), so that this
    thread being descheduled after a try cannot shorten the next gap."""
    times: list[float] = []
    while len(times) < count:
        link.poll(link.wait())
        if link.tick():
            times.append(link.last_heard)
    return [b - a for a, b in zip(times, times[1:])]


def test_a_silent_broker_gets_fresh_sockets_further_and_further_apart(silent_broker) -> None:
    context, router, endpoint = silent_broker
    link = BrokerLink(
        context,
        LinkConfig(endpoint, HEARTBEAT, LIVENESS, max_retry=0.16),
        messages.Info,
        messages.Heartbeat,
    )
    try:
        first = greeted_by(router)
        gaps = reconnects(link, 5)
        assert link.generation == 5
        assert greeted_by(router) != first, "each connection is a fresh socket, greeted anew"
        expiry = HEARTBEAT * LIVENESS
        assert all(gap >= expiry * factor * 0.9 for gap, factor in zip(gaps, (2, 4, 4, 4)))
        assert link.retry_interval == pytest.approx(0.16), "doubling stops at the cap"
        link.heard()  # the broker spoke: the back-off starts over
        assert link.retry_interval == pytest.approx(expiry)
    finally:
        link.close()


def test_without_back_off_every_try_waits_one_expiry(silent_broker) -> None:
    context, _, endpoint = silent_broker
    link = BrokerLink(
        context,
        LinkConfig(endpoint, HEARTBEAT, LIVENESS, max_retry=0.0),
        lambda: None,
        lambda: None,
    )
    try:
        reconnects(link, 3)
        assert link.retry_interval == pytest.approx(HEARTBEAT * LIVENESS)
    finally:
        link.close()


def test_the_brokers_longer_interval_stretches_the_expiry(silent_broker) -> None:
    context, _, endpoint = silent_broker
    link = BrokerLink(
        context, LinkConfig(endpoint, HEARTBEAT, LIVENESS), lambda: None, lambda: None
    )
    try:
        link.heard(interval=0.5)
        assert link.expiry == pytest.approx(1.0) and link.wait() <= HEARTBEAT
    finally:
        link.close()


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # pyzmq's "unclosed context"
def test_a_client_dropped_unclosed_is_freed_at_once(silent_broker) -> None:
    """The link holds nothing that leads back to its client, so a client nobody closed is
    freed when dropped, not by a later garbage collection (whose teardown of the context
    could wait forever on a socket it can no longer see)."""
    client = Client(silent_broker[2])
    dropped, its_link = weakref.ref(client), weakref.ref(client.link)
    del client
    assert dropped() is None
    assert its_link() is None, "a cycle holds the link (and its socket) until a collection"


@pytest.mark.parametrize(
    "endpoint, loopback",
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.0.0.2:5555", True),
        ("tcp://127.255.0.9:*", True),
        ("tcp://[::1]:5555", True),
        ("tcp://lo:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://*:5555", False),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://10.0.0.1:5555", False),
        ("tcp://[::]:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://128.0.0.1:5555", False),
        ("ipc:///tmp/farm", False),
    ],
)
def test_loopback_endpoints_are_told_apart(endpoint: str, loopback: bool) -> None:
    assert is_loopback(endpoint) is loopback


def test_the_unencrypted_warning_skips_loopback_binds(capsys) -> None:
    from farm.cli.broker import warn_if_exposed

    for bind in ("tcp://127.0.0.2:5555", "tcp://lo:5555", "tcp://[::1]:5555"):
        warn_if_exposed(bind, None)
    assert capsys.readouterr().err == ""
    warn_if_exposed("tcp://0.0.0.0:5555", None)
    assert "reachable from other machines and --curve is off" in capsys.readouterr().err


def test_ipv6_endpoints_get_an_ipv6_socket() -> None:
    assert is_ipv6("tcp://[::1]:5555") and is_ipv6("tcp://[fe80::1%lo]:5555")
    assert not is_ipv6("tcp://127.0.0.1:5555") and not is_ipv6("ipc:///tmp/x:y")


@pytest.fixture
def hanging_up_listener() -> Iterator[str]:
    """A TCP listener that closes every connection as soon as it accepts it: to a ZeroMQ
    peer, a handshake ended without a reason, as a CURVE broker's is when its own side
    notices a plain-text peer first."""
    listener = socket.create_server(("127.0.0.1", 0))
    closer = threading.Thread(target=close_every_connection, args=(listener,), daemon=True)
    closer.start()
    yield f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


def close_every_connection(listener: socket.socket) -> None:
    while True:
        try:
            connection, _ = listener.accept()
        except OSError:
            return  # the listener was closed
        connection.close()


def test_handshakes_ended_without_a_reason_are_an_error_not_a_hang(
    hanging_up_listener: str,
) -> None:
    with Client(hanging_up_listener, timeout=60.0) as client:
        with pytest.raises(FarmError, match=f"closed {SILENT_REFUSALS} handshakes in a row"):
            client.info()
