"""The real farm on loopback: a broker process, pinned worker processes, real model files."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from farm.client.client import Client, FarmError
from farm.client.npy import NpyReader, NpyWriter
from farm.ops.local import LocalFarm
from tests.conftest import reference_forward


def test_outputs_match_an_in_process_forward(farm_two_workers, lenet, digits) -> None:
    with farm_two_workers.client() as client:
        result = client.run(digits, "lenet")
    np.testing.assert_allclose(result.outputs, reference_forward(lenet, digits), atol=1e-5)
    summary = result.summary
    assert summary.items == len(digits)
    assert sum(share.items for share in summary.workers) == len(digits)
    assert len(summary.workers) == 2, "both workers should have taken chunks"
    assert 0 < summary.rate and summary.waste < 1


def test_order_is_kept_for_a_size_not_a_multiple_of_the_chunk(
    farm_two_workers, lenet, digits
) -> None:
    images = digits[::-1][:357]  # 357 = 3 x 100 + 57, reversed so order errors show
    with farm_two_workers.client() as client:
        outputs = client.map(images, model="lenet")
    assert outputs.shape == (357, 10)
    np.testing.assert_allclose(outputs, reference_forward(lenet, images), atol=1e-5)


@pytest.mark.parametrize(
    "convert",
    [
        lambda x: x,  # uint8 N x H x W
        lambda x: x[:, None],  # uint8 N x 1 x H x W
        lambda x: x.astype(np.float32)[:, None],  # float32 N x C x H x W
        lambda x: x.astype(np.float32),  # float32 N x H x W
    ],
    ids=["uint8-NHW", "uint8-NCHW", "float32-NCHW", "float32-NHW"],
)
def test_uint8_and_float32_inputs(farm_two_workers, lenet, digits, convert) -> None:
    images = convert(digits[:250])
    with farm_two_workers.client() as client:
        outputs = client.map(images, model="lenet")
    np.testing.assert_allclose(outputs, reference_forward(lenet, images), atol=1e-5)


def test_a_job_of_one_image(farm_two_workers, lenet, digits) -> None:
    with farm_two_workers.client() as client:
        outputs = client.map(digits[7:8], model="lenet")
    assert outputs.shape == (1, 10)
    np.testing.assert_allclose(outputs, reference_forward(lenet, digits[7:8]), atol=1e-5)


def test_two_clients_at_once_each_get_their_own_results(farm_two_workers, lenet, digits) -> None:
    inputs = {"a": np.resize(digits, (6000, 28, 28)), "b": np.resize(digits[::-1], (4500, 28, 28))}
    results: dict[str, np.ndarray] = {}
    spans: dict[str, tuple[float, float]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def submit(name: str) -> None:
        try:
            with farm_two_workers.client() as client:
                start.wait()
                began = time.monotonic()
                results[name] = client.map(inputs[name], model="lenet")
                spans[name] = (began, time.monotonic())
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=submit, args=(name,)) for name in inputs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert spans["a"][0] < spans["b"][1] and spans["b"][0] < spans["a"][1], "jobs did not overlap"
    for name, images in inputs.items():
        np.testing.assert_allclose(results[name], reference_forward(lenet, images), atol=1e-5)


def test_workers_are_pinned_to_their_cores(farm_two_workers) -> None:
    for process, device in zip(farm_two_workers.workers, farm_two_workers.devices):
        status = Path(f"/proc/{process.pid}/status").read_text()
        allowed = next(
            line.split(":")[1].strip()
            for line in status.splitlines()
            if line.startswith("Cpus_allowed_list")
        )
        assert allowed == device.split(":")[1]


def test_registry_lists_every_worker(farm_two_workers) -> None:
    with farm_two_workers.client() as client:
        info = client.info()
    assert sorted(w["device"] for w in info["workers"]) == sorted(farm_two_workers.devices)
    assert all(w["backend"] == "auto" and "lenet" in w["models"] for w in info["workers"])


def test_an_unpinned_worker_serves_too(lenet, digits, local_farm) -> None:
    with local_farm(devices=["cpu"], chunk=300).client() as client:
        outputs = client.map(digits, model="lenet")
    np.testing.assert_allclose(outputs, reference_forward(lenet, digits), atol=1e-5)


def test_a_chunk_longer_than_the_client_timeout_still_completes(lenet, digits, local_farm) -> None:
    """The broker heartbeats the client while a job runs, so only silence times out."""
    timeout = 1.0
    local = local_farm(1, heartbeat=0.1, max_chunk_seconds=0)
    with local.client() as client:  # the worker's speed here sizes the chunk
        warm_up = client.run(np.resize(digits, (5000, 28, 28)), "lenet")
    count = int(3 * timeout * warm_up.summary.workers[0].rate)  # 3 timeouts of compute
    with local.client(timeout=timeout) as client:
        result = client.run(
            np.resize(digits, (count, 28, 28)), "lenet", algo="fifo", params={"chunk": count}
        )
    assert result.summary.seconds > timeout, "the job was too short to show anything"
    assert [share.chunks for share in result.summary.workers] == [1]
    np.testing.assert_allclose(result.outputs[:1000], reference_forward(lenet, digits), atol=1e-5)


def test_a_worker_that_cannot_start_is_reported_not_waited_for() -> None:
    with pytest.raises(FarmError, match="exited during start"):
        with LocalFarm(devices=["cpu:4096"]):
            pass


def test_npy_file_in_and_out_a_chunk_at_a_time(farm_two_workers, lenet, digits, tmp_path) -> None:
    """Input read from a .npy by ranges, outputs written to a .npy as they come."""
    images = np.resize(digits, (1234, 28, 28))
    np.save(tmp_path / "in.npy", images)
    writer = NpyWriter(tmp_path / "out.npy", len(images))
    with Client(farm_two_workers.endpoint) as client:
        result = client.run(NpyReader.open(tmp_path / "in.npy"), "lenet", out=writer)
    writer.close()
    assert result.outputs is None and not result.failed and result.duplicates == 0
    np.testing.assert_allclose(
        np.load(tmp_path / "out.npy"), reference_forward(lenet, images), atol=1e-5
    )


def test_pinned_workers_run_one_thread(farm_two_workers) -> None:
    with farm_two_workers.client() as client:
        workers = client.info()["workers"]
    assert [w["threads"] for w in workers] == [1] * len(workers)
    assert all("lenet" in w["loaded"] for w in workers)


def test_summary_counts_a_worker_that_got_no_share(farm_two_workers, digits) -> None:
    """Waste is against every worker offered the job, not only those that ran it."""
    with farm_two_workers.client() as client:
        client.run(np.resize(digits, (4000, 28, 28)), "lenet")  # both workers build a history
        summary = client.run(digits[:50], "lenet").summary  # one chunk: one worker idles
    assert sorted(share.items for share in summary.workers) == [0, 50]
    assert all(share.rate > 0 for share in summary.workers)
    assert summary.theoretical_rate == pytest.approx(sum(s.rate for s in summary.workers))


def test_a_worker_stopped_mid_job_hands_its_chunks_on(lenet, digits, local_farm) -> None:
    """SIGTERM one of two workers mid-job: every image still comes back once, right."""
    images = np.resize(digits, (30_000, 28, 28))
    halfway = threading.Event()
    received = 0

    def progress(count: int) -> None:
        nonlocal received
        received += count
        if received >= 3000:
            halfway.set()

    local = local_farm(devices=["cpu", "cpu"], chunk=100, preload=["lenet"])
    outcome: dict = {}
    thread = threading.Thread(
        target=lambda: outcome.update(result=local.client().run(images, "lenet", progress=progress))
    )
    thread.start()
    assert halfway.wait(60)
    local.workers[0].terminate()
    thread.join(120)
    result = outcome["result"]
    np.testing.assert_allclose(result.outputs[:1000], reference_forward(lenet, digits), atol=1e-5)
    np.testing.assert_allclose(result.outputs[-1000:], reference_forward(lenet, digits), atol=1e-5)
    shares = sorted(share.items for share in result.summary.workers)
    assert sum(shares) == len(images)
    assert shares[0] < 0.3 * len(images), "the stopped worker should have done little"
