"""Several hosts on one machine: a broker and two worker hosts in Linux network namespaces.

Each host is a network namespace of its own; each worker host reaches the broker
host over a veth link of its own (10.231.1.0/24 and 10.231.2.0/24), so a link can
be cut under a running job.  Broker, workers and client are the real processes
(``python -m farm ...`` and a small client script), speaking TCP with CurveZMQ.

Needs root and iproute2 (``ip netns``); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq.auth

from farm.ops.local import farm_command
from tests.conftest import reference_forward

ROOT = Path(__file__).resolve().parents[2]
PORT = 5555
HEARTBEAT, LIVENESS = "0.2", "5"  # a silent peer is declared gone after 1 s
JOB = 20_000  # LeNet images: about a second on two cores
#: Seconds any awaited event may take before the test fails (generous: CI cores are shared).
WAIT = 60.0
#: Seconds a process gets to exit after SIGTERM before SIGKILL.
GRACE = 5.0

#: Run inside the broker's namespace: wait for the workers, run one job, report it as JSON.
CLIENT_SCRIPT = """
import json, sys
from dataclasses import asdict

import msgspec
import numpy as np

from farm.client.client import Client
from farm.client.npy import NpyReader

endpoint, keys, images_path, out_path, workers = sys.argv[1:6]
shared = sys.argv[6:] == ["shared"]  # the workers read the .npy themselves
images = NpyReader.open(images_path) if shared else np.load(images_path)


def say(tag, value):
    print(tag, json.dumps(value, default=str), flush=True)


with Client(endpoint, timeout=60.0, heartbeat=0.2, curve=keys) as client:
    say("ready", client.info(wait_workers=int(workers)))
    result = client.run(
        images, "lenet", progress=lambda n: print("progress", n, flush=True), shared=shared
    )
    np.save(out_path, result.outputs)
    say("result", {"duplicates": result.duplicates, "resubmissions": result.resubmissions,
                   "failed": [asdict(f) for f in result.failed],
                   "items": result.summary.items, "seconds": result.summary.seconds,
                   "shared": result.shared,
                   "rate": result.summary.rate, "waste": result.summary.waste,
                   "workers": msgspec.to_builtins(result.summary.workers)})
    say("info", client.info())
"""


class Process:
    """A process whose stdout and stderr lines are read by threads: awaitable, never blocking."""

    def __init__(self, name: str, args: list[str]) -> None:
        self.name = name
        self.popen = subprocess.Popen(
            args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1
        )
        self.stdout: queue.Queue[str | None] = queue.Queue()
        self.stderr: queue.Queue[str | None] = queue.Queue()
        self.stderr_tail: deque[str] = deque(maxlen=40)
        self.threads = [
            threading.Thread(target=self._pump, args=(stream, lines), daemon=True)
            for stream, lines in (
                (self.popen.stdout, self.stdout),
                (self.popen.stderr, self.stderr),
            )
        ]
        for thread in self.threads:
            thread.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _pump(self, stream, lines: queue.Queue) -> None:
        for line in stream:
            if lines is self.stderr:
                self.stderr_tail.append(line.rstrip())
            lines.put(line.rstrip("\n"))
        lines.put(None)  # end of stream

    def expect(
        self,
        pattern: str,
        timeout: float = WAIT,
        stream: str = "stdout",
        hosts: Hosts | None = None,
    ) -> str:
        """The first line (from now on) of ``stream`` matching ``pattern``; fails on a
        timeout or the end of the stream, with every process's last log lines."""
        lines = self.stdout if stream == "stdout" else self.stderr
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                why = f"no line matching {pattern!r} within {timeout:.0f} s"
                break
            if line is None:
                lines.put(None)  # stay at the end for later calls
                why = f"{stream} ended (exit code {self.popen.wait(GRACE)}) before {pattern!r}"
                break
            if re.search(pattern, line):
                return line
        logs = hosts.logs() if hosts else self.log()
        pytest.fail(f"{self.name}: {why}\n{logs}")

    def log(self) -> str:
        return f"--- {self.name} (pid {self.pid}, exit {self.popen.poll()}) stderr:\n" + "\n".join(
            self.stderr_tail
        )

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def reap(self) -> None:
        try:
            self.popen.wait(GRACE)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(GRACE)
        for thread in self.threads:
            thread.join(GRACE)


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@dataclass
class Link:
    """A veth pair: ``broker_if`` in the broker's namespace, ``worker_if`` on the worker host."""

    broker_if: str
    worker_if: str
    broker_ip: str
    worker_ip: str


@dataclass
class Hosts:
    """A broker host and worker hosts (namespaces), one veth link each, and their processes."""

    suffix: str
    broker_ns: str = ""
    worker_ns: list[str] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    made: list[str] = field(default_factory=list)  # namespaces to delete
    processes: list[Process] = field(default_factory=list)

    def setup(self, workers: int) -> None:
        """Namespaces and links; pytest.skip if this machine cannot make them."""
        self.broker_ns = self.add_namespace(f"farm-b-{self.suffix}")
        for n in range(1, workers + 1):
            namespace = self.add_namespace(f"farm-w{n}-{self.suffix}")
            self.worker_ns.append(namespace)
            link = Link(
                f"fb{n}-{self.suffix}", f"fw{n}-{self.suffix}", f"10.231.{n}.1", f"10.231.{n}.2"
            )
            self.must(
                "link",
                "add",
                link.broker_if,
                "netns",
                self.broker_ns,
                "type",
                "veth",
                "peer",
                "name",
                link.worker_if,
                "netns",
                namespace,
            )
            self.must(
                "-n", self.broker_ns, "addr", "add", f"{link.broker_ip}/24", "dev", link.broker_if
            )
            self.must("-n", namespace, "addr", "add", f"{link.worker_ip}/24", "dev", link.worker_if)
            self.must("-n", self.broker_ns, "link", "set", link.broker_if, "up")
            self.must("-n", namespace, "link", "set", link.worker_if, "up")
            self.links.append(link)

    def add_namespace(self, name: str) -> str:
        result = ip("netns", "add", name)
        if result.returncode:
            pytest.skip(
                f"cannot make network namespaces (`ip netns add {name}`: {result.stderr.strip()})"
            )
        self.made.append(name)
        self.must("-n", name, "link", "set", "lo", "up")
        return name

    def must(self, *args: str) -> None:
        result = ip(*args)
        if result.returncode:
            pytest.skip(
                f"cannot set up the namespaces' network (`ip {' '.join(args)}`: "
                f"{result.stderr.strip()})"
            )

    def start(self, name: str, namespace: str, args: list[str]) -> Process:
        process = Process(name, ["ip", "netns", "exec", namespace, *args])
        self.processes.append(process)
        return process

    def start_broker(self, keys: Path, log_level: str = "INFO") -> Process:
        broker = self.start(
            "broker",
            self.broker_ns,
            farm_command(
                "--log-level",
                log_level,
                "broker",
                "--bind",
                f"tcp://0.0.0.0:{PORT}",
                "--curve",
                str(keys),
                "--heartbeat",
                HEARTBEAT,
                "--liveness",
                LIVENESS,
                "--algo",
                "fifo",
                "--chunk",
                "100",
            ),
        )
        broker.expect(r"^farm broker listening on tcp://0\.0\.0\.0:", hosts=self)
        return broker

    def start_worker(self, n: int, keys: Path, core: int) -> Process:
        """A worker on host ``n`` (1-based), pinned to ``core``, reaching the broker over its
        own link."""
        return self.start(
            f"worker {n}",
            self.worker_ns[n - 1],
            farm_command(
                "--log-level",
                "INFO",
                "worker",
                "--device",
                f"cpu:{core}",
                "--broker",
                f"tcp://{self.links[n - 1].broker_ip}:{PORT}",
                "--curve",
                str(keys),
                "--heartbeat",
                HEARTBEAT,
                "--liveness",
                LIVENESS,
                "--model",
                "lenet",
            ),
        )

    def start_client(
        self, script: Path, keys: Path, images: Path, out: Path, workers: int, shared: bool = False
    ) -> Process:
        return self.start(
            "client",
            self.broker_ns,
            [
                sys.executable,
                str(script),
                f"tcp://127.0.0.1:{PORT}",
                str(keys),
                str(images),
                str(out),
                str(workers),
                *(["shared"] if shared else []),
            ],
        )

    def cut(self, n: int) -> None:
        """Cut worker host ``n``'s link at the broker's end, as a pulled cable would."""
        result = ip("-n", self.broker_ns, "link", "set", self.links[n - 1].broker_if, "down")
        assert result.returncode == 0, result.stderr

    def logs(self) -> str:
        return "\n".join(process.log() for process in self.processes)

    def close(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL), then delete the namespaces (and with
        them the veth links)."""
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.reap()
        for name in self.made:
            ip("netns", "delete", name)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    """A broker host and two worker hosts; everything is removed afterwards, pass or fail."""
    if not sys.platform.startswith("linux"):
        pytest.skip("network namespaces are Linux only")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (`ip netns add`)")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) to make network namespaces")
    made = Hosts(secrets.token_hex(3))
    try:
        made.setup(workers=2)
        yield made
    finally:
        made.close()
        print(made.logs())  # shown by pytest when the test failed


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """A `farm keys init` folder: the broker's key pair, authorized worker and client keys."""
    folder = tmp_path / "keys"
    subprocess.run(
        farm_command("keys", "init", str(folder)),
        check=True,
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    return folder


@pytest.fixture
def client_script(tmp_path: Path) -> Path:
    path = tmp_path / "client.py"
    path.write_text(CLIENT_SCRIPT)
    return path


@pytest.fixture(scope="module")
def job(lenet, digits) -> tuple[np.ndarray, np.ndarray]:
    """``JOB`` LeNet images (the sample, repeated) and the outputs an in-process forward gives.

    The reference is computed on the 1 000 distinct images and repeated the same way:
    the same per-image forward, without a 20 000-image batch (1 GB of activations).
    """
    images = np.resize(digits, (JOB, *digits.shape[1:]))
    expected = np.resize(reference_forward(lenet, digits), (JOB, 10))
    return images, expected


def pinned_cores() -> list[int]:
    """Worker 1 on the first core this process may use, worker 2 on the second."""
    cores = sorted(os.sched_getaffinity(0))
    return [cores[0], cores[1 % len(cores)]]


def read_report(client: Process, hosts: Hosts) -> tuple[dict[str, Any], dict[str, Any]]:
    """The client's job report and the broker's INFO after the job."""
    result = json.loads(client.expect(r"^result ", hosts=hosts).split(" ", 1)[1])
    info = json.loads(client.expect(r"^info ", hosts=hosts).split(" ", 1)[1])
    client.popen.wait(WAIT)
    assert client.popen.returncode == 0, hosts.logs()
    return result, info


def test_a_job_over_curve_tcp_across_hosts(hosts, keys, client_script, job, tmp_path) -> None:
    images, expected = job
    np.save(tmp_path / "images.npy", images)
    started = time.monotonic()
    hosts.start_broker(keys)
    workers = [hosts.start_worker(n, keys, core) for n, core in enumerate(pinned_cores(), 1)]
    client = hosts.start_client(
        client_script, keys, tmp_path / "images.npy", tmp_path / "out.npy", workers=2
    )
    ready = json.loads(client.expect(r"^ready ", hosts=hosts).split(" ", 1)[1])
    assert sorted(w["pid"] for w in ready["workers"]) == sorted(w.pid for w in workers)
    result, info = read_report(client, hosts)

    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, atol=1e-5)
    assert result["failed"] == [] and result["duplicates"] == 0
    assert result["items"] == JOB
    shares = {w["name"]: w["items"] for w in result["workers"]}
    assert len(shares) == 2 and all(shares.values()), f"both workers should take part: {shares}"
    assert sum(shares.values()) == JOB
    print(
        f"{JOB} images across namespaces in {result['seconds']:.2f} s "
        f"({result['rate']:,.0f} images/s, waste {result['waste']:.1%}), shares {shares}, "
        f"test {time.monotonic() - started:.1f} s; broker stats {info['stats']}"
    )


def test_workers_on_other_hosts_read_a_shared_npy(
    hosts, keys, client_script, job, tmp_path
) -> None:
    """The hosts share this machine's file system, as a cluster's nodes share NFS: the
    workers read their rows of the client's .npy, and only where they lie crosses the
    broker (a few bytes a chunk, not 784 an image)."""
    images, expected = job
    np.save(tmp_path / "images.npy", images)
    hosts.start_broker(keys)
    for n, core in enumerate(pinned_cores(), 1):
        hosts.start_worker(n, keys, core)
    client = hosts.start_client(
        client_script,
        keys,
        tmp_path / "images.npy",
        tmp_path / "out.npy",
        workers=2,
        shared=True,
    )
    client.expect(r"^ready ", hosts=hosts)
    result, info = read_report(client, hosts)

    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, atol=1e-5)
    assert result["shared"] and result["failed"] == [] and result["items"] == JOB
    assert info["stats"]["unshared_workers"] == 0
    per_image = info["traffic"]["input_bytes"] / JOB
    assert per_image < 200, info["traffic"]
    assert "DATA" not in info["traffic"]["received"], "no image crossed the broker"


def test_a_worker_host_cut_off_mid_job(hosts, keys, client_script, job, tmp_path) -> None:
    """The link of worker host 1 goes down at the first result: the broker declares the
    worker dead after heartbeat x liveness (1 s) and its chunks go to worker 2."""
    images, expected = job
    np.save(tmp_path / "images.npy", images)
    hosts.start_broker(keys)
    workers = [hosts.start_worker(n, keys, core) for n, core in enumerate(pinned_cores(), 1)]
    client = hosts.start_client(
        client_script, keys, tmp_path / "images.npy", tmp_path / "out.npy", workers=2
    )
    client.expect(r"^ready ", hosts=hosts)
    client.expect(r"^progress ", hosts=hosts)
    cut_at = time.monotonic()
    hosts.cut(1)
    result, info = read_report(client, hosts)
    finished_after_cut = time.monotonic() - cut_at

    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, atol=1e-5)
    assert result["failed"] == [] and result["duplicates"] == 0
    stats = info["stats"]
    assert stats["workers_expired"] >= 1 and stats["requeued_chunks"] >= 1, stats
    assert workers[0].pid not in [w["pid"] for w in info["workers"]], (
        "the cut worker should have been declared gone"
    )
    shares = {w["name"]: w["items"] for w in result["workers"]}
    assert sum(shares.values()) == JOB, shares
    print(
        f"cut worker 1 at the first result; job done {finished_after_cut:.2f} s later, "
        f"{result['seconds']:.2f} s in all; shares {shares}; "
        f"resubmissions {result['resubmissions']}; broker stats {stats}"
    )


def test_a_worker_with_an_unknown_key_gets_no_work(
    hosts, keys, client_script, lenet, digits, tmp_path
) -> None:
    """Worker 2 trusts the broker's key but presents a key the broker never authorized:
    the broker's ZAP handler denies it, and the job runs on worker 1 alone."""
    rogue = tmp_path / "rogue"
    subprocess.run(
        farm_command("keys", "init", str(rogue)),
        check=True,
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    shutil.copy(keys / "broker.key", rogue / "broker.key")
    rogue_key = zmq.auth.load_certificate(rogue / "worker.key")[0].decode()
    images = np.resize(digits, (2000, *digits.shape[1:]))
    np.save(tmp_path / "images.npy", images)

    broker = hosts.start_broker(keys, log_level="DEBUG")  # zmq.auth logs ZAP verdicts at DEBUG
    cores = pinned_cores()
    allowed = hosts.start_worker(1, keys, cores[0])
    intruder = hosts.start_worker(2, rogue, cores[1])
    broker.expect(rf"DENIED \(CURVE\).*{re.escape(rogue_key)}", stream="stderr", hosts=hosts)
    client = hosts.start_client(
        client_script, keys, tmp_path / "images.npy", tmp_path / "out.npy", workers=1
    )
    ready = json.loads(client.expect(r"^ready ", hosts=hosts).split(" ", 1)[1])
    result, info = read_report(client, hosts)

    assert [w["pid"] for w in ready["workers"]] == [allowed.pid]
    assert intruder.pid not in [w["pid"] for w in info["workers"]]
    assert [w["items"] for w in result["workers"]] == [len(images)]
    np.testing.assert_allclose(
        np.load(tmp_path / "out.npy"),
        np.resize(reference_forward(lenet, digits), (len(images), 10)),
        atol=1e-5,
    )
    # Refused at the CURVE handshake (libzmq does not retry), the intruder says why and exits.
    intruder.expect(r"refused key 'worker'", stream="stderr", hosts=hosts)
    assert intruder.popen.wait(30) == 1
