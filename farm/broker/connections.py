"""Which peer each connection carries, so that a connection closing names its peer.

A worker killed with ``kill -9`` says no goodbye, but the kernel closes its TCP
connection at once.  ZeroMQ reports the closing on the ROUTER's monitor socket by
file descriptor, and each message says which descriptor it came in on
(``zmq.SRCFD``), so the broker learns of a crash in milliseconds rather than after
``liveness`` heartbeats of silence, and knows it was a crash (a worker frozen or cut
off keeps its connection open).  Descriptors are reused: a new peer on a descriptor
still mapped means the old connection closed, and its close event, when it comes,
is stale.
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
    """Peers by connection descriptor."""

    peer_of: dict[int, bytes] = field(default_factory=dict)
    stale: Counter[int] = field(default_factory=Counter)  # close events owed for reused fds

    def seen(self, fd: int, peer: bytes) -> bytes | None:
        """``peer`` spoke over ``fd``; the peer the descriptor carried before, if another
        (its connection closed, though its close event has not come yet)."""
        if fd < 0:
            return None
        before = self.peer_of.get(fd)
        self.peer_of[fd] = peer
        if before is None or before == peer:
            return None
        self.stale[fd] += 1
        return before

    def closed(self, fd: int) -> bytes | None:
        """The connection on ``fd`` closed: the peer it carried, if still known."""
        if self.stale[fd] > 0:
            self.stale[fd] -= 1
            return None
        del self.stale[fd]
        return self.peer_of.pop(fd, None)
