"""The end of a job: a worker frozen while it holds the job's last chunks (SIGSTOP) is not
waited for.  Its liveness is set far beyond the job, so only backup attempts
(farm/broker/backups.py) can finish the job: the other worker runs its chunks again, and
the first answer wins.  Real broker and worker processes on loopback."""

from __future__ import annotations

import signal

import numpy as np

from farm.client.client import Client
from tests.conftest import reference_forward
from tests.system.test_recovery import assert_exactly_once, stats

#: Heartbeats every 0.2 s; a silent peer counts as gone only after 0.2 x 1000 = 200 s.
LINK = ["--heartbeat", "0.2", "--liveness", "1000"]


def test_a_frozen_workers_chunks_are_backed_up_and_every_image_comes_back_once(
    local_farm, lenet, digits
) -> None:
    local = local_farm(
        2,
        algo="equal-finish",
        broker_options=[*LINK, "--backup-share", "0.5"],
        worker_options=LINK,
        preload=["lenet"],
    )
    images = np.resize(digits, (30_000, 28, 28))
    reference = np.resize(reference_forward(lenet, digits), (30_000, 10))
    frozen = local.workers[0]
    stopped = []

    def freeze(count: int) -> None:
        if not stopped:  # at the first result: it holds chunks it will not answer
            frozen.send_signal(signal.SIGSTOP)
            stopped.append(True)

    try:
        with Client(local.endpoint, timeout=120, heartbeat=0.2) as client:
            result = client.run(images, "lenet", progress=freeze)
    finally:
        frozen.send_signal(signal.SIGCONT)
    assert stopped
    assert_exactly_once(result, images, reference)
    summary = result.summary
    assert summary.backups >= 1 and summary.backup_wins >= 1
    assert summary.backup_items <= 0.5 * summary.total
    assert 0 < summary.tail_s <= summary.span_s
    assert "backup attempts:" in summary.format() and "of the span" in summary.format()
    counters = stats(local)
    assert counters["workers_expired"] == 0  # the frozen worker was never declared gone
    assert counters["backup_wins"] >= 1 and counters["stragglers"] >= 1
