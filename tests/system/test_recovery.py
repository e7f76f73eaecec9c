"""Pull the plug on any one process mid-job: every image still comes back exactly once.

Real broker and worker processes on loopback, killed with SIGKILL or frozen
with SIGSTOP at the first result of a job.  Heartbeats every 0.2 s and a
liveness of 5 make a silent peer count as gone after 1 s.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from farm.client.client import Client, FarmError, FarmTimeout, JobResult
from farm.ops.local import LocalFarm, farm_command
from tests.conftest import reference_forward

LINK = ["--heartbeat", "0.2", "--liveness", "5"]
EXPIRY = 1.0  # 0.2 s x 5


@pytest.fixture
def recovering_farm(local_farm) -> Callable[..., LocalFarm]:
    """``recovering_farm(workers, *worker_options, **broker_options)``: a farm whose peers
    count each other gone after EXPIRY of silence, with fifo chunks of 200, and no backup
    attempts (they would run a frozen or killed worker's chunks before its expiry: these
    tests are of the recovery itself; tests/system/test_tail.py has backups)."""

    def start(workers: int, *worker_options: str, **broker_options: Any) -> LocalFarm:
        return local_farm(
            workers,
            broker_options=LINK,
            worker_options=[*LINK, *worker_options],
            preload=["lenet"],
            **{"chunk": 200, "backup_share": 0, **broker_options},
        )

    return start


def run_and_act(local: LocalFarm, images: np.ndarray, act: Callable[[], None]) -> JobResult:
    """Run a job, calling ``act`` once, when its first result arrives."""
    acted = []

    def progress(count: int) -> None:
        if not acted:
            acted.append(True)
            act()

    with Client(local.endpoint, timeout=60, heartbeat=0.2) as client:
        result = client.run(images, "lenet", progress=progress)
    assert acted, "the job finished before anything could happen to it"
    return result


def assert_exactly_once(result: JobResult, images: np.ndarray, reference: np.ndarray) -> None:
    """Every output equal to the reference, none duplicated, none failed, all accounted."""
    assert not result.failed and result.duplicates == 0
    np.testing.assert_allclose(result.outputs, reference, atol=1e-5)
    summary = result.summary  # kept results done nothing in any worker's share
    assert sum(share.items for share in summary.workers) + summary.kept == summary.items


@pytest.fixture(scope="module")
def job(lenet, digits) -> tuple[np.ndarray, np.ndarray]:
    """30 000 digits (the sample, repeated) and their reference outputs."""
    images = np.resize(digits, (30_000, 28, 28))
    reference = np.resize(reference_forward(lenet, digits), (30_000, 10))
    return images, reference


def stats(local: LocalFarm) -> dict:
    with local.client() as client:
        return client.info()["stats"]


def await_stat(local: LocalFarm, name: str, minimum: int, timeout: float = 10.0) -> dict:
    """The broker's stats once counter ``name`` reaches ``minimum`` (asked over INFO)."""
    return await_stats(local, lambda current: current[name] >= minimum, timeout)


def await_stats(local: LocalFarm, reached: Callable[[dict], bool], timeout: float = 10.0) -> dict:
    """The broker's stats once ``reached`` says so, or when ``timeout`` passes (asked over
    INFO)."""
    deadline = time.monotonic() + timeout
    with local.client() as client:
        while True:
            current = client.info()["stats"]
            if reached(current) or time.monotonic() > deadline:
                return current


def test_kill_one_of_two_workers_mid_job(job, recovering_farm) -> None:
    images, reference = job
    local = recovering_farm(2)
    victim = local.workers[0]
    result = run_and_act(local, images, victim.kill)
    assert victim.wait(10) == -signal.SIGKILL
    assert_exactly_once(result, images, reference)
    after = stats(local)
    # its closed connection told the broker at once, and only the chunk it was computing
    # was charged: the one queued behind it ran again uncharged
    assert (after["workers_crashed"], after["workers_expired"]) == (1, 0)
    summary = result.summary
    assert summary.failed_attempts <= 1 and summary.failed_attempts + summary.lost_attempts >= 1


def test_kill_the_only_worker_then_a_new_one_finishes_the_job(job, recovering_farm) -> None:
    images, reference = job
    local = recovering_farm(1)
    first = local.workers[0]

    def replace_worker() -> None:
        first.kill()
        local.start_worker(local.devices[0])

    result = run_and_act(local, images, replace_worker)
    assert_exactly_once(result, images, reference)
    names = {share.name for share in result.summary.workers}
    assert f":{local.workers[1].pid}/" in " ".join(names), "the new worker did the rest"


def test_kill_the_broker_mid_job_and_restart_it_on_the_same_address(job, recovering_farm) -> None:
    images, reference = job
    local = recovering_farm(2)
    result = run_and_act(local, images, local.restart_broker)
    assert result.resubmissions >= 1
    assert not result.failed and result.duplicates == 0
    np.testing.assert_allclose(result.outputs, reference, atol=1e-5)
    with local.client() as client:
        info = client.info(wait_workers=2)
    workers = info["workers"]
    assert len(workers) == 2, "both workers came back"
    # with their speeds: the new broker caps their first chunks
    assert all(worker["items_done"] > 0 for worker in workers)
    # and with the results they had sent the lost broker, offered again (the client took
    # those it lacked; the rest are not counted as duplicates)
    assert info["stats"]["kept_results"] >= 1


def test_a_frozen_worker_is_declared_dead_and_its_late_result_dropped(job, recovering_farm) -> None:
    images, reference = job
    local = recovering_farm(2)
    frozen = local.workers[0]
    stopped_at: list[float] = []

    def freeze() -> None:
        frozen.send_signal(signal.SIGSTOP)
        stopped_at.append(time.monotonic())

    try:
        result = run_and_act(local, images, freeze)
        finished = time.monotonic()
        after_job = stats(local)
    finally:
        frozen.send_signal(signal.SIGCONT)
    assert_exactly_once(result, images, reference)
    assert after_job["workers_expired"] == 1 and after_job["requeued_chunks"] >= 1
    # silence says nothing against the chunks: they ran again, uncharged
    assert result.summary.failed_attempts == 0 and result.summary.lost_attempts >= 1
    assert finished - stopped_at[0] > EXPIRY, "the job waited for the expiry"
    with local.client() as client:
        client.info(wait_workers=2)  # the thawed worker heard DISCONNECT and came back
    # its result reached the broker: dropped as late, or (sent over the connection that
    # replaced the one its chunk came on) held as kept; never delivered, its job ended
    after = await_stats(local, lambda now: now["late_replies"] + now["kept_results"] >= 1)
    assert after["late_replies"] + after["kept_results"] >= 1, after
    assert after["kept_delivered"] == 0


def test_a_worker_that_says_goodbye_mid_job_charges_its_chunks_nothing(
    job, recovering_farm
) -> None:
    images, reference = job
    local = recovering_farm(2)
    leaving = local.workers[0]
    result = run_and_act(local, images, lambda: leaving.send_signal(signal.SIGTERM))
    assert leaving.wait(10) == 0
    assert_exactly_once(result, images, reference)
    assert result.summary.failed_attempts == 0


def test_an_image_run_max_runs_times_is_given_up_as_its_own_cause(job, recovering_farm) -> None:
    """With --max-runs 1, a chunk held by a frozen worker is not run a second time: it is
    reported, as lost rather than failed."""
    images, reference = job
    local = recovering_farm(2, max_runs=1)
    frozen = local.workers[0]
    try:
        result = run_and_act(local, images, lambda: frozen.send_signal(signal.SIGSTOP))
    finally:
        frozen.send_signal(signal.SIGCONT)
    assert result.failed, "the frozen worker held no chunk"
    assert all(
        f.error.startswith("ran 1 times without a result, its workers lost or failing")
        and "silent for" in f.error
        for f in result.failed
    )
    failed = np.zeros(len(images), bool)
    for f in result.failed:
        failed[f.start : f.start + f.count] = True
    np.testing.assert_allclose(result.outputs[~failed], reference[~failed], atol=1e-5)


def test_a_poison_chunk_is_narrowed_down_to_its_bad_images(lenet, digits, recovering_farm) -> None:
    """Both workers fail any chunk holding items 250..260: the chunk is halved down to
    single images, and only those 11 are reported, each with its own last error."""
    images = digits[:1000]
    reference = reference_forward(lenet, images)
    local = recovering_farm(2, "--fail-items", "250-260")
    with Client(local.endpoint, timeout=60, heartbeat=0.2) as client:
        result = client.run(images, "lenet")
        with pytest.raises(
            FarmError,
            match=r"item 250: failed by itself 2 times "
            r"on 2 device\(s\)",
        ):
            client.map(images, "lenet")
    after = stats(local)
    assert [(f.start, f.count) for f in result.failed] == [(i, 1) for i in range(250, 261)]
    assert all("injected fault on items 250..260" in f.error for f in result.failed)
    assert np.isnan(result.outputs[250:261]).all()
    keep = np.r_[0:250, 261:1000]
    np.testing.assert_allclose(result.outputs[keep], reference[keep], atol=1e-5)
    assert after["abandoned_chunks"] == 22 and after["narrowed_chunks"] >= 2
    # what narrowing cost: the chunk's 200 images ran about 2 x log2(200) times over
    assert 1000 < result.summary.items_run < 1000 + 200 * 2 * 9


def test_a_failed_attempt_runs_again_on_another_device(lenet, digits, recovering_farm) -> None:
    """A third worker, on the first one's core, fails items 250..260; the other core does
    not.  A chunk failed on one device runs next on another, so it comes back."""
    images = digits[:1000]
    local = recovering_farm(2)
    local.start_worker(local.devices[0], "--fail-items", "250-260")
    local.wait_for_workers(3)
    with Client(local.endpoint, timeout=60, heartbeat=0.2) as client:
        result = client.run(images, "lenet")
    assert not result.failed and result.duplicates == 0
    assert result.summary.failed_attempts <= 1
    np.testing.assert_allclose(result.outputs, reference_forward(lenet, images), atol=1e-5)


def test_farm_submit_lists_failed_images_and_exits_1(
    lenet, digits, tmp_path, recovering_farm
) -> None:
    images = digits[:1000]
    np.save(tmp_path / "in.npy", images)
    local = recovering_farm(2, "--fail-items", "250-251")
    done = subprocess.run(
        farm_command(
            "--log-level",
            "ERROR",
            "submit",
            str(tmp_path / "in.npy"),
            "--broker",
            local.endpoint,
            "--out",
            str(tmp_path / "out.npy"),
            "--quiet",
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert (
        "2 images failed:\n  item 250: failed by itself 2 times on 2 device(s); last: "
    ) in done.stderr
    assert "Traceback" not in done.stderr
    outputs = np.load(tmp_path / "out.npy")
    assert np.isnan(outputs[250:252]).all() and not np.isnan(outputs[:250]).any()
    np.testing.assert_allclose(outputs[252:], reference_forward(lenet, images[252:]), atol=1e-5)


def test_a_client_with_no_broker_gives_up_after_its_timeout(digits) -> None:
    """Re-submitting every expiry must not restart the timeout: it counts from the last word
    the broker said (here: none)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with Client(f"tcp://127.0.0.1:{port}", timeout=2.0, heartbeat=0.2) as client:
        with pytest.raises(FarmTimeout, match="no reply from broker .* in 2.0 s"):
            client.run(digits[:10], "lenet")
    assert 2.0 <= time.monotonic() - started < 10


def test_a_killed_client_s_job_is_dropped_at_once_not_after_its_silence(
    digits, tmp_path, local_farm
) -> None:
    """The broker's heartbeat of 10 s would wait 50 s for a silent client; its closed
    connection ends its job at once (the chunks in flight finish, kept for a resume)."""
    np.save(tmp_path / "in.npy", np.resize(digits, (200_000, 28, 28)))
    local = local_farm(2, chunk=500, heartbeat=10, preload=["lenet"])
    client = subprocess.Popen(
        farm_command(
            "--log-level",
            "ERROR",
            "submit",
            str(tmp_path / "in.npy"),
            "--broker",
            local.endpoint,
            "--quiet",
        )
    )
    try:
        with local.client() as watcher:
            deadline = time.monotonic() + 60
            while not any(job["done"] for job in watcher.info()["jobs"]):
                assert time.monotonic() < deadline, "the job never started"
            client.kill()
            client.wait(10)
            after = await_stat(local, "jobs_expired", 1, timeout=20)
            assert after["jobs_expired"] == 1
            assert watcher.info()["jobs"] == []
    finally:
        client.kill()


def test_workers_that_reconnect_while_the_broker_stalls_charge_nothing(
    job, recovering_farm
) -> None:
    """The broker frozen past the workers' expiry: they say goodbye and reconnect, so
    their old connections closing are not taken for crashes."""
    images, reference = job
    local = recovering_farm(2)
    broker = local.running_broker()
    thaw = threading.Timer(3 * EXPIRY, broker.send_signal, args=(signal.SIGCONT,))

    def stall() -> None:
        broker.send_signal(signal.SIGSTOP)
        thaw.start()

    try:
        result = run_and_act(local, images, stall)
    finally:
        thaw.cancel()
        broker.send_signal(signal.SIGCONT)
    after = stats(local)
    assert not result.failed and result.duplicates == 0
    np.testing.assert_allclose(result.outputs, reference, atol=1e-5)
    assert (after["workers_crashed"], after["charged_attempts"]) == (0, 0)
