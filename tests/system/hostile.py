"""Hostile and buggy peers: each a real process speaking farm's own protocol (frames built
and read with ``farm.wire.protocol``), started beside a real farm by tests/system/test_hostile.py
and bench/hostile.py::

    python -m tests.system.hostile KIND --broker ENDPOINT [options]

KIND is one of:

  forger            never registers (unless --register); reads job ids from INFO and sends
                    RESULTs marked kept=True of a constant (--value) for every job it sees
  nan-worker        registers; answers every TASK with NaN rows, failed=0
  random-worker     registers; answers every TASK with plausible random softmax rows
  wrong-shape       registers; its first RESULT has outputs of shape (7,), then honest
                    answers (--always: every RESULT)
  off-by-one        registers; every RESULT counts one item more or less than its TASK
                    (its rows a constant, sent at once)
  fast-liar         registers; real answers, but reports --compute seconds (0.001) each
  bf16-worker       registers; real answers rounded to bfloat16, said to be f32 (an
                    engine that silently runs another precision)
  submitter         SUBMITs --jobs jobs (4; 1000 for the table's mass submitter), then only
                    heartbeats them, never answering a NEED (but the first --answer-needs,
                    with zeros: a client that proves itself, then stalls)
  frame-flooder     --connections connections each send one message of --frames frames of
                    --megabytes MB, --rounds times
  fetch-flooder     registers (real answers to TASKs); sends --fetches FETCHes of LeNet's
                    files at once and counts the bytes that come back

Every peer prints one line per event worth awaiting, flushed (``ready NAME``, ``forged JOB
N``, ``submitted N accepted A refused R``, ``flooded ...``, ``fetched ...``), and on SIGTERM
a last line ``stats {json}`` with its counters, then exits 0.  ``HostilePeer`` starts one
and reads those lines.

The honest answers (fast-liar, wrong-shape after its first, fetch-flooder) are OpenCV's
forward of the bundled LeNet, as ``tests.conftest.reference_forward`` computes them.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from farm.wire import messages, protocol
from farm.wire.messages import Header
from farm.wire.protocol import Command, Message, ProtocolError

REPO = Path(__file__).resolve().parents[2]
#: LeNet's items and outputs.
ITEM_SHAPE = (1, 28, 28)
OUTPUT_SHAPE = (10,)
#: Seconds a peer waits for a broker's reply it needs (an INFO, an ERROR) before it says so.
REPLY_SECONDS = 60.0
#: The peer kinds, for ``HostilePeer`` and the command line.
KINDS = (
    "forger",
    "nan-worker",
    "random-worker",
    "wrong-shape",
    "off-by-one",
    "fast-liar",
    "bf16-worker",
    "submitter",
    "frame-flooder",
    "fetch-flooder",
)


class Stopped(Exception):
    """SIGTERM: print the counters and exit."""


def _stop(*_: Any) -> None:
    raise Stopped


def say(*parts: Any) -> None:
    print(*parts, flush=True)


# ---------------------------------------------------------------------------- the wire


class Link:
    """A DEALER to the broker, with or without CURVE keys."""

    def __init__(
        self,
        endpoint: str,
        context: zmq.Context,
        curve: str | None = None,
        curve_name: str = "client",
    ) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # a flood is queued whole, never dropped
        if curve:
            from farm.wire.curve import make_client

            make_client(self.socket, curve, curve_name)
        self.socket.connect(endpoint)

    def send(self, command: Command, header: Header | None = None, payload: Sequence = ()) -> None:
        self.socket.send_multipart(protocol.encode(command, header, payload), copy=False)

    def receive(self, timeout_s: float) -> Message | None:
        """The broker's next message (None if none came in time); one that does not decode
        is counted and skipped."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(0.0, deadline - time.monotonic())
            if not self.socket.poll(int(left * 1000)):
                return None
            frames = self.socket.recv_multipart(copy=False)
            try:
                return protocol.decode(frames)
            except ProtocolError as exc:
                TALLY["malformed_replies"] += 1
                say("malformed reply:", exc)


#: Every peer's counters, printed as ``stats {json}`` when it stops.
TALLY: Counter = Counter()
DETAILS: dict[str, Any] = {}


def note_error(header: messages.Error) -> None:
    TALLY["errors"] += 1
    first = DETAILS.setdefault("error_texts", [])
    if len(first) < 5 and header.error not in first:
        first.append(header.error)
        say("error:", header.error)


# ----------------------------------------------------------------------- honest answers


class LeNet:
    """OpenCV's forward of the bundled LeNet (``tests.conftest.reference_forward``), the net
    read once."""

    def __init__(self) -> None:
        self.net: Any = None

    def __call__(self, images: np.ndarray) -> np.ndarray:
        import cv2

        from farm.modelrepo.repository import find

        spec = find("lenet")
        if self.net is None:
            cv2.setNumThreads(1)
            self.net = cv2.dnn.readNetFromCaffe(str(spec.prototxt), str(spec.weights))
        self.net.setInput(images.astype(np.float32), spec.input, spec.input_scale)
        return self.net.forward(spec.output).reshape(len(images), -1).copy()


def task_images(message: Message) -> np.ndarray:
    task = message.header
    assert isinstance(task, messages.Task)
    return message.array(task.dtype, task.item_shape)


def result(
    task: messages.Task, rows: np.ndarray, compute: float, count: int | None = None
) -> tuple[messages.Result, list]:
    """A RESULT header and payload answering ``task`` with ``rows`` (its count: ``count``,
    the task's unless given)."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    header = messages.Result(
        job=task.job,
        chunk=task.chunk,
        start=task.start,
        count=task.count if count is None else count,
        dtype="float32",
        item_shape=tuple(rows.shape[1:]),
        timings={"compute": compute, "receive": 0.0, "send": 0.0},
    )
    return header, protocol.array_frames(rows)


# ----------------------------------------------------------------------------- workers


class Worker:
    """A registered worker whose answers ``answer`` makes; the broker's heartbeats are
    answered, its DISCONNECT (register again) obeyed."""

    def __init__(self, args: argparse.Namespace, link: Link) -> None:
        self.args, self.link = args, link
        self.kind = args.kind
        self.device = args.device
        self.name = f"hostile-{self.kind}:{os.getpid()}/{self.device}"
        self.ready = False
        self.honest = LeNet()
        self.rng = np.random.default_rng(args.seed)

    def register(self) -> None:
        self.link.send(
            Command.READY,
            messages.Ready(
                device=self.device,
                host=f"hostile-{self.kind}",
                pid=os.getpid(),
                backend="hostile",
                models={"lenet": messages.ModelFacts(input_shape=ITEM_SHAPE)},
                slots=self.args.slots,
                threads=1,
                loaded=("lenet",),
            ),
        )

    def serve(self) -> None:
        self.register()
        while True:
            self.step(self.link.receive(1.0))

    def step(self, message: Message | None) -> None:
        if message is None:
            return
        match message.header:
            case messages.Heartbeat():
                self.link.send(Command.HEARTBEAT)
                if not self.ready:
                    self.ready = True
                    say("ready", self.name)
            case messages.Task() as task:
                TALLY["tasks"] += 1
                TALLY["task_items"] += task.count
                received = time.perf_counter()
                answer = self.answer(message, task)
                if answer is not None:
                    header, payload = answer
                    self.link.send(Command.RESULT, header, payload)
                    TALLY["results"] += 1
                    TALLY["result_items"] += header.count
                DETAILS["busy_s"] = DETAILS.get("busy_s", 0.0) + time.perf_counter() - received
            case messages.Error() as error:
                note_error(error)
                if error.registration:
                    say("registration refused:", error.error)
                    TALLY["registration_refused"] += 1
            case messages.Disconnect():
                TALLY["disconnects"] += 1
                say("told to register again")
                self.register()
            case messages.Cancel():
                TALLY["cancels"] += 1
            case messages.Model() as model:
                TALLY["models"] += 1
                TALLY["model_bytes"] += protocol.payload_bytes(message.payload)
                if model.error:
                    TALLY["model_errors"] += 1

    def answer(self, message: Message, task: messages.Task) -> tuple[messages.Result, list] | None:
        """The RESULT this kind sends for ``task``."""
        kind, count = self.kind, task.count
        if kind == "nan-worker":
            return result(task, np.full((count, *OUTPUT_SHAPE), np.nan, np.float32), 0.001)
        if kind == "random-worker":
            logits = self.rng.normal(0.0, 4.0, (count, *OUTPUT_SHAPE))
            rows = np.exp(logits - logits.max(axis=1, keepdims=True))
            return result(task, rows / rows.sum(axis=1, keepdims=True), 0.001)
        if kind == "wrong-shape" and (self.args.always or not TALLY["wrong"]):
            TALLY["wrong"] += 1
            return result(task, self.rng.random((count, 7)), 0.001)
        if kind == "off-by-one":  # rows of no matter (the count is wrong): at once
            TALLY["wrong"] += 1
            wrong = count - 1 if count > 1 else count + 1
            return result(task, np.full((wrong, *OUTPUT_SHAPE), 0.1, np.float32), 0.001, wrong)
        started = time.perf_counter()
        rows = self.honest(task_images(message))
        compute = time.perf_counter() - started
        if kind == "fast-liar":
            DETAILS["real_compute_s"] = DETAILS.get("real_compute_s", 0.0) + compute
            return result(task, rows, self.args.compute)
        if kind == "bf16-worker":  # a wrong engine: bf16's answers, said to be f32's
            return result(task, bf16_softmax(rows), compute)
        return result(task, rows, compute)


def to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16's 8 significant bits (round half to even)."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


#: A typical magnitude of LeNet's logits (its last inner product's outputs are tens).
LOGIT_OFFSET = 16.0


def bf16_softmax(probabilities: np.ndarray) -> np.ndarray:
    """The softmax of logits held in bfloat16, as a net whose last layers run in bf16
    answers: logits of LeNet's magnitude (the probabilities' logs plus ``LOGIT_OFFSET``)
    rounded to bf16 (steps of 1/8 at 16), then normalised again: an unsure image's
    probabilities move by a few percent, a sure one's not at all."""
    logits = to_bf16(np.log(np.maximum(probabilities, 1e-30)) + LOGIT_OFFSET)
    rows = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (rows / rows.sum(axis=1, keepdims=True)).astype(np.float32)


class FetchFlooder(Worker):
    """A registered worker (honest answers) that asks for LeNet's files ``--fetches`` times
    at once and counts what comes back."""

    def serve(self) -> None:
        from tests.frames import digest_of

        self.register()
        while not self.ready:
            self.step(self.link.receive(REPLY_SECONDS))
        digest = digest_of("lenet") if not self.args.any_digest else ""
        for _ in range(self.args.fetches):
            self.link.send(Command.FETCH, messages.Fetch(model="lenet", digest=digest))
        started = time.monotonic()
        while TALLY["models"] + TALLY["fetch_errors"] < self.args.fetches:
            message = self.link.receive(REPLY_SECONDS)
            if message is None:
                say("no reply to every FETCH within", REPLY_SECONDS, "s")
                break
            if isinstance(message.header, messages.Error) and message.header.job is None:
                TALLY["fetch_errors"] += 1
            self.step(message)
        DETAILS["fetch_seconds"] = time.monotonic() - started
        say(
            f"fetched {self.args.fetches}: models {TALLY['models']} bytes "
            f"{TALLY['model_bytes']} model_errors {TALLY['model_errors']} "
            f"errors {TALLY['fetch_errors']}"
        )
        while True:
            self.step(self.link.receive(1.0))


# ------------------------------------------------------------------------------ forger


def forge(link: Link, job: dict[str, Any], args: argparse.Namespace) -> int:
    """Kept RESULTs of ``args.value`` for every item of ``job``; how many were sent."""
    total, rows = int(job["total"]), args.rows
    sent = 0
    block = np.full((rows, *OUTPUT_SHAPE), args.value, np.float32)
    for start in range(0, total, rows):
        count = min(rows, total - start)
        header = messages.Result(
            job=job["job"],
            chunk=int(uuid.uuid4().int >> 80),
            start=start,
            count=count,
            dtype="float32",
            item_shape=OUTPUT_SHAPE,
            timings={"compute": 0.001},
            kept=args.kept,
        )
        link.send(Command.RESULT, header, protocol.array_frames(block[:count]))
        sent += 1
    return sent


def serve_forger(args: argparse.Namespace, context: zmq.Context) -> None:
    """Poll INFO; forge every job seen once.  With ``--register`` it first registers as a
    worker (its TASKs answered FAILED, not its fault, so its chunks go elsewhere)."""
    link = Link(args.broker, context, args.curve, args.curve_name)
    info = (
        Link(args.broker, context, args.curve, args.info_curve_name)
        if args.info_curve_name
        else link
    )
    if args.register:
        link.send(
            Command.READY,
            messages.Ready(
                device="cpu:0",
                host="hostile-forger",
                pid=os.getpid(),
                backend="hostile",
                models={"lenet": messages.ModelFacts(input_shape=ITEM_SHAPE)},
                slots=1,
            ),
        )
    forged: set[str] = set()
    say("watching")
    while True:
        info.send(Command.INFO, messages.Info())
        snapshot = None
        deadline = time.monotonic() + REPLY_SECONDS
        while snapshot is None and time.monotonic() < deadline:
            message = link.receive(0.002) if info is not link else None
            if message is not None:
                forger_heard(link, message)
            reply = info.receive(0.005)
            if reply is None:
                continue
            if isinstance(reply.header, messages.Info):
                snapshot = reply.document(dict) or {}
            else:
                forger_heard(link, reply)
        if snapshot is None:
            say("no INFO reply within", REPLY_SECONDS, "s")
            continue
        TALLY["infos"] += 1
        for job in snapshot.get("jobs", []):
            if job["job"] in forged or job.get("model") != "lenet":
                continue
            forged.add(job["job"])
            sent = forge(link, job, args)
            TALLY["forged_results"] += sent
            TALLY["forged_jobs"] += 1
            # an INFO on the same connection: once it is answered, every forged RESULT
            # before it was handled (a ROUTER serves one connection in order)
            link.send(Command.INFO, messages.Info())
            while (message := link.receive(REPLY_SECONDS)) is not None:
                if isinstance(message.header, messages.Info):
                    break
                forger_heard(link, message)
            say("forged", job["job"], sent)
        # what the broker said meanwhile (ERRORs, TASKs to a registered forger)
        while (message := link.receive(args.interval)) is not None:
            forger_heard(link, message)


def forger_heard(link: Link, message: Message) -> None:
    match message.header:
        case messages.Error() as error:
            note_error(error)
            if error.registration:
                TALLY["registration_refused"] += 1
        case messages.Heartbeat(job=None):
            link.send(Command.HEARTBEAT)
        case messages.Disconnect():  # the broker's answer to a refused RESULT
            TALLY["disconnects"] += 1
        case messages.Task() as task:
            TALLY["tasks"] += 1
            link.send(
                Command.FAILED,
                messages.Failed(
                    job=task.job,
                    chunk=task.chunk,
                    start=task.start,
                    count=task.count,
                    error="busy forging",
                    fatal=False,
                    charge=False,
                ),
            )


# --------------------------------------------------------------------------- submitter


#: NEEDs the submitter answers (with zeros) before it goes silent: ``--answer-needs``.
ANSWER_NEEDS = [0]


def serve_submitter(args: argparse.Namespace, context: zmq.Context) -> None:
    """``--jobs`` SUBMITs of ``--total`` LeNet images each, then an INFO: once it answers,
    every SUBMIT was handled (a ROUTER answers one connection in order), and the ERRORs
    before it are the refusals.  Then only heartbeats, every ``--heartbeat`` seconds for
    each job, as a real client sends them: NEEDs are counted, never answered (but the
    first ``--answer-needs``)."""
    ANSWER_NEEDS[0] = args.answer_needs
    link = Link(args.broker, context, args.curve, args.curve_name)
    jobs = [f"{args.prefix}-{os.getpid()}-{i}" for i in range(args.jobs)]
    for job in jobs:
        link.send(
            Command.SUBMIT,
            messages.Submit(
                job=job,
                model="lenet",
                dtype="uint8",
                item_shape=ITEM_SHAPE,
                total=args.total,
                options=messages.Options(client=f"hostile-submitter:{os.getpid()}"),
            ),
        )
    link.send(Command.INFO, messages.Info())
    refused: set[str] = set()
    live = {job: None for job in jobs}  # all but the refused and the lost
    taken: dict[str, None] = {}  # heartbeated until the INFO: those the broker probed
    beat = Heartbeats(link, args.heartbeat)
    started = time.monotonic()
    while True:
        message = link.receive(beat.wait())
        beat.send(taken)
        if message is None:
            if time.monotonic() - started > REPLY_SECONDS:
                say("no INFO reply within", REPLY_SECONDS, "s")
                break
            continue
        header = message.header
        if isinstance(header, messages.Info):
            break
        if isinstance(header, messages.Error) and header.job in live and not header.unknown_job:
            note_error(header)
            refused.add(header.job)
            live.pop(header.job)
            continue
        if isinstance(header, messages.Need) and header.job in live:
            taken[header.job] = None
        submitter_heard(link, message, live)
        for job in [job for job in taken if job not in live]:
            del taken[job]
    DETAILS["submit_seconds"] = time.monotonic() - started
    DETAILS["accepted"] = list(live)
    say(f"submitted {len(jobs)} accepted {len(live)} refused {len(refused)}")
    while True:
        message = link.receive(beat.wait())
        beat.send(live)
        if message is not None:
            submitter_heard(link, message, live)


class Heartbeats:
    """A client's heartbeat of each of its jobs, every ``interval`` seconds."""

    def __init__(self, link: Link, interval: float) -> None:
        self.link, self.interval = link, interval
        self.next = time.monotonic()

    def wait(self) -> float:
        return max(0.0, self.next - time.monotonic())

    def send(self, jobs: dict[str, None]) -> None:
        if time.monotonic() < self.next:
            return
        for job in jobs:
            self.link.send(Command.HEARTBEAT, messages.Heartbeat(job=job))
        self.next = time.monotonic() + self.interval


def submitter_heard(link: Link, message: Message, live: dict[str, None]) -> None:
    match message.header:
        case messages.Error() as error:
            note_error(error)
            TALLY["later_errors"] += 1
            if error.unknown_job and error.job in live:  # the broker dropped it
                TALLY["jobs_lost"] += 1
                live.pop(error.job)
        case messages.Need(job=job) as need:
            TALLY["needs"] += 1
            if (need.chunk, need.start, need.count) != (0, 0, 1):  # not a probe: a slot's
                TALLY["slot_needs"] += 1
            if TALLY["needs"] == 1:
                say("first need", job)
            if TALLY["answered_needs"] < ANSWER_NEEDS[0]:  # answered: then silent
                TALLY["answered_needs"] += 1
                link.send(
                    Command.DATA,
                    messages.Data(job=job, chunk=need.chunk, start=need.start, count=need.count),
                    [bytes(need.count * int(np.prod(ITEM_SHAPE)))],
                )
        case messages.Cancel(job=job, reason=reason):
            TALLY["cancelled"] += 1
            say("cancelled", job, reason)
        case messages.Done():
            TALLY["done"] += 1


# ------------------------------------------------------------------------ frame flooder


def serve_frame_flooder(args: argparse.Namespace, context: zmq.Context) -> None:
    """``--connections`` DEALERs, each sending ``--rounds`` messages of ``--frames`` frames of
    ``--megabytes`` MB (the same buffer, never copied here).  Each round waits until every
    connection was answered (an ERROR) or dropped by the broker (its monitor says so), for
    at most ``--wait`` seconds; the connections stay open until SIGTERM."""
    from zmq.utils.monitor import recv_monitor_message

    frame = memoryview(bytearray(int(args.megabytes * (1 << 20))))
    if args.signed:  # a well-formed start: the broker reads further before it refuses
        frame[: len(protocol.SIGNATURE)] = protocol.SIGNATURE
    links = [
        Link(args.broker, context, args.curve, args.curve_name) for _ in range(args.connections)
    ]
    monitors = {
        link.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED): link
        for link in links
    }
    poller = zmq.Poller()
    for socket in [*(link.socket for link in links), *monitors]:
        poller.register(socket, zmq.POLLIN)
    started = time.monotonic()
    for round_ in range(args.rounds):
        for link in links:
            link.socket.send_multipart([frame] * args.frames, copy=False)
        TALLY["sent_messages"] += len(links)
        TALLY["sent_bytes"] += len(links) * args.frames * frame.nbytes
        say(f"sent round {round_ + 1}")
        waiting = {id(link) for link in links}
        deadline = time.monotonic() + args.wait
        while waiting and time.monotonic() < deadline:
            ready = dict(poller.poll(int(max(0.0, deadline - time.monotonic()) * 1000)))
            for socket in ready:
                if socket in monitors:  # the broker closed this connection
                    recv_monitor_message(socket)
                    if id(monitors[socket]) in waiting:
                        waiting.discard(id(monitors[socket]))
                        TALLY["dropped"] += 1
                    continue
                link = next(link for link in links if link.socket is socket)
                message = link.receive(0)
                if message is not None and isinstance(message.header, messages.Error):
                    note_error(message.header)
                    waiting.discard(id(link))
        TALLY["unanswered"] += len(waiting)
    DETAILS["flood_seconds"] = time.monotonic() - started
    say(
        f"flooded {args.connections} x {args.rounds} x {args.frames} x {args.megabytes:g} MB: "
        f"errors {TALLY['errors']} dropped {TALLY['dropped']} unanswered {TALLY['unanswered']}"
    )
    while True:
        for link in links:
            link.receive(0.2)


# ------------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m tests.system.hostile", description=__doc__)
    top.add_argument("kind", choices=KINDS)
    top.add_argument("--broker", required=True)
    top.add_argument("--curve", help="a `farm keys` folder: speak CurveZMQ")
    top.add_argument("--curve-name", default="client", help="whose key pair (default client)")
    top.add_argument("--seed", type=int, default=1)
    workers = top.add_argument_group("workers")
    workers.add_argument("--device", default="cpu:0")
    workers.add_argument("--slots", type=int, default=2)
    workers.add_argument("--always", action="store_true", help="wrong-shape: every result")
    workers.add_argument("--compute", type=float, default=0.001, help="fast-liar's claim, s")
    workers.add_argument("--fetches", type=int, default=205, help="fetch-flooder's FETCHes")
    workers.add_argument("--any-digest", action="store_true", help='FETCH digest "" instead')
    forger = top.add_argument_group("forger")
    forger.add_argument("--value", type=float, default=0.0, help="every forged output")
    forger.add_argument("--rows", type=int, default=100, help="items per forged RESULT")
    forger.add_argument("--not-kept", dest="kept", action="store_false")
    forger.add_argument("--register", action="store_true", help="send READY first")
    forger.add_argument("--interval", type=float, default=0.005, help="s between INFOs")
    forger.add_argument("--info-curve-name", help="read INFO with this key pair instead")
    submitter = top.add_argument_group("submitter")
    submitter.add_argument("--jobs", type=int, default=4)
    submitter.add_argument("--total", type=int, default=20_000, help="images per job")
    submitter.add_argument("--prefix", default="silent")
    submitter.add_argument("--heartbeat", type=float, default=1.0, help="s between heartbeats")
    submitter.add_argument(
        "--answer-needs", type=int, default=0, help="NEEDs answered (zeros) before silence"
    )
    flooder = top.add_argument_group("frame-flooder")
    flooder.add_argument("--connections", type=int, default=8)
    flooder.add_argument("--frames", type=int, default=3)
    flooder.add_argument("--megabytes", type=float, default=250.0)
    flooder.add_argument("--rounds", type=int, default=1)
    flooder.add_argument("--signed", action="store_true", help="frames start with FARM09")
    flooder.add_argument("--wait", type=float, default=300.0, help="s for the answers")
    return top


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    context = zmq.Context()
    try:
        if args.kind == "forger":
            serve_forger(args, context)
        elif args.kind == "submitter":
            serve_submitter(args, context)
        elif args.kind == "frame-flooder":
            serve_frame_flooder(args, context)
        elif args.kind == "fetch-flooder":
            FetchFlooder(args, Link(args.broker, context, args.curve, args.curve_name)).serve()
        else:
            Worker(args, Link(args.broker, context, args.curve, args.curve_name)).serve()
    except (Stopped, KeyboardInterrupt):
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        say("stats", json.dumps({**TALLY, **DETAILS}))
        sys.stdout.flush()
        os._exit(0)  # no linger, no context term waiting on queued floods


# ---------------------------------------------------------------------- the tests' side


class HostilePeer:
    """One hostile peer process beside a farm: its printed lines, read as they come.

    ``with HostilePeer("nan-worker", endpoint) as peer: peer.await_line("ready")``;
    ``stop()`` (or leaving the block) ends it and returns its ``stats`` counters."""

    def __init__(self, kind: str, endpoint: str, *options: str) -> None:
        assert kind in KINDS, kind
        self.kind = kind
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.system.hostile", kind, "--broker", endpoint, *options],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # the terminal's Ctrl-C goes to the test, not the peer
        )
        self.lines: list[str] = []
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.stats: dict[str, Any] | None = None
        self.ready_line = ""  # the line a caller awaited as the sign it is ready

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            self.queue.put(line.rstrip("\n"))
        self.queue.put(None)

    @property
    def pid(self) -> int:
        return self.process.pid

    def await_line(self, prefix: str, timeout: float = REPLY_SECONDS) -> str:
        """The first line (from now on) that starts with ``prefix``; AssertionError if the
        peer exits or ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"{self.kind}: no line {prefix!r} within {timeout:g} s: {self.lines}"
                ) from None
            if line is None:
                raise AssertionError(
                    f"{self.kind} exited ({self.process.wait()}) before {prefix!r}: {self.lines}"
                )
            if line.startswith(prefix):
                return line

    def stop(self) -> dict[str, Any]:
        """SIGTERM; the counters it printed last."""
        if self.stats is not None:
            return self.stats
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.reader.join(10)
        if self.process.stdout is not None:
            self.process.stdout.close()
        stats = [line for line in self.lines if line.startswith("stats ")]
        self.stats = json.loads(stats[-1][len("stats ") :]) if stats else {}
        return self.stats

    def __enter__(self) -> HostilePeer:
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop()


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """A process' resident memory (``VmRSS``) or its peak (``VmHWM``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for process {pid}")


def reset_peak_rss(pid: int) -> bool:
    """Reset a process' VmHWM to its RSS now (Linux ``clear_refs`` 5); False where refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


if __name__ == "__main__":
    main()
