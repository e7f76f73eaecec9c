"""`.npy` files read and written range by range, with ``pread``/``pwrite``.

A client streams an input larger than RAM through these: each read copies one
chunk's items into a fresh buffer and nothing stays mapped, so the process's
resident memory does not grow with the file (a memory map's pages would count
in its RSS until the kernel reclaims them).  Outputs are written where they
belong as they arrive.

The command line writes a job's outputs to ``OUT.partial`` and renames it to
``OUT`` (``publish``) once every row is written or NaN-filled, so a killed
client never leaves a file at ``OUT`` that reads as complete (the rows it never
got would read as zeros: class 0).  Why not NaN-prefill ``OUT`` instead: for a
40 GB output (10 million images x 1 000 classes float32) a NaN prefill writes
40 GB before the first result; a rename costs nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.lib import format as npy_format

#: Appended to an output's path while its job runs (``publish`` renames it).
PARTIAL = ".partial"


class NpyError(ValueError):
    """A file that is not a plain C-order .npy array."""


def partial_path(out: str | os.PathLike[str]) -> Path:
    """Where output ``out`` is written while its job runs: its path with ``.partial``."""
    return Path(os.fspath(out) + PARTIAL)


def sync_folder(path: Path) -> None:
    """fsync the folder holding ``path``, so that a reboot keeps its entry."""
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(partial: Path, out: Path) -> None:
    """Rename a finished job's ``partial`` file to ``out``, replacing an earlier file there:
    its data fdatasync'ed first and the folder after, so that ``out`` is, even after a
    reboot, the earlier file or the whole new one."""
    fd = os.open(partial, os.O_RDONLY)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)
    os.replace(partial, out)
    sync_folder(out)


def _read_exact(fd: int, size: int, offset: int, path: Path) -> bytearray:
    """``size`` bytes of ``path`` at ``offset``; NpyError if the file ends before (cut
    short since it was opened), OSError naming it if it cannot be read."""
    buffer = bytearray(size)
    view, done = memoryview(buffer), 0
    while done < size:
        try:
            count = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:  # preadv names no file
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        if count == 0:
            now = os.fstat(fd).st_size
            raise NpyError(
                f"{path} ends {offset + size - now:,} bytes early: it is {now:,} bytes "
                f"now, shorter than when the job opened it (truncated or rewritten "
                f"meanwhile); put the whole file back and run the job again"
            )
        done += count
    return buffer


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        count = os.pwrite(fd, data, offset)
        data, offset = data[count:], offset + count


@dataclass
class NpyReader:
    """A `.npy` file's header, and its items read on demand."""

    path: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    fd: int

    @classmethod
    def open(cls, path: str | Path) -> NpyReader:
        path = Path(path)
        with open(path, "rb") as handle:
            try:
                version = npy_format.read_magic(handle)
                reader = (
                    npy_format.read_array_header_1_0
                    if version == (1, 0)
                    else npy_format.read_array_header_2_0
                )
                shape, fortran_order, dtype = reader(handle)
            except ValueError as exc:
                raise NpyError(f"{path} is not a .npy file: {exc}") from exc
            offset = handle.tell()
        if fortran_order:
            raise NpyError(f"{path} is in Fortran order; save it in C order")
        if dtype.hasobject:
            raise NpyError(f"{path} holds Python objects, not numbers")
        size = offset + dtype.itemsize * int(np.prod(shape))
        if path.stat().st_size < size:
            raise NpyError(
                f"{path} is truncated: {path.stat().st_size} bytes, its header needs {size}"
            )
        return cls(path, dtype, tuple(shape), offset, os.open(path, os.O_RDONLY))

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    @property
    def item_bytes(self) -> int:
        return self.dtype.itemsize * int(np.prod(self.shape[1:]))

    def read(self, start: int, count: int) -> np.ndarray:
        """Items ``[start, start + count)`` as a new array."""
        data = _read_exact(
            self.fd, count * self.item_bytes, self.offset + start * self.item_bytes, self.path
        )
        return np.frombuffer(data, self.dtype).reshape(count, *self.shape[1:])

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


class NpyWriter:
    """A `.npy` file of ``total`` items, written in ranges as they come.

    The header is written with the first range, once the item shape is known;
    ``update`` opens a file written before (a resumed job) instead.  ``nan_shape``:
    gives one output's shape (float32), asked only for a job whose every item failed:
    ``fill`` then writes the file of NaN rows that no result came to shape.
    """

    def __init__(
        self,
        path: str | Path,
        total: int,
        nan_shape: Callable[[], tuple[int, ...] | None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.total = total
        self.nan_shape = nan_shape
        self.fd = -1
        self.offset = 0
        self.item_shape: tuple[int, ...] | None = None
        self.dtype: np.dtype | None = None

    @classmethod
    def update(cls, path: str | Path, total: int) -> NpyWriter:
        """An existing `.npy` file of ``total`` items opened for update: its ranges are
        rewritten in place, the rest kept (NpyError if it does not hold ``total`` items)."""
        reader = NpyReader.open(path)
        try:
            if len(reader.shape) < 1 or reader.shape[0] != total:
                raise NpyError(f"{path} holds shape {reader.shape}, not {total} items")
            writer = cls(path, total)
            writer.item_shape, writer.dtype = reader.shape[1:], reader.dtype
            writer.offset = reader.offset
        finally:
            reader.close()
        writer.fd = os.open(writer.path, os.O_WRONLY)
        return writer

    def _create(self, item_shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.item_shape, self.dtype = item_shape, dtype
        with open(self.path, "wb") as handle:
            npy_format.write_array_header_2_0(
                handle,
                {
                    "descr": npy_format.dtype_to_descr(dtype),
                    "fortran_order": False,
                    "shape": (self.total, *item_shape),
                },
            )
            self.offset = handle.tell()
            handle.truncate(self.offset + self.total * self.item_bytes)
        self.fd = os.open(self.path, os.O_WRONLY)

    def layout(self) -> tuple[tuple[int, ...], np.dtype]:
        """The item shape and dtype: known once the first range was written."""
        if self.item_shape is None or self.dtype is None:
            raise NpyError(f"{self.path}: no outputs written yet")
        return self.item_shape, self.dtype

    @property
    def item_bytes(self) -> int:
        shape, dtype = self.layout()
        return dtype.itemsize * int(np.prod(shape))

    def write(self, start: int, values: np.ndarray) -> None:
        if self.fd < 0:
            self._create(values.shape[1:], values.dtype)
        if values.shape[1:] != self.item_shape or values.dtype != self.dtype:
            raise NpyError(
                f"outputs of shape {values.shape[1:]} {values.dtype} do not match "
                f"earlier ones {self.item_shape} {self.dtype}"
            )
        data = np.ascontiguousarray(values).data.cast("B")
        try:
            _write_all(self.fd, data, self.offset + start * self.item_bytes)
        except OSError as exc:  # pwrite names no file: name it for the error message
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc

    def sync(self) -> None:
        """fdatasync the file (its header and every range written so far)."""
        if self.fd >= 0:
            os.fdatasync(self.fd)

    def fill(self, start: int, count: int, value: float) -> None:
        """Set items ``[start, start + count)`` to ``value`` (failed items: NaN); before any
        result, only with ``nan_shape`` (else nothing is written)."""
        if self.fd < 0:
            shape = self.nan_shape() if self.nan_shape is not None else None
            if shape is None:
                return
            self._create(shape, np.dtype(np.float32))
        shape, dtype = self.layout()
        per_block = max(1, (16 << 20) // self.item_bytes)
        for first in range(start, start + count, per_block):
            size = min(per_block, start + count - first)
            self.write(first, np.full((size, *shape), value, dtype))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
