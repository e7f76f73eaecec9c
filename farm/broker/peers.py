"""Who may send what: every peer of the broker is a worker or a client.

* A worker registers (READY) before it may send RESULT, FAILED or FETCH; a peer that
  has not is refused (a RESULT gets DISCONNECT: a worker the broker dropped registers
  again).  A registered worker cannot SUBMIT, and a connection holding jobs cannot
  register as a worker.
* With ``--curve``, a key is authorized as a worker, a client or an operator (its
  folder under ``authorized/``, ``farm.wire.curve.KeyRoles``): a client key cannot
  register as a worker, a worker key cannot submit.  An operator may act as a client.
* INFO shows the whole farm to operators: peers on this host (loopback or IPC) and,
  with CURVE, operator keys (``authorized/operators/``).  Others see the workers and
  counters, and their own jobs only (``Peer.owner``: their CURVE key, else their
  connection).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from farm.broker.state import FarmState
from farm.wire import messages
from farm.wire.messages import Header

WORKER, CLIENT, OPERATOR = "worker", "client", "operator"
EVERY_ROLE = frozenset({WORKER, CLIENT, OPERATOR})
#: What only a registered worker sends, and what only a client does.
WORKER_MESSAGES = (messages.Result, messages.Failed, messages.Fetch)
CLIENT_MESSAGES = (messages.Submit, messages.Data, messages.Cancel)
#: Peers remembered at once; past it the memory starts afresh (a peer is looked up again).
MAX_PEERS = 10_000


@dataclass(frozen=True)
class Peer:
    """One connection as the broker sees it: who it is, and what it may do."""

    identity: bytes
    owner: str  # whose jobs are its own: its CURVE key, else its connection
    roles: frozenset[str]
    operator: bool  # sees the whole farm in INFO

    def refusal(self, header: Header, state: FarmState) -> str | None:
        """Why this peer may not send ``header`` now, or None."""
        worker = self.identity in state.workers
        if isinstance(header, messages.Ready):
            if WORKER not in self.roles:
                return "this CURVE key is not authorized as a worker (authorized/workers/)"
            if any(job.client == self.identity for job in state.jobs.values()):
                return "this connection submitted jobs: a client cannot register as a worker"
        elif isinstance(header, WORKER_MESSAGES) and not worker:
            return f"{type(header).__name__.upper()} is for registered workers only"
        elif isinstance(header, messages.Submit) and worker:
            return "a registered worker cannot submit jobs: submit from a client connection"
        elif isinstance(header, CLIENT_MESSAGES) and not self.roles & {CLIENT, OPERATOR}:
            return "this CURVE key is not authorized as a client (authorized/clients/)"
        return None


@dataclass
class Peers:
    """The broker's peers by identity; ``roles``: what each CURVE key may do (None: no
    CURVE, every peer may act as either); ``local``: the broker listens on IPC only."""

    roles: Any = None  # farm.wire.curve.KeyRoles
    local: bool = False
    known: dict[bytes, Peer] = field(default_factory=dict)

    def of(self, identity: bytes, frame: Any) -> Peer:
        """The peer that sent ``frame`` (a zmq.Frame of its message: its metadata names
        the CURVE key and the address)."""
        peer = self.known.get(identity)
        if peer is None or (self.roles is not None and peer.owner != metadata(frame, "User-Id")):
            if len(self.known) >= MAX_PEERS:  # a new key behind a reused identity: looked up
                self.known.clear()
            peer = self.known[identity] = self.make(identity, frame)
        return peer

    def forget(self, identity: bytes) -> None:
        self.known.pop(identity, None)

    def make(self, identity: bytes, frame: Any) -> Peer:
        local = self.local or on_this_host(frame)
        if self.roles is None:
            return Peer(identity, identity.hex(), EVERY_ROLE, local)
        key = metadata(frame, "User-Id")
        roles = self.roles.of(key)
        return Peer(identity, key, roles, local or OPERATOR in roles)


def metadata(frame: Any, name: str) -> str:
    """A message property libzmq attached to ``frame`` ("" if none)."""
    try:
        return str(frame.get(name))
    except Exception:  # a frame without metadata (bytes in tests), or an unknown property
        return ""


def on_this_host(frame: Any) -> bool:
    """Whether the frame came over loopback or IPC (libzmq's "Peer-Address")."""
    address = metadata(frame, "Peer-Address")
    if address.startswith("localhost"):  # IPC: libzmq names the peer's process
        return True
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 from a dual-stack socket
    return (mapped or ip).is_loopback


__all__ = ["CLIENT", "OPERATOR", "WORKER", "Peer", "Peers"]
