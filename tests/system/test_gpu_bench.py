"""bench/gpu.sh end to end on the CPU: its dry run, with a torch worker standing in for the
GPU worker, writes every file of its results folder with figures that add up."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from farm.bench.measure import paper_configurations
from farm.client.trace import Trace, idle_share
from farm.ops.local import cores

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu.sh"

pytestmark = [
    pytest.mark.skipif(len(cores()) < 2, reason="a CPU worker and the stand-in need two cores"),
    pytest.mark.timeout(600),
]


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=580,
        env={**os.environ, "PYTHON": sys.executable},
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu") / "results"
    done = run_script(str(out), "--stand-in", "--models", "lenet", "--images", "3000", "--quick")
    assert done.returncode == 0, done.stdout[-3000:]
    return out


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


def test_without_a_gpu_it_says_to_add_the_stand_in(tmp_path) -> None:
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
            "--stand-in",
            "--models",
            "lenet,cifar10_quick",
            "--images",
            "3000",
            "--quick",
        ],
        capture_output=True,
        text=True,
        timeout=limit + 120,
        env={**os.environ, "PYTHON": sys.executable, "FARM_GPU_LIMIT": str(limit)},
    )
    assert done.returncode == 124, done.stdout[-2000:]  # timeout's code: the limit was hit
    report = (out / "report.md").read_text()
    assert "interrupted: the time limit was reached" in report
    results = json.loads((out / "results.json").read_text())
    assert results["models"][0]["engines"]  # the first step finished before the limit
