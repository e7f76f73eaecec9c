"""Operating a farm: status, metrics, traces and reports, several jobs, cancellation.

One real farm for the module: a broker (fifo chunks of 500, Prometheus metrics
on a free port) and one pinned worker process per core, on loopback.  Jobs run
in threads with clients of their own, as separate users' jobs would.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from farm import defaults
from farm.client.client import Client, FarmError, JobResult
from farm.client.npy import NpyReader
from farm.ops.local import LocalFarm, farm_command
from tests.conftest import reference_forward

CHUNK = 500


@pytest.fixture(scope="module")
def farm(module_local_farm) -> LocalFarm:
    # exact message counts: no backup attempts (a loaded machine may start one)
    return module_local_farm(2, chunk=CHUNK, metrics_port=0, preload=["lenet"], backup_share=0)


@pytest.fixture(scope="module")
def reference(lenet, digits) -> np.ndarray:
    return reference_forward(lenet, digits)


@pytest.fixture(scope="module")
def speed(farm, digits) -> float:
    """LeNet's images per second of compute on this farm's fastest worker, from a warm-up
    job: jobs that must last a while are sized by it, so they last as long on any CPU."""
    with farm.client() as client:
        summary = client.run(repeated(digits, 20 * CHUNK), "lenet").summary
    return max(share.rate for share in summary.workers)


def repeated(digits: np.ndarray, count: int) -> np.ndarray:
    return np.resize(digits, (count, *digits.shape[1:]))


def blank(folder: Path, count: int) -> NpyReader:
    """``count`` blank digits in a `.npy` file that is all hole (sparse): a job as long as a
    test needs, for no memory or disk."""
    path = folder / f"blank-{count}.npy"
    np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(count, 28, 28)).flush()
    return NpyReader.open(path)


def expected(reference: np.ndarray, count: int) -> np.ndarray:
    return np.resize(reference, (count, reference.shape[1]))


class JobThread:
    """A job run by a client of its own in a thread; ``started`` is set at its first
    result, ``reached`` once ``threshold`` images are back (or the job ended)."""

    def __init__(
        self,
        local: LocalFarm,
        images: np.ndarray | NpyReader,
        threshold: int | None = None,
        **options: Any,
    ) -> None:
        self.client = local.client()
        self.images, self.options = images, options
        self.threshold = len(images) if threshold is None else threshold
        self.started, self.reached = threading.Event(), threading.Event()
        self.answered = 0
        self.result: JobResult | None = None
        self.error: BaseException | None = None
        self.finished_at = 0.0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def progress(self, count: int) -> None:
        self.answered += count
        self.started.set()
        if self.answered >= self.threshold:
            self.reached.set()

    def run(self) -> None:
        try:
            self.result = self.client.run(
                self.images, "lenet", progress=self.progress, **self.options
            )
        except BaseException as exc:  # reported by ``join``
            self.error = exc
        finally:
            self.finished_at = time.monotonic()
            self.started.set()
            self.reached.set()

    def __enter__(self) -> JobThread:
        self.thread.start()
        assert self.started.wait(60), "the job never produced a result"
        return self

    def join(self) -> JobResult:
        self.thread.join(120)
        assert not self.thread.is_alive(), "the job did not end"
        if self.error:
            raise self.error
        return self.result

    def __exit__(self, *_: Any) -> None:
        self.thread.join(120)
        self.client.close()


def status_json(local: LocalFarm) -> dict[str, Any]:
    """``farm status --json``, the real command."""
    done = subprocess.run(
        farm_command("status", "--json", "--broker", local.endpoint),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def job_with_total(snapshot: dict[str, Any], total: int) -> dict[str, Any]:
    [job] = [job for job in snapshot["jobs"] if job["total"] == total]
    return job


def scrape(local: LocalFarm) -> dict[tuple[str, tuple], float]:
    """The metrics endpoint over HTTP: (sample name, sorted labels) -> value."""
    with local.client() as client:
        url = client.info()["metrics"]
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total_of(metrics: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include ``labels``."""
    return sum(
        value
        for (sample, sample_labels), value in metrics.items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )


def test_status_json_lists_every_worker_and_job_with_their_states(farm, speed, tmp_path) -> None:
    # 20 s of the whole farm's compute: it runs on past the snapshot, then it is cancelled
    images = blank(tmp_path, int(20 * speed * len(farm.devices)))
    before = status_json(farm)
    # three heartbeats' worth of the farm's work back: every worker's heartbeats counted it
    counted = int(3 * defaults.HEARTBEAT * speed * len(farm.devices))
    with JobThread(farm, images, threshold=counted, priority=3) as running:
        assert running.reached.wait(60)
        assert running.answered < len(images), "the job ended before it was counted"
        seen = running.answered
        snapshot = status_json(farm)
        running.client.cancel()
        result = running.join()
    workers, jobs = snapshot["workers"], snapshot["jobs"]
    assert len(workers) == len(farm.devices)
    assert sorted(w["device"] for w in workers) == sorted(farm.devices)
    for worker in workers:
        assert worker["state"] == "busy" and 1 <= worker["in_flight"] <= worker["slots"]
        assert worker["backend"] == "auto" and "lenet" in worker["loaded"]
        assert worker["engines"]["lenet"].split()[0] in ("opencv", "onnxruntime", "openvino")
        assert worker["heartbeat_age_s"] < 5 * snapshot["heartbeat"]
        assert 0 < worker["busy_share"] <= 1 and worker["rate"] > 0
    [job] = jobs
    assert (job["model"], job["policy"], job["priority"], job["state"]) == (
        "lenet",
        "fifo",
        3,
        "running",
    )
    assert job["total"] == len(images) and seen <= job["done"] < len(images)
    assert job["in_flight"] == sum(w["in_flight"] for w in workers)
    assert job["workers"] == len(workers) and job["client"].endswith(f":{os.getpid()}")
    assert all(w["jobs"] == [job["job"]] for w in workers)

    assert result.cancelled == "cancelled by the client"
    after = status_json(farm)
    assert after["jobs"] == []
    assert all(w["state"] == "idle" and w["in_flight"] == 0 for w in after["workers"])
    assert after["jobs_ended"]["cancelled"] == before["jobs_ended"]["cancelled"] + 1
    computed = sum(w["items_done"] for w in after["workers"]) - sum(
        w["items_done"] for w in before["workers"]
    )
    delivered = len(images) - sum(f.count for f in result.failed)
    assert computed >= delivered  # chunks stopped by the cancel may have run in part


def test_metrics_scraped_over_http_move_with_the_job_and_match_its_results(
    farm, digits, reference
) -> None:
    before = scrape(farm)
    with farm.client() as client:
        result = client.run(repeated(digits, 20_000), "lenet")
    after = scrape(farm)

    def moved(name: str, **labels: str) -> float:
        return total_of(after, name, **labels) - total_of(before, name, **labels)

    np.testing.assert_allclose(result.outputs, expected(reference, 20_000), atol=1e-5)
    assert not result.summary.shared
    shares = {share.name: share for share in result.summary.workers}
    for name, share in shares.items():
        assert moved("farm_worker_images_total", worker=name) == share.items
        assert moved("farm_worker_chunks_total", worker=name) == share.chunks
        assert moved("farm_worker_compute_seconds_total", worker=name) == pytest.approx(
            share.compute_s, rel=1e-6
        )
    chunks = sum(share.chunks for share in shares.values())
    assert chunks == 20_000 // CHUNK
    assert moved("farm_images_delivered_total") == 20_000
    for histogram in (
        "farm_chunk_compute_seconds",
        "farm_chunk_queue_seconds",
        "farm_chunk_transfer_seconds",
    ):
        assert moved(f"{histogram}_count") == chunks
        assert moved(f"{histogram}_bucket", le="+Inf") == chunks
    assert moved("farm_chunk_compute_seconds_sum") == pytest.approx(
        sum(share.compute_s for share in shares.values()), rel=1e-6
    )
    assert moved("farm_jobs_ended_total", outcome="done") == 1
    # a chunk is five messages through the broker, and each image's 784 bytes cross it twice;
    # the job's probe (a NEED of one image before it holds any slot) is one NEED and DATA more
    for direction, command in (("sent", "NEED"), ("received", "DATA")):
        assert (
            moved("farm_broker_messages_total", direction=direction, command=command) == chunks + 1
        )
    assert moved("farm_broker_messages_total", direction="sent", command="TASK") == chunks
    assert moved("farm_broker_messages_total", direction="received", command="RESULT") == chunks
    assert 2 * 784 * 20_000 < moved("farm_broker_input_bytes_total") < 2.2 * 784 * 20_000
    assert total_of(after, "farm_jobs") == 0 and total_of(after, "farm_workers") == len(shares)
    assert total_of(after, "farm_worker_chunks_in_flight") == 0
    for name in shares:
        assert 0 <= total_of(after, "farm_worker_heartbeat_age_seconds", worker=name) < 5


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as handle:
        head = handle.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_farm_report_draws_a_real_trace_whose_totals_match_the_job(farm, digits, tmp_path) -> None:
    images = tmp_path / "images.npy"
    np.save(images, repeated(digits, 20_000))
    trace, png = tmp_path / "run.json", tmp_path / "run.png"
    submitted = subprocess.run(
        farm_command(
            "submit", str(images), "--broker", farm.endpoint, "--quiet", "--trace", str(trace)
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submitted.returncode == 0, submitted.stderr
    reported = subprocess.run(
        farm_command("report", str(trace), "-o", str(png), "--width", "900", "--height", "600"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert reported.returncode == 0, reported.stderr
    assert png_size(png) == (900, 600)

    document = json.loads(trace.read_text())
    chunks, workers = document["chunks"], document["workers"]
    assert document["items"] == 20_000 and document["failed"] == []
    assert len(document["job"]) == 32 and document["policy"] == "fifo"
    assert sum(chunk["count"] for chunk in chunks) == 20_000 == sum(w["items"] for w in workers)
    covered = sorted((chunk["start"], chunk["count"]) for chunk in chunks)
    assert all(a + n == b for (a, n), (b, _) in zip(covered, covered[1:]))
    for worker in workers:
        mine = [chunk for chunk in chunks if chunk["worker"] == worker["name"]]
        assert len(mine) == worker["chunks"] and sum(c["count"] for c in mine) == worker["items"]
    for chunk in chunks:
        moments = [
            chunk[key] for key in ("assigned", "sent", "arrived", "started", "finished", "received")
        ]
        assert moments == sorted(moments) and 0 <= moments[0]
        assert moments[-1] <= document["broker_seconds"] + 1e-6
    assert "20,000 images" in reported.stdout and "waste" in reported.stdout


def test_a_small_job_is_not_starved_by_a_big_one_and_both_finish(farm, digits, reference) -> None:
    with JobThread(farm, repeated(digits, 100_000)) as big:
        with farm.client() as client:
            # 10 000 images: more than one worker computes in a big job's chunk (a quarter
            # of a second while jobs share), so the other worker frees a slot meanwhile
            small = client.run(repeated(digits, 10_000), "lenet")
        answered_then = big.answered
        big_result = big.join()
    np.testing.assert_allclose(small.outputs, expected(reference, 10_000), atol=1e-5)
    np.testing.assert_allclose(big_result.outputs, expected(reference, 100_000), atol=1e-5)
    # sharing fairly, the big job did about as much as the small one meanwhile (twice as
    # much should the small one hold the slots of a core half as fast): a count, not a time,
    # so a pause of the whole machine stalls both alike.  Fair sharing counts slots, not
    # workers: on cores of unequal speed each job may keep to one, so that is not asserted.
    assert answered_then < 30_000, "the small job waited for the big one"
    assert small.summary.shared and big_result.summary.shared


def test_a_cancelled_job_frees_every_worker_within_a_second_and_costs_others_nothing(
    farm, digits, reference
) -> None:
    with (
        JobThread(farm, repeated(digits, 100_000)) as doomed,
        JobThread(farm, repeated(digits, 30_000)) as other,
    ):
        with farm.client() as watcher:
            doomed_id = job_with_total(watcher.info(), 100_000)["job"]
            cancelled_at = time.monotonic()
            doomed.client.cancel()
            while any(doomed_id in w["jobs"] for w in watcher.info()["workers"]):
                assert time.monotonic() - cancelled_at < 1.0, "a worker still holds its chunks"
            freed = time.monotonic() - cancelled_at
        cancelled, finished = doomed.join(), other.join()
    assert freed < 1.0
    assert cancelled.cancelled == "cancelled by the client" and cancelled.failed
    answered = ~np.isnan(cancelled.outputs).any(axis=1)
    assert sum(f.count for f in cancelled.failed) == (~answered).sum() > 0
    np.testing.assert_allclose(
        cancelled.outputs[answered], expected(reference, 100_000)[answered], atol=1e-5
    )
    assert not finished.failed and finished.duplicates == 0 and finished.cancelled is None
    np.testing.assert_allclose(finished.outputs, expected(reference, 30_000), atol=1e-5)


def fastest_rate(client: Client) -> float:
    """The speed the broker caps chunks by: its fastest worker's images per second of
    compute, over all it ran."""
    return max(
        w["items_done"] / w["compute_s"] for w in client.info()["workers"] if w["compute_s"] > 0
    )


def test_each_job_may_bring_its_own_policy_and_a_timeout(farm, speed, digits, tmp_path) -> None:
    images = repeated(digits, 2_000)
    workers = len(farm.devices)
    with farm.client() as client:
        own = client.run(images, "lenet", algo="fifo", params={"chunk": 100})
        assert own.summary.policy == "fifo"
        assert sum(share.chunks for share in own.summary.workers) == 20  # not the broker's 500s
        # static cuts one chunk per worker, here 5 s of compute each; the broker's cap (1 s
        # on the fastest worker) cuts it into 5, 3 at least should the speeds double meanwhile
        total = int(5 * fastest_rate(client) * workers)
        capped = client.run(blank(tmp_path, total), "lenet", algo="static", trace=True)
        assert len(capped.trace.chunks) >= 3 * workers
        assert sum(chunk.count for chunk in capped.trace.chunks) == total
        with pytest.raises(FarmError, match="takes no parameter chunk"):
            client.run(images, "lenet", algo="hat", params={"chunk": 5})
        # 10 s of the farm's compute, cut short by the timeout
        late = client.run(blank(tmp_path, int(10 * speed * workers)), "lenet", job_timeout=1.0)
    assert late.cancelled and "timeout of 1 s passed" in late.cancelled
    missing = sum(f.count for f in late.failed)
    assert 0 < missing < len(late.outputs)
    assert np.isnan(late.outputs).any(axis=1).sum() == missing
    assert status_json(farm)["jobs_ended"]["timed_out"] >= 1


def test_higher_priority_jobs_are_offered_free_workers_first(digits, local_farm) -> None:
    """Three jobs queued behind a running one on a fifo-sharing broker: the urgent one,
    submitted last, is offered the first free slot."""
    local = local_farm(1, chunk=CHUNK, sharing="fifo", preload=["lenet"])
    with JobThread(local, repeated(digits, 40_000)) as first:
        # 10 chunks each: the urgent job, running at once, is still listed when it is seen
        jobs = [
            JobThread(local, repeated(digits, 10 * CHUNK + n), priority=priority)
            for n, priority in enumerate((0, 0, 10))
        ]
        with local.client() as client:
            for listed, job in enumerate(jobs, start=2):  # one at a time, the urgent one last
                job.thread.start()
                deadline = time.monotonic() + 60
                while len(listing := client.info()["jobs"]) < listed:
                    assert time.monotonic() < deadline, f"{listed} jobs were never listed"
            order = [job["total"] for job in listing]
        results = [job.join() for job in jobs]
        first.join()
        for job in jobs:
            job.client.close()
    assert order[0] == 10 * CHUNK + 2, f"status lists jobs in the order they get slots: {order}"
    assert all(not result.failed for result in results)
    assert jobs[2].finished_at <= min(jobs[0].finished_at, jobs[1].finished_at)


def test_settings_come_from_the_option_then_the_environment_then_the_toml_file(
    farm, tmp_path
) -> None:
    config = tmp_path / "farm.toml"
    config.write_text(f'broker-address = "{farm.endpoint}"\n[status]\ntimeout = 2.0\n')
    environment = {**os.environ, "FARM_CONFIG": str(config)}

    def status(*args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            farm_command("status", "--json", *args),
            capture_output=True,
            text=True,
            timeout=60,
            env={**environment, **env},
        )

    assert status().returncode == 0  # the file's broker address
    nobody = "tcp://127.0.0.1:9"
    refused = status(FARM_BROKER=nobody)  # the environment beats the file
    assert refused.returncode == 1 and nobody in refused.stderr
    assert "Traceback" not in refused.stderr and "is a broker running" in refused.stderr
    assert status("--broker", farm.endpoint, FARM_BROKER=nobody).returncode == 0  # option wins
    config.write_text("[status]\nbogus = 1\n")
    broken = status()
    assert broken.returncode == 1 and "[status] has no option 'bogus'" in broken.stderr
    config.write_text('log-level = "verbose"\n')
    broken = status()
    assert broken.returncode == 1 and "log-level" in broken.stderr
    assert "Traceback" not in broken.stderr


def test_json_logs_are_one_object_per_line(tmp_path) -> None:
    broker = subprocess.Popen(
        farm_command("--log-format", "json", "broker", "--bind", "tcp://127.0.0.1:*"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = broker.stderr.readline()
    finally:
        broker.terminate()
        broker.communicate(timeout=30)
    entry = json.loads(line)
    assert entry["level"] == "INFO" and entry["logger"] == "farm.broker"
    assert entry["pid"] == broker.pid and "listening on tcp://127.0.0.1:" in entry["message"]
    assert entry["event"] == "broker_started" and entry["endpoint"] in entry["message"]


def test_a_job_with_odd_policy_parameters_is_refused_and_the_farm_serves_on(farm, digits) -> None:
    with farm.client() as client:
        for algo, params in (
            ("sliced", {"slice": 2.5}),
            ("fifo", {"chunk": 1.5}),
            ("hat", {"slice": "many"}),
        ):
            with pytest.raises(FarmError, match="job policy: .*slice|job policy: .*chunk"):
                client.run(digits[:100], "lenet", algo=algo, params=params)
        with pytest.raises(FarmError, match="params need algo"):
            client.run(digits[:100], "lenet", params={"chunk": 10})
        assert not client.run(digits[:1000], "lenet").failed
