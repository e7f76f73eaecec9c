"""Shared-storage inputs and kept results, piece by piece: the places a SUBMIT carries and
the broker cuts per chunk, the worker's reads and checks, the state's choices between
reading and sending, and the results workers keep across a lost broker."""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from farm.broker import events as ev
from farm.broker.jobs import Ranges
from farm.broker.kept import KeptResults, translate
from farm.broker.state import FarmState, SchedulingConfig
from farm.client.client import Progress
from farm.simulation import kit
from farm.wire import messages, protocol
from farm.wire.messages import StoredInputs
from farm.wire.protocol import Command
from farm.wire.storage import (
    ArrayFiles,
    SharedInputs,
    StoredError,
    UnsharedError,
    map_path,
    parse_path_map,
    read_files,
    row_ranges,
    stored_array,
    stored_files,
)
from farm.workers.kept import SentResults


def pairs(raw: bytes) -> list[tuple[int, int]]:
    values = struct.unpack(f"<{len(raw) // 8}Q", raw)
    return list(zip(values[::2], values[1::2]))


def test_row_ranges_follow_the_runs_and_wrap_round_the_array() -> None:
    # a resubmission: its items 0..9 are rows 5..14, its items 10..19 rows 40..49
    runs = [(0, 5, 10), (10, 40, 10)]
    assert pairs(row_ranges(runs, 100, 8, 4)) == [(13, 2), (40, 2)]
    # a job repeating a 30-row array: items 25..39 are rows 25..29 then 0..9
    assert pairs(row_ranges([(0, 0, 90)], 30, 25, 15)) == [(25, 5), (0, 10)]


def test_path_maps_match_whole_components_only() -> None:
    path_map = [("/home/me/photos", "/mnt/photos"), ("/home", "/nfs/home")]
    assert map_path("/home/me/photos/a.jpg", path_map) == "/mnt/photos/a.jpg"
    assert map_path("/home/me/photos2/a.jpg", path_map) == "/nfs/home/me/photos2/a.jpg"
    assert map_path("/srv/a.jpg", path_map) == "/srv/a.jpg"
    assert parse_path_map("/a/=/b") == ("/a/", "/b")
    for bad in ("relative=/b", "/a", "/a=b"):
        with pytest.raises(ValueError, match="CLIENT_PREFIX=WORKER_PREFIX"):
            parse_path_map(bad)


def test_the_broker_cuts_a_chunk_s_paths_without_copying_the_list(tmp_path: Path) -> None:
    paths = [str(tmp_path / f"{index}.jpg") for index in range(5)]
    stored = stored_files(paths, [10, 20, 30, 40, 50])
    shared = SharedInputs.check(stored, 5, 0)
    located = shared.locate(1, 3)
    assert located.stored == "files" and located.place is None
    names, sizes = located.payload
    assert bytes(names).split(b"\0") == [os.fsencode(p) for p in paths[1:4]]
    assert np.frombuffer(sizes, "<u8").tolist() == [20, 30, 40]
    with pytest.raises(StoredError, match="5 paths"):
        SharedInputs.check(stored, 6, 0)
    # a one-file job whose file the client refused: one empty name
    lone = SharedInputs.check(stored_files([""], [0]), 1, 0)
    assert bytes(lone.locate(0, 1).payload[0]) == b""


def test_a_worker_reads_shared_files_and_names_those_it_cannot(tmp_path: Path) -> None:
    for index in range(3):
        (tmp_path / f"{index}.jpg").write_bytes(b"x" * (index + 1))
    # three files, one the client refused (no path), one gone from the storage
    names = [os.fsencode(tmp_path / f"{i}.jpg") for i in range(3)]
    blob = b"\0".join([*names, b"", os.fsencode(tmp_path / "gone.jpg")])
    files, failures = read_files(blob, sizes_of(1, 2, 3, 0, 9))
    assert files == [b"x", b"xx", b"xxx", b"", b""]
    assert [index for index, _ in failures] == [4] and "cannot read" in failures[0][1]
    # not one readable file, or not the client's sizes: this host does not see its files
    with pytest.raises(UnsharedError, match="not the same file"):
        read_files(names[0], sizes_of(7))
    with pytest.raises(UnsharedError, match="cannot read"):
        read_files(os.fsencode(tmp_path / "gone.jpg"), sizes_of(9))


def sizes_of(*sizes: int) -> bytes:
    return np.array(sizes, "<u8").tobytes()


def test_a_worker_reads_rows_of_the_client_s_npy_and_nothing_else(tmp_path: Path) -> None:
    rows = np.arange(40 * 6, dtype=np.uint8).reshape(40, 1, 2, 3)
    np.save(tmp_path / "a.npy", rows)
    stored = stored_array(str(tmp_path / "a.npy"), 128, 40, [(0, 0, 80)])
    shared = SharedInputs.check(stored, 80, 6)
    located = shared.locate(35, 10)  # wraps round
    arrays = ArrayFiles()
    read = arrays.read_rows(located.place, located.payload[0], 6)
    expected = np.concatenate([rows[35:], rows[:5]])
    assert np.frombuffer(read, np.uint8).reshape(10, 1, 2, 3).tolist() == expected.tolist()
    # another file of the same name: its head differs
    np.save(tmp_path / "a.npy", rows[::-1])
    with pytest.raises(UnsharedError, match="not the client's file"):
        ArrayFiles().read_rows(located.place, located.payload[0], 6)
    arrays.close()
    with pytest.raises(StoredError, match="overrun"):
        SharedInputs.check(stored, 80, 60)


def test_a_shared_job_s_task_goes_out_at_once_and_a_blind_worker_gets_bytes() -> None:
    state = FarmState(SchedulingConfig(algo="fifo", params={"chunk": 10}))
    driver = kit.Driver(state)
    stored = StoredInputs(
        kind="npy",
        path="/nfs/a.npy",
        offset=128,
        size=528,
        head="0" * 16,
        rows=100,
        runs=[(0, 0, 100)],
    )
    inputs = SharedInputs.check(stored, 100, 4)
    driver.join(b"w1")
    out = driver.feed(dataclasses.replace(kit.submitted("j", 100), inputs=inputs))
    tasks = ev.matching(out, ev.SendTask)
    assert tasks and not ev.matching(out, ev.SendNeed), "no NEED: the worker reads the rows"
    assert tasks[0].stored == "npy" and tasks[0].place.path == "/nfs/a.npy"
    failure = dataclasses.replace(
        kit.failure_for(tasks[0], 1.0, "cannot read /nfs/a.npy", charge=False), unshared=True
    )
    out = driver.feed(failure)
    needs = ev.matching(out, ev.SendNeed)
    assert needs and (needs[0].start, needs[0].count) == (0, 10), "the chunk again, as bytes"
    assert state.stats.unshared_workers == 1 and state.stats.charged_attempts == 0


def kept_result(
    job: str, start: int, count: int, at: float = 0.0, size: int = 40
) -> ev.ResultArrived:
    return ev.ResultArrived(
        worker=b"w1",
        job=job,
        chunk=7,
        start=start,
        count=count,
        output_shape=(10,),
        timings={"compute": 0.1},
        at=at,
        kept=True,
        size=size,
    )


def test_kept_results_wait_for_their_client_then_ask_it_to_submit_again() -> None:
    state = FarmState(SchedulingConfig(algo="fifo", params={"chunk": 10}))
    driver = kit.Driver(state)
    driver.join(b"w1")
    assert driver.feed(kept_result("lost", 0, 10)) == []
    assert len(state.kept) == 1
    earlier = {"lost": ((0, 0, 100),)}
    out = driver.feed(dataclasses.replace(kit.submitted("again", 100), earlier=earlier))
    forwarded = ev.matching(out, ev.SendResult)
    assert [r.result.job for r in forwarded] == ["lost"] and forwarded[0].trace is None
    (refusal,) = ev.matching(out, ev.SendError)
    assert refusal.resubmit and refusal.job == "again" and "again" not in state.jobs
    # the next resubmission runs; a result kept later goes straight to its client
    earlier = {"lost": ((0, 0, 100),), "again": ((0, 0, 100),)}
    out = driver.feed(
        dataclasses.replace(kit.submitted("third", 90), earlier=earlier, runs=((0, 10, 90),))
    )
    assert "third" in state.jobs and ev.matching(out, ev.SendNeed)
    out = driver.feed(kept_result("lost", 10, 10))
    assert [r.result.start for r in ev.matching(out, ev.SendResult)] == [10]
    # its items 10..19 are the third submission's 0..9: done when next handed out
    assert state.jobs["third"].delivered.covers(0, 10)
    assert state.stats.kept_delivered == 2


def test_kept_results_are_bounded_in_bytes_and_time() -> None:
    kept = KeptResults(max_bytes=100, seconds=5.0)
    for n in range(4):
        kept.add(kept_result(f"j{n}", 0, 1, at=float(n), size=40))
    assert len(kept) == 2 and kept.dropped == 2 and kept.size == 80
    kept.expire(8.5)
    assert len(kept) == 0 and kept.take(("j3",)) == []


def test_a_worker_offers_what_it_sent_last_marked_kept() -> None:
    now = [0.0]
    sent = SentResults(seconds=10.0, max_bytes=1000, clock=lambda: now[0])
    outputs = np.ones((5, 10), np.float32)
    for start in (0, 5):
        sent.note(result_frames(start, outputs))
        now[0] += 6.0
    sent.note(protocol.encode(Command.HEARTBEAT, messages.Heartbeat()))
    offers = [protocol.decode(frames) for frames in sent.offers()]
    assert [(o.header.start, o.header.kept) for o in offers] == [(5, True)], "the first is too old"
    assert offers[0].array("float32", (10,)).tolist() == outputs.tolist()
    assert sent.offers() == []


def result_frames(start: int, outputs: np.ndarray) -> list:
    header = messages.Result(
        job="j",
        chunk=1,
        start=start,
        count=len(outputs),
        dtype="float32",
        item_shape=(10,),
        timings={"compute": 0.1},
    )
    return protocol.encode(Command.RESULT, header, protocol.array_frames(outputs))


def test_progress_takes_the_items_not_answered_yet_of_a_range() -> None:
    progress = Progress(20)
    assert progress.take(0, 5) == [(0, 5)]
    assert progress.take(8, 4, kept=True) == [(8, 12)] and progress.kept == 4
    # a resubmission's chunk across both: only the gaps are new
    assert progress.take(3, 12) == [(5, 8), (12, 15)]
    assert progress.take(0, 15) == [] and progress.duplicates == 1
    assert progress.take(0, 3, kept=True) == [] and progress.duplicates == 1
    assert progress.missing_runs() == [(15, 5)]


def test_a_kept_result_of_a_running_job_is_delivered_and_not_computed_again() -> None:
    """A worker counted lost comes back with the result it was computing: the client gets
    it at once, and when the policy hands its range out again the range is simply done."""
    state = FarmState(SchedulingConfig(algo="fifo", params={"chunk": 10}))
    driver = kit.Driver(state)
    driver.join(b"w1", device="cpu:0", pid=1)
    needs = driver.submit("j", 20)
    task = ev.matching(driver.answer(needs[0], 0.1), ev.SendTask)[0]
    driver.feed(ev.WorkerLeft(worker=b"w1", at=2.0, reason="silent for 1.0 s"))
    pending = driver.join(b"w1-again", at=2.5, device="cpu:0", pid=1)
    late = dataclasses.replace(
        kit.result_for(task, 2.6, 0.5), worker=b"w1-again", kept=True, output_shape=(1,)
    )
    out = driver.feed(late)
    delivered = [r for r in ev.matching(out, ev.SendResult) if r.result.kept]
    assert [(r.result.start, r.result.count) for r in delivered] == [(0, 10)]
    # the range was handed out again when the worker came back (its input asked for):
    # that attempt is answered by the kept result, and no TASK of it goes out
    sent = []
    pending = [i for i in pending + out if isinstance(i, (ev.SendNeed, ev.SendTask))]
    while pending:
        instruction = pending.pop(0)
        if isinstance(instruction, ev.SendTask):
            sent.append((instruction.start, instruction.count))
        more = driver.answer(instruction, 3.0, 0.5)
        pending += [i for i in more if isinstance(i, (ev.SendNeed, ev.SendTask))]
    assert sent == [(10, 10)] and "j" not in state.jobs
    assert state.stats.kept_used == 1 and state.outcomes["done"] == 1


def test_a_kept_range_back_in_its_policy_is_done_when_handed_out_again() -> None:
    state = FarmState(SchedulingConfig(algo="fifo", params={"chunk": 10}, max_chunk_seconds=0))
    driver = kit.Driver(state)
    driver.join(b"w1", device="cpu:0", pid=1)
    driver.join(b"w2", device="cpu:1", pid=2)
    tasks = []
    for need in driver.submit("j", 40):
        tasks += ev.matching(driver.answer(need, 0.1), ev.SendTask)
    lost = next(t for t in tasks if t.worker == b"w1")
    other = next(t for t in tasks if t.worker == b"w2")
    driver.feed(ev.WorkerLeft(worker=b"w1", at=2.0, reason="silent for 1.0 s"))
    rejoined = driver.join(b"w1", device="cpu:0", pid=1)  # registered again, it offers
    late = dataclasses.replace(kit.result_for(lost, 2.1, 0.5), kept=True)  # what it kept
    offered = driver.feed(late)
    assert ev.matching(offered, ev.SendResult), "the client gets it at once"
    sent = []
    pending = [
        i
        for i in [*rejoined, *offered, *driver.answer(other, 2.2, 0.5)]
        if isinstance(i, (ev.SendNeed, ev.SendTask))
    ]
    while pending:
        instruction = pending.pop(0)
        if isinstance(instruction, ev.SendTask):
            sent.append(instruction.start)
        pending += [
            i
            for i in driver.answer(instruction, 3.0, 0.5)
            if isinstance(i, (ev.SendNeed, ev.SendTask))
        ]
    assert lost.start not in sent and sorted(sent) == sorted(
        {0, 10, 20, 30} - {lost.start, other.start}
    )
    assert state.stats.kept_used == 1 and state.outcomes["done"] == 1


def test_kept_items_are_found_in_another_submission_s_numbering() -> None:
    # the first submission held the client's items 0..99; the third holds 10..29 and 60..99
    first = [(0, 0, 100)]
    third = [(0, 10, 20), (20, 60, 40)]
    assert translate(first, third, 5, 30) == [(0, 20)]  # 5..34: 10..29 held, 30..34 not
    assert translate(first, third, 50, 20) == [(20, 30)]
    assert translate(third, first, 15, 10) == [(25, 30), (60, 65)]


def test_delivered_ranges_merge_and_cover() -> None:
    ranges = Ranges()
    for start, stop in [(10, 20), (30, 40), (20, 30), (50, 60)]:
        ranges.add(start, stop)
    assert (ranges.starts, ranges.stops) == ([10, 50], [40, 60])
    assert ranges.covers(15, 40) and not ranges.covers(35, 55) and not ranges.covers(0, 5)
