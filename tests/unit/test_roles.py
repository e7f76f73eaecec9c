"""``farm.ops.roles``: the typed settings of a broker and a worker, and the same settings
as ``farm broker`` / ``farm worker`` arguments for a process started by exec.

Round trips: the arguments written for a configuration, parsed by the real commands,
build an equal configuration (the commands' serve functions are replaced; nothing binds).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from click.testing import CliRunner

from farm.broker.broker import BrokerConfig
from farm.cli import main
from farm.ops import roles
from farm.workers.config import Device, WorkerConfig


def parsed_by(monkeypatch: pytest.MonkeyPatch, entry: str, command: list[str]) -> Any:
    """The configuration ``farm COMMAND`` hands to ``roles.<entry>``."""
    seen: list[Any] = []
    monkeypatch.setattr(roles, entry, lambda config, *_, **__: seen.append(config))
    for name in [name for name in os.environ if name.startswith("FARM_")]:
        monkeypatch.delenv(name)
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 0, result.output
    [config] = seen
    return config


@pytest.mark.parametrize(
    "config",
    [
        BrokerConfig(bind="tcp://127.0.0.1:5999"),
        BrokerConfig(
            bind="ipc:///tmp/farm-test.sock",
            algo="static",
            params={"ratio": (1.0, 3.0), "floor": 10},
            heartbeat=0.5,
            liveness=3,
            max_attempts=2,
            max_runs=4,
            sharing="fifo",
            max_chunk_seconds=0.0,
            model_dirs=("/srv/models", "/opt/models"),
            curve="/etc/farm/keys",
            metrics=("0.0.0.0", 9100),
        ),
        BrokerConfig(bind="tcp://127.0.0.1:5998", algo="fifo", params={"chunk": 100}),
    ],
)
def test_broker_arguments_build_the_same_config(
    monkeypatch: pytest.MonkeyPatch, config: BrokerConfig
) -> None:
    arguments = roles.broker_arguments(config)
    assert parsed_by(monkeypatch, "serve_broker", ["broker", *arguments]) == config


@pytest.mark.parametrize(
    "config",
    [
        WorkerConfig(broker="tcp://127.0.0.1:5999", device=Device.parse("cpu:0")),
        WorkerConfig(
            broker="ipc:///tmp/farm-test.sock",
            device=Device.parse("gpu:1"),
            batch=64,
            model_dirs=("/srv/models",),
            preload=("lenet", "cifar10_quick"),
            slots=3,
            max_tasks=10,
            backend="opencv",
            cache_dir="/tmp/cache",
            heartbeat=0.5,
            liveness=3,
            curve="/etc/farm/keys",
            curve_name="rack2",
            fail_items=(250, 261),
            precision="bf16",
        ),
    ],
)
def test_worker_arguments_build_the_same_config(
    monkeypatch: pytest.MonkeyPatch, config: WorkerConfig
) -> None:
    arguments = roles.worker_arguments(config)
    assert parsed_by(monkeypatch, "serve_worker", ["worker", *arguments]) == config


def test_a_worker_device_is_passed_as_given() -> None:
    config = WorkerConfig(broker="tcp://127.0.0.1:5999", device=Device.parse("cpu:0"))
    arguments = roles.worker_arguments(config, "cpu:bound")
    assert arguments[:2] == ["--device", "cpu:bound"]


def test_the_endpoint_goes_down_the_pipe_then_end_of_file() -> None:
    read_end, write_end = os.pipe()
    roles.send_endpoint(write_end, "tcp://127.0.0.1:5999")
    with os.fdopen(read_end) as pipe:
        assert pipe.read() == "tcp://127.0.0.1:5999\n"
