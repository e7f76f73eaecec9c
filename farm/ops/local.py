"""A farm on this machine: a broker process and one pinned worker process per core.

``farm run`` and the tests use it; the processes are the real ``farm broker``
and ``farm worker`` commands, talking over loopback TCP, each in a session of
its own: a Ctrl-C at the terminal reaches the client (which cancels its job),
not the farm, which ``stop`` ends.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from farm import defaults
from farm.client.client import Client, FarmError, FarmTimeout
from farm.ops.forked import ForkedCommand, fork_command
from farm.startup import Timeline

#: A process of the farm: started by exec, or forked.
FarmProcess = subprocess.Popen | ForkedCommand

#: Seconds a process gets to exit after SIGTERM before SIGKILL.
STOP_GRACE = 5.0


def cores() -> list[int]:
    """Cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


def farm_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "farm", *args]


def policy_arguments(params: dict[str, Any]) -> list[str]:
    """Policy parameters as ``farm broker`` arguments (``{"ratio": (1, 3)}``: --ratio 1,3)."""
    arguments = []
    for name, value in params.items():
        text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        arguments += ["--" + name.replace("_", "-"), text]
    return arguments


@dataclass(kw_only=True)
class LocalFarm:
    """Start with ``with LocalFarm(...) as local:``; ``local.endpoint`` is the broker's address."""

    devices: Sequence[str] = field(default_factory=lambda: [f"cpu:{core}" for core in cores()])
    algo: str = defaults.POLICY
    broker_options: Sequence[str] = ()
    worker_options: Sequence[str] = ()
    device_options: Sequence[Sequence[str]] = ()  # more options for the i-th device's worker
    # a prefix for the i-th device's worker command (taskset -c 15: a GPU worker's own core)
    device_launchers: Sequence[Sequence[str]] = ()
    preload: Sequence[str] = ()
    log_level: str = defaults.LOG_LEVEL
    ready_timeout: float = 60.0
    curve: str | None = None  # a `farm keys` folder: every process and client uses CurveZMQ
    launcher: Sequence[str] = ()  # prefix for the broker and worker commands (a cgroup, ...)
    bind: str | None = None  # the broker's endpoint (None: a free loopback TCP port)
    # fork the broker and workers from this process (farm.ops.forked): no interpreter
    # start-up, no imports again; only while this process has no threads and no zmq
    # context in use (``farm run``, ``farm up``), and not with a launcher
    fork: bool = False
    # the caller's own work, done while the processes start (after they were launched)
    while_starting: Callable[[], None] | None = None
    # what starting it set up
    endpoint: str = field(default="", init=False)
    broker: FarmProcess | None = field(default=None, init=False)
    workers: list[FarmProcess] = field(default_factory=list, init=False)
    # from launch to every worker registered (models preloaded)
    start_seconds: float = field(default=0.0, init=False)
    registered: dict[str, Any] = field(default_factory=dict, init=False)  # the broker's INFO then
    # launched, broker listening, workers registered: ``farm run --timings``
    timeline: Timeline = field(default_factory=Timeline)

    def __enter__(self) -> LocalFarm:
        started = time.monotonic()
        if self.fork:
            preload_modules()
            self.timeline.mark("shared modules imported")
        self.timeline.mark("farm launched")
        try:
            # the workers start beside the broker, not after it: they connect to the port
            # picked here and their READY waits in their socket until the broker binds it
            self.endpoint = self.bind or f"tcp://127.0.0.1:{free_port()}"
            self.launch_broker(self.endpoint)
            for i, device in enumerate(self.devices):
                launcher = self.device_launchers[i] if i < len(self.device_launchers) else ()
                self.start_worker(
                    device,
                    *(self.device_options[i] if i < len(self.device_options) else ()),
                    launcher=launcher,
                )
            if self.while_starting is not None:
                self.while_starting()
            self.read_endpoint()
            self.timeline.mark("broker listening")
            self.registered = self.wait_for_workers(len(self.devices))
            self.timeline.mark("every worker registered")
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started
        return self

    def engines(self, model: str) -> str:
        """How the workers registered run ``model``: ``openvino f32 batch 64 on 2 workers``
        (each engine and the workers running it); empty if none reported it."""
        running: dict[str, list[str]] = {}
        for worker in self.registered.get("workers", []):
            engine = worker.get("engines", {}).get(model)
            if engine:
                running.setdefault(engine, []).append(str(worker.get("device", "?")))
        everyone = len(self.registered.get("workers", []))
        return "; ".join(
            f"{engine} on {'every worker' if len(devices) == everyone > 1 else ', '.join(devices)}"
            for engine, devices in running.items()
        )

    def __exit__(self, *_: Any) -> None:
        self.stop()

    @property
    def processes(self) -> list[FarmProcess]:
        """The broker and the workers started."""
        return [*([self.broker] if self.broker is not None else []), *self.workers]

    def start_broker(self, bind: str = "tcp://127.0.0.1:*") -> None:
        """Start the broker (on a free loopback port by default); read the endpoint it bound."""
        self.launch_broker(bind)
        self.read_endpoint()

    def launch_broker(self, bind: str) -> None:
        self.broker = self.spawn(
            [
                "--log-level",
                self.log_level,
                "broker",
                "--bind",
                bind,
                "--algo",
                self.algo,
                *self.curve_options,
                *self.broker_options,
            ],
            stdout_pipe=True,
        )

    def spawn(
        self, args: list[str], launcher: Sequence[str] = (), stdout_pipe: bool = False
    ) -> FarmProcess:
        """Start ``farm ARGS``, in a session of its own: forked from this process with
        ``fork`` (no launcher then), else as ``python -m farm ARGS``."""
        prefix = [*self.launcher, *launcher]
        if self.fork and not prefix:
            return fork_command(args, stdout_pipe=stdout_pipe)
        return subprocess.Popen(
            [*prefix, *farm_command(*args)],
            stdout=subprocess.PIPE if stdout_pipe else None,
            text=True,
            start_new_session=True,
        )

    def read_endpoint(self) -> None:
        """Wait for the broker's first line, which names the endpoint it bound."""
        broker = self.running_broker()
        assert broker.stdout is not None  # launched with stdout=PIPE
        line = broker.stdout.readline()
        if not line.startswith("farm broker listening on "):
            raise FarmError(f"broker did not start (exit code {broker.poll()})")
        self.endpoint = line.rsplit(" ", 1)[1].strip()

    def restart_broker(self) -> None:
        """Kill the broker (SIGKILL: no goodbye) and start a new one on the same address."""
        broker = self.running_broker()
        broker.kill()
        broker.wait()
        if broker.stdout:
            broker.stdout.close()
        self.start_broker(self.endpoint)

    def running_broker(self) -> FarmProcess:
        """The broker process; FarmError before it was started."""
        if self.broker is None:
            raise FarmError("the local farm's broker was not started")
        return self.broker

    def start_worker(self, device: str, *options: str, launcher: Sequence[str] = ()) -> FarmProcess:
        preload = [arg for name in self.preload for arg in ("--model", name)]
        process = self.spawn(
            [
                "--log-level",
                self.log_level,
                "worker",
                "--device",
                device,
                "--broker",
                self.endpoint,
                *preload,
                *self.curve_options,
                *self.worker_options,
                *options,
            ],
            launcher,
        )
        self.workers.append(process)
        return process

    def wait_for_workers(self, count: int) -> dict[str, Any]:
        """Block until ``count`` workers have registered; fail early if a process died."""
        deadline = time.monotonic() + self.ready_timeout
        with self.client(timeout=1.0) as client:
            while True:
                try:
                    return client.info(wait_workers=count)
                except FarmTimeout:
                    processes = [self.running_broker(), *self.workers]
                    dead = [p.args for p in processes if p.poll() is not None]
                    if dead:
                        raise FarmError(
                            f"a farm process exited during start: {dead[0]!r}"
                        ) from None
                    if time.monotonic() > deadline:
                        raise

    @property
    def curve_options(self) -> list[str]:
        return ["--curve", self.curve] if self.curve else []

    def client(self, timeout: float | None = defaults.CLIENT_TIMEOUT) -> Client:
        return Client(self.endpoint, timeout=timeout, curve=self.curve)

    def stop(self) -> None:
        """Workers first, so their goodbyes reach a live broker and they exit at once (a
        goodbye to a gone broker waits out the socket's linger), then the broker."""
        stop_processes(self.workers)
        stop_processes([self.broker] if self.broker is not None else [])


def preload_modules() -> None:
    """Import, once and before forking, what every forked child would import on its own:
    the broker's and the worker's code.  Not the inference libraries: each worker imports
    its own after the fork (OpenVINO imported before the fork left a forked worker hung
    in torch's import, when ``auto`` timed every backend).  Nothing here starts a thread."""
    import farm.broker.broker
    import farm.cli.broker
    import farm.cli.worker
    import farm.workers.worker  # noqa: F401


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the broker binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def stop_processes(processes: Sequence[FarmProcess]) -> None:
    """SIGTERM every process, then SIGKILL whatever outlives the grace period."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout:
            process.stdout.close()
