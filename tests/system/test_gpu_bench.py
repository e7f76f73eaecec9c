"""bench/gpu-run.sh and bench/gpu.sh end to end on the CPU: their dry run, with a torch
worker standing in for the GPU worker, writes every file with figures that add up; the one
call fits what a lent GPU machine gives back (8 files, 12 000 characters), keeps the
budget, and packs what it has when stopped."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from farm.benchsuite.measure import paper_configurations
from farm.benchsuite.setups import describe_machine
from farm.client.trace import Trace, idle_share
from farm.ops.local import cores
from tests.conftest import BENCH, LIMIT_ADDRESS_SPACE, bench_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu.sh"
ONE_CALL = ROOT / "bench" / "gpu-run.sh"
#: What the GPU machine gives back: files directly under $OUT, bytes each, characters.
MOST_FILES, MOST_BYTES, MOST_OUTPUT = 8, 16 * 2**20, 12_000
DRY_BENCH = ("--stand-in", "--images", "3000", "--quick")  # bench/gpu.sh's dry run
DRY_RUN = (*DRY_BENCH, "--smoke-models", "lenet")  # bench/gpu-run.sh's: a smoke on LeNet first

pytestmark = [
    pytest.mark.skipif(len(cores()) < 2, reason="a CPU worker and the stand-in need two cores"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed"),
    pytest.mark.timeout(600),
]


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def environment(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable, **extra}


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=580,
        env=environment(),
    )


@dataclass
class OneCall:
    """A finished bench/gpu-run.sh: its out folder, output and status, and its results
    folder unpacked from results.tar.gz."""

    out: Path
    output: str
    returncode: int
    unpacked: Path

    @property
    def results(self) -> Path:
        return self.unpacked / "results"


def one_call(folder: Path, *args: str) -> OneCall:
    out = folder / "out"
    done = subprocess.run(
        ["bash", str(ONE_CALL), str(out), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=580,
        env=environment(),
    )
    return OneCall(out, done.stdout, done.returncode, unpack(out, folder / "unpacked"))


def unpack(out: Path, into: Path) -> Path:
    with tarfile.open(out / "results.tar.gz") as archive:
        archive.extractall(into, filter="data")
    return into


@pytest.fixture(scope="module")
def dry_call(tmp_path_factory) -> OneCall:
    """The one call with a stand-in: the smoke on LeNet, then the bench on LeNet."""
    done = one_call(tmp_path_factory.mktemp("gpu-run"), *DRY_RUN, "--models", "lenet")
    assert done.returncode == 0, done.output[-3000:]
    return done


@pytest.fixture(scope="module")
def dry_run(dry_call) -> Path:
    """bench/gpu.py's results folder, as the one call packed it."""
    return dry_call.results


def test_the_one_call_fits_what_the_machine_gives_back(dry_call) -> None:
    out = dry_call.out
    assert len(dry_call.output) < MOST_OUTPUT
    files = sorted(path for path in out.rglob("*"))
    assert all(path.parent == out and path.is_file() for path in files)  # none deeper
    assert {path.name for path in files} == {
        "smoke.txt",
        "report.md",
        "log-tail.txt",
        "results.tar.gz",
    }
    assert len(files) <= MOST_FILES
    assert all(path.stat().st_size <= MOST_BYTES for path in files)
    assert (out / "report.md").read_text() == (dry_call.results / "report.md").read_text()
    assert {path.name for path in dry_call.unpacked.iterdir()} >= {"results", "smoke.json"}
    # the output: the smoke's table, a line per step, the summary, the files
    assert "## lenet on cpu" in dry_call.output and "## Summary" in dry_call.output
    for step in ("engines", "standalone speeds", "policies", "peers", "table 2"):
        assert f"-- lenet: {step}: done" in dry_call.output
    listed = [line.split()[-1] for line in dry_call.output.splitlines()[-4:]]
    assert sorted(listed) == sorted(path.name for path in files)


def test_the_smoke_names_every_run_and_the_refusals(dry_call) -> None:
    smoke = (dry_call.out / "smoke.txt").read_text()
    assert "nvidia-smi -L: " in smoke and "onnxruntime providers: " in smoke
    assert "torch threads on core " in smoke
    table = smoke[smoke.index("## lenet") :].splitlines()
    rows = {line.split()[0]: line for line in table[2:5]}
    assert set(rows) == {"f32", "f16", "bf16"}
    assert "0.0e+00" in rows["f32"]  # the stand-in is the CPU's f32: no difference
    for precision in ("f16", "bf16"):
        assert f"does not compute in {precision} on cpu" in rows[precision]
    assert "auto: " in smoke and "farm: cpu:" in smoke
    document = json.loads((dry_call.unpacked / "smoke.json").read_text())
    (model,) = document["models"]
    assert document["worked"] == 1 and document["tried"] == 3 and not document["stopped"]
    f32, *refused = model["engines"]
    assert f32["images_per_s"] > 0 and f32["device_s"] > 0 and f32["copy_s"] == 0.0
    assert all(run["problem"] and run["images_per_s"] is None for run in refused)
    assert model["auto"]["backend"] and not model["auto"]["problem"]
    farm = model["farm"]
    assert farm["images_per_s"] > 0 and 0 < farm["gpu_share"] < 1 and 0 < farm["gpu_busy"] <= 1


def test_without_a_gpu_the_one_call_stops_after_the_smoke(tmp_path) -> None:
    done = one_call(tmp_path, "--smoke-models", "lenet")
    assert done.returncode == 3, done.output[-2000:]
    assert "sees no CUDA device" in (done.out / "smoke.txt").read_text()
    assert "pointless" in done.output and not (done.out / "report.md").exists()
    assert "bench/gpu.py" not in done.output  # the bench was not started


def test_a_budget_too_small_for_the_second_model(tmp_path) -> None:
    """GoogLeNet needs LARGE_MODEL_FLOOR seconds left: with less than that in all it is
    not started, whatever this machine's speed; LeNet, started, keeps what it measured and
    names the steps the budget left out."""
    gpu = bench_script("gpu")
    budget = round(gpu.MODEL_FLOOR + 10)  # LeNet starts: the bench starts within 10 s
    assert budget < gpu.LARGE_MODEL_FLOOR
    out = tmp_path / "out"
    done = run_script(str(out), *DRY_BENCH, "--models", "lenet,googlenet", "--budget", str(budget))
    assert done.returncode == 0, done.stdout[-3000:]
    assert "googlenet: not started" in done.stdout  # in the summary printed
    results = json.loads((out / "results.json").read_text())
    (lenet,) = results["models"]
    assert lenet["model"] == "lenet" and lenet["engines"] and lenet["batches"]
    assert any(note.startswith("googlenet: not started") for note in results["skipped"])
    (summary,) = results["summary"]
    assert summary["model"] == "lenet"
    steps = {"standalone": "standalone speeds", "policies": "policies", "peers": "peers"}
    for field, step in steps.items():  # each step measured, or named as left out
        assert lenet[field] or any(f"lenet: {step}" in note for note in lenet["skipped"])


def marked(mark: str) -> list[int]:
    """The processes whose environment carries the run's mark (``FARM_GPU_RUN``)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"FARM_GPU_RUN={mark}".encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:  # gone meanwhile
            continue
    return found


def test_stopped_it_packs_what_it_has_and_leaves_no_process(tmp_path) -> None:
    """SIGTERM (a machine's limit) during the bench: the step running writes what it has,
    and the out folder holds it.  A process of the run's in a session of its own (as a
    local farm's are), left behind, is ended: on a lent machine it would hold the GPU."""
    out = tmp_path / "out"
    mark = f"test-{os.getpid()}-{tmp_path.name}"
    left_behind = subprocess.Popen(
        ["sleep", "600"], start_new_session=True, env=environment(FARM_GPU_RUN=mark)
    )
    process = subprocess.Popen(
        ["bash", str(ONE_CALL), str(out), *DRY_RUN, "--models", "lenet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environment(FARM_GPU_RUN=mark),
    )
    assert process.stdout is not None
    lines = []
    for line in process.stdout:  # until the bench's first step is done
        lines.append(line)
        if "-- lenet: engines: " in line:
            process.send_signal(signal.SIGTERM)
            break
    lines += process.stdout.readlines()
    assert process.wait(timeout=120) == 130, "".join(lines)[-3000:]
    assert "stopped by SIGTERM" in "".join(lines)
    assert "interrupted" in (out / "report.md").read_text()
    results = json.loads((unpack(out, tmp_path / "unpacked") / "results/results.json").read_text())
    assert results["models"][0]["engines"]
    assert left_behind.wait(timeout=10) == -signal.SIGKILL and not marked(mark)
    assert "process(es) this run left behind" in "".join(lines)


OUT_OF_MEMORY = (
    textwrap.dedent(
        """
        import json, sys
        sys.path.insert(0, sys.argv[1])
        import gpu
        from farm.benchsuite.setups import make_images

        core = int(sys.argv[2])
        gpu.batch_rate("lenet", "torch", "cpu", 1, 16, make_images("lenet", 16))  # torch loaded
        """
    )
    + LIMIT_ADDRESS_SPACE
    + """
row = gpu.alone("lenet", "torch", "cpu", 1, (16, 8192), 8192, (core,), "torch, GPU alone")
print(json.dumps(row))
"""
)


def test_alone_keeps_the_smaller_batches_when_a_larger_one_runs_out_of_memory() -> None:
    """A real out of memory (an address-space limit) at the larger batch: the smaller
    batch's figures stand, the failure is a note, and the summary counts the peer."""
    done = subprocess.run(
        [sys.executable, "-c", OUT_OF_MEMORY, str(BENCH), str(cores()[-1])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.splitlines()[-1])
    assert row["batch"] == 16 and row["images_per_s"] > 0 and row["problem"] is None
    assert row["note"].startswith("batch 8192: ") and "allocate" in row["note"]
    gpu = bench_script("gpu")
    layout = gpu.Layout.here(True, None)
    run = gpu.ModelRun("lenet", peers=[row])
    (summary,) = gpu.summary_rows(layout, [run])
    assert summary["gpu_alone"] == row["images_per_s"] and summary["best"] is None
    report = gpu.report(layout, describe_machine(), [run], [], "-", 0.0)
    assert "| lenet | not measured |" in report and row["note"] in report


def test_the_dry_run_writes_every_file(dry_run) -> None:
    assert {path.name for path in dry_run.iterdir()} == {
        "report.md",
        "results.json",
        "engines.csv",
        "policies.csv",
        "peers.csv",
        "table2.csv",
        "traces.jsonl",
        "log.txt",
    }
    report = (dry_run / "report.md").read_text()
    assert "a CPU stand-in" in report and "## lenet" in report
    assert report in (dry_run / "log.txt").read_text()  # the log holds what was printed


def test_every_policy_ran_and_its_waste_comes_from_its_trace(dry_run) -> None:
    results = json.loads((dry_run / "results.json").read_text())
    assert results["layout"]["stand_in"] and results["layout"]["gpu"] == "cpu"
    (model,) = results["models"]
    standalone = model["standalone"]
    assert set(standalone) == {*(f"cpu:{core}" for core in cores()[:-1]), "cpu"}
    assert all(rate > 0 for rate in standalone.values())
    theoretical = sum(standalone.values())
    rows = read_csv(dry_run / "policies.csv")
    assert [row["policy"] for row in rows] == [c.algo for c in paper_configurations(True)]
    for row in rows:
        assert int(row["images"]) == 3000
        assert float(row["theoretical"]) == pytest.approx(theoretical)
        standalone_waste = 1 - float(row["images_per_s"]) / theoretical
        assert float(row["standalone_waste"]) == pytest.approx(standalone_waste)
        assert 0 <= float(row["waste"]) < 1
        assert 0 < float(row["gpu_busy"]) <= 1 and 0 < float(row["gpu_images"]) < 1
        assert float(row["gpu_copy"]) == 0.0  # the stand-in copies nothing to a device
    best = max(rows, key=lambda row: float(row["images_per_s"]))
    (summary,) = results["summary"]
    assert summary["images_per_s"] == pytest.approx(float(best["images_per_s"]))
    trace = msgspec.json.decode((dry_run / "traces.jsonl").read_text().splitlines()[0], type=Trace)
    assert trace.items == 3000 and trace.policy == best["policy"]
    assert float(best["waste"]) == pytest.approx(idle_share(trace))


def test_engines_peers_and_table2_cover_both_workers(dry_run) -> None:
    engines = read_csv(dry_run / "engines.csv")
    assert [(e["kind"], e["precision"]) for e in engines] == [
        ("gpu", "f32"),
        ("gpu", "f16"),
        ("gpu", "bf16"),
        ("cpu", "f32"),
    ]
    assert engines[0]["backend"] == "torch" and float(engines[0]["rate"]) > 0
    assert "f32 on the CPU" in engines[1]["problem"]  # the stand-in has no f16: refused
    peers = {row["peer"]: row for row in read_csv(dry_run / "peers.csv")}
    assert set(peers) == {"torch, GPU alone", "onnxruntime, every core", "opencv, every core"}
    assert all(float(row["images_per_s"]) > 0 for row in peers.values())
    table2 = read_csv(dry_run / "table2.csv")
    assert {(row["device"], int(row["chunk"])) for row in table2} == {
        (device, size)
        for device in ("cpu", f"cpu:{cores()[0]}")
        for size in (1, 10, 100, 1000, 10_000)
    }
    for row in table2:
        assert int(row["images"]) % int(row["chunk"]) == 0 and float(row["images_per_s"]) > 0


def test_without_a_gpu_gpu_sh_says_to_add_the_stand_in(tmp_path) -> None:
    done = run_script(str(tmp_path / "out"), "--models", "lenet")
    assert done.returncode != 0 and "sees no CUDA device" in done.stdout
    assert "--stand-in" in done.stdout


def test_at_the_time_limit_it_writes_what_it_has(dry_run, tmp_path) -> None:
    """SIGINT from gpu.sh's hard limit: the report says so, the steps done are kept.  The
    limit is half the dry run's time on one model here, so it falls on any CPU after the
    first step (a fifth of that time or less) and before two models are done."""
    limit = round(json.loads((dry_run / "results.json").read_text())["seconds"] / 2)
    out = tmp_path / "out"
    done = subprocess.run(
        [
            "bash",
            str(SCRIPT),
            str(out),
            *DRY_BENCH,
            "--models",
            "lenet,cifar10_quick",
        ],
        capture_output=True,
        text=True,
        timeout=limit + 120,
        env=environment(FARM_GPU_LIMIT=str(limit)),
    )
    assert done.returncode == 124, done.stdout[-2000:]  # timeout's code: the limit was hit
    report = (out / "report.md").read_text()
    assert "interrupted: the time limit was reached" in report
    results = json.loads((out / "results.json").read_text())
    assert results["models"][0]["engines"]  # the first step finished before the limit
