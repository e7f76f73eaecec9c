"""CurveZMQ keys: the `farm keys` folder, the roles its keys carry, and the socket setup.

A keys folder holds the broker's key pair, key pairs for workers and clients, and
``authorized/``: the public keys the broker lets in, one folder per role::

    keys/
      broker.key  broker.key_secret       the broker's pair
      worker.key  worker.key_secret       the default worker's pair (farm keys init)
      client.key  client.key_secret       the default client's pair (farm keys init)
      authorized/
        workers/worker.key                may act as a worker
        clients/client.key                may act as a client
        operators/                        may see the whole farm, and act as a client
        rack2.key                         older layout: may act as worker and client

The broker needs ``broker.key_secret`` and ``authorized/``; a worker or client host needs
only ``broker.key`` (the broker's public key) and its own ``NAME.key_secret``.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from farm import defaults

BROKER = "broker"
AUTHORIZED = "authorized"
ROLE_WORKER, ROLE_CLIENT, ROLE_OPERATOR = "worker", "client", "operator"
ROLES = (ROLE_WORKER, ROLE_CLIENT, ROLE_OPERATOR)
#: Each role's folder under ``authorized/``.
ROLE_FOLDERS = {ROLE_WORKER: "workers", ROLE_CLIENT: "clients", ROLE_OPERATOR: "operators"}
#: What a key in each role's folder may act as: an operator is also a client.
GRANTS = {
    ROLE_WORKER: frozenset({ROLE_WORKER}),
    ROLE_CLIENT: frozenset({ROLE_CLIENT}),
    ROLE_OPERATOR: frozenset({ROLE_OPERATOR, ROLE_CLIENT}),
}
#: What a key directly in ``authorized/`` (the layout before roles) may act as.
LEGACY_GRANT = frozenset({ROLE_WORKER, ROLE_CLIENT})
#: Key pairs ``farm keys init`` makes besides the broker's, each authorized in its role.
DEFAULT_PEERS = ((defaults.WORKER_KEY, ROLE_WORKER), (defaults.CLIENT_KEY, ROLE_CLIENT))
#: The ZAP domain of the broker's socket (libzmq sends "", which pyzmq reads as "*").
CURVE_DOMAIN = "*"


class KeysError(ValueError):
    """A keys folder that lacks a needed file, or holds a broken one."""


def _need(path: Path, what: str) -> Path:
    if not path.is_file():
        raise KeysError(f"{what}: {path} not found (make keys with `farm keys init`)")
    return path


def role_folder(folder: Path, role: str) -> Path:
    """Where the public keys of ``role`` lie in keys folder ``folder``."""
    if role not in ROLE_FOLDERS:
        raise KeysError(f"role {role!r} is none of {', '.join(ROLES)}")
    return folder / AUTHORIZED / ROLE_FOLDERS[role]


def init_keys(folder: Path) -> list[Path]:
    """A new keys folder: the broker's pair, the default worker's and client's pairs
    (authorized in their roles), and an empty folder for each role.  No operator key."""
    folder.mkdir(parents=True, exist_ok=True)
    for role in ROLES:
        role_folder(folder, role).mkdir(parents=True, exist_ok=True)
    made = [Path(p) for p in zmq.auth.create_certificates(folder, BROKER)]
    made[1].chmod(0o600)
    for name, role in DEFAULT_PEERS:
        made += add_key(folder, name, role)
    return made


def add_key(folder: Path, name: str, role: str = ROLE_WORKER) -> list[Path]:
    """A new key pair ``name``, its public key authorized as ``role``."""
    allowed = role_folder(folder, role)
    if not name.isidentifier():
        raise KeysError(f"key name {name!r} must be letters, digits and underscores")
    if (folder / f"{name}.key").exists():
        raise KeysError(f"a key named {name!r} exists already in {folder}")
    public, secret = zmq.auth.create_certificates(folder, name)
    Path(secret).chmod(0o600)  # the secret half is for its owner's eyes only
    allowed.mkdir(parents=True, exist_ok=True)
    authorized = allowed / Path(public).name
    shutil.copy(public, authorized)
    return [Path(public), Path(secret), authorized]


def _public_keys(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.key")) if folder.is_dir() else []


def legacy_keys(folder: Path) -> list[Path]:
    """The public keys directly in ``authorized/`` (the layout before roles)."""
    return _public_keys(folder / AUTHORIZED)


def role_keys(folder: Path) -> dict[str, list[Path]]:
    """Each role's public key files."""
    return {role: _public_keys(role_folder(folder, role)) for role in ROLES}


def granted_files(folder: Path) -> list[tuple[Path, frozenset[str]]]:
    """Every authorized public key file, with what its key may act as."""
    files = [(path, GRANTS[role]) for role, paths in role_keys(folder).items() for path in paths]
    return files + [(path, LEGACY_GRANT) for path in legacy_keys(folder)]


def _merged(pairs: Iterable[tuple[str, frozenset[str]]]) -> dict[str, frozenset[str]]:
    """Each key once, with the union of its grants."""
    merged: dict[str, frozenset[str]] = {}
    for key, grant in pairs:
        merged[key] = merged.get(key, frozenset()) | grant
    return merged


def authorized_keys(folder: Path) -> dict[str, frozenset[str]]:
    """The names of the keys the broker lets in, in order, with what each may act as."""
    return dict(
        sorted(_merged((path.stem, grant) for path, grant in granted_files(folder)).items())
    )


def public_key(path: Path) -> str:
    """The z85 text of the public key in ``path``: what ZAP gives as the peer's User-Id."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeysError(f"{path}: no public key could be read ({exc})") from exc
    return public.decode("ascii")


def migration_target(path: Path) -> str | None:
    """The role ``farm keys migrate`` gives a key directly in ``authorized/``: that of the
    default key its name starts with (worker*, client*), else None (a person decides)."""
    for name, role in DEFAULT_PEERS:
        if path.stem.startswith(name):
            return role
    return None


def migration_line(path: Path) -> str:
    """What the broker says of a key directly in ``authorized/``."""
    role = migration_target(path)
    how = (
        f"`farm keys migrate {path.parent.parent}` moves it to {AUTHORIZED}/{ROLE_FOLDERS[role]}/"
        if role
        else "move it by hand: `farm keys migrate` moves only keys named worker*/client*"
    )
    return (
        f"{path} is in {AUTHORIZED}/ itself: it may act as worker and client; move it to "
        f"{AUTHORIZED}/workers/ or {AUTHORIZED}/clients/ to give it one role ({how})"
    )


@dataclass(frozen=True)
class KeyRoles:
    """What each authorized key may act as, read once from a keys folder.

    Keys added while the broker runs are not seen: restart the broker (load again).
    """

    roles: Mapping[str, frozenset[str]]  # z85 public key (as User-Id gives it) -> roles
    legacy: tuple[Path, ...]  # keys found directly in authorized/

    @classmethod
    def load(cls, folder: str | Path) -> KeyRoles:
        """The roles of every key in ``folder``'s ``authorized/``: a key in several role
        folders has each role; one directly in ``authorized/`` is a worker and a client."""
        folder = Path(folder)
        if not (folder / AUTHORIZED).is_dir():
            raise KeysError(f"no {folder / AUTHORIZED} folder of allowed public keys")
        files = granted_files(folder)
        roles = _merged((public_key(path), grant) for path, grant in files)
        return cls(MappingProxyType(roles), tuple(legacy_keys(folder)))

    def of(self, user_id: str) -> frozenset[str]:
        """The roles of the peer with ZAP User-Id ``user_id``; empty for an unknown one."""
        return self.roles.get(user_id, frozenset())

    def migration_lines(self) -> list[str]:
        """One line for the broker's log per key directly in ``authorized/``."""
        return [migration_line(path) for path in self.legacy]

    def curve_certs(self) -> dict[bytes, bool]:
        """Every key, as pyzmq's Authenticator.certs holds a domain's allowed keys."""
        return {key.encode("ascii"): True for key in self.roles}


def migrate_keys(folder: Path) -> tuple[list[tuple[Path, Path]], list[tuple[Path, str]]]:
    """Move the keys directly in ``authorized/`` that are named like a default key into its
    role's folder: the moves made, and the keys left with why."""
    moved: list[tuple[Path, Path]] = []
    left: list[tuple[Path, str]] = []
    for path in legacy_keys(folder):
        role = migration_target(path)
        target = role_folder(folder, role) / path.name if role else None
        if target is None:
            left.append((path, "not named worker*/client*"))
        elif target.exists():
            left.append((path, f"{target} exists already"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            moved.append((path, path.rename(target)))
    return moved, left


def start_authenticator(
    context: zmq.Context, folder: str | Path, roles: KeyRoles | None = None
) -> ThreadAuthenticator:
    """The ZAP handler of a broker: CURVE clients whose public key is in ``authorized/``,
    in any role folder or directly (``roles``: the folder's, loaded already).  Its ZAP
    replies give each peer's z85 public key as User-Id (pyzmq's ``curve_user_id``).

    The keys are read once: keys added while the broker runs get in after a restart.
    """
    roles = roles if roles is not None else KeyRoles.load(folder)
    authenticator = ThreadAuthenticator(context)
    # what configure_curve does for one folder, for the union of them all
    authenticator.allow_any = False
    authenticator.certs[CURVE_DOMAIN] = roles.curve_certs()
    authenticator.start()
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
