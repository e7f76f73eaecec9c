"""Configuration that runs a standing farm under a process supervisor (``farm deploy``).

``farm deploy supervisord`` writes a supervisord configuration: a broker, one worker
pinned to each CPU core, and one worker per GPU, run on a core taken out of the CPU
workers' set to feed it (the highest-numbered cores first, as the paper did).  The
command itself is ``farm.cli.deploy``; this module plans and renders.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

#: Seconds supervisord gives a program to exit after SIGTERM before SIGKILL.
STOP_WAIT_SECONDS = 10

#: Seconds a program must stay up before supervisord counts it as started. A worker that
#: fails at start (a GPU torch cannot see, a missing library) fails in 2-6 s, most of it
#: importing torch; with ``startsecs = 1`` each such start counted as a success and the
#: worker was respawned for ever. Longer than that, it is a failed start: retried
#: ``STARTRETRIES`` times, then FATAL, shown by ``supervisorctl status``. A GPU worker
#: gets longer: CUDA's start adds seconds before it could fail.
BROKER_STARTSECS = 5
CPU_STARTSECS = 10
GPU_STARTSECS = 30
STARTRETRIES = 3

#: Longest path a unix socket may have (sun_path is 108 bytes with its NUL).
MAX_SOCKET_PATH = 107

#: Hosts that mean "every interface" in a bind endpoint, and what to connect to instead.
WILDCARD_HOSTS = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]"}


def parse_ids(text: str, what: str) -> tuple[int, ...]:
    """``0-7`` or ``0,2,4-6`` -> sorted distinct ids; ValueError naming ``what`` if malformed."""
    ids: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not match:
            raise ValueError(
                f"malformed {what} list {text!r}: expected numbers and ranges like 0-7 or 0,2,4-6"
            )
        first = int(match[1])
        last = int(match[2]) if match[2] is not None else first
        if last < first:
            raise ValueError(f"malformed {what} list {text!r}: range {first}-{last} runs backwards")
        ids += range(first, last + 1)
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise ValueError(f"{what} list {text!r} names {', '.join(map(str, repeated))} twice")
    return tuple(sorted(ids))


@dataclass(frozen=True)
class Layout:
    """Which core runs what: CPU workers, and each GPU's worker with the core feeding it."""

    cpu_cores: tuple[int, ...]
    gpus: tuple[tuple[int, int], ...]  # (gpu, core)

    @classmethod
    def plan(cls, cores: tuple[int, ...], gpus: tuple[int, ...]) -> Layout:
        """Take one core per GPU off the top of ``cores``; the rest get a CPU worker each."""
        if len(cores) < len(gpus):
            raise ValueError(
                f"{len(gpus)} GPUs need a core each to feed them, but only "
                f"{len(cores)} cores were given"
            )
        ordered = sorted(cores)
        kept = len(ordered) - len(gpus)
        feeders = ordered[kept:][::-1]  # the highest core feeds the first GPU
        return cls(tuple(ordered[:kept]), tuple(zip(sorted(gpus), feeders)))

    def describe(self) -> str:
        devices = [f"cpu:{core}" for core in self.cpu_cores]
        devices += [f"gpu:{gpu} on core {core}" for gpu, core in self.gpus]
        return ", ".join(devices) or "none"


def connect_endpoint(bind: str) -> str:
    """Where workers on this host reach a broker bound to ``bind``."""
    match = re.fullmatch(r"tcp://(.+):([^:]+)", bind)
    if not match:
        return bind  # ipc://, inproc://: connect to the same address
    host, port = match.groups()
    if not port.isdigit():
        raise ValueError(f"--bind {bind}: a supervised broker needs a fixed port, not {port!r}")
    return f"tcp://{WILDCARD_HOSTS.get(host, host)}:{port}"


@dataclass(frozen=True)
class Program:
    """One supervised process."""

    name: str
    command: tuple[str, ...]
    priority: int
    # seconds it must stay up to count as started: a process that fails sooner is a failed
    # start, retried STARTRETRIES times and then left FATAL, not respawned for ever
    startsecs: int


@dataclass(frozen=True, kw_only=True)
class Deployment:
    """Everything a generated configuration says."""

    layout: Layout
    farm: tuple[str, ...]  # the command that runs farm: python -m farm, or farm
    bind: str
    connect: str
    algo: str
    models: tuple[str, ...]
    run_dir: Path
    broker_args: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()
    broker: bool = True

    @property
    def socket(self) -> Path:
        return self.run_dir / "supervisor.sock"

    def broker_program(self) -> Program:
        return Program(
            "farm-broker",
            (*self.farm, "broker", "--bind", self.bind, "--algo", self.algo, *self.broker_args),
            10,
            BROKER_STARTSECS,
        )

    def worker_command(self, device: str) -> tuple[str, ...]:
        preload = [arg for model in self.models for arg in ("--model", model)]
        return (
            *self.farm,
            "worker",
            "--device",
            device,
            "--broker",
            self.connect,
            *preload,
            *self.worker_args,
        )

    def worker_programs(self) -> list[Program]:
        cpus = [
            Program(f"farm-cpu-{core}", self.worker_command(f"cpu:{core}"), 20, CPU_STARTSECS)
            for core in self.layout.cpu_cores
        ]
        gpus = [
            Program(
                f"farm-gpu-{gpu}",
                ("taskset", "-c", str(core), *self.worker_command(f"gpu:{gpu}")),
                20,
                GPU_STARTSECS,
            )
            for gpu, core in self.layout.gpus
        ]
        return cpus + gpus


Section = tuple[str, dict[str, str]]


def supervisor_sections(deployment: Deployment) -> list[Section]:
    """supervisord's own sections: control socket, daemon, RPC, supervisorctl."""
    run = deployment.run_dir
    return [
        ("unix_http_server", {"file": str(deployment.socket), "chmod": "0700"}),
        (
            "supervisord",
            {
                "logfile": str(run / "supervisord.log"),
                "pidfile": str(run / "supervisord.pid"),
                "childlogdir": str(run),
                "nodaemon": "false",
            },
        ),
        (
            "rpcinterface:supervisor",
            {"supervisor.rpcinterface_factory": "supervisor.rpcinterface:make_main_rpcinterface"},
        ),
        ("supervisorctl", {"serverurl": f"unix://{deployment.socket}"}),
    ]


def program_section(program: Program, run_dir: Path) -> Section:
    return (
        f"program:{program.name}",
        {
            "command": shlex.join(program.command),
            "priority": str(program.priority),
            "autorestart": "true",
            "startsecs": str(program.startsecs),
            "startretries": str(STARTRETRIES),
            "stopsignal": "TERM",
            "stopwaitsecs": str(STOP_WAIT_SECONDS),
            "redirect_stderr": "true",
            "stdout_logfile": str(run_dir / f"{program.name}.log"),
        },
    )


def sections(deployment: Deployment) -> list[Section]:
    workers = deployment.worker_programs()
    programs = ([deployment.broker_program()] if deployment.broker else []) + workers
    result = supervisor_sections(deployment)
    result += [program_section(program, deployment.run_dir) for program in programs]
    if workers:
        result.append(
            ("group:farm-workers", {"programs": ",".join(program.name for program in workers)})
        )
    return result


def config_value(value: str) -> str:
    """A value as supervisord reads it back: ``%`` escaped; comment markers refused."""
    if re.search(r"\s[;#]|[\r\n]", value):
        raise ValueError(
            f"supervisord would cut {value!r} short: ' ;' and ' #' start a "
            f"comment there, and values are one line"
        )
    return value.replace("%", "%%")


def header(deployment: Deployment, config: str, generated_by: str) -> list[str]:
    control = f"supervisorctl -c {shlex.quote(config)}"
    workers = deployment.worker_programs()
    tail = f"farm-workers:{workers[0].name}" if workers else "farm-broker"
    what = ("broker + " if deployment.broker else "") + f"workers ({deployment.layout.describe()})"
    return [
        f"; A farm under supervisord: {what}.",
        f"; Broker: {deployment.bind if deployment.broker else 'elsewhere'}; "
        f"workers connect to {deployment.connect}.",
        f"; Generated by: {generated_by}",
        ";",
        f"; Start:    mkdir -p {shlex.quote(str(deployment.run_dir))} && "
        f"supervisord -c {shlex.quote(config)}",
        f"; Inspect:  {control} status       (logs: {deployment.run_dir}/*.log)",
        f";           {control} tail -f {tail}",
        f"; Restart:  {control} restart farm-workers:*",
        f"; Stop:     {control} shutdown",
    ]


def render(deployment: Deployment, config: str, generated_by: str) -> str:
    """The configuration file's text; ``config`` is its path, for the header's commands."""
    lines = header(deployment, config, generated_by)
    for name, values in sections(deployment):
        lines += ["", f"[{name}]"]
        lines += [f"{key} = {config_value(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def plan(
    *,
    cpus: str | None,
    gpus: str,
    bind: str,
    connect: str | None,
    algo: str,
    models: tuple[str, ...],
    run_dir: str,
    broker_args: tuple[str, ...],
    worker_args: tuple[str, ...],
    curve: str | None,
    broker: bool,
    farm_command: str,
) -> Deployment:
    """The deployment ``farm deploy supervisord``'s options describe; ValueError naming the
    option at fault when it cannot run."""
    cores = parse_ids(cpus, "core") if cpus is not None else tuple(sorted(os.sched_getaffinity(0)))
    if curve:
        curve_args = ("--curve", os.path.abspath(curve))
        broker_args, worker_args = (*curve_args, *broker_args), (*curve_args, *worker_args)
    farm = tuple(shlex.split(farm_command))
    if not farm:
        raise ValueError("--farm-command is empty")
    deployment = Deployment(
        layout=Layout.plan(cores, parse_ids(gpus, "GPU") if gpus.strip() else ()),
        farm=farm,
        bind=bind,
        connect=connect or connect_endpoint(bind),
        algo=algo,
        models=models,
        run_dir=Path(os.path.abspath(run_dir)),
        broker_args=broker_args,
        worker_args=worker_args,
        broker=broker,
    )
    if len(str(deployment.socket)) > MAX_SOCKET_PATH:
        raise ValueError(
            f"--run-dir {run_dir} is too long for supervisord's unix socket "
            f"(at most {MAX_SOCKET_PATH} characters in all)"
        )
    return deployment


def default_farm_command() -> str:
    """This Python's ``-m farm``, as one shell word list."""
    return shlex.join([os.path.abspath(sys.executable), "-m", "farm"])
