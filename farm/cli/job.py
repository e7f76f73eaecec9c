"""One job from the command line (submit, run): a progress bar, outputs written as they
arrive, the summary, and an exit status that says whether every image came back."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import click
import numpy as np

from farm import defaults
from farm.client import FarmError, FarmTimeout

if TYPE_CHECKING:
    from farm.client import Client, JobResult
    from farm.npy import NpyReader, NpyWriter

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


def run_job(link: BrokerLink, images: NpyReader, model: str, out: str | None = None,
            quiet: bool = False, trace: str | None = None,
            **job_options: Any) -> np.ndarray | None:
    """Submit with a progress bar, write outputs as they come, print the summary.

    ``job_options``: ``Client.run``'s priority, job_timeout, algo, params, backend and precision.
    Returns the outputs: in memory, or memory-mapped from ``out``.
    """
    from tqdm import tqdm

    from farm.client import ArraySink
    from farm.npy import NpyWriter

    if out and not os.access(Path(out).resolve().parent, os.W_OK):
        raise click.ClickException(f"cannot write {out}: its folder does not exist or is not "
                                   f"writable")
    writer = NpyWriter(out, len(images)) if out else None
    try:
        with link.connect() as client, \
                tqdm(total=len(images), unit="img", disable=quiet, file=sys.stderr,
                     desc=model) as bar, cancel_on_interrupt(client) as interrupted:
            result = client.run(images, model, out=writer or ArraySink(len(images)),
                                progress=bar.update, trace=trace is not None, **job_options)
    except FarmTimeout as exc:
        raise click.ClickException(f"{exc} ({NO_BROKER_HINT})") from exc
    except (FarmError, OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        if writer:
            writer.close()
    echo_result(result, writer, trace)
    exit_if_incomplete(result, len(images), bool(interrupted))
    return np.load(out, mmap_mode="r") if out else result.outputs


def echo_result(result: JobResult, writer: NpyWriter | None, trace: str | None) -> None:
    """Save the trace; say how the job went and where its outputs and trace are."""
    from farm.trace import save_trace

    if trace and result.trace is not None:
        save_trace(result.trace, trace)
    click.echo(result.summary.format())
    if result.resubmissions:
        click.echo(f"the broker was lost and the missing images submitted again "
                   f"{result.resubmissions} time(s)")
    if writer and writer.item_shape is not None:
        click.echo(f"outputs ({writer.total}, {', '.join(map(str, writer.item_shape))}) "
                   f"{writer.dtype} written to {writer.path}")
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
