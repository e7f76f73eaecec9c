"""Keys carry roles (farm.wire.curve): the folders `farm keys` writes, the roles the broker
reads from them, and a real CURVE ROUTER whose peers' User-Id maps to their roles."""

from __future__ import annotations

import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth
from click.testing import CliRunner

from farm.cli.keys import keys
from farm.wire.curve import (
    AUTHORIZED,
    ROLE_CLIENT,
    ROLE_OPERATOR,
    ROLE_WORKER,
    KeyRoles,
    KeysError,
    add_key,
    init_keys,
    make_client,
    make_server,
    migrate_keys,
    public_key,
    start_authenticator,
)
from farm.wire.link import Handshakes

WORKER, CLIENT, OPERATOR = frozenset({"worker"}), frozenset({"client"}), frozenset({"operator"})
BOTH = WORKER | CLIENT


def legacy_folder(folder: Path, *names: str) -> Path:
    """A keys folder as `farm keys init` made it before roles: every peer in authorized/."""
    (folder / AUTHORIZED).mkdir(parents=True)
    zmq.auth.create_certificates(folder, "broker")
    for name in names:
        public, _ = zmq.auth.create_certificates(folder, name)
        shutil.copy(public, folder / AUTHORIZED)
    return folder


def key_of(folder: Path, name: str) -> str:
    return public_key(folder / f"{name}.key")


def test_init_puts_each_default_key_in_its_role_folder(tmp_path) -> None:
    folder = tmp_path / "keys"
    made = init_keys(folder)
    authorized = folder / AUTHORIZED
    assert authorized / "workers" / "worker.key" in made
    assert authorized / "clients" / "client.key" in made
    assert sorted(p.relative_to(authorized).as_posix() for p in authorized.rglob("*")) == [
        "clients",
        "clients/client.key",
        "operators",
        "workers",
        "workers/worker.key",
    ]
    for secret in folder.glob("*.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret


def test_key_roles_map_each_key_to_its_folder_roles(tmp_path) -> None:
    folder = tmp_path / "keys"
    init_keys(folder)
    add_key(folder, "ops", ROLE_OPERATOR)
    add_key(folder, "rack2")  # a worker unless told otherwise
    roles = KeyRoles.load(folder)
    assert roles.of(key_of(folder, "worker")) == WORKER
    assert roles.of(key_of(folder, "client")) == CLIENT
    assert roles.of(key_of(folder, "ops")) == OPERATOR | CLIENT, "an operator is a client too"
    assert roles.of(key_of(folder, "rack2")) == {ROLE_WORKER}
    assert roles.of("not a key") == frozenset()
    assert roles.legacy == () and roles.migration_lines() == []


def test_a_key_in_two_role_folders_has_both_roles(tmp_path) -> None:
    folder = tmp_path / "keys"
    init_keys(folder)
    shutil.copy(folder / "client.key", folder / AUTHORIZED / "workers")
    assert KeyRoles.load(folder).of(key_of(folder, "client")) == BOTH


def test_keys_in_authorized_itself_are_workers_and_clients_and_say_how_to_move(
    tmp_path,
) -> None:
    folder = legacy_folder(tmp_path / "keys", "worker", "client", "rack2")
    roles = KeyRoles.load(folder)
    for name in ("worker", "client", "rack2"):
        assert roles.of(key_of(folder, name)) == {ROLE_WORKER, ROLE_CLIENT}
    assert [p.name for p in roles.legacy] == ["client.key", "rack2.key", "worker.key"]
    lines = roles.migration_lines()
    assert lines[2] == (
        f"{folder}/authorized/worker.key is in authorized/ itself: it may act as worker and "
        "client; move it to authorized/workers/ or authorized/clients/ to give it one role "
        f"(`farm keys migrate {folder}` moves it to authorized/workers/)"
    )
    assert lines[1].endswith(
        "(move it by hand: `farm keys migrate` moves only keys named worker*/client*)"
    )


def test_migrate_moves_default_names_and_leaves_the_rest(tmp_path) -> None:
    folder = legacy_folder(tmp_path / "keys", "worker", "client", "rack2")
    moved, left = migrate_keys(folder)
    assert [(a.name, b.parent.name) for a, b in moved] == [
        ("client.key", "clients"),
        ("worker.key", "workers"),
    ]
    assert left == [(folder / AUTHORIZED / "rack2.key", "not named worker*/client*")]
    roles = KeyRoles.load(folder)
    assert roles.of(key_of(folder, "worker")) == WORKER
    assert roles.of(key_of(folder, "client")) == CLIENT
    assert [p.name for p in roles.legacy] == ["rack2.key"]


def test_keys_commands_take_a_role_and_list_roles(tmp_path) -> None:
    folder = str(tmp_path / "keys")
    runner = CliRunner()
    assert runner.invoke(keys, ["init", folder]).exit_code == 0
    added = runner.invoke(keys, ["add", folder, "ops", "--role", "operator"])
    assert added.exit_code == 0 and "(role operator)" in added.output
    assert f"{folder}/authorized/operators/ops.key" in added.output
    bad = runner.invoke(keys, ["add", folder, "x", "--role", "admin"])
    assert bad.exit_code != 0 and "'admin' is not one of" in bad.output
    assert runner.invoke(keys, ["list", folder]).output.split() == ["client", "ops", "worker"]
    assert runner.invoke(keys, ["list", folder, "--roles"]).output.splitlines() == [
        "client\tclient",
        "ops\tclient,operator",
        "worker\tworker",
    ]


def test_broken_or_missing_folders_are_one_line_errors(tmp_path) -> None:
    with pytest.raises(KeysError, match="no .*authorized folder"):
        KeyRoles.load(tmp_path)
    folder = tmp_path / "keys"
    init_keys(folder)
    (folder / AUTHORIZED / "clients" / "junk.key").write_text("no key here\n")
    with pytest.raises(KeysError, match="junk.key: no public key could be read"):
        KeyRoles.load(folder)
    with pytest.raises(KeysError, match="role 'admin' is none of"):
        add_key(folder, "x", "admin")


# -- a real CURVE ROUTER -----------------------------------------------------------------


@pytest.fixture
def keys_folder(tmp_path) -> Path:
    """The new layout plus an operator, and a key left in authorized/ itself."""
    folder = tmp_path / "keys"
    init_keys(folder)
    add_key(folder, "ops", ROLE_OPERATOR)
    public, _ = zmq.auth.create_certificates(folder, "old")
    shutil.copy(public, folder / AUTHORIZED)
    return folder


@pytest.fixture
def router(keys_folder) -> Iterator[tuple[zmq.Context, zmq.Socket, str]]:
    context = zmq.Context()
    authenticator = start_authenticator(context, keys_folder)
    sock = context.socket(zmq.ROUTER)
    sock.linger = 0
    make_server(sock, keys_folder)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield context, sock, f"tcp://127.0.0.1:{port}"
    sock.close()
    authenticator.stop()
    context.term()


def dealer(context: zmq.Context, folder: Path, name: str, endpoint: str | None) -> zmq.Socket:
    """A CURVE DEALER as key ``name``, connected to ``endpoint`` unless it is None."""
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    make_client(sock, folder, name)
    if endpoint is not None:
        sock.connect(endpoint)
    return sock


def next_message(router: zmq.Socket) -> tuple[str, bytes]:
    """The User-Id and body of the next message that reaches ``router``."""
    assert router.poll(10_000), "no message came"
    frames = router.recv_multipart(copy=False)
    return frames[0].get("User-Id"), frames[-1].bytes


def test_each_peer_s_user_id_gives_its_roles(router, keys_folder) -> None:
    context, sock, endpoint = router
    names = ("worker", "client", "ops", "old")
    peers = [dealer(context, keys_folder, name, endpoint) for name in names]
    try:
        for name, peer in zip(names, peers):
            peer.send(name.encode())
        seen = dict(next_message(sock)[::-1] for _ in names)
    finally:
        for peer in peers:
            peer.close()
    roles = KeyRoles.load(keys_folder)
    assert {body.decode(): roles.of(user_id) for body, user_id in seen.items()} == {
        "worker": WORKER,
        "client": CLIENT,
        "ops": OPERATOR | CLIENT,
        "old": BOTH,
    }
    assert seen[b"worker"] == key_of(keys_folder, "worker"), "User-Id: z85 of the public key"


def test_an_unknown_key_gets_nothing_through(router, keys_folder, tmp_path) -> None:
    context, sock, endpoint = router
    strangers = tmp_path / "strangers"
    init_keys(strangers)
    shutil.copy(keys_folder / "broker.key", strangers / "broker.key")
    stranger = dealer(context, strangers, "worker", None)
    handshakes = Handshakes(stranger, "worker")  # watching before the handshake starts
    stranger.connect(endpoint)
    worker = dealer(context, keys_folder, "worker", endpoint)
    try:
        try:  # libzmq drops a refused connection's pipe, and may have done so already
            stranger.send(b"forged", zmq.NOBLOCK)
        except zmq.Again:
            pass
        assert handshakes.monitor.poll(10_000), "the stranger's handshake never ended"
        assert "the broker refused key 'worker'" in (handshakes.failure() or "")
        worker.send(b"real")
        user_id, body = next_message(sock)
        assert (body, user_id) == (b"real", key_of(keys_folder, "worker"))
        assert not sock.poll(200), "a refused peer's message came through"
    finally:
        handshakes.close()
        stranger.close()
        worker.close()
