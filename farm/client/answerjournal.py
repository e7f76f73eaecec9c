"""A journal beside an answers file (.csv, .jsonl), so that a killed client resumes it.

Answers are written one row per image in input order, so the file is whole up
to a row: ``OUT.journal``, made with the first rows (the `.npy` journal's
header, ``farm.client.journal``, with the format and top-k), then holds one line
``rows size crc32`` each time rows are written: the file's first ``size``
bytes hold its first ``rows`` rows (after a heading, for a CSV) and their
CRC-32 is ``crc32``.  The rows go to ``OUT.partial``, renamed to ``OUT`` once
every row is written, as for `.npy` outputs.

On resume the file (``OUT.partial``, or ``OUT`` of a job that stopped early,
taken back as ``OUT.partial``) is cut at the last line whose bytes check out,
so a torn last row (a kill mid-write) or rows that never reached the disk (a
reboot) are written again, and only the images after it are submitted.  Rows
written stay, failed ones included: their reason is in the file (the same
bytes fail the same way again).  The rows of images that a stopped job
(cancelled, timed out) never got are written so that ``OUT`` is whole, but
not journaled: a resume retries them.
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from farm.client.answers import AnswerSink, CsvAnswers, JsonlAnswers, ModelCard
from farm.client.journal import (
    SYNC_INTERVAL,
    JournalHeader,
    JournalMismatch,
    JournalUnreadable,
    append,
    journal_path,
    open_for_append,
    read_lines,
)
from farm.client.npy import partial_path, publish, sync_folder

log = logging.getLogger("farm.client.answerjournal")

#: Bytes read at a time while checking an answers file against its journal.
READ_BLOCK = 1 << 20


@dataclass(frozen=True)
class RowMark:
    """A journal line: the file's first ``size`` bytes hold ``rows`` rows, CRC-32 ``crc``."""

    rows: int
    size: int
    crc: int

    def line(self) -> bytes:
        return f"{self.rows} {self.size} {self.crc}\n".encode()


def parse_marks(lines: list[bytes], total: int) -> list[RowMark]:
    """The well-formed marks among ``lines``, each further on than the one before; others
    (a torn or garbled line) are skipped."""
    marks: list[RowMark] = []
    for line in lines:
        try:
            rows, size, crc = (int(field) for field in line.split())
        except ValueError:  # not three integers
            continue
        last = marks[-1] if marks else RowMark(0, 0, 0)
        if last.rows <= rows <= total and last.size <= size and 0 <= crc < 1 << 32:
            marks.append(RowMark(rows, size, crc))
    return marks


def last_whole(path: Path, marks: list[RowMark]) -> RowMark | None:
    """The furthest mark whose bytes ``path`` holds (None: none, or no file there)."""
    good, crc, done = None, 0, 0
    try:
        with open(path, "rb") as handle:
            for mark in marks:
                while done < mark.size:
                    block = handle.read(min(READ_BLOCK, mark.size - done))
                    if not block:
                        return good  # the file ends before this mark
                    crc, done = zlib.crc32(block, crc), done + len(block)
                if crc != mark.crc:
                    return good
                good = mark
    except FileNotFoundError:
        return None
    return good


class CountedFile:
    """An answers file written as UTF-8 text, counting its bytes and their CRC-32 (what a
    journal line records); opened afresh, or cut at ``mark`` to go on from there."""

    def __init__(self, path: Path, mark: RowMark | None = None) -> None:
        self.path = path
        self.handle = open(path, "r+b" if mark else "wb")
        self.size, self.crc = (mark.size, mark.crc) if mark else (0, 0)
        if mark:
            self.handle.truncate(mark.size)
            self.handle.seek(mark.size)

    def write(self, text: str, /) -> int:
        data = text.encode("utf-8")
        self.handle.write(data)
        self.size += len(data)
        self.crc = zlib.crc32(data, self.crc)
        return len(text)

    def sync(self) -> None:
        """Hand the buffered rows to the system and fdatasync them."""
        self.handle.flush()
        os.fdatasync(self.handle.fileno())

    def close(self) -> None:
        self.handle.close()


class AnswersJournal(AnswerSink):
    """An ``AnswerSink`` writing ``out``'s rows to ``OUT.partial`` and journaling them (a
    ``farm.client.journal.Journaled`` sink for ``Client.run``).

    ``open`` resumes from ``out``'s journal when there is one for the same job; the rows
    its marks vouch for are kept (``resumed_items``).  ``Client.run`` calls ``finish``;
    call ``close`` in any case.
    """

    def __init__(
        self,
        out: str | os.PathLike[str],
        header: JournalHeader,
        card: ModelCard,
        names: Callable[[int, int], Sequence[str]],
        file: CountedFile,
        resumed: RowMark | None = None,
    ) -> None:
        k = header.top_k or 1
        writer = (
            CsvAnswers(file, card, k, heading=resumed is None)
            if header.format == "csv"
            else JsonlAnswers(file, card)
        )
        super().__init__(k, card, writer, names, next_row=resumed.rows if resumed else 0)
        self.path, self.journal = Path(out), journal_path(out)
        self.header, self.file = header, file
        self.resumed_rows = resumed.rows if resumed else 0
        self.marked = self.resumed_rows  # rows the journal vouches for
        self.journaling, self.published = True, False
        self.hold = False  # leave OUT.partial unpublished at the end: an interrupted job
        self.synced = time.monotonic()
        self.fd = open_for_append(self.journal) if resumed else -1  # new: with the first rows

    @classmethod
    def open(
        cls,
        out: str | os.PathLike[str],
        job: JournalHeader,
        card: ModelCard,
        names: Callable[[int, int], Sequence[str]],
    ) -> AnswersJournal:
        """A sink for ``job``'s answers at ``out`` (``job.format`` and ``job.top_k`` set),
        resumed from its journal if there is one (JournalMismatch if that journal is for
        another job), else started afresh (an unusable journal deleted)."""
        journal, partial = journal_path(out), partial_path(out)
        if journal.exists():
            try:
                header, lines = read_lines(journal)
            except JournalUnreadable as exc:
                log.warning("%s is unreadable (%s): starting afresh", journal, exc)
                journal.unlink()
                return cls(out, job, card, names, CountedFile(partial))
            differences = header.differences(job)
            if differences:
                raise JournalMismatch(
                    f"{journal} was written for another job, not resumed: "
                    f"{'; '.join(differences)} (delete it to start afresh)"
                )
            found = partial if partial.exists() else Path(out)
            mark = last_whole(found, parse_marks(lines, job.input.count))
            if mark is not None:
                if found != partial:  # a stopped job's answers: whole again only when done
                    os.replace(found, partial)
                return cls(out, job, card, names, CountedFile(partial, mark), mark)
            log.warning("%s holds no rows its journal vouches for: starting afresh", found)
            journal.unlink()
        return cls(out, job, card, names, CountedFile(partial))

    def resumed_items(self) -> np.ndarray:
        """The rows resumed, as a bitmap of items."""
        done = np.zeros(self.header.input.count, dtype=bool)
        done[: self.resumed_rows] = True
        return done

    def flush(self) -> None:
        """Write every row whose earlier rows are written; journal how far the file is whole."""
        before = self.next_row
        super().flush()
        if self.next_row > before and self.journaling:
            self._mark()

    def _mark(self) -> None:
        """Journal the rows written (handed to the system first; the journal is made with
        the first ones); sync every ``SYNC_INTERVAL``."""
        self.file.handle.flush()
        if self.fd < 0:
            self._start_journal()
        append(self.fd, RowMark(self.next_row, self.file.size, self.file.crc).line(), self.journal)
        self.marked = self.next_row
        if time.monotonic() - self.synced >= SYNC_INTERVAL:
            self.sync()

    def _start_journal(self) -> None:
        """Create the journal: its header, synced with the rows before it."""
        self.fd = os.open(self.journal, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        append(self.fd, self.header.line(), self.journal)
        self.sync()
        sync_folder(self.journal)

    def stop_journal(self) -> None:
        """The job stopped early: the rows written from now on are not journaled."""
        self.journaling = False

    def sync(self) -> None:
        """fdatasync the answers, then the journal: every line synced has its rows on disk."""
        self.file.sync()
        if self.fd >= 0:
            os.fdatasync(self.fd)
        self.synced = time.monotonic()

    def finish(self, complete: bool) -> None:
        """Rename ``OUT.partial`` to ``out`` once every row is written; delete the journal if
        it vouches for every row (failed images' rows included: ``complete`` is not
        needed).  Held: leave ``OUT.partial`` and its journal for a resume, unless the
        journal vouches for every row (none: nothing to keep)."""
        self.sync()
        whole = self.marked == self.header.input.count
        if self.hold and not whole:
            if self.fd < 0:
                self.file.path.unlink(missing_ok=True)
            return
        if self.next_row == self.header.input.count:
            publish(self.file.path, self.path)
            self.published = True
        if whole:
            self.journal.unlink(missing_ok=True)

    def close(self) -> None:
        super().close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @property
    def safe(self) -> int:
        """Rows journaled: kept on resume."""
        return self.marked
