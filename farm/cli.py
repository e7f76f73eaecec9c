"""The ``farm`` command: a thin click group over the broker, workers and client."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click
import numpy as np

from farm.client import DEFAULT_BROKER, FarmError
from farm.engine import DEFAULT_BATCH

DEFAULT_MODEL = "lenet"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--log-level", default="INFO", show_default=True, envvar="FARM_LOG_LEVEL",
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              help="Logging threshold (logs go to stderr).")
def main(log_level: str) -> None:
    """farm: Caffe-model inference spread over every core of one or many machines.

    \b
    Quick start (one machine, no setup):
      farm run images.npy --model lenet
    A farm by hand:
      farm broker --algo fifo --bind tcp://127.0.0.1:5555
      farm worker --device cpu:0 --broker tcp://127.0.0.1:5555
      farm submit images.npy --model lenet --out scores.npy
    """
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s pid=%(process)d %(message)s")


def policy_options(function):
    """Options shared by every command that starts a broker."""
    function = click.option("--chunk", default=500, show_default=True, type=click.IntRange(1),
                            help="fifo: items per chunk.")(function)
    return click.option("--algo", default="fifo", show_default=True,
                        type=click.Choice(["fifo"]), help="Scheduling policy.")(function)


@main.command()
@click.option("--bind", default=DEFAULT_BROKER, show_default=True, envvar="FARM_BIND",
              help="ZeroMQ endpoint to bind; tcp://127.0.0.1:* picks a free port.")
@click.option("--heartbeat", default=1.0, show_default=True, type=click.FloatRange(0.01),
              help="Seconds between heartbeats to clients with running jobs.")
@policy_options
def broker(bind: str, heartbeat: float, algo: str, chunk: int) -> None:
    """Run the broker: the scheduler and router of a farm.

    \b
    Example:
      farm broker --algo fifo --chunk 1000 --bind tcp://127.0.0.1:5555
    """
    from farm.broker.broker import BrokerConfig, serve

    def announce(endpoint: str) -> None:
        click.echo(f"farm broker listening on {endpoint}")
        sys.stdout.flush()

    try:
        serve(BrokerConfig(bind, algo, {"chunk": chunk}, heartbeat), on_bound=announce)
    except Exception as exc:  # zmq.ZMQError on a busy address, ValueError on a bad parameter
        raise click.ClickException(str(exc)) from exc


@main.command()
@click.option("--device", default="cpu", show_default=True,
              help="cpu (all cores, all threads) or cpu:N (pinned to core N, one thread).")
@click.option("--broker", "broker_address", default=DEFAULT_BROKER, show_default=True,
              envvar="FARM_BROKER", help="Broker endpoint to connect to.")
@click.option("--model", "preload", multiple=True, help="Load this model at start (repeatable).")
@click.option("--models-dir", multiple=True, type=click.Path(file_okay=False),
              help="Extra model repository folder (repeatable; also $FARM_MODELS).")
@click.option("--batch", default=DEFAULT_BATCH, show_default=True, type=click.IntRange(1),
              help="Compute batch: chunks are run in batches of this many images.")
@click.option("--slots", default=2, show_default=True, type=click.IntRange(1),
              help="Chunks the broker may keep in flight to this worker.")
@click.option("--max-tasks", type=click.IntRange(1), help="Exit after this many chunks.")
def worker(device: str, broker_address: str, preload: tuple[str, ...],
           models_dir: tuple[str, ...], batch: int, slots: int, max_tasks: int | None) -> None:
    """Run one worker: one per pinned core, or one unpinned.

    \b
    Example:
      farm worker --device cpu:3 --broker tcp://10.0.0.1:5555 --model lenet
    """
    from farm.workers.worker import Device, WorkerConfig, serve

    try:
        config = WorkerConfig(broker_address, Device.parse(device), batch, models_dir, preload,
                              slots, max_tasks)
        serve(config)
    except (ValueError, LookupError) as exc:
        raise click.ClickException(str(exc)) from exc


def load_images(path: str) -> np.ndarray:
    """A .npy file, memory-mapped so that large inputs are not read at once."""
    try:
        return np.load(path, mmap_mode="r")  # numpy refuses object arrays by default
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot read {path}: {exc}") from exc


def run_job(endpoint: str, images: np.ndarray, model: str, out: str | None, quiet: bool,
            timeout: float) -> None:
    """Submit with a progress bar, save the outputs, print the summary."""
    from tqdm import tqdm

    from farm.client import Client, as_batch

    try:
        with Client(endpoint, timeout=timeout) as client, \
                tqdm(total=len(as_batch(images)), unit="img", disable=quiet,
                     file=sys.stderr, desc=model) as bar:
            result = client.run(images, model, progress=bar.update)
    except FarmError as exc:
        raise click.ClickException(str(exc)) from exc
    if out:
        np.save(out, result.outputs)
    click.echo(result.summary.format())
    if out:
        click.echo(f"outputs {result.outputs.shape} {result.outputs.dtype} written to {out}")


@main.command()
@click.argument("images", type=click.Path(exists=True, dir_okay=False))
@click.option("--model", default=DEFAULT_MODEL, show_default=True, help="Model to run.")
@click.option("--broker", "broker_address", default=DEFAULT_BROKER, show_default=True,
              envvar="FARM_BROKER", help="Broker endpoint.")
@click.option("--out", type=click.Path(dir_okay=False), help="Write outputs here (.npy).")
@click.option("--timeout", default=60.0, show_default=True,
              help="Seconds to wait for any reply before giving up.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def submit(images: str, model: str, broker_address: str, out: str | None, timeout: float,
           quiet: bool) -> None:
    """Run IMAGES (.npy, N x C x H x W or N x H x W; uint8 or float32) on a farm.

    \b
    Example:
      farm submit images.npy --model lenet --out scores.npy
    """
    run_job(broker_address, load_images(images), model, out, quiet, timeout)


@main.command()
@click.argument("images", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--model", default=DEFAULT_MODEL, show_default=True, help="Model to run.")
@click.option("--workers", type=click.IntRange(1),
              help="Pinned workers to start (default: one per core).")
@click.option("--out", type=click.Path(dir_okay=False), help="Write outputs here (.npy).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@policy_options
def run(images: str | None, model: str, workers: int | None, out: str | None, quiet: bool,
        algo: str, chunk: int) -> None:
    """Start a local farm (broker + one pinned worker per core), run IMAGES, stop it.

    Without IMAGES, runs the model's bundled sample.

    \b
    Example:
      farm run images.npy --model lenet --out scores.npy
    """
    from farm.local import LocalFarm, cores
    from farm.repository import ModelError, find

    if images is None:
        try:
            sample = find(model).sample
        except ModelError as exc:
            raise click.ClickException(str(exc)) from exc
        if sample is None:
            raise click.ClickException(f"model {model!r} has no bundled sample; give IMAGES")
        images = str(sample)
    available = cores()
    devices = [f"cpu:{available[i % len(available)]}" for i in range(workers or len(available))]
    array = load_images(images)
    click.echo(f"starting a local farm: broker + {len(devices)} workers ({', '.join(devices)})",
               err=True)
    try:
        with LocalFarm(devices, algo, ["--chunk", str(chunk)], preload=[model]) as local:
            run_job(local.endpoint, array, model, out, quiet, timeout=60.0)
    except FarmError as exc:
        raise click.ClickException(str(exc)) from exc


@main.group()
def models() -> None:
    """Inspect the model repository."""


@models.command("list")
@click.option("--models-dir", multiple=True, type=click.Path(file_okay=False),
              help="Extra model repository folder (repeatable).")
def list_models(models_dir: tuple[str, ...]) -> None:
    """List the models workers can run."""
    from farm.repository import ModelError, available, load_spec

    for name, folder in available(models_dir).items():
        try:
            spec = load_spec(Path(folder))
            click.echo(f"{name:<16} input {'x'.join(map(str, spec.input_shape)):<10} "
                       f"{spec.description}")
        except ModelError as exc:
            click.echo(f"{name:<16} BROKEN: {exc}")
