"""A discrete-event simulator that drives the very policy objects the broker runs.

Devices are modelled by their per-chunk cost ``t(n) = a + n / v`` (``a`` the
fixed cost of a chunk, ``v`` items/second), with optional noise (each
chunk's compute time times a mean-one log-normal factor whose spread shrinks
with the chunk's length), optional drift (from time
``drift_at`` the device runs at ``drift_factor`` of its speed) and a one-way
message latency.  The driver behaves as the broker does: each device has
``slots`` chunks it may hold; when a result arrives the policy hears
``ChunkDone`` and then ``WorkerReady`` for the freed slot.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field


from farm.policies import Assign, Chunk, ChunkDone, Policy, WorkerReady


#: Seconds over which a device's speed jitters independently (see ``DeviceModel.noise_factor``).
NOISE_WINDOW = 0.1


@dataclass(frozen=True)
class DeviceModel:
    """One simulated worker."""

    name: str
    rate: float  # v, items/second
    overhead: float = 0.0  # a, seconds per chunk
    noise: float = 0.0  # relative sd of the compute time of a chunk of NOISE_WINDOW seconds
    drift_at: float | None = None  # seconds into the job when the speed changes
    drift_factor: float = 1.0  # speed multiplier from drift_at on

    def noise_factor(self, items: int, rng: random.Random) -> float:
        """A mean-one log-normal factor on a chunk's compute time.

        Jitter is independent from one ``NOISE_WINDOW`` to the next, so a
        chunk of ``k`` windows has ``noise / sqrt(k)`` relative sd: long chunks
        average it out, as real batches do.
        """
        if not self.noise:
            return 1.0
        windows = max(1.0, items / self.rate / NOISE_WINDOW)
        sigma = self.noise / math.sqrt(windows)
        return math.exp(rng.gauss(-sigma * sigma / 2, sigma))

    def finish_time(self, start: float, items: int, noise: float) -> float:
        """When a chunk of ``items`` started at ``start`` ends (``noise`` multiplies its compute time)."""
        begin = start + self.overhead
        rate = self.rate / noise
        if self.drift_at is None or begin >= self.drift_at:
            factor = self.drift_factor if self.drift_at is not None else 1.0
            return begin + items / (rate * factor)
        before = (self.drift_at - begin) * rate
        if items <= before:
            return begin + items / rate
        return self.drift_at + (items - before) / (rate * self.drift_factor)

    def items_by(self, time: float) -> float:
        """Items the device could do alone, without overhead, by ``time`` (the fluid limit)."""
        if self.drift_at is None or time <= self.drift_at:
            return self.rate * time
        return self.rate * self.drift_at + self.rate * self.drift_factor * (time - self.drift_at)


@dataclass(frozen=True)
class Scenario:
    """A farm to simulate: devices, a job size and the messaging between them."""

    name: str
    devices: tuple[DeviceModel, ...]
    total: int
    latency: float = 0.0  # one way, per message
    slots: int = 1

    @property
    def standalone_rate(self) -> float:
        """Sum of the devices' standalone speeds (the paper's theoretical speed)."""
        return sum(d.rate for d in self.devices)

    def ideal_seconds(self) -> float:
        """Least time for the job if work could be split perfectly (no overhead): drift counted."""
        low, high = 0.0, 1.0
        while sum(d.items_by(high) for d in self.devices) < self.total:
            high *= 2
        for _ in range(100):
            middle = (low + high) / 2
            if sum(d.items_by(middle) for d in self.devices) < self.total:
                low = middle
            else:
                high = middle
        return high


@dataclass
class ChunkRun:
    """One simulated chunk: who ran it, when it was assigned, ran and came back."""

    worker: str
    chunk: Chunk
    assigned: float
    started: float
    finished: float
    answered: float


@dataclass
class SimResult:
    scenario: Scenario
    policy: str
    seconds: float
    chunks: list[ChunkRun] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.scenario.total / self.seconds

    @property
    def ideal_rate(self) -> float:
        return self.scenario.total / self.scenario.ideal_seconds()

    @property
    def waste(self) -> float:
        """(ideal - achieved) / ideal; the ideal splits the job perfectly over the devices' speeds.

        Without drift the ideal speed is the sum of the devices' standalone
        speeds, the paper's theoretical speed.
        """
        return 1.0 - self.rate / self.ideal_rate


class SimulationStalled(RuntimeError):
    """The policy left work unassigned with nothing in flight."""


def simulate(scenario: Scenario, policy: Policy, seed: int = 0) -> SimResult:
    """Run one job of ``scenario`` under ``policy``; deterministic for a given seed."""
    rng = random.Random(seed)
    devices = {d.name: d for d in scenario.devices}
    free_at = {name: 0.0 for name in devices}
    queue: list[tuple[float, int, str, ChunkRun]] = []
    runs: list[ChunkRun] = []
    order = 0

    def carry_out(assignments: list[Assign], now: float) -> None:
        nonlocal order
        for assignment in assignments:
            device = devices[assignment.worker]
            noise = device.noise_factor(assignment.chunk.count, rng)
            start = max(now + scenario.latency, free_at[device.name])
            end = device.finish_time(start, assignment.chunk.count, noise)
            free_at[device.name] = end
            run = ChunkRun(device.name, assignment.chunk, now, start, end, end + scenario.latency)
            heapq.heappush(queue, (run.answered, order, device.name, run))
            order += 1

    for _ in range(scenario.slots):
        for name in devices:
            carry_out(policy.handle(WorkerReady(name, at=0.0)), 0.0)
    now = 0.0
    while queue:
        now, _, name, run = heapq.heappop(queue)
        runs.append(run)
        carry_out(policy.handle(ChunkDone(name, run.chunk, run.finished - run.started, at=now)),
                  now)
        carry_out(policy.handle(WorkerReady(name, at=now)), now)
    if not policy.finished:
        raise SimulationStalled(f"{policy.name}: {policy.remaining} items never assigned")
    return SimResult(scenario, policy.name, now, runs)


