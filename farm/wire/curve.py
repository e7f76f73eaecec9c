"""CurveZMQ keys: the `farm keys` folder, and the socket setup that uses it.

A keys folder holds the broker's key pair, key pairs for workers and clients,
and ``authorized/``: the public keys the broker lets in.  The broker needs
``broker.key_secret`` and ``authorized/``; a worker or client host needs only
``broker.key`` (the broker's public key) and its own ``NAME.key_secret``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from farm import defaults

BROKER = "broker"
AUTHORIZED = "authorized"
#: Key pairs ``farm keys init`` makes besides the broker's, all authorized.
DEFAULT_PEERS = (defaults.WORKER_KEY, defaults.CLIENT_KEY)


class KeysError(ValueError):
    """A keys folder that lacks a needed file."""


def _need(path: Path, what: str) -> Path:
    if not path.is_file():
        raise KeysError(f"{what}: {path} not found (make keys with `farm keys init`)")
    return path


def init_keys(folder: Path) -> list[Path]:
    """A new keys folder: the broker's pair and the default peers' pairs, peers authorized."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / AUTHORIZED).mkdir(exist_ok=True)
    made = [Path(p) for p in zmq.auth.create_certificates(folder, BROKER)]
    made[1].chmod(0o600)
    for name in DEFAULT_PEERS:
        made += add_key(folder, name)
    return made


def add_key(folder: Path, name: str) -> list[Path]:
    """A new key pair for a worker or client, its public key authorized."""
    if not name.isidentifier():
        raise KeysError(f"key name {name!r} must be letters, digits and underscores")
    if (folder / f"{name}.key").exists():
        raise KeysError(f"a key named {name!r} exists already in {folder}")
    public, secret = zmq.auth.create_certificates(folder, name)
    Path(secret).chmod(0o600)  # the secret half is for its owner's eyes only
    (folder / AUTHORIZED).mkdir(parents=True, exist_ok=True)
    authorized = folder / AUTHORIZED / Path(public).name
    shutil.copy(public, authorized)
    return [Path(public), Path(secret), authorized]


def authorized_keys(folder: Path) -> list[Path]:
    return sorted((folder / AUTHORIZED).glob("*.key"))


def start_authenticator(context: zmq.Context, folder: str | Path) -> ThreadAuthenticator:
    """The ZAP handler of a broker: CURVE clients whose public key is in ``authorized/``."""
    allowed = Path(folder) / AUTHORIZED
    if not allowed.is_dir():
        raise KeysError(f"no {allowed} folder of allowed public keys")
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve(domain="*", location=str(allowed))
    return authenticator


def make_server(socket: zmq.Socket, folder: str | Path) -> None:
    """Make ``socket`` a CURVE server with the broker's key pair (before it binds)."""
    public, secret = zmq.auth.load_certificate(
        _need(Path(folder) / f"{BROKER}.key_secret", "the broker's secret key")
    )
    socket.curve_publickey, socket.curve_secretkey = public, secret
    socket.curve_server = True


def make_client(socket: zmq.Socket, folder: str | Path, name: str) -> None:
    """Make ``socket`` a CURVE client as ``name``, trusting the broker's public key."""
    folder = Path(folder)
    server, _ = zmq.auth.load_certificate(
        _need(folder / f"{BROKER}.key", "the broker's public key")
    )
    public, secret = zmq.auth.load_certificate(
        _need(folder / f"{name}.key_secret", f"the secret key of {name!r}")
    )
    socket.curve_publickey, socket.curve_secretkey = public, secret
    socket.curve_serverkey = server
