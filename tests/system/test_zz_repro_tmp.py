import sys, time
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from tests.system.test_floods import *  # noqa
from tests.system.test_floods import WorkerFuzzer, fuzz_until_target
from tests.unit.test_fuzz import FUZZ_SETTINGS, BATCH, TARGET, garbage, corpus
from tests.conftest import reference_forward


@pytest.mark.parametrize("target", [2000, 2000, 2000])
def test_repro(lenet, digits, tmp_path, target) -> None:
    images = digits[:200, None]
    log = tmp_path / "worker.log"
    fuzzer = WorkerFuzzer(log, images, reference_forward(lenet, images))
    try:
        @FUZZ_SETTINGS
        @given(
            batch=st.lists(garbage("worker"), min_size=BATCH[0], max_size=BATCH[1]),
            position=st.floats(0, 1),
            items=st.tuples(st.integers(0, 199), st.integers(1, 50)),
        )
        def fuzz_round(batch, position, items) -> None:
            if fuzzer.tally.malformed >= target:
                return
            start, count = items[0], min(items[1], len(images) - items[0])
            at = int(position * len(batch))
            for item in batch[:at]:
                fuzzer.fuzz(item)
            fuzzer.send(fuzzer.real_task(start, count))
            for item in batch[at:]:
                fuzzer.fuzz(item)
            fuzzer.check_result(start, count)
        while fuzzer.tally.malformed < target:
            fuzz_round()
        time.sleep(7)
        try:
            fuzzer.send(fuzzer.real_task(0, 10))
            fuzzer.check_result(0, 10)
        finally:
            print("\nreplies", fuzzer.tally.replies, "bad", dict(fuzzer.tally.bad_replies), "reconnects", fuzzer.reconnects, file=sys.stderr)
    finally:
        fuzzer.close()
