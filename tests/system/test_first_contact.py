"""A new user's first steps: each mistake is answered in one clear line, with real processes
(a broker alone, no broker at all, the `farm` command itself), and `farm run` reports the
farm's start apart from the job."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from farm import defaults
from farm.client.client import FIRST_CONTACT_TIMEOUT
from farm.ops.local import cores, farm_command, free_port
from tests.conftest import reference_forward


def farm(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(farm_command(*args), capture_output=True, text=True, timeout=timeout)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    """The command failed with one ``Error:`` line, no traceback and no warnings."""
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr and "WARNING" not in done.stderr, done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    return line


@pytest.fixture()
def images(tmp_path, digits) -> str:
    path = tmp_path / "digits.npy"
    np.save(path, digits[:200])
    return str(path)


def test_no_broker_is_one_clear_error_not_a_minute_of_warnings(images) -> None:
    """Nothing listens there: one error after FIRST_CONTACT_TIMEOUT, not the client's 60 s of
    resubmissions."""
    done = farm("submit", images, "--broker", f"127.0.0.1:{free_port()}", "--quiet")
    line = one_error_line(done)
    assert "no broker answered at tcp://127.0.0.1:" in line
    assert f"within {FIRST_CONTACT_TIMEOUT:g} s" in line and "is a broker running there?" in line
    assert "again" not in done.stderr  # no "submitting the 200 missing images again"


def test_a_broker_without_workers_says_so_then_gives_up_at_the_timeout(images, local_farm) -> None:
    alone = local_farm(0)
    done = farm("submit", images, "--broker", alone.endpoint, "--timeout", "6", "--quiet")
    assert f"waiting for a worker: none is connected to {alone.endpoint}" in done.stderr
    assert "farm worker --broker" in done.stderr  # how to start one
    line = one_error_line(done)
    assert f"no worker connected to broker {alone.endpoint} in 6 s" in line
    assert "0 of 200 images came back" in line


def test_host_and_port_mean_tcp(farm_two_workers, images, digits, lenet, tmp_path) -> None:
    address = farm_two_workers.endpoint.removeprefix("tcp://")
    status = farm("status", "--broker", address, "--json")
    assert status.returncode == 0, status.stderr
    out = tmp_path / "out.npy"
    done = farm("submit", images, "--broker", address, "--out", str(out), "--quiet")
    assert done.returncode == 0, done.stderr
    np.testing.assert_allclose(np.load(out), reference_forward(lenet, digits[:200]), atol=1e-5)


@pytest.mark.parametrize(
    "command", [("status",), ("submit", "x.npy"), ("worker", "--device", "cpu:0")]
)
@pytest.mark.parametrize(
    "address,reason",
    [
        ("127.0.0.1", "is not an endpoint: give tcp://HOST:PORT (or HOST:PORT)"),
        ("tcp://127.0.0.1:99999", "port '99999' is not a number from 1 to 65535"),
        ("http://127.0.0.1:5555", "farm speaks tcp://, ipc://, inproc://, not http://"),
    ],
)
def test_an_address_that_is_no_endpoint_is_one_usage_line(command, address, reason) -> None:
    done = farm(*command, "--broker", address, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert reason in done.stderr and "Invalid value for '--broker'" in done.stderr


def test_more_workers_than_cores_is_refused_before_anything_starts() -> None:
    too_many = len(cores()) + 1
    done = farm("run", "--workers", str(too_many), timeout=60)
    assert done.returncode == 2 and "starting a local farm" not in done.stderr
    assert f"--workers {too_many}: this process may use {len(cores())} core" in done.stderr


def test_farm_run_reports_the_start_apart_and_scores_what_it_wrote(tmp_path) -> None:
    """With --out as without: the outputs written, the first predictions, the accuracy; the
    farm's start and stop on lines of their own."""
    out = tmp_path / "scores.npy"
    done = subprocess.run(
        farm_command("run", "--model", "lenet", "--out", str(out), "--quiet"),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "farm ready in " in done.stderr and "(not counted in the job): lenet on " in done.stderr
    assert "farm stopped in " in done.stderr
    assert f"outputs (1000, 10) float32 written to {out}" in done.stdout
    assert "first predictions: " in done.stdout
    assert "accuracy on the bundled sample: 96.70% (967 of 1,000" in done.stdout


def test_engine_loading_on_fresh_workers_is_reported_apart_from_the_job(digits, local_farm) -> None:
    """Workers that load the model for the job's first chunks: their wait is counted as
    loading, not as the job's; once loaded, a second job has none."""
    local = local_farm(2, algo=defaults.POLICY, worker_options=["--backend", "opencv"])
    with local.client() as client:
        first = client.run(np.resize(digits, (2000, 28, 28)), "lenet").summary
        second = client.run(np.resize(digits, (2000, 28, 28)), "lenet").summary
    ran = [share for share in first.workers if share.items]
    assert ran and all(share.load_s > 0 for share in ran)
    assert 0 < first.load_seconds < first.seconds
    assert "of it went to loading the model on fresh workers" in first.format()
    assert second.load_seconds == 0 and "loading" not in second.format()
