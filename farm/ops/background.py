"""A local farm that stays up in the background: ``farm up`` starts it, ``farm run`` finds
and uses it, ``farm down`` or its idle timeout stops it.

It is private to its user. Its files live in a folder only that user may open
(``runtime_dir``: ``$FARM_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/farm``, else
``/tmp/farm-UID``; mode 0700, owned by the user), and its broker listens on an ipc
socket inside it.  ``farm.json`` there (mode 0600) names the supervisor process (pid
and start time, so a reused pid is not mistaken for it), the endpoint and the settings.

A farm is used only if its supervisor is alive and its broker answers with its
workers.  Anything else (a dead supervisor, a socket left behind, a broker that does
not answer, a folder another user could open) is stale: stopped, its files removed,
never trusted.

The supervisor (``farm up --foreground``) runs a ``LocalFarm`` and asks its broker every
few seconds whether a job ran; after ``idle_timeout`` seconds without one, or at
SIGTERM, or when a farm process dies, it stops the farm and removes its files.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from farm import defaults
from farm.client.client import Client, FarmError, FarmTimeout
from farm.ops.forked import wait_exited
from farm.ops.local import LocalFarm, farm_command
from farm.runtime import LOG, RECORD, SOCKET, alive, private_dir_problem, runtime_dir
from farm.startup import process_started
from farm.summary import plural

log = logging.getLogger("farm.up")

#: Seconds ``farm run`` waits for a recorded farm's broker before calling it stale.
ANSWER_TIMEOUT = 2.0
#: Longest wait between two looks at the broker's jobs (shorter for a short idle timeout).
IDLE_POLL = 5.0
#: Seconds ``farm down`` gives the supervisor to stop its farm before killing it.
DOWN_GRACE = 15.0


@dataclass(frozen=True, kw_only=True)
class FarmSettings:
    """What a background farm runs: its workers' devices, the models they preload, and the
    settings every job on it shares."""

    devices: tuple[str, ...]
    models: tuple[str, ...]
    models_dirs: tuple[str, ...] = ()  # resolved --models-dir folders, then $FARM_MODELS
    backend: str = defaults.BACKEND
    precision: str = defaults.PRECISION
    batch: int | None = None
    idle_timeout: float = defaults.LOCAL_IDLE_TIMEOUT

    def differences(self, other: FarmSettings) -> list[str]:
        """What a farm with ``other`` settings would change: the folders, batch and workers
        (a job can ask for another engine and policy, not for these)."""
        found = []
        if self.models_dirs != other.models_dirs:
            found.append(f"model folders {list(other.models_dirs)}, not {list(self.models_dirs)}")
        if self.batch != other.batch:
            found.append(f"batch {other.batch or 'auto'}, not {self.batch or 'auto'}")
        if set(other.devices) - set(self.devices):
            found.append(f"devices {', '.join(other.devices)}, not {', '.join(self.devices)}")
        return found


@dataclass(frozen=True, kw_only=True)
class FarmRecord:
    """``farm.json``: the running background farm."""

    pid: int  # the supervisor's
    pid_started: float  # its start time: a pid reused by another process does not match
    endpoint: str
    started: float
    settings: FarmSettings
    # broker and workers (pid, start time), stopped with a stale farm
    processes: tuple[tuple[int, float], ...] = ()

    def describe(self) -> str:
        devices = self.settings.devices
        workers = f"{plural(len(devices), 'worker')} ({', '.join(devices)})"
        return f"pid {self.pid}, {workers}, {self.endpoint}"


@dataclass(frozen=True)
class Found:
    """``find_running``'s answer: the farm to use (None: none), and what was seen on the
    way (a stale farm replaced, another user's folder ignored), to tell the user."""

    record: FarmRecord | None
    notice: str = ""


def make_runtime_dir() -> Path:
    folder = runtime_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if problem := private_dir_problem(folder):
        raise FarmError(f"cannot keep a local farm there: {problem}")
    return folder


def read_record(folder: Path) -> FarmRecord | None:
    try:
        return msgspec.json.decode((folder / RECORD).read_bytes(), type=FarmRecord)
    except FileNotFoundError:
        return None
    except msgspec.DecodeError as exc:
        log.warning("%s is unreadable (%s): ignored", folder / RECORD, exc)
        return None


def write_record(folder: Path, record: FarmRecord) -> None:
    """Written whole, then renamed: a reader never sees half of it."""
    partial = folder / f"{RECORD}.partial"
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(msgspec.json.format(msgspec.json.encode(record)))
    partial.replace(folder / RECORD)


def find_running(answer_timeout: float = ANSWER_TIMEOUT) -> Found:
    """This user's background farm if it is up and answers; a stale one is removed."""
    folder = runtime_dir()
    if problem := private_dir_problem(folder):
        return Found(None, f"not using a local farm: {problem}")
    record = read_record(folder)
    if record is None:
        return Found(None)
    why_stale = staleness(record, answer_timeout)
    if why_stale is None:
        return Found(record)
    remove_stale(folder, record)
    return Found(None, f"a stale local farm ({record.describe()}) was removed: {why_stale}")


def staleness(record: FarmRecord, answer_timeout: float) -> str | None:
    """Why ``record``'s farm cannot be used, or None."""
    if not alive(record.pid, record.pid_started):
        return f"its supervisor (pid {record.pid}) is gone"
    try:
        with Client(record.endpoint, timeout=answer_timeout) as client:
            info = client.info()
    except FarmTimeout:
        return f"its broker did not answer within {answer_timeout:g} s"
    except FarmError as exc:
        return f"its broker failed: {exc}"
    if len(info.get("workers", [])) < len(record.settings.devices):
        return (
            f"{len(info.get('workers', []))} of its {len(record.settings.devices)} workers "
            "are connected"
        )
    return None


def remove_stale(folder: Path, record: FarmRecord) -> None:
    """Stop whatever is left of a stale farm (its supervisor, broker and workers, each if
    it is still the process that was recorded), then remove its files."""
    for pid, started in ((record.pid, record.pid_started), *record.processes):
        if alive(pid, started):
            kill(pid)
    remove_files(folder)


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def remove_files(folder: Path) -> None:
    for name in (RECORD, SOCKET):
        (folder / name).unlink(missing_ok=True)


# ----------------------------------------------------------------- farm up / farm down


def start(settings: FarmSettings) -> FarmRecord:
    """Start the supervisor (``farm up --foreground``) detached, and return once its farm
    is ready; FarmError with its log's last lines if it fails."""
    folder = make_runtime_dir()
    log_path = folder / LOG
    command = farm_command(
        "up",
        "--foreground",
        *(arg for device in settings.devices for arg in ("--device", device)),
        *(arg for model in settings.models for arg in ("--model", model)),
        *(arg for path in settings.models_dirs for arg in ("--models-dir", path)),
        "--backend",
        settings.backend,
        "--precision",
        settings.precision,
        *(["--batch", str(settings.batch)] if settings.batch else []),
        "--idle-timeout",
        f"{settings.idle_timeout:g}",
    )
    with open(log_path, "ab") as log_file:
        os.chmod(log_path, 0o600)
        supervisor = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log_file,
            start_new_session=True,
            text=True,
        )
    assert supervisor.stdout is not None
    line = supervisor.stdout.readline()  # one line once ready; EOF if it failed
    supervisor.stdout.close()
    record = read_record(folder)
    if not line.startswith("ready") or record is None or record.pid != supervisor.pid:
        supervisor.wait()
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        raise FarmError(
            f"the local farm did not start (exit code {supervisor.returncode}); "
            f"{log_path} ends with:\n" + "\n".join(tail)
        )
    return record


def stop(record: FarmRecord, grace: float = DOWN_GRACE) -> None:
    """SIGTERM the supervisor and wait until it has stopped its farm (SIGKILL after
    ``grace`` s, then its processes too)."""
    try:
        os.kill(record.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    if alive(record.pid, record.pid_started) and not wait_exited(record.pid, grace):
        remove_stale(runtime_dir(), record)
    remove_files(runtime_dir())


# ------------------------------------------------------------------------ the supervisor


def supervise(settings: FarmSettings, algo: str) -> None:
    """Run the farm until SIGTERM, idleness or a dead farm process (``farm up
    --foreground``); print ``ready`` on stdout once it serves."""
    folder = make_runtime_dir()
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: stopping.set())
    endpoint = f"ipc://{folder / SOCKET}"
    (folder / SOCKET).unlink(missing_ok=True)  # left by a farm that was killed
    farm = LocalFarm(
        devices=list(settings.devices),
        algo=algo,
        preload=list(settings.models),
        bind=endpoint,
        fork=True,
        models_dirs=settings.models_dirs,
        backend=settings.backend,
        precision=settings.precision,
        batch=settings.batch,
    )
    try:
        with farm as local:
            write_record(
                folder,
                FarmRecord(
                    pid=os.getpid(),
                    pid_started=process_started(),
                    endpoint=local.endpoint,
                    started=time.time(),
                    settings=settings,
                    processes=tuple((p.pid, process_started(p.pid)) for p in local.processes),
                ),
            )
            print("ready", flush=True)
            redirect_stdout_to_null()
            log.info("local farm up: %s; idle timeout %g s", local.endpoint, settings.idle_timeout)
            reason = serve_until_idle(local, settings.idle_timeout, stopping)
            log.info("local farm stopping: %s", reason)
    finally:
        if (record := read_record(folder)) is not None and record.pid == os.getpid():
            remove_files(folder)


def redirect_stdout_to_null() -> None:
    """``farm up`` has read the ready line and gone: later writes must not hit a closed pipe."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)


def serve_until_idle(local: LocalFarm, idle_timeout: float, stopping: threading.Event) -> str:
    """Wait for a reason to stop: ``stopping`` set, a farm process dead, or no job for
    ``idle_timeout`` seconds.  Returns the reason."""
    poll = min(IDLE_POLL, max(0.2, idle_timeout / 4))
    last_active, seen = time.monotonic(), None
    with local.client(timeout=10.0) as client:
        while not stopping.wait(poll):
            dead = [p for p in local.processes if p.poll() is not None]
            if dead:
                return f"farm process {dead[0].pid} exited (code {dead[0].returncode})"
            info = client.info()
            activity = (tuple(job.get("job") for job in info["jobs"]), info["jobs_ended"])
            if info["jobs"] or activity != seen:
                last_active, seen = time.monotonic(), activity
            elif time.monotonic() - last_active >= idle_timeout:
                return f"no job for {idle_timeout:g} s"
    return "asked to stop"
