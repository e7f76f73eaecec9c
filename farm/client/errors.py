"""What ``Client.run`` raises: the broker refused or failed the job, went silent, had no
worker, or the job's outputs were refused or could not be written."""

from __future__ import annotations

import errno
from pathlib import Path


class FarmError(RuntimeError):
    """The broker refused or failed a job; the message says why."""


class FarmTimeout(FarmError):
    """Nothing came back from the broker within the timeout."""


class NoWorker(FarmTimeout):
    """No worker was connected to the broker for the client's timeout."""


class ResumeRefused(FarmError):
    """``resume`` found a journal written for another job (input, model or engine)."""


class OutputRefused(FarmError):
    """The output file is one of the job's inputs, another job is writing it, or an
    unfinished job's journal is beside it and no resume was asked: nothing was run."""


class OutputError(FarmError):
    """Writing the outputs failed (disk full, EIO, read-only...); a job still running was
    cancelled (``cancelled``)."""

    def __init__(
        self, error: OSError, safe: int, total: int, journal: Path | None, cancelled: bool = True
    ) -> None:
        self.error, self.safe, self.total, self.journal = error, safe, total, journal
        name = errno.errorcode.get(error.errno or 0, "")
        where = error.filename or "the outputs"
        if journal is None:
            kept = f"{safe:,} of {total:,} images were written; run the job again"
        else:
            kept = (
                f"{safe:,} of {total:,} images are safely written (journal {journal}); "
                f"free space and run again with --resume (resume= in Python)"
            )
        super().__init__(
            f"cannot write {where}: {error.strerror or error}"
            f"{f' ({name})' if name else ''}"
            f"{'; the job was cancelled' if cancelled else ''}; {kept}"
        )
