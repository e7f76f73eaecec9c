"""The GPU worker's engine path (``farm.engines.backends.torchfeed``) on the CPU: the same feeder,
transform and pipeline a CUDA worker runs, without streams.  Preprocessing on the device
equals Caffe's transformer bit for bit, batches stay in order, a stop is honoured, and a
worker reports the device seconds a trace's GPU busy share is made of."""

from __future__ import annotations

import numpy as np
import pytest

from farm.bench.setups import make_images
from farm.engines.autoselect import load_engine
from farm.engines.engine import Stopped
from farm.modelrepo.repository import find

torch = pytest.importorskip("torch")

from farm.engines.backends.torchfeed import DeviceTransform, batch_edges  # noqa: E402


@pytest.mark.parametrize("model", ["lenet", "cifar10_quick", "caffenet"])
def test_preprocessing_on_the_device_equals_caffes_transformer(model) -> None:
    engine = load_engine(find(model), "torch", batch=4, threads=1)
    images = make_images(model, 6)
    on_device = DeviceTransform.on(engine.transform, "cpu")(torch.from_numpy(images))
    assert np.array_equal(on_device.contiguous().numpy(), engine.transform(images))


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
