"""``farm bench``: measure, then write the results folder (see ``farm.benchsuite``)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from farm import defaults
from farm.benchsuite import measure, peers, results
from farm.benchsuite.measure import PolicyRun
from farm.benchsuite.results import ModelResults
from farm.benchsuite.setups import (
    SETUP_NAMES,
    FarmSetup,
    WorkerSpec,
    describe_machine,
    farm_setups,
    machine_slug,
    make_images,
)
from farm.client.client import FarmError
from farm.ops.local import cores


@dataclass(frozen=True, kw_only=True)
class SuiteConfig:
    out: Path  # the results folder goes inside: OUT/<date>-<cores>-<cpu|gpu>
    models: tuple[str, ...] = defaults.BENCH_MODELS
    images: int = defaults.BENCH_IMAGES
    repeat: int = 1  # rounds of the policy sweep (each figure is the median)
    setups: tuple[str, ...] = SETUP_NAMES
    peers: tuple[str, ...] = peers.PEERS
    quick: bool = False  # one parameter value per policy, three Table 2 sizes
    standalone_images: int = 30_000  # the head-to-head rounds' standalone measurements
    table2_images: int = 10_000
    tune_images: int = 10_000
    peer_rounds: int = defaults.BENCH_PEER_ROUNDS  # farm's best and every peer, in turn
    policies_only: bool = False  # the policy sweep alone: no Table 2, no peers


def kinds(setups: list[FarmSetup]) -> dict[str, WorkerSpec]:
    """One worker of each device kind among the setups (the first met)."""
    found: dict[str, WorkerSpec] = {}
    for setup in setups:
        for worker in setup.workers:
            found.setdefault(worker.kind, worker)
    return found


def standalone_round(
    setup: FarmSetup, model: str, images: np.ndarray, into: dict[str, list[float]]
) -> None:
    """Each worker of ``setup`` alone, in a fresh one-worker farm (the head-to-head's)."""
    for worker in setup.workers:
        into.setdefault(worker.label, []).append(measure.standalone_rate(worker, model, images))


def run_model(
    config: SuiteConfig, model: str, setups: list[FarmSetup], say: Callable[[str], None]
) -> ModelResults:
    """Everything on one model: batches, Table 2, the sweeps with standalone speeds, peers
    (only batches and the sweeps when ``config.policies_only``)."""
    found = ModelResults(model, config.images)
    images = make_images(model, config.images)
    best = tune_batches(config, found, setups, say)
    if not config.policies_only:
        measure_table2(config, found, setups, best, images, say)
    reference = None
    for setup in (s.with_batches(best) for s in setups):
        reference = sweep_setup(config, found, setup, images, say)
    if config.policies_only:
        return found
    available = []
    for peer in config.peers:
        why = peers.missing(peer)
        if why:
            found.skipped_peers.append(f"{peer}: {why}")
        else:
            available.append(peer)
    cores_farm = next((s for s in setups if s.name == "cores"), None)
    if cores_farm is not None and reference is not None:  # the sweep ran on the cores farm
        head_to_head(
            config, found, cores_farm.with_batches(best), available, images, reference, say
        )
    elif config.peers:
        found.skipped_peers.append("every peer: peers run beside the cores farm, not built")
    return found


def tune_batches(
    config: SuiteConfig, found: ModelResults, setups: list[FarmSetup], say: Callable[[str], None]
) -> dict[str, int]:
    """Each device kind's fastest compute batch (its trials go into ``found.batches``)."""
    best: dict[str, int] = {}
    for kind, worker in kinds(setups).items():
        found.batches[kind] = measure.best_batch(worker, found.model, config.tune_images)
        best[kind] = max(found.batches[kind], key=lambda trial: trial[1])[0]
        say(f"{found.model}: {kind} computes fastest at batch {best[kind]}")
    return best


def measure_table2(
    config: SuiteConfig,
    found: ModelResults,
    setups: list[FarmSetup],
    best: dict[str, int],
    images: np.ndarray,
    say: Callable[[str], None],
) -> None:
    """The paper's Table 2, one worker of each device kind at its best batch."""
    sizes = measure.TABLE2_SIZES[1:4] if config.quick else measure.TABLE2_SIZES
    for kind, worker in kinds(setups).items():
        found.table2[kind] = measure.table2(
            worker.with_batch(best[kind]), found.model, images[: config.table2_images], sizes
        )
        say(
            f"{found.model}: Table 2, {kind}: "
            + ", ".join(f"{n}: {v:,.0f}/s" for n, v in found.table2[kind])
        )


def sweep_setup(
    config: SuiteConfig,
    found: ModelResults,
    setup: FarmSetup,
    images: np.ndarray,
    say: Callable[[str], None],
) -> np.ndarray:
    """``config.repeat`` rounds of every policy at the paper's values on ``setup``, each
    job bracketed by standalone measurements; the first job's outputs."""
    sweep = measure.Sweep(
        setup,
        found.model,
        images,
        images[: measure.bracket_images(config.images, len(setup.workers))],
        found.standalone.setdefault(setup.name, {}),
    )
    configs = measure.paper_configurations(config.quick)
    reference: np.ndarray | None = None
    for round_ in range(config.repeat):
        runs, outputs = measure.policy_sweep(
            sweep, configs, round_, lambda run: say(_run_line(run))
        )
        found.runs += runs
        reference = outputs if reference is None else reference
    drifts = found.drifts(setup.name)
    say(
        f"{found.model}, {setup.name}: theoretical {found.theoretical(setup.name):,.0f}/s; "
        f"standalone drift across the brackets: median {statistics.median(drifts):.1%}, "
        f"max {max(drifts):.1%}"
    )
    assert reference is not None  # repeat >= 1
    return reference


def head_to_head(
    config: SuiteConfig,
    found: ModelResults,
    setup: FarmSetup,
    available: list[str],
    images: np.ndarray,
    reference: np.ndarray,
    say: Callable[[str], None],
) -> None:
    """Farm's best configuration and every peer, in turn, ``peer_rounds`` times: the
    machine's drift touches all of them alike (each figure is then a median).  Each round
    first measures the farm's workers alone again, so the farm's figure here has a waste
    of its own, free of the sweep's pick of its luckiest run.  Peers are tuned in the
    first round and keep that setting."""
    best = found.farm_best()
    if best is None:
        raise FarmError(f"{found.model}: no policy ran on the cores farm, no best to compare")
    settings: dict[str, int] = {}
    for round_ in range(config.peer_rounds):
        standalone_round(
            setup,
            found.model,
            images[: config.standalone_images],
            found.standalone.setdefault(results.HEAD_TO_HEAD, {}),
        )
        found.farm_rounds.append(measure.farm_rate(setup, found.model, images, best.config))
        say(f"{found.model}: farm ({best.config.label}): {found.farm_rounds[-1]:,.0f}/s")
        for peer in available:
            result = peers.run_peer(
                peer,
                found.model,
                config.images,
                config.tune_images,
                len(cores()),
                settings.get(peer),
                round_,
            )
            settings[peer] = result.best
            found.peers.append(result)
            difference = float(np.max(np.abs(result.outputs - reference)))
            found.peer_differences[peer] = max(difference, found.peer_differences.get(peer, 0.0))
            say(f"{found.model}: {peer} ({result.setting}): {result.rate:,.0f}/s")


def _run_line(run: PolicyRun) -> str:
    return (
        f"{run.model}, {run.setup}, round {run.round_ + 1}: {run.config.label}: "
        f"{run.rate:,.0f}/s, waste {run.idle:.1%}"
    )


def run_suite(config: SuiteConfig, command: str, say: Callable[[str], None]) -> Path:
    """Measure everything and write the results folder; its path."""
    started = time.perf_counter()
    machine = describe_machine()
    folder = config.out / machine_slug(machine)
    folder.mkdir(parents=True, exist_ok=True)
    setups, skipped = farm_setups(config.setups)
    if not setups:
        raise ValueError("no farm setup can run here: " + "; ".join(skipped))
    for why in skipped:
        say(f"not run: {why}")
    found = [run_model(config, model, setups, say) for model in config.models]
    machine["load_average_end"] = [round(value, 2) for value in os.getloadavg()]
    results.write_folder(
        folder,
        results.SuiteRun(machine, setups, skipped, found, command, time.perf_counter() - started),
    )
    return folder
