"""A discrete-event simulator that drives the very ``FarmState`` the broker runs.

Devices are modelled by their per-chunk cost ``t(n) = a + n / v`` (``a`` the
fixed cost of a chunk, ``v`` items/second), with optional noise (each
chunk's compute time times a mean-one log-normal factor whose spread shrinks
with the chunk's length), optional drift (from time
``drift_at`` the device runs at ``drift_factor`` of its speed) and a one-way
message latency between the broker and each worker (the client sits beside
the broker: its NEED/DATA exchange is instant).  Simulated workers register,
jobs are submitted, and every instruction the state returns is carried out in
simulated time: NEED is answered with DATA, TASK runs on its device and comes
back as a RESULT.  Several jobs, chunk caps, lost workers and retries are the
broker's own code, not a model of it.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from farm.broker import events as ev
from farm.broker.caps import note_rate
from farm.broker.facts import JobOptions
from farm.broker.state import FarmState, SchedulingConfig
from farm.policies import Chunk
from farm.simulation import kit
from farm.simulation.kit import CLIENT
from farm.summary import JobSummary

#: Seconds over which a device's speed jitters independently (see ``DeviceModel.noise_factor``).
NOISE_WINDOW = 0.1


def steady(value: float) -> float:
    """``value`` to 9 significant digits, so that a simulation is the same on every CPU.

    libm's and numpy's exp, log and pow may differ in their last bit from one CPU to
    the next (FMA or not, AVX-512 or not), and a schedule is chaotic: moving one noise
    factor by one bit moved later chunks in 7 of 100 noisy seeded runs.  Rounded, a
    last-bit difference changes nothing unless the value lies within 1e-16 of a
    rounding boundary (about one draw in 10 million).
    """
    return float(f"{value:.9g}")


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
        return steady(math.exp(rng.gauss(-sigma * sigma / 2, sigma)))

    def finish_time(self, start: float, items: int, noise: float) -> float:
        """When a chunk of ``items`` started at ``start`` ends (``noise`` multiplies its compute
        time)."""
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
    summary: JobSummary | None = None  # the broker's account of the job (its DONE)

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
    """The farm left work unassigned with nothing in flight."""


@dataclass(order=True)
class _Pending:
    at: float
    order: int
    event: ev.FarmEvent | Callable[[float], None] = field(compare=False)


@dataclass
class FarmSimulation:
    """A simulated farm: ``join`` devices, ``submit`` jobs, ``lose`` workers, then ``run``.

    ``poison``: items that fail every chunk holding them (``"fail"``: the worker answers
    FAILED; ``"crash"``: the worker dies).  ``restart``: seconds after a worker dies or
    is lost until a new one starts on its device (None: none does).  ``heartbeat``:
    every so many seconds each worker and the client are heard and the state ticks
    (stragglers, backups for idle workers, expiries), while a job runs.
    """

    scenario: Scenario
    config: SchedulingConfig = field(default_factory=SchedulingConfig)
    seed: int = 0
    poison: dict[int, str] = field(default_factory=dict)
    restart: float | None = None
    heartbeat: float | None = None  # seconds between heartbeats and ticks (None: none)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.driver = kit.Driver(FarmState(self.config), sent=None)
        self.state = self.driver.state
        self.devices = {d.name.encode(): d for d in self.scenario.devices}
        self.models = {d.name: d for d in self.scenario.devices}
        self.current = {d.name: d.name.encode() for d in self.scenario.devices}  # its worker
        self.starts = 0  # workers started after the first ones
        self.free_at = dict.fromkeys(self.devices, 0.0)
        self.queue: list[_Pending] = []
        self.order = 0
        self.running: dict[int, tuple[float, float]] = {}  # chunk id -> (started, finished)
        self.runs: dict[str, list[ChunkRun]] = {}
        self.ended: dict[str, float] = {}  # job -> when its DONE (or end) came
        self.failed: dict[str, list[ev.SendFailed]] = {}
        self.errors: dict[str, str] = {}
        self.summaries: dict[str, JobSummary] = {}  # job -> its DONE's summary
        self.cancelled: set[int] = set()  # attempts cancelled: their answers never come
        # each worker's computing, for its heartbeats' running counters: chunks running or
        # queued (began, end, images), and (images, seconds) of those it finished
        self.computing: dict[bytes, list[tuple[float, float, int]]] = {}
        self.computed: dict[bytes, tuple[float, float]] = {}
        self.speeds: dict[str, float] = {}  # device -> speed remembered from earlier jobs
        for identity, device in self.devices.items():
            self.at(0.0, self.joined(identity, device.name, 0.0))

    def joined(self, identity: bytes, device: str, at: float) -> ev.WorkerJoined:
        """A simulated worker on ``device`` registers."""
        return kit.joined(identity, at, slots=self.scenario.slots, device=device, host="sim", pid=0)

    def at(self, when: float, event: ev.FarmEvent | Callable[[float], None]) -> None:
        heapq.heappush(self.queue, _Pending(when, self.order, event))
        self.order += 1

    def submit(
        self, job: str, total: int, at: float = 0.0, options: JobOptions | None = None
    ) -> None:
        self.at(at, kit.submitted(job, total, at=at, options=options))
        if self.heartbeat is not None:
            self.at(at + self.heartbeat, self.beat)

    def beat(self, now: float) -> None:
        """Heartbeats from every worker and the client, then a tick; again while jobs run."""
        for worker in self.current.values():
            if worker in self.state.workers:
                self.step(
                    now, ev.WorkerHeard(worker=worker, at=now, computed=self.counters(worker, now))
                )
        for job in list(self.state.jobs):
            self.step(now, ev.ClientHeard(client=CLIENT, job=job, at=now))
        self.step(now, ev.Tick(at=now))
        if self.state.jobs and self.heartbeat is not None:
            self.at(now + self.heartbeat, self.beat)

    def lose(self, device: str, at: float, crashed: bool = False) -> None:
        """The device's worker leaves at ``at`` (what it computes then is lost); ``crashed``:
        it died, rather than going silent or saying goodbye.  Its successor, if
        ``restart`` is set, is a new worker on the same device."""

        def leave(now: float) -> None:
            if self.current[device]:  # else it died already, and a new one is on its way
                self.step(
                    now,
                    ev.WorkerLeft(
                        worker=self.current[device],
                        at=now,
                        reason="lost in the simulation",
                        crashed=crashed,
                    ),
                )
                if self.restart is not None:
                    self.current[device] = b""
                    self.start_worker(device, now + self.restart)

        self.at(at, leave)

    def start_worker(self, device: str, at: float) -> None:
        """A new worker process on ``device`` at ``at`` (after its last one died)."""
        self.starts += 1
        identity = f"{device}#{self.starts}".encode()
        self.devices[identity] = self.models[device]
        self.current[device] = identity
        self.free_at[identity] = at
        self.at(at, self.joined(identity, device, at))

    def fault(self, start: int, count: int) -> str | None:
        """What a chunk of these items does on any worker: None, "fail" or "crash"."""
        hits = [kind for item, kind in self.poison.items() if start <= item < start + count]
        return "crash" if "crash" in hits else hits[0] if hits else None

    def remember(self, speeds: dict[str, float]) -> None:
        """Each device's speed from earlier jobs, as the broker remembers them; before ``run``."""
        self.speeds.update(speeds)

    def run(self) -> float:
        """Run to the end; the simulated time of the last event."""
        now = 0.0
        while self.queue:
            pending = heapq.heappop(self.queue)
            now = pending.at
            if callable(pending.event):
                pending.event(now)
            else:
                self.step(now, pending.event)
        return now

    def step(self, now: float, event: ev.FarmEvent) -> None:
        answer = isinstance(event, (ev.ResultArrived, ev.FailureArrived))
        if answer and event.chunk in self.cancelled:  # type: ignore[union-attr]
            return  # the worker dropped it
        instructions = self.driver.feed(event)
        if isinstance(event, ev.WorkerJoined) and event.worker.decode() in self.speeds:
            self.seed_speed(event.worker)
        for instruction in instructions:
            self.carry_out(now, instruction)

    def seed_speed(self, identity: bytes) -> None:
        """A history on the model worth the remembered speed (1 000 s of it)."""
        rate = self.speeds[identity.decode()]
        entry = self.state.workers[identity]
        entry.record(kit.MODEL, round(rate * 1000), 1000.0)
        note_rate(self.state, kit.MODEL, entry)

    def carry_out(self, now: float, instruction: ev.Instruction) -> None:
        match instruction:
            case ev.SendNeed():
                self.at(now, kit.data_for(instruction, now))
            case ev.SendTask(worker=worker, chunk=chunk, start=start, count=count):
                device = self.devices[worker]
                noise = device.noise_factor(count, self.rng)
                began = max(now + self.scenario.latency, self.free_at[worker])
                end = device.finish_time(began, count, noise)
                self.free_at[worker] = end
                self.running[chunk] = (began, end)
                self.computing.setdefault(worker, []).append((began, end, count))
                answered = end + self.scenario.latency
                fault = self.fault(start, count)
                if fault == "fail":
                    self.at(answered, kit.failure_for(instruction, answered, "poison"))
                elif fault == "crash":  # the broker hears of it as of a reply: a latency on
                    self.crash(worker, answered)
                else:
                    self.at(answered, kit.result_for(instruction, answered, end - began))
            case ev.SendCancel(peer=peer, chunk=int(chunk)) if peer != CLIENT:
                self.cancel(peer, chunk, now + self.scenario.latency)
            case ev.SendResult(result=result, trace=trace):
                assert trace is not None  # no broker is lost here: no result is kept
                began, end = self.running.pop(result.chunk)
                self.runs.setdefault(result.job, []).append(
                    ChunkRun(
                        result.worker.decode(),
                        Chunk(result.start, result.count),
                        trace[0],
                        began,
                        end,
                        now,
                    )
                )
            case ev.SendDone(job=job, summary=summary):
                self.ended[job] = now
                self.summaries[job] = summary
            case ev.SendFailed(job=job):
                self.failed.setdefault(job, []).append(instruction)
            case ev.SendError(error=error, job=str(job)):
                self.errors[job] = error
                self.ended[job] = now
            case ev.SendCancel(peer=peer, job=job) if peer == CLIENT:
                self.ended[job] = now

    def counters(self, worker: bytes, now: float) -> tuple[int, float]:
        """The worker's running counters at ``now`` (images, compute seconds), as a real
        worker's heartbeat sends them: chunks count as they compute.  Chunks finished by
        ``now`` are folded into its totals."""
        images, seconds = self.computed.get(worker, (0.0, 0.0))
        running = []
        for began, end, count in self.computing.get(worker, []):
            if end <= now:
                images, seconds = images + count, seconds + (end - began)
            else:
                running.append((began, end, count))
        self.computed[worker], self.computing[worker] = (images, seconds), running
        for began, end, count in running:
            if now > began:
                images += count * (now - began) / (end - began)
                seconds += now - began
        return int(images), seconds

    def cancel(self, worker: bytes, chunk: int, at: float) -> None:
        """The worker drops attempt ``chunk`` when the CANCEL reaches it at ``at``: its
        answer never comes, and a device computing it as its last is free from then."""
        if chunk not in self.running:
            return
        self.cancelled.add(chunk)
        began, end = self.running.pop(chunk)
        if self.free_at.get(worker) == end and at < end:
            self.free_at[worker] = max(at, began)
            runs = self.computing.get(worker, [])
            for index, (b, e, count) in enumerate(runs):
                if (b, e) == (began, end):  # it computed until the CANCEL came
                    cut = max(at, began)
                    runs[index] = (b, cut, round(count * (cut - b) / (e - b)) if e > b else 0)

    def crash(self, worker: bytes, at: float) -> None:
        """The worker dies at ``at``; a new one starts on its device ``restart`` s later."""
        self.at(
            at, ev.WorkerLeft(worker=worker, at=at, reason="crashed on a poison item", crashed=True)
        )
        device = self.devices[worker].name
        if self.restart is not None and self.current[device] == worker:
            self.current[device] = b""  # one restart per death
            self.start_worker(device, at + self.restart)


def simulate(
    scenario: Scenario,
    algo: str,
    seed: int = 0,
    speeds: dict[str, float] | None = None,
    max_chunk_seconds: float = 0.0,
    backup_share: float = 0.0,
    heartbeat: float | None = None,
    **params: Any,
) -> SimResult:
    """Run one job of ``scenario`` under policy ``algo``; deterministic for a given seed.

    ``speeds``: each device's speed from earlier jobs; ``max_chunk_seconds``: the broker's
    chunk cap (0, the paper's setting, cuts chunks as the policy says); ``backup_share``:
    the broker's cap on backup attempts (0, the paper's setting: none); ``heartbeat``:
    seconds between heartbeats and ticks (None: none; backups then start only as
    workers ask for work).
    """
    config = SchedulingConfig(
        algo=algo, params=params, max_chunk_seconds=max_chunk_seconds, backup_share=backup_share
    )
    farm = FarmSimulation(scenario, config, seed, heartbeat=heartbeat)
    farm.remember(speeds or {})
    farm.submit("job", scenario.total)
    farm.run()
    if "job" in farm.errors:
        raise SimulationStalled(f"{algo}: {farm.errors['job']}")
    if "job" not in farm.ended:
        raise SimulationStalled(f"{algo}: the job never finished")
    return SimResult(
        scenario, algo, farm.ended["job"], farm.runs.get("job", []), farm.summaries.get("job")
    )
