"""A job under churn comes back whole: bench/chaos.py's run, bounded to well under a minute.

A broker (heartbeat 0.2 s, liveness 5) and 2 pinned workers, one of them in a network
namespace when one can be made; ``farm submit`` runs 25 000 LeNet digits once without
faults, then again while every 0.2-0.6 s a worker is killed and restarted, frozen for
an interval, or has its link cut, with one broker restart and one client kill followed
by ``farm submit --resume`` at fixed points.  Every output must equal the in-process
reference, no image may fail, and the last ``farm submit`` must exit 0.
"""

from __future__ import annotations

from tests.conftest import bench_script

faults = bench_script("faults")
BROKER_KILL, CLIENT_KILL, ChaosConfig, run_seed = (
    faults.BROKER_KILL,
    faults.CLIENT_KILL,
    faults.ChaosConfig,
    faults.run_seed,
)

CONFIG = ChaosConfig(
    images=25_000,
    workers=2,
    interval=(0.2, 0.6),
    broker_restarts=1,
    client_kills=1,
    job_timeout=120.0,
)


def test_a_job_under_churn_comes_back_whole_and_exact(tmp_path) -> None:
    report = run_seed(CONFIG, seed=17, root=tmp_path)
    kinds = [fault.kind for fault in report.faults]
    assert kinds.count(BROKER_KILL) == 1 and kinds.count(CLIENT_KILL) == 1, report.faults
    assert report.chaos.exit_code == 0, report.chaos.errors
    assert not report.chaos.failed_rows, f"{len(report.chaos.failed_rows)} images failed"
    assert report.chaos.max_diff <= 1e-5
    assert report.passed, report.problems
