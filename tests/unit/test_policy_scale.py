"""Policies at scale: the same decisions as before their bookkeeping became incremental.

``tests/unit/policy_decisions.json`` holds a hash of every assignment made in a set of seeded
runs, captured with the policies as they were before (``python tests/unit/test_policy_scale.py``
writes it again; every value drawn through exp, log or pow is ``steady``, so that the runs
are the same on every CPU): simulations of the paper's farms and of random farms of 2 to 16 devices
(noise, drift, latency, two slots, chunk caps, a lost worker, a second job), and random
event sequences fed to each policy directly (joins, rejoins, chunks done, failed and given
up, busy slots, losses, caps that move).  Every run must make the same assignments.

Property tests check what the policies keep as events come (members, idle and free workers,
speeds ranked, pieces due, equal-finish's running sums) against a scan of everything, and
the split against the drop-one-at-a-time split it replaced; a count of offers and
predictions per chunk with 3 000 workers checks that a chunk costs a few of each.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import random
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from itertools import count
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from farm.broker.jobs import JobOptions
from farm.broker.state import SchedulingConfig
from farm.policies import (
    PAPER_PARAMETERS,
    POLICIES,
    Assign,
    Chunk,
    ChunkDone,
    ChunkFailed,
    Policy,
    WorkerBusy,
    WorkerLost,
    WorkerReady,
    make_policy,
    proportional_split,
)
from farm.policies.base import SMALL_FARM
from farm.policies.equal_finish import EqualFinishPolicy
from farm.policies.rounds import RoundPolicy
from farm.policies.speeds import MeasuredPolicy
from farm.simulation.scenarios import many_devices, paper_scenario, spread_devices
from farm.simulation.simulator import DeviceModel, FarmSimulation, Scenario, steady

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
        models.append(
            DeviceModel(
                f"d{i}",
                steady(100 * 50 ** rng.random()),
                rng.choice([0, 2e-4, 5e-3]),
                noise,
                rng.uniform(1, 20) if drift else None,
                rng.uniform(0.2, 3) if drift else 1.0,
            )
        )
    return Scenario(
        f"random {seed}",
        tuple(models),
        rng.randint(500, 150_000),
        rng.choice([0.0, 0.001]),
        rng.choice([1, 2]),
    )


def simulated_decisions(
    scenario: Scenario,
    algo: str,
    params: dict[str, Any],
    seed: int,
    cap: float = 0.0,
    extras: bool = False,
) -> list[Decision]:
    """Every chunk each job ran: (job, worker, start, count), in the order they came back.

    ``extras``: a second job joins later and a device is lost mid-job (picked by ``seed``).
    """
    # the policies' decisions: without the broker's backup attempts, which are not theirs
    config = SchedulingConfig(algo=algo, params=params, max_chunk_seconds=cap, backup_share=0.0)
    farm = FarmSimulation(scenario, config, seed)
    rng = random.Random(seed)
    if algo == "equal-finish" and rng.random() < 0.5:
        farm.remember({d.name: d.rate * rng.uniform(0.5, 2) for d in scenario.devices})
    farm.submit("a", scenario.total)
    if extras:
        seconds = scenario.total / scenario.standalone_rate
        farm.submit(
            "b",
            scenario.total // 3 + 1,
            at=seconds * rng.uniform(0.1, 0.5),
            options=JobOptions(algo=algo, params=tuple(params.items())),
        )
        if len(scenario.devices) > 1:
            farm.lose(rng.choice(scenario.devices).name, seconds * rng.uniform(0.1, 0.8))
    farm.run()
    return [
        (job, run.worker, run.chunk.start, run.chunk.count)
        for job, runs in sorted(farm.runs.items())
        for run in runs
    ] + sorted(farm.errors.items())


def simulation_cases() -> dict[str, tuple[Scenario, str, dict[str, Any], int, float, bool]]:
    """Name -> simulated_decisions arguments."""
    cases = {}
    for farm_name, scenario in paper_farms().items():
        for algo in POLICIES:
            values = [{}] + [
                {PAPER_PARAMETERS[algo][0]: v}
                for v in PAPER_PARAMETERS.get(algo, ("", ()))[1]
                if algo != "static"
            ]
            for params in values:
                cases[f"{farm_name} {algo} {params}"] = (scenario, algo, params, 0, 0.0, False)
    for seed in range(24):
        scenario = random_farm(seed)
        for algo in POLICIES:
            cases[f"random {seed} {algo}"] = (
                scenario,
                algo,
                {},
                seed,
                (0.0, 0.5, 1.0)[seed % 3],
                seed % 2 == 1,
            )
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
    check: Callable[[EventDriver], None] | None = None  # after every event

    def feed(self, event: Any) -> None:
        assignments = self.policy.handle(event)
        self.log.append(
            (
                type(event).__name__,
                event.worker,
                *[(a.worker, a.chunk.start, a.chunk.count) for a in assignments],
            )
        )
        for assignment in assignments:
            self.held[assignment.worker].append(assignment.chunk)
        if self.check:
            self.check(self)

    def join(self, worker: str) -> None:
        self.alive.add(worker)
        self.held[worker] = []
        for _ in range(self.slots):
            self.feed(WorkerReady(worker, at=self.clock))

    def step(self) -> None:
        """One random event (and the WorkerReady a driver sends after a chunk)."""
        rng, names = self.rng, sorted(self.alive)
        action = rng.randrange(40)
        self.clock += rng.choice([0.0, 0.0, steady(rng.expovariate(2.0))])
        if rng.random() < 0.02:
            self.policy.max_chunk = rng.choice([None, rng.randint(1, 4000)])
        if action == 0 and len(names) > 1:
            lost = rng.choice(names)
            self.alive.discard(lost)
            self.held[lost] = []
            self.feed(WorkerLost(lost, at=self.clock))
        elif action == 1:
            newcomer = rng.choice([f"w{len(self.speed)}", *sorted(set(self.held) - self.alive)])
            self.speed.setdefault(newcomer, steady(100 * 50 ** rng.random()))
            self.join(newcomer)
        elif action == 2:
            taken = rng.choice(names)
            self.feed(WorkerBusy(taken, at=self.clock))
            self.feed(WorkerReady(taken, at=self.clock))
        else:
            self.finish_one(action, [w for w in names if self.held[w]])

    def finish_one(self, action: int, busy: list[str]) -> None:
        if not busy:  # stalled (a barrier waits for a member that is gone): one comes back
            away = sorted(set(self.policy.roster) | (set(self.held) - self.alive))
            self.join(self.rng.choice(away)) if away else self.feed(
                WorkerReady(self.rng.choice(sorted(self.alive)), at=self.clock)
            )
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


def event_decisions(
    algo: str,
    seed: int,
    workers: tuple[int, int] = (1, 16),
    events: int = 3000,
    check: Callable[[EventDriver], None] | None = None,
) -> list[Decision]:
    """A random event sequence of up to ``events`` events fed to a fresh policy."""
    rng = random.Random(seed)
    count = rng.randint(*workers)
    speed = {f"w{i}": steady(100 * 50 ** rng.random()) for i in range(count)}
    roster = list(speed)[: rng.randint(0, count)]
    remembered = {w: v * rng.uniform(0.5, 2) for w, v in speed.items() if rng.random() < 0.5}
    floor = rng.choice([1, 50, 100])
    params: dict[str, Any] = {} if algo == "fifo" else {"floor": floor}
    if algo in PAPER_PARAMETERS and algo != "static":
        name, values = PAPER_PARAMETERS[algo]
        params[name] = rng.choice(values)
    policy = make_policy(algo, int(steady(10 ** rng.uniform(1, 5.5))), roster, remembered, **params)
    driver = EventDriver(policy, rng, speed, rng.choice([1, 2]), check=check)
    for worker in speed:
        if worker in roster or rng.random() < 0.5:
            driver.join(worker)
    while not policy.finished and len(driver.log) < events and driver.alive:
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
            cases[f"events {algo} {seed}"] = lambda algo=algo, seed=seed: event_decisions(
                algo, seed
            )
        for seed in range(5):
            cases[f"large events {algo} {seed}"] = lambda algo=algo, seed=seed: event_decisions(
                algo, seed, (32, 128)
            )
            cases[f"large sim {algo} {seed}"] = lambda algo=algo, seed=seed: simulated_decisions(
                random_farm(seed, (32, 100)), algo, {}, seed, 0.5 * (seed % 3), seed % 2 == 1
            )
    return cases


def capture() -> dict[str, str]:
    return {name: digest(run()) for name, run in all_cases().items()}


CAPTURED: dict[str, str] = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
KINDS = ("sim", "events", "large sim", "large events")


@pytest.mark.parametrize("algo", list(POLICIES))
@pytest.mark.parametrize("kind", KINDS)
def test_decisions_are_the_ones_captured_before(kind: str, algo: str) -> None:
    runs = {
        name: run
        for name, run in all_cases().items()
        if name.startswith(f"{kind} ") and f" {algo} " in f"{name} "
    }
    assert runs
    moved = [name for name, run in runs.items() if digest(run()) != CAPTURED[name]]
    assert not moved, f"{len(moved)} of {len(runs)} runs decided differently: {moved[:5]}"


def test_noisy_runs_do_not_depend_on_the_last_bit_of_exp(monkeypatch) -> None:
    """libm's exp may differ in its last bit from one CPU to the next (FMA, AVX-512): moved
    by one bit, the seeded noise must decide every noisy simulation alike (unrounded, 7 of
    100 runs moved)."""
    import types

    import farm.simulation.simulator as simulator

    bumped = types.SimpleNamespace(
        **{name: getattr(math, name) for name in dir(math) if not name.startswith("_")}
    )
    bumped.exp = lambda x: math.nextafter(math.exp(x), math.inf)
    monkeypatch.setattr(simulator, "math", bumped)
    noisy = {name: args for name, args in simulation_cases().items() if "noise" in name}
    assert len(noisy) >= 50
    moved = [
        name
        for name, args in noisy.items()
        if digest(simulated_decisions(*args)) != CAPTURED[f"sim {name}"]
    ]
    assert not moved, moved


# ------------------------------------------------------------------ bookkeeping


def assert_bookkeeping(driver: EventDriver) -> None:
    """What the policy keeps as events come equals what a scan of everything finds."""
    policy = driver.policy
    members = [
        w
        for w in dict.fromkeys([*policy.roster, *policy.in_flight])
        if w in driver.alive or w not in driver.held
    ]
    assert policy.members == members
    assert list(policy.idle.values()) == sorted(policy.idle.values())
    assert policy.free == {w for w in policy.idle if not policy.in_flight[w]}
    if isinstance(policy, RoundPolicy):
        assert policy.free & set(policy.plan) <= policy.due
    if isinstance(policy, MeasuredPolicy):
        assert_ranking(policy, members)
    if isinstance(policy, EqualFinishPolicy) and len(members) > SMALL_FARM:
        rates = [(policy.rate(m), policy.available_at(m)) for m in members]
        exact = sum(r for r, _ in rates), sum(r * free for r, free in rates)
        assert policy.totals() == pytest.approx(exact, rel=1e-9)


def assert_ranking(policy: MeasuredPolicy, members: list[str]) -> None:
    book, ranking = policy.speeds.speeds, policy.ranking
    known = [book[w] for w in members if w in book]
    assert ranking.known == len(known)
    assert ranking.fastest() == max(known, default=None)
    assert policy.speeds.fastest() == max(book.values(), default=None)
    assert ranking.mean() == pytest.approx(sum(known) / len(known) if known else 1.0)
    mean = ranking.mean()
    weight = {w: book.get(w, mean) for w in members}
    heaviest = sorted(members, key=lambda w: (-weight[w], policy.place[w]))
    for n in (1, 3, len(members)):
        assert [m.worker for m in ranking.heaviest(n)] == heaviest[:n]


@settings(max_examples=40, deadline=None)
@given(
    algo=st.sampled_from(list(POLICIES)),
    seed=st.integers(0, 2**32),
    workers=st.sampled_from([(1, 8), (12, 40)]),
)
def test_what_is_kept_as_events_come_is_what_a_scan_finds(algo, seed, workers) -> None:
    """Random joins, rejoins, chunks done and failed, busy slots and losses: members, idle
    workers, speeds ranked, due pieces and equal-finish's running sums stay right."""
    event_decisions(algo, seed, workers, 400, assert_bookkeeping)


def split_one_at_a_time(total: int, weights: dict[str, float], floor: int) -> dict[str, int]:
    """proportional_split as it was first written: drop the lightest share until all reach
    the floor (quadratic; the reference)."""
    if total <= 0 or not weights:
        return {}
    members = [w for w in weights if weights[w] > 0] or list(weights)
    weight = {w: weights[w] if weights[w] > 0 else 1.0 for w in members}
    while True:
        scale = total / sum(weight[w] for w in members)
        exact = {w: weight[w] * scale for w in members}
        if len(members) == 1 or min(exact.values()) >= floor:
            break
        members.remove(min(members, key=lambda w: (exact[w], -members.index(w))))
    shares = {w: math.floor(exact[w]) for w in members}
    leftover = total - sum(shares.values())
    for w in sorted(members, key=lambda w: -(exact[w] - shares[w]))[:leftover]:
        shares[w] += 1
    return {w: shares[w] for w in weights if shares.get(w)}


@settings(max_examples=400, deadline=None)
@given(
    total=st.integers(0, 20_000),
    floor=st.integers(1, 500),
    weights=st.lists(
        st.sampled_from([0.0, 1.0, 2.0, 1000.0, 1234.5]) | st.floats(0.01, 1e5), max_size=60
    ),
)
def test_split_is_the_one_of_dropping_the_lightest_one_at_a_time(total, floor, weights) -> None:
    named = {f"w{i}": weight for i, weight in enumerate(weights)}
    assert proportional_split(total, named, floor) == split_one_at_a_time(total, named, floor)


# ----------------------------------------------------------------------- scale


@dataclass
class SteadyFarm:
    """Workers with two slots each run chunks at ``rates``, answered in order of their end."""

    policy: Policy
    rates: dict[str, float]
    running: list[tuple[float, int, Assign]] = field(default_factory=list)
    order: Iterator[int] = field(default_factory=count)

    def __post_init__(self) -> None:
        for worker in self.rates:
            for _ in range(2):
                self.start(self.policy.handle(WorkerReady(worker)), 0.0)

    def start(self, assignments: list[Assign], now: float) -> None:
        for a in assignments:
            end = now + a.chunk.count / self.rates[a.worker]
            heapq.heappush(self.running, (end, next(self.order), a))

    def run(self, chunks: int) -> None:
        for _ in range(chunks):
            if not self.running:
                return
            now, _, a = heapq.heappop(self.running)
            seconds = a.chunk.count / self.rates[a.worker]
            self.start(self.policy.handle(ChunkDone(a.worker, a.chunk, seconds, now)), now)
            self.start(self.policy.handle(WorkerReady(a.worker, now)), now)


def counted(calls: Counter[str], method: Callable[..., Any]) -> Callable[..., Any]:
    def count(self: Policy, *args: Any) -> Any:
        calls[method.__name__] += 1
        return method(self, *args)

    return count


@pytest.mark.parametrize("algo", list(POLICIES))
def test_a_chunk_costs_a_few_offers_with_thousands_of_workers(algo, monkeypatch) -> None:
    """Barrier waiters and busy workers are not asked again at every event: offers and
    equal-finish's predictions stay a handful per chunk with 3 000 workers."""
    rng = random.Random(0)
    rates = {f"w{i}": rng.uniform(500, 2000) for i in range(3000)}
    policy = make_policy(algo, 10**9, rates)
    policy.max_chunk = 2000
    farm = SteadyFarm(policy, rates)
    farm.run(6000)  # the first rounds, which look at every worker
    calls: Counter[str] = Counter()
    for cls, method in ((Policy, "_offer"), (EqualFinishPolicy, "rate")):
        monkeypatch.setattr(cls, method, counted(calls, getattr(cls, method)))
    farm.run(3000)
    assert calls["_offer"] <= 1.5 * 3000  # fast-split made 9 000 per chunk, every busy worker
    assert calls["rate"] <= 8 * 3000  # equal-finish made 6 000 per chunk, every member


if __name__ == "__main__":
    if sys.argv[1:] == ["--dump"]:  # every decision, to compare by eye what moved
        print(json.dumps({name: run() for name, run in all_cases().items()}))
    else:
        FIXTURE.write_text(json.dumps(capture(), indent=0, sort_keys=True) + "\n")
