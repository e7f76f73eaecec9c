"""Policies at scale: the same decisions as before their bookkeeping became incremental.

``tests/policy_decisions.json`` holds a hash of every assignment made in a set of seeded
runs, captured with the policies as they were before (``python tests/test_policy_scale.py``
writes it again): simulations of the paper's farms and of random farms of 2 to 16 devices
(noise, drift, latency, two slots, chunk caps, a lost worker, a second job), and random
event sequences fed to each policy directly (joins, rejoins, chunks done, failed and given
up, busy slots, losses, caps that move).  Every run must make the same assignments.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from farm.broker.jobs import JobOptions
from farm.broker.state import SchedulingConfig
from farm.policies import (PAPER_PARAMETERS, POLICIES, Assign, Chunk, ChunkDone, ChunkFailed,
                           Policy, WorkerBusy, WorkerLost, WorkerReady, make_policy)
from farm.scenarios import many_devices, paper_scenario, spread_devices
from farm.simulator import DeviceModel, FarmSimulation, Scenario

FIXTURE = Path(__file__).with_name("policy_decisions.json")

Decision = tuple[Any, ...]


# ------------------------------------------------------------------ simulations

def paper_farms() -> dict[str, Scenario]:
    """The paper's calibrated farms, as bench/policies.py compares them."""
    farms = {}
    for dataset in ("mnist", "cifar10"):
        farms[f"{dataset}"] = paper_scenario(dataset)
        farms[f"{dataset} noise"] = paper_scenario(dataset, noise=0.05)
        farms[f"{dataset} drift noise"] = paper_scenario(dataset, noise=0.05, gpu_drift=0.5)
        farms[f"{dataset} latency slots"] = paper_scenario(dataset, latency=0.001, slots=2)
        farms[f"{dataset} 10k"] = paper_scenario(dataset, total=10_000)
    farms["mix 16"] = many_devices(16, per_device=5_000)
    farms["spread 8"] = spread_devices(8, total=50_000)
    return farms


def random_farm(seed: int, devices: tuple[int, int] = (2, 16)) -> Scenario:
    """2 to 16 devices, speeds 100..5 000/s, some noisy, some drifting, maybe two slots."""
    rng = random.Random(seed)
    count = rng.randint(*devices)
    noise = rng.choice([0.0, 0.02, 0.1])
    models = []
    for i in range(count):
        drift = rng.random() < 0.3
        models.append(DeviceModel(f"d{i}", 100 * 50 ** rng.random(), rng.choice([0, 2e-4, 5e-3]),
                                  noise, rng.uniform(1, 20) if drift else None,
                                  rng.uniform(0.2, 3) if drift else 1.0))
    return Scenario(f"random {seed}", tuple(models), rng.randint(500, 150_000),
                    rng.choice([0.0, 0.001]), rng.choice([1, 2]))


def simulated_decisions(scenario: Scenario, algo: str, params: dict[str, Any], seed: int,
                        cap: float = 0.0, extras: bool = False) -> list[Decision]:
    """Every chunk each job ran: (job, worker, start, count), in the order they came back.

    ``extras``: a second job joins later and a device is lost mid-job (picked by ``seed``).
    """
    config = SchedulingConfig(algo=algo, params=params, max_chunk_seconds=cap)
    farm = FarmSimulation(scenario, config, seed)
    rng = random.Random(seed)
    if algo == "equal-finish" and rng.random() < 0.5:
        farm.remember({d.name: d.rate * rng.uniform(0.5, 2) for d in scenario.devices})
    farm.submit("a", scenario.total)
    if extras:
        seconds = scenario.total / scenario.standalone_rate
        farm.submit("b", scenario.total // 3 + 1, at=seconds * rng.uniform(0.1, 0.5),
                    options=JobOptions(algo=algo, params=tuple(params.items())))
        if len(scenario.devices) > 1:
            farm.lose(rng.choice(scenario.devices).name, seconds * rng.uniform(0.1, 0.8))
    farm.run()
    return [(job, run.worker, run.chunk.start, run.chunk.count)
            for job, runs in sorted(farm.runs.items()) for run in runs] + sorted(
        farm.errors.items())


def simulation_cases() -> dict[str, tuple[Scenario, str, dict[str, Any], int, float, bool]]:
    """Name -> simulated_decisions arguments."""
    cases = {}
    for farm_name, scenario in paper_farms().items():
        for algo in POLICIES:
            values = [{}] + [{PAPER_PARAMETERS[algo][0]: v} for v in PAPER_PARAMETERS.get(
                algo, ("", ()))[1] if algo != "static"]
            for params in values:
                cases[f"{farm_name} {algo} {params}"] = (scenario, algo, params, 0, 0.0, False)
    for seed in range(24):
        scenario = random_farm(seed)
        for algo in POLICIES:
            cases[f"random {seed} {algo}"] = (scenario, algo, {}, seed, (0.0, 0.5, 1.0)[seed % 3],
                                              seed % 2 == 1)
    return cases


# --------------------------------------------------------------- event sequences

@dataclass
class EventDriver:
    """Random events fed straight to one policy, as a broker that misbehaves at random might."""

    policy: Policy
    rng: random.Random
    speed: dict[str, float]
    slots: int
    clock: float = 0.0
    held: dict[str, list[Chunk]] = field(default_factory=dict)
    alive: set[str] = field(default_factory=set)
    log: list[Decision] = field(default_factory=list)

    def feed(self, event: Any) -> None:
        assignments = self.policy.handle(event)
        self.log.append((type(event).__name__, event.worker,
                         *[(a.worker, a.chunk.start, a.chunk.count) for a in assignments]))
        for assignment in assignments:
            self.held[assignment.worker].append(assignment.chunk)

    def join(self, worker: str) -> None:
        self.alive.add(worker)
        self.held[worker] = []
        for _ in range(self.slots):
            self.feed(WorkerReady(worker, at=self.clock))

    def step(self) -> None:
        """One random event (and the WorkerReady a driver sends after a chunk)."""
        rng, names = self.rng, sorted(self.alive)
        action = rng.randrange(40)
        self.clock += rng.choice([0.0, 0.0, rng.expovariate(2.0)])
        if rng.random() < 0.02:
            self.policy.max_chunk = rng.choice([None, rng.randint(1, 4000)])
        if action == 0 and len(names) > 1:
            lost = rng.choice(names)
            self.alive.discard(lost)
            self.held[lost] = []
            self.feed(WorkerLost(lost, at=self.clock))
        elif action == 1:
            newcomer = rng.choice([f"w{len(self.speed)}", *sorted(set(self.held) - self.alive)])
            self.speed.setdefault(newcomer, 100 * 50 ** rng.random())
            self.join(newcomer)
        elif action == 2:
            taken = rng.choice(names)
            self.feed(WorkerBusy(taken, at=self.clock))
            self.feed(WorkerReady(taken, at=self.clock))
        else:
            self.finish_one(action, [w for w in names if self.held[w]])

    def finish_one(self, action: int, busy: list[str]) -> None:
        if not busy:  # stalled (a barrier waits for a member that is gone): one comes back
            away = sorted(set(self.policy.roster) | set(self.held) - self.alive)
            self.join(self.rng.choice(away)) if away else self.feed(
                WorkerReady(self.rng.choice(sorted(self.alive)), at=self.clock))
            return
        worker = self.rng.choice(busy)
        chunk = self.held[worker].pop(0)
        if action in (3, 4):
            self.feed(ChunkFailed(worker, chunk, retry=action == 3, at=self.clock))
        else:
            seconds = chunk.count / self.speed[worker] * self.rng.uniform(0.7, 1.5)
            self.clock += seconds * self.rng.random()
            self.feed(ChunkDone(worker, chunk, seconds, at=self.clock))
        self.feed(WorkerReady(worker, at=self.clock))


def event_decisions(algo: str, seed: int, workers: tuple[int, int] = (1, 16)) -> list[Decision]:
    """A random event sequence of up to 3 000 events fed to a fresh policy."""
    rng = random.Random(seed)
    count = rng.randint(*workers)
    speed = {f"w{i}": 100 * 50 ** rng.random() for i in range(count)}
    roster = list(speed)[:rng.randint(0, count)]
    remembered = {w: v * rng.uniform(0.5, 2) for w, v in speed.items() if rng.random() < 0.5}
    floor = rng.choice([1, 50, 100])
    params: dict[str, Any] = {} if algo == "fifo" else {"floor": floor}
    if algo in PAPER_PARAMETERS and algo != "static":
        name, values = PAPER_PARAMETERS[algo]
        params[name] = rng.choice(values)
    policy = make_policy(algo, int(10 ** rng.uniform(1, 5.5)), roster, remembered, **params)
    driver = EventDriver(policy, rng, speed, rng.choice([1, 2]))
    for worker in speed:
        if worker in roster or rng.random() < 0.5:
            driver.join(worker)
    while not policy.finished and len(driver.log) < 3000 and driver.alive:
        driver.step()
    return driver.log


# --------------------------------------------------------------------- capture

def digest(decisions: list[Decision]) -> str:
    return hashlib.sha256(json.dumps(decisions).encode()).hexdigest()[:16]


@cache
def all_cases() -> dict[str, Any]:
    """Name -> a function of no arguments that returns the run's decisions."""
    cases: dict[str, Any] = {}
    for name, args in simulation_cases().items():
        cases[f"sim {name}"] = lambda args=args: simulated_decisions(*args)
    for algo in POLICIES:
        for seed in range(150):
            cases[f"events {algo} {seed}"] = lambda algo=algo, seed=seed: event_decisions(algo, seed)
        for seed in range(5):
            cases[f"large events {algo} {seed}"] = (
                lambda algo=algo, seed=seed: event_decisions(algo, seed, (32, 128)))
            cases[f"large sim {algo} {seed}"] = lambda algo=algo, seed=seed: simulated_decisions(
                random_farm(seed, (32, 100)), algo, {}, seed, 0.5 * (seed % 3), seed % 2 == 1)
    return cases


def capture() -> dict[str, str]:
    return {name: digest(run()) for name, run in all_cases().items()}


CAPTURED: dict[str, str] = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
KINDS = ("sim", "events", "large sim", "large events")


@pytest.mark.parametrize("algo", list(POLICIES))
@pytest.mark.parametrize("kind", KINDS)
def test_decisions_are_the_ones_captured_before(kind: str, algo: str) -> None:
    runs = {name: run for name, run in all_cases().items()
            if name.startswith(f"{kind} ") and f" {algo} " in f"{name} "}
    assert runs
    moved = [name for name, run in runs.items() if digest(run()) != CAPTURED[name]]
    assert not moved, f"{len(moved)} of {len(runs)} runs decided differently: {moved[:5]}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--dump"]:  # every decision, to compare by eye what moved
        print(json.dumps({name: run() for name, run in all_cases().items()}))
    else:
        FIXTURE.write_text(json.dumps(capture(), indent=0, sort_keys=True) + "\n")
