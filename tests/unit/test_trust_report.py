"""What the summaries, ``farm status`` and the metrics say of answers the broker did not take
on trust: refused answers, quarantined workers, spot checks, parked jobs, peers that see
their own jobs only."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from prometheus_client import CollectorRegistry

from farm.broker.core import FarmStats
from farm.broker.metrics import BrokerMetrics
from farm.broker.state import FarmCounts
from farm.cli.job import echo_result, trust_lines
from farm.client.client import JobResult
from farm.client.status import OWN_JOBS_NOTE, format_status
from farm.summary import JobSummary, WorkerShare

WORKER = "host:123/cpu:1"
WHY = "3 answers failed the checks; last: 4 of 4 items have non-finite outputs"


def summary(**fields: Any) -> JobSummary:
    share = WorkerShare(
        name="h:1/cpu:0", device="cpu:0", items=100, chunks=2, compute_s=1.0, rate=100.0
    )
    base: dict[str, Any] = {"total": 100_000, "items": 100_000, "workers": (share,), "seconds": 2.0}
    return JobSummary(**{**base, **fields})


def test_a_clean_job_prints_no_trust_lines() -> None:
    assert trust_lines(summary()) == []
    assert trust_lines(JobSummary(total=10, items=10)) == []


def test_refused_answers_quarantine_spot_checks_and_parks_each_get_a_line() -> None:
    lines = trust_lines(
        summary(
            bad_answers=2,
            quarantined=(f"{WORKER}: {WHY}",),
            verified=1_000,
            disagreements=0,
            corrected=2_000,
            parked=1,
        )
    )
    assert lines == [
        "2 answers failed the broker's checks and ran again on other workers",
        f"quarantined: {WORKER}: {WHY}",
        "verified 1,000 images (1.0%) on another device: 0 disagreements",
        "corrected: 2,000 images re-run after a worker lost a spot check",
        "parked 1 time: the client left a NEED unanswered",
    ]


def test_spot_checks_no_device_could_settle_or_run_are_said() -> None:
    lines = trust_lines(summary(verified=500, disagreements=3, unresolved=1, unverified=20))
    assert lines == [
        "verified 500 images (0.5%) on another device: 3 disagreements, 1 unresolved",
        "unverified: 20 images sampled for a spot check had no other device to run on",
    ]


def test_trust_lines_agree_in_number() -> None:
    lines = trust_lines(summary(bad_answers=1, verified=1, disagreements=1, parked=3))
    assert lines == [
        "1 answer failed the broker's checks and ran again on another worker",
        "verified 1 image (0.0%) on another device: 1 disagreement",
        "parked 3 times: the client left a NEED unanswered",
    ]


def test_the_printed_summary_ends_with_the_trust_lines(capsys) -> None:
    echo_result(JobResult(outputs=None, summary=summary(bad_answers=2, parked=1)), None, None)
    out = capsys.readouterr().out
    assert "2 answers failed the broker's checks" in out and "parked 1 time" in out
    echo_result(JobResult(outputs=None, summary=summary()), None, None)
    out = capsys.readouterr().out
    assert "checks" not in out and "parked" not in out and "quarantined" not in out


def worker(name: str, **fields: Any) -> dict[str, Any]:
    described = {
        "name": name,
        "backend": "onnxruntime",
        "state": "idle",
        "rate": 0.0,
        "busy_share": 0.0,
        "in_flight": 0,
        "slots": 2,
        "heartbeat_age_s": 0.5,
        "items_done": 0,
        "strikes": 0,
        "quarantined": None,
    }
    return {**described, **fields}


def job(**fields: Any) -> dict[str, Any]:
    described = {
        "job": "0123456789abcdef",
        "client": "me",
        "model": "lenet",
        "policy": "fifo",
        "priority": 0,
        "state": "running",
        "total": 1000,
        "done": 500,
        "rate": 100.0,
        "eta_s": 5.0,
        "in_flight": 1,
        "owner": "me",
        "parked": False,
        "bad_answers": 0,
    }
    return {**described, **fields}


def snapshot(workers: list[dict[str, Any]], jobs: list[dict[str, Any]], **fields: Any) -> dict:
    return {
        "endpoint": "tcp://127.0.0.1:5555",
        "uptime_s": 65.0,
        "policy": "fifo",
        "sharing": "fair",
        "jobs_ended": {"done": 1},
        "stats": asdict(FarmStats()),
        "workers": workers,
        "jobs": jobs,
        **fields,
    }


def test_a_quiet_farms_status_says_nothing_of_trust() -> None:
    text = format_status(snapshot([worker("h:1/cpu:0")], [job()]))
    for word in ("QUARANTINED", "strike", "PARKED", "not trusted", "own jobs", "checks"):
        assert word not in text, word


def test_status_shows_quarantined_workers_strikes_and_why() -> None:
    workers = [
        worker(WORKER, state="quarantined", strikes=3, quarantined=WHY),
        worker("h:2/cpu:0", state="busy", strikes=1),
    ]
    lines = format_status(snapshot(workers, [])).splitlines()
    [quarantined] = [line for line in lines if line.startswith(WORKER)]
    assert "QUARANTINED (3 strikes)" in quarantined
    [striked] = [line for line in lines if line.startswith("h:2/cpu:0")]
    assert "BUSY (1 strike)" in striked
    assert f"  {WORKER} quarantined: {WHY}" in lines


def test_status_shows_parked_jobs_and_bad_answers() -> None:
    lines = format_status(snapshot([], [job(parked=True, bad_answers=2)])).splitlines()
    [row] = [line for line in lines if line.startswith("0123456789ab ")]
    assert " PARKED " in row
    assert "  0123456789ab: 2 answers failed the broker's checks and ran again elsewhere" in lines
    assert any(
        line.startswith("  PARKED: the job's client left a NEED unanswered") for line in lines
    )


def test_status_says_when_it_shows_the_peers_own_jobs_only() -> None:
    assert OWN_JOBS_NOTE in format_status(snapshot([], [job()], view="own jobs")).splitlines()
    assert OWN_JOBS_NOTE not in format_status(snapshot([], [job()]))
    assert OWN_JOBS_NOTE.startswith("showing your own jobs only: connect from the broker's host")


def test_status_lists_the_refusal_counters_apart_from_recoveries() -> None:
    stats = {
        **asdict(FarmStats()),
        "requeued_chunks": 4,
        "refused_messages": 3,
        "bad_answers": 2,
        "quarantined_workers": 1,
        "parked_jobs": 1,
        "refused_fetches": 2,
    }
    lines = format_status({**snapshot([], []), "stats": stats}).splitlines()
    assert "recovered from: 4 requeued chunks" in lines
    assert (
        "not trusted: 3 refused messages, 2 answers that failed the checks, "
        "1 quarantined worker, 1 parked job, 2 refused fetches"
    ) in lines


class Entry:
    """The parts of a worker's registry entry the metrics read."""

    def __init__(self) -> None:
        self.name, self.device, self.host = WORKER, "cpu:1", "host"
        self.in_flight: dict[int, Any] = {}
        self.last_seen = 0.0
        self.strikes = 0
        self.quarantined: str | None = None


def metrics(stats: FarmStats) -> tuple[BrokerMetrics, CollectorRegistry]:
    counts = FarmCounts(jobs={}, workers=1, chunks_waiting=0, outcomes={}, stats=asdict(stats))
    broker = BrokerMetrics(lambda: 1.0, lambda: counts)
    return broker, broker.registry


def test_metrics_export_the_refusal_counters_and_each_workers_quarantine() -> None:
    stats = FarmStats(
        refused_messages=3, bad_answers=2, quarantined_workers=1, parked_jobs=1, refused_fetches=4
    )
    broker, registry = metrics(stats)
    entry = Entry()
    broker.worker_joined(entry)  # type: ignore[arg-type]
    labels = {"worker": WORKER, "device": "cpu:1", "host": "host"}
    assert registry.get_sample_value("farm_worker_quarantined", labels) == 0
    assert registry.get_sample_value("farm_worker_strikes", labels) == 0
    entry.strikes, entry.quarantined = 3, WHY
    assert registry.get_sample_value("farm_worker_quarantined", labels) == 1
    assert registry.get_sample_value("farm_worker_strikes", labels) == 3
    for name in ("refused_messages", "bad_answers", "quarantined_workers", "parked_jobs"):
        value = registry.get_sample_value("farm_broker_events_total", {"event": name})
        assert value == getattr(stats, name), name
    assert registry.get_sample_value("farm_broker_events_total", {"event": "refused_fetches"}) == 4
    broker.worker_left(entry)  # type: ignore[arg-type]
    assert registry.get_sample_value("farm_worker_quarantined", labels) is None
    assert registry.get_sample_value("farm_worker_strikes", labels) is None


def test_status_shows_stragglers_and_a_job_in_its_tail_with_its_backups() -> None:
    workers = [worker(WORKER, state="straggling"), worker("h:2/cpu:0", state="idle")]
    jobs = [job(tail_s=1.5, backups=2, backup_wins=1)]
    lines = format_status(snapshot(workers, jobs)).splitlines()
    [straggling] = [line for line in lines if line.startswith(WORKER)]
    assert "STRAGGLING" in straggling
    assert any(line.startswith("WORKERS  2 (1 busy)") for line in lines)
    assert (
        "  0123456789ab: in its tail for 1.5 s (a worker idle with nothing left); "
        "backup attempts: 2 chunks, 1 won"
    ) in lines
    assert not any(
        "in its tail" in line for line in format_status(snapshot([], [job()])).splitlines()
    )
