"""Job inputs on shared storage: the workers read the items, the broker carries only where
they lie.

A job submitted with shared inputs (``farm run --shared``, ``Client.run(shared=True)``) sends
no image bytes.  Its SUBMIT's document carries ``StoredInputs`` (``farm.wire.messages``), which
says where each of its items lies:

* image files: each file's path as the workers see it and its size on the client;
* a `.npy` array: the file's path, where its rows start, its size and a hash of its first
  bytes, and which rows the job's items are (``runs``, as a resubmission after a broker
  restart holds only the items still missing).

The broker keeps it (``SharedInputs``) and cuts each chunk's part of it into the TASK
(``SharedInputs.locate``): a few bytes per item instead of the item.  The worker reads the
chunk's items itself (``read_files``, ``read_rows``) and checks them against what the client
saw (sizes, the array's head hash): what it cannot read, or reads differently, is never
computed silently.  A chunk it cannot read at all fails uncharged as ``unshared``, and the
broker sends that worker the job's bytes from then on (NEED and DATA, as for any job).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np

from farm.wire.messages import ArrayPlace, StoredInputs

#: Bytes of a `.npy` file hashed to check that a worker reads the client's file, and the
#: hex digits of their sha256 kept (every TASK carries them).
HEAD_BYTES, HEAD_DIGITS = 64 << 10, 16
#: The dtype of the file sizes a SUBMIT lists, and of a chunk's row ranges.
SIZE_DTYPE = np.dtype("<u8")
#: What separates the paths of a chunk of files (no path holds it).
SEPARATOR = b"\0"
#: `.npy` files a worker keeps open (and checked), most recently used last.
OPEN_ARRAYS = 8


class UnsharedError(OSError):
    """A worker cannot read a chunk's shared input (or reads other bytes than the client's)."""


class StoredError(ValueError):
    """A ``StoredInputs`` that does not describe the job it came with."""


class Located(NamedTuple):
    """A chunk's part of a job's shared inputs, as its TASK carries it."""

    stored: Literal["files", "npy"]
    place: ArrayPlace | None
    payload: list[Any]


@dataclass
class SharedInputs:
    """What the broker keeps of a job's ``StoredInputs``, to cut chunks from it cheaply."""

    stored: StoredInputs
    item_bytes: int  # of an array's rows; 0 for files
    starts: np.ndarray = field(init=False)  # files: where each name starts in ``names``
    place: ArrayPlace | None = field(init=False)  # npy: the file, as every TASK names it

    @classmethod
    def check(cls, stored: StoredInputs, total: int, item_bytes: int) -> SharedInputs:
        """The broker's copy of a job's document; StoredError if it does not fit the job."""
        if stored.kind == "files":
            shared = cls(stored, 0)
            names = len(shared.starts) - 1
            if names != total or len(stored.sizes) != total * SIZE_DTYPE.itemsize:
                raise StoredError(
                    f"shared inputs list {names} paths and "
                    f"{len(stored.sizes) // SIZE_DTYPE.itemsize} sizes for a job of {total}"
                )
            return shared
        counted = sum(count for _, _, count in stored.runs)
        if counted != total or not stored.rows or not stored.path:
            raise StoredError(f"shared .npy rows cover {counted} items of a job of {total}")
        if stored.offset + stored.rows * item_bytes > stored.size:
            raise StoredError(f"{stored.rows} rows of {item_bytes} bytes overrun {stored.path}")
        return cls(stored, item_bytes)

    def __post_init__(self) -> None:
        stored = self.stored
        # name i is names[starts[i] : starts[i + 1] - 1]: one NUL after each name but the last
        ends = np.flatnonzero(np.frombuffer(stored.names, np.uint8) == SEPARATOR[0])
        self.starts = (
            np.concatenate(([0], ends + 1, [len(stored.names) + 1]))
            if stored.kind == "files"
            else np.zeros(1, np.int64)
        )
        self.place = (
            ArrayPlace(stored.path, stored.offset, stored.size, stored.head)
            if stored.kind == "npy"
            else None
        )

    def locate(self, start: int, count: int) -> Located:
        """A chunk's TASK part: the kind, the header's place (an array's file) and payload.

        Files: their NUL-joined paths and sizes (two frames, views of the job's document).
        An array: its row ranges, ``(row, count)`` pairs of uint64 (one frame).
        """
        stored = self.stored
        if stored.kind == "files":
            names = memoryview(stored.names)[self.starts[start] : self.starts[start + count] - 1]
            sizes = memoryview(stored.sizes)[start * 8 : (start + count) * 8]
            return Located("files", None, [names, sizes])
        return Located("npy", self.place, [row_ranges(self.stored.runs, stored.rows, start, count)])


def row_ranges(runs: Sequence[tuple[int, int, int]], rows: int, start: int, count: int) -> bytes:
    """The rows of items ``start..start + count`` as ``(row, count)`` ranges (uint64 pairs),
    runs of the job mapped to rows and cut where the array wraps round."""
    ranges: list[int] = []
    stop = start + count
    for job_start, row, run_count in runs:
        low, high = max(start, job_start), min(stop, job_start + run_count)
        first = row + low - job_start
        while low < high:
            at = first % rows
            taken = min(high - low, rows - at)
            ranges += (at, taken)
            low, first = low + taken, first + taken
    return struct.pack(f"<{len(ranges)}Q", *ranges)


# ------------------------------------------------------------------------------- client


def map_path(path: str, path_map: Sequence[tuple[str, str]]) -> str:
    """``path`` as the workers see it: the first ``(client prefix, worker prefix)`` that
    starts it replaced (a prefix matches whole path components only)."""
    for client, worker in path_map:
        prefix = client.rstrip("/")
        if path == prefix or path.startswith(prefix + "/"):
            return worker.rstrip("/") + path[len(prefix) :]
    return path


def parse_path_map(text: str) -> tuple[str, str]:
    """``CLIENT_PREFIX=WORKER_PREFIX`` as a pair of absolute prefixes; ValueError if not."""
    client, sep, worker = text.partition("=")
    if not sep or not client.startswith("/") or not worker.startswith("/"):
        raise ValueError(
            f"{text!r}: a path map is CLIENT_PREFIX=WORKER_PREFIX, two absolute paths "
            f"(for example /home/me/photos=/mnt/photos)"
        )
    return client, worker


def stored_files(
    paths: Sequence[str], sizes: Sequence[int], path_map: Sequence[tuple[str, str]] = ()
) -> StoredInputs:
    """A job of image files: their absolute paths as the workers see them ("" for a file
    refused on the client) and their sizes."""
    names = [
        map_path(os.path.abspath(path), path_map).encode("utf-8", "surrogateescape")
        if path
        else b""
        for path in paths
    ]
    return StoredInputs(
        kind="files",
        names=SEPARATOR.join(names),
        sizes=np.asarray(sizes, dtype=SIZE_DTYPE).tobytes(),
    )


def stored_array(
    path: str,
    offset: int,
    rows: int,
    runs: Sequence[tuple[int, int, int]],
    path_map: Sequence[tuple[str, str]] = (),
) -> StoredInputs:
    """A job of a `.npy` file's rows, with the size and head hash a worker checks."""
    return StoredInputs(
        kind="npy",
        path=map_path(os.path.abspath(path), path_map),
        offset=offset,
        size=os.stat(path).st_size,
        head=head_digest(path),
        rows=rows,
        runs=[(job_start, row, count) for job_start, row, count in runs],
    )


def head_digest(path: str) -> str:
    """The sha256 of a file's first ``HEAD_BYTES``."""
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read(HEAD_BYTES)).hexdigest()[:HEAD_DIGITS]


# ------------------------------------------------------------------------------- worker


def read_files(
    names: bytes | memoryview, sizes: bytes | memoryview
) -> tuple[list[bytes], list[tuple[int, str]]]:
    """A chunk of shared image files: each file's bytes (b"" for one that failed) and
    ``(index, reason)`` for those that failed; UnsharedError if none could be read (this
    host does not see the client's files)."""
    paths = bytes(names).split(SEPARATOR)
    expected = np.frombuffer(sizes, SIZE_DTYPE).tolist()
    if len(paths) != len(expected):
        raise UnsharedError(f"{len(paths)} shared paths with {len(expected)} sizes")
    files: list[bytes] = []
    failures: list[tuple[int, str]] = []
    for index, (raw, size) in enumerate(zip(paths, expected)):
        data, problem = read_file(os.fsdecode(raw), size) if raw else (b"", "")
        files.append(data)
        if problem:
            failures.append((index, problem))
    if failures and len(failures) == sum(1 for raw in paths if raw):
        raise UnsharedError(f"cannot read the shared files here: {failures[0][1]}")
    return files, failures


def read_file(path: str, size: int) -> tuple[bytes, str]:
    """A file's bytes and "", or b"" and why not: unreadable, or not the client's size."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(size + 1)
    except OSError as exc:
        return b"", f"cannot read {path} on {os.uname().nodename}: {exc.strerror or exc}"
    if len(data) != size:
        return b"", (
            f"{path} has {'more than ' if len(data) > size else ''}{len(data):,} bytes on "
            f"{os.uname().nodename}, {size:,} on the client: not the same file"
        )
    return data, ""


@dataclass
class ArrayFiles:
    """The shared `.npy` files a worker has open and checked, by place."""

    open: dict[ArrayPlace, int] = field(default_factory=dict)  # place -> file descriptor

    def read_rows(
        self, place: ArrayPlace, ranges: bytes | memoryview, item_bytes: int
    ) -> bytearray:
        """The rows of a chunk, back to back; UnsharedError if the file cannot be read here or
        is not the client's."""
        fd = self.descriptor(place)
        pairs = np.frombuffer(ranges, SIZE_DTYPE).reshape(-1, 2).tolist()
        buffer = bytearray(sum(count for _, count in pairs) * item_bytes)
        view, done = memoryview(buffer), 0
        for row, count in pairs:
            want = count * item_bytes
            got = os.preadv(fd, [view[done : done + want]], place.offset + row * item_bytes)
            if got != want:  # a regular file reads whole unless it shrank
                raise UnsharedError(f"{place.path} ends early on {os.uname().nodename}")
            done += want
        return buffer

    def descriptor(self, place: ArrayPlace) -> int:
        """An open descriptor of a checked file: size and head hash as on the client."""
        fd = self.open.pop(place, None)
        if fd is None:
            fd = self.check(place)
        self.open[place] = fd
        while len(self.open) > OPEN_ARRAYS:
            os.close(self.open.pop(next(iter(self.open))))
        return fd

    @staticmethod
    def check(place: ArrayPlace) -> int:
        host = os.uname().nodename
        try:
            fd = os.open(place.path, os.O_RDONLY)
        except OSError as exc:
            raise UnsharedError(
                f"cannot read {place.path} on {host}: {exc.strerror or exc}"
            ) from None
        try:
            size = os.fstat(fd).st_size
            head = hashlib.sha256(os.pread(fd, HEAD_BYTES, 0)).hexdigest()[:HEAD_DIGITS]
        except OSError as exc:
            os.close(fd)
            raise UnsharedError(
                f"cannot read {place.path} on {host}: {exc.strerror or exc}"
            ) from None
        if (size, head) != (place.size, place.head):
            os.close(fd)
            raise UnsharedError(
                f"{place.path} on {host} is not the client's file "
                f"({size:,} bytes{'' if size != place.size else ', other contents'})"
            )
        return fd

    def close(self) -> None:
        for fd in self.open.values():
            os.close(fd)
        self.open.clear()
