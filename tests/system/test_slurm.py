"""``farm deploy slurm`` against a real Slurm: Debian's slurmctld, two slurmd and munge on
this machine (``tests/system/slurm.py``).  The generated script is submitted as it is: a 20
000-image
job comes back exact, a node's worker step cancelled mid-job costs nothing but time, a
standing farm takes workers from a second job, and nothing is left behind."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from farm.ops.local import cores, farm_command
from tests.conftest import reference_forward
from tests.system.slurm import SlurmCluster

pytestmark = [
    pytest.mark.skipif(len(cores()) < 2, reason="two Slurm nodes need two cores"),
    pytest.mark.timeout(600),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    reason = cluster.start()
    if reason is not None:
        pytest.skip(f"Slurm cannot start here: {reason}")
    yield cluster
    cluster.stop()


def deploy(folder: Path, *options: str) -> Path:
    """``farm deploy slurm OPTIONS -o folder/farm.sbatch``; the script's path."""
    script = folder / "farm.sbatch"
    done = subprocess.run(
        farm_command("deploy", "slurm", *options, "-o", str(script)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return script


def sbatch(cluster: SlurmCluster, script: Path, wait: bool) -> subprocess.Popen:
    """Submit from the script's folder; with ``wait``, the process ends with the job."""
    return subprocess.Popen(
        [
            "sbatch",
            "--parsable",
            *(["--wait"] if wait else []),
            "--chdir",
            str(script.parent),
            str(script),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cluster.env,
    )


def job_id(submitted: subprocess.Popen) -> str:
    assert submitted.stdout is not None
    line = submitted.stdout.readline().strip()
    assert re.fullmatch(r"\d+(;\S+)?", line), (line, submitted.stderr)
    return line.split(";")[0]


def wait_for(check, seconds: float, what: str):
    """Poll ``check`` until it returns something true (Slurm's states have no event to
    wait on)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {seconds} s")


def assert_stopped_cleanly(job_dir: Path, workers: int) -> None:
    """Every worker said goodbye to the broker: none was killed."""
    log = (job_dir / "broker.log").read_text()
    assert log.count("left (disconnected)") == workers, log[-2000:]


def assert_nothing_left(cluster: SlurmCluster, folder: Path) -> None:
    """squeue empty, and no process of this test's farm alive."""
    wait_for(lambda: cluster.squeue() == "", 60, "squeue empty")
    left = subprocess.run(["pgrep", "-af", str(folder)], capture_output=True, text=True)
    assert left.stdout == "", left.stdout


def farm_status(job_dir: Path) -> dict:
    done = subprocess.run(
        farm_command("status", "--json"),
        capture_output=True,
        text=True,
        timeout=30,
        env={
            **os.environ,
            "FARM_BROKER": (job_dir / "endpoint").read_text().strip(),
            "FARM_CURVE": str(job_dir / "keys"),
        },
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def save_images(folder: Path, digits: np.ndarray, count: int) -> tuple[Path, np.ndarray]:
    images = np.resize(digits[:, None], (count, 1, *digits.shape[1:]))
    path = folder / "images.npy"
    np.save(path, images)
    return path, images


def expected(lenet, digits: np.ndarray, count: int) -> np.ndarray:
    """The reference outputs of ``count`` images, the digits repeated (each computed once)."""
    once = reference_forward(lenet, digits[:, None])
    return np.resize(once, (count, *once.shape[1:]))


def test_sbatch_runs_a_job_exactly_and_leaves_nothing(cluster, tmp_path, lenet, digits) -> None:
    """The nodes share the job's folder (as a cluster shares NFS): the workers read the
    images themselves (``--shared``), and the broker carries only where they lie."""
    path, _ = save_images(tmp_path, digits, 20_000)
    script = deploy(
        tmp_path,
        "--nodes",
        "2",
        "--model",
        "lenet",
        "--submit",
        f"farm submit {path} --model lenet --out {tmp_path / 'out.npy'} --quiet --shared",
        "--submit",
        f"farm status --json > {tmp_path / 'status.json'}",
    )
    submitted = sbatch(cluster, script, wait=True)
    job = job_id(submitted)
    assert submitted.wait(timeout=300) == 0, (tmp_path / f"farm-{job}.out").read_text()
    log = (tmp_path / f"farm-{job}.out").read_text()
    assert "4 workers registered" in log and "done (exit status 0)" in log
    outputs = np.load(tmp_path / "out.npy")
    np.testing.assert_allclose(outputs, expected(lenet, digits, 20_000), atol=1e-5)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["stats"]["unshared_workers"] == 0
    assert "DATA" not in status["traffic"]["received"], "no image crossed the broker"
    assert status["traffic"]["input_bytes"] / 20_000 < 200
    keys = tmp_path / f"farm-{job}" / "keys"
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for key in [*keys.glob("*.key*"), *keys.glob("authorized/*/*.key")]:
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    assert_stopped_cleanly(tmp_path / f"farm-{job}", 4)
    assert_nothing_left(cluster, tmp_path)


def test_a_node_lost_mid_job_costs_only_time(cluster, tmp_path, lenet, digits) -> None:
    """``scancel JOB.STEP`` of n2's worker step kills its workers at once (SIGKILL); their
    chunks go back, and the job still comes back exact."""
    path, _ = save_images(tmp_path, digits, 200_000)
    script = deploy(
        tmp_path,
        "--nodes",
        "2",
        "--model",
        "lenet",
        "--submit",
        f"farm submit {path} --model lenet --out {tmp_path / 'out.npy'} --quiet",
    )
    submitted = sbatch(cluster, script, wait=True)
    job = job_id(submitted)
    job_dir = tmp_path / f"farm-{job}"

    def started() -> bool:
        if not (job_dir / "endpoint").is_file():
            return False
        jobs = farm_status(job_dir).get("jobs", [])
        return bool(jobs) and jobs[0]["done"] >= 20_000

    wait_for(started, 120, "the job a fifth done")
    steps = dict(
        line.split() for line in cluster.squeue("-s", "-j", job, "-o", "%j %i").splitlines()
    )
    subprocess.run(["scancel", steps["farm-workers-n2"]], env=cluster.env, check=True, timeout=30)
    wait_for(
        lambda: "farm-workers-n2" not in cluster.squeue("-s", "-j", job, "-o", "%j"),
        30,
        "n2's worker step gone",
    )
    assert farm_status(job_dir)["jobs"][0]["done"] < 200_000  # lost while the job ran
    assert submitted.wait(timeout=400) == 0, (tmp_path / f"farm-{job}.out").read_text()
    np.testing.assert_allclose(
        np.load(tmp_path / "out.npy"), expected(lenet, digits, 200_000), atol=1e-5
    )
    log = (tmp_path / f"farm-{job}.out").read_text()
    assert " lost with their workers" in log, log  # "1 was lost ..." or "2 were lost ..."
    lost = [
        line
        for line in (job_dir / "broker.log").read_text().splitlines()
        if "left (its connection closed)" in line
    ]  # SIGKILL: no goodbye
    assert len(lost) == 2
    assert_stopped_cleanly(job_dir, 2)  # n1's two, at the end
    assert_nothing_left(cluster, tmp_path)


def test_a_standing_farm_takes_workers_from_another_job(cluster, tmp_path, lenet, digits) -> None:
    """A broker job with no submit lines serves until stopped; a workers-only job
    (``--connect``) on the other node joins it, and a client's job runs on both.  The
    joiner leaves at a plain scancel; the standing farm stops cleanly at scancel -b -s TERM."""
    broker_dir, joiner_dir = tmp_path / "broker", tmp_path / "joiner"
    broker_dir.mkdir()
    joiner_dir.mkdir()
    standing = job_id(
        sbatch(cluster, deploy(broker_dir, "--nodes", "1", "--model", "lenet"), wait=False)
    )
    job_dir = broker_dir / f"farm-{standing}"
    log = broker_dir / f"farm-{standing}.out"
    wait_for(
        lambda: log.is_file() and "workers registered" in log.read_text(),
        120,
        "the standing farm's workers",
    )
    endpoint = (job_dir / "endpoint").read_text().strip()
    joiner = job_id(
        sbatch(
            cluster,
            deploy(
                joiner_dir,
                "--nodes",
                "1",
                "--connect",
                endpoint,
                "--curve",
                str(job_dir / "keys"),
                "--model",
                "lenet",
            ),
            wait=False,
        )
    )
    joined = joiner_dir / f"farm-{joiner}.out"
    wait_for(
        lambda: joined.is_file() and "2 workers registered" in joined.read_text(),
        120,
        "the joiner's two workers",
    )
    assert len(farm_status(job_dir)["workers"]) == 4
    from farm.client.client import Client

    _, images = save_images(tmp_path, digits, 20_000)
    with Client(endpoint, curve=str(job_dir / "keys")) as client:
        result = client.run(images, "lenet")
    np.testing.assert_allclose(result.outputs, expected(lenet, digits, 20_000), atol=1e-5)
    assert {share.device.split(":")[0] for share in result.summary.workers} == {"cpu"}
    assert len(result.summary.workers) == 4
    subprocess.run(["scancel", joiner], env=cluster.env, check=True, timeout=30)
    wait_for(lambda: len(farm_status(job_dir)["workers"]) == 2, 60, "the joiner's workers gone")
    subprocess.run(
        ["scancel", "-b", "-s", "TERM", standing], env=cluster.env, check=True, timeout=30
    )
    assert_nothing_left(cluster, tmp_path)
    assert "stopping: signalled" in log.read_text()
    assert_stopped_cleanly(job_dir, 4)  # scancel SIGTERMs the joiner's workers: goodbyes too
