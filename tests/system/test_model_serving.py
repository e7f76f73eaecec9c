"""Workers get models from the broker by content hash; broken models fail alone; the demo's
accuracy."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from farm.client.client import FarmError
from farm.engines.autoselect import load_engine
from farm.engines.tolerances import TOLERANCE, relative_difference
from farm.modelrepo.modelstore import ModelCache, manifest_of
from farm.modelrepo.repository import find, load_spec
from farm.ops.local import LocalFarm, farm_command
from farm.wire import messages, protocol
from farm.wire.protocol import Command
from tests.frames import next_reply, task
from tests.system.conftest import pinned_devices
from tests.unit.test_models import break_model, needs_torch


def copy_model(source: str, folder: Path) -> Path:
    """A bundled model under another name, so that no worker has it on its own disk."""
    shutil.copytree(find(source).folder, folder)
    return folder


def run_jobs_at_once(endpoint_farm: LocalFarm, jobs: dict[str, np.ndarray]) -> dict[str, object]:
    """Each job from its own client thread; model -> outputs, or the exception it raised."""
    results: dict[str, object] = {}

    def submit(model: str, images: np.ndarray) -> None:
        try:
            with endpoint_farm.client() as client:
                results[model] = client.map(images, model=model)
        except Exception as exc:  # reported by the assertion below
            results[model] = exc

    threads = [threading.Thread(target=submit, args=item) for item in jobs.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


def test_workers_with_empty_caches_fetch_each_model_once(tmp_path, digits, local_farm) -> None:
    repository = tmp_path / "broker-models"
    copy_model("lenet", repository / "digits")
    copy_model("cifar10_quick", repository / "pictures")
    pictures = np.tile(np.load(find("cifar10_quick").sample), (20, 1, 1, 1))
    jobs = {"digits": digits[:, None], "pictures": pictures}
    expected = {
        name: load_engine(load_spec(repository / name)).run(images) for name, images in jobs.items()
    }
    caches = [tmp_path / "cache-a", tmp_path / "cache-b"]
    farm = local_farm(
        2,
        device_options=[["--cache", str(cache)] for cache in caches],
        chunk=100,
        models_dir=repository,
    )
    for _ in range(2):  # the second round must run from the loaded engines
        results = run_jobs_at_once(farm, jobs)
        assert results.keys() == jobs.keys(), "a job never finished"
        for name, outputs in results.items():
            assert not isinstance(outputs, Exception), outputs
            # the same model: within the engines' own tolerance (a pinned worker and this
            # process may run it on different engines and batches)
            assert relative_difference(outputs, expected[name]) <= TOLERANCE, name
    with farm.client() as client:
        workers = client.info()["workers"]
    assert [w["fetched"] for w in workers] == [{"digits": 1, "pictures": 1}] * 2
    for cache in caches:
        assert sorted(p.name.rsplit("-", 1)[0] for p in (cache).iterdir()) == ["digits", "pictures"]


@pytest.fixture(scope="module")
def farm_with_broken_models(tmp_path_factory, module_local_farm) -> LocalFarm:
    repository = tmp_path_factory.mktemp("broken-models")
    for damage in ("truncate", "unknown_layer", "mismatch"):
        break_model(repository / f"bad-{damage.replace('_', '-')}", find("lenet").folder, damage)
    return module_local_farm(2, chunk=100, models_dir=repository)


@pytest.mark.parametrize(
    "model, problem",
    [
        ("bad-truncate", "weights.caffemodel is not a Caffe NetParameter"),
        (
            "bad-unknown-layer",
            "deploy.prototxt: layer 'odd' has type 'Crop', which farm does not support",
        ),
        (
            "bad-mismatch",
            "weights.caffemodel does not match the prototxt: layer 'conv1' blob 0 has "
            "shape (20, 1, 5, 5), the prototxt needs (30, 1, 5, 5)",
        ),
    ],
)
def test_a_broken_model_fails_its_job_and_workers_keep_serving(
    farm_with_broken_models, lenet, digits, model, problem
) -> None:
    with farm_with_broken_models.client() as client:
        with pytest.raises(FarmError, match=problem.replace("(", r"\(").replace(")", r"\)")):
            client.map(digits[:300, None], model=model)
        outputs = client.map(digits[:300, None], model="lenet")
    np.testing.assert_allclose(outputs, load_engine(lenet).run(digits[:300, None]), atol=1e-5)


def test_a_model_whose_hash_does_not_match_is_refused(lone_worker, tmp_path, lenet, digits) -> None:
    router, identity = lone_worker
    spec = load_spec(copy_model("lenet", tmp_path / "digits"))
    manifest = manifest_of(spec)
    contents = [bytearray(spec.files()[f.name].read_bytes()) for f in manifest.files]
    contents[[f.name for f in manifest.files].index("lenet.caffemodel")][1000] ^= 0xFF
    frames = task(identity, 7, digits[:5, None], model="digits")
    header = protocol.decode(frames[1:]).header
    header.digest = manifest.digest
    router.send_multipart([identity, *protocol.encode(Command.TASK, header, frames[4:])])
    fetch = next_reply(router)
    assert fetch.command is Command.FETCH and fetch.header.digest == manifest.digest
    router.send_multipart(
        [identity, *protocol.encode(Command.MODEL, manifest.header(), [bytes(c) for c in contents])]
    )
    failed = next_reply(router)
    assert failed.command is Command.FAILED and failed.header.chunk == 7
    assert "file lenet.caffemodel from the broker has" in failed.header.error
    assert "sha256" in failed.header.error and "not installed" in failed.header.error
    router.send_multipart(task(identity, 8, digits[:5, None]))  # other models still run
    result = next_reply(router)
    assert result.command is Command.RESULT and result.header.chunk == 8


def test_a_damaged_cache_entry_is_discarded(tmp_path) -> None:
    spec = load_spec(copy_model("lenet", tmp_path / "digits"))
    manifest = manifest_of(spec)
    cache = ModelCache(tmp_path / "cache")
    contents = [spec.files()[f.name].read_bytes() for f in manifest.files]
    installed = cache.install(manifest, contents)
    assert cache.lookup("digits", manifest.digest).folder == installed.folder
    with open(installed.weights, "r+b") as handle:
        handle.seek(100)
        handle.write(b"\0\0\0\0")
    assert cache.lookup("digits", manifest.digest) is None
    assert not installed.folder.exists()


@needs_torch
def test_opencv_and_torch_workers_share_a_job(lenet, digits, local_farm) -> None:
    farm = local_farm(
        2, device_options=[["--backend", "torch"], ["--backend", "opencv"]], chunk=100
    )
    with farm.client() as client:
        result = client.run(digits[:, None], model="lenet")
        workers = client.info()["workers"]
    np.testing.assert_allclose(result.outputs, load_engine(lenet).run(digits[:, None]), atol=1e-4)
    assert sorted(w["backend"] for w in workers) == ["opencv", "torch"]
    assert all(w["threads"] == 1 for w in workers)  # pinned: one thread, torch included
    assert all(share.items > 0 for share in result.summary.workers)


def test_demo_reports_the_measured_accuracy(lenet, digits) -> None:
    labels = np.load(lenet.sample_labels)
    predicted = load_engine(lenet).run(digits[:, None]).argmax(axis=1)
    accuracy = (predicted == labels).mean()
    assert accuracy >= 0.95, "the bundled LeNet is trained: it must read digits"
    # what `make demo` runs, with fewer passes
    done = subprocess.run(
        farm_command("--log-level", "WARNING", "run", "--quiet", "--repeat", "3"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"{3 * len(labels):,} images in " in done.stdout
    assert (
        f"accuracy on the bundled sample: {accuracy:.2%} ({(predicted == labels).sum():,} "
        f"of {len(labels):,} against labels.npy; the 3 passes agree)"
    ) in done.stdout


def test_unsafe_model_names_never_touch_the_disk(lone_worker, digits) -> None:
    """A task naming '../x' is refused; the worker answers and keeps serving."""
    router, identity = lone_worker
    frames = task(identity, 9, digits[:2, None], model="../../etc")
    router.send_multipart(frames)
    failed = next_reply(router)
    assert failed.command is Command.FAILED and "refusing model name" in failed.header.error
    router.send_multipart(task(identity, 10, digits[:2, None]))
    assert next_reply(router).command is Command.RESULT


def test_models_go_to_registered_workers_only(farm_two_workers) -> None:
    """A client (or anyone not registered as a worker) that sends FETCH gets an ERROR, no
    files: FETCH is a worker's message (``farm.broker.peers``)."""
    import zmq

    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(farm_two_workers.endpoint)
    try:
        sock.send_multipart(
            protocol.encode(Command.FETCH, messages.Fetch(model="lenet", digest="0" * 64))
        )
        assert sock.poll(10_000)
        reply = protocol.decode(sock.recv_multipart())
        assert reply.command is Command.ERROR and reply.payload == []
        assert reply.header.error == "FETCH is for registered workers only"
    finally:
        sock.close()


def engines_of(farm: LocalFarm, model: str, timeout: float = 60.0) -> list[dict]:
    """The workers' snapshots once one reports an engine loaded for ``model`` (heartbeats
    carry them)."""
    deadline = time.monotonic() + timeout
    with farm.client() as client:
        while time.monotonic() < deadline:
            workers = client.info()["workers"]
            if any(model in w["engines"] for w in workers):
                return workers
            time.sleep(0.2)
    raise AssertionError(f"no worker loaded {model} within {timeout:.0f} s")


def test_a_worker_fetches_its_model_option_from_the_broker(tmp_path, digits) -> None:
    """`farm worker --model NAME` with NAME only on the broker: fetched by name and loaded
    before any chunk; a --model nobody has is logged and the worker serves the rest."""
    repository = tmp_path / "broker-models"
    copy_model("lenet", repository / "digits")
    log = tmp_path / "worker.log"
    with LocalFarm(
        devices=[], algo="fifo", broker_options=["--chunk", "100", "--models-dir", str(repository)]
    ) as farm:
        with open(log, "w") as stderr:
            farm.workers.append(
                subprocess.Popen(
                    farm_command(
                        "worker",
                        "--device",
                        pinned_devices(1)[0],
                        "--broker",
                        farm.endpoint,
                        "--cache",
                        str(tmp_path / "cache"),
                        "--model",
                        "digits",
                        "--model",
                        "nosuch",
                    ),
                    stderr=stderr,
                    start_new_session=True,
                )
            )
        farm.wait_for_workers(1)
        assert engines_of(farm, "digits")[0]["fetched"] == {"digits": 1}  # before any job
        with farm.client() as client:
            outputs = client.map(digits[:200, None], model="digits")
            worker = client.info()["workers"][0]
    np.testing.assert_allclose(
        outputs, load_engine(find("lenet")).run(digits[:200, None]), atol=1e-5
    )
    assert worker["fetched"] == {"digits": 1}
    text = log.read_text()
    assert "cannot preload --model nosuch" in text and "unknown model 'nosuch'" in text
    assert "farm models add nosuch" in text
