"""``farm worker --slow FACTOR[@SECONDS]``: a straggler stand-in for tests and benchmarks on
CPU machines (``farm.workers.chunks.Throttle``).

The option is parsed and validated by the real command, and survives a round trip through
``worker_arguments``.  A real worker's chunk runner computes a chunk of the bundled LeNet
unthrottled and throttled: the throttled one reports (timings, heartbeat counters, speeds)
compute seconds several times the unthrottled one's, measured in the same test; and a
chunk cancelled while its throttle waits stops at once, long before the wait would end.
"""

from __future__ import annotations

import threading
import time

import click
import numpy as np
import pytest
from click.testing import CliRunner

from farm.cli import main
from farm.cli.worker import SlowDown
from farm.modelrepo.repository import ModelSpec
from farm.ops import roles
from farm.wire import protocol
from farm.wire.protocol import Command, Message
from farm.workers.chunks import Throttle
from farm.workers.config import Device, WorkerConfig
from farm.workers.worker import Worker
from tests.frames import task
from tests.unit.test_roles import parsed_by

BROKER = "tcp://127.0.0.1:1"  # nothing connects: chunks are handed to the runner directly


@pytest.mark.parametrize(
    "value, parsed",
    [("3", (3.0, 0.0)), ("1", (1.0, 0.0)), ("2.5@30", (2.5, 30.0)), ("4@0", (4.0, 0.0))],
)
def test_good_values_reach_the_worker_config(monkeypatch, value, parsed) -> None:
    config = parsed_by(monkeypatch, "serve_worker", ["worker", "--slow", value])
    assert config.slow == parsed


@pytest.mark.parametrize(
    "value, says",
    [
        ("0.5", "FACTOR must be a number >= 1"),
        ("0", "FACTOR must be a number >= 1"),
        ("-2@1", "FACTOR must be a number >= 1"),
        ("nan", "FACTOR must be a number >= 1"),
        ("inf", "FACTOR must be a number >= 1"),
        ("3@-1", "SECONDS must be a number >= 0"),
        ("3@inf", "SECONDS must be a number >= 0"),
        ("slow", "is not FACTOR or FACTOR@SECONDS"),
        ("3@", "is not FACTOR or FACTOR@SECONDS"),
        ("3@5@6", "is not FACTOR or FACTOR@SECONDS"),
        ("", "is not FACTOR or FACTOR@SECONDS"),
    ],
)
def test_bad_values_are_refused_with_a_clear_error(value, says) -> None:
    with pytest.raises(click.BadParameter, match=says):
        SlowDown().convert(value, None, None)
    result = CliRunner().invoke(main, ["worker", "--slow", value])
    assert result.exit_code == 2
    assert "Invalid value for '--slow'" in result.output and says in result.output


def test_the_help_says_what_it_is_for() -> None:
    result = CliRunner().invoke(main, ["worker", "--help"])
    assert "--slow FACTOR[@SECONDS]" in result.output
    assert "tests and benchmarks" in result.output and "straggler" in result.output


def test_worker_arguments_keep_the_slowdown(monkeypatch) -> None:
    config = WorkerConfig(broker=BROKER, device=Device.parse("cpu:0"), slow=(3.0, 12.5))
    arguments = roles.worker_arguments(config)
    assert arguments[-2:] == ["--slow", "3.0@12.5"]
    assert parsed_by(monkeypatch, "serve_worker", ["worker", *arguments]) == config


def test_no_wait_before_the_first_chunk_or_before_its_seconds() -> None:
    never = lambda: False  # noqa: E731
    assert Throttle(3.0).wait(1000.0, never) == 0.0  # no chunk began yet
    later = Throttle(3.0, after=3600.0)
    later.begin()
    assert later.wait(1000.0, never) == 0.0


def test_a_wait_asked_to_stop_does_not_begin() -> None:
    throttle = Throttle(1000.0)
    throttle.begin()
    began = time.perf_counter()
    waited = throttle.wait(1.0, lambda: True)  # 999 s, were it not stopped
    assert waited == pytest.approx(0.0, abs=0.5) and time.perf_counter() - began < 0.5


# -- a real worker's chunk runner, computing LeNet ------------------------------------------


def lenet_worker(slow: tuple[float, float] | None = None, batch: int | None = None) -> Worker:
    """A worker on one thread with OpenCV (nothing chosen by timing), not connected."""
    config = WorkerConfig(
        broker=BROKER, device=Device.parse("cpu:0"), backend="opencv", batch=batch, slow=slow
    )
    return Worker(config)


@pytest.fixture(scope="module")
def chunk(digits: np.ndarray) -> Message:
    """The bundled sample's 1 000 digits as one TASK of job ``j``, chunk 7."""
    return protocol.decode(task(b"worker", 7, np.ascontiguousarray(digits[:, None]))[1:])


def run(worker: Worker, chunk: Message, spec: ModelSpec) -> tuple[Message, float, float]:
    """The chunk run on the worker's runner: its reply, and the compute seconds its heartbeat
    counters and its speeds grew by."""
    runner = worker.runner
    counted = runner.computed_seconds
    _, spent = runner.speeds.get(spec.name, (0, 0.0))
    reply = protocol.decode(runner.run_task(chunk, time.perf_counter(), spec))
    return reply, runner.computed_seconds - counted, runner.speeds[spec.name][1] - spent


def test_a_slow_worker_reports_its_chunks_slower(lenet, chunk) -> None:
    plain, slow = lenet_worker(), lenet_worker(slow=(3.0, 0.0))
    assert slow.runner.throttle == Throttle(3.0, 0.0)
    for worker in (plain, slow):  # load the engine, and start the throttle's clock
        assert run(worker, chunk, lenet)[0].command is Command.RESULT
    unthrottled = min((run(plain, chunk, lenet) for _ in range(2)), key=lambda r: r[1])
    throttled = run(slow, chunk, lenet)
    assert throttled[0].command is Command.RESULT
    assert np.array_equal(  # the same outputs, only later
        throttled[0].array("float32", throttled[0].header.item_shape),
        unthrottled[0].array("float32", unthrottled[0].header.item_shape),
    )
    timings = throttled[0].header.timings, unthrottled[0].header.timings
    assert timings[0]["compute"] >= 2 * timings[1]["compute"], timings
    assert timings[0]["device"] >= 2 * timings[1]["device"], timings  # the device was busy
    assert throttled[1] >= 2 * unthrottled[1]  # heartbeat counters
    assert throttled[2] >= 2 * unthrottled[2]  # speeds, sent with READY


@pytest.mark.parametrize("cancel", ["job", "chunk"])
def test_a_cancelled_chunk_stops_its_wait_at_once(lenet, chunk, cancel) -> None:
    """One batch, throttled 50 times: the cancel comes early in the wait, which ends then,
    not 49 batch times later; the chunk fails as cancelled, uncharged."""
    factor = 50.0
    worker = lenet_worker(slow=(factor, 0.0), batch=chunk.header.count)
    worker.runner.throttle.after = float("inf")  # the warm-up runs at full speed
    warm, batch_seconds, _ = run(worker, chunk, lenet)
    assert warm.command is Command.RESULT
    worker.runner.throttle.after = 0.0
    full = factor * batch_seconds  # the chunk's time throttled, were it not cancelled
    by = {
        "job": lambda: worker.cancels.cancel("j"),
        "chunk": lambda: worker.cancels.cancel_chunk(7),
    }
    timer = threading.Timer(3 * batch_seconds, by[cancel])  # its compute done, its wait begun
    began = time.perf_counter()
    timer.start()
    try:
        reply, counted, _ = run(worker, chunk, lenet)
    finally:
        timer.cancel()
    took = time.perf_counter() - began
    assert reply.command is Command.FAILED
    assert "job cancelled" in reply.header.error and "throttled" in reply.header.error
    assert not reply.header.charge
    assert took < full / 4, (took, full)
    assert counted < full / 4  # the heartbeat counters hold the part waited, no more
