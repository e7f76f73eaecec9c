import sys, time
import pytest
from hypothesis import given
from hypothesis import strategies as st
import tests.system.test_floods as tf
from tests.unit.test_fuzz import FUZZ_SETTINGS, BATCH, garbage
from tests.conftest import reference_forward
from farm.wire import protocol
from farm.wire.protocol import Command

T0 = time.monotonic()
SEEN = set()
orig_cmd = tf.farm_command
tf.farm_command = lambda *a: orig_cmd(*["DEBUG" if x == "WARNING" else x for x in a])


class Traced(tf.WorkerFuzzer):
    def __init__(self, *a):
        import zmq
        from zmq.utils.monitor import recv_monitor_message
        orig = zmq.Context.socket
        holder = {}
        def sock(ctx, kind, **kw):
            s = orig(ctx, kind, **kw)
            if kind == zmq.ROUTER and "m" not in holder:
                holder["m"] = s.get_monitor_socket()
            return s
        zmq.Context.socket = sock
        try:
            super().__init__(*a)
        finally:
            zmq.Context.socket = orig
        self.mon = holder["m"]

    def events(self):
        from zmq.utils.monitor import recv_monitor_message
        import zmq
        while self.mon.poll(0):
            e = recv_monitor_message(self.mon)
            print(f"{time.monotonic()-T0:8.3f} EVENT {zmq.Event(e['event']).name} {e['value']}", file=sys.stderr)
    def receive(self, wanted):
        deadline = time.monotonic() + tf.REPLY_TIMEOUT
        while True:
            assert self.process.poll() is None
            wait = int((deadline - time.monotonic()) * 1000)
            assert wait > 0 and self.router.poll(wait), "the worker did not answer"
            identity, *frames = self.router.recv_multipart()
            self.events()
            message = self.tally.reply(frames)
            if self.trace or identity not in SEEN:
                SEEN.add(identity)
                print(f"{time.monotonic()-T0:8.3f} recv {identity.hex()} {message and message.command.name}", file=sys.stderr)
            if message is None:
                continue
            if message.command is Command.READY and identity != self.identity:
                self.identity, self.reconnects = identity, self.reconnects + 1
            elif message.command is Command.HEARTBEAT:
                self.answer(identity, protocol.encode(Command.HEARTBEAT, tf.messages.Heartbeat(interval=1.0)))
            elif message.command is Command.FETCH:
                self.answer(identity, protocol.encode(Command.MODEL, tf.messages.Model(model=message.header.model, digest=message.header.digest, files=[], error="no such model")))
            if wanted(message):
                return message

    def send(self, frames):
        if self.trace:
            print(f"{time.monotonic()-T0:8.3f} send {self.identity.hex()} {frames[1]!r}", file=sys.stderr)
        return super().send(frames)


@pytest.mark.parametrize("target", [2000])
def test_repro(lenet, digits, tmp_path, target) -> None:
    images = digits[:200, None]
    log = tmp_path / "worker.log"
    Traced.trace = False
    fuzzer = Traced(log, images, reference_forward(lenet, images))
    try:
        @FUZZ_SETTINGS
        @given(
            batch=st.lists(garbage("worker"), min_size=BATCH[0], max_size=BATCH[1]),
            position=st.floats(0, 1),
            items=st.tuples(st.integers(0, 199), st.integers(1, 50)),
        )
        def fuzz_round(batch, position, items) -> None:
            if fuzzer.tally.malformed >= target:
                return
            start, count = items[0], min(items[1], len(images) - items[0])
            at = int(position * len(batch))
            for item in batch[:at]:
                fuzzer.fuzz(item)
            fuzzer.send(fuzzer.real_task(start, count))
            for item in batch[at:]:
                fuzzer.fuzz(item)
            fuzzer.check_result(start, count)
        while fuzzer.tally.malformed < target:
            fuzz_round()
        Traced.trace = True
        print(f"{time.monotonic()-T0:8.3f} silence", file=sys.stderr)
        time.sleep(7)
        try:
            fuzzer.send(fuzzer.real_task(0, 10))
            fuzzer.check_result(0, 10)
        finally:
            print("\nreplies", fuzzer.tally.replies, "bad", dict(fuzzer.tally.bad_replies), "reconnects", fuzzer.reconnects, file=sys.stderr)
    finally:
        fuzzer.close()
