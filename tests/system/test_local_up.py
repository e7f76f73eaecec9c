"""``farm up`` / ``farm run`` / ``farm down``: the background local farm, really started.

Each test has a runtime folder of its own (``FARM_RUNTIME_DIR``): the farm's record,
socket and log live there, and ``farm run`` looks for a farm there only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from farm.client.client import Client
from farm.ops import forked
from farm.ops.background import (
    RECORD,
    SOCKET,
    FarmRecord,
    FarmSettings,
    read_record,
    write_record,
)
from farm.ops.local import LocalFarm, farm_command
from farm.startup import process_started, process_state
from tests.conftest import reference_forward

#: Seconds any command here may take (a farm's start on a slow, loaded machine).
COMMAND_TIMEOUT = 120


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "rt"
    monkeypatch.setenv("FARM_RUNTIME_DIR", str(folder))
    return folder


def farm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        farm_command("--log-level", "WARNING", *args),
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
    )


@pytest.fixture
def farm_up(runtime: Path):
    """A farm started with ``farm up`` (one worker, LeNet loaded); stopped after the test."""
    done = farm("up", "--workers", "1", "--model", "lenet", "--idle-timeout", "600")
    assert done.returncode == 0, done.stderr
    assert "local farm up:" in done.stderr
    record = read_record(runtime)
    assert record is not None
    yield record
    farm("down")
    for pid in (record.pid, *pids(record)):
        kill_if_alive(pid)


def pids(record: FarmRecord) -> list[int]:
    """The broker's and the workers' pids."""
    return [pid for pid, _ in record.processes]


def kill_if_alive(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_exited(pid: int, seconds: float = COMMAND_TIMEOUT) -> bool:
    return forked.wait_exited(pid, seconds)


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, exited and not yet reaped, is not)."""
    found = process_state(pid)
    return found is not None and found[0] != "Z"


def run_digits(tmp_path: Path, digits: np.ndarray, *options: str) -> subprocess.CompletedProcess:
    images, out = tmp_path / "digits.npy", tmp_path / "out.npy"
    np.save(images, digits[:200])
    return farm("run", str(images), "--model", "lenet", "--quiet", "--out", str(out), *options)


def test_farm_up_is_used_by_farm_run_and_stopped_by_farm_down(
    farm_up: FarmRecord, runtime: Path, tmp_path: Path, lenet, digits, monkeypatch
) -> None:
    assert oct((runtime / RECORD).stat().st_mode & 0o777) == oct(0o600)
    assert oct(runtime.stat().st_mode & 0o777) == oct(0o700)
    assert farm_up.endpoint == f"ipc://{runtime / SOCKET}"

    done = run_digits(tmp_path, digits, "--timings")
    assert done.returncode == 0, done.stderr
    first_line = done.stderr.splitlines()[0]
    assert first_line.startswith("using the local farm of `farm up`: pid ")
    assert "starting a local farm" not in done.stderr
    outputs = np.load(tmp_path / "out.npy")
    np.testing.assert_allclose(
        outputs, reference_forward(lenet, digits[:200]), rtol=1e-3, atol=1e-4
    )
    with Client(farm_up.endpoint, timeout=10) as client:
        info = client.info()
    assert info["jobs_ended"].get("done") == 1  # the job ran on the warm farm
    assert [w["pid"] for w in info["workers"]] == pids(farm_up)[1:]

    found_by_client_commands(farm_up, tmp_path, monkeypatch)

    down = farm("down")
    assert down.returncode == 0, down.stderr
    assert "local farm stopped" in down.stderr
    assert not (runtime / RECORD).exists() and not (runtime / SOCKET).exists()
    for pid in (farm_up.pid, *pids(farm_up)):
        assert wait_exited(pid, 30) and not running(pid), pid
    assert "no local farm is up" in farm("down").stderr


def found_by_client_commands(
    farm_up: FarmRecord, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no --broker and no $FARM_BROKER, farm status, farm submit and Client() talk to
    the farm of `farm up`, and the commands say so."""
    monkeypatch.delenv("FARM_BROKER", raising=False)
    status = farm("status", "--json")
    assert status.returncode == 0, status.stderr
    assert f"using the local farm of `farm up` at {farm_up.endpoint}" in status.stderr
    assert {w["pid"] for w in json.loads(status.stdout)["workers"]} == set(pids(farm_up)[1:])
    submitted = farm(
        "submit", str(tmp_path / "digits.npy"), "--model", "lenet", "--quiet",
        "--out", str(tmp_path / "submitted.npy"),
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    assert "using the local farm of `farm up`" in submitted.stderr
    np.testing.assert_array_equal(
        np.load(tmp_path / "submitted.npy"), np.load(tmp_path / "out.npy")
    )
    with Client(timeout=10) as client:
        assert client.broker_choice.found == "local farm"
        assert client.broker == farm_up.endpoint
        assert len(client.info()["workers"]) == len(pids(farm_up)) - 1


def test_a_farm_with_farm_models_set_is_used(
    runtime: Path, tmp_path: Path, digits, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$FARM_MODELS and the same --models-dir: one folder, the same settings on both sides."""
    models = tmp_path / "models"
    models.mkdir()
    monkeypatch.setenv("FARM_MODELS", str(models))
    up = farm("up", "--workers", "1", "--models-dir", str(models), "--idle-timeout", "600")
    assert up.returncode == 0, up.stderr
    try:
        done = run_digits(tmp_path, digits)
        assert done.returncode == 0, done.stderr
        assert done.stderr.startswith("using the local farm of `farm up`")
    finally:
        assert farm("down").returncode == 0


def test_farm_run_with_other_settings_starts_its_own_farm(
    farm_up: FarmRecord, tmp_path: Path, digits
) -> None:
    done = run_digits(tmp_path, digits, "--batch", "7")
    assert done.returncode == 0, done.stderr
    assert "not using the local farm of `farm up`" in done.stderr
    assert "batch 7, not auto" in done.stderr
    assert "starting a local farm" in done.stderr


def test_a_stale_farm_is_replaced_never_used(
    farm_up: FarmRecord, runtime: Path, tmp_path: Path, digits
) -> None:
    """The supervisor killed: its broker and worker stop with it, its record and socket
    stay behind; the next ``farm run`` removes them and starts its own farm."""
    os.kill(farm_up.pid, signal.SIGKILL)
    assert wait_exited(farm_up.pid)
    for pid in pids(farm_up):  # SIGTERM when their parent died
        assert wait_exited(pid), pid
    assert (runtime / SOCKET).exists() and (runtime / RECORD).exists()

    done = run_digits(tmp_path, digits)
    assert done.returncode == 0, done.stderr
    assert f"a stale local farm (pid {farm_up.pid}" in done.stderr
    assert f"its supervisor (pid {farm_up.pid}) is gone" in done.stderr
    assert "starting a local farm" in done.stderr
    assert "using the local farm" not in done.stderr
    assert read_record(runtime) is None and not (runtime / SOCKET).exists()


def test_a_record_whose_pid_was_reused_is_stale(runtime: Path, tmp_path: Path, digits) -> None:
    """A record naming a live process that is not its supervisor (this test's own pid, a
    different start time) is not trusted."""
    runtime.mkdir(mode=0o700)
    (runtime / SOCKET).touch()
    record = FarmRecord(
        pid=os.getpid(),
        pid_started=process_started() - 100,
        endpoint=f"ipc://{runtime / SOCKET}",
        started=0,
        settings=FarmSettings(devices=("cpu:0",), models=("lenet",)),
    )
    write_record(runtime, record)
    done = run_digits(tmp_path, digits)
    assert done.returncode == 0, done.stderr
    assert f"its supervisor (pid {os.getpid()}) is gone" in done.stderr
    assert not (runtime / RECORD).exists() and not (runtime / SOCKET).exists()


@pytest.mark.skipif(os.getuid() != 0, reason="giving the folder to another user needs root")
def test_another_users_farm_is_not_used(
    farm_up: FarmRecord, runtime: Path, tmp_path: Path, digits
) -> None:
    os.chown(runtime, 65534, 65534)
    try:
        done = run_digits(tmp_path, digits)
    finally:
        os.chown(runtime, 0, 0)
    assert done.returncode == 0, done.stderr
    assert f"not using a local farm: {runtime} belongs to uid 65534" in done.stderr
    assert "starting a local farm" in done.stderr
    with Client(farm_up.endpoint, timeout=10) as client:
        assert sum(client.info()["jobs_ended"].values()) == 0  # that farm ran nothing


def test_a_folder_others_may_open_is_not_used(runtime: Path, tmp_path: Path, digits) -> None:
    runtime.mkdir(mode=0o755)
    runtime.chmod(0o755)
    done = run_digits(tmp_path, digits)
    assert done.returncode == 0, done.stderr
    assert "may be opened by other users (mode 755)" in done.stderr
    refused = farm("up", "--workers", "1")
    assert refused.returncode == 1
    assert "cannot keep a local farm there" in refused.stderr


def test_an_idle_farm_stops_by_itself(runtime: Path) -> None:
    done = farm("up", "--workers", "1", "--idle-timeout", "1")
    assert done.returncode == 0, done.stderr
    record = read_record(runtime)
    assert record is not None
    assert wait_exited(record.pid)
    for pid in pids(record):
        assert not running(pid), pid
    assert not (runtime / RECORD).exists()
    assert "no job for 1 s" in (runtime / "farm.log").read_text()


def test_a_killed_farm_run_leaves_no_process_behind(tmp_path: Path, digits) -> None:
    """``farm run``'s broker and workers are its forked children: SIGKILL it mid-job and
    they stop too."""
    images = tmp_path / "digits.npy"
    np.save(images, digits)
    run = subprocess.Popen(
        farm_command("run", str(images), "--model", "lenet", "--repeat", "100000", "--quiet"),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert run.stderr is not None
        for line in run.stderr:  # the farm is up once this line comes
            if line.startswith("farm ready in"):
                break
        children = [
            int(pid)
            for task in Path(f"/proc/{run.pid}/task").iterdir()
            for pid in (task / "children").read_text().split()
        ]
        assert len(children) == 1 + len(os.sched_getaffinity(0))  # broker + a worker per core
    finally:
        run.kill()
        run.wait()
    for pid in children:
        assert wait_exited(pid), pid


def test_timings_show_each_stage_of_a_new_farm_in_order(tmp_path: Path, digits) -> None:
    done = run_digits(tmp_path, digits, "--timings", "--workers", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stderr.split("timings, seconds since `farm run`'s process started:\n")[1]
    stages = [line.split(")", 1)[1].strip() for line in lines.splitlines() if "(+" in line]
    seconds = [float(line.split()[0]) for line in lines.splitlines() if "(+" in line]
    assert seconds == sorted(seconds) and seconds[0] == 0.0
    mine = [s for s in stages if not s.startswith("worker ")]
    assert mine == [
        "process",
        "command imported",
        "input opened",
        "shared modules imported",
        "farm launched",
        "broker listening",
        "every worker registered",
        "job submitted",
        "first result",
        "job ended",
        "farm stopping",
        "farm stopped",
        "done",
    ]
    worker = [s for s in stages if s.startswith("worker cpu:")]
    assert [s.split(": ", 1)[1] for s in worker] == ["process", "imported", "loaded"]
    assert stages.index(worker[0]) > stages.index("farm launched")
    assert stages.index(worker[-1]) < stages.index("every worker registered")


def test_farm_run_hands_its_settings_to_the_forked_farm(tmp_path: Path, digits) -> None:
    """The forked broker and workers get typed settings, not argv: the engine, the batch
    and the policy's parameter all reach them."""
    done = run_digits(
        tmp_path, digits, "--backend", "opencv", "--batch", "16", "--algo", "fifo", "--chunk", "50"
    )
    assert done.returncode == 0, done.stderr
    assert "on opencv f32 batch 16 on every worker" in done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if "/cpu:" in line]
    assert sum(int(row[3]) for row in rows) == 200 // 50  # the chunks column


def test_a_broker_on_any_port_sends_the_one_it_bound() -> None:
    """A broker started by exec on port ``*`` tells the farm its endpoint down a pipe."""
    with LocalFarm(devices=[], bind="tcp://127.0.0.1:*") as local:
        host, _, port = local.endpoint.rpartition(":")
        assert host == "tcp://127.0.0.1" and int(port) > 0
        with local.client(timeout=10.0) as client:
            assert client.info()["workers"] == []


def test_a_forked_worker_that_cannot_start_says_why_in_one_line(tmp_path: Path) -> None:
    """A forked worker reports what `farm worker` would (``Error: ...``, exit 1), not a
    Python traceback; `farm run` then names the process that exited."""
    import importlib.util

    if importlib.util.find_spec("caffe") is not None:
        pytest.skip("pycaffe is installed here: the caffe backend starts")
    done = subprocess.run(
        farm_command(
            "run", "--own-farm", "--model", "lenet", "--workers", "1", "--backend", "caffe"
        ),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr
    assert "Error: the caffe backend needs pycaffe" in done.stderr
    assert "Traceback" not in done.stderr
    assert "a farm process exited during start" in done.stderr
