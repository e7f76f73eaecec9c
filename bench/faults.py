"""Chaos: one real job run through a farm whose processes are killed, frozen and cut off.

A broker and pinned workers are started as separate ``farm broker`` and ``farm worker``
processes, and ``farm submit`` runs one LeNet job on them, once without faults and once
under churn.  Every U(a, b) seconds of the chaos run, one fault (seeded): a worker killed
with SIGKILL and started again at once on its core; a worker frozen (SIGSTOP) for one
interval; the link of the worker that runs in a network namespace cut (its veth down) for
one interval; and, at fixed points of the job, the broker killed and started again on
the same address, or the client killed and ``farm submit ... --resume`` started.

Workers log one debug line per computed chunk to their own file; the harness counts the
images computed from them.  Every output is checked against an in-process forward.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

import numpy as np

from farm.client.client import Client, FarmError, FarmTimeout
from farm.modelrepo.repository import find
from farm.ops.local import cores, farm_command, free_port, stop_processes

ATOL = 1e-5
#: Seconds the farm's processes get to register.
READY_TIMEOUT = 120.0
WORKER_KILL, WORKER_STOP, LINK_CUT = "worker kill", "worker stop", "link cut"
BROKER_KILL, CLIENT_KILL = "broker kill", "client kill"
#: Faults drawn at random on every tick; the broker and client kills come at fixed points.
RANDOM_KINDS = (WORKER_KILL, WORKER_STOP, LINK_CUT)
KINDS = (*RANDOM_KINDS, BROKER_KILL, CLIENT_KILL)
CHUNK_LINE = re.compile(
    r"^(\S+) DEBUG farm\.worker pid=(\d+) computed items (\d+)\.\.(\d+) "
    r"of job (\S+) in "
)
SUBMIT_LINE = re.compile(
    r"^(\S+) INFO farm\.broker pid=\d+ (?:job (\w+): \d+ x |broker "
    r"listening on )"
)
DELIVERED_LINE = re.compile(
    r"^(\S+) DEBUG farm\.broker pid=\d+ delivered (kept )?items (\d+)\.\.(\d+) of job (\w+)"
)
FAILED_LINE = re.compile(r" ERROR farm\.worker pid=\d+ chunk \d+ of job \S+ failed")
#: The lines of a ``farm submit`` summary (farm/summary.py ``JobSummary.format``) about the
#: job's size, its tail and its backup attempts.
SUMMARY_DONE = re.compile(r"^(?:[\d,]+ of )?([\d,]+) images? (?:\(stopped early\) )?in \S+ s:")
SUMMARY_TAIL = re.compile(r"tail (\d+(?:\.\d+)?) s \((\d+(?:\.\d+)?)% of the span\)")
#: A broker's INFO lines (farm/broker/backups.py) for a backup attempt started and a straggler.
BACKUP_LINE = re.compile(r"^(\S+) INFO farm\.broker pid=\d+ job \w+: backup of items ")
STRAGGLER_LINE = re.compile(
    r"^(\S+) INFO farm\.broker pid=\d+ job \w+: items \d+\.\.\d+ on \S+ straggle: "
)
SUMMARY_BACKUPS = re.compile(
    r"^backup attempts: ([\d,]+) chunks? \([\d,]+ images?\), (\d+(?:\.\d+)?)% extra work, "
    r"([\d,]+) won, (\d+(?:\.\d+)?) s saved"
)


@dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    """One chaos run's farm, job and faults."""

    images: int = 200_000
    workers: int = 3
    interval: tuple[float, float] = (0.5, 1.5)  # seconds between faults, uniform
    broker_restarts: int = 2
    client_kills: int = 1
    link_cut: bool = True  # put worker 0 in a network namespace and cut its link
    heartbeat: float = 0.2
    liveness: int = 5
    algo: str | None = None  # the broker's policy (None: its default)
    poison: int | None = None  # poison mode: this item fails on every worker, no faults
    job_timeout: float = 900.0  # seconds the whole job may take before it is killed
    shared: bool = False  # farm submit --shared: the workers read the .npy themselves
    backup_share: float | None = None  # the broker's --backup-share (None: its default)


@dataclass(frozen=True)
class Computed:
    """One chunk a worker computed, from its log."""

    time: float  # epoch seconds
    pid: int
    start: int
    count: int
    job: str


@dataclass
class Fault:
    at: float  # seconds since the chaos job started
    kind: str
    target: str


class NetnsError(OSError):
    """A network namespace or veth pair could not be made."""


def ip(*args: str, netns: str | None = None) -> None:
    """Run ``ip ARGS`` (inside ``netns``); NetnsError with ip's own words when it fails."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    try:
        subprocess.run([*prefix, "ip", *args], check=True, capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise NetnsError("no `ip` command") from exc
    except subprocess.CalledProcessError as exc:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {exc.stderr.strip()}") from exc


@dataclass(frozen=True)
class Netns:
    """A network namespace joined to this host by a veth pair (a /30 of 10.231.0.0/16)."""

    name: str
    host_veth: str
    inner_veth: str
    host_ip: str
    inner_ip: str

    @classmethod
    def create(cls, tag: int) -> Netns:
        """Namespace ``farmchaos<tag>``; NetnsError when it cannot be made (not root, ...)."""
        n = tag % 16384
        base = f"10.231.{n // 64}.{(n % 64) * 4}"
        prefix = base.rsplit(".", 1)[0]
        last = int(base.rsplit(".", 1)[1])
        netns = cls(
            f"farmchaos{tag}",
            f"fch{tag}h"[:15],
            f"fch{tag}n"[:15],
            f"{prefix}.{last + 1}",
            f"{prefix}.{last + 2}",
        )
        ip("netns", "add", netns.name)
        try:
            ip("link", "add", netns.host_veth, "type", "veth", "peer", "name", netns.inner_veth)
            ip("link", "set", netns.inner_veth, "netns", netns.name)
            ip("addr", "add", f"{netns.host_ip}/30", "dev", netns.host_veth)
            ip("link", "set", netns.host_veth, "up")
            ip("addr", "add", f"{netns.inner_ip}/30", "dev", netns.inner_veth, netns=netns.name)
            ip("link", "set", netns.inner_veth, "up", netns=netns.name)
            ip("link", "set", "lo", "up", netns=netns.name)
        except NetnsError:
            netns.delete()
            raise
        return netns

    @property
    def launcher(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def cut(self) -> None:
        """The namespace's end down: the host keeps its address, the worker loses its route."""
        ip("link", "set", self.inner_veth, "down", netns=self.name)

    def mend(self) -> None:
        ip("link", "set", self.inner_veth, "up", netns=self.name)

    def delete(self) -> None:
        """Remove the namespace (its veth end, and so the pair, goes with it)."""
        for args in (("netns", "delete", self.name), ("link", "delete", self.host_veth)):
            try:
                ip(*args)
            except NetnsError:
                pass


@dataclass
class WorkerSlot:
    """One worker's place: its core, whether it runs in the namespace, its processes."""

    index: int
    device: str
    in_netns: bool
    process: subprocess.Popen | None = None
    started: int = 0  # processes started in this slot

    def __str__(self) -> str:
        where = ", netns" if self.in_netns else ""
        return f"worker {self.index} ({self.device}{where})"


@dataclass
class ChaosFarm:
    """A broker and pinned workers, every process logging to its own file in ``folder``."""

    config: ChaosConfig
    folder: Path
    netns: Netns | None = None
    worker_options: Sequence[str] = ()
    endpoint: str = ""
    broker: subprocess.Popen | None = None
    brokers_started: int = 0
    slots: list[WorkerSlot] = field(default_factory=list)
    logs: list[IO[str]] = field(default_factory=list)

    @property
    def link(self) -> list[str]:
        return ["--heartbeat", str(self.config.heartbeat), "--liveness", str(self.config.liveness)]

    def start(self) -> None:
        """Broker, then workers; returns when every worker has registered."""
        host = self.netns.host_ip if self.netns else "127.0.0.1"
        self.endpoint = f"tcp://{host}:{free_port(host)}"
        self.start_broker()
        available = cores()
        self.slots = [
            WorkerSlot(i, f"cpu:{available[i % len(available)]}", self.netns is not None and i == 0)
            for i in range(self.config.workers)
        ]
        for slot in self.slots:
            self.start_worker(slot)
        self.wait_for_workers(len(self.slots))

    def log_file(self, name: str) -> IO[str]:
        handle = open(self.folder / name, "w")
        self.logs.append(handle)
        return handle

    def start_broker(self) -> None:
        """A broker bound to ``endpoint``; waits for the line that says it listens."""
        algo = ["--algo", self.config.algo] if self.config.algo else []
        if self.config.backup_share is not None:
            algo += ["--backup-share", f"{self.config.backup_share:g}"]
        self.brokers_started += 1
        self.broker = subprocess.Popen(
            farm_command(
                "--log-level",
                "DEBUG",  # a line per delivered chunk: the report's figures per broker life
                "--log-format",
                "text",
                "broker",
                "--bind",
                self.endpoint,
                *algo,
                *self.link,
            ),
            stdout=subprocess.PIPE,
            stderr=self.log_file(f"broker-{self.brokers_started}.log"),
            text=True,
            start_new_session=True,
        )
        assert self.broker.stdout is not None
        line = self.broker.stdout.readline()
        if not line.startswith("farm broker listening on "):
            raise FarmError(
                f"the broker did not start (exit code {self.broker.poll()}; "
                f"see {self.folder}/broker-{self.brokers_started}.log)"
            )

    def kill_broker(self) -> None:
        """SIGKILL the broker and start a new one on the same address."""
        assert self.broker is not None
        self.broker.kill()
        self.broker.wait()
        if self.broker.stdout:
            self.broker.stdout.close()
        self.start_broker()

    def start_worker(self, slot: WorkerSlot) -> None:
        slot.started += 1
        launcher = self.netns.launcher if slot.in_netns and self.netns else []
        slot.process = subprocess.Popen(
            [
                *launcher,
                *farm_command(
                    "--log-level",
                    "DEBUG",
                    "--log-format",
                    "text",
                    "worker",
                    "--device",
                    slot.device,
                    "--broker",
                    self.endpoint,
                    "--model",
                    "lenet",
                    *self.link,
                    *self.worker_options,
                ),
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log_file(f"worker-{slot.index}-{slot.started}.log"),
            start_new_session=True,
        )

    def kill_worker(self, slot: WorkerSlot) -> None:
        """SIGKILL the slot's worker and start a new one on the same core at once."""
        assert slot.process is not None
        slot.process.kill()
        slot.process.wait()
        self.start_worker(slot)

    def wait_for_workers(self, count: int) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        with Client(self.endpoint, timeout=1.0) as client:
            while True:
                try:
                    client.info(wait_workers=count)
                    return
                except FarmTimeout:
                    dead = [p.args for p in self.processes() if p.poll() is not None]
                    if dead:
                        raise FarmError(
                            f"a farm process exited during start: {dead[0]!r} "
                            f"(logs in {self.folder})"
                        ) from None
                    if time.monotonic() > deadline:
                        raise

    def processes(self) -> list[subprocess.Popen]:
        workers = [slot.process for slot in self.slots if slot.process is not None]
        return [*([self.broker] if self.broker else []), *workers]

    def worker_logs(self) -> list[Path]:
        return sorted(self.folder.glob("worker-*.log"))

    def stop(self) -> None:
        """Thaw every worker, then stop workers and broker; close the log files."""
        for slot in self.slots:
            if slot.process is not None and slot.process.poll() is None:
                slot.process.send_signal(signal.SIGCONT)
        stop_processes([slot.process for slot in self.slots if slot.process is not None])
        stop_processes([self.broker] if self.broker else [])
        for handle in self.logs:
            handle.close()


def epoch(stamp: str) -> float:
    """A log line's UTC timestamp (``2026-11-23T10:04:05.123Z``) in epoch seconds."""
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


def computed_chunks(
    paths: Iterable[Path], since: float = 0.0, until: float = float("inf")
) -> list[Computed]:
    """Chunks the workers' logs say were computed between ``since`` and ``until``."""
    chunks = []
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            match = CHUNK_LINE.match(line)
            if match:
                stamp, pid, first, last, job = match.groups()
                chunk = Computed(
                    epoch(stamp), int(pid), int(first), int(last) - int(first) + 1, job
                )
                if since <= chunk.time < until:
                    chunks.append(chunk)
    return sorted(chunks, key=lambda chunk: chunk.time)


def failed_attempts(paths: Iterable[Path]) -> int:
    """Chunks the workers' logs say raised (a poison chunk's attempts)."""
    return sum(
        1
        for path in paths
        for line in path.read_text(errors="replace").splitlines()
        if FAILED_LINE.search(line)
    )


@dataclass(frozen=True)
class Job:
    """The job's input file and its reference outputs."""

    path: Path
    count: int
    reference: np.ndarray


def make_job(folder: Path, count: int, seed: int) -> Job:
    """The bundled LeNet digits tiled to ``count`` in a seeded order, saved as .npy; the
    reference is the sample's in-process forward, indexed the same way."""
    spec = find("lenet")
    assert spec.sample is not None  # lenet is bundled with its sample
    sample = np.load(spec.sample)
    order = np.random.default_rng(seed).permutation(np.resize(np.arange(len(sample)), count))
    path = folder / "images.npy"
    np.save(path, sample[order])
    return Job(path, count, sample_reference(sample)[order])


def sample_reference(sample: np.ndarray) -> np.ndarray:
    """LeNet outputs of the sample in this process: OpenCV, one thread (what a worker runs)."""
    from farm.engines.autoselect import load_engine
    from farm.engines.engine import limit_threads

    limit_threads(1)
    return load_engine(find("lenet"), "opencv", threads=1).run(sample[:, np.newaxis])


@dataclass
class Submission:
    """One ``farm submit`` process, its output files and its exit."""

    process: subprocess.Popen
    stderr: Path
    stdout: Path | None = None  # where its summary is printed

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout)

    def error_lines(self, limit: int = 8) -> list[str]:
        """The failures ``farm submit`` listed, else the last lines of its stderr."""
        lines = [
            line for line in self.stderr.read_text(errors="replace").splitlines() if line.strip()
        ]
        listed = [i for i, line in enumerate(lines) if line.endswith(" images failed:")]
        return lines[listed[-1] :][:limit] if listed else lines[-limit:]


def submit(farm: ChaosFarm, job: Job, out: Path, name: str, resume: bool = False) -> Submission:
    """Start ``farm submit IMAGES --model lenet --out OUT [--resume]``."""
    stderr = farm.folder / f"{name}.err"
    with open(farm.folder / f"{name}.out", "w") as stdout, open(stderr, "w") as errors:
        process = subprocess.Popen(
            farm_command(
                "--log-level",
                "WARNING",
                "submit",
                str(job.path),
                "--model",
                "lenet",
                "--broker",
                farm.endpoint,
                "--out",
                str(out),
                "--quiet",
                *(["--resume"] if resume else []),
                *(["--shared"] if farm.config.shared else []),
            ),
            stdout=stdout,
            stderr=errors,
            start_new_session=True,
        )
    return Submission(process, stderr, farm.folder / f"{name}.out")


@dataclass(frozen=True)
class TailFigures:
    """What a ``farm submit`` summary says of its job's tail and backup attempts; None
    where it says nothing (no summary, a job stopped early, a summary without them)."""

    images: int | None = None  # the images of the job the summary is of
    tail_s: float | None = None
    tail_share: float | None = None  # of the job's span, on the broker's clock
    backups: int | None = None  # backup attempts (chunks)
    extra: float | None = None  # their images over the job's
    wins: int | None = None
    saved_s: float | None = None

    def short(self) -> str:
        """``backups 2 (won 1), tail 3.1%``; ``n/a`` for what the summary lacks."""
        backups = f"{self.backups} (won {self.wins})" if self.backups is not None else "n/a"
        tail = f"{self.tail_share:.1%}" if self.tail_share is not None else "n/a"
        return f"backups {backups}, tail {tail}"

    def long(self) -> str:
        """Every figure, for a report's detail lines."""
        backups = (
            f"{self.backups} chunk{'' if self.backups == 1 else 's'}, {self.extra:.1%} "
            f"extra work, {self.wins} won, "
            f"{self.saved_s:.2f} s saved"
            if self.backups is not None and self.extra is not None
            else "n/a"
        )
        tail = (
            f"{self.tail_s:.2f} s ({self.tail_share:.1%} of the span)"
            if self.tail_s is not None and self.tail_share is not None
            else "n/a"
        )
        size = (
            f"{self.images:,} image{'' if self.images == 1 else 's'}"
            if self.images is not None
            else "no summary"
        )
        return f"backup attempts {backups}; tail {tail} (its job: {size})"


def tail_figures(text: str) -> TailFigures:
    """The tail and backup attempts a ``farm submit`` printout's last summary reports.  A
    summary that shows its tail but no backup line had no backup attempts."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if SUMMARY_DONE.match(line)]
    if not starts:
        return TailFigures()
    summary = lines[starts[-1] :]
    images = int(SUMMARY_DONE.match(summary[0]).group(1).replace(",", ""))  # type: ignore[union-attr]
    tail = next((m for m in map(SUMMARY_TAIL.search, summary) if m), None)
    backup = next((m for m in map(SUMMARY_BACKUPS.match, summary) if m), None)
    figures = TailFigures(images=images)
    if tail:
        figures = TailFigures(
            images=images,
            tail_s=float(tail.group(1)),
            tail_share=float(tail.group(2)) / 100,
            backups=0,
            extra=0.0,
            wins=0,
            saved_s=0.0,
        )
    if backup:
        figures = TailFigures(
            images=images,
            tail_s=figures.tail_s,
            tail_share=figures.tail_share,
            backups=int(backup.group(1).replace(",", "")),
            extra=float(backup.group(2)) / 100,
            wins=int(backup.group(3).replace(",", "")),
            saved_s=float(backup.group(4)),
        )
    return figures


def broker_marks(paths: Iterable[Path], since: float = 0.0) -> tuple[int, int]:
    """Backup attempts started and stragglers flagged that the brokers' logs record from
    ``since`` (epoch seconds), over every broker life."""
    backups = stragglers = 0
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            backup, straggler = BACKUP_LINE.match(line), STRAGGLER_LINE.match(line)
            match = backup or straggler
            if match and epoch(match.group(1)) >= since:
                backups += bool(backup)
                stragglers += bool(straggler)
    return backups, stragglers


def submission_figures(submission: Submission) -> TailFigures:
    """The tail and backups of a finished ``farm submit``'s printed summary."""
    if submission.stdout is None or not submission.stdout.exists():
        return TailFigures()
    return tail_figures(submission.stdout.read_text(errors="replace"))


@dataclass
class Outcome:
    """What a job's outputs and last ``farm submit`` came to."""

    exit_code: int
    wall: float
    failed_rows: list[int]  # images whose outputs are NaN (failed)
    max_diff: float  # over the images that did not fail
    errors: list[str]  # the last submit's stderr, when it failed
    # the tail and backup attempts its summary printed (the last submit's own job)
    tail: TailFigures = field(default_factory=TailFigures)


def check_outputs(out: Path, job: Job) -> tuple[list[int], float]:
    """Rows with NaN (failed images) and the largest difference elsewhere (inf: no file)."""
    try:
        outputs = np.load(out).reshape(job.reference.shape)
    except (OSError, ValueError) as exc:
        print(f"  cannot read {out}: {exc}")
        return [], float("inf")
    failed = np.isnan(outputs).any(axis=1)
    good = ~failed
    difference = float(np.abs(outputs[good] - job.reference[good]).max()) if good.any() else 0.0
    return [int(i) for i in np.flatnonzero(failed)], difference


def finish(submission: Submission, out: Path, job: Job, started: float) -> Outcome:
    code = submission.wait()
    wall = time.time() - started
    failed, difference = check_outputs(out, job)
    errors = submission.error_lines() if code else []
    return Outcome(code, wall, failed, difference, errors, submission_figures(submission))


@dataclass
class Undo:
    """How to end a fault that lasts one interval (a frozen worker, a cut link)."""

    action: str
    slot: WorkerSlot | None = None

    def run(self, farm: ChaosFarm) -> None:
        if self.action == "thaw" and self.slot and self.slot.process:
            self.slot.process.send_signal(signal.SIGCONT)
        elif self.action == "mend" and farm.netns:
            farm.netns.mend()


def milestones(config: ChaosConfig, expected: float) -> list[tuple[float, str]]:
    """Broker and client kills, spread evenly through a job expected to last ``expected``
    seconds and interleaved by kind: (seconds after the start, kind), in order."""
    kinds = sorted(
        [
            ((i + 1) / (config.broker_restarts + 1), BROKER_KILL)
            for i in range(config.broker_restarts)
        ]
        + [((j + 1) / (config.client_kills + 1), CLIENT_KILL) for j in range(config.client_kills)]
    )
    points = len(kinds)
    return [((m + 1) / (points + 1) * expected, kind) for m, (_, kind) in enumerate(kinds)]


@dataclass
class ChaosRun:
    """The chaos job: the faults it met and its client kills' times (epoch seconds)."""

    faults: list[Fault] = field(default_factory=list)
    client_kills: list[float] = field(default_factory=list)
    planned: int = 0
    outcome: Outcome | None = None


def run_chaos(farm: ChaosFarm, job: Job, out: Path, expected: float, seed: int) -> ChaosRun:
    """Run the job while injecting faults every U(a, b) s until its last client exits: the
    random kinds in rounds (each once per round, in a seeded order), the broker and client
    kills at their planned times."""
    config, rng = farm.config, np.random.default_rng(seed)
    plan = milestones(config, expected)
    run = ChaosRun(planned=len(plan))
    kinds = [kind for kind in RANDOM_KINDS if kind != LINK_CUT or farm.netns]
    started = time.time()
    client = submit(farm, job, out, "chaos-submit-0")
    undo: Undo | None = None
    bag: list[str] = []  # the random kinds in a seeded order, each once per round
    deadline = time.monotonic() + config.job_timeout
    while time.monotonic() < deadline:
        try:
            client.wait(float(rng.uniform(*config.interval)))
            break
        except subprocess.TimeoutExpired:
            pass
        if undo:
            undo.run(farm)
            undo = None
        elapsed = time.time() - started
        if plan and plan[0][0] <= elapsed:
            kind = plan.pop(0)[1]
        else:
            bag = bag or [str(kind) for kind in rng.permutation(kinds)]
            kind = bag.pop()
        if kind == CLIENT_KILL:
            if client.process.poll() is not None:
                break  # it finished just now
            client.process.kill()
            client.wait()
            run.client_kills.append(time.time())
            run.faults.append(Fault(elapsed, kind, f"farm submit pid {client.process.pid}"))
            client = submit(farm, job, out, f"chaos-submit-{len(run.client_kills)}", resume=True)
            continue
        target, undo = inject(farm, kind, rng)
        run.faults.append(Fault(elapsed, kind, target))
    else:
        client.process.kill()
        print(f"  the job did not end within {config.job_timeout:g} s: its client was killed")
    if undo:
        undo.run(farm)
    run.outcome = finish(client, out, job, started)
    return run


def inject(farm: ChaosFarm, kind: str, rng: np.random.Generator) -> tuple[str, Undo | None]:
    """Inject one worker or broker fault: what it hit, and how to end it next tick."""
    if kind == BROKER_KILL:
        old = farm.broker.pid if farm.broker else 0
        farm.kill_broker()
        return f"broker pid {old} -> {farm.broker.pid if farm.broker else 0}", None
    if kind == LINK_CUT:
        slot = next(slot for slot in farm.slots if slot.in_netns)
        assert farm.netns is not None
        farm.netns.cut()
        return f"{slot} pid {pid(slot)}", Undo("mend")
    slot = farm.slots[int(rng.integers(len(farm.slots)))]
    if kind == WORKER_STOP:
        assert slot.process is not None
        slot.process.send_signal(signal.SIGSTOP)
        return f"{slot} pid {pid(slot)}", Undo("thaw", slot)
    old = pid(slot)
    farm.kill_worker(slot)
    return f"{slot} pid {old} -> {pid(slot)}", None


def pid(slot: WorkerSlot) -> int:
    return slot.process.pid if slot.process else 0


@dataclass
class SeedReport:
    """One seed's run, summed up."""

    seed: int
    clean: Outcome
    chaos: Outcome
    faults: list[Fault]
    recomputed: int
    kill_waste: list[int]  # images recomputed because of each client kill
    chunk_mean: float
    problems: list[str]
    lives: list[Life] = field(default_factory=list)  # the chaos run's broker lives
    # backup attempts started and stragglers flagged in the chaos run, by the brokers' logs
    marks: tuple[int, int] = (0, 0)

    @property
    def passed(self) -> bool:
        return not self.problems

    def line(self) -> str:
        counts = ", ".join(f"{kind} {sum(f.kind == kind for f in self.faults)}" for kind in KINDS)
        return (
            f"seed {self.seed}: {'PASS' if self.passed else 'FAIL'}; fault-free "
            f"{self.clean.wall:.1f} s, chaos {self.chaos.wall:.1f} s "
            f"({self.chaos.wall / self.clean.wall:.2f}x); faults {len(self.faults)} "
            f"({counts}); recomputed {self.recomputed:,}; failed "
            f"{len(self.chaos.failed_rows):,}; max diff {self.chaos.max_diff:.2g}; "
            f"exit {self.chaos.exit_code}; {self.chaos.tail.short()}"
        )


def outcome_problems(name: str, outcome: Outcome) -> list[str]:
    problems = []
    if outcome.exit_code != 0:
        problems.append(f"{name}: farm submit exited {outcome.exit_code}")
    if outcome.failed_rows:
        problems.append(
            f"{name}: {len(outcome.failed_rows):,} images failed (NaN outputs), "
            f"first {outcome.failed_rows[0]}"
        )
    if not outcome.max_diff <= ATOL:
        problems.append(
            f"{name}: outputs differ from the reference by up to {outcome.max_diff:.3g}"
        )
    return problems


@dataclass(frozen=True)
class Life:
    """One broker process's part of the chaos run: images the workers computed while it
    lived, and images it delivered to the client (of them, results workers kept from the
    broker before it)."""

    computed: int
    delivered: int
    kept: int


def broker_lives(folder: Path, chunks: list[Computed], since: float) -> list[Life]:
    """Per broker process (``broker-N.log``, in order), from ``since``: images computed while
    it lived (the workers' logs) and delivered by it (its debug log)."""
    logs = sorted(folder.glob("broker-*.log"), key=lambda p: int(p.stem.split("-")[1]))
    starts = [
        min((when for when, job in submitted_jobs([log]) if not job), default=0.0) for log in logs
    ]
    lives = []
    for n, log in enumerate(logs):
        begin = max(starts[n], since)
        end = starts[n + 1] if n + 1 < len(logs) else float("inf")
        delivered = [d for d in deliveries([log]) if d.time >= since]
        kept = sum(d.count for d in delivered if d.kept)
        computed = sum(chunk.count for chunk in chunks if begin <= chunk.time < end)
        lives.append(Life(computed, sum(d.count for d in delivered), kept))
    return lives


def submitted_jobs(paths: Iterable[Path]) -> list[tuple[float, str]]:
    """(epoch seconds, job id) of every submission the brokers' logs record, and (epoch
    seconds, "") for every broker start."""
    jobs = []
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            match = SUBMIT_LINE.match(line)
            if match:
                jobs.append((epoch(match.group(1)), match.group(2) or ""))
    return jobs


def kill_waste(
    chunks: list[Computed], jobs: list[tuple[float, str]], kills: list[float], folder: Path
) -> list[int]:
    """Images computed for a killed client's job after it was killed and not passed on to
    the resumed client as kept results: the resumed submit asks for them again.  The
    client's job is the last one the brokers saw submitted before the kill (one client runs
    at a time), unless a broker started after it (that job died with its broker: a broker
    kill's cost, not this one's).  One figure per kill."""
    wasted = []
    passed_on = kept_deliveries(folder)
    for at in kills:
        earlier = [(when, job) for when, job in jobs if when < at]
        current = max(earlier)[1] if earlier else ""
        computed = sum(
            chunk.count for chunk in chunks if chunk.time >= at and current and chunk.job == current
        )
        wasted.append(max(0, computed - passed_on.get(current, 0)))
    return wasted


def kept_deliveries(folder: Path) -> dict[str, int]:
    """Images of kept results the brokers passed on, by the job they were computed for."""
    passed: dict[str, int] = {}
    for delivered in deliveries(folder.glob("broker-*.log")):
        if delivered.kept:
            passed[delivered.job] = passed.get(delivered.job, 0) + delivered.count
    return passed


@dataclass(frozen=True)
class Delivery:
    """A chunk's outputs a broker's debug log says it passed to the client."""

    time: float
    count: int
    job: str
    kept: bool  # a result a worker kept across a lost broker, worker or client


def deliveries(paths: Iterable[Path]) -> list[Delivery]:
    """Every delivery the brokers' debug logs record."""
    found = []
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            match = DELIVERED_LINE.match(line)
            if match:
                stamp, kept, first, last, job = match.groups()
                found.append(Delivery(epoch(stamp), int(last) - int(first) + 1, job, bool(kept)))
    return found


def seed_folder(root: Path, seed: int) -> Path:
    folder = root / f"seed-{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def make_netns(config: ChaosConfig) -> Netns | None:
    """The namespace for the link-cut fault, or None (and why, printed)."""
    if not config.link_cut:
        return None
    try:
        return Netns.create(os.getpid())
    except NetnsError as exc:
        print(f"  link-cut fault skipped: no network namespace ({exc})")
        return None


def run_seed(config: ChaosConfig, seed: int, root: Path) -> SeedReport:
    """A fresh farm: the job without faults, then under churn; checks and counts."""
    folder = seed_folder(root, seed)
    job = make_job(folder, config.images, seed)
    netns = make_netns(config)
    farm = ChaosFarm(config, folder, netns)
    try:
        farm.start()
        print(
            f"seed {seed}: broker {farm.endpoint} (--heartbeat {config.heartbeat:g} "
            f"--liveness {config.liveness}), " + ", ".join(str(slot) for slot in farm.slots),
            flush=True,
        )
        clean_out = folder / "clean.npy"
        started = time.time()
        clean = finish(submit(farm, job, clean_out, "clean-submit"), clean_out, job, started)
        chaos_start = time.time()
        print(f"  fault-free: {clean.wall:.2f} s; chaos run from here", flush=True)
        out = folder / "chaos.npy"
        run = run_chaos(farm, job, out, clean.wall, seed)
        crashed = [
            f"{slot} pid {pid(slot)} exited on its own (code {slot.process.poll()})"
            for slot in farm.slots
            if slot.process and slot.process.poll() is not None
        ]
    finally:
        farm.stop()
        if netns:
            netns.delete()
    assert run.outcome is not None
    chunks = computed_chunks(farm.worker_logs(), since=chaos_start)
    clean_chunks = computed_chunks(farm.worker_logs(), until=chaos_start)
    problems = (
        outcome_problems("fault-free", clean) + outcome_problems("chaos", run.outcome) + crashed
    )
    done = sum(f.kind in (BROKER_KILL, CLIENT_KILL) for f in run.faults)
    if done < run.planned:
        problems.append(
            f"only {done} of {run.planned} planned broker/client kills happened "
            f"before the job ended"
        )
    if Path(f"{out}.journal").exists() and run.outcome.exit_code == 0:
        problems.append(f"{out}.journal left behind after the job completed")
    report = SeedReport(
        seed,
        clean,
        run.outcome,
        run.faults,
        sum(c.count for c in chunks) - job.count,
        kill_waste(chunks, submitted_jobs(folder.glob("broker-*.log")), run.client_kills, folder),
        float(np.mean([c.count for c in chunks])) if chunks else 0.0,
        problems,
        broker_lives(folder, chunks, chaos_start),
        broker_marks(folder.glob("broker-*.log"), chaos_start),
    )
    print_seed(report, config, sum(c.count for c in clean_chunks) - job.count)
    return report


def print_seed(report: SeedReport, config: ChaosConfig, clean_recomputed: int) -> None:
    print(f"  faults injected ({len(report.faults)}):")
    for fault in report.faults:
        print(f"    {fault.at:7.2f} s  {fault.kind:<12} {fault.target}")
    for kind in KINDS:
        times = [f"{f.at:.1f}" for f in report.faults if f.kind == kind]
        print(f"  {kind:<12} {len(times):3d}  at {', '.join(times) or '-'} s")
    print(
        f"  images recomputed (computed by the workers minus the job's images): "
        f"{report.recomputed:,} in the chaos run, {clean_recomputed:,} in the fault-free run"
    )
    for k, wasted in enumerate(report.kill_waste, 1):
        per_worker = config.workers * report.chunk_mean
        print(
            f"  client kill {k}: {wasted:,} images computed twice because of it; one chunk "
            f"per worker would be {per_worker:,.0f} ({config.workers} x "
            f"{report.chunk_mean:,.0f}, the mean chunk): {wasted / per_worker:.2f}x"
            if per_worker
            else f"  client kill {k}: {wasted:,} images computed twice"
        )
    for n, life in enumerate(report.lives, 1):
        print(
            f"  broker life {n}: {life.computed:,} images computed, {life.delivered:,} "
            f"delivered ({life.kept:,} of them from results the workers kept)"
        )
    chaos = report.chaos
    print(
        f"  chaos job: exit {chaos.exit_code}, failed images {len(chaos.failed_rows):,}, "
        f"max abs diff {chaos.max_diff:.3g} (limit {ATOL:g}), wall {chaos.wall:.2f} s, "
        f"fault-free {report.clean.wall:.2f} s, overhead "
        f"{chaos.wall / report.clean.wall:.2f}x"
    )
    print(f"  chaos job, the last farm submit's summary: {chaos.tail.long()}")
    print(
        f"  chaos run, every broker life (their logs): {report.marks[0]} backup attempts "
        f"started, {report.marks[1]} stragglers flagged"
    )
    print(f"  fault-free job's summary: {report.clean.tail.long()}")
    for line in chaos.errors:
        print(f"    farm submit: {line}")
    for problem in report.problems:
        print(f"  FAIL: {problem}")
    print(report.line(), flush=True)


@dataclass
class PoisonReport:
    outcome: Outcome
    computed: int
    attempts: int
    problems: list[str]


def run_poison(config: ChaosConfig, root: Path, seed: int = 1) -> PoisonReport:
    """Workers that fail every chunk touching item ``config.poison``; no other faults.
    Exactly that image must fail; every other must equal the reference."""
    assert config.poison is not None
    item = config.poison
    folder = seed_folder(root, seed)
    job = make_job(folder, config.images, seed)
    farm = ChaosFarm(config, folder, worker_options=["--fail-items", f"{item}-{item}"])
    try:
        farm.start()
        print(
            f"poison: item {item} of {job.count:,} fails on every worker; broker "
            f"{farm.endpoint}, " + ", ".join(str(slot) for slot in farm.slots),
            flush=True,
        )
        out = folder / "poison.npy"
        started = time.time()
        outcome = finish(submit(farm, job, out, "poison-submit"), out, job, started)
    finally:
        farm.stop()
    computed = sum(chunk.count for chunk in computed_chunks(farm.worker_logs()))
    attempts = failed_attempts(farm.worker_logs())
    problems = []
    if outcome.failed_rows != [item]:
        shown = outcome.failed_rows[:3] + (["..."] if len(outcome.failed_rows) > 3 else [])
        problems.append(
            f"{len(outcome.failed_rows):,} images failed ({shown}), not exactly item {item}"
        )
    if not outcome.max_diff <= ATOL:
        problems.append(
            f"the other outputs differ from the reference by up to {outcome.max_diff:.3g}"
        )
    if outcome.exit_code != 1:
        problems.append(f"farm submit exited {outcome.exit_code}, not 1 (images failed)")
    report = PoisonReport(outcome, computed, attempts, problems)
    for line in outcome.errors:
        print(f"    farm submit: {line}")
    print(
        f"  failed images {len(outcome.failed_rows):,}; max abs diff elsewhere "
        f"{outcome.max_diff:.3g}; exit {outcome.exit_code}; wall {outcome.wall:.2f} s"
    )
    print(
        f"  images computed {computed:,} for a job of {job.count:,}: extra compute "
        f"{computed - job.count:+,} ({(computed - job.count) / job.count:.2%}: the "
        f"narrowing down to the poison image); failed chunk attempts {attempts}"
    )
    for problem in problems:
        print(f"  FAIL: {problem}")
    print(f"poison: {'PASS' if not problems else 'FAIL'}", flush=True)
    return report


@dataclass
class ResumeReport:
    outcome: Outcome
    journaled: int  # images the killed client had journaled
    twice: int  # images computed more than once over both clients
    bound: int  # one chunk per worker
    problems: list[str]


def journaled_items(out: Path, total: int) -> int:
    """Images the journal beside ``out`` holds (0 while it has no whole header)."""
    from farm.client.journal import JournalUnreadable, journal_path, read_journal

    try:
        _, entries = read_journal(journal_path(out), total)
    except (OSError, JournalUnreadable):
        return 0
    return sum(entry.count for entry in entries)


def run_resume(config: ChaosConfig, root: Path, seed: int = 1) -> ResumeReport:
    """No other fault: ``farm submit`` killed with SIGKILL once its journal holds half the
    job, then ``farm submit --resume``.  Every output must equal the reference, and the
    images computed twice must be at most one chunk per worker."""
    folder = seed_folder(root, seed)
    job = make_job(folder, config.images, seed)
    farm = ChaosFarm(config, folder)
    out = folder / "resume.npy"
    try:
        farm.start()
        print(
            f"resume: {job.count:,} images; farm submit killed at half-way, then --resume; "
            f"broker {farm.endpoint}, " + ", ".join(str(slot) for slot in farm.slots),
            flush=True,
        )
        started = time.time()
        first = submit(farm, job, out, "resume-first")
        deadline = time.monotonic() + config.job_timeout
        while journaled_items(out, job.count) < job.count // 2:
            if first.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the first farm submit ended before half-way")
            time.sleep(0.01)  # polling a file another process writes
        first.process.kill()
        first.wait()
        journaled = journaled_items(out, job.count)
        outcome = finish(submit(farm, job, out, "resume-second", resume=True), out, job, started)
    finally:
        farm.stop()
    chunks = computed_chunks(farm.worker_logs())
    twice = sum(chunk.count for chunk in chunks) - job.count
    bound = round(len(farm.slots) * np.mean([chunk.count for chunk in chunks]))
    problems = outcome_problems("resumed job", outcome)
    if twice > bound:
        problems.append(f"{twice:,} images computed twice, over one chunk per worker ({bound:,})")
    print(
        f"  killed with {journaled:,} of {job.count:,} images journaled; the resumed "
        f"submit finished: exit {outcome.exit_code}, failed images "
        f"{len(outcome.failed_rows):,}, max abs diff {outcome.max_diff:.3g}, wall "
        f"{outcome.wall:.2f} s in all"
    )
    print(
        f"  images computed twice: {twice:,}; one chunk per worker: {bound:,} "
        f"({len(farm.slots)} x the mean chunk)"
    )
    for problem in problems:
        print(f"  FAIL: {problem}")
    print(f"resume: {'PASS' if not problems else 'FAIL'}", flush=True)
    return ResumeReport(outcome, journaled, twice, bound, problems)


def keep_or_remove(root: Path, passed: bool, keep: bool) -> None:
    """Remove the run's folder unless asked to keep it or a check failed (say where)."""
    if passed and not keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"logs, inputs and outputs kept in {root}")
