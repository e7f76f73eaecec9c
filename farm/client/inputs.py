"""A job's input on the client: a `.npy` array, or image files named by folders, globs and
lists.

Image files are not decoded here: the client streams their encoded bytes (10-30x
smaller than the decoded float32 pixels) and the workers decode them
(``farm.engines.images``).  ``farm.client.imagefiles`` turns command-line arguments into one ordered
list of files, with the reasons of those that fail before they are read.

An array travels as uint8 or float32 (``protocol.ALLOWED_DTYPES``).  Integers are
pixels, 0..255 as image files decode: an integer array of another dtype (int16, uint16,
int32...) is sent as uint8 when every value lies in 0..255, and refused otherwise, with
what to do (never rescaled here).  Other float arrays, and float32 in the other byte
order, are converted to float32; a float whose value float32 cannot hold (a finite
``abs`` over 3.4e38) is refused.  Conversions happen a chunk at a time as the broker asks
for it, ``ArraySource.notices`` says so, and refusals come before anything is submitted.
bool, complex, string, object and structured arrays are refused.
"""

from __future__ import annotations

import copy
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from farm.client.imagefiles import InputError, find_image_files, find_inputs, unreadable
from farm.client.npy import NpyError, NpyReader
from farm.wire.messages import StoredInputs
from farm.wire.protocol import ENCODED, MAX_FILE_BYTES, ProtocolError, check_array_spec, file_frames
from farm.wire.storage import stored_array, stored_files

__all__ = [
    "ArraySource",
    "FileSource",
    "InputError",
    "Source",
    "find_image_files",
    "find_inputs",
    "is_array_input",
    "open_input",
    "repeated",
    "stacked",
]

#: Items read at once when a float64 array is checked for values float32 cannot hold.
RANGE_CHECK_BYTES = 16 << 20
FLOAT32_MAX = float(np.finfo(np.float32).max)


def is_array_input(arguments: Sequence[str]) -> bool:
    """Whether the input is one `.npy` array rather than image files."""
    return len(arguments) == 1 and arguments[0].lower().endswith(".npy")


@dataclass
class ArraySource:
    """Images already decoded: an array, or a `.npy` file read a range at a time; items of
    another dtype than the wire's are converted as they are read."""

    images: np.ndarray | NpyReader
    passes: int = 1  # the items, this many times over (``farm run --repeat``)
    item_shape: tuple[int, ...] = field(init=False)
    #: What the items travel as: uint8, or native float32.
    wire: np.dtype = field(init=False)
    #: One-line notices for the user: the conversion, if any.
    notices: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        shape = self.images.shape
        if len(shape) not in (3, 4):
            raise InputError(
                f"images must be N x C x H x W, N x H x W x C (an HWC model) or N x H x W "
                f"(a 1-channel model), got shape {shape}"
            )
        if shape[0] == 0:
            raise InputError(f"{self.label}: no images (shape {shape})")
        self.item_shape = tuple(shape[1:]) if len(shape) == 4 else (1, *shape[1:])
        given = np.dtype(self.images.dtype)
        self.wire = wire_dtype(given, self.label)
        try:
            check_array_spec(self.wire.name, self.item_shape)
        except ProtocolError as exc:
            raise InputError(f"{self.label}: {exc}") from None
        if given != self.wire:
            if given.kind == "f" and given.itemsize > self.wire.itemsize:
                self.check_range()
            if given.kind in "iu":
                self.check_pixels()
                self.notices.append(
                    f"{self.label}: {describe_dtype(given)} values all within 0..255: sent "
                    f"as uint8 pixels, unchanged"
                )
                return
            native = "" if given.isnative else "native "
            self.notices.append(
                f"{self.label}: {describe_dtype(given)} converted to "
                f"{native}{self.wire.name} on the client"
            )

    @property
    def label(self) -> str:
        """What messages call the input: the `.npy` file, or "the array"."""
        return str(self.images.path) if isinstance(self.images, NpyReader) else "the array"

    @property
    def dtype(self) -> str:
        return self.wire.name

    def check_range(self) -> None:
        """InputError naming the first item with a finite value beyond float32's range (read
        a block at a time); infinities and NaN pass, as in a float32 array."""
        per_block = max(1, RANGE_CHECK_BYTES // max(1, self.item_bytes))
        for start in range(0, len(self.images), per_block):
            block = self.raw(start, min(per_block, len(self.images) - start))
            over = (np.abs(block) > FLOAT32_MAX) & np.isfinite(block)
            if over.any():
                position = np.unravel_index(int(over.argmax()), over.shape)
                raise InputError(
                    f"{self.label}: item {start + int(position[0])} holds "
                    f"{float(block[position]):.6g}, beyond float32's range "
                    f"(±{FLOAT32_MAX:.3g}): {describe_dtype(block.dtype)} cannot "
                    f"be converted to float32 without losing it; nothing was "
                    f"submitted"
                )

    def check_pixels(self) -> None:
        """InputError unless every value of an integer array lies in 0..255 (read a block
        at a time): integers are pixels, and farm does not guess another scale."""
        low, high = 0, 0
        per_block = max(1, RANGE_CHECK_BYTES // max(1, self.item_bytes))
        for start in range(0, len(self.images), per_block):
            block = self.raw(start, min(per_block, len(self.images) - start))
            low, high = min(low, int(block.min())), max(high, int(block.max()))
        if low >= 0 and high <= 255:
            return
        given = describe_dtype(np.dtype(self.images.dtype))
        raise InputError(pixel_refusal(self.label, given, low, high))

    @property
    def item_bytes(self) -> int:
        """Bytes per item as given (before any conversion)."""
        return int(np.dtype(self.images.dtype).itemsize * np.prod(self.item_shape))

    def raw(self, start: int, count: int) -> np.ndarray:
        """Items ``[start, start + count)`` as given: a fresh array from a `.npy` file, a
        view of an array; past the first pass, the items again from the first."""
        size = len(self.images)
        pieces = []
        while count:
            offset = start % size
            taken = min(count, size - offset)
            pieces.append(
                self.images.read(offset, taken)
                if isinstance(self.images, NpyReader)
                else self.images[offset : offset + taken]
            )
            start, count = start + taken, count - taken
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def __len__(self) -> int:
        return len(self.images) * self.passes

    def read(self, start: int, count: int) -> np.ndarray:
        """Items ``[start, start + count)`` as they travel: contiguous, of the wire dtype."""
        block = np.ascontiguousarray(self.raw(start, count), dtype=self.wire)
        return block.reshape(count, *self.item_shape)

    def frames(self, ranges: Sequence[tuple[int, int]]) -> list[Any]:
        """DATA's payload for these ranges of items, in order: one raw array frame."""
        blocks = [self.read(start, count) for start, count in ranges]
        return [
            np.ascontiguousarray(blocks[0] if len(blocks) == 1 else np.concatenate(blocks)).data
        ]

    def names(self, start: int, count: int) -> list[str]:
        """What an answers file calls each item: its index."""
        return [str(index) for index in range(start, start + count)]

    def digest(self) -> str:
        """The sha256 of the input (a `.npy` file's bytes, or an array's items), and the
        number of passes when there are several."""
        if self.passes > 1:
            return hashlib.sha256(f"{self.items_digest()} x{self.passes}".encode()).hexdigest()
        return self.items_digest()

    def items_digest(self) -> str:
        """The sha256 of one pass: a `.npy` file's bytes, or an array's items."""
        if isinstance(self.images, NpyReader):
            with open(self.images.path, "rb") as handle:
                return hashlib.file_digest(handle, "sha256").hexdigest()
        hasher = hashlib.sha256()
        per_block = max(1, (64 << 20) // max(1, self.images[:1].nbytes))
        for start in range(0, len(self.images), per_block):
            hasher.update(np.ascontiguousarray(self.images[start : start + per_block]).data)
        return hasher.hexdigest()


@dataclass
class FileSource:
    """Image files, sent encoded; read when the broker asks for their chunk.

    A file that cannot be read then (gone, unreadable, grown past ``MAX_FILE_BYTES``),
    or one ``refused`` when it was found (a broken link, an unsupported format), is sent
    empty and its reason kept in ``problems``: the client reports that reason, not the
    worker's "empty file".
    """

    paths: list[Path]
    sizes: np.ndarray = field(init=False)
    problems: dict[int, str] = field(default_factory=dict)
    #: Files that fail whatever happens, by index, and why: they are never read.
    refused: dict[int, str] = field(default_factory=dict)
    #: One-line notices for the user: what the folders and globs skipped.
    notices: list[str] = field(default_factory=list)
    #: (the most bytes one file may have,): the largest file, within ``MAX_FILE_BYTES``
    item_shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if not self.paths:
            raise InputError("no image files to run")
        self.sizes = np.zeros(len(self.paths), dtype=np.int64)
        self.problems.update(self.refused)
        for index, path in enumerate(self.paths):
            if index in self.refused:
                continue
            try:
                self.sizes[index] = path.stat().st_size
            except OSError as exc:
                self.problems[index] = unreadable(path, exc)
        self.item_shape = (int(max(1, min(int(self.sizes.max()), MAX_FILE_BYTES))),)

    @property
    def dtype(self) -> str:
        return ENCODED

    def __len__(self) -> int:
        return len(self.paths)

    def read_file(self, index: int) -> bytes:
        """One file's bytes; b"" (and the reason in ``problems``) if it cannot be sent."""
        path, limit = self.paths[index], self.item_shape[0]
        if index in self.refused:
            return b""
        if self.sizes[index] > MAX_FILE_BYTES:
            self.problems[index] = (
                f"{path} has {int(self.sizes[index]):,} bytes, more than "
                f"the {MAX_FILE_BYTES >> 20} MiB a file may have"
            )
            return b""
        try:
            with open(path, "rb") as handle:
                data = handle.read(limit + 1)
        except OSError as exc:
            self.problems[index] = unreadable(path, exc)
            return b""
        if len(data) > limit:
            self.problems[index] = f"{path} grew past {limit:,} bytes after the job was submitted"
            return b""
        self.problems.pop(index, None)
        return data

    def frames(self, ranges: Sequence[tuple[int, int]]) -> list[Any]:
        """DATA's payload for these ranges of files: their sizes, then their bytes."""
        return file_frames(
            [
                self.read_file(index)
                for start, count in ranges
                for index in range(start, start + count)
            ]
        )

    def names(self, start: int, count: int) -> list[str]:
        return [str(path) for path in self.paths[start : start + count]]

    def digest(self) -> str:
        """The sha256 of the file list: each path, size and modification time."""
        hasher = hashlib.sha256()
        for path, size in zip(self.paths, self.sizes.tolist()):
            try:
                mtime = path.stat().st_mtime_ns
            except OSError:
                mtime = -1
            hasher.update(f"{os.fspath(path)}\0{size}\0{mtime}\n".encode())
        return hasher.hexdigest()


Source = ArraySource | FileSource


def repeated(source: Source, passes: int) -> Source:
    """The source's items ``passes`` times over, in order: one job long enough to measure
    a farm on a small input."""
    if passes == 1:
        return source
    if isinstance(source, ArraySource):
        longer = copy.copy(source)  # not checked again: replace() would read it all again
        longer.passes = passes
        return longer
    count = len(source.paths)
    return FileSource(
        source.paths * passes,
        notices=source.notices,
        refused={
            index + count * lap: reason
            for lap in range(passes)
            for index, reason in source.refused.items()
        },
    )


def unshareable(source: Source) -> str | None:
    """Why the workers cannot read this source's items themselves (None: they can, given
    shared storage): only files can be shared, and a `.npy` file only as it travels."""
    if isinstance(source, FileSource):
        return None
    if not isinstance(source.images, NpyReader):
        return "an array in memory cannot be shared: save it as a .npy file, or send it"
    if source.wire != source.images.dtype:
        return (
            f"{source.label} is {describe_dtype(source.images.dtype)}, converted to "
            f"{source.wire.name} on the client: its bytes are sent"
        )
    return None


def stored_inputs(
    source: Source, runs: Sequence[tuple[int, int, int]], path_map: Sequence[tuple[str, str]]
) -> StoredInputs:
    """Where a submission's items lie (``runs``: its items ``job_start..`` are the source's
    ``item_start..``), for workers that read them from shared storage (``farm.wire.storage``).
    A file the client cannot send is listed without a path: it fails with the client's
    reason, as when sent."""
    if isinstance(source, FileSource):
        indices = np.concatenate(
            [np.arange(start, start + count) for _, start, count in runs]
        ).astype(np.int64)
        for index in np.flatnonzero(source.sizes[indices] > MAX_FILE_BYTES).tolist():
            source.read_file(int(indices[index]))  # records why it is not sent
        paths = [
            "" if index in source.problems else os.fspath(source.paths[index])
            for index in indices.tolist()
        ]
        return stored_files(paths, source.sizes[indices].tolist(), path_map)
    reader = source.images
    assert isinstance(reader, NpyReader)  # unshareable() said so
    return stored_array(os.fspath(reader.path), reader.offset, len(reader), runs, path_map)


def wire_dtype(given: np.dtype, label: str) -> np.dtype:
    """The dtype an array of ``given`` travels as: integers as uint8 (pixels: checked by
    ``ArraySource.check_pixels``), floats as native float32; InputError for the rest."""
    if given.kind in "iu":
        return np.dtype(np.uint8)
    if given.kind == "f":
        return np.dtype(np.float32)
    raise InputError(
        f"{label}: {describe_dtype(given)} images cannot be sent: farm takes "
        f"numbers (uint8 and float32 as they are; other integers as pixels 0..255, other "
        f"floats converted to float32)"
    )


def pixel_refusal(label: str, dtype: str, low: int, high: int) -> str:
    """Why an integer array is refused: its values, the 0..255 farm takes, and the two
    ways on (scale the pixels, or send the values as float32)."""
    values = f"values up to {high:,}" if low >= 0 else f"values from {low:,} to {high:,}"
    scale = (
        "for 16-bit pixels divide by 257 (np.round(images / 257).astype(np.uint8))"
        if low >= 0 and high <= 65535
        else "scale them to 0..255 as uint8"
    )
    return (
        f"{label} is {dtype} with {values}; integer images are pixels and the model "
        f"takes 0..255: {scale}, or, if the model takes these values as they are, save "
        f"them as float32 (images.astype(np.float32)); nothing was submitted"
    )


def stacked(images: Sequence[Any]) -> np.ndarray:
    """A list of arrays, one image each (C x H x W, H x W x C or H x W), as one N x ...
    array; InputError naming the first one that is not an array or differs from the first
    in shape or dtype."""
    first = images[0]
    for index, image in enumerate(images):
        if not isinstance(image, np.ndarray):
            raise InputError(
                f"images[{index}] is a {type(image).__name__}, images[0] an array: give a "
                f"list of arrays or a list of image files, not both"
            )
        if image.ndim not in (2, 3):
            raise InputError(
                f"images[{index}] has shape {image.shape}: a list of arrays holds one image "
                f"each (C x H x W, H x W x C or H x W); give a batch as one array "
                f"(np.concatenate a list of batches)"
            )
        if (image.shape, image.dtype) != (first.shape, first.dtype):
            raise InputError(
                f"images[{index}] is {describe_dtype(image.dtype)} {image.shape}, "
                f"images[0] {describe_dtype(first.dtype)} {first.shape}: a list of "
                f"arrays is stacked into one, so every image needs the same shape and dtype"
            )
    return np.stack(images)


def describe_dtype(dtype: np.dtype) -> str:
    """ "float64", "big-endian float32 (>f4)", "structured ([('a', '<f4')])"."""
    if dtype.fields is not None:
        return f"structured ({dtype.descr})"
    if not dtype.isnative:
        order = "big-endian" if dtype.byteorder == ">" else "little-endian"
        return f"{order} {dtype.newbyteorder('=').name} ({dtype.str})"
    return dtype.name


def open_input(arguments: Sequence[str]) -> Source:
    """A source for command-line arguments: one `.npy` file, else image files."""
    arrays = [argument for argument in arguments if argument.lower().endswith(".npy")]
    if arrays and len(arguments) > 1:
        raise InputError(
            f"a .npy array is a job of its own: give {arrays[0]} alone (image "
            f"files, folders, globs and lists may be mixed)"
        )
    if is_array_input(arguments):
        try:
            return ArraySource(NpyReader.open(arguments[0]))
        except (OSError, NpyError) as exc:
            raise InputError(f"cannot read {arguments[0]}: {exc}") from exc
    found = find_inputs(arguments)
    return FileSource(found.paths, refused=found.refused, notices=found.notices)
