"""A protocol-level worker the tests drive by hand, to act as a broken or slow worker would."""

from __future__ import annotations

import zmq

from farm.wire import messages, protocol
from farm.wire.messages import Header
from farm.wire.protocol import Command, Message


class ScriptedWorker:
    """A DEALER that registers as a worker and answers only when told to."""

    def __init__(self, endpoint: str, slots: int = 1, models: dict | None = None) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        lenet = {"lenet": messages.ModelFacts(input_shape=(1, 28, 28))}
        self.send(
            Command.READY,
            messages.Ready(
                device="cpu:0",
                host="scripted",
                pid=1,
                backend="none",
                threads=1,
                slots=slots,
                models=models or lenet,
            ),
        )

    def send(self, command: Command, header: Header | None = None, payload: list = ()) -> None:
        self.socket.send_multipart(protocol.encode(command, header, payload))

    def receive(self, timeout_ms: int = 10_000) -> Message | None:
        """The next message other than a heartbeat (answered, to stay alive), or None if none
        came within the timeout."""
        while self.socket.poll(timeout_ms):
            message = protocol.decode(self.socket.recv_multipart())
            if message.command is not Command.HEARTBEAT:
                return message
            self.send(Command.HEARTBEAT)
        return None

    def close(self) -> None:
        self.socket.close()
        self.context.term()
