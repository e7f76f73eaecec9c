"""A real broker and a real worker keep serving through floods of malformed messages (the
strategies are tests/unit/test_fuzz.py's)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq
from hypothesis import example, given
from hypothesis import strategies as st
from zmq.utils.monitor import recv_monitor_message

from farm.ops.local import LocalFarm, cores, farm_command
from farm.wire import messages, protocol
from farm.wire.protocol import (
    Command,
    ProtocolError,
)
from farm.workers.worker import ACCEPTED as WORKER_ACCEPTS
from tests.conftest import reference_forward
from tests.system.test_bad_input import assert_farm_still_serves
from tests.unit.test_fuzz import (
    BATCH,
    BROKER_ACCEPTS,
    FUZZ_BUDGET,
    FUZZ_SETTINGS,
    ITEM_SHAPE,
    LENET_DIGEST,
    LIVE,
    REPLY_TIMEOUT,
    RSS_GROWTH_LIMIT,
    TARGET,
    WARMUP,
    Garbage,
    corpus,
    garbage,
)


@dataclass
class Tally:
    """What was sent to one peer, and what came back."""

    sent: int = 0
    malformed: int = 0  # rejected by protocol.decode with the peer's accepted commands
    batches: int = 0
    families: Counter = field(default_factory=Counter)
    replies: Counter = field(default_factory=Counter)
    bad_replies: Counter = field(default_factory=Counter)  # the peer broke the protocol
    rss_warm: int | None = None
    rss_end: int | None = None

    def count(self, item: Garbage, frames: Sequence[bytes], accepts: frozenset) -> None:
        """Count a message about to be sent; decode must refuse it with ProtocolError or
        accept it, never raise anything else."""
        self.sent += 1
        self.families[item.family] += 1
        try:
            protocol.decode(frames, allowed=accepts)
        except ProtocolError:
            self.malformed += 1
        except Exception as exc:
            raise AssertionError(
                f"protocol.decode raised {type(exc).__name__} (not "
                f"ProtocolError) on {item!r}: {exc}"
            ) from exc

    def reply(self, frames: Sequence[bytes]) -> protocol.Message | None:
        """A message from the peer, which must be well-formed whatever it was sent; a
        malformed one is counted (and reported at the end) and None returned."""
        try:
            message = protocol.decode(frames)
        except ProtocolError as exc:
            name = next((c.name for c in Command if list(frames[1:2]) == [c.value]), "?")
            try:  # what it says, read without the limits
                said = msgpack.unpackb(frames[2], strict_map_key=False).get("error", "")[:32]
            except Exception:
                said = "?"
            self.bad_replies[f"{name} {said!r}...: {str(exc)[:100]}"] += 1
            return None
        self.replies[message.command.name] += 1
        return message

    def note_rss(self, pid: int, peer: str) -> None:
        if self.rss_warm is None and self.sent >= WARMUP:
            self.rss_warm = rss(pid, peer)

    def report(self, peer: str, seconds: float) -> str:
        growth = (self.rss_end - self.rss_warm) / 2**20
        return (
            f"{peer}: {self.sent} messages in {self.batches} batches, {self.malformed} "
            f"malformed, in {seconds:.1f} s; RSS {self.rss_warm / 2**20:.1f} MiB after "
            f"{WARMUP} -> {self.rss_end / 2**20:.1f} MiB at the end ({growth:+.1f} MiB, "
            f"limit {RSS_GROWTH_LIMIT >> 20}); families {dict(sorted(self.families.items()))}"
            f"; replies {dict(sorted(self.replies.items()))}"
        )


def rss(pid: int, peer: str) -> int:
    """A process' resident memory in bytes (VmRSS in /proc/PID/status)."""
    status = Path(f"/proc/{pid}/status")
    assert status.exists(), f"the {peer} process {pid} is gone"
    for line in status.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in {status}")


@contextlib.contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """Point file descriptor 2 at ``path``: processes started meanwhile write their log there."""
    saved = os.dup(2)
    try:
        with open(path, "ab") as log:
            os.dup2(log.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def bugs(log: Path, tally: Tally) -> list[str]:
    """What the peer's own code calls a bug: the exceptions it logged (a broker logs one
    instead of answering ERROR), each with the line that raised it, and the messages it sent
    that the protocol rejects."""
    found: Counter = Counter()
    where, in_traceback = "", False
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("Traceback"):
            where, in_traceback = "", True
        elif in_traceback and line.lstrip().startswith("File "):
            where = line.strip()
        elif in_traceback and line and not line[0].isspace():
            found[f"{line.strip()[:160]} ({where})"] += 1
            in_traceback = False
    for problem, count in tally.bad_replies.items():
        found[f"sent a malformed message: {problem}"] += count
    return [f"{count} x {problem}" for problem, count in found.most_common()]


# ------------------------------------------------------------------- templates


class WorkerFuzzer:
    """A ROUTER acting as the broker of one real worker process: it sends the worker garbage
    with real TASKs among it, answers its heartbeats and FETCHes, and follows it when it
    reconnects (each connection has an identity of its own).

    The ROUTER reads its connections in turn, not in the order they opened: after several
    reconnections the READY read last may come from a connection closed since.  So every
    connection that registered is remembered, and those known closed (a goodbye, a send
    refused), and what is sent goes to the newest of the others."""

    def __init__(
        self, log: Path, images: np.ndarray, expected: np.ndarray, heartbeat: float = 1.0
    ) -> None:
        self.images, self.expected = images, expected
        self.heartbeat = heartbeat  # the worker's interval, and the one this broker announces
        self.real_job, self.real_tasks = f"real-{uuid.uuid4().hex}", 0
        self.awaited: list[bytes] | None = None  # the real TASK whose RESULT is awaited ...
        self.awaited_on = b""  # ... and the connection it went to
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises
        self.router.setsockopt(zmq.SNDTIMEO, int(REPLY_TIMEOUT * 1000))
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        with open(log, "ab") as stderr:
            self.process = subprocess.Popen(
                farm_command(
                    "--log-level",
                    "WARNING",
                    "worker",
                    "--device",
                    f"cpu:{min(os.sched_getaffinity(0))}",
                    "--broker",
                    f"tcp://127.0.0.1:{port}",
                    "--model",
                    "lenet",
                    "--heartbeat",
                    str(heartbeat),
                ),
                stderr=stderr,
            )
        self.identity = b""  # the connection sent to: the newest registered, as far as known
        self.registered: list[bytes] = []  # connections that sent READY, in the order read
        self.gone: set[bytes] = set()  # connections that said goodbye or refused a send
        self.tally = Tally()
        try:
            self.receive(lambda message: message.command is Command.READY)
        except BaseException:
            self.close()
            raise

    def fuzz(self, item: Garbage) -> None:
        self.tally.count(item, item.frames, WORKER_ACCEPTS)
        self.send(item.frames)

    def send_task(self, start: int, count: int) -> None:
        """Send a real TASK; it goes again if its connection closes before answering (the
        worker reconnected: a broker requeues what a lost connection held)."""
        task = self.real_task(start, count)
        self.send(task)
        self.awaited, self.awaited_on = task, self.identity

    def real_task(self, start: int, count: int) -> list[bytes]:
        """A valid TASK for images ``start..``: a LeNet chunk as the broker would send it."""
        self.real_tasks += 1
        return protocol.encode(
            Command.TASK,
            messages.Task(
                job=self.real_job,
                chunk=self.real_tasks,
                attempt=1,
                start=start,
                count=count,
                model="lenet",
                digest=LENET_DIGEST,
                dtype="uint8",
                item_shape=tuple(ITEM_SHAPE),
            ),
            [self.images[start : start + count].tobytes()],
        )

    def check_result(self, start: int, count: int) -> None:
        """The last real TASK came back, exact."""
        reply = self.receive(self.answers_task)
        self.awaited = None
        assert reply.command is Command.RESULT, f"a real TASK failed: {reply.header}"
        assert (reply.header.chunk, reply.header.start, reply.header.count) == (
            self.real_tasks,
            start,
            count,
        ), "the RESULT of another TASK"
        np.testing.assert_allclose(
            reply.array("float32", (10,)), self.expected[start : start + count], atol=1e-5
        )

    def answers_task(self, message: protocol.Message) -> bool:
        """Whether a message answers the last real TASK: a worker that reconnected offers its
        last results again, marked kept, and a TASK sent again may be answered twice (the
        answer to an earlier one is late)."""
        header: Any = message.header  # a RESULT's or a FAILED's, when it counts
        return (
            message.command in (Command.RESULT, Command.FAILED)
            and header.job == self.real_job
            and header.chunk >= self.real_tasks
            and not (message.command is Command.RESULT and header.kept)
        )

    @property
    def reconnects(self) -> int:
        """Connections the worker registered after its first."""
        return len(self.registered) - 1

    def send(self, frames: Sequence[bytes]) -> None:
        """Send to the worker's newest connection; one found closed (the worker reconnected)
        is left for the newest other, or the next to register."""
        deadline = time.monotonic() + REPLY_TIMEOUT
        while True:
            assert time.monotonic() < deadline, "the worker keeps reconnecting"
            if self.identity in self.gone:
                self.identity = self.newest_connection()
            try:
                self.router.send_multipart([self.identity, *frames])
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                self.gone.add(self.identity)

    def newest_connection(self) -> bytes:
        """The connection registered last of those not known closed, waiting for a READY if
        none is left."""
        while not (live := [c for c in self.registered if c not in self.gone]):
            self.receive(lambda message: message.command is Command.READY)
        return live[-1]

    def receive(self, wanted) -> protocol.Message:
        """The worker's next message that ``wanted`` accepts, serving a broker's part meanwhile."""
        deadline = time.monotonic() + REPLY_TIMEOUT
        while True:
            assert self.process.poll() is None, f"the worker exited ({self.process.returncode})"
            wait = int((deadline - time.monotonic()) * 1000)
            assert wait > 0 and self.router.poll(wait), "the worker did not answer"
            message = self.handle(*self.router.recv_multipart())
            if message is not None and wanted(message):
                return message

    def serve(self) -> None:
        """Handle what the worker sent meanwhile, without waiting: between rounds, while
        hypothesis draws the next, a broker still answers heartbeats (else the worker counts
        it lost and reconnects)."""
        while self.router.poll(0):
            self.handle(*self.router.recv_multipart())

    def handle(self, identity: bytes, *frames: bytes) -> protocol.Message | None:
        """A broker's part for one message of the worker's (None: a malformed one): note a
        connection that registers or says goodbye, answer a heartbeat or a FETCH."""
        message = self.tally.reply(frames)
        if message is None:
            return None
        if message.command is Command.READY and identity not in self.registered:
            self.registered.append(identity)
            self.identity = identity
        elif message.command is Command.DISCONNECT:
            self.gone.add(identity)
            if self.awaited is not None and identity == self.awaited_on:
                self.send(self.awaited)
                self.awaited_on = self.identity
        elif message.command is Command.HEARTBEAT and identity not in self.registered:
            # one that never registered: a broker tells it to (membership.on_worker_heard)
            self.answer(identity, protocol.encode(Command.DISCONNECT))
        elif message.command is Command.HEARTBEAT:
            heartbeat = messages.Heartbeat(interval=self.heartbeat)
            self.answer(identity, protocol.encode(Command.HEARTBEAT, heartbeat))
        elif message.command is Command.FETCH:  # as a broker does for a model it lacks
            self.answer(
                identity,
                protocol.encode(
                    Command.MODEL,
                    messages.Model(
                        model=message.header.model,
                        digest=message.header.digest,
                        files=[],
                        error="no such model",
                    ),
                ),
            )
        return message

    def await_reconnects(self, count: int) -> None:
        """Say nothing until the worker has opened ``count`` new connections: a worker whose
        broker is silent reconnects, again and again (each try waiting twice as long)."""
        monitor = self.router.get_monitor_socket(zmq.EVENT_ACCEPTED)
        try:
            for _ in range(count):
                assert monitor.poll(int(REPLY_TIMEOUT * 1000)), "the worker did not reconnect"
                recv_monitor_message(monitor)
        finally:
            self.router.disable_monitor()
            monitor.close(linger=0)

    def answer(self, identity: bytes, frames: list[bytes]) -> None:
        """Answer a message, unless its connection is gone (the worker reconnected since it
        was sent: a broker drops such answers too)."""
        try:
            self.router.send_multipart([identity, *frames])
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.router.close()
        self.context.term()


def fuzz_until_target(fuzz_round: Callable[[], None], tally: Any) -> float:
    """Run hypothesis rounds until ``TARGET`` malformed messages were sent; the seconds taken."""
    started = time.monotonic()
    while tally.malformed < TARGET:
        assert time.monotonic() - started < FUZZ_BUDGET, (
            f"only {tally.malformed} malformed messages in {FUZZ_BUDGET} s"
        )
        fuzz_round()
    return time.monotonic() - started


# --------------------------------------------------------------------- broker


class BrokerFuzzer:
    """Sends batches to the broker, each from a fresh DEALER, and checks it still answers."""

    def __init__(self, endpoint: str, pid: int) -> None:
        self.endpoint, self.pid = endpoint, pid
        self.context = zmq.Context()
        self.probe = self.dealer()
        self.tally = Tally()
        self.live_job = b"0" * 32
        self.in_job = 0  # messages sent while a real job was running
        self.job_running = threading.Event()

    def dealer(self, identity: bytes | None = None) -> zmq.Socket:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, int(REPLY_TIMEOUT * 1000))  # a stuck broker fails the test
        if identity:
            sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.connect(self.endpoint)
        return sock

    def send_batch(self, batch: list[Garbage], identity: bytes | None) -> None:
        """Send fire-and-forget; then a heartbeat for a made-up job, whose ERROR reply comes
        after the broker has handled the whole batch."""
        self.tally.batches += 1
        sock = self.dealer(identity and identity + self.tally.batches.to_bytes(4, "big"))
        try:
            for item in batch:
                frames = list(item.frames)
                if len(frames) > 2:
                    frames[2] = frames[2].replace(LIVE, self.live_job)
                self.tally.count(item, frames, BROKER_ACCEPTS)
                self.in_job += self.job_running.is_set()
                sock.send_multipart(frames)
            token = f"sync-{self.tally.batches}"
            sock.send_multipart(protocol.encode(Command.HEARTBEAT, messages.Heartbeat(job=token)))
            deadline = time.monotonic() + REPLY_TIMEOUT
            while True:
                assert sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), (
                    f"the broker did not answer within {REPLY_TIMEOUT} s after a batch"
                )
                reply = self.tally.reply(sock.recv_multipart())
                if (
                    reply
                    and messages.job_of(reply.header) == token
                    and reply.command is Command.ERROR
                ):
                    break
        finally:
            sock.close()
        self.snapshot()
        self.tally.note_rss(self.pid, "broker")

    def snapshot(self) -> dict[str, Any]:
        """The broker's INFO (over a socket of its own): it serves; the real job's id."""
        self.probe.send_multipart(protocol.encode(Command.INFO, messages.Info()))
        while True:
            assert self.probe.poll(int(REPLY_TIMEOUT * 1000)), "the broker stopped answering INFO"
            reply = protocol.decode(self.probe.recv_multipart())
            if reply.command is Command.INFO:
                break
        snapshot = reply.document(dict)
        jobs = [
            job["job"]
            for job in snapshot["jobs"]
            if isinstance(job["job"], str) and len(job["job"]) == len(LIVE)
        ]
        if jobs:
            self.live_job = jobs[0].encode()
        return snapshot

    def close(self) -> None:
        self.probe.close()
        self.context.term()


def test_worker_keeps_serving_through_a_flood_of_malformed_messages(
    lenet, digits, tmp_path
) -> None:
    images = digits[:200, None]
    log = tmp_path / "worker.log"
    fuzzer = WorkerFuzzer(log, images, reference_forward(lenet, images))
    try:

        @FUZZ_SETTINGS
        @given(
            batch=st.lists(garbage("worker"), min_size=BATCH[0], max_size=BATCH[1]),
            position=st.floats(0, 1),
            items=st.tuples(st.integers(0, 199), st.integers(1, 50)),
        )
        @example(batch=corpus("worker"), position=0.5, items=(0, 10))
        def fuzz_round(batch: list[Garbage], position: float, items: tuple[int, int]) -> None:
            """The batch with one real TASK among it; its RESULT must be exact."""
            fuzzer.serve()  # what came while hypothesis drew this round
            if fuzzer.tally.malformed >= TARGET:
                return
            fuzzer.tally.batches += 1
            start, count = items[0], min(items[1], len(images) - items[0])
            at = int(position * len(batch))
            for item in batch[:at]:
                fuzzer.fuzz(item)
            fuzzer.send_task(start, count)
            for item in batch[at:]:
                fuzzer.fuzz(item)
            fuzzer.check_result(start, count)
            fuzzer.tally.note_rss(fuzzer.process.pid, "worker")

        seconds = fuzz_until_target(fuzz_round, fuzzer.tally)
        fuzzer.send_task(0, 10)  # its RESULT comes after the worker read it all
        fuzzer.check_result(0, 10)
        tally = fuzzer.tally
        tally.rss_end = rss(fuzzer.process.pid, "worker")
        dropped = log.read_text(errors="replace").count("dropped malformed message")
        print(
            f"\n{tally.report('worker', seconds)}\n  {fuzzer.real_tasks} real TASKs exact; the "
            f"worker logged {dropped} malformed messages dropped; {fuzzer.reconnects} reconnects"
        )

        assert tally.malformed >= TARGET
        if fuzzer.reconnects == 0:  # else what was sent to the old connection was lost
            assert dropped == tally.malformed, "the worker did not get every message"
        assert tally.rss_end - tally.rss_warm < RSS_GROWTH_LIMIT, tally.report("worker", seconds)
        problems = bugs(log, tally)
        assert not problems, "the worker:\n" + "\n".join(problems)
    finally:
        fuzzer.close()


def test_worker_serves_again_after_reconnecting_through_a_silence(lenet, digits, tmp_path) -> None:
    """A worker whose broker fell silent after a flood reconnects, again and again; once the
    broker answers, its chunks are done over its newest connection, whatever was left
    unread of its older ones (their READYs among it)."""
    images = digits[:50, None]
    # a short interval: a silence of 1 s is a lost broker, the third try comes 7 s after it
    fuzzer = WorkerFuzzer(
        tmp_path / "worker.log", images, reference_forward(lenet, images), heartbeat=0.2
    )
    try:
        for item in corpus("worker"):
            fuzzer.fuzz(item)
        fuzzer.send_task(0, 10)
        fuzzer.check_result(0, 10)
        fuzzer.await_reconnects(3)
        for start in range(0, 50, 10):
            fuzzer.send_task(start, 10)
            fuzzer.check_result(start, 10)
        fuzzer.serve()  # the READYs not read yet
        assert fuzzer.reconnects >= 3
    finally:
        fuzzer.close()


def test_broker_keeps_serving_through_a_flood_of_malformed_messages(
    lenet, digits, tmp_path
) -> None:
    images = np.random.default_rng(7).integers(0, 256, (20_000, 28, 28), dtype=np.uint8)
    expected = reference_forward(lenet, images)
    devices = [f"cpu:{core}" for core in cores()[:2]] or ["cpu"]
    log = tmp_path / "farm.log"
    with contextlib.ExitStack() as cleanup:
        with stderr_to(log):  # the broker and workers log their errors (tracebacks) there
            # the fuzzer's READY garbage registers workers that never compute; one that
            # registers again or goes silent charges its chunks nothing
            local = cleanup.enter_context(
                LocalFarm(
                    devices=devices,
                    algo="fifo",
                    broker_options=["--chunk", "100"],
                    preload=["lenet"],
                    log_level="ERROR",
                )
            )
        fuzzer = BrokerFuzzer(local.endpoint, local.broker.pid)
        cleanup.callback(fuzzer.close)
        before = fuzzer.snapshot()["stats"]
        results: list[Any] = []  # JobResult, or the exception a job raised
        stop = threading.Event()
        cleanup.callback(stop.set)

        def real_jobs() -> None:
            """Real 20 000-image jobs, one after another, until the fuzzing is over."""
            with local.client(timeout=REPLY_TIMEOUT * 2) as client:
                while not stop.is_set():
                    try:
                        results.append(
                            client.run(images, "lenet", progress=lambda _: fuzzer.job_running.set())
                        )
                    except Exception as exc:  # reported below, with the figures
                        results.append(exc)
                        return
                    finally:
                        fuzzer.job_running.clear()

        jobs = threading.Thread(target=real_jobs, daemon=True)
        jobs.start()
        assert fuzzer.job_running.wait(REPLY_TIMEOUT), "the real job did not start"

        @FUZZ_SETTINGS
        @given(
            batch=st.lists(garbage("broker"), min_size=BATCH[0], max_size=BATCH[1]),
            identity=st.none() | st.binary(min_size=1, max_size=32).filter(lambda b: b[0]),
        )
        @example(batch=corpus("broker"), identity=None)
        def fuzz_round(batch: list[Garbage], identity: bytes | None) -> None:
            if fuzzer.tally.malformed < TARGET:
                fuzzer.send_batch(batch, identity)

        seconds = fuzz_until_target(fuzz_round, fuzzer.tally)
        stop.set()
        jobs.join(REPLY_TIMEOUT * 4)
        assert not jobs.is_alive(), "the real job did not finish"
        tally = fuzzer.tally
        tally.rss_end = rss(local.broker.pid, "broker")
        stats = fuzzer.snapshot()["stats"]
        print(
            f"\n{tally.report('broker', seconds)}\n  broker stats {stats}; "
            f"{len(results)} real jobs, {fuzzer.in_job} messages sent while one ran"
        )

        for result in results:
            assert not isinstance(result, Exception), f"a real job failed: {result!r}"
            assert not result.failed and result.duplicates == 0
            np.testing.assert_allclose(result.outputs, expected, atol=1e-5)
        assert fuzzer.in_job >= tally.sent // 2, "the real jobs did not run alongside the fuzzing"
        assert tally.malformed >= TARGET
        assert stats["bad_messages"] - before["bad_messages"] >= tally.malformed, (
            "the broker counted fewer bad messages than were sent"
        )
        assert tally.rss_end - tally.rss_warm < RSS_GROWTH_LIMIT, tally.report("broker", seconds)
        assert_farm_still_serves(local, lenet, digits)  # a fresh job, after the fuzzing
        assert local.broker.poll() is None and all(w.poll() is None for w in local.workers)
        problems = bugs(log, tally)
        assert not problems, "the broker or its workers:\n" + "\n".join(problems)
