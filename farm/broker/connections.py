"""Which peer each connection carries, so that a connection closing names its peer.

A worker killed with ``kill -9`` says no goodbye, but the kernel closes its TCP
connection at once.  ZeroMQ reports accepted and closed connections on the ROUTER's
monitor socket by file descriptor, and each message says which descriptor it came in
on (``zmq.SRCFD``), so the broker learns of a crash in milliseconds rather than after
``liveness`` heartbeats of silence, and knows it was a crash (a worker frozen or cut
off keeps its connection open).

Descriptors are reused, and the monitor's events and the socket's messages are two
streams.  So connections are numbered per descriptor as the monitor reports them
accepted, a peer is filed under its connection's number, and a close names a peer
only if it closes that very connection.  The broker reads the monitor before filing
a peer (the connection's accept was reported before its first message arrived) and
acts on closes once it has read the messages waiting (a dead worker's last result
arrived before its close).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import zmq


def source_fd(frame: Any) -> int:
    """The descriptor a received frame came in on; -1 where the transport has none."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (AttributeError, zmq.ZMQError):
        return -1


@dataclass
class Connections:
    """Peers by connection: (descriptor, its number among the connections on it)."""

    accepted: Counter[int] = field(default_factory=Counter)  # fd -> connections so far
    peer_of: dict[int, tuple[int, bytes]] = field(default_factory=dict)  # fd -> (number, peer)
    closing: list[tuple[int, int]] = field(default_factory=list)  # closed, not acted on yet

    def on_accepted(self, fd: int) -> None:
        self.accepted[fd] += 1

    def on_closed(self, fd: int) -> None:
        """The monitor reported the connection now on ``fd`` closed."""
        self.closing.append((fd, self.accepted[fd]))

    def seen(self, fd: int, peer: bytes) -> None:
        """``peer`` registered over ``fd`` (the monitor read up to now)."""
        if fd >= 0:
            self.peer_of[fd] = (self.accepted[fd], peer)

    def closed_peers(self) -> list[bytes]:
        """The peers of the connections closed since the last call."""
        peers = []
        for fd, number in self.closing:
            filed = self.peer_of.get(fd)
            if filed is not None and filed[0] == number:
                del self.peer_of[fd]
                peers.append(filed[1])
        self.closing.clear()
        return peers
