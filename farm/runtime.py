"""Where this user's background farm (``farm up``) lives, and whether one is up.

Its files live in a folder only that user may open (``runtime_dir``:
``$FARM_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/farm``, else ``/tmp/farm-UID``), and its
broker listens on an ipc socket inside it. ``farm.json`` there names the supervisor
process (pid and start time, so a reused pid is not mistaken for it) and the endpoint.

This module only reads: ``farm.ops.background`` starts and stops the farm; clients
(``farm submit``, ``farm status``, ``Client()``) ask ``local_farm_endpoint`` where it
listens when no broker is named.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import msgspec

from farm import defaults
from farm.startup import process_state

RECORD = "farm.json"
SOCKET = "broker.sock"
LOG = "farm.log"


def runtime_dir() -> Path:
    """This user's folder for its background farm (not created)."""
    if folder := os.environ.get("FARM_RUNTIME_DIR"):
        return Path(folder)
    if xdg := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(xdg) / "farm"
    return Path(tempfile.gettempdir()) / f"farm-{os.getuid()}"


def private_dir_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot hold this user's farm (another owner, open to others), or None."""
    try:
        info = folder.lstat()
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(info.st_mode):
        return f"{folder} is not a folder"
    if info.st_uid != os.getuid():
        return f"{folder} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()})"
    if info.st_mode & 0o077:
        return f"{folder} may be opened by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def alive(pid: int, started: float) -> bool:
    """Whether ``pid`` is still this user's process that started at ``started`` (not a
    zombie, not a process that reused the pid)."""
    try:
        owner = Path(f"/proc/{pid}").stat().st_uid
    except OSError:
        return False
    found = process_state(pid)
    return (
        owner == os.getuid()
        and found is not None
        and found[0] != "Z"
        and abs(found[1] - started) < 0.5
    )


class RecordFacts(msgspec.Struct):
    """The part of ``farm.json`` a client needs: who supervises the farm, and where."""

    pid: int
    pid_started: float
    endpoint: str


def local_farm_endpoint() -> str | None:
    """The broker endpoint of this user's ``farm up`` farm, if its folder is private, its
    record readable, its supervisor alive and its socket there; else None. The broker is
    not asked: the caller's first request does that."""
    folder = runtime_dir()
    if private_dir_problem(folder) is not None:
        return None
    try:
        facts = msgspec.json.decode((folder / RECORD).read_bytes(), type=RecordFacts)
    except (OSError, msgspec.DecodeError):
        return None
    if not alive(facts.pid, facts.pid_started) or not (folder / SOCKET).exists():
        return None
    return facts.endpoint


@dataclass(frozen=True)
class BrokerChoice:
    """The broker a client talks to, and how it was found (said to the user)."""

    endpoint: str
    found: str  # "named", "$FARM_BROKER", "local farm" or "default"

    def describe(self) -> str:
        how = {
            "named": "",
            "$FARM_BROKER": " (from $FARM_BROKER)",
            "local farm": " (the local farm of `farm up`)",
            "default": " (the default: no --broker, $FARM_BROKER or `farm up` farm)",
        }[self.found]
        return f"{self.endpoint}{how}"


def choose_broker(named: str | None) -> BrokerChoice:
    """The broker to use: the one named, else ``$FARM_BROKER``, else this user's running
    ``farm up`` farm, else the default loopback endpoint."""
    if named:
        return BrokerChoice(named, "named")
    if from_environment := os.environ.get("FARM_BROKER"):
        return BrokerChoice(from_environment, "$FARM_BROKER")
    if local := local_farm_endpoint():
        return BrokerChoice(local, "local farm")
    return BrokerChoice(defaults.BROKER_ENDPOINT, "default")
