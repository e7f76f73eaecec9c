"""A restarted broker never strands a worker: whatever the worker carries across the
reconnect (engines of models it fetched, their speeds, results it sent) is accepted by the
broker it meets next, one that serves the same model, a new version of it, or not the
model at all.  A worker the broker refuses exits with the reason instead of waiting
unheard.

One farm for the module: a broker that serves a model (``digits``) from a folder of its
own, which the worker does not have, and one pinned worker that fetches it.  Each test
changes the broker's folder and restarts the broker with SIGTERM on the same address.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import zmq

from farm.client.client import FarmError
from farm.engines.autoselect import load_engine
from farm.engines.tolerances import TOLERANCE, relative_difference
from farm.modelrepo.repository import find, load_spec
from farm.ops.local import LocalFarm, farm_command
from farm.wire import messages, protocol
from farm.wire.protocol import Command
from tests.system.conftest import pinned_devices

LINK = ["--heartbeat", "0.2", "--liveness", "5"]  # a lost broker counts as gone after 1 s


def serve_as_digits(repository: Path, source: str) -> Path:
    """The broker's ``digits`` is now bundled model ``source`` (a new version of it, when
    it was another one before)."""
    folder = repository / "digits"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(find(source).folder, folder)
    return folder


def restart_broker(farm: LocalFarm) -> dict:
    """Stop the broker with SIGTERM, start a new one on the same address, and return its
    INFO once the worker has registered with it."""
    broker = farm.running_broker()
    broker.terminate()
    broker.wait(10)
    if broker.stdout:
        broker.stdout.close()
    farm.start_broker(farm.endpoint)
    return farm.wait_for_workers(1)


def expected(folder: Path, images: np.ndarray) -> np.ndarray:
    return load_engine(load_spec(folder), "opencv").run(images)


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("broker-models")


@pytest.fixture(scope="module")
def served(repository, module_local_farm, tmp_path_factory) -> LocalFarm:
    serve_as_digits(repository, "lenet")
    return module_local_farm(
        1,
        broker_options=LINK,
        worker_options=[*LINK, "--backend", "opencv", "--cache", str(tmp_path_factory.mktemp("c"))],
        chunk=100,
        models_dir=repository,
    )


def run_digits(farm: LocalFarm, images: np.ndarray) -> np.ndarray:
    with farm.client() as client:
        return client.map(images, model="digits")


def test_a_fetched_model_runs_again_after_a_broker_restart(served, repository, digits) -> None:
    folder = serve_as_digits(repository, "lenet")
    images = digits[:300, None]
    reference = expected(folder, images)
    assert relative_difference(run_digits(served, images), reference) <= TOLERANCE
    [worker] = restart_broker(served)["workers"]
    # it advertises what it fetched and loaded, and the new broker takes it as it is
    assert "digits" in worker["models"] and "digits" in worker["loaded"]
    assert relative_difference(run_digits(served, images), reference) <= TOLERANCE
    with served.client() as client:
        [worker] = client.info()["workers"]
    assert worker["fetched"] == {}, "run from the engine it kept, not fetched again"


def test_a_new_version_of_the_model_is_fetched_not_the_old_one_run(
    served, repository, digits
) -> None:
    run_digits(served, digits[:100, None])  # the worker holds the old version's engine
    folder = serve_as_digits(repository, "cifar10_quick")  # other weights, other input
    restart_broker(served)
    pictures = np.tile(np.load(find("cifar10_quick").sample), (5, 1, 1, 1))
    outputs = run_digits(served, pictures)
    assert relative_difference(outputs, expected(folder, pictures)) <= TOLERANCE
    with served.client() as client:
        [worker] = client.info()["workers"]
    assert worker["fetched"] == {"digits": 1}


def test_a_model_removed_from_the_broker_fails_its_jobs_and_the_worker_stays(
    served, repository, digits, lenet
) -> None:
    run_digits(served, np.tile(np.load(find("cifar10_quick").sample), (2, 1, 1, 1)))
    shutil.rmtree(repository / "digits")
    restart_broker(served)
    with served.client() as client:
        with pytest.raises(FarmError, match="'digits'"):
            client.map(digits[:10, None], model="digits")
        outputs = client.map(digits[:100, None], model="lenet")
        assert len(client.info()["workers"]) == 1, "the worker stays registered"
    assert relative_difference(outputs, expected(lenet.folder, digits[:100, None])) <= TOLERANCE


def test_a_worker_the_broker_refuses_exits_with_the_reason(tmp_path) -> None:
    """Refused at registration, the worker exits 1 (supervisord starts it afresh) instead of
    registering again, unheard, forever."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    worker = subprocess.Popen(
        farm_command(
            "worker", "--device", pinned_devices(1)[0], "--broker", f"tcp://127.0.0.1:{port}"
        ),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert router.poll(30_000), "the worker never said READY"
        identity, *frames = router.recv_multipart()
        assert protocol.decode(frames).command is Command.READY
        router.send_multipart(
            [
                identity,
                *protocol.encode(
                    Command.ERROR, messages.Error(error="odd READY", registration=True)
                ),
            ]
        )
        _, stderr = worker.communicate(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        router.close()
        context.term()
    assert worker.returncode == 1, stderr
    assert f"the broker at tcp://127.0.0.1:{port} refused this worker's registration" in stderr
    assert "odd READY" in stderr
