"""The broker's wire adapter: messages become the state's events, instructions become typed
headers, and a chunk's input and outputs are checked against the attempt the state awaits."""

from __future__ import annotations

import msgpack
import msgspec
import numpy as np
import pytest

from farm.broker import events as ev
from farm.broker import wire
from farm.broker.facts import ModelFound
from farm.broker.state import FarmState, SchedulingConfig
from farm.simulation import kit
from farm.wire import messages, protocol
from farm.wire.protocol import Command

CLIENT, WORKER = b"client", b"worker"


def decoded(header: messages.Header, payload: list | tuple = ()) -> protocol.Message:
    """A message as the broker receives it."""
    return protocol.decode(protocol.encode(protocol.command_of(header), header, payload))


def farm_with_a_need(
    total: int = 3, model: ModelFound | None = None
) -> tuple[FarmState, ev.SendNeed]:
    """A one-worker farm whose job of ``total`` float32 items waits for its input."""
    state = FarmState(SchedulingConfig(algo="fifo", params={"chunk": 10}, max_chunk_seconds=0))
    state.handle(kit.joined(WORKER))
    submitted = kit.submitted("j", total, client=CLIENT, found=model)
    (need,) = kit.answer_probes(state.handle, state.handle(submitted))
    assert isinstance(need, ev.SendNeed)
    return state, need


def data(need: ev.SendNeed, payload: list) -> protocol.Message:
    return decoded(
        messages.Data(job=need.job, chunk=need.chunk, start=need.start, count=need.count), payload
    )


def result(task: ev.SendTask, **fields) -> protocol.Message:
    """The worker's RESULT for ``task``, but for ``fields``."""
    header = result_header(task, **fields)
    return decoded(header, protocol.array_frames(np.zeros((header.count, 10), np.float32)))


def result_header(task: ev.SendTask, **fields) -> messages.Result:
    return messages.Result(
        **{
            "job": task.job,
            "chunk": task.chunk,
            "start": task.start,
            "count": task.count,
            "dtype": "float32",
            "item_shape": (10,),
            "timings": {"compute": 0.5},
            **fields,
        }
    )


def test_a_chunk_crosses_the_adapter_both_ways_with_typed_headers() -> None:
    state, need = farm_with_a_need()
    peer, header, payload = wire.message_of(need)
    assert (peer, header, payload) == (
        CLIENT,
        messages.Need(job="j", chunk=need.chunk, start=0, count=3),
        (),
    )
    arrived = wire.event_of(CLIENT, data(need, [bytes(12)]), 1.0, state)
    assert isinstance(arrived, ev.DataArrived) and arrived.problem is None
    (task,) = state.handle(arrived)
    peer, header, payload = wire.message_of(task)
    assert peer == WORKER and isinstance(header, messages.Task) and payload == arrived.payload
    assert (header.job, header.start, header.count, header.dtype) == ("j", 0, 3, "float32")
    message = result(task)
    answered = wire.event_of(WORKER, message, 2.0, state)
    assert isinstance(answered, ev.ResultArrived) and answered.problem is None
    assert answered.header is message.header and answered.output_shape == (10,)
    forward = ev.matching(state.handle(answered), ev.SendResult)[0]
    peer, header, payload = wire.message_of(forward)
    assert peer == CLIENT and payload is message.payload
    assert header == messages.Result(
        job="j",
        chunk=task.chunk,
        start=0,
        count=3,
        dtype="float32",
        item_shape=(10,),
        timings={"compute": 0.5},
        worker="host:1/cpu",
        attempt=1,
        trace=forward.trace,
    )


@pytest.mark.parametrize(
    "payload, problem",
    [
        ([bytes(11)], "job j: DATA of 11 bytes, expected 3 x 4"),
        ([bytes(4), bytes(8)], "DATA carries exactly one frame"),
    ],
)
def test_data_that_is_not_the_chunks_input_carries_its_problem(payload, problem) -> None:
    state, need = farm_with_a_need()
    arrived = wire.event_of(CLIENT, data(need, payload), 1.0, state)
    assert isinstance(arrived, ev.DataArrived) and arrived.problem == problem
    assert state.handle(arrived) == [ev.SendError(peer=CLIENT, error=problem, job="j")]


NAN_ROWS = np.full((3, 10), np.nan, np.float32)


@pytest.mark.parametrize(
    "fields, outputs, problem, in_values",
    [
        ({"start": 1, "count": 2}, None, "answers items 1+2, not 0+3", False),
        ({"timings": {"receive": 0.1}}, None, "no compute time", False),
        ({"timings": {"compute": -1.0}}, None, "compute time -1.0 is not a time", False),
        ({"rerun": 4}, None, "4 items re-run in f32 and 0 failed, of 3", False),
        (
            {"item_shape": (7,)},
            np.zeros((3, 7), np.float32),
            "output shape (7,), the model's is (10,)",
            False,
        ),
        (
            {},
            np.zeros((2, 10), np.float32),
            "a malformed RESULT: payload is 80 bytes, header declares 3 x [10] float32 = 120",
            False,
        ),
        ({}, NAN_ROWS, "3 of 3 items have non-finite outputs", True),
        (
            {},
            np.full((3, 10), 2.0, np.float32),
            "probabilities range over 2..2, outside 0..1",
            True,
        ),
    ],
)
def test_a_result_that_fails_the_checks_is_refused_and_its_chunk_runs_again(
    fields, outputs, problem, in_values
) -> None:
    """The job goes on: the chunk is asked for again, nothing reaches the client, and a
    wrong form is a strike against the worker at once (wrong values only once another
    device answers the same items well)."""
    state, need = farm_with_a_need(
        model=ModelFound(
            item_shape=kit.ITEM_SHAPE, digest=kit.DIGEST, output_shape=(10,), softmax=True
        )
    )
    (task,) = state.handle(wire.event_of(CLIENT, data(need, [bytes(12)]), 1.0, state))
    header = result(task, **fields).header if outputs is None else result_header(task, **fields)
    rows = np.zeros((header.count, 10), np.float32) if outputs is None else outputs
    frames = protocol.array_frames(rows)
    try:
        answered = wire.event_of(WORKER, decoded(header, frames), 2.0, state)
    except protocol.ProtocolError as exc:  # the broker refuses it just the same
        assert exc.header == header
        answered = wire.malformed_result(WORKER, header, str(exc), 2.0)
    assert isinstance(answered, ev.ResultArrived)
    assert (answered.problem, answered.in_values) == (problem, in_values)
    out = state.handle(answered)
    assert not ev.matching(out, ev.SendResult) and not ev.matching(out, ev.SendError)
    (again,) = ev.matching(out, ev.SendNeed)
    assert (again.start, again.count) == (0, 3) and again.chunk != need.chunk
    assert state.stats.bad_answers == 1 and state.workers[WORKER].strikes == (not in_values)


def test_finite_rows_beside_failed_items_pass_and_probabilities_may_round() -> None:
    rows = np.full((3, 10), 0.1, np.float32)
    rows[1] = np.nan  # item 1 failed on its own (a corrupt image): NaN by design
    rows[2, 0] = 1.005
    failures = [(1, 1, "corrupt")]
    message = decoded(
        messages.Result(
            job="j",
            chunk=1,
            start=0,
            count=3,
            dtype="float32",
            item_shape=(10,),
            timings={"compute": 0.1},
            failed=1,
        ),
        [*protocol.array_frames(rows), protocol.failures_frame(failures)],
    )
    assert wire.answer_problem(message, (10,), softmax=True) is None


def test_a_late_result_is_not_checked_and_is_dropped() -> None:
    state, need = farm_with_a_need()
    (task,) = state.handle(wire.event_of(CLIENT, data(need, [bytes(12)]), 1.0, state))
    state.handle(ev.WorkerLeft(worker=WORKER, at=1.5))
    answered = wire.event_of(WORKER, result(task, timings={}), 2.0, state)
    assert isinstance(answered, ev.ResultArrived) and answered.problem is None
    assert state.handle(answered) == [ev.DropWorker(worker=WORKER)]


def test_error_texts_are_cut_to_the_limit() -> None:
    frames = wire.frames(messages.Error(error="x" * 5000, job="j"))
    header = protocol.decode(frames).header
    assert isinstance(header, messages.Error) and len(header.error) == wire.MAX_ERROR_CHARS
    assert header.error.endswith("...") and frames[1] == Command.ERROR.value


def test_a_ready_becomes_worker_facts_and_bad_models_are_refused() -> None:
    ready = messages.Ready(
        device="cpu:0",
        host="h",
        pid=7,
        backend="opencv",
        slots=2,
        models={"m": messages.ModelFacts(input_shape=(1,))},
        loaded=("m",),
        speeds={"m": (100, 2.0), "other": (5, 1.0)},
    )
    facts = wire.worker_facts(ready)
    assert facts.models == {"m": (1,)} and facts.loaded == frozenset({"m"})
    assert facts.speeds == {"m": (100, 2.0)}  # only models it advertises
    # a loaded model it does not advertise (a worker of an older farm, after a broker
    # restart) is a hint to drop, not a reason to lock the worker out
    odd = wire.worker_facts(
        messages.Ready(
            device="cpu:0", host="h", pid=7, backend="opencv", slots=1, models={}, loaded=("m",)
        )
    )
    assert odd.loaded == frozenset() and odd.models == {}
    # what cannot cross the wire is still refused
    with pytest.raises(protocol.ProtocolError):
        wire.worker_facts(
            messages.Ready(
                device="cpu:0",
                host="h",
                pid=7,
                backend="opencv",
                slots=1,
                models={"huge": messages.ModelFacts(input_shape=(1 << 20, 1 << 20))},
            )
        )


def test_a_ready_refused_even_undecodable_is_marked_a_refused_registration() -> None:
    """A worker exits only on a refused READY (``Error.registration``); a READY whose
    header does not decode (65 models: a READY names at most 64) is refused as one."""
    import zmq

    from farm.broker.broker import is_ready

    limit = messages.MAX_MAP
    models = {f"m{i}": messages.ModelFacts(input_shape=(1, 2, 2)) for i in range(limit)}
    header = msgspec.to_builtins(
        messages.Ready(device="cpu:0", host="h", pid=7, backend="auto", models=models, slots=2)
    )
    header["models"][f"m{limit}"] = {"input_shape": [1, 2, 2]}
    ready = [protocol.SIGNATURE, Command.READY.value, msgpack.packb(header)]
    with pytest.raises(protocol.ProtocolError, match=f"length <= {limit}"):
        protocol.decode(ready)
    assert is_ready([zmq.Frame(frame) for frame in ready])
    heartbeat = protocol.encode(Command.HEARTBEAT, messages.Heartbeat())
    assert not is_ready([zmq.Frame(bytes(frame)) for frame in heartbeat])
    older = [b"FARM08", Command.READY.value, b"\x80"]
    assert not is_ready([zmq.Frame(frame) for frame in older])
