"""The results a worker sent last, kept to offer again if its broker is lost.

A broker that dies takes with it the results in its queues, and those a worker sends
before it notices the loss.  The worker keeps what it sent in the last ``seconds``
(within ``max_bytes``) and, once registered with a broker again, sends them once more
marked ``kept``: a restarted broker holds them until the job's client submits again
(``farm.broker.kept``); a broker that knows the job drops them as late.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from farm.wire import messages, protocol
from farm.wire.protocol import Command

#: Most bytes of results a worker keeps.
MAX_KEPT_BYTES = 64 << 20
#: Least seconds a result is kept after it was sent.
KEPT_SECONDS = 10.0

_result_decoder = msgspec.msgpack.Decoder(messages.Result)


@dataclass
class SentResults:
    """RESULT messages as sent, newest last, with when and how large."""

    seconds: float = KEPT_SECONDS
    max_bytes: int = MAX_KEPT_BYTES
    clock: Callable[[], float] = time.monotonic
    sent: deque[tuple[float, int, list[Any]]] = field(default_factory=deque)
    size: int = 0

    def note(self, frames: list[Any]) -> None:
        """A message going to the broker: kept if it is a RESULT."""
        if bytes(memoryview(frames[1])) != Command.RESULT.value:
            return
        size = protocol.payload_bytes(frames[3:])
        self.sent.append((self.clock(), size, frames))
        self.size += size
        self.forget()

    def forget(self) -> None:
        """Drop what is older than ``seconds`` or beyond ``max_bytes``."""
        oldest = self.clock() - self.seconds
        while self.sent and (self.sent[0][0] < oldest or self.size > self.max_bytes):
            self.size -= self.sent.popleft()[1]

    def offers(self) -> list[list[Any]]:
        """The kept results as messages marked ``kept``; they are no longer kept."""
        self.forget()
        offers = [as_kept(frames) for _, _, frames in self.sent]
        self.sent.clear()
        self.size = 0
        return offers


def as_kept(frames: list[Any]) -> list[Any]:
    """A RESULT message marked ``kept``."""
    header = _result_decoder.decode(memoryview(frames[2]))
    return protocol.encode(Command.RESULT, msgspec.structs.replace(header, kept=True), frames[3:])
