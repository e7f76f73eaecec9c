"""``farm broker``: the scheduler and router of a farm."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from farm import defaults
from farm.cli.options import curve_option, endpoint_value, heartbeat_options, models_dir_option
from farm.cli.policy import policy_options, policy_params

if TYPE_CHECKING:
    from farm.broker.broker import Broker


@click.command()
@click.option(
    "--bind",
    default=defaults.BROKER_ENDPOINT,
    show_default=True,
    envvar="FARM_BIND",
    show_envvar=True,
    callback=endpoint_value,
    help="ZeroMQ endpoint to bind (HOST:PORT means tcp://HOST:PORT); "
    "tcp://127.0.0.1:* picks a free port.",
)
@heartbeat_options
@click.option(
    "--max-attempts",
    default=defaults.MAX_ATTEMPTS,
    show_default=True,
    type=click.IntRange(1),
    help="Charged attempts (the worker failed the chunk, or died computing it) "
    "that make a chunk suspect on one device, and give up a single image; "
    "charges on two devices make it suspect sooner.  A suspect chunk is "
    "halved down to the images that fail by themselves.",
)
@click.option(
    "--max-runs",
    default=defaults.MAX_RUNS,
    show_default=True,
    type=click.IntRange(1),
    help="Runs of one image for any reason (workers lost while holding it count "
    "too) before it is given up as one whose workers kept being lost.",
)
@curve_option("the broker's key pair and the authorized/ public keys")
@models_dir_option(
    "Model repository folder served to workers (repeatable; searched before "
    "$FARM_MODELS and the bundled models)."
)
@click.option(
    "--verify",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0, 1),
    metavar="FRACTION",
    help="Run this part of every job's images again on another device (spot checks), "
    "unless the job says otherwise; a worker whose answers lose a check is quarantined.",
)
@click.option(
    "--backup-share",
    default=defaults.BACKUP_SHARE,
    show_default=True,
    type=click.FloatRange(0, 1),
    metavar="SHARE",
    help="Backup attempts: a worker idle at the end of a job runs again the chunk in "
    "flight projected to answer last, if it would finish it sooner; the first answer "
    "wins.  At most this share of a job's images run as backups (0: none).",
)
@click.option(
    "--sharing",
    type=click.Choice(["fair", "fifo"]),
    default=defaults.SHARING,
    show_default=True,
    help="How jobs of equal priority share workers: fair (the job holding the fewest "
    "chunks gets the next free slot) or fifo (the oldest job first).",
)
@click.option(
    "--max-chunk-seconds",
    default=defaults.MAX_CHUNK_SECONDS,
    show_default=True,
    type=click.FloatRange(0),
    help="Cap chunks at this many seconds of compute (once speeds are known), so a "
    "new job, a cancel or a lost worker waits about that long; 0: no cap, the "
    "policy's chunks as they are.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    envvar="FARM_METRICS_PORT",
    show_envvar=True,
    help="Serve Prometheus metrics on this port (0: a free one) [default: off].",
)
@click.option(
    "--metrics-host",
    default=defaults.METRICS_HOST,
    show_default=True,
    help="Address the metrics endpoint listens on.",
)
@click.option(
    "--endpoint-fd",
    type=click.IntRange(0),
    hidden=True,
    help="Write the bound endpoint and a newline to this inherited file descriptor, then "
    "close it: how a local farm that started this broker learns where it listens.",
)
@policy_options()
def broker(
    bind: str,
    heartbeat: float,
    liveness: int,
    max_attempts: int,
    max_runs: int,
    curve: str | None,
    models_dir: tuple[str, ...],
    sharing: str,
    max_chunk_seconds: float,
    verify: float,
    backup_share: float,
    metrics_port: int | None,
    metrics_host: str,
    endpoint_fd: int | None,
    algo: str,
    **options: object,
) -> None:
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
    from farm.broker.broker import BrokerConfig
    from farm.ops.roles import serve_broker

    warn_if_exposed(bind, curve)
    config = BrokerConfig(
        bind=bind,
        algo=algo,
        params=params,
        heartbeat=heartbeat,
        model_dirs=models_dir,
        liveness=liveness,
        max_attempts=max_attempts,
        max_runs=max_runs,
        curve=curve,
        sharing=sharing,
        max_chunk_seconds=max_chunk_seconds,
        verify=verify,
        backup_share=backup_share,
        metrics=(metrics_host, metrics_port) if metrics_port is not None else None,
    )
    try:
        serve_broker(config, endpoint_fd, on_bound=announce)
    except Exception as exc:  # zmq.ZMQError on a busy address, ValueError on a bad parameter
        raise click.ClickException(str(exc)) from exc


def announce(running: Broker) -> None:
    """The first lines on stdout, for people: where the broker listens (a local farm
    learns it through ``--endpoint-fd``)."""
    click.echo(f"farm broker listening on {running.endpoint}")
    if running.metrics_url:
        click.echo(f"metrics on {running.metrics_url}")
    sys.stdout.flush()


def warn_if_exposed(bind: str, curve: str | None) -> None:
    """A broker reachable from other machines without CURVE lets anyone in: say so (not for
    a loopback address: 127.0.0.0/8, ::1, lo, localhost)."""
    from farm.wire.link import is_loopback

    if not curve and bind.startswith("tcp://") and not is_loopback(bind):
        click.echo(
            f"warning: {bind} is reachable from other machines and --curve is off: "
            "anyone who can connect can submit jobs or pose as a worker",
            err=True,
        )
