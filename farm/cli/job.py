"""One job from the command line (submit, run): a progress bar, outputs written as they
arrive, the summary, and an exit status that says whether every image came back."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import click
import numpy as np

from farm import defaults
from farm.client import FarmError, FarmTimeout, ResumeRefused

if TYPE_CHECKING:
    from farm.client import Client, JobResult
    from farm.npy import NpyReader

NO_BROKER_HINT = ("is a broker running there? --broker or FARM_BROKER give its address; a "
                  "broker started with --curve needs --curve here too")


@dataclass(frozen=True, kw_only=True)
class BrokerLink:
    """How a command reaches its broker."""

    endpoint: str
    timeout: float = defaults.CLIENT_TIMEOUT  # seconds of broker silence before giving up
    curve: str | None = None
    curve_name: str = defaults.CLIENT_KEY

    def connect(self) -> Client:
        from farm.client import Client

        return Client(self.endpoint, timeout=self.timeout, curve=self.curve,
                      curve_name=self.curve_name)


def load_images(path: str) -> NpyReader:
    """A .npy file opened for reading range by range: inputs of any size, read as needed."""
    from farm.npy import NpyError, NpyReader

    try:
        return NpyReader.open(path)
    except (OSError, NpyError) as exc:
        raise click.ClickException(f"cannot read {path}: {exc}") from exc


@contextlib.contextmanager
def cancel_on_interrupt(client: Client) -> Iterator[list[bool]]:
    """The first Ctrl-C cancels the job (the broker confirms what finished); a second one
    quits at once.  Yields a list that holds True once Ctrl-C was pressed."""
    pressed: list[bool] = []

    def interrupted(*_: Any) -> None:
        if pressed:
            click.echo("\nquit without waiting for the broker", err=True)
            raise SystemExit(130)
        pressed.append(True)
        click.echo("\ncancelling the job; Ctrl-C again to quit at once", err=True)
        client.cancel()

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


class Refused(click.ClickException):
    """An error that exits with status 2: the command was refused, nothing was run."""

    exit_code = 2


def check_journal(out: str, resume: bool) -> None:
    """Refuse to overwrite an unfinished job's outputs without ``--resume``; with it and no
    journal, say that the job starts afresh."""
    from farm.journal import journal_path

    journal = journal_path(out)
    if journal.exists() and not resume:
        raise Refused(f"{journal} is there: {out} holds an unfinished job's outputs; add "
                      f"--resume to finish that job, or delete {journal} to start afresh")
    if resume and not journal.exists():
        click.echo(f"--resume: no journal at {journal}: starting afresh", err=True)


def run_job(link: BrokerLink, images: NpyReader, model: str, out: str | None = None,
            quiet: bool = False, trace: str | None = None, journal: bool = False,
            resume: bool = False, models_dir: Sequence[str] = (),
            **job_options: Any) -> np.ndarray | None:
    """Submit with a progress bar, write outputs as they come, print the summary.

    ``journal``: keep ``OUT.journal`` beside ``out`` (``farm.journal``) so that a killed
    job can be finished with ``resume``.  ``models_dir``: extra repository folders where
    the client looks the model up (``farm.repository.find_local``), for its labels.
    ``job_options``: ``Client.run``'s priority,
    job_timeout, algo, params, backend and precision.  Returns the outputs: in memory, or
    memory-mapped from ``out``.
    """
    from tqdm import tqdm

    from farm.client import ArraySink
    from farm.npy import NpyWriter

    if resume and not (out and journal):
        raise click.UsageError("--resume needs --out: the outputs of the job to resume")
    if out and not os.access(Path(out).resolve().parent, os.W_OK):
        raise click.ClickException(f"cannot write {out}: its folder does not exist or is not "
                                   f"writable")
    if out and journal:
        check_journal(out, resume)
    writer = NpyWriter(out, len(images)) if out and not journal else None
    sink: dict[str, Any] = ({"resume": out} if out and journal else
                            {"out": writer or ArraySink(len(images))})
    try:
        with link.connect() as client, \
                tqdm(total=len(images), unit="img", disable=quiet, file=sys.stderr,
                     desc=model) as bar, cancel_on_interrupt(client) as interrupted:
            result = client.run(images, model, progress=bar.update, trace=trace is not None,
                                **sink, **job_options)
    except FarmTimeout as exc:
        raise click.ClickException(f"{exc} ({NO_BROKER_HINT})") from exc
    except ResumeRefused as exc:
        raise Refused(str(exc)) from exc
    except (FarmError, OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        if writer:
            writer.close()
    outputs = result.outputs
    if outputs is None and out and Path(out).exists():
        outputs = np.load(out, mmap_mode="r")
    echo_result(result, out if outputs is not None else None, outputs, trace,
                journaled=journal)
    exit_if_incomplete(result, len(images), bool(interrupted))
    return outputs


def echo_result(result: JobResult, out: str | None, outputs: np.ndarray | None,
                trace: str | None, journaled: bool = False) -> None:
    """Save the trace; say how the job went, what came from the journal, and where its
    outputs, journal and trace are."""
    from farm.journal import journal_path
    from farm.trace import save_trace

    if trace and result.trace is not None:
        save_trace(result.trace, trace)
    if result.summary.total or not result.resumed:
        click.echo(result.summary.format())
    if result.resumed:
        click.echo(f"{result.resumed:,} images resumed from {journal_path(out or '')} "
                   f"(checked against the outputs); {result.summary.total:,} submitted")
    if result.resubmissions:
        click.echo(f"the broker was lost and the missing images submitted again "
                   f"{result.resubmissions} time(s)")
    if out and outputs is not None:
        click.echo(f"outputs {outputs.shape} {outputs.dtype} written to {out}")
    if out and journaled and journal_path(out).exists():
        click.echo(f"journal kept at {journal_path(out)}: --resume submits the images still "
                   f"missing")
    if trace and result.trace is not None:
        click.echo(f"trace of {len(result.trace.chunks)} chunks written to {trace} "
                   f"(farm report {trace} -o {Path(trace).with_suffix('.png')})")


def exit_if_incomplete(result: JobResult, total: int, interrupted: bool) -> None:
    """Exit 130 (Ctrl-C) or 1 (cancelled, timed out, failed images) when images are missing."""
    from farm.client import describe_failures

    if result.cancelled:
        missing = sum(f.count for f in result.failed)
        click.echo(f"job stopped: {result.cancelled}; {total - missing:,} of {total:,} "
                   f"images came back, the other {missing:,} have NaN outputs", err=True)
        raise SystemExit(130 if interrupted else 1)
    if result.failed:
        click.echo(describe_failures(result.failed) + "\n(their outputs are NaN)", err=True)
        raise SystemExit(1)
