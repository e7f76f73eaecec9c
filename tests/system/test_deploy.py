"""``farm deploy supervisord``: the layout it plans, the file it writes, and a real supervisord
running that file: a broker and pinned workers that come back after a kill -9."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from farm.cli.deploy import deploy
from farm.client.client import Client, FarmTimeout
from farm.ops.deploy import (
    BROKER_STARTSECS,
    CPU_STARTSECS,
    GPU_STARTSECS,
    STARTRETRIES,
    Layout,
    parse_ids,
)
from tests.conftest import reference_forward

REPO = Path(__file__).resolve().parents[2]

#: The committed example, and the options that make it (README of deploy/).
EXAMPLE = REPO / "deploy" / "supervisord.conf"
EXAMPLE_ARGS = [
    "--cpus",
    "0-1",
    "--run-dir",
    "/tmp/farm",
    "--model",
    "lenet",
    "--farm-command",
    "farm",
    "-o",
    "deploy/supervisord.conf",
]


def generate(*args: str) -> str:
    """``farm deploy supervisord ARGS``'s output; the test fails on a non-zero exit."""
    result = CliRunner().invoke(deploy, ["supervisord", *args], prog_name="farm deploy")
    assert result.exit_code == 0, result.output
    return result.output


def refused(*args: str) -> str:
    """The usage error ``farm deploy supervisord ARGS`` exits with."""
    result = CliRunner().invoke(deploy, ["supervisord", *args], prog_name="farm deploy")
    assert result.exit_code == 2, result.output
    return result.output


def parsed(text: str, tmp_path: Path):
    """The configuration as supervisord itself reads it: its ServerOptions."""
    options = pytest.importorskip("supervisor.options")
    path = tmp_path / "farm.conf"
    path.write_text(text)
    server = options.ServerOptions()
    server.realize(args=["-c", str(path)])
    return server


def programs(server) -> dict[str, list[str]]:
    """Program name -> its command line, split as supervisord splits it."""
    return {
        process.name: shlex.split(process.command)
        for group in server.process_group_configs
        for process in group.process_configs
    }


# ----------------------------------------------------------------- layout


@pytest.mark.parametrize(
    "text, ids",
    [
        ("0-7", (0, 1, 2, 3, 4, 5, 6, 7)),
        ("0,2,4-6", (0, 2, 4, 5, 6)),
        ("3", (3,)),
        ("5,1, 2-3", (1, 2, 3, 5)),
    ],
)
def test_core_lists_are_parsed(text: str, ids: tuple[int, ...]) -> None:
    assert parse_ids(text, "core") == ids


@pytest.mark.parametrize(
    "text, reason",
    [
        ("", "malformed"),
        ("a", "malformed"),
        ("0-", "malformed"),
        ("-1", "malformed"),
        ("1;2", "malformed"),
        ("3-1", "backwards"),
        ("0-3,2", "names 2 twice"),
    ],
)
def test_malformed_core_lists_are_refused(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_ids(text, "core")


def test_each_gpu_takes_the_highest_free_core() -> None:
    layout = Layout.plan(tuple(range(8)), (0, 1))
    assert layout.cpu_cores == (0, 1, 2, 3, 4, 5)
    assert layout.gpus == ((0, 7), (1, 6))


def test_as_many_gpus_as_cores_leaves_no_cpu_worker() -> None:
    assert Layout.plan((2, 3), (0, 1)) == Layout((), ((0, 3), (1, 2)))


def test_more_gpus_than_cores_is_refused() -> None:
    with pytest.raises(ValueError, match="3 GPUs need a core each"):
        Layout.plan((0, 1), (0, 1, 2))


# ----------------------------------------------------------------- the file


def test_a_broker_and_one_pinned_worker_per_core_and_gpu(tmp_path: Path) -> None:
    server = parsed(
        generate(
            "--cpus",
            "0-3",
            "--gpus",
            "0",
            "--model",
            "lenet",
            "--model",
            "cifar10_quick",
            "--run-dir",
            str(tmp_path),
        ),
        tmp_path,
    )
    commands = programs(server)
    farm = [os.path.abspath(sys.executable), "-m", "farm"]
    assert commands["farm-broker"] == [
        *farm,
        "broker",
        "--bind",
        "tcp://127.0.0.1:5555",
        "--algo",
        "equal-finish",
    ]
    worker = ["--broker", "tcp://127.0.0.1:5555", "--model", "lenet", "--model", "cifar10_quick"]
    for core in (0, 1, 2):
        assert commands[f"farm-cpu-{core}"] == [*farm, "worker", "--device", f"cpu:{core}", *worker]
    assert commands["farm-gpu-0"] == [
        "taskset",
        "-c",
        "3",
        *farm,
        "worker",
        "--device",
        "gpu:0",
        *worker,
    ]
    groups = {group.name: group for group in server.process_group_configs}
    assert sorted(p.name for p in groups["farm-workers"].process_configs) == [
        "farm-cpu-0",
        "farm-cpu-1",
        "farm-cpu-2",
        "farm-gpu-0",
    ]
    for group in groups.values():
        for process in group.process_configs:
            assert process.priority == (10 if process.name == "farm-broker" else 20)
            assert process.startsecs == STARTSECS.get(process.name, CPU_STARTSECS)
            assert process.startretries == STARTRETRIES and process.redirect_stderr
            assert process.stopsignal == signal.SIGTERM
            assert process.stdout_logfile == str(tmp_path / f"{process.name}.log")
    assert server.logfile == str(tmp_path / "supervisord.log")
    assert server.pidfile == str(tmp_path / "supervisord.pid")
    assert server.server_configs[0]["file"] == str(tmp_path / "supervisor.sock")
    assert server.server_configs[0]["chmod"] == 0o700
    assert server.nodaemon is False


STARTSECS = {"farm-broker": BROKER_STARTSECS, "farm-gpu-0": GPU_STARTSECS}


def test_default_cores_are_those_this_process_may_run_on(tmp_path: Path) -> None:
    commands = programs(parsed(generate("--run-dir", str(tmp_path)), tmp_path))
    cores = sorted(os.sched_getaffinity(0))
    assert sorted(commands) == sorted(["farm-broker", *(f"farm-cpu-{core}" for core in cores)])


def test_extra_arguments_pass_through_verbatim(tmp_path: Path) -> None:
    text = generate(
        "--cpus",
        "0",
        "--broker-arg=--chunk",
        "--broker-arg",
        "500",
        "--worker-arg=--slots",
        "--worker-arg=3",
        "--worker-arg",
        "a 100% 'odd' arg",
        "--algo",
        "fifo",
        "--run-dir",
        str(tmp_path),
    )
    commands = programs(parsed(text, tmp_path))
    assert commands["farm-broker"][-4:] == ["--algo", "fifo", "--chunk", "500"]
    assert commands["farm-cpu-0"][-3:] == ["--slots", "3", "a 100% 'odd' arg"]


def test_workers_connect_to_loopback_when_the_broker_binds_every_interface() -> None:
    text = generate("--cpus", "0", "--bind", "tcp://*:6000")
    assert "--bind 'tcp://*:6000'" in text
    assert "--broker tcp://127.0.0.1:6000" in text
    assert "--broker tcp://10.0.0.1:7000" in generate(
        "--cpus", "0", "--bind", "tcp://0.0.0.0:1", "--connect", "tcp://10.0.0.1:7000"
    )


def test_a_worker_only_host_has_no_broker_and_needs_the_brokers_address(tmp_path: Path) -> None:
    assert "--connect" in refused("--no-broker")
    text = generate(
        "--cpus",
        "0-1",
        "--no-broker",
        "--connect",
        "tcp://10.0.0.1:5555",
        "--run-dir",
        str(tmp_path),
    )
    assert sorted(programs(parsed(text, tmp_path))) == ["farm-cpu-0", "farm-cpu-1"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cpus", "0-x"], "malformed core list"),
        (["--gpus", "1,1"], "GPU list '1,1' names 1 twice"),
        (["--cpus", "0-1", "--gpus", "0-2"], "3 GPUs need a core each"),
        (["--bind", "tcp://127.0.0.1:*"], "needs a fixed port"),
        (["--run-dir", "/tmp/" + "x" * 100], "too long for supervisord's unix socket"),
        (["--worker-arg", "a ;b"], "start a comment"),
        (["--algo", "nope"], "Invalid value for '--algo'"),
    ],
)
def test_bad_input_is_refused_with_a_reason(args: list[str], message: str) -> None:
    assert message in refused(*args)


def test_the_header_says_how_it_was_made_and_how_to_run_it() -> None:
    text = generate("--cpus", "0-1", "--worker-arg=--slots", "--worker-arg", "3")
    assert (
        "; Generated by: farm deploy supervisord --cpus 0-1 --worker-arg=--slots "
        "--worker-arg 3\n" in text
    )
    assert "; Start:    mkdir -p /tmp/farm && supervisord -c supervisord.conf\n" in text


def test_the_committed_example_is_what_the_command_writes(tmp_path: Path, monkeypatch) -> None:
    """deploy/supervisord.conf is regenerated, not edited (see deploy/README.md)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "deploy").mkdir()
    generate(*EXAMPLE_ARGS)
    assert (tmp_path / "deploy" / "supervisord.conf").read_text() == EXAMPLE.read_text()


# ----------------------------------------------------------------- a real supervisord


def supervisor_tool(name: str) -> str | None:
    """The supervisor command installed next to this Python, else on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, or a short folder under /tmp when tmp_path is too long for a unix socket."""
    if len(str(tmp_path / "supervisor.sock")) <= 100:
        yield tmp_path
        return
    short = Path(tempfile.mkdtemp(prefix="farm-sv-", dir="/tmp"))
    try:
        yield short
    finally:
        shutil.rmtree(short, ignore_errors=True)


class SupervisordLog:
    """supervisord's foreground log, read line by line; waits are on lines, not on a clock."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self.read, args=(stream,), daemon=True)
        self.thread.start()

    def read(self, stream) -> None:
        for line in stream:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()
        with self.changed:
            self.lines.append("<supervisord exited>")
            self.changed.notify_all()

    def wait_for(self, pattern: str, after: int = 0, timeout: float = 60.0) -> re.Match:
        """The first line from index ``after`` on that matches ``pattern``."""
        found: list[re.Match] = []

        def seen() -> bool:
            found[:] = [m for line in self.lines[after:] if (m := re.search(pattern, line))][:1]
            return bool(found) or "<supervisord exited>" in self.lines[after:]

        with self.changed:
            if not self.changed.wait_for(seen, timeout) or not found:
                raise AssertionError(f"supervisord never logged {pattern!r}:\n" + self.text())
        return found[0]

    def text(self) -> str:
        with self.changed:
            return "\n".join(self.lines)


class Supervised:
    """A supervisord started in the foreground on a generated configuration."""

    def __init__(self, supervisord: str, supervisorctl: str, config: Path) -> None:
        self.supervisorctl = supervisorctl
        self.config = config
        self.process = subprocess.Popen(
            [supervisord, "-n", "-c", str(config)],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.log = SupervisordLog(self.process.stdout)

    def ctl(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.supervisorctl, "-c", str(self.config), *args],
            text=True,
            capture_output=True,
            timeout=30,
        )

    def pid(self, program: str) -> int:
        return int(self.ctl("pid", program).stdout)

    def wait_running(self, program: str, after: int = 0) -> None:
        self.log.wait_for(rf"success: {re.escape(program)} entered RUNNING state", after)

    def wait_for_workers(self, endpoint: str, count: int, timeout: float = 60.0) -> dict:
        """The broker's registry once ``count`` workers joined; retried while supervisord runs."""
        deadline = time.monotonic() + timeout
        with Client(endpoint, timeout=1.0) as client:
            while True:
                try:
                    return client.info(wait_workers=count)
                except FarmTimeout:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(f"no {count} workers:\n{self.log.text()}") from None

    def shutdown(self) -> None:
        try:
            self.ctl("shutdown")
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.thread.join(10)
        self.process.stdout.close()


SUPERVISORD = supervisor_tool("supervisord")
SUPERVISORCTL = supervisor_tool("supervisorctl")


@pytest.mark.skipif(
    SUPERVISORD is None or SUPERVISORCTL is None,
    reason="supervisord is not installed (pip install 'supervisor>=4.2')",
)
def test_supervised_farm_runs_a_job_through_a_kill_9_and_restarts_the_worker(
    run_dir: Path, lenet, digits
) -> None:
    cores = sorted(os.sched_getaffinity(0))[:2]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = run_dir / "farm.conf"
    generate(
        "--cpus",
        ",".join(map(str, cores)),
        "--bind",
        endpoint,
        "--model",
        "lenet",
        "--run-dir",
        str(run_dir),
        "-o",
        str(config),
    )
    # started after 1 s instead of CPU_STARTSECS (the FATAL test checks those): the kill
    # and the restart, not the start, are what this test is about
    config.write_text(config.read_text().replace(f"startsecs = {CPU_STARTSECS}", "startsecs = 1"))
    workers = [f"farm-cpu-{core}" for core in cores]
    images = np.resize(digits, (20_000, 28, 28))
    farm = Supervised(SUPERVISORD, SUPERVISORCTL, config)
    try:
        for program in ["farm-broker", *workers]:
            farm.wait_running(program)
        farm.wait_for_workers(endpoint, len(workers))
        victim = workers[0]
        victim_pid = farm.pid(f"farm-workers:{victim}")
        killed_at: list[int] = []

        def kill_once(count: int) -> None:
            if not killed_at:
                killed_at.append(len(farm.log.lines))
                os.kill(victim_pid, signal.SIGKILL)

        outcome: dict = {}

        def submit() -> None:
            try:
                with Client(endpoint, timeout=30) as client:
                    outcome["result"] = client.run(images, "lenet", progress=kill_once)
            except BaseException as exc:  # reported by the test's thread
                outcome["error"] = exc

        job = threading.Thread(target=submit, daemon=True)
        job.start()
        job.join(90)
        assert not job.is_alive(), f"the job did not finish after {victim} was killed"
        assert "error" not in outcome, outcome.get("error")
        assert killed_at, "the job never reported progress"
        outputs = outcome["result"].outputs  # the client checked that every image came back
        assert outputs.shape == (len(images), 10)
        expected = reference_forward(lenet, digits)  # images repeat the digits
        np.testing.assert_allclose(outputs, np.resize(expected, outputs.shape), atol=1e-5)

        farm.log.wait_for(rf"exited: {victim} \(terminated by SIGKILL", killed_at[0])
        farm.wait_running(victim, killed_at[0])
        info = farm.wait_for_workers(endpoint, len(workers))
        pids = {farm.pid(f"farm-workers:{program}") for program in workers}
        assert victim_pid not in pids
        assert {worker["pid"] for worker in info["workers"]} == pids
        status = farm.ctl("status")
        assert status.returncode == 0, status.stdout
        states = dict(line.split()[:2] for line in status.stdout.splitlines())
        assert states == {
            "farm-broker": "RUNNING",
            **{f"farm-workers:{program}": "RUNNING" for program in workers},
        }
    finally:
        farm.shutdown()


@pytest.mark.skipif(
    SUPERVISORD is None or SUPERVISORCTL is None,
    reason="supervisord is not installed (pip install 'supervisor>=4.2')",
)
def test_a_worker_that_fails_at_start_ends_fatal_not_respawned_for_ever(run_dir: Path) -> None:
    """A GPU worker on a machine whose torch sees no GPU fails after seconds (the torch
    import): each start is a failed one, and supervisord gives up on it."""
    if cuda_devices() > 0:
        pytest.skip("this machine has a GPU: the GPU worker would start")
    config = run_dir / "farm.conf"
    core = str(sorted(os.sched_getaffinity(0))[-1])
    generate(
        "--cpus", core, "--gpus", "0", "--no-broker", "--connect",
        f"tcp://127.0.0.1:{free_port()}", "--run-dir", str(run_dir), "-o", str(config),
    )  # fmt: skip
    text = config.read_text()
    assert f"startsecs = {GPU_STARTSECS}\n" in text
    # one retry instead of STARTRETRIES: the same verdict, in two failed starts
    config.write_text(text.replace(f"startretries = {STARTRETRIES}", "startretries = 1"))
    farm = Supervised(SUPERVISORD, SUPERVISORCTL, config)
    try:
        farm.log.wait_for(r"gave up: farm-gpu-0 entered FATAL state", timeout=120)
        spawned = [line for line in farm.log.lines if "spawned: 'farm-gpu-0'" in line]
        assert len(spawned) == 2, farm.log.text()
        states = dict(line.split()[:2] for line in farm.ctl("status").stdout.splitlines())
        assert states == {"farm-workers:farm-gpu-0": "FATAL"}
        assert "Error: device gpu:0" in (run_dir / "farm-gpu-0.log").read_text()
    finally:
        farm.shutdown()


def cuda_devices() -> int:
    """CUDA devices torch sees here; 0 without torch."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


# ----------------------------------------------------------------- slurm

SLURM_EXAMPLE = REPO / "deploy" / "farm.sbatch"
SLURM_EXAMPLE_ARGS = [
    "--nodes",
    "2",
    "--gpus-per-node",
    "1",
    "--model",
    "lenet",
    "--farm-command",
    "farm",
    "--sbatch=--time=1:00:00",
    "--submit",
    "farm submit images.npy --model lenet --out out.npy",
    "-o",
    "deploy/farm.sbatch",
]


def slurm_script(*args: str) -> str:
    result = CliRunner().invoke(deploy, ["slurm", *args], prog_name="farm deploy")
    assert result.exit_code == 0, result.output
    return result.output


def test_a_slurm_script_asks_for_cores_and_gpus_and_runs_a_step_for_each() -> None:
    text = slurm_script(
        "--nodes",
        "2",
        "--cores-per-node",
        "16",
        "--gpus-per-node",
        "2",
        "--model",
        "lenet",
        "--sbatch=--time=2:00:00",
        "--submit",
        "farm submit a.npy --model lenet --out 'o u t.npy'",
    )
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=farm",
        "#SBATCH --nodes=2",
        "#SBATCH --output=farm-%j.out",
        "#SBATCH --signal=B:TERM@60",
        "#SBATCH --ntasks-per-node=16",
        "#SBATCH --cpus-per-task=1",
        "#SBATCH --gres=gpu:2",
        "#SBATCH --time=2:00:00",
    ]
    assert "GPUS_PER_NODE=2\n" in text and "MODELS=(--model lenet)\n" in text
    assert "worker --device cpu:bound" in text and "--cpu-bind=cores" in text
    assert "--gres=gpu:1" in text and "worker --device gpu:0" in text
    assert "(\nfarm submit a.npy --model lenet --out 'o u t.npy'\n) &\n" in text
    assert 'farm keys init "$JOB_DIR/keys"' in text  # keys made per job by default


def test_a_workers_only_script_joins_a_broker_and_serves() -> None:
    text = slurm_script("--connect", "tcp://node7:5555", "--curve", "/shared/keys")
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    assert "export FARM_BROKER=tcp://node7:5555\n" in text
    assert "export FARM_CURVE=/shared/keys\n" in text
    assert " broker --bind" not in text and "keys init" not in text
    assert 'wait "${WORKER_PIDS[@]}"' in text and "#SBATCH --exclusive" in text
    assert "CURVE_ARGS=()" in slurm_script("--no-curve")


def test_the_script_reads_slurms_cpu_counts_per_node() -> None:
    from farm.ops.slurm import FUNCTIONS

    shell = "\n".join(FUNCTIONS) + '\nexpand_counts "16(x2),8,4(x1)"\n'
    done = subprocess.run(["bash"], input=shell, capture_output=True, text=True)
    assert done.stdout.strip() == "16 16 8 4"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cores-per-node", "2", "--gpus-per-node", "3"], "needs a core each to feed it"),
        (["--connect", "tcp://h:1"], "give the broker's keys folder with --curve DIR"),
        (
            ["--connect", "tcp://h:1", "--no-curve", "--submit", "farm status"],
            "not in a workers-only job",
        ),
        (["--curve", "k", "--no-curve"], "contradict"),
        (["--submit", "farm submit a\nrm -rf b"], "must be one line"),
        (["--job-name", "a b"], "--job-name 'a b'"),
        (["--connect", "tcp://h:1", "--no-curve", "--port", "5555"], "a workers-only job"),
        (["--model", "a\nb"], "must be one line"),
        (["--submit", "farm submit a.npy )"], "the script would not run: bash says"),
    ],
)
def test_a_slurm_script_that_could_not_run_is_refused(args: list[str], message: str) -> None:
    result = CliRunner().invoke(deploy, ["slurm", *args], prog_name="farm deploy")
    assert result.exit_code == 2 and message in result.output, result.output


def test_the_committed_slurm_example_is_what_the_command_writes(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(REPO)
    out = tmp_path / "farm.sbatch"
    args = [*SLURM_EXAMPLE_ARGS[:-1], str(out)]
    slurm_script(*args)
    written = out.read_text().replace(str(out), "deploy/farm.sbatch")
    assert written == SLURM_EXAMPLE.read_text(), (
        "deploy/farm.sbatch is stale: farm deploy slurm " + " ".join(SLURM_EXAMPLE_ARGS)
    )
    assert os.access(out, os.X_OK)


def test_status_waits_for_workers_and_says_how_many_came(tmp_path: Path, local_farm) -> None:
    from farm.ops.local import farm_command
    from tests.system.conftest import pinned_devices

    local = local_farm(0)
    started = time.monotonic()
    done = subprocess.run(
        farm_command("status", "--broker", local.endpoint, "--wait-workers", "2", "--timeout", "1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "0 of 2 workers registered within 1 s" in done.stderr
    assert time.monotonic() - started < 30
    [device] = pinned_devices(1)
    local.start_worker(device)
    done = subprocess.run(
        farm_command(
            "status", "--broker", local.endpoint, "--wait-workers", "1", "--timeout", "60"
        ),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0 and device in done.stdout, done.stderr


def test_a_bound_worker_pins_itself_to_the_core_it_was_given() -> None:
    from farm.workers.worker import Device

    device = Device.parse("cpu:bound")
    assert device.pinned and device.index in os.sched_getaffinity(0)

    def bound(cores: str, local: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "SLURM_LOCALID"}
        env.update({"SLURM_LOCALID": local} if local is not None else {})
        done = subprocess.run(
            [
                "taskset",
                "-c",
                cores,
                sys.executable,
                "-c",
                "from farm.workers.worker import Device; print(Device.parse('cpu:bound'))",
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert bound("1", None) == bound("1", "0") == "cpu:1"  # the one core it was given
    # two Slurm tasks given the same two CPUs (a core's hyperthreads) take one each
    assert (bound("0,1", "0"), bound("0,1", "1"), bound("0,1", "2")) == ("cpu:0", "cpu:1", "cpu:0")
    assert bound("0,1", None) == "cpu:0"  # taskset with several: the first


def run_script_part(text: str, tail: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """The generated script's definitions (up to its first Slurm command), then ``tail``,
    run by bash with ``tmp_path`` first on PATH."""
    head = text[: text.index("trap 'on_signal 143' TERM")]
    return subprocess.run(
        ["bash", "-c", head + tail],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        env={
            **os.environ,
            "PATH": f"{tmp_path}:{os.environ['PATH']}",
            "SLURM_JOB_ID": "7",
            "FARM_CURVE": "/elsewhere",
        },
    )


def test_a_farm_command_named_farm_runs_the_program_not_the_function(tmp_path: Path) -> None:
    program = tmp_path / "farm"
    program.write_text('#!/bin/sh\necho "the farm program: $*"\n')
    program.chmod(0o755)
    text = slurm_script("--farm-command", "farm", "--submit", "farm status")
    done = run_script_part(
        text, 'farm status --json; echo "curve: ${FARM_CURVE-unset}"\n', tmp_path
    )
    assert done.stdout.splitlines() == ["the farm program: status --json", "curve: unset"], (
        done.stderr
    )
    assert (tmp_path / "farm-7").is_dir()  # the job's folder, beside its output


def test_the_jobs_exit_status_is_the_first_failing_lines(tmp_path: Path) -> None:
    text = slurm_script(
        "--submit", "true", "--submit", "exit 3", "--submit", "exit 5", "--submit", "true"
    )
    body = text[text.index("status=0\n") : text.index('stop_farm\nsay "done')]
    done = run_script_part(text, body + 'echo "status $status"\n', tmp_path)
    assert done.stdout.splitlines()[-1] == "status 3", done.stdout + done.stderr
