"""The ``farm`` command: a thin click group over the broker, workers and client.

Every option can also come from an environment variable (named in its help,
else ``FARM_<COMMAND>_<OPTION>``) or a TOML file (``farm.config``), in that order
of precedence after the command line.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import click
import numpy as np

from farm.client import DEFAULT_BROKER, FarmError, FarmTimeout

DEFAULT_MODEL = "lenet"
#: ``--backend`` values: ``auto`` and ``farm.engine.BACKENDS`` (kept here so the CLI starts
#: without importing numpy's and the engines' modules; a test checks they match).
BACKEND_CHOICES = ("auto", "caffe", "opencv", "torch", "onnxruntime", "openvino")
PRECISION_CHOICES = ("f32", "f16", "bf16")
#: Commands that run for a long time and log as they go: INFO by default; others WARNING.
SERVICES = ("broker", "worker")
NO_BROKER_HINT = ("is a broker running there? --broker or FARM_BROKER give its address; a "
                  "broker started with --curve needs --curve here too")


class FarmGroup(click.Group):
    """A click group that reports a farm error as one line, not a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except FarmError as exc:
            raise click.ClickException(str(exc)) from exc


@click.group(cls=FarmGroup, context_settings={"help_option_names": ["-h", "--help"],
                                              "auto_envvar_prefix": "FARM",
                                              "max_content_width": 100})
@click.option("--config", "config_file", type=click.Path(dir_okay=False), envvar="FARM_CONFIG",
              show_envvar=True,
              help="TOML settings file [default: ./farm.toml, else ~/.config/farm/farm.toml].")
@click.option("--log-level", envvar="FARM_LOG_LEVEL", show_envvar=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              help="Logging threshold, logs on stderr [default: INFO for broker and worker, "
                   "WARNING for the rest].")
@click.option("--log-format", envvar="FARM_LOG_FORMAT",
              show_envvar=True, type=click.Choice(["text", "json"]),
              help="text for people, json (one object per line) for log shippers "
                   "[default: text].")
@click.version_option(package_name="farm")
@click.pass_context
def main(ctx: click.Context, config_file: str | None, log_level: str | None,
         log_format: str | None) -> None:
    """farm: Caffe-model inference spread over every core of one or many machines.

    \b
    Quick start (one machine, no setup):
      farm run images.npy --model lenet
    A farm by hand:
      farm broker --bind tcp://127.0.0.1:5555
      farm worker --device cpu:0 --broker tcp://127.0.0.1:5555
      farm submit images.npy --model lenet --out scores.npy --trace run.json
      farm status --watch
      farm report run.json -o run.png
    Settings: option > environment (FARM_BROKER, ...) > farm.toml (see README).
    """
    from farm.config import ConfigError, config_path, default_map, load_config
    from farm.logs import setup_logging

    path = config_path(config_file)
    settings = default_map(ctx.command, load_config(path), path) if path else {}
    ctx.default_map = settings
    for param in ctx.command.params:  # the group's own options: parsed before the file was
        if param.name in settings and ctx.params.get(param.name) is None:
            try:
                ctx.params[param.name] = param.type_cast_value(ctx, settings[param.name])
            except click.BadParameter as exc:
                raise ConfigError(f"{path}: {param.name.replace('_', '-')}: "
                                  f"{exc.message}") from exc
    level = ctx.params["log_level"] or (
        "INFO" if ctx.invoked_subcommand in SERVICES else "WARNING")
    setup_logging(level, ctx.params["log_format"] or "text")


#: Policy parameter options: (option, parameter, type, help).
POLICY_OPTIONS = (
    ("--chunk", "chunk", click.IntRange(1), "fifo: items per chunk (paper: 500-3000)."),
    ("--probe", "probe", click.IntRange(1),
     "quick, fast-split, equal-finish: probe size per worker."),
    ("--slice", "slice", click.IntRange(1), "sliced, hat: items per round (hat: the first)."),
    ("--ratio", "ratio", str,
     "fast-split: share r of what remains (0.25-0.5); static: ratios r1,r2,... by worker."),
    ("--tolerance", "tolerance", click.FloatRange(0, 1, max_open=True),
     "hat: finish times this close (fraction) end the doubling."),
    ("--fraction", "fraction", click.FloatRange(0, 1, min_open=True),
     "equal-finish: part of a worker's equal-finish share given per chunk."),
    ("--floor", "floor", click.IntRange(1),
     "Smallest chunk a policy cuts (except the last) [default: 100]."),
    ("--speed-alpha", "speed_alpha", click.FloatRange(0, 1),
     "Weight of the newest chunk in speed estimates (1: last chunk, 0: cumulative)."),
    ("--speed-window", "speed_window", click.FloatRange(0),
     "equal-finish: seconds of compute that weigh as much as all earlier speed measurements."),
)


def heartbeat_options(function):
    """``--heartbeat`` and ``--liveness``: the Paranoid Pirate link's timers."""
    function = click.option(
        "--liveness", default=5, show_default=True, type=click.IntRange(1),
        help="Heartbeats a peer may miss before it is declared gone.")(function)
    return click.option(
        "--heartbeat", default=1.0, show_default=True, type=click.FloatRange(0.01, 60),
        help="Seconds between heartbeats.")(function)


def curve_option(what: str, default_name: str | None = None):
    """``--curve DIR`` (a `farm keys` folder holding ``what``), and ``--curve-name`` for peers."""
    def decorate(function):
        if default_name:
            function = click.option(
                "--curve-name", default=default_name, show_default=True, envvar="FARM_CURVE_NAME",
                    show_envvar=True,
                help="Which key of the --curve folder to use (NAME.key_secret).")(function)
        return click.option(
            "--curve", type=click.Path(file_okay=False), envvar="FARM_CURVE", show_envvar=True,
            help=f"Encrypt and authenticate with CurveZMQ: a `farm keys` folder with {what}.",
        )(function)
    return decorate


class ItemRange(click.ParamType):
    """``A-B``: items A to B inclusive, as ``(A, B + 1)``."""

    name = "A-B"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        low, _, high = str(value).partition("-")
        if not (low.isdigit() and high.isdigit() and int(low) <= int(high)):
            self.fail(f"{value!r} is not a range A-B", param, ctx)
        return int(low), int(high) + 1


def warn_if_exposed(bind: str, curve: str | None) -> None:
    """A broker reachable from other machines without CURVE lets anyone in: say so."""
    host = bind.split("://", 1)[-1].rsplit(":", 1)[0]
    if not curve and bind.startswith("tcp://") and host not in ("127.0.0.1", "localhost", "[::1]"):
        click.echo(f"warning: {bind} is reachable from other machines and --curve is off: "
                   "anyone who can connect can submit jobs or pose as a worker", err=True)


def policy_options(function=None, *, per_job: bool = False):
    """``--algo`` and every policy parameter; unset parameters keep the policy's default.

    ``per_job``: for ``farm submit``, where no ``--algo`` means the broker's policy.
    """
    from farm.policies import POLICIES

    def decorate(function):
        for flag, name, kind, text in reversed(POLICY_OPTIONS):
            function = click.option(flag, name, type=kind, default=None, help=text)(function)
        if per_job:
            return click.option("--algo", type=click.Choice(list(POLICIES)),
                                help="A scheduling policy for this job only "
                                     "[default: the broker's].")(function)
        return click.option("--algo", default="equal-finish", show_default=True,
                            envvar="FARM_ALGO", show_envvar=True, type=click.Choice(list(POLICIES)),
                            help="Scheduling policy (see README: Scheduling).")(function)
    return decorate(function) if function else decorate


def policy_params(algo: str, options: dict) -> dict:
    """The policy parameters given on the command line, converted and checked against ``algo``."""
    from farm.policies import parameters

    params = {name: options[name] for _, name, _, _ in POLICY_OPTIONS
              if options.get(name) is not None}
    if "ratio" in params:
        try:
            ratios = tuple(float(r) for r in params["ratio"].split(","))
        except ValueError:
            raise click.BadParameter(f"not a number or list of numbers: {params['ratio']}",
                                     param_hint="--ratio") from None
        if algo != "static" and len(ratios) != 1:
            raise click.BadParameter(f"{algo} takes one ratio", param_hint="--ratio")
        params["ratio"] = ratios if algo == "static" else ratios[0]
    unknown = sorted(set(params) - set(parameters(algo)))
    if unknown:
        flags = ", ".join("--" + name.replace("_", "-") for name in unknown)
        raise click.UsageError(f"policy {algo} does not take {flags}")
    return params


def policy_arguments(params: dict) -> list[str]:
    """The same parameters as ``farm broker`` arguments (for a local farm)."""
    arguments = []
    for name, value in params.items():
        text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        arguments += ["--" + name.replace("_", "-"), text]
    return arguments


@main.command()
@click.option("--bind", default=DEFAULT_BROKER, show_default=True, envvar="FARM_BIND",
              show_envvar=True,
              help="ZeroMQ endpoint to bind; tcp://127.0.0.1:* picks a free port.")
@heartbeat_options
@click.option("--max-attempts", default=3, show_default=True, type=click.IntRange(1),
              help="Attempts at a chunk (failures, or its worker lost) before its images are "
                   "reported failed to the client.")
@curve_option("the broker's key pair and the authorized/ public keys")
@click.option("--models-dir", multiple=True, type=click.Path(file_okay=False),
              help="Model repository folder served to workers (repeatable; searched before "
                   "$FARM_MODELS and the bundled models).")
@click.option("--sharing", type=click.Choice(["fair", "fifo"]), default="fair",
              show_default=True,
              help="How jobs of equal priority share workers: fair (the job holding the fewest "
                   "chunks gets the next free slot) or fifo (the oldest job first).")
@click.option("--max-chunk-seconds", default=1.0, show_default=True,
              type=click.FloatRange(0),
              help="Cap chunks at this many seconds of compute (once speeds are known), so a "
                   "new job, a cancel or a lost worker waits about that long; 0: no cap, the "
                   "policy's chunks as they are.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), envvar="FARM_METRICS_PORT",
              show_envvar=True,
              help="Serve Prometheus metrics on this port (0: a free one) [default: off].")
@click.option("--metrics-host", default="127.0.0.1", show_default=True,
              help="Address the metrics endpoint listens on.")
@policy_options
def broker(bind: str, heartbeat: float, liveness: int, max_attempts: int, curve: str | None,
           models_dir: tuple[str, ...], sharing: str, max_chunk_seconds: float,
           metrics_port: int | None, metrics_host: str, algo: str, **options: object) -> None:
    """Run the broker: the scheduler and router of a farm.

    \b
    Examples:
      farm broker --bind tcp://127.0.0.1:5555            # equal-finish, our policy
      farm broker --algo fast-split --ratio 0.5 --probe 500
      farm broker --algo hat --slice 1000 --tolerance 0.1
      farm broker --algo static --ratio 1,1,1,3
      farm broker --metrics-port 9100                     # Prometheus: /metrics
      farm broker --curve keys/ --bind tcp://0.0.0.0:5555 # other machines, encrypted
    """
    params = policy_params(algo, options)
    from farm.broker.broker import BrokerConfig, serve

    warn_if_exposed(bind, curve)

    def announce(running) -> None:
        click.echo(f"farm broker listening on {running.endpoint}")
        if running.metrics_url:
            click.echo(f"metrics on {running.metrics_url}")
        sys.stdout.flush()

    metrics = (metrics_host, metrics_port) if metrics_port is not None else None
    try:
        serve(BrokerConfig(bind, algo, params, heartbeat, models_dir, liveness, max_attempts,
                           curve, sharing, max_chunk_seconds, metrics), on_bound=announce)
    except Exception as exc:  # zmq.ZMQError on a busy address, ValueError on a bad parameter
        raise click.ClickException(str(exc)) from exc


@main.command()
@click.option("--device", default="cpu", show_default=True,
              help="cpu (all cores, all threads), cpu:N (pinned to core N, one thread) or "
                   "gpu:N (CUDA device N, torch backend).")
@click.option("--broker", "broker_address", default=DEFAULT_BROKER, show_default=True,
              envvar="FARM_BROKER", show_envvar=True, help="Broker endpoint to connect to.")
@click.option("--backend", type=click.Choice(BACKEND_CHOICES), default="auto", show_default=True,
              help="Inference library; auto times each installed one on each model when it "
                   "loads and keeps the fastest whose outputs agree (remembered on disk).")
@click.option("--precision", type=click.Choice(PRECISION_CHOICES), default="f32",
              show_default=True,
              help="Compute precision; f16/bf16 where the engine and device offer them.")
@click.option("--model", "preload", multiple=True, help="Load this model at start (repeatable).")
@click.option("--models-dir", multiple=True, type=click.Path(file_okay=False),
              help="Local model folder used when its files match the job's (repeatable; also "
                   "$FARM_MODELS); other models are fetched from the broker.")
@click.option("--cache", "cache_dir", type=click.Path(file_okay=False), envvar="FARM_CACHE_MODELS",
              show_envvar=True,
              help="Where fetched models are kept [default: ~/.cache/farm/models].")
@click.option("--batch", type=click.IntRange(1),
              help="Compute batch: chunks run in batches of this many images "
                   "[default: the batch size in each model's prototxt].")
@click.option("--slots", default=2, show_default=True, type=click.IntRange(1),
              help="Chunks the broker may keep in flight to this worker.")
@click.option("--max-tasks", type=click.IntRange(1), help="Exit after this many chunks.")
@heartbeat_options
@curve_option("the broker's public key and this worker's secret key", "worker")
@click.option("--fail-items", hidden=True, type=ItemRange(),
              help="Fault injection for chaos tests: chunks touching items A-B fail.")
def worker(device: str, broker_address: str, backend: str, precision: str,
           preload: tuple[str, ...],
           models_dir: tuple[str, ...], cache_dir: str | None, batch: int | None, slots: int,
           max_tasks: int | None, heartbeat: float, liveness: int, curve: str | None,
           curve_name: str, fail_items: tuple[int, int] | None) -> None:
    """Run one worker: one per pinned core, one per GPU.

    \b
    Examples:
      farm worker --device cpu:3 --broker tcp://10.0.0.1:5555
      farm worker --device gpu:0 --broker tcp://10.0.0.1:5555 --batch 256
      farm worker --device cpu:1 --backend openvino --precision bf16
      farm worker --device cpu:0 --curve keys/ --curve-name rack2 --broker tcp://10.0.0.1:5555
    Under supervisord, one per core: farm deploy supervisord --help
    """
    from farm.workers.worker import Device, WorkerConfig, serve

    try:
        config = WorkerConfig(
            broker_address, Device.parse(device), batch=batch, model_dirs=models_dir,
            preload=preload, slots=slots, max_tasks=max_tasks, backend=backend,
            cache_dir=cache_dir, heartbeat=heartbeat, liveness=liveness, curve=curve,
            curve_name=curve_name, fail_items=fail_items, precision=precision)
        serve(config)
    except (ValueError, LookupError) as exc:
        raise click.ClickException(str(exc)) from exc


def load_images(path: str):
    """A .npy file opened for reading range by range: inputs of any size, read as needed."""
    from farm.npy import NpyError, NpyReader

    try:
        return NpyReader.open(path)
    except (OSError, NpyError) as exc:
        raise click.ClickException(f"cannot read {path}: {exc}") from exc


@contextlib.contextmanager
def cancel_on_interrupt(client) -> Iterator[list[bool]]:
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


def run_job(endpoint: str, images, model: str, out: str | None, quiet: bool, timeout: float,
            curve: str | None = None, curve_name: str = "client", trace: str | None = None,
            **job_options: Any) -> np.ndarray | None:
    """Submit with a progress bar, write outputs as they come, print the summary.

    ``job_options``: ``Client.run``'s priority, job_timeout, algo, params, backend and precision.
    Returns the outputs: in memory, or memory-mapped from ``out``.
    """
    from tqdm import tqdm

    from farm.client import ArraySink, Client, describe_failures
    from farm.npy import NpyWriter
    from farm.trace import save_trace

    if out and not os.access(Path(out).resolve().parent, os.W_OK):
        raise click.ClickException(f"cannot write {out}: its folder does not exist or is not "
                                   f"writable")
    sink = NpyWriter(out, len(images)) if out else ArraySink(len(images))
    try:
        with Client(endpoint, timeout=timeout, curve=curve, curve_name=curve_name) as client, \
                tqdm(total=len(images), unit="img", disable=quiet, file=sys.stderr,
                     desc=model) as bar, cancel_on_interrupt(client) as interrupted:
            result = client.run(images, model, out=sink, progress=bar.update,
                                trace=trace is not None, **job_options)
    except FarmTimeout as exc:
        raise click.ClickException(f"{exc} ({NO_BROKER_HINT})") from exc
    except (FarmError, OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        if out:
            sink.close()
    if trace:
        save_trace(result.trace, trace)
    click.echo(result.summary.format())
    if result.resubmissions:
        click.echo(f"the broker was lost and the missing images submitted again "
                   f"{result.resubmissions} time(s)")
    if out and sink.item_shape is not None:
        click.echo(f"outputs ({len(images)}, {', '.join(map(str, sink.item_shape))}) "
                   f"{sink.dtype} written to {out}")
    if trace:
        click.echo(f"trace of {len(result.trace.chunks)} chunks written to {trace} "
                   f"(farm report {trace} -o {Path(trace).with_suffix('.png')})")
    if result.cancelled:
        missing = sum(f.count for f in result.failed)
        click.echo(f"job stopped: {result.cancelled}; {len(images) - missing:,} of "
                   f"{len(images):,} images came back, the other {missing:,} have NaN outputs",
                   err=True)
        raise SystemExit(130 if interrupted else 1)
    if result.failed:
        click.echo(describe_failures(result.failed) + "\n(their outputs are NaN)", err=True)
        raise SystemExit(1)
    return np.load(out, mmap_mode="r") if out else result.outputs


def report_accuracy(outputs: np.ndarray, labels_path: Path, class_names: tuple[str, ...]) -> None:
    """Top-1 accuracy of the outputs against the sample's labels, and a few predictions."""
    labels = np.load(labels_path)
    predicted = outputs.reshape(len(outputs), -1).argmax(axis=1)
    correct = int((predicted == labels).sum())
    names = class_names or tuple(map(str, range(outputs.shape[1])))
    shown = ", ".join(names[p] for p in predicted[:10])
    click.echo(f"first predictions: {shown} ...")
    click.echo(f"accuracy on the bundled sample: {correct / len(labels):.2%} "
               f"({correct} of {len(labels)} against {labels_path.name})")


broker_option = click.option("--broker", "broker_address", default=DEFAULT_BROKER,
                             show_default=True, envvar="FARM_BROKER",
                                 show_envvar=True, help="Broker endpoint.")


@main.command()
@click.argument("images", type=click.Path(exists=True, dir_okay=False))
@click.option("--model", default=DEFAULT_MODEL, show_default=True, help="Model to run.")
@broker_option
@click.option("--out", type=click.Path(dir_okay=False), help="Write outputs here (.npy).")
@click.option("--priority", default=0, show_default=True, type=click.IntRange(-100, 100),
              help="Jobs of higher priority get free workers first.")
@click.option("--job-timeout", type=click.FloatRange(0, min_open=True),
              help="Seconds after which the broker cancels the job [default: none].")
@click.option("--trace", type=click.Path(dir_okay=False),
              help="Write every chunk's worker and timings here (JSON) for `farm report`.")
@click.option("--timeout", default=60.0, show_default=True,
              help="Seconds of broker silence before giving up (a broker back within this "
                   "time gets the missing images submitted again).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--backend", type=click.Choice(BACKEND_CHOICES),
              help="Run this job on this engine instead of the workers' own.")
@click.option("--precision", type=click.Choice(PRECISION_CHOICES),
              help="Run this job in this precision instead of the workers' own.")
@curve_option("the broker's public key and this client's secret key", "client")
@policy_options(per_job=True)
def submit(images: str, model: str, broker_address: str, out: str | None, priority: int,
           job_timeout: float | None, trace: str | None, timeout: float, quiet: bool,
           backend: str | None, precision: str | None, curve: str | None, curve_name: str,
           algo: str | None, **options: object) -> None:
    """Run IMAGES (.npy, N x C x H x W or N x H x W; uint8 or float32) on a farm.

    IMAGES is read a chunk at a time and outputs are written as they arrive, so
    a file larger than memory runs in bounded memory.  Ctrl-C cancels the job:
    the images done so far are kept.  Exit status 1 if any image failed or the
    job timed out (the failures are listed; their outputs are NaN), 130 if it
    was cancelled.

    \b
    Examples:
      farm submit images.npy --model lenet --out scores.npy
      farm submit images.npy --trace run.json && farm report run.json -o run.png
      farm submit urgent.npy --priority 10 --job-timeout 600
      farm submit images.npy --algo fifo --chunk 1000     # this job's own policy
      farm submit images.npy --backend openvino           # this job's own engine
      FARM_BROKER=tcp://10.0.0.1:5555 farm submit images.npy --curve keys/
    """
    params = policy_params(algo, options) if algo else {}
    if not algo and any(value is not None for value in options.values()):
        raise click.UsageError("policy parameters need --algo (the job's own policy)")
    run_job(broker_address, load_images(images), model, out, quiet, timeout, curve, curve_name,
            trace, priority=priority, job_timeout=job_timeout, algo=algo, params=params,
            backend=backend, precision=precision)


@main.command()
@click.argument("images", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--model", default=DEFAULT_MODEL, show_default=True, help="Model to run.")
@click.option("--workers", type=click.IntRange(1),
              help="Pinned workers to start (default: one per core).")
@click.option("--out", type=click.Path(dir_okay=False), help="Write outputs here (.npy).")
@click.option("--trace", type=click.Path(dir_okay=False),
              help="Write every chunk's worker and timings here (JSON) for `farm report`.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--backend", type=click.Choice(BACKEND_CHOICES), default="auto", show_default=True,
              help="The workers' inference library (auto: the fastest that agrees, per model).")
@click.option("--precision", type=click.Choice(PRECISION_CHOICES), default="f32",
              show_default=True, help="The workers' compute precision.")
@click.option("--batch", type=click.IntRange(1),
              help="The workers' compute batch [default: auto's choice, else the prototxt's].")
@click.option("--models-dir", multiple=True, type=click.Path(file_okay=False, exists=True),
              help="Model repository folder for the broker and workers (repeatable; also "
                   "$FARM_MODELS).")
@policy_options
def run(images: str | None, model: str, workers: int | None, out: str | None,
        trace: str | None, quiet: bool, backend: str, precision: str, batch: int | None,
        models_dir: tuple[str, ...], algo: str, **options: object) -> None:
    """Start a local farm (broker + one pinned worker per core), run IMAGES, stop it.

    Without IMAGES, runs the model's bundled sample (and scores it when the
    sample has labels).  Ctrl-C cancels the job and stops the farm.

    \b
    Examples:
      farm run                                   # LeNet on its bundled sample
      farm run images.npy --model lenet --out scores.npy
      farm run images.npy --algo fast-split --ratio 0.5 --trace run.json
      farm run images.npy --model mynet --models-dir ~/models --backend openvino
    """
    from farm.local import LocalFarm, cores
    from farm.repository import ModelError, find

    try:
        spec = find(model, models_dir)
    except ModelError as exc:
        raise click.ClickException(str(exc)) from exc
    labels = None
    if images is None:
        if spec.sample is None:
            raise click.ClickException(f"model {model!r} has no bundled sample; give IMAGES")
        images, labels = str(spec.sample), spec.sample_labels
    broker_arguments = policy_arguments(policy_params(algo, options))
    folders = [arg for folder in models_dir
               for arg in ("--models-dir", str(Path(folder).resolve()))]
    available = cores()
    devices = [f"cpu:{available[i % len(available)]}" for i in range(workers or len(available))]
    array = load_images(images)
    click.echo(f"starting a local farm: broker + {len(devices)} workers ({', '.join(devices)})",
               err=True)
    def stop(signum: int, _: Any) -> None:  # the farm's processes are stopped on the way out
        raise SystemExit(128 + signum)

    for hangup in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(hangup, stop)
    try:
        with LocalFarm(devices, algo, [*broker_arguments, *folders], [
                "--backend", backend, "--precision", precision, *folders,
                *(["--batch", str(batch)] if batch else [])], preload=[model]) as local:
            outputs = run_job(local.endpoint, array, model, out, quiet, 60.0, trace=trace)
    except FarmError as exc:
        raise click.ClickException(str(exc)) from exc
    if labels is not None:
        report_accuracy(outputs, labels, spec.labels)


@main.command()
@broker_option
@click.option("--json", "as_json", is_flag=True, help="The broker's snapshot as JSON, for scripts.")
@click.option("--watch", type=click.FloatRange(0.1), is_flag=False, flag_value=2.0,
              help="Redraw every SECONDS (2 if not given) until Ctrl-C.", metavar="[SECONDS]")
@click.option("--timeout", default=5.0, show_default=True, type=click.FloatRange(0.1),
              help="Seconds to wait for the broker's answer.")
@curve_option("the broker's public key and this client's secret key", "client")
def status(broker_address: str, as_json: bool, watch: float | None, timeout: float,
           curve: str | None, curve_name: str) -> None:
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
    """
    from farm.client import Client
    from farm.status import format_status

    with Client(broker_address, timeout=timeout, curve=curve, curve_name=curve_name) as client:
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


@main.command()
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("-o", "--out", type=click.Path(dir_okay=False),
              help="The PNG to draw [default: TRACE with .png instead of .json].")
@click.option("--width", default=1200, show_default=True, type=click.IntRange(200, 10000),
              help="Image width in pixels.")
@click.option("--height", default=800, show_default=True, type=click.IntRange(200, 10000),
              help="Image height in pixels.")
def report(trace: str, out: str | None, width: int, height: int) -> None:
    """Print a job's waste and where it went; draw its timeline and throughput.

    TRACE is the JSON that `farm submit --trace` (or `farm run --trace`) wrote.
    Waste is how far the job's speed fell below the sum of its workers'
    standalone speeds; it splits into idle time at the start, waits for the
    scheduler between chunks (barriers), messaging, and the tail.

    \b
    Examples:
      farm submit images.npy --trace run.json
      farm report run.json -o run.png
      farm report run.json --width 1800 --height 1000
    """
    from farm.report import TraceError, analyse, load_trace, plot

    try:
        document = load_trace(trace)
    except TraceError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(analyse(document).format())
    target = out or str(Path(trace).with_suffix(".png"))
    plot(document, target, width, height)
    click.echo(f"timeline and throughput drawn in {target} ({width} x {height})")



def comma_list(choices: Sequence[str]) -> Callable[[click.Context, click.Parameter, str], tuple]:
    """A click callback: a comma-separated subset of ``choices``."""
    def parse(_ctx: click.Context, _param: click.Parameter, text: str) -> tuple[str, ...]:
        items = tuple(item.strip() for item in text.split(",") if item.strip())
        unknown = [item for item in items if item not in choices]
        if unknown:
            raise click.BadParameter(f"unknown {', '.join(unknown)}; choose among "
                                     f"{', '.join(choices)}")
        return items
    return parse


@main.command()
@click.option("--out", default="farm-bench", show_default=True, type=click.Path(file_okay=False),
              help="Folder that receives the results folder (DATE-CORES-cpu|gpu).")
@click.option("--models", default="lenet,cifar10_quick", show_default=True,
              help="Comma-separated models (each needs a bundled sample).")
@click.option("--images", default=100_000, show_default=True, type=click.IntRange(1000),
              help="Images per job of the policy sweep and the peers.")
@click.option("--repeat", default=1, show_default=True, type=click.IntRange(1),
              help="Rounds of the policy sweep; each figure is the median.")
@click.option("--setups", default="cores,mixed,gpu", show_default=True,
              callback=comma_list(("cores", "mixed", "gpu")),
              help="Farms to build: cores (one worker per core on auto), mixed (OpenCV and "
                   "torch on alternate cores), gpu (cores plus one worker per GPU); those this "
                   "machine cannot build are skipped and named.")
@click.option("--peers", "peer_names",
              default="opencv-threads,process-pool,ray-data,onnxruntime-threads,"
                      "openvino-throughput", show_default=True,
              callback=comma_list(("opencv-threads", "process-pool", "ray-data",
                                   "onnxruntime-threads", "openvino-throughput")),
              help="Peers to run beside the farm ('' for none); ray-data needs ray[data].")
@click.option("--peer-rounds", default=3, show_default=True, type=click.IntRange(1),
              help="Rounds of farm's best policy and every peer run in turn (medians).")
@click.option("--quick", is_flag=True,
              help="One parameter value per policy and three Table 2 sizes (a smoke run).")
@click.option("--render", type=click.Path(file_okay=False, exists=True),
              help="Measure nothing: write the report and figures again from the CSV "
                   "tables of this results folder.")
def bench(out: str, models: str, images: int, repeat: int, setups: tuple[str, ...],
          peer_names: tuple[str, ...], peer_rounds: int, quick: bool,
          render: str | None) -> None:
    """The paper's experiments on this machine, and farm beside what users pick instead.

    Writes CSV tables, PNG figures and report.md: Table 2 per device kind,
    every policy at the paper's parameter values (Figures 3/4, Tables 4/5),
    waste per policy against the standalone speeds measured in the same run
    (Figure 5), and farm's best policy against one OpenCV, ONNX Runtime or
    OpenVINO process on every core, a multiprocessing pool and Ray Data.  Run
    it on an otherwise idle machine: every figure is a throughput.

    \b
    Examples:
      farm bench                                  # the full suite (about an hour on 2 cores)
      farm bench --quick --images 5000            # a smoke run, a minute or two
      farm bench --models lenet --setups cores --peers opencv-threads --repeat 3
      farm bench --render farm-bench/2026-11-23-2cores-cpu   # report again from its CSV
    """
    from farm.bench.results import read_folder, write_folder
    from farm.bench.suite import SuiteConfig, run_suite
    from farm.repository import ModelError, find

    if render:
        try:
            write_folder(Path(render), read_folder(Path(render)))
        except (OSError, KeyError, ValueError) as exc:
            raise click.ClickException(f"{render} is not a complete farm bench results "
                                       f"folder: {type(exc).__name__}: {exc}") from None
        click.echo(f"report and figures written again in {render}")
        return

    names = tuple(name.strip() for name in models.split(",") if name.strip())
    try:
        for name in names:
            if find(name).sample is None:
                raise click.BadParameter(f"model {name!r} has no bundled sample",
                                         param_hint="--models")
    except ModelError as exc:
        raise click.BadParameter(str(exc), param_hint="--models") from None
    config = SuiteConfig(Path(out), names, images, repeat, setups, peer_names, quick,
                         standalone_images=min(images, 30_000),
                         table2_images=min(images, 10_000), tune_images=min(images, 10_000),
                         peer_rounds=peer_rounds)
    command = "farm bench " + " ".join(shlex.quote(arg) for arg in sys.argv[2:])
    folder = run_suite(config, command, lambda line: click.echo(line, err=True))
    click.echo(f"results in {folder}: report.md, CSV tables, PNG figures")


@main.group()
def keys() -> None:
    """CurveZMQ keys for --curve: who may connect to a broker.

    \b
    Examples:
      farm keys init keys/                 # broker, worker and client key pairs
      farm keys add keys/ rack2            # one more worker or client key
      farm broker --curve keys/ --bind tcp://0.0.0.0:5555
      farm worker --curve keys/ --broker tcp://10.0.0.1:5555
      farm submit images.npy --curve keys/ --broker tcp://10.0.0.1:5555
    A worker or client host needs only keys/broker.key and its own NAME.key_secret.
    """


@keys.command("init")
@click.argument("folder", type=click.Path(file_okay=False))
def keys_init(folder: str) -> None:
    """Make FOLDER's broker key pair and the worker and client key pairs (authorized).

    \b
    Example:
      farm keys init /etc/farm/keys
    Copy broker.key and worker.key_secret to worker hosts, broker.key and
    client.key_secret to client hosts; the rest stays on the broker host.
    """
    from farm.keys import KeysError, init_keys

    try:
        made = init_keys(Path(folder))
    except (KeysError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    for path in made:
        click.echo(f"wrote {path}")


@keys.command("add")
@click.argument("folder", type=click.Path(file_okay=False, exists=True))
@click.argument("name")
def keys_add(folder: str, name: str) -> None:
    """A new key pair NAME in FOLDER, its public key authorized (restart the broker to use it).

    \b
    Example:
      farm keys add /etc/farm/keys rack2
      farm worker --curve keys/ --curve-name rack2 --broker tcp://10.0.0.1:5555
    """
    from farm.keys import KeysError, add_key

    try:
        made = add_key(Path(folder), name)
    except (KeysError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    for path in made:
        click.echo(f"wrote {path}")
    click.echo(f"on the {name} host: --curve DIR --curve-name {name}, with DIR holding "
               f"broker.key and {name}.key_secret")


@keys.command("list")
@click.argument("folder", type=click.Path(file_okay=False, exists=True))
def keys_list(folder: str) -> None:
    """The public keys the broker of FOLDER lets in.

    \b
    Example:
      farm keys list /etc/farm/keys
    """
    from farm.keys import authorized_keys

    for path in authorized_keys(Path(folder)):
        click.echo(path.stem)


@main.group()
def models() -> None:
    """Inspect, check and prepare the model repository.

    \b
    Examples:
      farm models list
      farm models show caffenet
      farm models check lenet
      farm models export lenet --onnx lenet.onnx
      farm models prepare caffenet
    """


models_dir_option = click.option(
    "--models-dir", multiple=True, type=click.Path(file_okay=False),
    help="Extra model repository folder (repeatable; also $FARM_MODELS).")


def find_model(name: str, models_dir: tuple[str, ...]):
    from farm.repository import ModelError, find

    try:
        return find(name, models_dir)
    except ModelError as exc:
        raise click.ClickException(str(exc)) from exc


def shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


@models.command("list")
@models_dir_option
def list_models(models_dir: tuple[str, ...]) -> None:
    """List the models in the repository.

    \b
    Examples:
      farm models list
      farm models list --models-dir ~/models     # or FARM_MODELS=~/models
    """
    from farm.repository import ModelError, available, load_spec

    click.echo(f"{'model':<16} {'images':<12} {'layout':<6} {'weights':<22} description")
    for name, folder in available(models_dir).items():
        try:
            spec = load_spec(Path(folder))
        except ModelError as exc:
            click.echo(f"{name:<16} BROKEN: {exc}")
            continue
        weights = (f"{spec.weights.stat().st_size / 1e6:.1f} MB" if spec.weights.is_file()
                   else "made on first use")
        click.echo(f"{name:<16} {shape_text(spec.item_shape):<12} "
                   f"{spec.preprocess.layout:<6} {weights:<22} {spec.description}")


@models.command("show")
@click.argument("name")
@models_dir_option
def show_model(name: str, models_dir: tuple[str, ...]) -> None:
    """Show a model's files, input, preprocessing and layers.

    \b
    Example:
      farm models show lenet
    """
    from farm.caffe_proto import unknown_fields
    from farm.caffe_net import Network

    spec = find_model(name, models_dir)
    net = Network.load(spec.prototxt)
    p = spec.preprocess
    click.echo(f"{spec.name}: {spec.description}")
    click.echo(f"  folder      {spec.folder}")
    click.echo(f"  prototxt    {spec.prototxt.name}")
    weights = (f"{spec.weights} ({spec.weights.stat().st_size / 1e6:.1f} MB)"
               if spec.weights.is_file() else
               f"{spec.weights} (not made yet: farm models prepare {spec.name})")
    click.echo(f"  weights     {weights}")
    click.echo(f"  input       {spec.input} {shape_text(net.input_shape)} (batch {spec.batch}); "
               f"images {shape_text(spec.item_shape)} ({p.layout})")
    mean = (f"file {p.mean_file.name}" if p.mean_file else
            ", ".join(map(str, p.mean)) if p.mean else "none")
    click.echo(f"  preprocess  channel_swap {list(p.channel_swap) or 'none'}, raw_scale "
               f"{p.raw_scale:g}, mean {mean}, input_scale {p.input_scale:g}")
    click.echo(f"  output      {spec.output} {shape_text(net.shapes[spec.output][1:])}"
               f"{f', {len(spec.labels)} labels' if spec.labels else ''}")
    click.echo(f"  parameters  {net.parameter_count():,}")
    ignored = unknown_fields(spec.prototxt.read_text())
    if ignored:
        click.echo(f"  ignored     {', '.join(ignored)} (fields farm's Caffe schema lacks)")
    click.echo(f"  {'layer':<14} {'type':<13} {'output':<16} weights")
    for layer in net.layers:
        blobs = ", ".join(shape_text(shape) for shape in layer.blob_shapes)
        click.echo(f"  {layer.name:<14} {layer.type:<13} "
                   f"{shape_text(net.shapes[layer.tops[0]][1:]):<16} {blobs}")


@models.command("check")
@click.argument("name")
@click.option("--count", default=8, show_default=True, type=click.IntRange(1),
              help="Images to compare (the model's sample, else seeded random images).")
@click.option("--precision", type=click.Choice(PRECISION_CHOICES), default="f32",
              show_default=True,
              help="Compare this precision with the reference in f32 (top-1 agreement too).")
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True,
              help="Compute threads, for the speeds and auto's choice (1: a pinned worker).")
@models_dir_option
def check_model_command(name: str, count: int, precision: str, threads: int,
                        models_dir: tuple[str, ...]) -> None:
    """Load NAME on every backend here, compare their outputs, and show auto's choice.

    Differences are relative to the largest output of the reference (the first
    backend that runs the model, in f32).

    \b
    Examples:
      farm models check lenet
      farm models check caffenet --count 2
      farm models check cifar10_quick --precision bf16
    """
    from farm.autoselect import choose
    from farm.modelcheck import check_inputs, check_model
    from farm.repository import ModelError

    spec = find_model(name, models_dir)
    inputs = check_inputs(spec, count)
    checks = check_model(spec, inputs, threads=threads, precision=precision)
    click.echo(f"{spec.name}: {len(inputs)} images {shape_text(inputs.shape[1:])} "
               f"{inputs.dtype}; outputs must agree within {checks[-1].tolerance:g} of the "
               f"reference's largest output")
    for check in checks:
        if check.skipped:
            click.echo(f"  {check.backend:<11} skipped: {check.problem.split(' (')[0]}")
        elif check.problem:
            click.echo(f"  {check.backend:<11} FAILED: {check.problem}")
        else:
            verdict = "ok" if check.ok else "DIFFERS"
            click.echo(f"  {check.backend:<11} {verdict:<7} difference {check.difference:.1e}, "
                       f"top-1 agrees {check.top1_agreement:.0%}, "
                       f"{len(inputs) / check.seconds:,.0f} images/s")
    try:
        choice = choose(spec, "cpu", threads, precision)
        click.echo(f"auto on {threads} thread(s): {choice.describe()}")
    except ModelError as exc:
        click.echo(f"auto: {exc}")
    if not all(check.ok for check in checks):
        raise click.ClickException(f"model {spec.name!r} failed its check")


@models.command("export")
@click.argument("name")
@click.option("--onnx", "onnx_path", required=True, type=click.Path(dir_okay=False),
              help="Write the ONNX graph here.")
@click.option("--count", default=8, show_default=True, type=click.IntRange(1),
              help="Images to compare with the reference backend.")
@models_dir_option
def export_model(name: str, onnx_path: str, count: int, models_dir: tuple[str, ...]) -> None:
    """Write NAME as a checked ONNX file: onnx.checker passes it, and ONNX Runtime's outputs
    on it are compared with the reference backend's.

    The graph has a free batch dimension, ends at the model's output blob and
    computes Caffe's semantics (pooling rounding, LRN, BatchNorm's scale factor);
    preprocessing (model.toml) stays outside it.

    \b
    Examples:
      farm models export caffenet --onnx caffenet.onnx
      farm models export mynet --models-dir ~/models --onnx mynet.onnx
    """
    from farm.modelcheck import check_inputs, export_checked
    from farm.repository import ModelError

    spec = find_model(name, models_dir)
    try:
        result = export_checked(spec, Path(onnx_path), check_inputs(spec, count))
    except (ModelError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{spec.name}: {onnx_path} ({result.size / 1e6:.1f} MB, opset {result.opset}, "
               f"input {result.input} N x {shape_text(spec.input_shape)}, output "
               f"{result.output}); onnx.checker passed")
    click.echo(f"  ONNX Runtime against {result.reference}: difference {result.difference:.1e} "
               f"of the largest output on {count} images")
    if not result.ok:
        raise click.ClickException(f"the exported graph differs from {result.reference}")


@models.command("prepare")
@click.argument("names", nargs=-1)
@models_dir_option
def prepare_models(names: tuple[str, ...], models_dir: tuple[str, ...]) -> None:
    """Make the weights of models that generate them on first use (all such models by default).

    \b
    Examples:
      farm models prepare              # every model that needs it
      farm models prepare caffenet
    """
    from tqdm import tqdm

    from farm.repository import ModelError, available, load_spec, prepare

    chosen = names or tuple(available(models_dir))
    with tqdm(chosen, unit="model", file=sys.stderr, disable=len(chosen) < 2) as bar:
        for name in bar:
            bar.set_description(name)
            spec = (find_model(name, models_dir) if names
                    else load_spec(available(models_dir)[name]))
            try:
                path = prepare(spec)
            except ModelError as exc:
                raise click.ClickException(str(exc)) from exc
            bar.write(f"{spec.name:<16} {path} ({path.stat().st_size / 1e6:.1f} MB)",
                      file=sys.stdout)


from farm.deploy import deploy  # noqa: E402  (a group of its own module)

main.add_command(deploy)
