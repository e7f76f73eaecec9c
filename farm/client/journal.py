"""A journal beside a job's `.npy` output, so that a killed client resumes where it was.

While the job runs its outputs go to ``OUT.partial`` (``farm.client.npy.partial_path``),
renamed to ``OUT`` when the job ends with every row written or NaN-filled: a
killed client leaves ``OUT.partial``, never an ``OUT`` that reads as complete,
and an ``OUT`` of an earlier job stays until the rename replaces it.

``OUT.journal`` is a small text file.  Its first line is a JSON header naming
the job: the input (sha256 digest, item count, dtype, item shape), the model,
the engine chosen for the job, the output format, and the output's item shape
and dtype.  Then one line ``start count crc32`` per range of outputs written,
appended (one plain write each) as results are written; both files are
fdatasync'ed every ``SYNC_INTERVAL`` seconds and at the end.

On resume every journaled range is checked against the output file's bytes
(CRC-32), so a line whose data never reached the disk (a reboot), a torn last
line (a kill mid-write, a full disk) or a damaged range costs only recomputing
those items.  Failed items are NaN-filled in the output but never journaled,
so a resume retries them: it takes ``OUT`` back as ``OUT.partial`` while it
does, so that ``OUT`` only ever exists whole.  A job that got every item back
deletes its journal.  Answers files (.csv, .jsonl) keep a journal of the same
header and their own lines (``farm.client.answerjournal``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec
import numpy as np

from farm.client.npy import NpyError, NpyReader, NpyWriter, partial_path, publish, sync_folder
from farm.wire.engines import EngineChoice

if TYPE_CHECKING:
    from farm.client.inputs import Source

log = logging.getLogger("farm.client.journal")

#: The journal format this module writes and reads.
VERSION = 1
#: Appended to the output's path to name its journal.
SUFFIX = ".journal"
#: Seconds between fdatasyncs of the output then the journal: what a reboot may lose.
SYNC_INTERVAL = 2.0


class JournalMismatch(ValueError):
    """A journal written for another job (input, model or engine): resuming is refused."""


class JournalUnreadable(ValueError):
    """A journal whose header cannot be read: not a journal, or torn before it was whole."""


def journal_path(out: str | os.PathLike[str]) -> Path:
    """The journal of output ``out``: its path with ``.journal`` appended."""
    return Path(os.fspath(out) + SUFFIX)


#: Appended to the output's path to name the file a job writing it holds locked.
LOCK_SUFFIX = ".lock"


class OutputIsInput(ValueError):
    """An output (or a file written beside it) that is one of the job's input files."""


class OutputBusy(ValueError):
    """Another job holds the output's lock: it is writing that file now (``named``: the
    lock file names its process)."""

    named: bool = False


#: Looks again, and seconds between them, at a lock held by no named process.
UNNAMED_RETRIES, UNNAMED_WAIT = 20, 0.005


def lock_path(out: str | os.PathLike[str]) -> Path:
    """The lock file of output ``out``: its path with ``.lock`` appended."""
    return Path(os.fspath(out) + LOCK_SUFFIX)


def output_files(out: str | os.PathLike[str]) -> list[Path]:
    """Every file a job writing ``out`` may write: ``out``, ``OUT.partial``, its journal,
    the journal's list of submissions, and the lock."""
    journal = journal_path(out)
    return [Path(out), partial_path(out), journal, submissions_path(journal), lock_path(out)]


def input_files(source: Source) -> Iterator[tuple[Path, os.stat_result | int]]:
    """The files a job reads, each with its stat (a `.npy` input, from its open file) or
    its size as read when the job was opened (image files)."""
    from farm.client.inputs import FileSource

    if isinstance(source, FileSource):
        yield from zip(source.paths, source.sizes.tolist())
    elif isinstance(source.images, NpyReader) and source.images.fd >= 0:
        yield source.images.path, os.fstat(source.images.fd)
    elif (mapped := memory_mapped_file(source.images)) is not None:
        yield mapped, -1  # np.load(..., mmap_mode=...): the file under the array


def memory_mapped_file(images: object) -> Path | None:
    """The file an array maps (``np.memmap``, or a view of one), if it maps one."""
    while isinstance(images, np.ndarray):
        if isinstance(images, np.memmap) and images.filename:
            return Path(images.filename)
        images = images.base
    return None


def check_not_input(
    out: str | os.PathLike[str], source: Source, others: Iterable[str | os.PathLike[str]] = ()
) -> None:
    """OutputIsInput if ``out`` or a file written beside it (``output_files``) is one of the
    job's input files (``input_files``, and ``others``: list files, say), under its own
    name or through a symbolic or hard link; nothing is written."""
    written = {}
    for path in output_files(out):
        try:
            found = path.stat()
        except OSError:  # not there: written afresh, no input's file (a link to none)
            continue
        written[(found.st_dev, found.st_ino)] = path
    if not written:
        return
    sizes = {os.stat(path).st_size for path in written.values()}
    candidates: list[tuple[Path, os.stat_result | int]] = [*input_files(source)]
    candidates += [(Path(other), -1) for other in others]
    for path, known in candidates:
        if isinstance(known, int):
            if 0 <= known and known not in sizes:  # a link has its file's size: not this one
                continue
            try:
                known = path.stat()
            except OSError:
                continue
        clash = written.get((known.st_dev, known.st_ino))
        if clash is not None:
            what = str(out) if clash == Path(out) else f"{clash} (written with {out})"
            same = os.path.abspath(clash) == os.path.abspath(path)
            input_named = "the job's input" if same else f"the same file as the job's input {path}"
            raise OutputIsInput(
                f"{what} is {input_named}: the outputs written there would destroy it; "
                f"write them to another file"
            )


@contextlib.contextmanager
def output_lock(out: str | os.PathLike[str]) -> Iterator[None]:
    """Hold ``OUT.lock`` locked (``flock``, advisory) while a job writes ``out``: a second
    job on the same output gets OutputBusy, naming the process holding it, and touches
    nothing.  The lock file holds that process's id and host; it is removed at the end (a
    killed job's stays, unlocked: the next job takes it over)."""
    path = lock_path(out)
    unnamed = 0  # refusals by a holder that names no process: a look (check_free), or a
    # job between its lock and its pid: both last microseconds, so look again
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            busy = held_by(fd, out)
            os.close(fd)
            if busy.named or unnamed >= UNNAMED_RETRIES:
                raise busy from None
            unnamed += 1
            time.sleep(UNNAMED_WAIT)
            continue
        except BaseException:
            os.close(fd)
            raise
        if same_file(fd, path):
            break
        os.close(fd)  # removed by a job that just ended (and maybe made again): again
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def check_free(out: str | os.PathLike[str]) -> None:
    """OutputBusy if another job holds ``out``'s lock now (a look: nothing stays held)."""
    try:
        fd = os.open(lock_path(out), os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise held_by(fd, out) from None
    finally:
        os.close(fd)


def held_by(fd: int, out: str | os.PathLike[str]) -> OutputBusy:
    """The error for a lock (open as ``fd``) that another job holds: its process, if the
    file names it yet."""
    holder = os.pread(fd, 200, 0).decode(errors="replace").split()
    by = f" (pid {holder[0]} on {holder[1]})" if len(holder) == 2 else ""
    busy = OutputBusy(
        f"another job{by} is writing {out} now: wait for it to end, or write the outputs "
        f"to another file"
    )
    busy.named = bool(by)
    return busy


def same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        there = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


@dataclass(frozen=True)
class InputIdentity:
    """What a journal records of a job's input: a resume must read the same."""

    digest: str  # sha256 of the .npy file's bytes, or of an array's items
    count: int
    dtype: str
    item_shape: tuple[int, ...]

    @classmethod
    def of(cls, source: Source) -> InputIdentity:
        """The identity of a job's input: an array or `.npy` file, or image files (their
        paths, sizes and modification times)."""
        return cls(source.digest(), len(source), source.dtype, tuple(source.item_shape))


@dataclass(frozen=True)
class JournalHeader:
    """A journal's first line: the job it belongs to, and the output's layout."""

    model: str
    input: InputIdentity
    engine: EngineChoice | None  # the engine the job chose; None: the workers'
    output_shape: tuple[int, ...] | None = None  # one output item's shape, once known
    output_dtype: str | None = None
    version: int = VERSION
    format: str = "npy"  # the output file's: npy, or answers as csv or jsonl
    top_k: int | None = None  # classes per answer (answers files only)
    exif_rotate: bool | None = None  # image files: turned upright by EXIF; None: arrays

    @classmethod
    def of_job(
        cls, model: str, source: Source, engine: EngineChoice | None, exif_rotate: bool
    ) -> JournalHeader:
        """The header of a job on ``source``: ``exif_rotate`` counts for image files only."""
        from farm.client.inputs import FileSource

        rotate = exif_rotate if isinstance(source, FileSource) else None
        return cls(model, InputIdentity.of(source), engine, exif_rotate=rotate)

    def line(self) -> bytes:
        document = {
            "version": self.version,
            "model": self.model,
            "input": {
                "sha256": self.input.digest,
                "count": self.input.count,
                "dtype": self.input.dtype,
                "item_shape": list(self.input.item_shape),
                "exif_rotate": self.exif_rotate,
            },
            "engine": msgspec.to_builtins(self.engine),
            "output": {
                "item_shape": list(self.output_shape or ()),
                "dtype": self.output_dtype,
                "format": self.format,
                "top_k": self.top_k,
            },
        }
        return (json.dumps(document) + "\n").encode()

    @classmethod
    def parse(cls, line: bytes) -> JournalHeader:
        """The header in a journal's first line; JournalUnreadable if it is not one."""
        try:
            document: dict[str, Any] = json.loads(line)
            source, output = document["input"], document["output"]
            engine = document["engine"]
            return cls(
                model=str(document["model"]),
                input=InputIdentity(
                    str(source["sha256"]),
                    int(source["count"]),
                    str(source["dtype"]),
                    tuple(int(n) for n in source["item_shape"]),
                ),
                engine=recorded_engine(engine),
                output_shape=tuple(int(n) for n in output["item_shape"]),
                output_dtype=output["dtype"] and str(output["dtype"]),
                version=int(document["version"]),
                format=str(output.get("format", "npy")),
                top_k=None if output.get("top_k") is None else int(output["top_k"]),
                exif_rotate=None
                if source.get("exif_rotate") is None
                else bool(source["exif_rotate"]),
            )
        except (ValueError, TypeError, KeyError, IndexError) as exc:  # msgspec's: ValueError
            raise JournalUnreadable(f"its header is not a journal header ({exc})") from exc

    def differences(self, job: JournalHeader) -> list[str]:
        """How ``job`` differs from the job this journal was written for (empty: none)."""
        mine, theirs = self.input, job.input
        checks = [
            ("journal format version", self.version, job.version),
            ("model", self.model, job.model),
            ("input item count", mine.count, theirs.count),
            ("input dtype", mine.dtype, theirs.dtype),
            ("input item shape", mine.item_shape, theirs.item_shape),
            ("input sha256", mine.digest, theirs.digest),
            ("engine", self.engine, job.engine),
            ("output format", self.format, job.format),
            ("top-k", self.top_k, job.top_k),
            ("EXIF orientation applied", self.exif_rotate, job.exif_rotate),
        ]
        return [
            f"{what}: {now!r} here, {before!r} in the journal"
            for what, before, now in checks
            if before != now
        ]


@dataclass(frozen=True)
class JournalEntry:
    """One journaled range of outputs and the CRC-32 of its bytes."""

    start: int
    count: int
    crc: int

    def line(self) -> bytes:
        return f"{self.start} {self.count} {self.crc}\n".encode()


def parse_entries(lines: list[bytes], total: int) -> list[JournalEntry]:
    """The well-formed entries among ``lines`` (each without its newline); others (a torn
    or garbled line) are skipped."""
    entries = []
    for line in lines:
        fields = line.split()
        try:
            start, count, crc = (int(field) for field in fields)
        except ValueError:  # not three integers
            continue
        if 0 <= start and 0 < count and start + count <= total and 0 <= crc < 1 << 32:
            entries.append(JournalEntry(start, count, crc))
    return entries


def crc32(values: np.ndarray) -> int:
    """The CRC-32 of an array's bytes (as they lie in the `.npy` file)."""
    return zlib.crc32(np.ascontiguousarray(values).data.cast("B"))


def read_lines(path: Path) -> tuple[JournalHeader, list[bytes]]:
    """A journal's header and its other whole lines: a last line with no newline (killed
    mid-write) is ignored.  JournalUnreadable if the header cannot be read."""
    lines = path.read_bytes().split(b"\n")
    whole = lines[:-1]  # the part after the last newline is empty, or a torn line
    if not whole:
        raise JournalUnreadable("it holds no whole header line")
    return JournalHeader.parse(whole[0]), whole[1:]


def read_journal(path: Path, total: int) -> tuple[JournalHeader, list[JournalEntry]]:
    """A `.npy` output's journal: its header and its well-formed entries."""
    header, lines = read_lines(path)
    return header, parse_entries(lines, total)


def verified(out: Path, entries: list[JournalEntry]) -> list[JournalEntry]:
    """The entries whose ranges of ``out`` hold the bytes they were journaled with."""
    reader = NpyReader.open(out)
    try:
        return [
            entry for entry in entries if crc32(reader.read(entry.start, entry.count)) == entry.crc
        ]
    finally:
        reader.close()


def append(fd: int, data: bytes, path: Path) -> None:
    """Append ``data`` to a journal opened with O_APPEND (OSError naming the journal)."""
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


def open_for_append(journal: Path) -> int:
    """A journal reopened to append to (O_APPEND); a torn last line is ended first, so that
    the next line is whole."""
    fd = os.open(journal, os.O_RDWR | os.O_APPEND)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            append(fd, b"\n", journal)
    except OSError:
        os.close(fd)
        raise
    return fd


#: Beside the journal (``OUT.journal.jobs``): the job's submissions, one JSON line each.
SUBMISSIONS_SUFFIX = ".jobs"
#: Most submissions a resumed client names (the latest).
MAX_SUBMISSIONS = 100


def submissions_path(journal: Path) -> Path:
    return Path(f"{journal}{SUBMISSIONS_SUFFIX}")


def record_submission(journal: Path, job: str, runs: list[tuple[int, int, int]]) -> None:
    """Note a submission of the job (its id, and which items its ``runs`` hold): a client
    that resumes the job names it, so that what the workers finished for it after this
    client died still counts.  Best effort: a failure costs only that recomputation."""
    try:
        with open(submissions_path(journal), "a") as handle:
            handle.write(json.dumps({"job": job, "runs": runs}) + "\n")
    except OSError as exc:
        log.debug("cannot note the submission in %s: %s", submissions_path(journal), exc)


def recorded_submissions(journal: Path) -> dict[str, list[tuple[int, int, int]]]:
    """The submissions ``record_submission`` noted, the latest ``MAX_SUBMISSIONS`` (torn or
    foreign lines skipped)."""
    try:
        lines = submissions_path(journal).read_text(errors="replace").splitlines()
    except OSError:
        return {}
    found: dict[str, list[tuple[int, int, int]]] = {}
    for line in lines[-MAX_SUBMISSIONS:]:
        try:
            entry = json.loads(line)
            found[str(entry["job"])] = [(int(a), int(b), int(c)) for a, b, c in entry["runs"]]
        except (ValueError, KeyError, TypeError):
            continue
    return found


@runtime_checkable
class Journaled(Protocol):
    """A sink that journals what it writes, so that a killed job resumes (``Client.run``
    asks it what it resumed and tells it how the job ended)."""

    path: Path  # the output, once published
    journal: Path
    published: bool  # whether the job's end renamed the partial file to ``path``
    hold: bool  # leave ``OUT.partial`` unpublished at the job's end (an interrupted job)

    def resumed_items(self) -> np.ndarray:
        """A bitmap of the items resumed from the journal (not to be asked for)."""
        ...

    def stop_journal(self) -> None:
        """The job stopped early: what is written from now on (the items that did not come
        back) is not journaled, so that a resume retries it."""
        ...

    def sync(self) -> None: ...

    def finish(self, complete: bool) -> None:
        """The job ended, every row written or filled: publish the output; delete the journal
        if ``complete``."""
        ...

    @property
    def safe(self) -> int:
        """Items journaled with their outputs: kept on resume."""
        ...


class JournalSink:
    """A ``ResultSink`` writing a job's outputs to a `.npy` file and journaling each range.

    The outputs are written to ``OUT.partial`` and renamed to ``out`` by ``finish``
    (unless ``hold`` was set: an interrupted job, left as a killed one is).  ``open``
    resumes from the output's journal when there is one for the same job; ``resumed``
    are then the entries it verified (their items need not be asked for again).
    ``nan_shape``: as ``NpyWriter``'s, for a job started afresh.  Call ``finish`` when the
    job ends and ``close`` in any case.
    """

    def __init__(
        self,
        out: str | os.PathLike[str],
        header: JournalHeader,
        writer: NpyWriter | None = None,
        resumed: list[JournalEntry] | None = None,
        nan_shape: Callable[[], tuple[int, ...] | None] | None = None,
    ) -> None:
        self.path = Path(out)
        self.partial = partial_path(out)
        self.journal = journal_path(out)
        self.header = header
        self.writer = writer or NpyWriter(self.partial, header.input.count, nan_shape)
        self.resumed = resumed or []
        self.resumed_count = int(self.resumed_items().sum())  # once: safe is asked often
        self.written = 0  # items journaled by this run
        self.published = False
        self.hold = False
        self.fd = -1
        self.synced = time.monotonic()
        if writer is not None:  # resuming: append to the journal there
            self.fd = open_for_append(self.journal)

    @classmethod
    def open(
        cls,
        out: str | os.PathLike[str],
        job: JournalHeader,
        nan_shape: Callable[[], tuple[int, ...] | None] | None = None,
    ) -> JournalSink:
        """A sink for ``job``'s outputs at ``out``, resumed from its journal if there is
        one (JournalMismatch if that journal is for another job), else started afresh."""
        journal = journal_path(out)
        if not journal.exists():
            return cls(out, job, nan_shape=nan_shape)
        try:
            header, entries = read_journal(journal, job.input.count)
        except JournalUnreadable as exc:
            log.warning("%s is unreadable (%s): starting afresh", journal, exc)
            return cls.afresh(out, job, nan_shape)
        differences = header.differences(job)
        if differences:
            raise JournalMismatch(
                f"{journal} was written for another job, not resumed: "
                f"{'; '.join(differences)} (delete it to start afresh)"
            )
        return cls._resumed(out, job, header, entries, nan_shape)

    @classmethod
    def _resumed(
        cls,
        out: str | os.PathLike[str],
        job: JournalHeader,
        header: JournalHeader,
        entries: list[JournalEntry],
        nan_shape: Callable[[], tuple[int, ...] | None] | None = None,
    ) -> JournalSink:
        """A sink resuming into ``OUT.partial`` (a killed job's), else into ``out`` (a job
        that ended with failed items: taken back as ``OUT.partial`` while they are retried):
        the journal's entries that its bytes bear out are kept; afresh if neither file is
        there or is not the journal's layout (``out`` then stays until the rename)."""
        journal, partial = journal_path(out), partial_path(out)
        found = partial if partial.exists() else Path(out)
        try:
            writer = NpyWriter.update(found, job.input.count)
        except (FileNotFoundError, NpyError) as exc:  # other errors: the caller's to fix
            log.warning("cannot resume into %s (%s): starting afresh", found, exc)
            return cls.afresh(out, job, nan_shape)
        try:
            layout = (writer.item_shape, str(writer.dtype))
            if layout != (header.output_shape, header.output_dtype):
                log.warning(
                    "%s holds items of %s %s, its journal says %s %s: starting afresh",
                    found,
                    *layout,
                    header.output_shape,
                    header.output_dtype,
                )
                writer.close()
                return cls.afresh(out, job, nan_shape)
            good = verified(found, entries)
            if len(good) < len(entries):
                log.warning(
                    "%s: %d of %d journaled ranges do not match the output's bytes: "
                    "computing them again",
                    journal,
                    len(entries) - len(good),
                    len(entries),
                )
            if found != partial:
                os.replace(found, partial)
                writer.path = partial
            return cls(out, header, writer, good)
        except BaseException:
            writer.close()
            raise

    @classmethod
    def afresh(
        cls,
        out: str | os.PathLike[str],
        job: JournalHeader,
        nan_shape: Callable[[], tuple[int, ...] | None] | None = None,
    ) -> JournalSink:
        """A sink starting afresh: an unusable journal there is deleted first."""
        journal_path(out).unlink(missing_ok=True)
        return cls(out, job, nan_shape=nan_shape)

    def resumed_items(self) -> np.ndarray:
        """A bitmap of the items the verified entries hold (a range journaled twice
        counts once)."""
        done = np.zeros(self.header.input.count, dtype=bool)
        for entry in self.resumed:
            done[entry.start : entry.start + entry.count] = True
        return done

    def write(self, start: int, values: np.ndarray) -> None:
        """Write a range of outputs, then journal it; sync both every ``SYNC_INTERVAL``."""
        self.writer.write(start, values)
        if self.fd < 0:
            self._start_journal()
        crc = crc32(values)
        append(self.fd, JournalEntry(start, len(values), crc).line(), self.journal)
        self.written += len(values)
        if time.monotonic() - self.synced >= SYNC_INTERVAL:
            self.sync()

    def _start_journal(self) -> None:
        """Create the journal, its header naming the output's layout (now known)."""
        shape, dtype = self.writer.layout()
        self.header = replace(self.header, output_shape=shape, output_dtype=str(dtype))
        self.fd = os.open(self.journal, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        append(self.fd, self.header.line(), self.journal)
        self.writer.sync()
        os.fdatasync(self.fd)
        sync_folder(self.journal)

    def fill(self, start: int, count: int, value: float) -> None:
        """Fill failed items (NaN): written, never journaled, so a resume retries them."""
        self.writer.fill(start, count, value)

    def sync(self) -> None:
        """fdatasync the output, then the journal: every line synced has its data on disk."""
        self.writer.sync()
        if self.fd >= 0:
            os.fdatasync(self.fd)
        self.synced = time.monotonic()

    def stop_journal(self) -> None:
        """Nothing to do: NaN fills are never journaled."""

    def finish(self, complete: bool) -> None:
        """Sync both files, rename ``OUT.partial`` (every row written or NaN-filled) to
        ``out``; delete the journal if ``complete`` (every item came back).  Held: leave
        ``OUT.partial`` and its journal for a resume (no journal: nothing to keep)."""
        self.sync()
        if self.hold and not complete:
            if self.fd < 0:
                self.partial.unlink(missing_ok=True)
            return
        if self.writer.fd >= 0:  # else no row was written, nor filled: no file
            publish(self.partial, self.path)
            self.writer.path, self.published = self.path, True
        if complete:
            self.journal.unlink(missing_ok=True)

    def close(self) -> None:
        self.writer.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @property
    def safe(self) -> int:
        """Items journaled with their outputs (resumed or written here): kept on resume."""
        return self.resumed_count + self.written


def recorded_engine(recorded: Any) -> EngineChoice | None:
    """A journal header's engine: the struct, or the ``[backend, precision]`` pair that
    journals written before the struct hold (their jobs resume as they were)."""
    if isinstance(recorded, list) and len(recorded) == 2:
        return EngineChoice.parse(str(recorded[0]), str(recorded[1]))
    return msgspec.convert(recorded, EngineChoice | None)
