"""Feeding a torch device so that it never waits for the host.

A chunk's images go to the device as clients sent them (uint8 pixels: a
quarter of the bytes of the net's float32 input) and Caffe's preprocessing
(layout, channel swap, raw scale, mean, input scale) runs there, in the same
order and in f32, so the result equals ``farm.engines.preprocess.Transformer``'s bit for
bit.  On CUDA each batch is copied into a pinned staging buffer and sent on a
copy stream while the batch before it computes on the compute stream (a chunk's
first batch is an eighth of the others, so the GPU waits little between chunks); its
outputs come back into pinned memory, and the host waits only for the batch
``DEPTH`` behind the newest, so the device always has a batch queued.  CUDA
events time each batch's copies and its compute (from its preprocessing's first kernel to
its forward pass's last): the worker reports them (``timings["device"]``,
``timings["copy"]``) and a trace shows how busy the GPU was.

On the CPU the same steps run in order, without streams or pinned memory: a
CPU torch worker runs them, and so does the tests' stand-in for a GPU worker.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from farm.engines.engine import RunStats, Stopped
from farm.engines.preprocess import Transformer

# a chunk's pixels arrive in read-only message frames; torch only reads them
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

#: Batches launched ahead of the one the host waits for.
DEPTH = 2
#: On CUDA a chunk's first batch is this fraction of a full one: the GPU, idle between
#: chunks, starts on it sooner, and the host stages the full batches after it while it
#: computes.
RAMP = 8
#: On CUDA a short batch runs padded to a multiple of this (the rows past its images are
#: left over and dropped), so that varied chunk sizes make few batch shapes, each with its
#: own kernel plans.
PAD = 8


@dataclass(frozen=True)
class DeviceTransform:
    """``Transformer``'s steps as torch operations, on the tensors' own device."""

    hwc: bool
    channel_swap: Any  # an index tensor on the device, or None
    raw_scale: float
    mean: Any  # a float32 tensor broadcastable to C x H x W on the device, or None
    input_scale: float

    @classmethod
    def on(cls, transform: Transformer, device: str) -> DeviceTransform:
        import torch

        swap = (
            torch.tensor(transform.channel_swap, device=device) if transform.channel_swap else None
        )
        mean = (
            torch.tensor(np.asarray(transform.mean, np.float32), device=device)
            if transform.mean is not None
            else None
        )
        return cls(transform.hwc, swap, transform.raw_scale, mean, transform.input_scale)

    def __call__(self, images: Any) -> Any:
        """N x item shape (any dtype) -> float32 N x C x H x W; for HWC input the result
        keeps the NHWC memory order (torch's ``channels_last``), which CUDA convolutions
        prefer."""
        batch = images.permute(0, 3, 1, 2) if self.hwc else images
        if self.channel_swap is not None:
            batch = batch.index_select(1, self.channel_swap)
        batch = batch.float()
        if self.raw_scale != 1.0:
            batch = batch * self.raw_scale
        if self.mean is not None:
            batch = batch - self.mean
        if self.input_scale != 1.0:
            batch = batch * self.input_scale
        return batch


@dataclass
class Launched:
    """A batch on its way: where its outputs go, and the events that time it."""

    begin: int
    count: int
    slot: int
    result: Any = None  # CPU: the outputs, computed at launch
    seconds: float = 0.0  # CPU: how long they took
    events: tuple[Any, ...] = ()  # CUDA: copy start, copied, compute start, computed, done


@dataclass
class Feeder:
    """Runs a module over a chunk, batch by batch, keeping ``DEPTH`` batches in flight."""

    module: Callable[[Any], Any]  # float32 N x C x H x W on the device -> output tensor
    transform: DeviceTransform
    device: str
    dtype: Any  # the compute dtype (torch.float32, float16 or bfloat16)
    staging: dict[tuple[Any, ...], list[Any]] = field(default_factory=dict)
    streams: tuple[Any, Any] | None = None  # (copy, compute) on CUDA
    ramp: int = 1  # a chunk's first batch is 1/ramp of the others (RAMP on CUDA)

    def __post_init__(self) -> None:
        import torch

        self.torch = torch
        self.cuda = self.device.startswith("cuda")
        if self.cuda:
            self.streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
            self.ramp = RAMP

    def run(
        self,
        images: np.ndarray,
        batch: int,
        outputs: np.ndarray,
        stop: Callable[[], bool] | None = None,
        tally: Callable[[int, float], None] | None = None,
    ) -> RunStats:
        """Fill ``outputs`` with the module's outputs for ``images``, in batches of
        ``batch``; ``stop`` is asked before each launch, and when it says yes the batches
        in flight are waited for and ``Stopped`` is raised; ``tally`` hears each batch's
        images and device seconds."""
        stats = RunStats()
        pending: deque[Launched] = deque()
        edges = batch_edges(len(images), batch, max(1, batch // self.ramp))
        if self.streams is not None:  # the weights were put in place on the default stream
            self.streams[1].wait_stream(self.torch.cuda.current_stream(self.device))
        try:
            with self.torch.inference_mode():
                for index, (begin, end) in enumerate(zip(edges, edges[1:])):
                    if stop is not None and stop():
                        raise Stopped(f"stopped after {begin} of {len(images)} images")
                    slot = index % (DEPTH + 1)
                    pending.append(self.launch(images, begin, end, batch, slot, outputs.shape[1:]))
                    if len(pending) > DEPTH:
                        self.collect(pending.popleft(), outputs, stats, tally)
                while pending:
                    self.collect(pending.popleft(), outputs, stats, tally)
        finally:
            self.drain(pending)  # a stop or an error: let the launched batches finish
        return stats

    def launch(
        self,
        images: np.ndarray,
        begin: int,
        end: int,
        batch: int,
        slot: int,
        output_shape: tuple[int, ...],
    ) -> Launched:
        """Start one batch; on CUDA its buffers are slot ``slot``'s, whose last batch was
        collected before this one was launched."""
        launched = Launched(begin, end - begin, slot)
        if not self.cuda:
            started = time.perf_counter()
            launched.result = self.compute(self.torch.from_numpy(images[begin:end]))
            launched.seconds = time.perf_counter() - started
            return launched
        torch = self.torch
        assert self.streams is not None
        copy_stream, compute_stream = self.streams
        host_in = self.buffer("in", images.dtype, (batch, *images.shape[1:]), slot)
        host_in[: end - begin].copy_(torch.from_numpy(images[begin:end]))
        padded = min(batch, -(-(end - begin) // PAD) * PAD)
        # blocking: the host sleeps in synchronize() instead of spinning on the core that
        # also receives the next chunks
        events = tuple(torch.cuda.Event(enable_timing=True, blocking=True) for _ in range(5))
        with torch.cuda.stream(copy_stream):
            events[0].record()
            on_device = host_in[:padded].to(self.device, non_blocking=True)
            on_device.record_stream(compute_stream)  # freed only once compute is done with it
            events[1].record()
        host_out = self.buffer("out", np.dtype(np.float32), (batch, *output_shape), slot)
        with torch.cuda.stream(compute_stream):
            compute_stream.wait_event(events[1])
            events[2].record()
            result = self.compute(on_device)
            events[3].record()
            host_out[: end - begin].copy_(result[: end - begin], non_blocking=True)
            events[4].record()
        launched.events = events
        return launched

    def compute(self, images: Any) -> Any:
        """Preprocess and run one batch on the device: its float32 outputs, N x the
        engine's output shape."""
        batch = self.transform(images.to(self.device, non_blocking=True))
        if self.cuda and batch.dim() == 4:
            batch = batch.contiguous(memory_format=self.torch.channels_last)
        else:
            batch = batch.contiguous()
        return self.module(batch.to(self.dtype)).float()

    def collect(
        self,
        launched: Launched,
        outputs: np.ndarray,
        stats: RunStats,
        tally: Callable[[int, float], None] | None,
    ) -> None:
        """Wait for a launched batch and put its outputs in place."""
        begin, end = launched.begin, launched.begin + launched.count
        if not self.cuda:
            outputs[begin:end] = launched.result.numpy()
            seconds = launched.seconds
        else:
            copy_start, copied, started, computed, done = launched.events
            done.synchronize()
            host_out = self.staging[("out", launched.slot)][0]
            outputs[begin:end] = host_out[: launched.count].numpy()
            seconds = started.elapsed_time(computed) / 1000
            stats.copy += (copy_start.elapsed_time(copied) + computed.elapsed_time(done)) / 1000
        stats.device += seconds
        if tally is not None:
            tally(launched.count, seconds)

    def drain(self, pending: deque[Launched]) -> None:
        """Wait for launched batches whose outputs are no longer wanted."""
        for launched in pending:
            if launched.events:
                launched.events[-1].synchronize()
        pending.clear()

    def buffer(self, role: str, dtype: np.dtype, shape: tuple[int, ...], slot: int) -> Any:
        """Slot ``slot``'s pinned host buffer for ``role`` (in/out), reallocated when the
        shape or dtype changes."""
        key = (role, slot)
        found = self.staging.get(key)
        if found is not None and found[1] == (dtype, shape):
            return found[0]
        tensor = self.torch.empty(
            shape, dtype=self.torch.from_numpy(np.empty(0, dtype)).dtype, pin_memory=True
        )
        self.staging[key] = [tensor, (dtype, shape)]
        return tensor

    def release(self) -> None:
        """Drop the pinned buffers (the engine rests)."""
        self.staging.clear()


def batch_edges(count: int, batch: int, first: int) -> list[int]:
    """Where the batches of a ``count``-image chunk begin and end: ``first`` images, then
    ``batch`` at a time."""
    edges, size = [0], min(first, batch)
    while edges[-1] < count:
        edges.append(min(count, edges[-1] + size))
        size = batch
    return edges
