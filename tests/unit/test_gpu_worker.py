"""The GPU worker's engine path (``farm.engines.backends.torchfeed``) on the CPU: the same feeder,
transform and pipeline a CUDA worker runs, without streams.  Preprocessing on the device
equals Caffe's transformer bit for bit, batches stay in order, a stop is honoured, and a
worker reports the device seconds a trace's GPU busy share is made of."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref

import numpy as np
import pytest

from farm.benchsuite.setups import make_images
from farm.engines.autoselect import load_engine
from farm.engines.engine import Stopped
from farm.modelrepo.repository import find
from tests.conftest import LIMIT_ADDRESS_SPACE

torch = pytest.importorskip("torch")

from farm.engines.backends.torchfeed import DeviceTransform, batch_edges  # noqa: E402


@pytest.mark.parametrize("model", ["lenet", "cifar10_quick", "caffenet"])
def test_preprocessing_on_the_device_equals_caffes_transformer(model) -> None:
    engine = load_engine(find(model), "torch", batch=4, threads=1)
    images = make_images(model, 6)
    on_device = DeviceTransform.on(engine.transform, "cpu")(torch.from_numpy(images))
    assert np.array_equal(on_device.contiguous().numpy(), engine.transform(images))


def test_a_dropped_engine_is_freed_at_once_not_by_the_collector(lenet, digits) -> None:
    """On a GPU an engine holds its weights and pinned buffers: they must go with its last
    reference (autoselect drops each engine it timed), not wait for a cycle collection."""
    engine = load_engine(lenet, "torch", batch=8, threads=1)
    engine.run(np.resize(digits[:, None], (9, 1, *digits.shape[1:])))
    weights = weakref.ref(next(engine.module.parameters()))
    gc.disable()
    try:
        del engine
        assert weights() is None
    finally:
        gc.enable()


OUT_OF_MEMORY = (
    """
import json
from farm.benchsuite.setups import make_images
from farm.engines.autoselect import load_engine, time_batches
from farm.modelrepo.repository import find

engine = load_engine(find("lenet"), "torch", batch=16, threads=1)
images = make_images("lenet", 16)
time_batches(engine, images, (16,), budget=0.01)  # torch and the engine's buffers loaded
"""
    + LIMIT_ADDRESS_SPACE
    + """
print(json.dumps(time_batches(engine, images, (16, 8192), budget=0.1)))
"""
)


def test_a_batch_the_memory_cannot_hold_is_left_out_of_the_timing() -> None:
    """A real out of memory (an address-space limit) at the larger batch, as a GPU's memory
    may not hold batch 1024: the smaller batch's rate stands and the worker can start."""
    done = subprocess.run(
        [sys.executable, "-c", OUT_OF_MEMORY], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rates = json.loads(done.stdout.splitlines()[-1])
    assert list(rates) == ["16"] and rates["16"] > 0
    assert "batch 8192 left out on torch" in done.stderr and "allocate" in done.stderr


def test_host_buffers_are_page_locked_or_pageable_where_locking_is_refused(lenet, caplog) -> None:
    """A host without CUDA refuses page-locked memory, as a sandboxed GPU host may: the
    buffer is then pageable, of the shape and type asked, and the refusal is said once."""
    engine = load_engine(lenet, "torch", batch=8, threads=1)
    feeder = engine.feeder
    first = feeder.buffer("in", np.dtype(np.uint8), (8, 1, 28, 28), 0)
    second = feeder.buffer("out", np.dtype(np.float32), (8, 10), 0)
    assert (first.shape, first.dtype, second.dtype) == ((8, 1, 28, 28), torch.uint8, torch.float32)
    assert feeder.buffer("in", np.dtype(np.uint8), (8, 1, 28, 28), 0) is first  # kept
    locks = torch.cuda.is_available()
    assert feeder.pinned is locks and first.is_pinned() is locks and second.is_pinned() is locks
    refusals = [r for r in caplog.records if "no page-locked host memory" in r.getMessage()]
    assert len(refusals) == (0 if locks else 1)


@pytest.mark.parametrize("count", [1, 7, 64, 129])
def test_the_pipeline_returns_every_batch_in_order(lenet, digits, count) -> None:
    batch = 16  # 129 images: 9 batches, more than DEPTH in flight, and a short last one
    engine = load_engine(lenet, "torch", batch=batch, threads=1)
    images = np.resize(digits[:, None], (count, 1, *digits.shape[1:]))
    heard: list[int] = []
    outputs = engine.run(images, tally=lambda done, seconds: heard.append(done))
    expected = np.concatenate(
        [engine.forward(engine.transform(images[i : i + batch])) for i in range(0, count, batch)]
    )
    assert np.array_equal(outputs, expected)
    assert heard == [min(batch, count - i) for i in range(0, count, batch)]
    assert engine.last_run.device > 0 and engine.last_run.copy == 0.0  # nothing to copy


def test_a_stop_ends_the_chunk_between_batches(lenet, digits) -> None:
    engine = load_engine(lenet, "torch", batch=8, threads=1)
    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 3  # after three batches were launched

    with pytest.raises(Stopped, match="after 24 of 64"):
        engine.run(np.resize(digits[:, None], (64, 1, *digits.shape[1:])), stop=stop)


def test_reduced_precision_is_a_gpu_option_and_refused_on_the_cpu(lenet) -> None:
    from farm.modelrepo.repository import ModelError

    with pytest.raises(ModelError, match="f32 on the CPU"):
        load_engine(lenet, "torch", precision="f16")


def test_a_ramped_chunk_starts_with_a_small_batch(lenet, digits) -> None:
    """As on CUDA: the first batch is 1/ramp of the others, the outputs are unchanged."""
    engine = load_engine(lenet, "torch", batch=16, threads=1)
    images = np.resize(digits[:, None], (50, 1, *digits.shape[1:]))
    plain = engine.run(images)
    engine.feeder.ramp = 8
    heard: list[int] = []
    ramped = engine.run(images, tally=lambda done, _: heard.append(done))
    assert np.allclose(ramped, plain, rtol=1e-5, atol=1e-7)  # other batch sizes, other sums
    assert heard == [2, 16, 16, 16]
    assert batch_edges(0, 16, 2) == [0] and batch_edges(1, 16, 2) == [0, 1]


def test_a_gpu_worker_keeps_one_more_chunk_in_flight() -> None:
    from farm import defaults
    from farm.workers.worker import Device, Worker, WorkerConfig

    assert Device.parse("gpu:0").default_slots == defaults.GPU_SLOTS == defaults.SLOTS + 1
    assert Device.parse("cpu:1").default_slots == defaults.SLOTS
    worker = Worker(
        WorkerConfig(broker="tcp://127.0.0.1:1", device=Device.parse("cpu:0"), backend="opencv")
    )
    assert worker.ready_header().slots == defaults.SLOTS
    worker.config.slots = 5
    assert worker.ready_header().slots == 5


def recording_launches(engine) -> list[str]:
    """Log each batch the engine's module computes ("launch"; on the CPU a launch
    computes at once) into the returned list."""
    events: list[str] = []
    module = engine.feeder.module

    def recorded(batch):
        events.append("launch")
        return module(batch)

    engine.feeder.module = recorded
    return events


def test_the_next_chunk_is_launched_before_the_last_batches_are_waited_for(lenet, digits) -> None:
    """Across a chunk boundary the pipeline stays DEPTH batches deep: the next chunk's first
    batches are launched before the current chunk's last ones are collected, each chunk's
    outputs equal its run alone, and no batch is computed twice."""
    from farm.engines.backends.torchfeed import DEPTH

    engine = load_engine(lenet, "torch", batch=8, threads=1)
    first = np.resize(digits[:, None], (40, 1, *digits.shape[1:]))  # 5 batches
    second = np.ascontiguousarray(first[::-1][:20])  # 3 batches: 8, 8, 4
    alone = engine.run(first), engine.run(second)
    events = recording_launches(engine)

    def launch_second() -> None:
        events.append("ahead")
        engine.start_ahead(second)

    outputs = engine.run(
        first, tally=lambda done, _: events.append("collect first"), then=launch_second
    )
    assert events.count("collect first") == 5  # every batch in before its run returned
    outputs_second = engine.run(second, tally=lambda done, _: events.append("collect second"))
    assert np.array_equal(outputs, alone[0]) and np.array_equal(outputs_second, alone[1])
    assert events.count("launch") == 5 + 3 and events.count("collect second") == 3
    ahead = events.index("ahead")
    last_of_first = len(events) - 1 - events[::-1].index("collect first")
    launched_ahead = events[ahead:last_of_first].count("launch")
    assert launched_ahead == DEPTH  # launched while the first chunk's last batches computed
    assert not engine.feeder.pending and engine.feeder.ahead is None


def test_a_chunk_launched_ahead_and_then_cancelled_stops_and_leaves_nothing_in_flight(
    lenet, digits
) -> None:
    engine = load_engine(lenet, "torch", batch=8, threads=1)
    first = np.resize(digits[:, None], (24, 1, *digits.shape[1:]))
    second = np.ascontiguousarray(first[:20])
    cancelled: list[bool] = []
    engine.run(first, then=lambda: engine.start_ahead(second, stop=lambda: bool(cancelled)))
    cancelled.append(True)  # the job is cancelled after its first batches were launched
    with pytest.raises(Stopped, match="after 16 of 20"):
        engine.run(second, stop=lambda: bool(cancelled))
    assert not engine.feeder.pending and engine.feeder.ahead is None
    assert np.array_equal(engine.run(second), load_engine(lenet, "torch", 8, threads=1).run(second))


def test_a_chunk_launched_ahead_but_not_run_next_changes_no_other_chunks_outputs(
    lenet, digits
) -> None:
    """The broker's next message was not the chunk launched ahead (its connection went, say):
    its batches finish into its own outputs, and the chunk run instead is right."""
    engine = load_engine(lenet, "torch", batch=8, threads=1)
    images = np.resize(digits[:, None], (30, 1, *digits.shape[1:]))
    skipped, other = images[:20].copy(), images[10:].copy()
    expected = engine.run(other)
    engine.run(images, then=lambda: engine.start_ahead(skipped))
    assert np.array_equal(engine.run(other), expected)
    assert not engine.feeder.pending


def test_a_worker_launches_its_next_queued_chunk_ahead_and_runs_it_from_there(
    lenet, digits
) -> None:
    """A real worker and its real compute path, in-process, with the torch engine feeding
    ahead as on a GPU: while chunk 1's last batches compute, chunk 2 (queued behind it) is
    read and launched; chunk 2's turn goes on from there, and both results are right."""
    import queue

    from farm.wire import messages, protocol
    from farm.wire.protocol import Command
    from farm.workers.worker import Device, QueuedMessage, Worker, WorkerConfig
    from tests.frames import task

    worker = Worker(
        WorkerConfig(broker="tcp://127.0.0.1:1", device=Device.parse("cpu:0"), backend="torch")
    )
    worker.config.batch = 8
    images = np.resize(digits[:, None], (40, 1, *digits.shape[1:]))
    chunks = [
        protocol.decode(task(b"w", chunk, part)[1:])
        for chunk, part in ((1, images[:24]), (2, images[24:]))
    ]
    engine = worker.engines.load(lenet, worker.engines.key(chunks[0].header))
    expected = [engine.run(message.array("uint8", (1, 28, 28))) for message in chunks]
    engine.feeder.overlap = True  # as on CUDA
    events = recording_launches(engine)
    runner = worker.runner
    runner.upcoming = queue.Queue()
    runner.upcoming.put(QueuedMessage(0, chunks[1], 0.0))
    replies = worker.dispatch(chunks[0], 0.0)
    assert runner.prefetched is not None and runner.prefetched[0] is chunks[1]
    assert events.count("launch") == 3 + 2  # chunk 2's first two batches, launched ahead
    runner.upcoming.get()
    replies += worker.dispatch(chunks[1], 0.0)
    assert events.count("launch") == 3 + 2  # chunk 2's 16 images: none launched again
    assert runner.prefetched is None
    for reply, want in zip(replies, expected):
        result = protocol.decode(reply)
        assert result.command is Command.RESULT and isinstance(result.header, messages.Result)
        assert np.array_equal(result.array("float32", result.header.item_shape), want)
