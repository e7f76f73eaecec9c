"""A real broker and a real worker keep serving through floods of malformed messages (the strategies are tests/unit/test_fuzz.py's)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from farm.ops.local import LocalFarm, cores
from tests.conftest import reference_forward
from tests.system.test_bad_input import assert_farm_still_serves
from tests.unit.test_fuzz import (
    BATCH,
    FUZZ_SETTINGS,
    REPLY_TIMEOUT,
    RSS_GROWTH_LIMIT,
    TARGET,
    BrokerFuzzer,
    Garbage,
    WorkerFuzzer,
    bugs,
    corpus,
    fuzz_until_target,
    garbage,
    rss,
    stderr_to,
)


def test_worker_keeps_serving_through_a_flood_of_malformed_messages(lenet, digits,
                                                                     tmp_path) -> None:
    images = digits[:200, None]
    log = tmp_path / "worker.log"
    fuzzer = WorkerFuzzer(log, images, reference_forward(lenet, images))
    try:
        @FUZZ_SETTINGS
        @given(batch=st.lists(garbage("worker"), min_size=BATCH[0], max_size=BATCH[1]),
               position=st.floats(0, 1), items=st.tuples(st.integers(0, 199), st.integers(1, 50)))
        @example(batch=corpus("worker"), position=0.5, items=(0, 10))
        def fuzz_round(batch: list[Garbage], position: float, items: tuple[int, int]) -> None:
            """The batch with one real TASK among it; its RESULT must be exact."""
            if fuzzer.tally.malformed >= TARGET:
                return
            fuzzer.tally.batches += 1
            start, count = items[0], min(items[1], len(images) - items[0])
            at = int(position * len(batch))
            for item in batch[:at]:
                fuzzer.fuzz(item)
            fuzzer.send(fuzzer.real_task(start, count))
            for item in batch[at:]:
                fuzzer.fuzz(item)
            fuzzer.check_result(start, count)
            fuzzer.tally.note_rss(fuzzer.process.pid, "worker")

        seconds = fuzz_until_target(fuzz_round, fuzzer.tally)
        fuzzer.send(fuzzer.real_task(0, 10))  # its RESULT comes after the worker read it all
        fuzzer.check_result(0, 10)
        tally = fuzzer.tally
        tally.rss_end = rss(fuzzer.process.pid, "worker")
        dropped = log.read_text(errors="replace").count("dropped malformed message")
        print(f"\n{tally.report('worker', seconds)}\n  {fuzzer.real_tasks} real TASKs exact; the "
              f"worker logged {dropped} malformed messages dropped; {fuzzer.reconnects} reconnects")

        assert tally.malformed >= TARGET
        if fuzzer.reconnects == 0:  # else what was sent to the old connection was lost
            assert dropped == tally.malformed, "the worker did not get every message"
        assert tally.rss_end - tally.rss_warm < RSS_GROWTH_LIMIT, tally.report("worker", seconds)
        problems = bugs(log, tally)
        assert not problems, "the worker:\n" + "\n".join(problems)
    finally:
        fuzzer.close()


def test_broker_keeps_serving_through_a_flood_of_malformed_messages(lenet, digits,
                                                                     tmp_path) -> None:
    images = np.random.default_rng(7).integers(0, 256, (20_000, 28, 28), dtype=np.uint8)
    expected = reference_forward(lenet, images)
    devices = [f"cpu:{core}" for core in cores()[:2]] or ["cpu"]
    log = tmp_path / "farm.log"
    with contextlib.ExitStack() as cleanup:
        with stderr_to(log):  # the broker and workers log their errors (tracebacks) there
            # the fuzzer's READY garbage registers workers that never compute; one that
            # registers again or goes silent charges its chunks nothing
            local = cleanup.enter_context(LocalFarm(
                devices=devices, algo="fifo", broker_options=["--chunk", "100"],
                preload=["lenet"], log_level="ERROR"))
        fuzzer = BrokerFuzzer(local.endpoint, local.broker.pid)
        cleanup.callback(fuzzer.close)
        before = fuzzer.snapshot()["stats"]
        results: list[Any] = []  # JobResult, or the exception a job raised
        stop = threading.Event()
        cleanup.callback(stop.set)

        def real_jobs() -> None:
            """Real 20 000-image jobs, one after another, until the fuzzing is over."""
            with local.client(timeout=REPLY_TIMEOUT * 2) as client:
                while not stop.is_set():
                    try:
                        results.append(client.run(images, "lenet",
                                                  progress=lambda _: fuzzer.job_running.set()))
                    except Exception as exc:  # reported below, with the figures
                        results.append(exc)
                        return
                    finally:
                        fuzzer.job_running.clear()

        jobs = threading.Thread(target=real_jobs, daemon=True)
        jobs.start()
        assert fuzzer.job_running.wait(REPLY_TIMEOUT), "the real job did not start"

        @FUZZ_SETTINGS
        @given(batch=st.lists(garbage("broker"), min_size=BATCH[0], max_size=BATCH[1]),
               identity=st.none() | st.binary(min_size=1, max_size=32).filter(lambda b: b[0]))
        @example(batch=corpus("broker"), identity=None)
        def fuzz_round(batch: list[Garbage], identity: bytes | None) -> None:
            if fuzzer.tally.malformed < TARGET:
                fuzzer.send_batch(batch, identity)

        seconds = fuzz_until_target(fuzz_round, fuzzer.tally)
        stop.set()
        jobs.join(REPLY_TIMEOUT * 4)
        assert not jobs.is_alive(), "the real job did not finish"
        tally = fuzzer.tally
        tally.rss_end = rss(local.broker.pid, "broker")
        stats = fuzzer.snapshot()["stats"]
        print(f"\n{tally.report('broker', seconds)}\n  broker stats {stats}; "
              f"{len(results)} real jobs, {fuzzer.in_job} messages sent while one ran")

        for result in results:
            assert not isinstance(result, Exception), f"a real job failed: {result!r}"
            assert not result.failed and result.duplicates == 0
            np.testing.assert_allclose(result.outputs, expected, atol=1e-5)
        assert fuzzer.in_job >= tally.sent // 2, "the real jobs did not run alongside the fuzzing"
        assert tally.malformed >= TARGET
        assert stats["bad_messages"] - before["bad_messages"] >= tally.malformed, \
            "the broker counted fewer bad messages than were sent"
        assert tally.rss_end - tally.rss_warm < RSS_GROWTH_LIMIT, tally.report("broker", seconds)
        assert_farm_still_serves(local, lenet, digits)  # a fresh job, after the fuzzing
        assert local.broker.poll() is None and all(w.poll() is None for w in local.workers)
        problems = bugs(log, tally)
        assert not problems, "the broker or its workers:\n" + "\n".join(problems)
