"""The image files command-line arguments name, in order, and those that fail before a byte
is read.

- a folder: the image files under it (``IMAGE_SUFFIXES``), recursively, sorted by path;
- a glob (``photos/*.jpg``, ``**`` included): the matches, sorted;
- a text file (``.txt``, ``.lst``, ``.list``): one path per line, relative to the list's
  folder, in the list's order; a Caffe ImageData list's trailing `` LABEL`` is dropped;
- any other file: itself, whatever its suffix (a file that is not an image then fails
  alone, with the reason).

Every path a folder or glob yields is an input or is told of.  A broken symbolic link
(dangling, or a loop) and a folder's file of an image format the workers do not decode
(``UNSUPPORTED_FORMATS``) are inputs that fail with their reason, named in the job's
failures; so is a broken link named on the command line, unless nothing else is left to
run (then the whole input is refused, with the reason).  A folder's other files
(README.txt, .DS_Store), its links to folders (not followed) and a glob's folders are
skipped and counted in one notice per argument; a subfolder that cannot be listed is
named in a notice.  A file that cannot be read (permission) fails when its chunk is sent
(``farm.client.inputs.FileSource``), with ``unreadable``'s reason.
"""

from __future__ import annotations

import errno
import glob
import os
import stat
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from farm.defaults import DECODED_FORMATS
from farm.summary import plural

#: Suffixes of the files a folder contributes (any case).
IMAGE_SUFFIXES = frozenset(
    {
        ".jpg",
        ".jpeg",
        ".jpe",
        ".png",
        ".bmp",
        ".dib",
        ".tif",
        ".tiff",
        ".webp",
        ".gif",
        ".pgm",
        ".ppm",
        ".pbm",
        ".pnm",
    }
)
#: Image formats the workers do not decode, by suffix: a folder's file of one fails, named.
UNSUPPORTED_FORMATS = {
    ".heic": "HEIC",
    ".heif": "HEIF",
    ".avif": "AVIF",
    ".jxl": "JPEG XL",
    ".jp2": "JPEG 2000",
    ".j2k": "JPEG 2000",
    ".svg": "SVG",
    ".ico": "ICO",
    ".psd": "PSD",
    ".exr": "OpenEXR",
    ".hdr": "Radiance HDR",
    ".tga": "TGA",
    ".dng": "camera raw (DNG)",
    ".cr2": "camera raw (CR2)",
    ".nef": "camera raw (NEF)",
    ".arw": "camera raw (ARW)",
}
#: Suffixes of the text files that list image paths.
LIST_SUFFIXES = frozenset({".txt", ".lst", ".list"})
#: Kinds of skipped files a notice names before "...".
SHOWN_KINDS = 6


class InputError(ValueError):
    """The input cannot be read or names no images; the message says which and why."""


@dataclass
class FoundFiles:
    """The files arguments name, in order; why those that fail before being read fail (by
    index); one-line notices of what was skipped."""

    paths: list[Path] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)

    def add(self, path: Path, refusal: str | None = None) -> None:
        if refusal is not None:
            self.refused[len(self.paths)] = refusal
        self.paths.append(path)


def find_image_files(arguments: Sequence[str]) -> list[Path]:
    """The image files that folders, globs, lists and plain paths name, in order (those that
    will fail included: ``find_inputs`` says why)."""
    return find_inputs(arguments).paths


def find_inputs(arguments: Sequence[str]) -> FoundFiles:
    """The files folders, globs, lists and plain paths name, in order; InputError if one
    names nothing, or if no file is left that could run."""
    found = FoundFiles()
    for argument in arguments:
        path = Path(argument)
        if path.is_dir():
            add_folder(found, argument)
        elif path.is_file():
            for named in read_list(path) if path.suffix.lower() in LIST_SUFFIXES else [path]:
                found.add(named)
        elif path.is_symlink():  # is_dir and is_file follow a link: this one is broken
            found.add(path, broken_link(path))
        elif glob.has_magic(argument):
            add_matches(found, argument)
        elif path.exists():
            raise InputError(f"{argument}: not a file or folder")
        else:
            raise InputError(f"{argument}: no such file or folder")
    if found.paths and len(found.refused) == len(found.paths):
        raise InputError(nothing_to_run(found))
    return found


def add_folder(found: FoundFiles, argument: str) -> None:
    """A folder's image files, sorted by path; its broken links and unsupported images as
    failures; its other entries counted in a notice."""
    entries, unlisted = folder_entries(Path(argument))
    skipped: Counter[str] = Counter()
    folder_links = 0
    before = len(found.paths)
    for path in sorted(entries):
        try:
            mode = path.stat().st_mode  # a link's target
        except OSError as exc:
            found.add(path, unreadable(path, exc))
            continue
        suffix = path.suffix.lower()
        if stat.S_ISDIR(mode):
            folder_links += 1
        elif not stat.S_ISREG(mode):
            skipped["special files"] += 1
        elif suffix in IMAGE_SUFFIXES:
            found.add(path)
        elif suffix in UNSUPPORTED_FORMATS:
            found.add(path, unsupported(suffix))
        else:
            skipped[suffix or (path.name if path.name.startswith(".") else "no suffix")] += 1
    if len(found.paths) == before:
        raise InputError(
            f"{argument}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) "
            f"under this folder" + "".join(f"; {notice}" for notice in unlisted[:1])
        )
    found.notices += unlisted
    if skipped or folder_links:
        found.notices.append(f"{argument}: {skipped_notice(skipped, folder_links)}")


def folder_entries(folder: Path) -> tuple[list[Path], list[str]]:
    """Every entry under ``folder`` but its subfolders (links to folders included, not
    followed), and a notice for each subfolder that cannot be listed; InputError if
    ``folder`` itself cannot be."""
    entries: list[Path] = []
    errors: list[OSError] = []
    for top, folders, files in os.walk(folder, onerror=errors.append):
        entries += [Path(top, name) for name in files]
        entries += [Path(top, name) for name in folders if Path(top, name).is_symlink()]
    notices = []
    for error in errors:
        reason = unreadable(Path(error.filename or folder), error)
        if Path(error.filename or folder) == folder:
            raise InputError(f"{folder}: cannot list this folder: {reason}")
        notices.append(
            f"{error.filename}: cannot list this folder ({reason}): its files are not run"
        )
    return entries, notices


def add_matches(found: FoundFiles, pattern: str) -> None:
    """A glob's matches, sorted: its files whatever their suffix, its broken links as
    failures; the folders it matches counted in a notice."""
    folders = 0
    before = len(found.paths)
    for path in sorted(Path(p) for p in glob.glob(pattern, recursive=True)):
        if path.is_dir():
            folders += 1
        elif path.is_file():
            found.add(path)
        elif path.is_symlink():
            found.add(path, broken_link(path))
    if len(found.paths) == before:
        raise InputError(
            f"{pattern}: the pattern matches no files"
            + (f", only {plural(folders, 'folder')}" if folders else "")
        )
    if folders:
        found.notices.append(
            f"{pattern}: skipped the {plural(folders, 'folder')} it matches "
            f"(give a folder itself to run the images under it)"
        )


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


def unreadable(path: Path, error: OSError) -> str:
    """Why ``path`` cannot be read, as a job's failures say it."""
    if error.errno == errno.ELOOP:
        return "symbolic link loop"
    if error.errno == errno.ENOENT and path.is_symlink():
        return broken_link(path)
    if error.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if error.errno == errno.ENOENT:
        return "no such file"
    return f"cannot read it: {error.strerror or error}"


def broken_link(path: Path) -> str:
    """Why a symbolic link that leads to no file cannot be read."""
    try:
        path.stat()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "symbolic link loop"
    try:
        return f"dangling symbolic link to {os.readlink(path)}"
    except OSError:
        return "dangling symbolic link"


def unsupported(suffix: str) -> str:
    return (
        f"unsupported format: {UNSUPPORTED_FORMATS[suffix]} (the workers decode "
        f"{', '.join(DECODED_FORMATS[:-1])} and {DECODED_FORMATS[-1]})"
    )


def skipped_notice(kinds: Counter[str], folder_links: int) -> str:
    """ "skipped 3 files that are not images (.json, .txt) and 1 link to a folder"."""
    parts = []
    if kinds:
        count = sum(kinds.values())
        names = sorted(kinds)
        shown = ", ".join(names[:SHOWN_KINDS]) + (", ..." if len(names) > SHOWN_KINDS else "")
        what = "is not an image" if count == 1 else "are not images"
        parts.append(f"{plural(count, 'file')} that {what} ({shown})")
    if folder_links:
        where = "a folder" if folder_links == 1 else "folders"
        parts.append(f"{plural(folder_links, 'link')} to {where} (not followed)")
    return "skipped " + " and ".join(parts)


def nothing_to_run(found: FoundFiles) -> str:
    """The refusal of an input whose every file fails before it is read."""
    first = min(found.refused)
    reason = f"{found.paths[first]}: {found.refused[first]}"
    if len(found.paths) == 1:
        return reason
    return f"none of the {len(found.paths):,} files can be read (the first: {reason})"
