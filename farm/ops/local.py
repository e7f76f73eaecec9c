"""A farm on this machine: a broker process and one pinned worker process per core.

``farm run`` and the tests use it.  Its fields build the broker's and each worker's typed
settings (``BrokerConfig``, ``WorkerConfig``); a forked process serves them directly
(``farm.ops.roles``), a process started by exec gets them as ``farm broker`` and ``farm
worker`` arguments, with the extra options given (``broker_options``, ...) after them.
Either way the broker sends the endpoint it bound down a pipe.  The processes talk over
loopback TCP, each in a session of its own: a Ctrl-C at the terminal reaches the client
(which cancels its job), not the farm, which ``stop`` ends.
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
from typing import IO, TYPE_CHECKING, Any

from farm import defaults
from farm.client.client import Client, FarmError, FarmTimeout
from farm.ops import roles
from farm.ops.forked import ForkedCommand, fork_call
from farm.startup import Timeline

if TYPE_CHECKING:
    from farm.broker.broker import BrokerConfig
    from farm.workers.config import WorkerConfig

#: A process of the farm: started by exec, or forked.
FarmProcess = subprocess.Popen | ForkedCommand

#: Seconds a process gets to exit after SIGTERM before SIGKILL.
STOP_GRACE = 5.0


def cores() -> list[int]:
    """Cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


def farm_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "farm", *args]


__all__ = ["LocalFarm", "cores", "farm_command", "free_port"]


@dataclass(kw_only=True)
class LocalFarm:
    """Start with ``with LocalFarm(...) as local:``; ``local.endpoint`` is the broker's address."""

    devices: Sequence[str] = field(default_factory=lambda: [f"cpu:{core}" for core in cores()])
    algo: str = defaults.POLICY
    params: dict[str, Any] = field(default_factory=dict)  # the policy's parameters
    models_dirs: Sequence[str] = ()  # model folders of the broker and the workers
    backend: str = defaults.BACKEND  # the workers' engine settings
    precision: str = defaults.PRECISION
    batch: int | None = None
    # more ``farm broker`` / ``farm worker`` options, for processes started by exec only
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
    # context in use (``farm run``, ``farm up``), and not with a launcher or extra options
    fork: bool = False
    # the caller's own work, done while the processes start (after they were launched)
    while_starting: Callable[[], None] | None = None
    # what starting it set up
    endpoint: str = field(default="", init=False)
    broker: FarmProcess | None = field(default=None, init=False)
    endpoint_pipe: IO[str] | None = field(default=None, init=False)  # the broker sends it here
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
        """Start the broker; it sends the endpoint it bound down ``endpoint_pipe``."""
        read_end, write_end = os.pipe()
        config = self.broker_config(bind)
        try:
            if self.forks((), self.broker_options):
                self.broker = fork_call(self.forked_broker(config, write_end), ["farm", "broker"])
            else:
                arguments = [*roles.broker_arguments(config), "--endpoint-fd", str(write_end)]
                self.broker = self.exec_farm(
                    ["broker", *arguments, *self.broker_options], pass_fds=(write_end,)
                )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        self.endpoint_pipe = os.fdopen(read_end, "r")

    def broker_config(self, bind: str) -> BrokerConfig:
        """The broker's settings, from this farm's fields."""
        from farm.broker.broker import BrokerConfig

        return BrokerConfig(
            bind=bind,
            algo=self.algo,
            params=dict(self.params),
            model_dirs=tuple(self.models_dirs),
            curve=self.curve,
        )

    def worker_config(self, device: str) -> WorkerConfig:
        """A worker's settings, from this farm's fields (``device`` is parsed here)."""
        from farm.workers.config import Device, WorkerConfig

        return WorkerConfig(
            broker=self.endpoint,
            device=Device.parse(device),
            preload=tuple(self.preload),
            model_dirs=tuple(self.models_dirs),
            backend=self.backend,
            precision=self.precision,
            batch=self.batch,
            curve=self.curve,
        )

    def forks(self, launcher: Sequence[str], options: Sequence[str]) -> bool:
        """Whether a process is forked: with ``fork``, and neither a launcher nor extra
        command-line options (only a process started by exec reads those)."""
        return self.fork and not (self.launcher or launcher or options)

    def forked_broker(self, config: BrokerConfig, endpoint_fd: int) -> Callable[[], None]:
        def serve() -> None:
            roles.set_log_level(self.log_level)
            with roles.reported_as_errors(Exception):  # as `farm broker` reports them
                roles.serve_broker(config, endpoint_fd)

        return serve

    def forked_worker(self, device: str) -> Callable[[], None]:
        """The worker's settings are built in the child: ``cpu:bound`` is its own core."""

        def serve() -> None:
            roles.set_log_level(self.log_level)
            with roles.reported_as_errors(ValueError, LookupError):  # as `farm worker` does
                roles.serve_worker(self.worker_config(device))

        return serve

    def exec_farm(
        self, args: list[str], launcher: Sequence[str] = (), pass_fds: Sequence[int] = ()
    ) -> subprocess.Popen:
        """Start ``python -m farm ARGS`` (after the launchers), in a session of its own;
        its stdout is dropped (the broker's first lines are for people)."""
        return subprocess.Popen(
            [*self.launcher, *launcher, *farm_command("--log-level", self.log_level, *args)],
            stdout=subprocess.DEVNULL,
            pass_fds=pass_fds,
            start_new_session=True,
        )

    def read_endpoint(self) -> None:
        """Wait for the endpoint the broker bound, which it sends down ``endpoint_pipe``."""
        broker = self.running_broker()
        assert self.endpoint_pipe is not None  # launch_broker made it
        with self.endpoint_pipe as pipe:
            line = pipe.readline()
        self.endpoint_pipe = None
        if not line.endswith("\n"):
            raise FarmError(f"broker did not start (exit code {broker.poll()})")
        self.endpoint = line.strip()

    def restart_broker(self) -> None:
        """Kill the broker (SIGKILL: no goodbye) and start a new one on the same address."""
        broker = self.running_broker()
        broker.kill()
        broker.wait()
        self.start_broker(self.endpoint)

    def running_broker(self) -> FarmProcess:
        """The broker process; FarmError before it was started."""
        if self.broker is None:
            raise FarmError("the local farm's broker was not started")
        return self.broker

    def start_worker(self, device: str, *options: str, launcher: Sequence[str] = ()) -> FarmProcess:
        """Start a worker on ``device``; ``options``: more ``farm worker`` options (exec only)."""
        process: FarmProcess
        extra = [*self.worker_options, *options]
        if self.forks(launcher, extra):
            process = fork_call(self.forked_worker(device), ["farm", "worker", device])
        else:
            arguments = roles.worker_arguments(self.worker_config(device), device)
            process = self.exec_farm(["worker", *arguments, *extra], launcher)
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

    def client(self, timeout: float | None = defaults.CLIENT_TIMEOUT) -> Client:
        return Client(self.endpoint, timeout=timeout, curve=self.curve)

    def stop(self) -> None:
        """Workers first, so their goodbyes reach a live broker and they exit at once (a
        goodbye to a gone broker waits out the socket's linger), then the broker."""
        stop_processes(self.workers)
        stop_processes([self.broker] if self.broker is not None else [])
        if self.endpoint_pipe is not None:
            self.endpoint_pipe.close()
            self.endpoint_pipe = None


def preload_modules() -> None:
    """Import, once and before forking, what every forked child would import on its own:
    the broker's and the worker's code.  Not the inference libraries: each worker imports
    its own after the fork (OpenVINO imported before the fork left a forked worker hung
    in torch's import, when ``auto`` timed every backend).  Nothing here starts a thread."""
    import farm.broker.broker
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
