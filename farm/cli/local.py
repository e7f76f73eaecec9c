"""``farm up`` and ``farm down``: a local farm that stays up in the background, so that
each ``farm run`` starts computing at once (``farm.ops.background``)."""

from __future__ import annotations

import click

from farm import defaults
from farm.cli.options import (
    backend_option,
    batch_option,
    models_dir_option,
    precision_option,
    workers_option,
)


@click.command()
@click.option(
    "--model",
    "models",
    multiple=True,
    help=f"Model to load on every worker now (repeatable) [default: {defaults.MODEL}].",
)
@workers_option
@click.option("--device", "devices", multiple=True, hidden=True)
@backend_option("The workers' inference library.", defaults.BACKEND)
@precision_option("The workers' compute precision.", defaults.PRECISION)
@batch_option
@models_dir_option("Model repository folder (repeatable; also $FARM_MODELS).", exists=True)
@click.option(
    "--idle-timeout",
    default=defaults.LOCAL_IDLE_TIMEOUT,
    show_default=True,
    type=click.FloatRange(0, min_open=True),
    help="Seconds without a job after which the farm stops by itself.",
)
@click.option(
    "--foreground", is_flag=True, help="Run the farm in this process until stopped (no detach)."
)
def up(
    models: tuple[str, ...],
    workers: int | None,
    devices: tuple[str, ...],
    backend: str,
    precision: str,
    batch: int | None,
    models_dir: tuple[str, ...],
    idle_timeout: float,
    foreground: bool,
) -> None:
    """Start a local farm that stays up in the background: `farm run` uses it.

    A broker and one pinned worker per core, the models loaded, private to this
    user (an ipc socket in a folder only this user may open).  Each `farm run` then
    starts computing at once, instead of starting and stopping a farm of its own.
    It stops after --idle-timeout seconds without a job, or with `farm down`.
    """
    from farm.cli.run import farm_settings, local_devices
    from farm.ops import background

    settings = farm_settings(
        devices or local_devices(workers),
        models or (defaults.MODEL,),
        models_dir,
        backend,
        precision,
        batch,
        idle_timeout,
    )
    if foreground:
        background.supervise(settings, defaults.POLICY)
        return
    found = background.find_running()
    if found.notice:
        click.echo(found.notice, err=True)
    if found.record is not None:
        differences = found.record.settings.differences(settings)
        if differences or found.record.settings.models != settings.models:
            raise click.ClickException(
                f"a local farm is already up ({found.record.describe()}) with other "
                f"settings; `farm down` stops it"
            )
        click.echo(f"a local farm is already up: {found.record.describe()}", err=True)
        return
    record = background.start(settings)
    click.echo(
        f"local farm up: {record.describe()}; {', '.join(settings.models)} loaded; "
        f"stops after {idle_timeout:g} s without a job, or with `farm down`",
        err=True,
    )


@click.command()
def down() -> None:
    """Stop the local farm that `farm up` started."""
    from farm.ops import background

    found = background.find_running()
    if found.notice:
        click.echo(found.notice, err=True)
    if found.record is None:
        if not found.notice:
            click.echo("no local farm is up", err=True)
        return
    background.stop(found.record)
    click.echo(f"local farm stopped ({found.record.describe()})", err=True)
