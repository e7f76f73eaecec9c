"""A real Slurm on this machine, for the tests: Debian's slurmctld, slurmd and munge.

``SlurmCluster.start`` installs the packages when they are missing (``apt-get``), starts
munged if no munge daemon answers, writes a ``slurm.conf`` for two nodes on loopback
(``n1``, ``n2``: two slurmd daemons, each on its own port, both this machine's CPUs),
starts slurmctld and the two slurmd, and waits until both nodes are idle.  Everything but
munge's key lives in the cluster's folder; ``stop`` ends the daemons it started.  When
Slurm cannot start here (not root, no apt-get, a daemon that will not come up) ``start``
returns the reason, for the tests to skip with.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from farm.ops.local import free_port

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
#: Seconds Slurm waits between SIGTERM and SIGKILL when it ends a job or step.
KILL_WAIT = 5
#: Seconds to wait for the daemons to bring both nodes up.
START_SECONDS = 60
#: CPUs each node declares (this machine's first two: the tests count workers by them).
CPUS_PER_NODE = 2


@dataclass
class SlurmCluster:
    """Two Slurm nodes on this machine; ``env`` is the environment its commands need."""

    folder: Path
    nodes: tuple[str, ...] = ("n1", "n2")
    pids: list[int] = field(default_factory=list)
    started_munge: bool = False

    @property
    def conf(self) -> Path:
        return self.folder / "etc" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> str | None:
        """Start the cluster; None when it runs, else why it cannot run here (and nothing
        it started is left running)."""
        try:
            return self.start_daemons()
        except (OSError, subprocess.SubprocessError, LookupError) as exc:
            self.stop()
            return f"{type(exc).__name__}: {exc}"

    def start_daemons(self) -> str | None:
        if os.geteuid() != 0:
            return "Slurm's node daemon needs root here, and the tests do not run as root"
        problem = install() or self.start_munge()
        if problem:
            return problem
        self.write_conf()
        for command in (
            ["slurmctld", "-c", "-f", str(self.conf)],
            *(["slurmd", "-f", str(self.conf), "-N", node] for node in self.nodes),
        ):
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                self.stop()
                return f"{command[0]} did not start: {done.stderr.strip()[-500:]}"
        if not self.wait_idle():
            logs = "; ".join(path.read_text()[-300:] for path in (self.folder / "log").glob("*"))
            self.stop()
            return f"the Slurm nodes did not come up within {START_SECONDS} s: {logs}"
        return None

    def start_munge(self) -> str | None:
        if munge_works():
            return None
        for folder, mode in (
            ("/run/munge", 0o755),
            ("/var/lib/munge", 0o700),
            ("/var/log/munge", 0o700),
        ):
            os.makedirs(folder, mode=mode, exist_ok=True)
            shutil.chown(folder, "munge", "munge")
        for stale in Path("/run/munge").glob("munge.socket.2*"):
            stale.unlink()
        done = subprocess.run(
            ["runuser", "-u", "munge", "--", "/usr/sbin/munged"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        self.started_munge = done.returncode == 0
        deadline = time.monotonic() + 10
        while not munge_works():  # munged forks into the background: only its socket tells
            if time.monotonic() > deadline:
                return f"munged did not start: {done.stderr.strip()[-300:]}"
            time.sleep(0.1)
        return None

    def write_conf(self) -> None:
        for sub in ("etc", "state/ctld", "log", "run", *(f"state/{n}" for n in self.nodes)):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname().split(".")[0]
        cpus = CPUS_PER_NODE
        f = self.folder
        lines = [
            "ClusterName=farmtest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"StateSaveLocation={f}/state/ctld",
            f"SlurmdSpoolDir={f}/state/%n",
            f"SlurmctldPidFile={f}/run/slurmctld.pid",
            f"SlurmdPidFile={f}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={f}/log/slurmctld.log",
            f"SlurmdLogFile={f}/log/slurmd-%n.log",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "TaskPlugin=task/affinity",
            "ProctrackType=proctrack/linuxproc",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "ReturnToService=2",
            f"KillWait={KILL_WAIT}",
            "InactiveLimit=0",
            "MinJobAge=10",
            "MailProg=/bin/true",
            *(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} "
                f"CPUs={cpus} Sockets=1 CoresPerSocket={cpus} ThreadsPerCore=1 RealMemory=1000 "
                f"State=UNKNOWN"
                for node in self.nodes
            ),
            f"PartitionName=farm Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE "
            f"State=UP OverSubscribe=NO",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def wait_idle(self) -> bool:
        """Whether every node is idle within START_SECONDS (slurmd registers by itself; there
        is nothing to wait on but its state)."""
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            done = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %T"],
                capture_output=True,
                text=True,
                env=self.env,
                timeout=30,
            )
            states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
            if done.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes):
                return True
            time.sleep(0.25)
        return False

    def squeue(self, *args: str) -> str:
        return subprocess.run(
            ["squeue", "-h", *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=30,
            check=True,
        ).stdout

    def stop(self) -> None:
        """Cancel every job, end the daemons (and munged, if this cluster started it)."""
        if self.conf.is_file():
            subprocess.run(
                ["scancel", "--user", "root"], env=self.env, timeout=30, capture_output=True
            )
        pids = [
            int(path.read_text())
            for path in (self.folder / "run").glob("*.pid")
            if path.read_text().strip().isdigit()
        ]
        if self.started_munge and Path("/run/munge/munged.pid").is_file():
            pids.append(int(Path("/run/munge/munged.pid").read_text()))
        end_daemons(pids, within=15.0)


def end_daemons(pids: list[int], within: float) -> None:
    """SIGTERM each process, wait up to ``within`` s for all to exit, SIGKILL those left.
    They are not this process's children: each is awaited through a pidfd, readable once
    its process has exited."""
    handles = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            handles.append(os.pidfd_open(pid))
    try:
        for handle in handles:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(handle, signal.SIGTERM)
        running, deadline = set(handles), time.monotonic() + within
        while running and (left := deadline - time.monotonic()) > 0:
            exited, _, _ = select.select(list(running), [], [], left)
            running -= set(exited)
        for handle in running:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(handle, signal.SIGKILL)
    finally:
        for handle in handles:
            os.close(handle)


def munge_works() -> bool:
    if shutil.which("munge") is None:
        return False
    credential = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
    return (
        credential.returncode == 0
        and subprocess.run(
            ["unmunge"], input=credential.stdout, capture_output=True, timeout=10
        ).returncode
        == 0
    )


def install() -> str | None:
    """Install the Slurm and munge packages if missing; None, or why it failed."""
    if all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch", "munged")):
        return None
    if shutil.which("apt-get") is None:
        return "Slurm is not installed and there is no apt-get to install it"
    command = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:  # stale package lists: fetch them and try once more
        subprocess.run(["apt-get", "update"], capture_output=True, env=env, timeout=600)
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        return f"apt-get could not install {' '.join(PACKAGES)}: {done.stderr.strip()[-500:]}"
    return None
