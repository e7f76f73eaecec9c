"""Stop a ZeroMQ loop at once on SIGINT/SIGTERM, not at its next timer.

A poll waits up to a heartbeat interval; a signal handler that only sets a flag
is seen when that wait ends (a second with the default interval, for every
worker and the broker of a stopping farm).  ``Wakeup`` installs the handlers and
``signal.set_wakeup_fd`` on one end of a socket pair; its other end goes into
the loop's ``zmq.Poller``, so the signal ends the wait.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable

import zmq


class Wakeup:
    """Run ``on_signal`` on SIGINT/SIGTERM and make ``poller`` return (main thread only)."""

    def __init__(self, on_signal: Callable[[], None]) -> None:
        self.reader, self.writer = socket.socketpair()
        self.reader.setblocking(False)
        self.writer.setblocking(False)
        self.previous_fd = signal.set_wakeup_fd(self.writer.fileno(), warn_on_full_buffer=False)
        for number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(number, lambda *_: on_signal())

    def watch(self, poller: zmq.Poller) -> None:
        poller.register(self.reader, zmq.POLLIN)

    def drain(self) -> None:
        """Empty the pipe (the signal bytes) so the next poll waits again."""
        try:
            while self.reader.recv(4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        signal.set_wakeup_fd(self.previous_fd)
        self.reader.close()
        self.writer.close()
