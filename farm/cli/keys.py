"""``farm keys``: the CurveZMQ key pairs that say who may connect to a broker."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click


@click.group()
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


def write_keys(make: Callable[[], list[Path]]) -> None:
    """Run ``make`` and name the files it wrote; a keys problem is one line, not a traceback."""
    from farm.wire.curve import KeysError

    try:
        made = make()
    except (KeysError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    for path in made:
        click.echo(f"wrote {path}")


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
    from farm.wire.curve import init_keys

    write_keys(lambda: init_keys(Path(folder)))


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
    from farm.wire.curve import add_key

    write_keys(lambda: add_key(Path(folder), name))
    click.echo(
        f"on the {name} host: --curve DIR --curve-name {name}, with DIR holding "
        f"broker.key and {name}.key_secret"
    )


@keys.command("list")
@click.argument("folder", type=click.Path(file_okay=False, exists=True))
def keys_list(folder: str) -> None:
    """The public keys the broker of FOLDER lets in.

    \b
    Example:
      farm keys list /etc/farm/keys
    """
    from farm.wire.curve import authorized_keys

    for path in authorized_keys(Path(folder)):
        click.echo(path.stem)
