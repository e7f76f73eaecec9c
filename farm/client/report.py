"""Where a job's time went: read a trace from `farm submit --trace`, break its waste down, plot it.

Waste is the share of the farm's capacity (every worker's standalone speed times the job's span T
on the broker's clock) that did not turn into images.  A worker loses capacity whenever it is not
computing, and each idle second is put in one of four parts:

- start: before its first chunk started;
- barrier: between chunks, while the broker held its result and had given it nothing new;
- messaging: the rest of a gap between chunks (inputs and results in transit, latency);
- tail: after its last chunk finished, until T.

Each part is weighted by the worker's speed, so the parts add up to the waste; `other` takes what
they do not explain (failed chunks, speeds and clock estimates, rounding).

A chunk may reach its worker (``arrived``) well before it starts: workers hold two chunks, so the
second queues behind the first.  That wait is neither transfer nor idleness, and is not drawn.
The figure's lower panel is the compute throughput (`throughput`): each chunk spreads its images
evenly over the time it computed, so a large chunk shows as a steady rate, not a spike when its
result lands.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from matplotlib import rc_context
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import StrMethodFormatter

from farm.client.status import table
from farm.client.trace import TRACE_FORMAT, ChunkTrace, Trace, busy_stretches
from farm.summary import per_second, plural

__all__ = [
    "TRACE_FORMAT",
    "Breakdown",
    "Trace",
    "TraceError",
    "WorkerLine",
    "analyse",
    "load_trace",
    "plot",
    "throughput",
]

_PARTS = (
    ("start", "workers idle before their first chunk started"),
    ("barrier", "result handed back, waiting for the scheduler to assign the next chunk"),
    ("messaging", "inputs and results in transit between chunks"),
    ("tail", "workers idle after their last chunk finished, until the job ended"),
    ("other", "not explained: failed chunks, speed and clock estimates, rounding"),
)


class TraceError(ValueError):
    """A file that is not a valid farm trace."""


# -- reading ---------------------------------------------------------------------------------


def load_trace(path: str | Path) -> Trace:
    """Read a trace file, every field's type checked; TraceError naming the file (and the
    field) on anything wrong."""
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=Trace)
    except OSError as error:
        raise TraceError(f"{path}: cannot read ({error.strerror or error})") from None
    except msgspec.DecodeError as error:  # ValidationError included: "... - at `$.chunks`"
        raise TraceError(f"{path}: not a farm trace ({error})") from None


# -- analysis --------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerLine:
    name: str
    items: int
    chunks: int
    busy_s: float  # computing (chunks merged where they overlap)
    idle_start_s: float
    barrier_s: float
    messaging_s: float
    tail_s: float
    standalone_rate: float  # images per second of compute
    device_s: float | None = None  # seconds the device computed, where the worker said
    copy_s: float | None = None  # seconds of host-GPU copies, where the worker said

    def device_share(self, seconds: float) -> float | None:
        """The share of ``seconds`` the device computed (a GPU's busy share)."""
        return None if self.device_s is None or seconds <= 0 else self.device_s / seconds


@dataclass(frozen=True)
class Breakdown:
    items: int  # images that came back (failed or cancelled ones excluded)
    seconds: float  # T: the job's span on the broker's clock
    rate: float
    theoretical_rate: float
    waste: float
    start: float  # the parts are fractions of capacity, sum of standalone_rate * T
    barrier: float
    messaging: float
    tail: float
    other: float
    workers: tuple[WorkerLine, ...]
    model: str = "?"
    policy: str = "?"
    cancelled: str | None = None  # why the job stopped early, if it did
    total: int = 0  # images in the job
    shared: bool = False  # other jobs ran on the workers meanwhile
    tail_from: float = 0.0  # the first worker's last result: from here it idled to the end

    @property
    def tail_seconds(self) -> float:
        """The job's tail: from the first worker's last result to the job's end."""
        return max(0.0, self.seconds - self.tail_from)

    @property
    def tail_share(self) -> float:
        return self.tail_seconds / self.seconds if self.seconds > 0 else 0.0

    def format(self) -> str:
        """A few aligned lines for the terminal: totals, where the waste went, each worker."""
        stopped = f", stopped early: {self.cancelled}" if self.cancelled else ""
        done = (
            plural(self.items, "image")
            if self.items >= self.total
            else f"{self.items:,} of {plural(self.total, 'image')}"
        )
        lines = [
            f"{done} in {self.seconds:.3f} s: {per_second(self.rate)} "
            f"(model {self.model}, policy {self.policy}){stopped}",
            f"theoretical {per_second(self.theoretical_rate)} (sum of the workers' "
            f"standalone speeds), waste {self.waste:.1%}",
            f"tail {self.tail_seconds:.3f} s ({self.tail_share:.1%} of the span): from the "
            f"first worker's last result to the job's end",
            "where the waste went (% of the workers' capacity):",
        ]
        if self.shared:
            lines.insert(
                3, "(other jobs shared the workers meanwhile: their chunks count as idle time here)"
            )
        if self.cancelled:
            lines.insert(
                3, "(the job stopped early: chunks running when it stopped are not in the trace)"
            )
        lines += [
            f"  {part:<9} {_percent(getattr(self, part)):>6}  {meaning}" for part, meaning in _PARTS
        ]
        header = (
            "worker",
            "images",
            "chunks",
            "busy",
            "device",
            "idle: start",
            "barrier",
            "messaging",
            "tail (s)",
        )
        rows = [
            (
                w.name,
                f"{w.items:,}",
                f"{w.chunks:,}",
                f"{w.busy_s / self.seconds if self.seconds > 0 else 0.0:.1%}",
                _optional_percent(w.device_share(self.seconds)),
                *(f"{s:.3f}" for s in (w.idle_start_s, w.barrier_s, w.messaging_s, w.tail_s)),
            )
            for w in self.workers
        ]
        lines += ["  " + line for line in table(header, rows, set(range(1, len(header))))]
        return "\n".join(lines)


def _by_worker(trace: Trace) -> dict[str, list[ChunkTrace]]:
    """Chunks of each worker (listed or not), sorted by start of compute; rows sorted by name."""
    names = {w.name for w in trace.workers} | {c.worker for c in trace.chunks}
    rows: dict[str, list[ChunkTrace]] = {name: [] for name in sorted(names)}
    for chunk in trace.chunks:
        rows[chunk.worker].append(chunk)
    for chunks in rows.values():
        chunks.sort(key=lambda c: c.started)
    return rows


def _idle(chunks: list[ChunkTrace], seconds: float) -> tuple[float, float, float, float, float]:
    """(busy, start, barrier, messaging, tail) seconds of one worker, from its busy stretches
    (``busy_stretches``: chunks merged where they overlap, cut to the job's span)."""
    stretches = busy_stretches(chunks, seconds)
    if not stretches:
        return 0.0, seconds, 0.0, 0.0, 0.0
    barrier = messaging = 0.0
    for before, after in zip(stretches, stretches[1:]):
        # a barrier: the result was back and the next chunk not yet assigned
        wait = max(
            0.0,
            min(after.begin, after.first.assigned) - max(before.end, before.last.received),
        )
        barrier += wait
        messaging += after.begin - before.end - wait
    busy = sum(stretch.end - stretch.begin for stretch in stretches)
    return busy, stretches[0].begin, barrier, messaging, seconds - stretches[-1].end


def _worker_lines(trace: Trace, seconds: float) -> tuple[WorkerLine, ...]:
    listed = {w.name: w for w in trace.workers}
    lines = []
    for name, chunks in _by_worker(trace).items():
        share = listed.get(name)  # a worker missing from the list ran chunks at no known speed
        items, count, rate = (
            (share.items, share.chunks, share.rate)
            if share
            else (sum(c.count for c in chunks), len(chunks), 0.0)
        )
        busy, start, barrier, messaging, tail = _idle(chunks, seconds)
        lines.append(
            WorkerLine(
                name,
                items,
                count,
                busy,
                start,
                barrier,
                messaging,
                tail,
                float(rate),
                _reported(c.device for c in chunks),
                _reported(c.copy for c in chunks),
            )
        )
    return tuple(lines)


def _reported(values: Iterable[float | None]) -> float | None:
    """The sum of the values reported, or None when no chunk reported one."""
    known = [value for value in values if value is not None]
    return sum(known) if known else None


def _percent(fraction: float) -> str:
    """A fraction as a percentage, with no "-0.0%" for rounding noise."""
    return f"{0.0 if abs(fraction) < 0.0005 else fraction:.1%}"


def _optional_percent(fraction: float | None) -> str:
    return "-" if fraction is None else _percent(fraction)


def analyse(trace: Trace) -> Breakdown:
    """The job's rate, waste, and the waste split into start, barrier, messaging, tail, other."""
    seconds = max(trace.broker_seconds, 0.0)
    total = trace.items
    items = total - sum(f.count for f in trace.failed)
    workers = _worker_lines(trace, seconds)
    theoretical = sum(w.standalone_rate for w in workers)
    capacity = theoretical * seconds  # images the workers could have done in T

    def share(images: float) -> float:
        return images / capacity if capacity > 0 else 0.0

    waste = share(capacity - items)  # == (theoretical - rate) / theoretical when T > 0
    start, barrier, messaging, tail = (
        share(sum(w.standalone_rate * getattr(w, field) for w in workers))
        for field in ("idle_start_s", "barrier_s", "messaging_s", "tail_s")
    )
    return Breakdown(
        items=items,
        seconds=seconds,
        rate=items / seconds if seconds > 0 else 0.0,
        theoretical_rate=theoretical,
        waste=waste,
        start=start,
        barrier=barrier,
        messaging=messaging,
        tail=tail,
        other=waste - (start + barrier + messaging + tail),
        workers=workers,
        model=trace.model,
        policy=trace.policy,
        cancelled=trace.cancelled or None,
        total=total,
        shared=trace.shared,
        tail_from=tail_from(trace, seconds),
    )


def tail_from(trace: Trace, seconds: float) -> float:
    """When the first worker that ran chunks had its last result back (``seconds``, the
    job's end, if none did)."""
    lasts = [max(c.received for c in chunks) for chunks in _by_worker(trace).values() if chunks]
    return min(lasts, default=seconds)


def _span(trace: Trace) -> float:
    """Seconds the figure covers: the job's span, or longer if a chunk came back later."""
    return max(
        [trace.broker_seconds, 0.01]
        + [moment for c in trace.chunks for moment in (c.finished, c.received)]
    )


def throughput(trace: Trace, bins: int | Sequence[float] = 100) -> tuple[np.ndarray, np.ndarray]:
    """(edges, rates): images/s computed by all workers together, averaged within each bin.

    A chunk counts count / (finished - started) images/s over [started, finished]; each bin gets
    the images computed inside it (the exact overlap) divided by its width.  `bins` is a number
    of equal bins from 0 to the end of the job, or the increasing bin edges themselves.  A chunk
    that took no time puts all its images in the bin where it started.
    """
    if isinstance(bins, (int, float)):
        edges = np.linspace(0.0, _span(trace), max(int(bins), 1) + 1)
    else:
        edges = np.asarray(bins, dtype=float)
        if edges.ndim != 1 or len(edges) < 2 or np.any(np.diff(edges) <= 0):
            raise ValueError("bins: need at least two increasing edges")
    done = np.zeros_like(edges)  # images computed by each edge
    for c in trace.chunks:
        took = c.finished - c.started
        if took > 0:
            done += c.count * np.clip((edges - c.started) / took, 0.0, 1.0)
        else:
            done += c.count * (edges >= c.started)
    return edges, np.diff(done) / np.diff(edges)


# -- figure ----------------------------------------------------------------------------------

_SHADES = ("#2b6cb0", "#63a4e0")  # alternate chunks of a row
_TRANSFER = "#e07b00"
_RECEIVED = "#9a9a9a"


def _arrived(chunk: ChunkTrace) -> float:
    """When the chunk reached its worker, within [sent, started]; older traces: when sent."""
    arrived = chunk.sent if chunk.arrived is None else chunk.arrived
    return min(max(arrived, chunk.sent), chunk.started)


def _draw_timeline(ax: Any, trace: Trace, wide: bool) -> None:
    rows = _by_worker(trace)
    height = 0.8
    tail = tail_from(trace, trace.broker_seconds)
    if tail < trace.broker_seconds:
        ax.axvspan(tail, trace.broker_seconds, color="#f2d0d0", zorder=1, linewidth=0)
    for y, chunks in enumerate(rows.values()):
        spans = [(c.started, max(c.finished - c.started, 0.0)) for c in chunks]
        colors = [_SHADES[i % 2] for i in range(len(spans))]
        ax.broken_barh(spans, (y - height / 2, height), facecolors=colors, linewidth=0, zorder=2)
        # a thin strip in the row's middle, on top (an edge line keeps a 1 ms transfer visible)
        transfers = [
            (a, b - a)
            for c in chunks
            for a, b in ((c.sent, _arrived(c)), (c.finished, c.received))
            if b > a
        ]
        ax.broken_barh(
            transfers,
            (y - height / 14, height / 7),
            facecolors=_TRANSFER,
            edgecolors=_TRANSFER,
            linewidth=0.6,
            zorder=3,
        )
        if not chunks:
            ax.text(0.0, y, "  ran no chunk", va="center", fontsize="x-small", color="grey")
    names = list(rows)
    step = -(-len(names) // 40) if names else 1  # label at most ~40 rows
    ax.set_yticks(
        range(0, len(names), step),
        names[::step],
        fontsize="medium" if len(names) <= 20 else "small",
    )
    ax.set_ylim(max(len(names), 1) - 0.5, -0.5)  # first name on top
    ax.set_ylabel("worker")
    ax.grid(axis="x", alpha=0.3, zorder=0)
    ax.set_axisbelow(True)
    ax.legend(
        handles=[
            Patch(color=_SHADES[0], label="computing (one chunk)"),
            Patch(color=_SHADES[1], label="computing (next chunk)"),
            Patch(color=_TRANSFER, label="in transit: sent→arrived, finished→received"),
            Patch(facecolor="white", edgecolor="grey", label="idle"),
            Patch(color="#f2d0d0", label="tail: a worker idle with nothing left"),
        ],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=5 if wide else 2,
        fontsize="small",
        frameon=False,
    )


def _draw_throughput(ax: Any, trace: Trace, breakdown: Breakdown, wide: bool) -> None:
    edges, rates = throughput(trace, 100)
    span = edges[-1]
    ax.stairs(rates, edges, fill=True, color=_SHADES[1], alpha=0.25, linewidth=0)
    ax.stairs(
        rates,
        edges,
        color=_SHADES[0],
        linewidth=1.5,
        zorder=3,
        label="images/s computed (all workers)",
    )
    top_axes = ax  # the legend goes on the topmost axes, over the curves of both
    if trace.chunks and breakdown.items > 0:  # when results came back, on its own scale
        back = top_axes = ax.twinx()
        times = np.sort([c.received for c in trace.chunks])
        counts = np.cumsum([c.count for c in sorted(trace.chunks, key=lambda c: c.received)])
        back.step(
            np.r_[0.0, times, span],
            np.r_[0, counts, counts[-1]] / breakdown.items,
            where="post",
            color=_RECEIVED,
            linewidth=1,
            alpha=0.8,
        )
        back.set_ylim(0.0, 1.45 if wide else 2.2)
        back.set_yticks([0.0, 0.5, 1.0], ["0", "50%", "100%"], color=_RECEIVED)
        back.set_ylabel("results received", color=_RECEIVED)
    ax.axhline(
        breakdown.theoretical_rate,
        color="black",
        linestyle="--",
        linewidth=1,
        zorder=4,
        label=f"theoretical {per_second(breakdown.theoretical_rate)}",
    )
    ax.axhline(
        breakdown.rate,
        color="dimgrey",
        linestyle=":",
        linewidth=1.2,
        zorder=4,
        label=f"achieved average {per_second(breakdown.rate)}",
    )
    ax.set_xlim(0.0, span)
    top = max([breakdown.theoretical_rate, 10.0] + list(rates))
    ax.set_ylim(0.0, (1.45 if wide else 2.2) * top)  # headroom for the legend
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    ax.set_xlabel("seconds since submission (broker clock)")
    ax.set_ylabel("images/s")
    ax.grid(alpha=0.3)
    ax.set_axisbelow(True)
    top_axes.legend(
        *ax.get_legend_handles_labels(), loc="upper right", ncol=3 if wide else 1, fontsize="small"
    )


def _title(b: Breakdown, columns: int) -> str:
    """Headline and where the waste went, wrapped to about `columns` characters."""
    parts = ", ".join(f"{part} {_percent(getattr(b, part))}" for part, _ in _PARTS)
    lines = [
        f"{b.model}, policy {b.policy}: {plural(b.items, 'image')} in {b.seconds:.3f} s, "
        f"{per_second(b.rate)}, waste {b.waste:.1%}",
        f"where it went: {parts}",
    ]
    if b.cancelled:
        lines.insert(0, f"stopped early: {b.cancelled}")
    return "\n".join(wrapped for line in lines for wrapped in textwrap.wrap(line, columns))


def plot(trace: Trace, path: str | Path, width: int = 1200, height: int = 800) -> None:
    """Write a PNG of exactly width x height pixels: worker timeline over throughput."""
    b = analyse(trace)
    wide = width >= 900
    scale = min(max(min(width / 1200, height / 800), 0.7), 1.5)  # text size follows the figure
    with rc_context({"font.size": 10 * scale}):
        fig = Figure(figsize=(width / 100, height / 100), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        timeline, rates = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1))
        _draw_timeline(timeline, trace, wide)
        _draw_throughput(rates, trace, b, wide)
        fig.suptitle(_title(b, columns=int(width / (12 * scale))))
        fig.savefig(path, dpi=100, format="png")
