"""Cache files checked against the digest recorded when farm wrote them.

Every file farm writes into its cache and later loads as a graph, weights or a compiled
net (ONNX exports, int8 versions, generated weights, OpenVINO's compiled blobs) has a
record beside it, ``FILE.sha256.json``: its SHA-256, size and format.  Before such a file
is loaded its bytes are hashed again (``verified``); a file without a record, or whose
bytes or format differ from it, is named in a WARNING, removed, and built anew by the
caller.  A record says what farm wrote: it catches a file damaged or edited since, not
someone who can write both the cache and its records (records are not signatures).

A writer puts the record down before it renames the file into place (``install``): a
reader that sees the file sees its record, and processes that build the same file at
once (workers starting on one host) write the same bytes under the same record.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("farm.modelrepo.sealed")

#: A record's name: the file's name and this.
SUFFIX = ".sha256.json"
#: The lock file of a library's cache folder (``checked_folder``).
LOCK = ".lock"

#: (inode, size, mtime_ns): whether a library rewrote a file while it held the folder.
Stamp = tuple[int, int, int]

#: (path, inode, size, mtime_ns, ctime_ns) -> SHA-256 of the files this process hashed: a
#: file is hashed again once any of these changes (CaffeNet's 233 MB take 0.2-0.4 s, and
#: one engine load checks its weights, export and blob more than once).
_HASHED: dict[tuple[str, int, int, int, int], str] = {}


@dataclass(frozen=True)
class Record:
    """What farm wrote into a cache file."""

    sha256: str
    size: int
    format: str  # what the file is, and the version of the code that wrote it


def record_path(path: Path) -> Path:
    return path.with_name(path.name + SUFFIX)


def sha256_of(path: Path) -> str:
    """A file's SHA-256, read in blocks; remembered while its inode, size and times stay."""
    status = path.stat()
    key = (str(path), status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)
    if key not in _HASHED:
        with open(path, "rb") as handle:
            _HASHED[key] = hashlib.file_digest(handle, "sha256").hexdigest()
    return _HASHED[key]


def measure(path: Path, format: str) -> Record:
    return Record(sha256_of(path), path.stat().st_size, format)


def recorded(path: Path) -> Record | None:
    """The record of ``path``; None when there is none or it cannot be read."""
    try:
        return Record(**json.loads(record_path(path).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def partial_path(path: Path) -> Path:
    """A temporary name beside ``path``, of this process, with its suffix (``np.save``
    adds ``.npy`` to a name without it)."""
    return path.with_name(f".{path.stem}.{os.getpid()}.partial{path.suffix}")


def write_record(path: Path, record: Record) -> None:
    target = record_path(path)
    partial = partial_path(target)
    try:
        partial.write_text(json.dumps(asdict(record)))
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def install(partial: Path, path: Path, format: str) -> Record:
    """Rename the finished file ``partial`` to ``path``, its record written first."""
    record = measure(partial, format)
    write_record(path, record)
    os.replace(partial, path)
    return record


def write(path: Path, writer: Callable[[Path], object], format: str | None = None) -> Path:
    """Write ``path`` through a temporary name beside it, so readers see all of it or
    none; with ``format``, a cache file: its record is written first (``install``)."""
    partial = partial_path(path)
    try:
        writer(partial)
        if format is None:
            os.replace(partial, path)
        else:
            install(partial, path, format)
    finally:
        partial.unlink(missing_ok=True)
    return path


def mismatch(path: Path, format: str) -> str | None:
    """How ``path`` differs from its record (None: it does not)."""
    record = recorded(path)
    if record is None:
        return (
            f"has no recorded digest ({record_path(path).name} missing or unreadable: "
            f"written by an older farm, or not by farm)"
        )
    if record.format != format:
        return f"was recorded as {record.format!r}, farm now reads {format!r}"
    found = measure(path, format)
    if found != record:
        return (
            f"does not match its recorded digest (tampered or damaged): expected sha256 "
            f"{record.sha256[:16]} ({record.size} bytes), found {found.sha256[:16]} "
            f"({found.size} bytes)"
        )
    return None


def verified(path: Path, what: str, format: str) -> bool:
    """Whether ``path`` holds what farm recorded writing there.  False when it is absent,
    and when it differs (no record, other bytes, other format): then a WARNING names it
    and it is removed, for the caller to build anew."""
    if not path.is_file():
        return False
    try:
        problem = mismatch(path, format)
    except FileNotFoundError:  # removed meanwhile by another process's check
        return False
    if problem is None:
        return True
    log.warning("%s %s %s: rebuilding it", what, path, problem)
    with contextlib.suppress(OSError):  # a read-only cache: the rebuild says why
        path.unlink(missing_ok=True)
    return False


# ------------------------------------------------------------- a library's own folder


def entries(folder: Path) -> list[Path]:
    """The files a library wrote into ``folder`` (not farm's records, nor hidden ones)."""
    return [
        path
        for path in sorted(folder.iterdir())
        if path.is_file() and not path.name.startswith(".") and not path.name.endswith(SUFFIX)
    ]


def stamp(path: Path) -> Stamp:
    status = path.stat()
    return status.st_ino, status.st_size, status.st_mtime_ns


def check_folder(folder: Path, what: str, format: str) -> dict[str, Stamp]:
    """Remove the files of ``folder`` that differ from their records (``verified``) and
    the records of files gone; the stamps of the files kept."""
    for record in folder.glob(f"*{SUFFIX}"):
        if not record.with_name(record.name.removesuffix(SUFFIX)).exists():
            record.unlink(missing_ok=True)
    return {path.name: stamp(path) for path in entries(folder) if verified(path, what, format)}


def record_folder(folder: Path, kept: dict[str, Stamp], format: str) -> None:
    """Record the files of ``folder`` written since ``check_folder`` kept ``kept``."""
    for path in entries(folder):
        if kept.get(path.name) != stamp(path):
            write_record(path, measure(path, format))


@contextlib.contextmanager
def checked_folder(folder: Path, what: str, format: str) -> Iterator[Path]:
    """A library's cache folder (OpenVINO's ``CACHE_DIR``), one process at a time: on
    entry its files are checked against their records, on a clean exit the files the
    library wrote meanwhile are recorded.  The lock (``flock``) is held throughout, so no
    process checks a file another is still writing."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        kept = check_folder(folder, what, format)
        yield folder
        record_folder(folder, kept, format)
