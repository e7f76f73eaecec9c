"""``farm keys``: the CurveZMQ key pairs that say who may connect to a broker, and as what."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click

#: The roles ``--role`` takes (farm.wire.curve.ROLES, not imported: the CLI loads lazily).
ROLE_CHOICES = ("worker", "client", "operator")


@click.group()
def keys() -> None:
    """CurveZMQ keys for --curve: who may connect to a broker, and as what.

    \b
    Examples:
      farm keys init keys/                      # broker, worker and client key pairs
      farm keys add keys/ rack2                 # one more worker key
      farm keys add keys/ alice --role client   # ... or client, or operator key
      farm broker --curve keys/ --bind tcp://0.0.0.0:5555
      farm worker --curve keys/ --broker tcp://10.0.0.1:5555
      farm submit images.npy --curve keys/ --broker tcp://10.0.0.1:5555
    A worker or client host needs only keys/broker.key and its own NAME.key_secret.
    The broker lets in the public keys in keys/authorized/workers/, clients/ and
    operators/ (an operator may also act as a client); one directly in authorized/
    (older folders) may act as worker and client until `farm keys migrate` moves it.
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
    """Make FOLDER's broker key pair, and a worker and a client key pair, each authorized
    in its role (authorized/workers/, authorized/clients/; no operator key).

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
@click.option(
    "--role",
    type=click.Choice(ROLE_CHOICES),
    default="worker",
    show_default=True,
    help="What the key may act as: worker (runs chunks, sends results), client (submits "
    "jobs), operator (a client that may also see the whole farm in farm status).",
)
def keys_add(folder: str, name: str, role: str) -> None:
    """A new key pair NAME in FOLDER, its public key authorized as --role (restart the
    broker to use it).

    \b
    Example:
      farm keys add /etc/farm/keys rack2
      farm worker --curve keys/ --curve-name rack2 --broker tcp://10.0.0.1:5555
      farm keys add /etc/farm/keys ops --role operator
      farm status --curve keys/ --curve-name ops --broker tcp://10.0.0.1:5555
    """
    from farm.wire.curve import add_key

    write_keys(lambda: add_key(Path(folder), name, role))
    click.echo(
        f"on the {name} host: --curve DIR --curve-name {name}, with DIR holding "
        f"broker.key and {name}.key_secret (role {role})"
    )


@keys.command("list")
@click.argument("folder", type=click.Path(file_okay=False, exists=True))
@click.option("--roles", is_flag=True, help="Each key's roles too, after a tab.")
def keys_list(folder: str, roles: bool) -> None:
    """The keys the broker of FOLDER lets in, by name.

    \b
    Example:
      farm keys list /etc/farm/keys --roles
    """
    from farm.wire.curve import authorized_keys

    for name, grant in authorized_keys(Path(folder)).items():
        click.echo(f"{name}\t{','.join(sorted(grant))}" if roles else name)


@keys.command("migrate")
@click.argument("folder", type=click.Path(file_okay=False, exists=True))
def keys_migrate(folder: str) -> None:
    """Move FOLDER's public keys that lie directly in authorized/ (older folders: worker
    and client at once) and are named worker* or client* into authorized/workers/ or
    authorized/clients/ (restart the broker to use the new roles).

    \b
    Example:
      farm keys migrate /etc/farm/keys
    Others are named, to move by hand into authorized/workers/, clients/ or operators/.
    """
    from farm.wire.curve import KeysError, migrate_keys

    try:
        moved, left = migrate_keys(Path(folder))
    except (KeysError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    for source, target in moved:
        click.echo(f"moved {source} to {target}")
    for path, why in left:
        click.echo(f"left {path} ({why}): move it by hand into a role folder", err=True)
