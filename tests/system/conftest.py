"""Fixtures of the system tier: real farms (a broker and pinned worker processes on
loopback), and raw peers for tests that speak the protocol frame by frame."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import zmq

from farm.ops.local import LocalFarm, cores, farm_command, stop_processes
from farm.wire import protocol
from farm.wire.protocol import Command

#: ``local_farm(...)`` keywords that are LocalFarm's settings; any other is a broker option.
FARM_OPTIONS = {field.name for field in dataclasses.fields(LocalFarm) if field.init} - {
    "devices",
    "algo",
}

StartFarm = Callable[..., LocalFarm]


def pinned_devices(count: int) -> list[str]:
    """``count`` CPU devices, each pinned to one of this process's cores in turn (two on the
    same core where there is only one)."""
    available = cores()
    return [f"cpu:{available[i % len(available)]}" for i in range(count)]


def farm_starter(stack: contextlib.ExitStack) -> StartFarm:
    """``local_farm``'s function: each farm it starts is stopped when ``stack`` closes."""

    def start(
        workers: int = 2,
        devices: Sequence[str] | None = None,
        *,
        algo: str = "fifo",
        **options: Any,
    ) -> LocalFarm:
        own = {name: value for name, value in options.items() if name in FARM_OPTIONS}
        broker = {name: value for name, value in options.items() if name not in FARM_OPTIONS}
        own["broker_options"] = [
            *own.get("broker_options", ()),
            *(
                argument
                for name, value in broker.items()
                for argument in ("--" + name.replace("_", "-"), str(value))
            ),
        ]
        devices = pinned_devices(workers) if devices is None else devices
        return stack.enter_context(LocalFarm(devices=devices, algo=algo, **own))

    return start


@pytest.fixture
def local_farm() -> Iterator[StartFarm]:
    """Starts a real farm for this test and stops it at the test's end:
    ``local_farm(workers=2, devices=None, *, algo="fifo", **options)``.

    ``devices`` defaults to ``workers`` CPU devices pinned to cores (``pinned_devices``);
    ``local_farm(0)`` is a broker alone.  ``options`` are LocalFarm's own (``preload``,
    ``worker_options``, ``curve``, ...) or broker options: ``chunk=100, models_dir=path``
    starts ``farm broker --chunk 100 --models-dir path``.  The farm is returned once every
    worker has registered."""
    with contextlib.ExitStack() as stack:
        yield farm_starter(stack)


@pytest.fixture(scope="module")
def module_local_farm() -> Iterator[StartFarm]:
    """``local_farm`` for a module's fixtures: its farms stop after the module's last test."""
    with contextlib.ExitStack() as stack:
        yield farm_starter(stack)


@pytest.fixture(scope="module")
def farm_two_workers(module_local_farm: StartFarm) -> LocalFarm:
    """The module's shared farm, for tests that need one running and leave it as it was:
    two pinned workers with LeNet loaded, fifo chunks of 100."""
    return module_local_farm(2, chunk=100, preload=["lenet"])


@pytest.fixture
def raw_socket(farm_two_workers: LocalFarm) -> Iterator[zmq.Socket]:
    """A DEALER speaking to ``farm_two_workers``'s broker frame by frame, as a broken or
    hostile peer would (``tests.frames`` builds and reads the frames)."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(farm_two_workers.endpoint)
    yield sock
    sock.close()
    context.term()


@pytest.fixture
def lone_worker() -> Iterator[tuple[zmq.Socket, bytes]]:
    """A real worker process connected to a ROUTER the test drives by hand: the router and
    the worker's identity, once it said READY."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    process = subprocess.Popen(
        farm_command(
            "--log-level",
            "ERROR",
            "worker",
            "--device",
            pinned_devices(1)[0],
            "--broker",
            f"tcp://127.0.0.1:{port}",
        )
    )
    try:
        assert router.poll(30_000), "worker never said READY"
        identity, *frames = router.recv_multipart()
        ready = protocol.decode(frames)
        assert ready.command is Command.READY and "lenet" in ready.header.models
        yield router, identity
    finally:
        process.terminate()
        process.wait(10)
        router.close()
        context.term()


@contextlib.contextmanager
def logged_broker(
    log: Any, *options: str, level: str = "INFO"
) -> Iterator[tuple[subprocess.Popen, str]]:
    """A ``farm broker`` on a free loopback port (unless ``options`` bind another) whose log
    (``level`` and up) goes to the file ``log``: the process and the endpoint it bound."""
    with open(log, "w") as stderr:
        broker = subprocess.Popen(
            farm_command("--log-level", level, "broker", "--bind", "tcp://127.0.0.1:*", *options),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        assert broker.stdout is not None
        line = broker.stdout.readline()
        assert line.startswith("farm broker listening on "), f"broker did not start: {line!r}"
        yield broker, line.rsplit(" ", 1)[1].strip()
    finally:
        stop_processes([broker])


def await_text(path: Any, text: str, process: subprocess.Popen | None = None) -> str:
    """The file's contents once ``text`` is in them (AssertionError if ``process`` exits or a
    minute passes first)."""
    deadline = time.monotonic() + 60
    while True:
        contents = open(path).read()
        if text in contents:
            return contents
        assert process is None or process.poll() is None, f"exited before {text!r}: {contents}"
        assert time.monotonic() < deadline, f"no {text!r} in {path}: {contents}"
        time.sleep(0.05)


#: The test files that take a minute or more under ``make test`` on the 2-core machine, the
#: longest first.  ``make test`` hands whole files to its two pytest processes in collection
#: order (``--dist loadfile --no-loadscope-reorder``): these go first, and the many short
#: files after them even out the two processes' ends, instead of one long file running alone
#: at the end while the other process has nothing left.
LONGEST_FILES = (
    "tests/system/test_gpu_bench.py",
    "tests/system/test_floods.py",
    "tests/system/test_bench.py",
    "tests/system/test_resume.py",
    "tests/system/test_recovery.py",
    "tests/system/test_slurm.py",
    "tests/unit/test_engines.py",
    "tests/system/test_operations.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``LONGEST_FILES`` first, in that order; every other file after them, as collected."""
    rank = {path: place for place, path in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
