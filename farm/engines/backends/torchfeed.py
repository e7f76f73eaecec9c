"""Feeding a torch device so that it never waits for the host.

A chunk's images go to the device as clients sent them (uint8 pixels: a
quarter of the bytes of the net's float32 input) and Caffe's preprocessing
(layout, channel swap, raw scale, mean, input scale) runs there, in the same
order and in f32, so the result equals ``farm.engines.preprocess.Transformer``'s bit for
bit.  On CUDA each batch is copied into a pinned staging buffer and sent on a
copy stream while the batch before it computes on the compute stream; its
outputs come back into pinned memory, and the host waits only for the batch
``DEPTH`` behind the newest, so the device always has a batch queued.

The batches in flight are the feeder's, not a chunk's.  A worker that holds its
next chunk launches that chunk's first batches behind the current chunk's last
ones (``Feeder.start_ahead``) before it waits for them, so the GPU computes
while the host collects outputs and replies; a chunk that finds nothing in
flight starts with a batch an eighth of the others, so the idle GPU starts on
it sooner.  CUDA events time each batch's copies and its compute (from its
preprocessing's first kernel to its forward pass's last): the worker reports
them (``timings["device"]``, ``timings["copy"]``) and a trace shows how busy the
GPU was.

On the CPU the same steps run in order, without streams or pinned memory: a
CPU torch worker runs them, and so does the tests' stand-in for a GPU worker.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from farm.engines.engine import RunStats, Stopped
from farm.engines.preprocess import Transformer

log = logging.getLogger("farm.engines.torchfeed")

# a chunk's pixels arrive in read-only message frames; torch only reads them
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

#: Batches launched ahead of the one the host waits for.
DEPTH = 2
#: On CUDA a chunk that finds nothing in flight starts with this fraction of a batch: the
#: idle GPU starts on it sooner, and the host stages the full batches after it while it
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
class Pass:
    """One chunk's way through the pipeline: its images, the outputs filled in as its
    batches are collected, and how far it got."""

    images: np.ndarray
    outputs: np.ndarray
    batch: int
    edges: list[int]  # where its batches begin and end (``batch_edges``)
    stop: Callable[[], bool] | None = None
    tally: Callable[[int, float], None] | None = None
    stats: RunStats = field(default_factory=RunStats)
    launched: int = 0  # batches launched so far
    collected: int = 0  # batches whose outputs are in place

    @property
    def all_launched(self) -> bool:
        return self.launched == len(self.edges) - 1

    @property
    def done(self) -> bool:
        return self.collected == len(self.edges) - 1


@dataclass
class Launched:
    """A batch on its way: its chunk, its rows, and the events that time it."""

    owner: Pass
    begin: int
    count: int
    slot: int
    result: Any = None  # CPU: the outputs, computed at launch
    seconds: float = 0.0  # CPU: how long they took
    events: tuple[Any, ...] = ()  # CUDA: copy start, copied, compute start, computed, done


@dataclass
class Feeder:
    """Runs a module over chunks, batch by batch, keeping ``DEPTH`` batches in flight.

    The batches in flight are the feeder's, not a chunk's: while a chunk's last batches
    compute, the next chunk's first ones can be launched behind them (``start_ahead``), so
    that a chunk's end does not drain the device."""

    module: Callable[[Any], Any]  # float32 N x C x H x W on the device -> output tensor
    transform: DeviceTransform
    device: str
    dtype: Any  # the compute dtype (torch.float32, float16 or bfloat16)
    staging: dict[tuple[Any, ...], list[Any]] = field(default_factory=dict)
    streams: tuple[Any, Any] | None = None  # (copy, compute) on CUDA
    ramp: int = 1  # a chunk met by an empty pipeline starts with 1/ramp of a batch (CUDA)
    #: Whether to launch the next chunk before this one's outputs are in: on CUDA (the
    #: device computes while the host waits and replies); on the CPU a launch computes at
    #: once, so launching ahead would only delay the reply.
    overlap: bool = False
    pending: deque[Launched] = field(default_factory=deque)
    launches: int = 0  # batches launched so far: a batch's staging slot
    ahead: Pass | None = None  # a chunk launched before its ``run``
    #: Whether host buffers are page-locked: False once the host refused (a sandbox may),
    #: and copies then go through pageable memory, slower but the same bytes.
    pinned: bool = True

    def __post_init__(self) -> None:
        import torch

        self.torch = torch
        self.cuda = self.device.startswith("cuda")
        if self.cuda:  # the engine made self.device current before building the feeder
            self.streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
            self.ramp = RAMP
            self.overlap = True

    def run(
        self,
        images: np.ndarray,
        batch: int,
        output_shape: tuple[int, ...],
        stop: Callable[[], bool] | None = None,
        tally: Callable[[int, float], None] | None = None,
        then: Callable[[], None] | None = None,
    ) -> Pass:
        """The module's outputs for ``images`` (``Pass.outputs``), in batches of ``batch``.

        ``stop`` is asked before each launch; when it says yes the batches in flight are
        waited for and ``Stopped`` is raised.  ``tally`` hears each batch's images and
        device seconds.  ``then`` is called once every batch is launched, before the last
        ones are waited for: it may ``start_ahead`` the next chunk.  A chunk started ahead
        (these very ``images``) goes on where it stopped."""
        chunk, self.ahead = self.ahead, None
        if chunk is None or chunk.images is not images:
            chunk = self.begin(images, batch, output_shape, stop, tally)
        chunk.stop, chunk.tally = stop, tally
        if self.cuda:
            self.torch.cuda.set_device(self.device)  # the calling thread's device too
        try:
            with self.torch.inference_mode():
                while not chunk.all_launched:
                    self.launch_next(chunk)
                if then is not None:
                    then()
                while not chunk.done:
                    self.collect_oldest()
        except BaseException:
            self.drain()  # a stop or an error: let the launched batches finish
            raise
        return chunk

    def start_ahead(
        self,
        images: np.ndarray,
        batch: int,
        output_shape: tuple[int, ...],
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """Launch a chunk's first batches behind those in flight, collecting the older
        ones as they finish, until every batch launched before it is collected: the
        pipeline stays ``DEPTH`` deep across the chunks' boundary.  Its ``run`` goes on
        from there.  Launches nothing more once ``stop`` says so."""
        chunk = self.begin(images, batch, output_shape, stop, None)
        self.ahead = chunk
        with self.torch.inference_mode():
            while (
                not chunk.all_launched
                and any(launched.owner is not chunk for launched in self.pending)
                and not (stop is not None and stop())
            ):
                self.launch_next(chunk, check_stop=False)

    def begin(
        self,
        images: np.ndarray,
        batch: int,
        output_shape: tuple[int, ...],
        stop: Callable[[], bool] | None,
        tally: Callable[[int, float], None] | None,
    ) -> Pass:
        """A chunk's pass; it starts with a small batch (1/``ramp``) when nothing is in
        flight for the device to work on meanwhile."""
        if self.streams is not None:  # the weights were put in place on the default stream
            self.streams[1].wait_stream(self.torch.cuda.current_stream(self.device))
        first = batch if self.pending else max(1, batch // self.ramp)
        outputs = np.empty((len(images), *output_shape), dtype=np.float32)
        edges = batch_edges(len(images), batch, first)
        return Pass(images, outputs, batch, edges, stop, tally)

    def launch_next(self, chunk: Pass, check_stop: bool = True) -> None:
        """Launch the chunk's next batch, then collect the oldest batches in flight
        until ``DEPTH`` are left; ``Stopped`` if the chunk's ``stop`` says so first."""
        begin, end = chunk.edges[chunk.launched], chunk.edges[chunk.launched + 1]
        if check_stop and chunk.stop is not None and chunk.stop():
            raise Stopped(f"stopped after {begin} of {len(chunk.images)} images")
        # at most DEPTH are in flight, in the slots of the last DEPTH launches: this one's
        # slot is free
        slot = self.launches % (DEPTH + 1)
        self.pending.append(self.launch(chunk, begin, end, slot))
        self.launches += 1
        chunk.launched += 1
        while len(self.pending) > DEPTH:
            self.collect_oldest()

    def launch(self, chunk: Pass, begin: int, end: int, slot: int) -> Launched:
        """Start one batch; on CUDA its buffers are slot ``slot``'s, whose last batch was
        collected before this one was launched."""
        images = chunk.images
        launched = Launched(chunk, begin, end - begin, slot)
        if not self.cuda:
            started = time.perf_counter()
            launched.result = self.compute(self.torch.from_numpy(images[begin:end]))
            launched.seconds = time.perf_counter() - started
            return launched
        torch = self.torch
        assert self.streams is not None
        copy_stream, compute_stream = self.streams
        batch = chunk.batch
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
        output_shape = chunk.outputs.shape[1:]
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

    def collect_oldest(self) -> None:
        """Wait for the oldest batch in flight and put its outputs in place."""
        launched = self.pending.popleft()
        chunk = launched.owner
        begin, end = launched.begin, launched.begin + launched.count
        if not self.cuda:
            chunk.outputs[begin:end] = launched.result.numpy()
            seconds = launched.seconds
        else:
            copy_start, copied, started, computed, done = launched.events
            done.synchronize()
            host_out = self.staging[("out", launched.slot)][0]
            chunk.outputs[begin:end] = host_out[: launched.count].numpy()
            seconds = started.elapsed_time(computed) / 1000
            copies = copy_start.elapsed_time(copied) + computed.elapsed_time(done)
            chunk.stats.copy += copies / 1000
        chunk.stats.device += seconds
        chunk.collected += 1
        if chunk.tally is not None:
            chunk.tally(launched.count, seconds)

    def drain(self) -> None:
        """Wait for the batches in flight, whose outputs are no longer wanted; a chunk
        started ahead that had batches among them starts over in its ``run``."""
        for launched in self.pending:
            if launched.events:
                launched.events[-1].synchronize()
            if launched.owner is self.ahead:
                self.ahead = None
        self.pending.clear()

    def buffer(self, role: str, dtype: np.dtype, shape: tuple[int, ...], slot: int) -> Any:
        """Slot ``slot``'s pinned host buffer for ``role`` (in/out), reallocated when the
        shape or dtype changes."""
        key = (role, slot)
        found = self.staging.get(key)
        if found is not None and found[1] == (dtype, shape):
            return found[0]
        tensor = self.host_tensor(shape, self.torch.from_numpy(np.empty(0, dtype)).dtype)
        self.staging[key] = [tensor, (dtype, shape)]
        return tensor

    def host_tensor(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A page-locked host tensor, or a pageable one where the host refuses to lock."""
        if self.pinned:
            try:
                return self.torch.empty(shape, dtype=dtype, pin_memory=True)
            except RuntimeError as exc:
                self.pinned = False
                log.warning("no page-locked host memory (%s): copies go through pageable", exc)
        return self.torch.empty(shape, dtype=dtype)

    def release(self) -> None:
        """Drop the pinned buffers (the engine rests; nothing is in flight)."""
        self.staging.clear()


def batch_edges(count: int, batch: int, first: int) -> list[int]:
    """Where the batches of a ``count``-image chunk begin and end: ``first`` images, then
    ``batch`` at a time."""
    edges, size = [0], min(first, batch)
    while edges[-1] < count:
        edges.append(min(count, edges[-1] + size))
        size = batch
    return edges
