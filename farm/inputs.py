"""A job's input on the client: a `.npy` array, or image files named by folders, globs and
lists.

Image files are not decoded here: the client streams their encoded bytes (10-30x
smaller than the decoded float32 pixels) and the workers decode them
(``farm.images``).  ``find_image_files`` turns command-line arguments into one ordered
list of files:

- a folder: the image files under it, recursively, sorted by path;
- a glob (``photos/*.jpg``, ``**`` included): the matches, sorted;
- a text file (``.txt``, ``.lst``, ``.list``): one path per line, relative to the list's
  folder, in the list's order; a Caffe ImageData list's trailing `` LABEL`` is dropped;
- any other file: itself, whatever its suffix (a file that is not an image then fails
  alone, with the reason).
"""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from farm.npy import NpyReader
from farm.protocol import ENCODED, MAX_FILE_BYTES

#: Suffixes of the files a folder contributes (any case).
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".jpe", ".png", ".bmp", ".dib", ".tif", ".tiff",
                            ".webp", ".pgm", ".ppm", ".pbm"})
#: Suffixes of the text files that list image paths.
LIST_SUFFIXES = frozenset({".txt", ".lst", ".list"})


class InputError(ValueError):
    """The input cannot be read or names no images; the message says which and why."""


def find_image_files(arguments: Sequence[str]) -> list[Path]:
    """The image files that folders, globs, lists and plain paths name, in order."""
    files: list[Path] = []
    for argument in arguments:
        path = Path(argument)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*")
                           if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
            if not found:
                raise InputError(f"{argument}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) "
                                 f"under this folder")
            files += found
        elif path.is_file():
            files += read_list(path) if path.suffix.lower() in LIST_SUFFIXES else [path]
        elif glob.has_magic(argument):
            matches = sorted(Path(p) for p in glob.glob(argument, recursive=True)
                             if Path(p).is_file())
            if not matches:
                raise InputError(f"{argument}: the pattern matches no files")
            files += matches
        else:
            raise InputError(f"{argument}: no such file or folder")
    return files


def read_list(path: Path) -> list[Path]:
    """The paths a list file names, one per line (blank lines and ``#`` comments skipped)."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read the list {path}: {exc}") from exc
    files = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        named = path.parent / line
        head, _, label = line.rpartition(" ")
        if not named.exists() and head and label.lstrip("-").isdigit():
            named = path.parent / head.strip()  # "path label", as Caffe's ImageData lists
        files.append(named)
    if not files:
        raise InputError(f"the list {path} names no files")
    return files


def is_array_input(arguments: Sequence[str]) -> bool:
    """Whether the input is one `.npy` array rather than image files."""
    return len(arguments) == 1 and arguments[0].lower().endswith(".npy")


@dataclass
class ArraySource:
    """Images already decoded: an array, or a `.npy` file read a range at a time."""

    images: np.ndarray | NpyReader
    item_shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        shape = self.images.shape
        if len(shape) not in (3, 4):
            raise InputError(f"images must be N x C x H x W or N x H x W, got shape {shape}")
        self.item_shape = tuple(shape[1:]) if len(shape) == 4 else (1, *shape[1:])

    @property
    def dtype(self) -> str:
        return str(np.dtype(self.images.dtype))

    def __len__(self) -> int:
        return len(self.images)

    def read(self, start: int, count: int) -> np.ndarray:
        if isinstance(self.images, NpyReader):
            block = self.images.read(start, count)
        else:
            block = np.ascontiguousarray(self.images[start:start + count])
        return block.reshape(count, *self.item_shape)

    def frames(self, ranges: Sequence[tuple[int, int]]) -> list[Any]:
        """DATA's payload for these ranges of items, in order: one raw array frame."""
        blocks = [self.read(start, count) for start, count in ranges]
        return [np.ascontiguousarray(blocks[0] if len(blocks) == 1
                                     else np.concatenate(blocks)).data]

    def names(self, start: int, count: int) -> list[str]:
        """What an answers file calls each item: its index."""
        return [str(index) for index in range(start, start + count)]

    def digest(self) -> str:
        """The sha256 of the input (a `.npy` file's bytes, or an array's items)."""
        if isinstance(self.images, NpyReader):
            with open(self.images.path, "rb") as handle:
                return hashlib.file_digest(handle, "sha256").hexdigest()
        hasher = hashlib.sha256()
        per_block = max(1, (64 << 20) // max(1, self.images[:1].nbytes))
        for start in range(0, len(self.images), per_block):
            hasher.update(np.ascontiguousarray(self.images[start:start + per_block]).data)
        return hasher.hexdigest()


@dataclass
class FileSource:
    """Image files, sent encoded; read when the broker asks for their chunk.

    A file that cannot be read then (gone, unreadable, grown past ``MAX_FILE_BYTES``)
    is sent empty and its reason kept in ``problems``: the client reports that reason,
    not the worker's "empty file".
    """

    paths: list[Path]
    sizes: np.ndarray = field(init=False)
    problems: dict[int, str] = field(default_factory=dict)
    #: (the most bytes one file may have,): the largest file, within ``MAX_FILE_BYTES``
    item_shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if not self.paths:
            raise InputError("no image files to run")
        self.sizes = np.zeros(len(self.paths), dtype=np.int64)
        for index, path in enumerate(self.paths):
            try:
                self.sizes[index] = path.stat().st_size
            except OSError as exc:
                self.problems[index] = f"cannot read {path}: {exc.strerror or exc}"
        self.item_shape = (int(max(1, min(int(self.sizes.max()), MAX_FILE_BYTES))),)

    @property
    def dtype(self) -> str:
        return ENCODED

    def __len__(self) -> int:
        return len(self.paths)

    def read_file(self, index: int) -> bytes:
        """One file's bytes; b"" (and the reason in ``problems``) if it cannot be sent."""
        path, limit = self.paths[index], self.item_shape[0]
        if self.sizes[index] > MAX_FILE_BYTES:
            self.problems[index] = (f"{path} has {int(self.sizes[index]):,} bytes, more than "
                                    f"the {MAX_FILE_BYTES >> 20} MiB a file may have")
            return b""
        try:
            with open(path, "rb") as handle:
                data = handle.read(limit + 1)
        except OSError as exc:
            self.problems[index] = f"cannot read {path}: {exc.strerror or exc}"
            return b""
        if len(data) > limit:
            self.problems[index] = f"{path} grew past {limit:,} bytes after the job was submitted"
            return b""
        self.problems.pop(index, None)
        return data

    def frames(self, ranges: Sequence[tuple[int, int]]) -> list[Any]:
        """DATA's payload for these ranges of files: their sizes, then their bytes."""
        from farm.protocol import file_frames

        return file_frames([self.read_file(index) for start, count in ranges
                            for index in range(start, start + count)])

    def names(self, start: int, count: int) -> list[str]:
        return [str(path) for path in self.paths[start:start + count]]

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


def open_input(arguments: Sequence[str]) -> Source:
    """A source for command-line arguments: one `.npy` file, else image files."""
    from farm.npy import NpyError

    arrays = [argument for argument in arguments if argument.lower().endswith(".npy")]
    if arrays and len(arguments) > 1:
        raise InputError(f"a .npy array is a job of its own: give {arrays[0]} alone (image "
                         f"files, folders, globs and lists may be mixed)")
    if is_array_input(arguments):
        try:
            return ArraySource(NpyReader.open(arguments[0]))
        except (OSError, NpyError) as exc:
            raise InputError(f"cannot read {arguments[0]}: {exc}") from exc
    return FileSource(find_image_files(arguments))
