"""``farm report``: a job's waste, where it went, and its timeline drawn from its trace."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option(
    "-o",
    "--out",
    type=click.Path(dir_okay=False),
    help="The PNG to draw [default: TRACE with .png instead of .json].",
)
@click.option(
    "--width",
    default=1200,
    show_default=True,
    type=click.IntRange(200, 10000),
    help="Image width in pixels.",
)
@click.option(
    "--height",
    default=800,
    show_default=True,
    type=click.IntRange(200, 10000),
    help="Image height in pixels.",
)
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
    from farm.client.report import TraceError, analyse, load_trace, plot

    try:
        document = load_trace(trace)
    except TraceError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(analyse(document).format())
    target = out or str(Path(trace).with_suffix(".png"))
    plot(document, target, width, height)
    click.echo(f"timeline and throughput drawn in {target} ({width} x {height})")
