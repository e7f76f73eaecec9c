"""The worker's side of its conversation with the broker (the I/O thread).

Each broker message is liveness (a heartbeat, which also tells the worker the broker
took its READY), an order (cancel a job or an attempt, register again, exit), or work
for the compute thread.  A new connection offers again the results sent last
(``farm.workers.kept``), in case the broker that took them was lost.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass

from farm.wire import messages, protocol
from farm.wire.link import BrokerLink, recv_frames
from farm.wire.protocol import Command, ProtocolError
from farm.workers.chunks import Cancellations, QueuedMessage
from farm.workers.config import WorkerConfig
from farm.workers.kept import SentResults

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


class WorkerRefused(ValueError):
    """The broker refused this worker's READY: the worker exits (status 1) rather than
    register again, unheard, forever."""


@dataclass
class BrokerConversation:
    """What the broker's messages mean to a worker, and where its registration stands:
    whether the broker took this connection's READY (its first heartbeat came), whether it
    ever did, and whether the silence of this wait was reported."""

    config: WorkerConfig
    cancels: Cancellations
    sent: SentResults
    registered: bool = False
    was_registered: bool = False
    silence_reported: bool = False
    started_waiting: float = 0.0  # monotonic clock when this worker began to wait

    def receive(self, link: BrokerLink, tasks: queue.Queue) -> None:
        """One message from the broker: liveness, an order, or work for compute."""
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
            self.cancels.cancel_chunk(header.chunk)
        elif isinstance(header, messages.Cancel):
            self.cancels.cancel(header.job)
        elif message.command is Command.DISCONNECT:
            log.warning(
                "the broker does not know this worker (it restarted, or declared us "
                "dead): registering again"
            )
            link.reconnect()
            self.reconnected(link, tasks)
        else:
            tasks.put(QueuedMessage(link.generation, message, received))

    def reconnected(self, link: BrokerLink, tasks: queue.Queue) -> None:
        """A new connection (READY sent): the old one's fetches died; the results sent last
        are offered again, in case the broker that took them was lost."""
        self.registered = False
        tasks.put(QueuedMessage(link.generation, None, 0.0))
        for offer in self.sent.offers():
            link.send(offer)

    def on_registered(self) -> None:
        """The broker took this connection's READY (its first heartbeat came)."""
        self.registered = True
        log.info(
            "registered with the broker at %s%s",
            self.config.broker,
            " again" if self.was_registered else "",
        )
        self.was_registered = True

    def report_silence(self) -> None:
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
