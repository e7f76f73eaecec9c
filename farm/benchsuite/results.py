"""What a suite run found, and how it is written: CSV tables, PNG figures, a Markdown report.

Waste is measured from each policy job's own trace (``farm.client.trace.idle_share``):
each worker's idle time between the job's start and its end, summed, over workers x
span.  The machine's drift cannot move it, and it cannot go negative.  Each job is
bracketed by standalone measurements of the same workers (each alone in a warm one-worker
farm, just before and just after it); how far they moved is reported beside the figures.
The old figure, (theoretical - achieved) / theoretical against those standalone speeds,
stays as a secondary column: it moves with the machine and can go negative.
"""

from __future__ import annotations

import csv
import json
import statistics
import textwrap
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from farm.benchsuite.measure import Configuration, PolicyRun
from farm.benchsuite.peers import PeerResult
from farm.benchsuite.setups import SETUP_ABOUT, FarmSetup, WorkerSpec

#: The paper's figures quoted beside ours (docs/scheduling.md): fast-split's and HAT's waste.
PAPER_WASTE = {"fast-split": 0.094, "hat": 0.11}
WASTE_GOAL = 0.05
#: The standalone speeds measured in the head-to-head rounds, filed as if a setup.
HEAD_TO_HEAD = "head-to-head"


def median_run(runs: Sequence[Any]) -> Any:
    """The run of median rate (the upper one of an even count), as ``median_high``."""
    return sorted(runs, key=lambda run: run.rate)[len(runs) // 2]


@dataclass
class ModelResults:
    """Everything measured on one model."""

    model: str
    images: int
    batches: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # kind -> trials
    table2: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # kind -> rows
    standalone: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # setup/worker
    runs: list[PolicyRun] = field(default_factory=list)
    peers: list[PeerResult] = field(default_factory=list)  # every round of every peer
    farm_rounds: list[float] = field(default_factory=list)  # farm's best, between the peers
    skipped_peers: list[str] = field(default_factory=list)
    peer_differences: dict[str, float] = field(default_factory=dict)  # max |peer - farm|

    def theoretical(self, setup: str) -> float:
        """Sum over the setup's workers of their mean standalone speed."""
        return sum(statistics.mean(rates) for rates in self.standalone[setup].values())

    def bracket(self, run: PolicyRun) -> tuple[list[float], list[float]]:
        """The standalone speeds of ``run``'s workers just before it and just after it."""
        workers = self.standalone[run.setup].values()
        return [r[run.bracket] for r in workers], [r[run.bracket + 1] for r in workers]

    def drift(self, run: PolicyRun) -> float:
        """How far ``run``'s workers' standalone speeds moved across its bracket: the
        largest |after / before - 1| among them."""
        before, after = self.bracket(run)
        return max(abs(a / b - 1) for b, a in zip(before, after))

    def drifts(self, setup: str | None = None) -> list[float]:
        """|after / before - 1| of every worker around every policy job (of ``setup``)."""
        found = []
        for run in self.runs:
            if setup is None or run.setup == setup:
                before, after = self.bracket(run)
                found += [abs(a / b - 1) for b, a in zip(before, after)]
        return found

    @property
    def setups(self) -> list[str]:
        """The farm setups of the sweep (not the head-to-head rounds)."""
        return [name for name in self.standalone if name != HEAD_TO_HEAD]

    def head_to_head_waste(self) -> float | None:
        """Waste of farm's best in the head-to-head rounds, against the standalone speeds
        measured in those rounds."""
        if not self.farm_rounds or HEAD_TO_HEAD not in self.standalone:
            return None
        return 1 - self.farm_head_to_head() / self.theoretical(HEAD_TO_HEAD)

    def one_core(self) -> float:
        """The unit of Tables 4/5: the mean standalone speed of one core of the default farm."""
        rates = [statistics.mean(r) for label, r in self.standalone.get("cores", {}).items()]
        return statistics.mean(rates) if rates else 0.0

    def summaries(self) -> list[PolicySummary]:
        """One row per setup and configuration: the median of its rounds."""
        grouped: dict[tuple[str, str], list[PolicyRun]] = defaultdict(list)
        for run in self.runs:
            grouped[(run.setup, run.config.label)].append(run)
        return [PolicySummary.of(runs, self) for runs in grouped.values()]

    def peer_medians(self) -> list[PeerResult]:
        """Each peer's median round, in the order they ran."""
        rounds: dict[str, list[PeerResult]] = defaultdict(list)
        for result in self.peers:
            rounds[result.peer].append(result)
        return [median_run(runs) for runs in rounds.values()]

    def farm_head_to_head(self) -> float:
        """Farm's best configuration, median of its runs between the peers' (the sweep's
        figure when there were none)."""
        if self.farm_rounds:
            return statistics.median_high(self.farm_rounds)
        best = self.farm_best()
        return best.rate if best else 0.0

    def best_per_policy(self) -> dict[tuple[str, str], PolicySummary]:
        """(setup, policy) -> its parameter value of least waste (from the trace)."""
        best: dict[tuple[str, str], PolicySummary] = {}
        for s in self.summaries():
            key = (s.setup, s.config.algo)
            if key not in best or s.waste < best[key].waste:
                best[key] = s
        return best

    def farm_best(self, setup: str = "cores") -> PolicySummary | None:
        rows = [row for row in self.summaries() if row.setup == setup]
        return max(rows, key=lambda row: row.rate) if rows else None


@dataclass(frozen=True)
class PolicySummary:
    setup: str
    config: Configuration
    rate: float  # median images/s over rounds
    rounds: int
    theoretical: float  # standalone sum, mean of every measurement of the setup
    in_job_theoretical: float  # the median run's in-job speed sum
    waste: float  # median over rounds of the trace's idle share
    bracket_theoretical: float  # the median run's standalone sum, mean of its bracket
    drift: float  # the median run's largest standalone move across its bracket

    @classmethod
    def of(cls, runs: Sequence[PolicyRun], found: ModelResults) -> PolicySummary:
        median = median_run(runs)
        before, after = found.bracket(median)
        return cls(
            median.setup,
            median.config,
            median.rate,
            len(runs),
            found.theoretical(median.setup),
            median.in_job_theoretical,
            statistics.median(run.idle for run in runs),
            (sum(before) + sum(after)) / 2,
            found.drift(median),
        )

    @property
    def standalone_waste(self) -> float:
        """Secondary: 1 - rate / the standalone speeds measured around the median run.
        It moves with the machine's drift and can go negative."""
        return 1 - self.rate / self.bracket_theoretical

    @property
    def contention(self) -> float:
        """Share of the bracket's standalone sum lost by the workers running side by side."""
        return 1 - self.in_job_theoretical / self.bracket_theoretical

    @property
    def farm_waste(self) -> float:
        """Share of the in-job speed sum lost to scheduling and messaging."""
        return 1 - self.rate / self.in_job_theoretical


# ---- CSV --------------------------------------------------------------------------------


def write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)


def _r(value: float, digits: int = 1) -> float:
    return round(value, digits)


@dataclass
class SuiteRun:
    """A whole suite run: where, how it was asked for, what it found."""

    machine: dict[str, Any]
    setups: list[FarmSetup]
    skipped: list[str]
    results: list[ModelResults]
    command: str
    seconds: float


def write_tables(folder: Path, run: SuiteRun) -> None:
    """Every table the run measured, as CSV; the machine and the run as JSON."""
    results = run.results
    (folder / "machine.json").write_text(
        json.dumps(
            {
                **run.machine,
                "setups": {s.name: [w.label for w in s.workers] for s in run.setups},
                "run": {
                    "command": run.command,
                    "seconds": round(run.seconds),
                    "skipped": run.skipped,
                    "images": {r.model: r.images for r in results},
                    "skipped_peers": {r.model: r.skipped_peers for r in results},
                },
            },
            indent=2,
        )
        + "\n"
    )
    write_csv(
        folder / "batches.csv",
        ["model", "device", "batch", "images_per_s"],
        [
            (r.model, kind, b, _r(v))
            for r in results
            for kind, rows in r.batches.items()
            for b, v in rows
        ],
    )
    if any(r.table2 for r in results):
        write_table2(folder, results)
    write_policy_tables(folder, results)
    if any(r.peers or r.farm_rounds for r in results):
        write_peer_tables(folder, results)


def write_table2(folder: Path, results: Sequence[ModelResults]) -> None:
    write_csv(
        folder / "table2.csv",
        ["model", "device", "submitted", "images_per_s"],
        [
            (r.model, kind, n, _r(v))
            for r in results
            for kind, rows in r.table2.items()
            for n, v in rows
        ],
    )


#: policy_runs.csv's columns: one row per policy job.
POLICY_RUNS_COLUMNS = [
    "model",
    "setup",
    "policy",
    "parameter",
    "value",
    "round",
    "images_per_s",
    "seconds",
    "chunks",
    "in_job_theoretical_per_s",
    "waste_from_trace",
    "standalone_bracket",
]
#: policies.csv's columns: one row per configuration, medians over its rounds.
POLICIES_COLUMNS = [
    "model",
    "setup",
    "policy",
    "parameter",
    "value",
    "images_per_s",
    "theoretical_per_s",
    "waste",
    "bracket_theoretical_per_s",
    "standalone_waste_secondary",
    "bracket_drift",
    "contention",
    "farm_waste",
    "relative_to_one_core",
]


def write_policy_tables(folder: Path, results: Sequence[ModelResults]) -> None:
    """The standalone speeds, every policy job, and each configuration's median."""
    write_csv(
        folder / "standalone.csv",
        ["model", "setup", "worker", "measurement", "images_per_s"],
        [
            (r.model, setup, worker, i, _r(v))
            for r in results
            for setup, workers in r.standalone.items()
            for worker, rates in workers.items()
            for i, v in enumerate(rates)
        ],
    )
    write_csv(
        folder / "policy_runs.csv",
        POLICY_RUNS_COLUMNS,
        [policy_run_row(r.model, job) for r in results for job in r.runs],
    )
    write_csv(
        folder / "policies.csv",
        POLICIES_COLUMNS,
        [policy_row(r, summary) for r in results for summary in r.summaries()],
    )


def policy_run_row(model: str, job: PolicyRun) -> tuple[object, ...]:
    """One policy job, as ``POLICY_RUNS_COLUMNS``."""
    return (
        model,
        job.setup,
        job.config.algo,
        job.config.parameter,
        job.config.value,
        job.round_,
        _r(job.rate),
        round(job.seconds, 3),
        job.chunks,
        _r(job.in_job_theoretical),
        round(job.idle, 6),
        job.bracket,
    )


def policy_row(r: ModelResults, s: PolicySummary) -> tuple[object, ...]:
    """One configuration's medians, as ``POLICIES_COLUMNS``."""
    return (
        r.model,
        s.setup,
        s.config.algo,
        s.config.parameter,
        s.config.value,
        _r(s.rate),
        _r(s.theoretical),
        round(s.waste, 4),
        _r(s.bracket_theoretical),
        round(s.standalone_waste, 4),
        round(s.drift, 4),
        round(s.contention, 4),
        round(s.farm_waste, 4),
        round(s.rate / r.one_core() - 1, 4),
    )


def write_peer_tables(folder: Path, results: Sequence[ModelResults]) -> None:
    write_csv(
        folder / "peers.csv",
        [
            "model",
            "peer",
            "setting",
            "images_per_s",
            "ratio_to_farm_best",
            "max_abs_difference",
            "note",
            "rounds",
        ],
        peer_rows(results),
    )
    write_csv(
        folder / "peer_runs.csv",
        ["model", "who", "round", "setting", "best", "images_per_s", "note"],
        [
            (r.model, "farm", i, "", 0, _r(v), "")
            for r in results
            for i, v in enumerate(r.farm_rounds)
        ]
        + [
            (r.model, p.peer, p.round_, p.setting, p.best, _r(p.rate), p.note)
            for r in results
            for p in r.peers
        ],
    )
    write_csv(
        folder / "peer_tuning.csv",
        ["model", "peer", "setting", "images_per_s"],
        [
            (r.model, p.peer, s, _r(v))
            for r in results
            for p in r.peers
            if p.round_ == 0
            for s, v in p.tuning
        ],
    )


def peer_rows(results: Sequence[ModelResults]) -> list[tuple[Any, ...]]:
    """Farm's best, then each peer (medians of the rounds run in turn), with its ratio to
    farm's best on the same cores and every round's images/s."""
    rows: list[tuple[Any, ...]] = []
    for r in results:
        best = r.farm_best()
        if best is None:
            continue
        farm = r.farm_head_to_head()
        rows.append(
            (
                r.model,
                f"farm ({best.config.label})",
                "one worker per core",
                _r(farm),
                1.0,
                0.0,
                "",
                _rounds(r.farm_rounds),
            )
        )
        for peer in r.peer_medians():
            rows.append(
                (
                    r.model,
                    peer.peer,
                    peer.setting,
                    _r(peer.rate),
                    round(peer.rate / farm, 3),
                    r.peer_differences.get(peer.peer, float("nan")),
                    peer.note,
                    _rounds([p.rate for p in r.peers if p.peer == peer.peer]),
                )
            )
    return rows


def _rounds(rates: Sequence[float]) -> str:
    return " ".join(f"{rate:.0f}" for rate in rates)


def relative_table(r: ModelResults, setup: str) -> dict[str, float]:
    """Tables 4/5: each policy's speed relative to one CPU core, averaged over its
    parameter values."""
    unit = r.one_core()
    by_policy: dict[str, list[float]] = defaultdict(list)
    for s in r.summaries():
        if s.setup == setup:
            by_policy[s.config.algo].append(s.rate / unit - 1)
    return {algo: statistics.mean(values) for algo, values in by_policy.items()}


def waste_table(r: ModelResults, setup: str) -> dict[str, float]:
    """Tables 4/5's waste: each policy's waste from the trace, averaged over its parameter
    values."""
    by_policy: dict[str, list[float]] = defaultdict(list)
    for s in r.summaries():
        if s.setup == setup:
            by_policy[s.config.algo].append(s.waste)
    return {algo: statistics.mean(values) for algo, values in by_policy.items()}


def alone_table(r: ModelResults) -> dict[str, float]:
    """Each device kind alone relative to one CPU core (the paper's "1 GPU" column)."""
    rates: dict[str, list[float]] = defaultdict(list)
    for setup in r.setups:
        for label, measured in r.standalone[setup].items():
            rates[WorkerSpec.from_label(label).kind].append(statistics.mean(measured))
    return {kind: statistics.mean(values) / r.one_core() - 1 for kind, values in rates.items()}


# ---- figures ----------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_policies(path: Path, r: ModelResults, figure: str) -> None:
    """Figures 3/4: images/s of every policy at each parameter value, a bar per farm
    setup labelled with its waste (from the job's trace), the peers dotted.  No standalone
    "theoretical" line: it drifts with the machine, and a bar above it would read as a
    negative waste."""
    plt = _pyplot()
    summaries = r.summaries()
    setups = list(dict.fromkeys(s.setup for s in summaries))
    labels = list(dict.fromkeys(s.config.label for s in summaries))
    width = 0.8 / max(1, len(setups))
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.6), 5))
    for i, setup in enumerate(setups):
        ran = {s.config.label: s for s in summaries if s.setup == setup}
        bars = ax.bar(
            [x + i * width for x in range(len(labels))],
            [ran[label].rate if label in ran else 0 for label in labels],
            width,
            label=f"farm, {setup}",
        )
        ax.bar_label(
            bars,
            [f"{ran[label].waste:.0%}" if label in ran else "" for label in labels],
            fontsize=6,
        )
    for peer in r.peer_medians():
        ax.axhline(peer.rate, color="grey", ls=":", lw=1)
        ax.annotate(
            peer.peer,
            (len(labels) - 0.5, peer.rate),
            fontsize=7,
            color="grey",
            ha="right",
            va="bottom",
        )
    ax.set_xticks(
        [x + width * (len(setups) - 1) / 2 for x in range(len(labels))],
        labels,
        rotation=60,
        ha="right",
        fontsize=8,
    )
    ax.set_ylabel("images/s")
    ax.set_title(f"{figure}: {r.model}, {r.images:,} images, every policy")
    ax.legend(fontsize=8, loc="lower left")
    _save(plt, fig, path)


def plot_waste(path: Path, results: Sequence[ModelResults]) -> None:
    """Figure 5: waste from each job's trace, per policy (its value of least waste), per
    model and setup; the standalone drift across the jobs' brackets written under it."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.8), squeeze=False)
    for ax, r in zip(axes[0], results):
        best = {key: s.waste for key, s in r.best_per_policy().items()}
        setups = list(dict.fromkeys(k[0] for k in best))
        algos = list(dict.fromkeys(k[1] for k in best))
        width = 0.8 / max(1, len(setups))
        for i, setup in enumerate(setups):
            ax.bar(
                [x + i * width for x in range(len(algos))],
                [100 * best.get((setup, a), 0) for a in algos],
                width,
                label=setup,
            )
        ax.axhline(100 * WASTE_GOAL, color="green", ls="--", lw=1, label="goal 5%")
        ax.axhline(
            100 * PAPER_WASTE["fast-split"],
            color="red",
            ls=":",
            lw=1,
            label="paper's fast-split 9.4%",
        )
        ax.set_xticks(
            [x + width * (len(setups) - 1) / 2 for x in range(len(algos))],
            algos,
            rotation=30,
            ha="right",
        )
        ax.set_ylim(bottom=0)
        ax.set_ylabel("waste, % (idle worker time, from the trace)")
        ax.set_title(f"Figure 5: {r.model}")
        ax.legend(fontsize=8)
    note = textwrap.fill(drift_text(results), width=95 * len(results))
    fig.text(0.01, 0.01, note, fontsize=8, color="dimgrey")
    fig.tight_layout(rect=(0, 0.03 * (1 + note.count("\n")) + 0.02, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def drift_text(results: Sequence[ModelResults]) -> str:
    """The standalone drift across the policy jobs' brackets, in one line."""
    drifts = [d for r in results for d in r.drifts()]
    if not drifts:
        return "No standalone bracket around the policy jobs"
    return (
        f"Standalone speed drift across the bracket: median {statistics.median(drifts):.1%}, "
        f"max {max(drifts):.1%} (|after / before - 1|, {len(drifts)} worker-jobs), which "
        f"the waste from the trace does not depend on"
    )


def plot_peers(path: Path, results: Sequence[ModelResults]) -> None:
    """Farm's best beside each peer, images/s, per model."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 3.5), squeeze=False)
    for ax, r in zip(axes[0], results):
        rows = peer_rows([r])
        names = [row[1] for row in rows][::-1]
        rates = [row[3] for row in rows][::-1]
        colors = ["tab:blue" if name.startswith("farm") else "tab:grey" for name in names]
        ax.barh(names, rates, color=colors)
        for y, (rate, row) in enumerate(zip(rates, rows[::-1])):
            ax.annotate(f" {rate:,.0f}/s ({row[4]:.2f}x)", (rate, y), va="center", fontsize=8)
        ax.set_xlim(0, max(rates) * 1.35 if rates else 1)
        ax.set_xlabel("images/s")
        ax.set_title(f"{r.model}, {r.images:,} images, same cores")
    _save(plt, fig, path)


def plot_table2(path: Path, results: Sequence[ModelResults]) -> None:
    """Table 2 as lines: images/s by how many are submitted at once, per device kind."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        for kind, rows in r.table2.items():
            ax.plot(
                [n for n, _ in rows], [v for _, v in rows], marker="o", label=f"{r.model}, {kind}"
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("images submitted at once (chunk)")
    ax.set_ylabel("images/s, one worker")
    ax.set_title("Table 2: one worker through the farm")
    ax.legend(fontsize=8)
    _save(plt, fig, path)


def write_figures(folder: Path, results: Sequence[ModelResults]) -> list[str]:
    """Every PNG; their file names."""
    names = []
    for number, r in enumerate(results, start=3):
        name = f"figure{number}-{r.model}.png"
        plot_policies(folder / name, r, f"Figure {number}")
        names.append(name)
    plot_waste(folder / "figure5-waste.png", results)
    names.append("figure5-waste.png")
    if any(r.farm_rounds or r.peers for r in results):
        plot_peers(folder / "peers.png", results)
        names.append("peers.png")
    if any(r.table2 for r in results):
        plot_table2(folder / "table2.png", results)
        names.append("table2.png")
    return names


# ---- Markdown ---------------------------------------------------------------------------

PEER_MECHANISM = {
    "opencv-threads": "one process, OpenCV's threads splitting every layer across the cores: "
    "no image crosses a process boundary, which counts most on small nets, "
    "where moving an image costs the largest share of computing it",
    "process-pool": "multiprocessing serializes each chunk to a process and the outputs back, "
    "through pipes, from one parent",
    "ray-data": "Ray Data moves blocks through its object store and schedules every batch "
    "as a task of its actor pool",
    "onnxruntime-threads": "one process, ONNX Runtime's intra-op threads splitting every "
    "operator across the cores: no image crosses a process boundary",
    "openvino-throughput": "one process, OpenVINO's streams each computing whole requests on "
    "their share of the cores, kept busy by an async request queue: no "
    "image crosses a process boundary",
}


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines + [""]


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def headline(results: Sequence[ModelResults]) -> list[str]:
    """Farm's best against each peer, and its waste: the lines the README quotes."""
    peers = list(dict.fromkeys(p.peer for r in results for p in r.peers))
    rows = []
    for r in results:
        best = r.farm_best()
        if best is None:
            continue
        farm = r.farm_head_to_head()
        rates = {p.peer: p.rate for p in r.peer_medians()}
        waste = r.head_to_head_waste()
        rows.append(
            [
                r.model,
                f"{best.config.label}",
                f"{farm:,.0f}",
                _pct(best.waste),
                "-" if waste is None else _pct(waste),
            ]
            + [f"{farm / rates[p]:.2f}x" if p in rates else "-" for p in peers]
        )
    return _table(
        [
            "model",
            "farm's best policy",
            "images/s (head to head)" if peers else "images/s (sweep)",
            "waste (sweep, from the trace)",
            "head to head against standalone speeds (secondary)",
        ]
        + [f"farm ÷ {p}" for p in peers],
        rows,
    )


def noise(results: Sequence[ModelResults]) -> list[float]:
    """Per worker: how far apart its standalone measurements fell (max / min - 1)."""
    return [
        max(rates) / min(rates) - 1
        for r in results
        for workers in r.standalone.values()
        for rates in workers.values()
        if len(rates) > 1
    ]


def peer_wins(results: Sequence[ModelResults]) -> list[str]:
    """Where a peer beat farm's best, by how much, and what the farm lost there."""
    spread = max(noise(results), default=0.0)
    lines = []
    for r in results:
        best = r.farm_best()
        farm = r.farm_head_to_head()
        for peer in r.peer_medians():
            if best is not None and peer.rate > farm:
                mechanism = PEER_MECHANISM[peer.peer]
                lines.append(
                    f"- **{peer.peer} on {r.model}** ran {peer.rate / farm - 1:.1%} faster "
                    f"than farm's best ({peer.rate:,.0f} vs {farm:,.0f} images/s, medians "
                    f"of rounds run in turn). {mechanism[0].upper() + mechanism[1:]}. In the "
                    f"sweep, farm's best lost "
                    f"{_pct(best.contention)} of the standalone speeds to the cores running "
                    f"side by side and {_pct(best.farm_waste)} to scheduling and messaging"
                    + (
                        f"; the margin is within this run's noise ({spread:.1%})."
                        if peer.rate / farm - 1 < spread
                        else "."
                    )
                )
    return lines or ["No peer was faster than farm's best policy on any model."]


def policy_lines(r: ModelResults) -> list[str]:
    summaries = r.summaries()
    setups = list(dict.fromkeys(s.setup for s in summaries))
    labels = list(dict.fromkeys(s.config.label for s in summaries))
    index = {(s.setup, s.config.label): s for s in summaries}
    rows = []
    for label in labels:
        row = [label]
        for setup in setups:
            s = index.get((setup, label))
            row += ["-", "-"] if s is None else [f"{s.rate:,.0f}", _pct(s.waste)]
        rows.append(row)
    rows.append(
        ["theoretical"]
        + [cell for setup in setups for cell in (f"{r.theoretical(setup):,.0f}", "")]
    )
    header = ["policy"] + [
        cell for setup in setups for cell in (f"{setup} images/s", f"{setup} waste (trace)")
    ]
    return _table(header, rows)


def relative_lines(results: Sequence[ModelResults]) -> list[str]:
    rows = []
    algos: list[str] = []
    kinds = list(dict.fromkeys(kind for r in results for kind in alone_table(r)))
    for r in results:
        alone = alone_table(r)
        for setup in r.setups:
            table = relative_table(r, setup)
            algos = algos or list(table)
            rows.append(
                [r.model, setup]
                + [f"{100 * alone[k]:+.1f}%" if k in alone else "-" for k in kinds]
                + [f"{100 * table.get(a, float('nan')):+.1f}%" for a in algos]
            )
    return _table(["model", "setup"] + [f"{k} alone" for k in kinds] + algos, rows)


def relative_waste_lines(results: Sequence[ModelResults]) -> list[str]:
    """Tables 4/5's waste: from the trace, each policy's mean over its parameter values."""
    rows = []
    algos: list[str] = []
    for r in results:
        for setup in r.setups:
            table = waste_table(r, setup)
            algos = algos or list(table)
            rows.append([r.model, setup] + [_pct(table.get(a, float("nan"))) for a in algos])
    return _table(["model", "setup"] + algos, rows)


def waste_lines(results: Sequence[ModelResults]) -> list[str]:
    rows = []
    for r in results:
        for (setup, algo), s in r.best_per_policy().items():
            value = f"{s.config.parameter}={s.config.value}" if s.config.params else "-"
            rows.append(
                [
                    r.model,
                    setup,
                    algo,
                    value,
                    _pct(s.waste),
                    _pct(s.standalone_waste),
                    _pct(s.drift),
                ]
            )
    return _table(
        [
            "model",
            "setup",
            "policy",
            "value of least waste",
            "waste (from the trace)",
            "against standalone speeds (secondary: drifts, can go negative)",
            "standalone drift across its bracket (largest worker)",
        ],
        rows,
    )


def table2_lines(r: ModelResults) -> list[str]:
    kinds = list(r.table2)
    sizes = [n for n, _ in next(iter(r.table2.values()), [])]
    rows = [[f"{n:,}"] + [f"{dict(r.table2[k])[n]:,.1f}" for k in kinds] for n in sizes]
    return _table(["submitted at once"] + kinds, rows)


def noise_line(results: Sequence[ModelResults]) -> str:
    """How far the standalone speeds moved across the policy jobs' brackets, and over the
    whole run: what the secondary, standalone-based figures are worth."""
    drifts = [d for r in results for d in r.drifts()]
    spreads = noise(results)
    if not drifts:
        return "No standalone bracket around the policy jobs: no drift figure."
    return (
        f"{drift_text(results)}. Over the whole run one worker's standalone measurements "
        f"differ by up to {max(spreads, default=0.0):.1%}: figures against standalone "
        f"speeds move by as much, and can go negative."
    )


def machine_lines(run: SuiteRun) -> list[str]:
    """The report's first lines: the machine, the versions, the load, the command."""
    machine = run.machine
    gpus = ", ".join(machine["gpus"]) or "no GPU"
    versions = ", ".join(f"{k} {v}" for k, v in machine["versions"].items())
    lines = [
        f"- machine: {machine['cpu']}, {machine['cores']} cores, "
        f"{machine['memory_gib']} GiB, {gpus}; Linux {machine['kernel']}, "
        f"Python {machine['python']}",
    ]
    if "cpu_family" in machine:  # folders written before these were recorded lack them
        lines.append(f"- CPU: {cpu_line(machine)}")
    lines += [
        f"- versions: {versions}",
        f"- load average at start: {machine['load_average']}"
        + (f", at the end: {machine['load_average_end']}" if "load_average_end" in machine else ""),
        f"- command: `{run.command}` ({run.seconds / 60:.0f} min)",
    ]
    lines += [
        f"- farm `{s.name}`: {s.about}: " + ", ".join(w.label for w in s.workers)
        for s in run.setups
    ]
    return lines + [f"- not run: {why}" for why in run.skipped]


def cpu_line(machine: dict[str, Any]) -> str:
    """Family, model, generation and the instruction sets the engines care about."""
    generation = machine.get("cpu_generation") or ""
    flags = machine.get("cpu_flags", [])
    amx = [flag for flag in flags if flag.startswith("amx")]
    shown = [flag for flag in flags if not flag.startswith("amx")]
    return (
        f"family {machine['cpu_family']} model {machine['cpu_model']}"
        + (f" ({generation})" if generation else "")
        + f"; flags {' '.join(shown) or 'none of note'}; "
        + (f"AMX: {' '.join(amx)}" if amx else "no AMX")
    )


WASTE_TEXT = (
    "**Waste** is measured from each policy job's own trace: each worker's idle time "
    "between the job's start (its submission) and its end (the last result back at the "
    "broker), summed over the workers, over workers x span "
    "(`farm.client.trace.idle_share`). A worker is busy only while it computes a chunk "
    "(the compute time its RESULT reports); receiving, queueing, replying and loading "
    "count as idle. It cannot go negative, and the machine's drift between measurements "
    "cannot move it. Each policy job is bracketed by standalone measurements of the same "
    "workers (each alone in a warm one-worker farm, just before and just after the job); "
    "how far they moved is the drift. The old figure, (theoretical - achieved) / "
    "theoretical against those standalone speeds, is kept as a secondary column only: it "
    "moves with the drift. Each figure is the median of its rounds."
)


def write_report(folder: Path, run: SuiteRun) -> None:
    results = run.results
    peers_ran = any(r.peers or r.farm_rounds for r in results)
    lines = [f"# farm benchmark, {run.machine['date']}", ""] + machine_lines(run)
    lines += ["", WASTE_TEXT, "", noise_line(results), "", "## Headline", ""]
    lines += headline(results)
    if peers_ran:
        lines += ["## Where a peer is faster", ""] + peer_wins(results) + [""]
    if any(r.table2 for r in results):
        lines += table2_section(results)
    lines += [batches_line(results), ""]
    for number, r in enumerate(results, start=3):
        lines += figure_section(number, r)
    lines += relative_section(results) + waste_section(results)
    if peers_ran:
        lines += peer_section(results)
    lines += standalone_section(results)
    (folder / "report.md").write_text("\n".join(lines))


def table2_section(results: Sequence[ModelResults]) -> list[str]:
    """Table 2: one worker's speed by how many images are submitted at once."""
    lines = [
        "## Table 2: one worker, images/s by how many images are submitted at once",
        "",
        "![Table 2](table2.png)",
        "",
    ]
    for r in results:
        lines += [f"{r.model}:", ""] + table2_lines(r)
    return lines


def batches_line(results: Sequence[ModelResults]) -> str:
    """The workers' compute batches and what each gave."""
    return (
        "Compute batch of the farm's workers, tuned like the peers' settings "
        "(images/s of the engine alone): "
        + "; ".join(
            f"{r.model} {kind}: " + ", ".join(f"{b} {v:,.0f}" for b, v in rows)
            for r in results
            for kind, rows in r.batches.items()
        )
    )


def figure_section(number: int, r: ModelResults) -> list[str]:
    """Figure 3, 4, ...: one model, every policy at the paper's values."""
    return [
        f"## Figure {number}: {r.model}, every policy at the paper's values, {r.images:,} images",
        "",
        f"![Figure {number}](figure{number}-{r.model}.png)",
        "",
    ] + policy_lines(r)


def relative_section(results: Sequence[ModelResults]) -> list[str]:
    """Tables 4/5: speed relative to one core, and waste, per policy."""
    lines = [
        "## Tables 4/5: speed relative to one CPU core, and waste (mean over parameter values)",
        "",
        "One CPU core: the mean standalone speed of the `cores` farm's workers (every "
        "bracket measurement of the run).",
        "",
    ]
    lines += relative_lines(results)
    lines += ["Waste from the trace, each policy's mean over its parameter values:", ""]
    return lines + relative_waste_lines(results)


def waste_section(results: Sequence[ModelResults]) -> list[str]:
    """Figure 5: each policy's least waste, and the drift around the jobs."""
    return [
        "## Figure 5: waste per policy (its parameter value of least waste)",
        "",
        "![Figure 5](figure5-waste.png)",
        "",
        drift_text(results) + ".",
        "",
    ] + waste_lines(results)


def standalone_section(results: Sequence[ModelResults]) -> list[str]:
    """Every standalone measurement, in order."""
    lines = [
        "",
        "## Standalone speeds (images/s, each measurement in order)",
        "",
        "In the sweep, one before each round's first job and one after each job: job k of "
        "a round lies between measurements k and k + 1 of that round.",
        "",
    ]
    return lines + _table(
        ["model", "setup", "worker", "measurements"],
        [
            (r.model, setup, worker, ", ".join(f"{v:,.0f}" for v in rates))
            for r in results
            for setup, workers in r.standalone.items()
            for worker, rates in workers.items()
        ],
    )


def peer_section(results: Sequence[ModelResults]) -> list[str]:
    """The peers' section: farm's best and every peer, run in turn."""
    lines = [
        "## Peers: same model, same images, same cores",
        "",
        "![peers](peers.png)",
        "",
        "Farm's best configuration (from the sweep, on a fresh farm) and every peer run "
        "in turn, round after round; each figure is the median of its rounds. "
        "Every peer runs farm's own engine code in fresh processes, tuned on a slice "
        "first; `max_abs_difference` compares its outputs with the farm's.",
        "",
    ]
    lines += _table(
        [
            "model",
            "who",
            "settings",
            "images/s (median)",
            "÷ farm's best",
            "max abs difference",
            "note",
            "each round",
        ],
        peer_rows(results),
    )
    return lines + [f"- {why}" for r in results for why in r.skipped_peers]


# ---- reading a results folder back ------------------------------------------------------


def _rows(folder: Path, name: str, optional: bool = False) -> list[dict[str, str]]:
    """A CSV table's rows; none for an ``optional`` table the run did not write."""
    if optional and not (folder / name).exists():
        return []
    with open(folder / name, newline="") as handle:
        return list(csv.DictReader(handle))


def _number(text: str) -> int | float:
    value = float(text)
    return int(value) if value.is_integer() and "." not in text else value


def _configuration(algo: str, parameter: str, value: str) -> Configuration:
    return Configuration(algo, {parameter: _number(value)} if parameter else {})


def read_folder(folder: Path) -> SuiteRun:
    """A results folder's data, as the suite had it when it wrote the folder."""
    machine = json.loads((folder / "machine.json").read_text())
    recorded = machine.pop("run")
    setups = read_setups(machine.pop("setups"))
    results = {model: ModelResults(model, images) for model, images in recorded["images"].items()}
    for model, why in recorded["skipped_peers"].items():
        results[model].skipped_peers = list(why)
    read_speeds(folder, results)
    read_policy_runs(folder, results)
    read_peers(folder, results)
    return SuiteRun(
        machine,
        setups,
        list(recorded["skipped"]),
        list(results.values()),
        recorded["command"],
        float(recorded["seconds"]),
    )


def read_setups(recorded: dict[str, list[str]]) -> list[FarmSetup]:
    """The farms the suite built, from machine.json's worker labels."""
    return [
        FarmSetup(
            name, SETUP_ABOUT.get(name, ""), tuple(WorkerSpec.from_label(label) for label in labels)
        )
        for name, labels in recorded.items()
    ]


def read_speeds(folder: Path, results: dict[str, ModelResults]) -> None:
    """The batch tuning, table 2 and the standalone measurements."""
    for row in _rows(folder, "batches.csv"):
        results[row["model"]].batches.setdefault(row["device"], []).append(
            (int(row["batch"]), float(row["images_per_s"]))
        )
    for row in _rows(folder, "table2.csv", optional=True):
        results[row["model"]].table2.setdefault(row["device"], []).append(
            (int(row["submitted"]), float(row["images_per_s"]))
        )
    for row in _rows(folder, "standalone.csv"):
        results[row["model"]].standalone.setdefault(row["setup"], {}).setdefault(
            row["worker"], []
        ).append(float(row["images_per_s"]))


def read_policy_runs(folder: Path, results: dict[str, ModelResults]) -> None:
    """Every policy job; ValueError for a table written before jobs were traced."""
    runs = _rows(folder, "policy_runs.csv")
    if runs and "waste_from_trace" not in runs[0]:
        raise ValueError(
            "policy_runs.csv has no waste from the trace (written before farm bench traced "
            "its policy jobs): its figures cannot be drawn again"
        )
    for row in runs:
        results[row["model"]].runs.append(
            PolicyRun(
                row["setup"],
                row["model"],
                _configuration(row["policy"], row["parameter"], row["value"]),
                int(row["round"]),
                float(row["images_per_s"]),
                float(row["seconds"]),
                float(row["in_job_theoretical_per_s"]),
                int(row["chunks"]),
                float(row["waste_from_trace"]),
                int(row["standalone_bracket"]),
            )
        )


def read_peers(folder: Path, results: dict[str, ModelResults]) -> None:
    """Farm's rounds against the peers, each peer's runs, tuning and output difference."""
    tuning: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for row in _rows(folder, "peer_tuning.csv", optional=True):
        tuning[(row["model"], row["peer"])].append(
            (int(row["setting"]), float(row["images_per_s"]))
        )
    for row in _rows(folder, "peer_runs.csv", optional=True):
        found, rate = results[row["model"]], float(row["images_per_s"])
        if row["who"] == "farm":
            found.farm_rounds.append(rate)
            continue
        round_ = int(row["round"])
        found.peers.append(
            PeerResult(
                row["who"],
                row["setting"],
                rate,
                found.images / rate,
                tuple(tuning[(row["model"], row["who"])]) if round_ == 0 else (),
                None,
                row["note"],
                int(row["best"]),
                round_,
            )
        )
    for row in _rows(folder, "peers.csv", optional=True):
        if not row["peer"].startswith("farm ("):
            results[row["model"]].peer_differences[row["peer"]] = float(row["max_abs_difference"])


def write_folder(folder: Path, run: SuiteRun) -> None:
    """Tables, figures and the report."""
    write_tables(folder, run)
    write_figures(folder, run.results)
    write_report(folder, run)
