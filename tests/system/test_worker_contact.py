"""How a worker and its broker find each other, said in the logs: a worker that waits for
its broker says so (and what may be wrong), then that it registered; a second worker on a
device already served is reported; an IPv6 loopback broker takes workers and clients."""

from __future__ import annotations

import re
import socket
import subprocess

import numpy as np
import pytest

from farm.client.client import Client
from farm.client.status import format_status
from farm.ops.local import LocalFarm, farm_command, free_port, stop_processes
from tests.conftest import reference_forward
from tests.system.conftest import await_text, logged_broker, pinned_devices

LINK = ["--heartbeat", "0.2", "--liveness", "5"]  # no answer for 1 s: the broker is silent


def start_worker(log, endpoint: str, device: str, *options: str) -> subprocess.Popen:
    with open(log, "w") as stderr:
        return subprocess.Popen(
            farm_command(
                "--log-level", "INFO", "worker", "--device", device, "--broker", endpoint, *options
            ),
            stderr=stderr,
        )


def test_a_worker_started_before_its_broker_says_it_waits_then_that_it_registered(
    tmp_path,
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    log = tmp_path / "worker.log"
    worker = start_worker(log, endpoint, pinned_devices(1)[0], *LINK)
    try:
        waiting = await_text(log, "no answer from the broker", worker)
        assert f"waiting for the broker at {endpoint} (no answer yet)" in waiting
        assert "is it running, and at that address?" in waiting and "--curve" in waiting
        assert "registered" not in waiting and " ready" not in waiting
        with LocalFarm(devices=[], bind=endpoint, broker_options=LINK) as farm:
            farm.wait_for_workers(1)
            await_text(log, f"registered with the broker at {endpoint}", worker)
    finally:
        stop_processes([worker])


def test_a_second_worker_on_a_device_in_use_is_reported(tmp_path) -> None:
    device = pinned_devices(1)[0]
    with logged_broker(tmp_path / "broker.log") as (broker, endpoint):
        workers = [start_worker(tmp_path / f"w{i}.log", endpoint, device) for i in range(2)]
        try:
            with Client(endpoint) as client:
                info = client.info(wait_workers=2)
            logged = await_text(tmp_path / "broker.log", "they compete for it", broker)
        finally:
            stop_processes(workers)
    assert [w["device_shared_by"] for w in info["workers"]] == [2, 2]
    table = format_status(info)
    assert all(f"{w['name']} (device shared by 2)" in table for w in info["workers"])
    first, second = sorted(info["workers"], key=lambda w: w["uptime_s"], reverse=True)
    assert f"worker {second['name']} runs on {device} of host {second['host']}" in logged
    assert f"which {first['name']} serves already" in logged


def test_the_brokers_debug_log_names_the_event_behind_each_instruction(tmp_path, digits) -> None:
    """Every instruction the broker carries out is logged with the number of the event that
    caused it: a chunk's TASK with its client's DATA, its RESULT with the worker's."""
    log = tmp_path / "broker.log"
    with logged_broker(log, level="DEBUG") as (broker, endpoint):
        worker = start_worker(tmp_path / "w.log", endpoint, pinned_devices(1)[0])
        try:
            with Client(endpoint) as client:
                client.info(wait_workers=1)
                client.run(digits[:50], "lenet")
        finally:
            stop_processes([worker])
        logged = await_text(log, "instruction SendDone caused by event #", broker)
    numbers = [int(n) for n in re.findall(r"caused by event #(\d+) ", logged)]
    assert numbers == sorted(numbers) and numbers[0] >= 1
    assert re.search(r"instruction SendTask caused by event #\d+ \(DataArrived\)", logged)
    assert re.search(r"instruction SendResult caused by event #\d+ \(ResultArrived\)", logged)


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not ipv6_loopback(), reason="IPv6 loopback (::1) is not enabled here")
def test_a_broker_on_ipv6_loopback_serves_workers_and_clients(lenet, digits) -> None:
    with socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::1", 0))
        port = probe.getsockname()[1]
    with LocalFarm(
        devices=pinned_devices(1),
        algo="fifo",
        bind=f"tcp://[::1]:{port}",
        worker_options=["--backend", "opencv"],
    ) as farm:
        assert farm.endpoint == f"tcp://[::1]:{port}"
        with farm.client() as client:
            outputs = client.map(digits[:50], model="lenet")
    np.testing.assert_allclose(outputs, reference_forward(lenet, digits[:50]), atol=1e-4)
