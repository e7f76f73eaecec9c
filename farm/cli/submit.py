"""The client side: ``farm submit`` (a job on a farm) and ``farm status`` (the broker's
view); ``farm run`` is in ``farm.cli.run``."""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import click

from farm import defaults
from farm.cli.job import (
    NO_BROKER_HINT,
    BrokerAccess,
    gated_precision,
    load_input,
    output_spec,
    run_job,
    warn_unkept,
)
from farm.cli.options import (
    backend_option,
    client_broker_option,
    client_curve_option,
    exif_option,
    image_out_options,
    model_option,
    models_dir_option,
    precision_option,
    shared_options,
    top_k_option,
    verify_option,
)
from farm.cli.policy import policy_options, policy_params
from farm.client.answers import ModelCard
from farm.client.client import Client, FarmTimeout
from farm.wire.engines import CASCADES

if TYPE_CHECKING:
    from farm.modelrepo.repository import ModelSpec

#: ``farm status --watch`` without SECONDS: redraw this often.
WATCH_INTERVAL = 2.0


#: ``farm submit --help``.
SUBMIT_HELP = """Run IMAGES on a farm: image files, or one .npy array.

IMAGES are image files (JPEG, PNG, BMP, TIFF, WebP, GIF, PNM), folders of them
(searched recursively; other files are skipped and counted), globs, and text
files listing paths; or one .npy array (N x C x H x W or N x H x W, or N x H x
W x C for an HWC model; uint8 or float32, other numbers converted to float32
on the client).  Image
files travel encoded and the workers decode them, resized and cropped as the
model's [resize] says; a file that cannot be decoded, or a float32 image with a
NaN or infinite pixel, fails alone, with its reason.  --out answers.csv (or
.jsonl) writes each image's top classes, named, in input order; --out scores.npy
the raw outputs.

IMAGES is read a chunk at a time and outputs are written as they arrive, so
a file larger than memory runs in bounded memory.  Ctrl-C cancels the job:
the images done so far are kept (in OUT.partial, which the same command with
--resume finishes).  Exit status 1 if any image failed or the
job timed out (the failures are listed; their outputs are NaN), 130 if it
was cancelled.

--out is written as OUT.partial, renamed to OUT when the job ends with
every row written: a killed client leaves OUT.partial, never an OUT that
reads as complete, and an earlier OUT stays until the rename.  Beside it a
journal (OUT.journal) lists the rows written and their CRCs until every
image is back.  If the client is killed, the machine reboots or the disk
fills up (exit status 1, the job cancelled), the same command with --resume
submits only the images missing.  A .npy resume also retries failed images
(NaN rows); an answers file keeps its rows, failed ones with their reason,
and retries the images a stopped job (cancelled, timed out) did not get.
Without --resume an unfinished job's journal is not overwritten; a resume
with another input, model, engine, format or --top-k is refused (exit
status 2).  So is an --out that is one of the input files (links
included), and one that another job is writing (it holds OUT.lock).

\b
Examples:
  farm submit photos/ --model squeezenet --top-k 5 --out answers.csv
  farm submit 'photos/**/*.jpg' list.txt --model squeezenet    # answers on the terminal
  farm submit images.npy --model lenet --out scores.npy
  farm submit images.npy --model lenet --out scores.npy --resume   # after a crash
  farm submit images.npy --trace run.json && farm report run.json -o run.png
  farm submit urgent.npy --priority 10 --job-timeout 600
  farm submit images.npy --algo fifo --chunk 1000     # this job's own policy
  farm submit images.npy --backend openvino           # this job's own engine
  farm submit /nfs/photos/ --shared --model squeezenet  # workers read the files
  FARM_BROKER=tcp://10.0.0.1:5555 farm submit images.npy --curve keys/
"""


@click.command(help=SUBMIT_HELP)
@click.argument("images", nargs=-1, required=True)
@model_option
@client_broker_option
@image_out_options
@top_k_option
@exif_option
@verify_option
@click.option(
    "--priority",
    default=defaults.PRIORITY,
    show_default=True,
    type=click.IntRange(-100, 100),
    help="Jobs of higher priority get free workers first.",
)
@click.option(
    "--job-timeout",
    type=click.FloatRange(0, min_open=True),
    help="Seconds after which the broker cancels the job [default: none].",
)
@click.option(
    "--timeout",
    default=defaults.CLIENT_TIMEOUT,
    show_default=True,
    help="Seconds of broker silence, or with no worker connected, before giving "
    "up (a broker back within this time gets the missing images submitted "
    "again; a broker that never answered is given up after 8 s).",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Finish the killed or stopped job writing --out (.npy, .csv or .jsonl): "
    "keep the rows its journal (OUT.journal) vouches for and submit only the "
    "other images.",
)
@backend_option("Run this job on this engine instead of the workers' own.")
@precision_option(
    "Run this job in this precision instead of the workers' own; auto: the fastest whose "
    "top-1 answers agree with f32's on the validation images (the model's files needed here).",
    gated=True,
)
@shared_options
@client_curve_option
@models_dir_option(
    "Name answers with the labels of the model in this folder (repeatable); "
    "without it the broker's copy of the model names them."
)
@policy_options(per_job=True)
def submit(
    images: tuple[str, ...],
    model: str,
    broker_address: str | None,
    out: str | None,
    trace: str | None,
    quiet: bool,
    top_k: int | None,
    no_exif_rotate: bool,
    verify: float | None,
    priority: int,
    job_timeout: float | None,
    timeout: float,
    resume: bool,
    backend: str | None,
    precision: str | None,
    min_agreement: float,
    validate: tuple[str, ...],
    shared: bool,
    path_map: tuple[tuple[str, str], ...],
    curve: str | None,
    curve_name: str,
    models_dir: tuple[str, ...],
    algo: str | None,
    **options: object,
) -> None:
    """Run IMAGES on a farm (``SUBMIT_HELP``)."""
    params = job_policy(algo, options)
    access = partial(BrokerAccess, timeout=timeout, curve=curve, curve_name=curve_name)
    source = load_input(images)
    warn_unkept(source, out, top_k)
    output = output_spec(source, out, top_k, local_card(model, models_dir), resume, images)
    precision, gate_summary = gated_precision(
        precision,
        local_spec(model, models_dir) if precision in ("auto", *CASCADES) else None,
        source,
        validate,
        min_agreement,
        backend,
        exif_rotate=not no_exif_rotate,
    )
    run_job(
        access(endpoint=broker_address),
        source,
        model,
        output,
        quiet,
        trace,
        notes=(gate_summary,) if gate_summary else (),
        priority=priority,
        job_timeout=job_timeout,
        algo=algo,
        params=params,
        backend=backend,
        precision=precision,
        shared=shared,
        path_map=path_map,
        exif_rotate=not no_exif_rotate,
        verify=verify,
    )


def job_policy(algo: str | None, options: dict[str, object]) -> dict[str, object]:
    """The parameters of the job's own policy (``--algo``); UsageError for parameters
    given without it."""
    if not algo and any(value is not None for value in options.values()):
        raise click.UsageError("policy parameters need --algo (the job's own policy)")
    return policy_params(algo, options) if algo else {}


def local_spec(model: str, models_dir: tuple[str, ...]) -> ModelSpec | None:
    """The model's files on this host, if they are here (``--precision auto`` runs them)."""
    from farm.modelrepo.repository import ModelError, find

    try:
        return find(model, models_dir)
    except ModelError:
        return None


def local_card(model: str, models_dir: tuple[str, ...]) -> ModelCard | None:
    """The labels of the model in the ``--models-dir`` folders given (None: none given, ask
    the broker, whose copy runs the job)."""
    from farm.client.answers import ModelCard
    from farm.modelrepo.repository import ModelError, available, load_spec

    folder = available(models_dir).get(model) if models_dir else None
    if folder is None or folder.parent.resolve() not in {Path(d).resolve() for d in models_dir}:
        return None
    try:
        spec = load_spec(folder)
    except ModelError as exc:
        raise click.ClickException(str(exc)) from exc
    return ModelCard(spec.labels, spec.softmax)


def await_workers(client: Client, count: int, timeout: float) -> None:
    """Return once ``count`` workers have registered; ClickException (exit 1) after
    ``timeout`` seconds, naming how many have.  The request is renewed every
    ``WAIT_ROUND`` seconds (a broker forgets a request left waiting for long)."""
    deadline = time.monotonic() + timeout
    while True:
        client.timeout = max(0.1, min(WAIT_ROUND, deadline - time.monotonic()))
        try:
            client.info(wait_workers=count)
            return
        except FarmTimeout:
            if time.monotonic() >= deadline:
                break
    client.timeout = 5.0
    try:
        joined = len(client.info().get("workers", []))
    except FarmTimeout as exc:
        raise click.ClickException(f"{exc} ({NO_BROKER_HINT})") from exc
    raise click.ClickException(f"{joined} of {count} workers registered within {timeout:g} s")


#: Seconds of one request of ``farm status --wait-workers`` (below the broker's limit).
WAIT_ROUND = 60.0


@click.command()
@client_broker_option
@click.option("--json", "as_json", is_flag=True, help="The broker's snapshot as JSON, for scripts.")
@click.option(
    "--watch",
    type=click.FloatRange(0.1),
    is_flag=False,
    flag_value=WATCH_INTERVAL,
    help=f"Redraw every SECONDS ({WATCH_INTERVAL:g} if not given) until Ctrl-C.",
    metavar="[SECONDS]",
)
@click.option(
    "--timeout",
    default=5.0,
    show_default=True,
    type=click.FloatRange(0.1),
    help="Seconds to wait for the broker's answer (and for --wait-workers).",
)
@click.option(
    "--wait-workers",
    type=click.IntRange(1),
    metavar="N",
    help="First wait, up to --timeout, until N workers have registered; exit 1 "
    "if they have not (scripts starting a farm).",
)
@client_curve_option
def status(
    broker_address: str | None,
    as_json: bool,
    watch: float | None,
    timeout: float,
    wait_workers: int | None,
    curve: str | None,
    curve_name: str,
) -> None:
    """Show the farm: its workers and jobs, read from the broker over its own socket.

    Workers: name (host:pid/device), backend, state, images/s and busy share over
    the last 5 s, chunks in flight of its slots, last heartbeat, images done,
    models loaded.  Jobs, in the order they get free workers: id, client,
    model, policy, priority, state, progress, images/s, ETA, chunks in flight.

    \b
    Examples:
      farm status
      farm status --watch            # redraw every 2 s; --watch 0.5 for faster
      farm status --json | jq '.workers[] | {name, rate, busy_share}'
      farm status --wait-workers 64 --timeout 300   # until 64 workers have joined
    """
    from farm.client.status import format_status

    broker = BrokerAccess(
        endpoint=broker_address, timeout=timeout, curve=curve, curve_name=curve_name
    )
    with broker.connect() as client:
        if wait_workers:
            await_workers(client, wait_workers, timeout)
        while True:
            try:
                snapshot = client.info()
            except FarmTimeout as exc:
                raise click.ClickException(f"{exc} ({NO_BROKER_HINT})") from exc
            text = json.dumps(snapshot, indent=2) if as_json else format_status(snapshot)
            if watch is None:
                click.echo(text)
                return
            click.clear()
            click.echo(text)
            try:
                time.sleep(watch)
            except KeyboardInterrupt:
                return
