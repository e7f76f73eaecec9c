"""farm bench: a real (small) suite run writes every table, figure and the report; the
figures it derives (median, waste, its split, speed relative to one core) are right."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest

from farm.benchsuite.measure import Configuration, PolicyRun, paper_configurations
from farm.benchsuite.peers import CANDIDATES, PEERS, missing
from farm.benchsuite.results import (
    PEER_MECHANISM,
    ModelResults,
    SuiteRun,
    read_folder,
    relative_table,
    waste_table,
    write_folder,
)
from farm.benchsuite.setups import SETUP_ABOUT, WorkerSpec, farm_setups
from farm.ops.local import cores, farm_command
from farm.policies import POLICIES

pytestmark = [
    pytest.mark.skipif(len(cores()) < 2, reason="the suite's farms need two cores"),
    # the first test to use suite_folder waits for the suite itself (up to 900 s)
    pytest.mark.timeout(1000),
]


#: The peers the suite fixture runs: every one that needs nothing beyond farm's install.
PEERS_RUN = ("opencv-threads", "process-pool", "onnxruntime-threads", "openvino-throughput")


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.fixture(scope="module")
def suite_folder(tmp_path_factory) -> Path:
    """One quick suite on LeNet, the cores farm and four peers (a minute or two)."""
    out = tmp_path_factory.mktemp("bench")
    done = subprocess.run(
        farm_command(
            "bench",
            "--quick",
            "--images",
            "1000",  # the least it takes: every figure checked is a ratio or a count
            "--models",
            "lenet",
            "--setups",
            "cores",
            "--peers",
            ",".join(PEERS_RUN),
            "--peer-rounds",
            "2",
            "--out",
            str(out),
        ),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    folders = list(out.iterdir())
    assert len(folders) == 1 and done.stdout.startswith(f"results in {folders[0]}")
    return folders[0]


def test_suite_writes_every_table_figure_and_the_report(suite_folder) -> None:
    names = {path.name for path in suite_folder.iterdir()}
    assert {
        "report.md",
        "machine.json",
        "table2.csv",
        "batches.csv",
        "standalone.csv",
        "policy_runs.csv",
        "policies.csv",
        "peers.csv",
        "peer_tuning.csv",
        "peer_runs.csv",
        "figure3-lenet.png",
        "figure5-waste.png",
        "peers.png",
        "table2.png",
    } <= names
    for png in suite_folder.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    machine = json.loads((suite_folder / "machine.json").read_text())
    assert machine["cores"] == len(cores()) and machine["setups"]["cores"]
    report = (suite_folder / "report.md").read_text()
    for heading in (
        "## Headline",
        "## Table 2",
        "## Figure 3: lenet",
        "## Tables 4/5",
        "## Figure 5",
        "## Peers",
        "## Where a peer is faster",
    ):
        assert heading in report


def test_every_policy_ran_with_waste_from_its_trace_and_a_standalone_bracket(
    suite_folder,
) -> None:
    rows = read_csv(suite_folder / "policies.csv")
    assert {row["policy"] for row in rows} == set(POLICIES)
    standalone = read_csv(suite_folder / "standalone.csv")
    per_worker: dict[str, list[float]] = {}
    for row in standalone:
        if row["setup"] == "cores":
            per_worker.setdefault(row["worker"], []).append(float(row["images_per_s"]))
    assert len(per_worker) == len(cores())
    runs = read_csv(suite_folder / "policy_runs.csv")
    # one measurement before the first job, one after each job
    assert all(len(rates) == len(runs) + 1 for rates in per_worker.values())
    assert [int(run["standalone_bracket"]) for run in runs] == list(range(len(runs)))
    again = [row for row in standalone if row["setup"] == "head-to-head"]
    assert len(again) == 2 * len(cores())  # every worker alone again in each peer round
    theoretical = sum(sum(r) / len(r) for r in per_worker.values())
    for row, run in zip(rows, runs):
        rate, bracket = float(row["images_per_s"]), int(run["standalone_bracket"])
        before = [rates[bracket] for rates in per_worker.values()]
        after = [rates[bracket + 1] for rates in per_worker.values()]
        assert float(row["theoretical_per_s"]) == pytest.approx(theoretical, rel=1e-3)
        assert float(row["waste"]) == pytest.approx(float(run["waste_from_trace"]), abs=1e-4)
        assert 0 <= float(row["waste"]) < 1  # idle time over workers x span
        bracketed = (sum(before) + sum(after)) / 2
        assert float(row["standalone_waste_secondary"]) == pytest.approx(
            1 - rate / bracketed, abs=2e-3
        )
        drift = max(abs(a / b - 1) for b, a in zip(before, after))
        assert float(row["bracket_drift"]) == pytest.approx(drift, abs=2e-3)
        assert 0 < rate < 1.5 * theoretical
    report = (suite_folder / "report.md").read_text()
    assert "Standalone speed drift across the bracket: median" in report


def test_peers_compute_what_the_farm_computes(suite_folder) -> None:
    rows = read_csv(suite_folder / "peers.csv")
    assert [row["peer"] for row in rows][1:] == list(PEERS_RUN)
    assert rows[0]["peer"].startswith("farm (") and float(rows[0]["ratio_to_farm_best"]) == 1
    farm = float(rows[0]["images_per_s"])
    for row in rows[1:]:
        assert float(row["max_abs_difference"]) < 1e-3  # the same outputs, in the same order
        assert float(row["ratio_to_farm_best"]) == pytest.approx(
            float(row["images_per_s"]) / farm, abs=2e-3
        )
    farm_rounds = [
        float(row["images_per_s"])
        for row in read_csv(suite_folder / "peer_runs.csv")
        if row["who"] == "farm"
    ]
    assert len(farm_rounds) == 2 and farm == max(farm_rounds)  # the median_high of two
    tuning = read_csv(suite_folder / "peer_tuning.csv")
    for peer in PEERS_RUN:  # each peer tried every candidate setting, in the first round
        assert {int(row["setting"]) for row in tuning if row["peer"] == peer} == set(
            CANDIDATES[peer]
        )
    assert {row["peer"] for row in tuning} == set(PEERS_RUN)


def test_table2_has_one_row_per_size_and_device_kind(suite_folder) -> None:
    rows = read_csv(suite_folder / "table2.csv")
    assert [int(row["submitted"]) for row in rows] == [1000, 100, 10]
    assert {row["device"] for row in rows} == {"cpu core (auto)"}  # the workers' default
    assert all(float(row["images_per_s"]) > 0 for row in rows)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--setups", "cores,tpu"], "unknown tpu"),
        (["--peers", "dask"], "unknown dask"),
        (["--models", "nosuchmodel"], "unknown model 'nosuchmodel'"),
        (["--models", "caffenet"], "has no bundled sample"),
        (["--images", "10"], "10 is not in the range x>=1000"),
    ],
)
def test_bench_refuses_bad_options_before_measuring(arguments, message, tmp_path) -> None:
    done = subprocess.run(
        farm_command("bench", "--out", str(tmp_path), *arguments),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and message in done.stderr
    assert not any(tmp_path.iterdir())


def test_paper_configurations_cover_every_value_or_one_when_quick() -> None:
    full = paper_configurations()
    assert len(full) == 1 + 4 + 3 + 3 + 4 + 4 + 1  # static, quick ... fast-split, ours
    assert [c.label for c in full if c.algo == "fifo"] == [
        "fifo chunk=500",
        "fifo chunk=1000",
        "fifo chunk=2000",
        "fifo chunk=3000",
    ]
    assert len(paper_configurations(quick=True)) == len(POLICIES)


def run(
    rate: float,
    round_: int,
    in_job: float = 100.0,
    algo: str = "fifo",
    chunk: int = 500,
    idle: float = 0.05,
    bracket: int = 0,
) -> PolicyRun:
    return PolicyRun(
        "cores",
        "lenet",
        Configuration(algo, {"chunk": chunk}),
        round_,
        rate,
        1.0,
        in_job,
        10,
        idle,
        bracket,
    )


def test_a_summary_is_the_median_round_with_its_bracket_and_the_median_waste() -> None:
    # cpu:0 alone 50 then 60 then 40, cpu:1 alone 50 throughout
    results = ModelResults(
        "lenet", 1000, standalone={"cores": {"cpu:0": [50, 60, 40, 50], "cpu:1": [50] * 4}}
    )
    results.runs = [
        run(90, 0, 95, idle=0.02, bracket=0),
        run(70, 1, 80, idle=0.10, bracket=1),
        run(80, 2, 90, idle=0.04, bracket=2),
    ]
    (summary,) = results.summaries()
    assert summary.rate == 80 and summary.rounds == 3
    assert summary.waste == pytest.approx(0.04)  # the median of the traces' idle shares
    assert summary.bracket_theoretical == pytest.approx(95)  # (40 + 50 + 50 + 50) / 2
    assert summary.standalone_waste == pytest.approx(1 - 80 / 95)
    assert summary.drift == pytest.approx(0.25)  # cpu:0 from 40 to 50
    assert summary.contention == pytest.approx(1 - 90 / 95)
    assert summary.farm_waste == pytest.approx(1 - 80 / 90)
    assert sorted(results.drifts()) == pytest.approx([0, 0, 0, 0.2, 0.25, 1 / 3])


def test_relative_speed_is_against_one_core_and_waste_averaged_over_values() -> None:
    results = ModelResults(
        "lenet", 1000, standalone={"cores": {"cpu:0": [40, 60], "cpu:1": [50, 50]}}
    )
    results.runs = [run(150, 0, chunk=500, idle=0.1), run(200, 0, chunk=1000, idle=0.3)]
    assert results.one_core() == 50 and results.theoretical("cores") == 100
    assert relative_table(results, "cores") == {"fifo": pytest.approx((2 + 3) / 2)}
    assert waste_table(results, "cores") == {"fifo": pytest.approx(0.2)}
    fastest = results.farm_best()
    assert fastest is not None and fastest.config.label == "fifo chunk=1000"
    assert results.best_per_policy()[("cores", "fifo")].config.label == "fifo chunk=500"


def test_a_policies_only_folder_has_no_table2_or_peers_and_renders_again(tmp_path) -> None:
    results = ModelResults(
        "lenet", 1000, standalone={"cores": {"cpu:0": [40, 60, 50], "cpu:1": [50, 50, 50]}}
    )
    results.batches = {"cpu core (auto)": [(64, 100.0)]}
    results.runs = [run(90, 0, idle=0.1, bracket=0), run(95, 0, chunk=1000, bracket=1)]
    setups, _ = farm_setups(("cores",))
    machine = {
        "date": "2026-11-26",
        "cpu": "AMD EPYC",
        "cores": 2,
        "memory_gib": 1.0,
        "gpus": [],
        "kernel": "6",
        "python": "3",
        "versions": {},
        "load_average": [1.0, 1.0, 1.0],
    }
    write_folder(tmp_path, SuiteRun(machine, setups, [], [results], "farm bench", 60.0))
    names = {path.name for path in tmp_path.iterdir()}
    assert {"figure5-waste.png", "figure3-lenet.png", "policies.csv", "report.md"} <= names
    assert not names & {"table2.csv", "peers.csv", "table2.png", "peers.png"}
    report = (tmp_path / "report.md").read_text()
    assert "## Table 2" not in report and "## Peers" not in report
    assert "median 8.3%, max 50.0%" in report  # cpu:0 40 -> 60 -> 50 (+50%, -16.7%); cpu:1 0, 0
    again = read_folder(tmp_path)
    assert [r.idle for r in again.results[0].runs] == [0.1, 0.05]


def test_every_peer_has_candidates_a_mechanism_and_runs_here_but_ray() -> None:
    assert set(CANDIDATES) == set(PEERS) == set(PEER_MECHANISM)
    assert all(missing(peer) is None for peer in PEERS_RUN)  # farm's own dependencies
    assert set(PEERS_RUN) < set(PEERS)


def test_the_default_farm_runs_the_workers_default_backend() -> None:
    worker = WorkerSpec("cpu:0")
    assert worker.library == "auto" and worker.options() == []  # no --backend: auto
    assert worker.kind == "cpu core (auto)" and WorkerSpec.from_label(worker.label) == WorkerSpec(
        "cpu:0", "auto"
    )
    setups, _ = farm_setups(("cores",))
    assert all(w.backend is None for w in setups[0].workers)
    assert "auto" in SETUP_ABOUT["cores"] and "OpenCV" not in SETUP_ABOUT["cores"]
