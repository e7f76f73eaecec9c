"""What a suite run found, and how it is written: CSV tables, PNG figures, a Markdown report.

Waste follows docs/scheduling.md: (theoretical - achieved) / theoretical, where
theoretical is the sum of each worker's standalone speed, each worker alone in
a one-worker farm, measured in the same run (before every round of the sweep
and after the last; their mean).  Beside it, the sweep's own split: the
workers' speeds inside the job (contention between cores the scheduler cannot
recover) and the rest (scheduling and messaging: the farm's own waste).
"""

from __future__ import annotations

import csv
import json
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from farm.bench.measure import Configuration, PolicyRun
from farm.bench.peers import PeerResult
from farm.bench.setups import SETUP_ABOUT, FarmSetup, WorkerSpec

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
        return [
            PolicySummary.of(runs, self.theoretical(runs[0].setup)) for runs in grouped.values()
        ]

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
        """(setup, policy) -> its fastest parameter value."""
        best: dict[tuple[str, str], PolicySummary] = {}
        for s in self.summaries():
            key = (s.setup, s.config.algo)
            if key not in best or s.rate > best[key].rate:
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
    theoretical: float  # standalone sum
    in_job_theoretical: float  # the median run's in-job speed sum

    @classmethod
    def of(cls, runs: Sequence[PolicyRun], theoretical: float) -> PolicySummary:
        median = median_run(runs)
        return cls(
            median.setup,
            median.config,
            median.rate,
            len(runs),
            theoretical,
            median.in_job_theoretical,
        )

    @property
    def waste(self) -> float:
        return 1 - self.rate / self.theoretical

    @property
    def contention(self) -> float:
        """Share of the standalone sum lost by the workers running side by side."""
        return 1 - self.in_job_theoretical / self.theoretical

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
    """Every table as CSV; the machine and the run as JSON."""
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
        [
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
        ],
        [
            (
                r.model,
                job.setup,
                job.config.algo,
                job.config.parameter,
                job.config.value,
                job.round_,
                _r(job.rate),
                round(job.seconds, 3),
                job.chunks,
                _r(job.in_job_theoretical),
            )
            for r in results
            for job in r.runs
        ],
    )
    write_csv(
        folder / "policies.csv",
        [
            "model",
            "setup",
            "policy",
            "parameter",
            "value",
            "images_per_s",
            "theoretical_per_s",
            "waste",
            "contention",
            "farm_waste",
            "relative_to_one_core",
        ],
        [
            (
                r.model,
                s.setup,
                s.config.algo,
                s.config.parameter,
                s.config.value,
                _r(s.rate),
                _r(s.theoretical),
                round(s.waste, 4),
                round(s.contention, 4),
                round(s.farm_waste, 4),
                round(s.rate / r.one_core() - 1, 4),
            )
            for r in results
            for s in r.summaries()
        ],
    )
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
    setup, its theoretical speed dashed, the peers dotted."""
    plt = _pyplot()
    summaries = r.summaries()
    setups = list(dict.fromkeys(s.setup for s in summaries))
    labels = list(dict.fromkeys(s.config.label for s in summaries))
    width = 0.8 / max(1, len(setups))
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.6), 5))
    for i, setup in enumerate(setups):
        rates = {s.config.label: s.rate for s in summaries if s.setup == setup}
        bars = ax.bar(
            [x + i * width for x in range(len(labels))],
            [rates.get(label, 0) for label in labels],
            width,
            label=f"farm, {setup}",
        )
        ax.axhline(
            r.theoretical(setup),
            color=bars.patches[0].get_facecolor(),
            ls="--",
            lw=1,
            label=f"theoretical, {setup}",
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
    """Figure 5: waste of each policy (its best parameter value), per model and setup."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
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
        ax.set_ylabel("waste, % (best parameter value)")
        ax.set_title(f"Figure 5: {r.model}")
        ax.legend(fontsize=8)
    _save(plt, fig, path)


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
    plot_peers(folder / "peers.png", results)
    plot_table2(folder / "table2.png", results)
    return names + ["figure5-waste.png", "peers.png", "table2.png"]


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
                "-" if waste is None else _pct(waste),
                _pct(best.waste),
                _pct(best.farm_waste),
            ]
            + [f"{farm / rates[p]:.2f}x" if p in rates else "-" for p in peers]
        )
    return _table(
        [
            "model",
            "farm's best policy",
            "images/s (head to head)",
            "waste (head to head)",
            "waste (sweep)",
            "sweep's scheduling + messaging",
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
        cell for setup in setups for cell in (f"{setup} images/s", f"{setup} waste")
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


def waste_lines(results: Sequence[ModelResults]) -> list[str]:
    rows = []
    for r in results:
        for (setup, algo), s in r.best_per_policy().items():
            value = f"{s.config.parameter}={s.config.value}" if s.config.params else "-"
            rows.append(
                [r.model, setup, algo, value, _pct(s.waste), _pct(s.contention), _pct(s.farm_waste)]
            )
    return _table(
        ["model", "setup", "policy", "best value", "waste", "contention", "scheduling + messaging"],
        rows,
    )


def table2_lines(r: ModelResults) -> list[str]:
    kinds = list(r.table2)
    sizes = [n for n, _ in next(iter(r.table2.values()), [])]
    rows = [[f"{n:,}"] + [f"{dict(r.table2[k])[n]:,.1f}" for k in kinds] for n in sizes]
    return _table(["submitted at once"] + kinds, rows)


def noise_line(results: Sequence[ModelResults]) -> str:
    """How far apart one worker's standalone measurements fell: the run's noise."""
    spreads = noise(results)
    if not spreads:
        return "One standalone measurement per worker: no noise figure."
    return (
        f"Noise: one worker's standalone measurements in this run differ by up to "
        f"{max(spreads):.1%} (median {statistics.median(spreads):.1%}); waste figures "
        f"closer than that are ties, and a small negative waste means the farm ran "
        f"faster than the standalone runs happened to."
    )


def write_report(folder: Path, run: SuiteRun) -> None:
    machine, setups, skipped, results = run.machine, run.setups, run.skipped, run.results
    command, seconds = run.command, run.seconds
    gpus = ", ".join(machine["gpus"]) or "no GPU"
    versions = ", ".join(f"{k} {v}" for k, v in machine["versions"].items())
    lines = [
        f"# farm benchmark, {machine['date']}",
        "",
        f"- machine: {machine['cpu']}, {machine['cores']} cores, "
        f"{machine['memory_gib']} GiB, {gpus}; Linux {machine['kernel']}, "
        f"Python {machine['python']}",
        f"- versions: {versions}",
        f"- load average at start: {machine['load_average']}",
        f"- command: `{command}` ({seconds / 60:.0f} min)",
    ]
    lines += [
        f"- farm `{s.name}`: {s.about}: " + ", ".join(w.label for w in s.workers) for s in setups
    ]
    lines += [f"- not run: {why}" for why in skipped]
    lines += [
        "",
        "Waste = (theoretical - achieved) / theoretical; theoretical is the sum of "
        "each worker's standalone speed (alone in a one-worker farm), measured in this "
        "run before each round and after the last. *Contention* is the part the "
        "workers lose by running side by side (their speeds inside the job against "
        "alone); *scheduling + messaging* is the rest. Each figure is the median of "
        "its rounds. The head-to-head waste is the farm's median round between the "
        "peers against the standalone speeds measured in those rounds; the sweep's "
        "is its best configuration's, which the pick of the best of many runs "
        "flatters.",
        "",
        noise_line(results),
        "",
        "## Headline",
        "",
    ]
    lines += headline(results)
    lines += ["## Where a peer is faster", ""] + peer_wins(results) + [""]
    lines += [
        "## Table 2: one worker, images/s by how many images are submitted at once",
        "",
        "![Table 2](table2.png)",
        "",
    ]
    for r in results:
        lines += [f"{r.model}:", ""] + table2_lines(r)
    lines += [
        "Compute batch of the farm's workers, tuned like the peers' settings "
        "(images/s of the engine alone): "
        + "; ".join(
            f"{r.model} {kind}: " + ", ".join(f"{b} {v:,.0f}" for b, v in rows)
            for r in results
            for kind, rows in r.batches.items()
        ),
        "",
    ]
    for number, r in enumerate(results, start=3):
        lines += [
            f"## Figure {number}: {r.model}, every policy at the paper's values, "
            f"{r.images:,} images",
            "",
            f"![Figure {number}](figure{number}-{r.model}.png)",
            "",
        ] + policy_lines(r)
    lines += [
        "## Tables 4/5: speed relative to one CPU core (mean over parameter values)",
        "",
        "One CPU core: the mean standalone speed of the `cores` farm's workers.",
        "",
    ]
    lines += relative_lines(results)
    lines += [
        "## Figure 5: waste per policy (its best parameter value)",
        "",
        "![Figure 5](figure5-waste.png)",
        "",
    ] + waste_lines(results)
    lines += [
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
    lines += [f"- {why}" for r in results for why in r.skipped_peers]
    lines += ["", "## Standalone speeds (images/s, each measurement)", ""]
    lines += _table(
        ["model", "setup", "worker", "measurements"],
        [
            (r.model, setup, worker, ", ".join(f"{v:,.0f}" for v in rates))
            for r in results
            for setup, workers in r.standalone.items()
            for worker, rates in workers.items()
        ],
    )
    (folder / "report.md").write_text("\n".join(lines))


# ---- reading a results folder back ------------------------------------------------------


def _rows(folder: Path, name: str) -> list[dict[str, str]]:
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
    setups = [
        FarmSetup(
            name, SETUP_ABOUT.get(name, ""), tuple(WorkerSpec.from_label(label) for label in labels)
        )
        for name, labels in machine.pop("setups").items()
    ]
    results = {model: ModelResults(model, images) for model, images in recorded["images"].items()}
    for model, why in recorded["skipped_peers"].items():
        results[model].skipped_peers = list(why)
    for row in _rows(folder, "batches.csv"):
        results[row["model"]].batches.setdefault(row["device"], []).append(
            (int(row["batch"]), float(row["images_per_s"]))
        )
    for row in _rows(folder, "table2.csv"):
        results[row["model"]].table2.setdefault(row["device"], []).append(
            (int(row["submitted"]), float(row["images_per_s"]))
        )
    for row in _rows(folder, "standalone.csv"):
        results[row["model"]].standalone.setdefault(row["setup"], {}).setdefault(
            row["worker"], []
        ).append(float(row["images_per_s"]))
    for row in _rows(folder, "policy_runs.csv"):
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
            )
        )
    tuning: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for row in _rows(folder, "peer_tuning.csv"):
        tuning[(row["model"], row["peer"])].append(
            (int(row["setting"]), float(row["images_per_s"]))
        )
    for row in _rows(folder, "peer_runs.csv"):
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
    for row in _rows(folder, "peers.csv"):
        if not row["peer"].startswith("farm ("):
            results[row["model"]].peer_differences[row["peer"]] = float(row["max_abs_difference"])
    return SuiteRun(
        machine,
        setups,
        list(recorded["skipped"]),
        list(results.values()),
        recorded["command"],
        float(recorded["seconds"]),
    )


def write_folder(folder: Path, run: SuiteRun) -> None:
    """Tables, figures and the report."""
    write_tables(folder, run)
    write_figures(folder, run.results)
    write_report(folder, run)
