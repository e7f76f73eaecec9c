"""Bad input gets a clear error to its sender; the broker and workers keep serving."""

from __future__ import annotations

import json
import subprocess
import threading
from typing import Any

import numpy as np
import pytest
import zmq

from farm.client.client import FarmError
from farm.ops.local import LocalFarm, farm_command
from farm.wire import messages, protocol
from farm.wire.protocol import Command
from tests.conftest import reference_forward
from tests.frames import (
    GARBAGE,
    next_reply,
    reply,
    reply_after_probe,
    task,
)


def assert_farm_still_serves(local, lenet, digits) -> None:
    with local.client() as client:
        outputs = client.map(digits[:300], model="lenet")
    np.testing.assert_allclose(outputs, reference_forward(lenet, digits[:300]), atol=1e-5)


@pytest.mark.parametrize(
    "images, model, reason",
    [
        (np.zeros((10, 28, 28), np.complex64), "lenet", "complex64 images cannot be sent"),
        (np.zeros((10, 28, 28), bool), "lenet", "bool images cannot be sent"),
        (np.full((10, 28, 28), 1e300), "lenet", r"item 0 holds 1e\+300, beyond float32's range"),
        (np.zeros((10, 3, 32, 32), np.float32), "lenet", r"shape \(3, 32, 32\) do not match"),
        (np.zeros((10, 1, 28, 29), np.uint8), "lenet", "do not match model 'lenet'"),
        (np.zeros((10, 28, 28), np.uint8), "no-such-model", "unknown model 'no-such-model'"),
    ],
    ids=["complex", "bool", "float64-beyond-float32", "cifar-shape", "off-by-one", "unknown-model"],
)
def test_a_bad_job_gets_a_clear_error(
    farm_two_workers, lenet, digits, images, model, reason
) -> None:
    with farm_two_workers.client() as client, pytest.raises(FarmError, match=reason):
        client.map(images, model=model)
    assert_farm_still_serves(farm_two_workers, lenet, digits)


@pytest.mark.parametrize("frames", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_frames_get_an_error_reply(
    farm_two_workers, raw_socket, lenet, digits, frames
) -> None:
    raw_socket.send_multipart(frames)
    if frames[1:2] == [b"\x03"]:  # a well-formed but unasked-for result is dropped silently
        assert_farm_still_serves(farm_two_workers, lenet, digits)
        return
    message = reply(raw_socket)
    assert message.command is Command.ERROR
    assert message.header.error
    if frames[0] == b"FARM01":
        assert f"this farm speaks {protocol.SIGNATURE.decode()}" in message.header.error
    assert_farm_still_serves(farm_two_workers, lenet, digits)


def bad_message_count(local) -> int:
    """``farm status --json``'s count of malformed messages the broker recovered from."""
    done = subprocess.run(
        farm_command("status", "--json", "--broker", local.endpoint),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout)["stats"]["bad_messages"]


@pytest.mark.parametrize("dtype", ["float64", ">f4", "int16"])
def test_a_submit_of_a_dtype_the_wire_refuses_is_an_error_not_a_bad_message(
    farm_two_workers, raw_socket, dtype
) -> None:
    """A well-formed SUBMIT the broker will not take is refused with an ERROR for its job;
    the counter of malformed messages does not move (a malformed one does move it)."""
    before = bad_message_count(farm_two_workers)
    raw_socket.send_multipart(
        protocol.encode(
            Command.SUBMIT,
            messages.Submit(
                job=f"wide-{dtype}",
                model="lenet",
                dtype=dtype,
                item_shape=(1, 28, 28),
                total=10,
                options=messages.Options(),
            ),
        )
    )
    message = reply(raw_socket)
    assert message.command is Command.ERROR and message.header.job == f"wide-{dtype}"
    assert f"dtype '{dtype}' not allowed; use one of ['float32', 'uint8']" in message.header.error
    assert bad_message_count(farm_two_workers) == before
    raw_socket.send_multipart(GARBAGE[5])  # truncated msgpack: malformed
    assert reply(raw_socket).command is Command.ERROR
    assert bad_message_count(farm_two_workers) == before + 1


def submit_frames(job: str, total: int) -> list:
    return protocol.encode(
        Command.SUBMIT,
        messages.Submit(
            job=job,
            model="lenet",
            dtype="uint8",
            item_shape=(1, 28, 28),
            total=total,
            options=messages.Options(),
        ),
    )


def test_a_data_frame_that_lies_about_its_size_fails_only_its_job(
    farm_two_workers, raw_socket, lenet, digits
) -> None:
    raw_socket.send_multipart(submit_frames("liar", 10))
    need = reply_after_probe(raw_socket, [bytes(784)])
    assert need.command is Command.NEED and (need.header.start, need.header.count) == (0, 10)
    raw_socket.send_multipart(
        protocol.encode(
            Command.DATA,
            messages.Data(job="liar", chunk=need.header.chunk, start=0, count=10),
            [b"\0" * 7839],
        )
    )
    message = reply(raw_socket)
    assert message.command is Command.ERROR and message.header.job == "liar"
    assert "7839 bytes" in message.header.error
    assert_farm_still_serves(farm_two_workers, lenet, digits)


def test_garbage_alongside_a_running_job_leaves_it_untouched(
    farm_two_workers, raw_socket, lenet
) -> None:
    images = np.random.default_rng(0).integers(0, 256, (6000, 28, 28), dtype=np.uint8)
    outcome: dict = {}

    def good_job() -> None:
        with farm_two_workers.client() as client:
            outcome["outputs"] = client.map(images, model="lenet")

    thread = threading.Thread(target=good_job)
    thread.start()
    rng = np.random.default_rng(1)
    for i in range(300):
        frames = GARBAGE[i % len(GARBAGE)]
        raw_socket.send_multipart([f[: rng.integers(0, len(f) + 1)] for f in frames] or [b""])
    thread.join(120)
    np.testing.assert_allclose(outcome["outputs"], reference_forward(lenet, images), atol=1e-5)


def test_worker_survives_garbage_and_reports_bad_chunks(lone_worker, lenet, digits) -> None:
    router, identity = lone_worker
    for frames in GARBAGE:
        router.send_multipart([identity, *frames])
    images = digits[:5, None]
    router.send_multipart(task(identity, 1, images[:, :, :27, :27]))
    failed = next_reply(router)
    assert failed.command is Command.FAILED and failed.header.chunk == 1
    assert "does not match model 'lenet'" in failed.header.error
    router.send_multipart(task(identity, 2, images, model="nope"))
    fetch = next_reply(router)
    assert fetch.command is Command.FETCH and fetch.header.model == "nope"
    router.send_multipart(
        [
            identity,
            *protocol.encode(
                Command.MODEL,
                messages.Model(
                    model="nope", digest=fetch.header.digest, files=[], error="unknown model 'nope'"
                ),
            ),
        ]
    )
    failed = next_reply(router)
    assert failed.command is Command.FAILED and "unknown model 'nope'" in failed.header.error
    router.send_multipart(task(identity, 3, images))
    result = next_reply(router)
    assert result.command is Command.RESULT and result.header.chunk == 3
    timings = result.header.timings
    assert set(timings) == {"load", "receive", "compute", "send", "device", "copy"}
    assert 0 < timings["device"] <= timings["compute"] and timings["copy"] == 0.0
    assert timings["load"] == 0.0  # the engine was loaded for chunk 1
    np.testing.assert_allclose(
        result.array("float32", (10,)), reference_forward(lenet, images), atol=1e-5
    )


@pytest.fixture
def empty_farm(local_farm) -> LocalFarm:
    """A real broker with no worker processes: the test brings scripted workers."""
    return local_farm(0, chunk=4)


def rerun_after_scripted_result(farm, images: np.ndarray, reply_to) -> tuple[Any, Any]:
    """A job of ``images`` whose one (scripted) worker answers its first TASK as
    ``reply_to(worker, task_header)`` does: the TASK the broker sends next (the same items
    run again: no other device is left), and the job's outcome once that is answered
    well."""
    from tests.system.peers import ScriptedWorker

    worker = ScriptedWorker(farm.endpoint)
    outcome: dict = {}

    def submit() -> None:
        with farm.client(timeout=20) as client:
            outcome["result"] = client.run(images, model="lenet")

    thread = threading.Thread(target=submit)
    thread.start()
    try:
        first = worker.receive()
        assert first is not None and first.command is Command.TASK
        reply_to(worker, task_fields(first.header))
        again = worker.receive()
        assert again is not None and again.command is Command.TASK
        fields = task_fields(again.header)
        rows = np.zeros((fields["count"], 10), np.float32)
        rows[:, 3] = 1.0
        worker.send(
            Command.RESULT,
            messages.Result(
                **fields, dtype="float32", item_shape=(10,), timings={"compute": 0.001}
            ),
            [rows.tobytes()],
        )
        thread.join(30)
    finally:
        worker.close()
    return again.header, outcome["result"]


def task_fields(header: Any) -> dict:
    return {key: getattr(header, key) for key in ("job", "chunk", "start", "count")}


def test_a_result_for_the_wrong_items_is_refused_and_its_chunk_runs_again(
    empty_farm, digits
) -> None:
    def wrong_items(worker, header: dict) -> None:
        worker.send(
            Command.RESULT,
            messages.Result(
                **{**header, "start": 2},
                dtype="float32",
                item_shape=(10,),
                timings={"compute": 0.001},
            ),
            [np.zeros((header["count"], 10), np.float32).tobytes()],
        )

    again, result = rerun_after_scripted_result(empty_farm, digits[:4], wrong_items)
    assert (again.start, again.count) == (0, 4)
    assert np.array_equal(result.outputs.argmax(axis=1), [3, 3, 3, 3])
    assert result.summary.bad_answers == 1 and result.summary.failed_items == 0


def test_a_result_whose_failures_list_lies_is_refused_and_its_chunk_runs_again(
    empty_farm, digits
) -> None:
    """A worker says 1 image failed on its own but lists 3: the client is not fed it."""

    def lying_failures(worker, header: dict) -> None:
        worker.send(
            Command.RESULT,
            messages.Result(
                **header, dtype="float32", item_shape=(10,), timings={"compute": 0.001}, failed=1
            ),
            [
                np.zeros((header["count"], 10), np.float32).tobytes(),
                protocol.failures_frame([(0, 3, "no")]),
            ],
        )

    again, result = rerun_after_scripted_result(empty_farm, digits[:4], lying_failures)
    assert (again.start, again.count) == (0, 4)
    assert result.summary.bad_answers == 1 and not result.failed


def test_chunks_waiting_for_their_input_count_against_the_workers_slots(empty_farm, digits) -> None:
    """A one-slot worker never holds two chunks, even while the client is slow with input."""
    from tests.system.peers import ScriptedWorker

    worker = ScriptedWorker(empty_farm.endpoint, slots=1)
    context = zmq.Context()
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(empty_farm.endpoint)
    images = digits[:12, None]
    try:
        client.send_multipart(submit_frames("late", 12))
        assert worker.receive(300) is None  # no slot is held for a job until its probe is answered
        need = reply_after_probe(client, [images[0].tobytes()])
        for start in (0, 4, 8):
            need = need if start == 0 else reply(client)
            assert need.command is Command.NEED and need.header.start == start
            assert worker.receive(300) is None  # no input yet: nothing sent
            assert reply(client, 100) is None, "a second chunk was assigned beyond the single slot"
            client.send_multipart(
                protocol.encode(
                    Command.DATA,
                    messages.Data(job="late", chunk=need.header.chunk, start=start, count=4),
                    [images[start : start + 4].tobytes()],
                )
            )
            task_message = worker.receive()
            assert task_message.header.start == start and task_message.header.attempt == 1
            np.testing.assert_array_equal(
                task_message.array("uint8", (1, 28, 28)), images[start : start + 4]
            )
            header = {
                key: getattr(task_message.header, key) for key in ("job", "chunk", "start", "count")
            }
            worker.send(
                Command.RESULT,
                messages.Result(
                    **header, dtype="float32", item_shape=(10,), timings={"compute": 0.001}
                ),
                [np.zeros((4, 10), np.float32).tobytes()],
            )
            assert reply(client).command is Command.RESULT
        assert reply(client).command is Command.DONE
    finally:
        worker.close()
        client.close()
        context.term()


def test_absurd_timings_from_a_worker_neither_wedge_a_job_nor_the_next(empty_farm, digits) -> None:
    """A compute time of 1e-320 s (an infinite speed) is taken and the job ends, the
    worker credited with the time the broker saw, not an infinite speed; a receive time
    that is not a time is refused, and the chunk runs again; the next job still runs."""
    from tests.system.peers import ScriptedWorker

    worker = ScriptedWorker(empty_farm.endpoint)
    outcomes: list = []

    def submit(count: int) -> None:
        with empty_farm.client(timeout=20) as client:
            try:
                outcomes.append(client.run(digits[:count], "lenet"))
            except FarmError as exc:
                outcomes.append(str(exc))

    def answer(timings: dict) -> None:
        message = worker.receive()
        assert message is not None and message.command is Command.TASK
        header = {key: getattr(message.header, key) for key in ("job", "chunk", "start", "count")}
        worker.send(
            Command.RESULT,
            messages.Result(**header, dtype="float32", item_shape=(10,), timings=timings),
            [np.zeros((header["count"], 10), np.float32).tobytes()],
        )

    try:
        for count, answers in (
            (8, [{"compute": 1e-320}, {"compute": 0.001}]),
            (4, [{"compute": 0.001, "receive": "x"}, {"compute": 0.001}]),
            (4, [{"compute": 0.001}]),
        ):
            thread = threading.Thread(target=submit, args=(count,))
            thread.start()
            for timings in answers:
                answer(timings)
            thread.join(30)
            assert not thread.is_alive()
    finally:
        worker.close()
    assert outcomes[0].summary.items == 8 and not outcomes[0].failed
    assert all(0 < share.rate < 1e12 for share in outcomes[0].summary.workers)
    assert outcomes[1].summary.items == 4 and outcomes[1].summary.bad_answers == 1
    assert outcomes[2].summary.items == 4
