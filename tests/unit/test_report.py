"""farm.client.report: the waste breakdown of a job trace, its text, its figure, and trace
validation."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import msgspec
import numpy as np
import pytest
from msgspec.structs import replace

from farm.client.report import (
    TRACE_FORMAT,
    Trace,
    TraceError,
    analyse,
    load_trace,
    plot,
    throughput,
)


def chunk(
    worker: str,
    assigned: float,
    sent: float,
    started: float,
    finished: float,
    received: float,
    count: int = 100,
    arrived: float | None = None,
) -> dict:
    """A chunk record; `arrived` left out (as in older traces) unless given."""
    record = {
        "worker": worker,
        "start": 0,
        "count": count,
        "attempt": 1,
        "assigned": assigned,
        "sent": sent,
        "started": started,
        "finished": finished,
        "received": received,
        "delivered": received + 0.001,
    }
    return record if arrived is None else {**record, "arrived": arrived}


def make_trace(
    rates: dict[str, float], chunks: list[dict], seconds: float, items: int | None = None
) -> Trace:
    """A trace of these workers (name: standalone rate) and chunks, T = seconds."""
    workers = [
        {
            "name": name,
            "device": name.split("/")[-1],
            "items": sum(c["count"] for c in chunks if c["worker"] == name),
            "chunks": sum(c["worker"] == name for c in chunks),
            "compute_s": 1.0,
            "standalone_rate": rate,
        }
        for name, rate in rates.items()
    ]
    return msgspec.convert(
        {
            "format": TRACE_FORMAT,
            "job": "j1",
            "model": "lenet",
            "policy": "equal-finish",
            "items": sum(c["count"] for c in chunks) if items is None else items,
            "broker_seconds": seconds,
            "client_seconds": seconds + 0.1,
            "workers": workers,
            "chunks": chunks,
            "failed": [],
        },
        Trace,
    )


def as_json(trace: Trace, **changes: object) -> str:
    """The trace as its file holds it, with ``changes`` to its fields."""
    return json.dumps({**msgspec.to_builtins(trace), **changes})


def parts(breakdown) -> tuple[float, ...]:
    return breakdown.start, breakdown.barrier, breakdown.messaging, breakdown.tail


def known_trace() -> Trace:
    """Worker a (100/s): idle 2 s at start, a 3 s gap (1.5 barrier), 1 s tail; b (50/s) busy."""
    return make_trace(
        {"h:1/cpu:0": 100.0, "h:2/cpu:1": 50.0},
        [
            chunk(
                "h:1/cpu:0", 6.0, 6.5, 7.0, 9.0, 9.2, count=200
            ),  # arrival order, not start order
            chunk("h:1/cpu:0", 0.5, 1.0, 2.0, 4.0, 4.5, count=200),
            chunk("h:2/cpu:1", 0.0, 0.0, 0.0, 10.0, 10.0, count=490),
        ],
        seconds=10.0,
    )


def test_perfect_trace_has_no_waste() -> None:
    trace = make_trace(
        {"a/cpu:0": 100.0, "b/cpu:1": 50.0},
        [
            chunk("a/cpu:0", 0.0, 0.0, 0.0, 5.0, 5.0, count=500),
            chunk("a/cpu:0", 5.0, 5.0, 5.0, 10.0, 10.0, count=500),
            chunk("b/cpu:1", 0.0, 0.0, 0.0, 10.0, 10.0, count=500),
        ],
        seconds=10.0,
    )
    b = analyse(trace)
    assert b.rate == pytest.approx(150.0)
    assert b.theoretical_rate == pytest.approx(150.0)
    assert b.waste == pytest.approx(0.0, abs=1e-12)
    assert parts(b) == pytest.approx((0.0, 0.0, 0.0, 0.0), abs=1e-12)
    assert b.other == pytest.approx(0.0, abs=1e-12)


def test_known_idle_splits_into_hand_computed_parts() -> None:
    b = analyse(known_trace())
    capacity = 150.0 * 10.0  # images both workers could have done in T
    assert b.items == 890 and b.seconds == 10.0
    assert b.waste == pytest.approx((capacity - 890) / capacity)
    # gap 4..7 on a: result back at 4.5, next chunk assigned at 6 -> 1.5 s barrier, 1.5 messaging
    assert parts(b) == pytest.approx(
        (100 * 2.0 / capacity, 100 * 1.5 / capacity, 100 * 1.5 / capacity, 100 * 1.0 / capacity)
    )
    assert b.other == pytest.approx(10 / capacity)  # b ran 490 images, not the 500 its speed says
    assert b.start + b.barrier + b.messaging + b.tail + b.other == pytest.approx(b.waste)
    a = b.workers[0]
    assert (a.name, a.chunks, a.items) == ("h:1/cpu:0", 2, 400)
    assert (a.busy_s, a.idle_start_s, a.barrier_s, a.messaging_s, a.tail_s) == pytest.approx(
        (4.0, 2.0, 1.5, 1.5, 1.0)
    )


def test_next_chunk_assigned_before_result_back_is_all_messaging() -> None:
    trace = make_trace(
        {"a/cpu:0": 10.0},
        [
            chunk("a/cpu:0", 0.0, 0.0, 0.0, 4.0, 5.0),
            chunk("a/cpu:0", 3.0, 5.5, 6.0, 10.0, 10.0),  # prefetched: assigned while a computed
        ],
        seconds=10.0,
        items=80,
    )
    b = analyse(trace)
    assert (b.barrier, b.messaging) == pytest.approx((0.0, 0.2))
    assert b.waste == pytest.approx(0.2) and b.other == pytest.approx(0.0, abs=1e-12)


def test_overlapping_chunks_idle_workers_and_unlisted_workers() -> None:
    trace = make_trace(
        {"a/cpu:0": 10.0, "idle/cuda:0": 30.0},
        [
            chunk("a/cpu:0", 0.0, 0.0, 0.0, 6.0, 6.0),
            chunk("a/cpu:0", 0.0, 0.0, 4.0, 8.0, 8.0),  # overlaps the first: busy 0..8
            chunk("ghost/cpu:0", 0.0, 0.0, 1.0, 2.0, 2.0, count=5),
        ],
        seconds=10.0,
        items=80,
    )
    b = analyse(trace)
    lines = {w.name: w for w in b.workers}
    assert [w.name for w in b.workers] == sorted(lines)
    assert lines["a/cpu:0"].busy_s == pytest.approx(8.0)
    assert lines["idle/cuda:0"].idle_start_s == pytest.approx(10.0)  # ran nothing: all start
    ghost = lines["ghost/cpu:0"]  # not in "workers": items from its chunks, no speed
    assert (ghost.items, ghost.chunks, ghost.standalone_rate) == (5, 1, 0.0)
    assert b.theoretical_rate == pytest.approx(40.0)
    assert b.start == pytest.approx(30 * 10.0 / 400)
    assert b.tail == pytest.approx(10 * 2.0 / 400)
    assert b.start + b.barrier + b.messaging + b.tail + b.other == pytest.approx(b.waste)


def test_empty_trace_divides_by_nothing() -> None:
    b = analyse(make_trace({}, [], seconds=0.0))
    assert (b.rate, b.theoretical_rate, b.waste, b.other) == (0.0, 0.0, 0.0, 0.0)
    assert "waste 0.0%" in b.format()


def test_format_names_waste_and_every_worker() -> None:
    b = analyse(known_trace())
    text = b.format()
    assert f"waste {b.waste:.1%}" in text
    for name in ("h:1/cpu:0", "h:2/cpu:1"):
        assert name in text
    for part in ("start", "barrier", "messaging", "tail", "other"):
        assert part in text
    assert "equal-finish" in text and "890 images" in text
    assert "stopped early" not in text


def test_format_table_reads_naturally_and_stays_aligned() -> None:
    long = "rack-12.example.org:123456/cpu:63"
    trace = make_trace(
        {long: 10000.0, "a/cpu:0": 10000.0},
        [
            chunk(long, 0.0, 0.0, 0.0, 3.0, 3.0, count=29482),
            chunk("a/cpu:0", 0.0, 0.0, 0.0, 3.0, 3.0, count=1234567),
        ],
        seconds=3.0,
    )
    lines = analyse(trace).format().splitlines()
    header = next(line for line in lines if line.lstrip().startswith("worker"))
    assert header.split() == [
        "worker",
        "images",
        "chunks",
        "busy",
        "device",
        "idle:",
        "start",
        "barrier",
        "messaging",
        "tail",
        "(s)",
    ]
    rows = lines[lines.index(header) + 1 :]
    assert [row.split()[:2] for row in rows] == [["a/cpu:0", "1,234,567"], [long, "29,482"]]
    assert len({len(line) for line in [header] + rows}) == 1  # every column lines up
    for title in ("images", "busy", "start", "tail (s)"):  # numbers end under their header
        end = header.index(title) + len(title)
        assert all(row[end - 1] != " " and row[end : end + 1] in ("", " ") for row in rows)


def test_cancelled_job_says_it_stopped_early(tmp_path: Path) -> None:
    trace = replace(known_trace(), cancelled="interrupted by the user")
    assert (
        analyse(trace).format().splitlines()[0].endswith(", stopped early: interrupted by the user")
    )
    assert "stopped early" not in analyse(replace(known_trace(), cancelled=None)).format()
    assert load_trace(write(tmp_path, as_json(trace))) == trace
    plot(trace, tmp_path / "run.png", 640, 480)
    assert png_size(tmp_path / "run.png") == (640, 480)


def test_throughput_is_the_compute_rate_of_all_workers() -> None:
    trace = make_trace(
        {"a/cpu:0": 1000.0, "b/cpu:1": 1000.0},
        [
            chunk("a/cpu:0", 0.0, 0.0, 0.0, 1.0, 1.4, count=1000),
            chunk("b/cpu:1", 0.0, 0.0, 0.0, 1.0, 1.1, count=1000),
        ],
        seconds=2.0,
    )
    edges, rates = throughput(trace, 20)
    assert edges[0] == 0.0 and edges[-1] == pytest.approx(2.0) and len(rates) == 20
    inside = edges[1:] <= 1.0 + 1e-9
    assert rates[inside] == pytest.approx(np.full(inside.sum(), 2000.0))
    assert rates[~inside] == pytest.approx(np.zeros((~inside).sum()))
    assert np.sum(rates * np.diff(edges)) == pytest.approx(2000.0)  # every image counted once


def test_throughput_splits_a_chunk_by_its_exact_overlap_with_each_bin() -> None:
    trace = make_trace(
        {"a/cpu:0": 100.0},
        [
            chunk("a/cpu:0", 0.0, 0.0, 0.5, 2.5, 2.5, count=200),  # 100 images/s over [0.5, 2.5]
            chunk("a/cpu:0", 0.0, 0.0, 2.7, 2.7, 2.8, count=30),  # took no time: all in its bin
        ],
        seconds=3.0,
    )
    edges, rates = throughput(trace, [0.0, 1.0, 2.0, 3.0])
    assert list(edges) == [0.0, 1.0, 2.0, 3.0]
    assert rates == pytest.approx([50.0, 100.0, 50.0 + 30.0])
    with pytest.raises(ValueError):
        throughput(trace, [1.0, 1.0])
    empty_edges, empty_rates = throughput(make_trace({}, [], seconds=0.0), 5)
    assert len(empty_edges) == 6 and not empty_rates.any()


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("size", [(640, 480), (1200, 800)])
def test_plot_writes_png_of_requested_size(tmp_path: Path, size: tuple[int, int]) -> None:
    path = tmp_path / "run.png"
    plot(known_trace(), path, width=size[0], height=size[1])
    assert png_size(path) == size


def test_plot_many_workers_and_empty_trace(tmp_path: Path) -> None:
    names = [f"vm{i // 8}:{100 + i}/cpu:{i % 8}" for i in range(64)]
    chunks = [
        chunk(n, k * 0.1, k * 0.1, k * 0.1 + 0.01, k * 0.1 + 0.09, k * 0.1 + 0.1)
        for n in names
        for k in range(3)
    ]
    plot(make_trace(dict.fromkeys(names, 1000.0), chunks, 0.3), tmp_path / "many.png")
    assert png_size(tmp_path / "many.png") == (1200, 800)
    plot(make_trace({}, [], 0.0), tmp_path / "empty.png", 800, 600)
    assert png_size(tmp_path / "empty.png") == (800, 600)


def write(tmp_path: Path, content: str) -> Path:
    path = tmp_path / "run.json"
    path.write_text(content)
    return path


def test_load_trace_round_trip(tmp_path: Path) -> None:
    trace = known_trace()
    assert load_trace(write(tmp_path, as_json(trace))) == trace


def test_arrived_is_optional(tmp_path: Path) -> None:
    old = known_trace()  # no chunk has "arrived": an older trace
    assert all(c.arrived is None for c in old.chunks) and '"arrived"' not in as_json(old)
    assert load_trace(write(tmp_path, as_json(old))) == old
    new = make_trace(
        {"a/cpu:0": 100.0},
        [
            chunk("a/cpu:0", 0.0, 0.0, 0.0, 1.0, 1.1, arrived=0.05),
            chunk("a/cpu:0", 0.0, 0.1, 1.0, 2.0, 2.1, arrived=0.3),  # queued behind the first
        ],
        seconds=2.1,
    )
    assert load_trace(write(tmp_path, as_json(new))) == new
    assert analyse(new) == analyse(
        replace(new, chunks=[replace(c, arrived=None) for c in new.chunks])
    )
    for trace in (old, new):
        plot(trace, tmp_path / "run.png", 640, 480)
        assert png_size(tmp_path / "run.png") == (640, 480)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot read"),
        ("{not json", "not a farm trace (JSON is malformed"),
        ("[1, 2]", "Expected `object`, got `array`"),
        (as_json(known_trace(), format="farm-trace/0"), "Invalid enum value 'farm-trace/0'"),
        (as_json(known_trace(), chunks={}), "got `object` - at `$.chunks`"),
        (as_json(known_trace(), broker_seconds="1.0"), "got `str` - at `$.broker_seconds`"),
        (
            as_json(known_trace(), chunks=[{"worker": "a", "count": 1}]),
            "missing required field `start` - at `$.chunks[0]`",
        ),
        (
            as_json(known_trace(), chunks=[chunk("a", 0, 0, 1, 2, 3, arrived="soon")]),
            "got `str` - at `$.chunks[0].arrived`",
        ),
        (
            as_json(known_trace(), chunks=[chunk("a", 0, 0, 1, 2, 3, arrived=math.nan)]),
            "JSON is malformed",
        ),  # NaN is no JSON number
        (as_json(known_trace(), cancelled=1), "got `int` - at `$.cancelled`"),
    ],
)
def test_load_trace_rejects_bad_files(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "missing.json" if content is None else write(tmp_path, content)
    with pytest.raises(TraceError) as error:
        load_trace(path)
    assert str(path) in str(error.value) and message in str(error.value)


def test_device_share_sums_the_device_seconds_workers_report() -> None:
    gpu, cpu = "h/gpu:0", "h/cpu:0"
    chunks = [
        {**chunk(gpu, 0.0, 0.0, 0.1, 1.0, 1.0), "device": 0.8, "copy": 0.1},
        {**chunk(gpu, 1.0, 1.0, 1.0, 2.0, 2.0), "device": 0.9, "copy": 0.1},
        chunk(cpu, 0.0, 0.0, 0.0, 2.0, 2.0),
    ]  # an older worker reports no device time
    lines = {
        line.name: line
        for line in analyse(make_trace({gpu: 100.0, cpu: 50.0}, chunks, seconds=2.0)).workers
    }
    assert lines[gpu].device_s == pytest.approx(1.7) and lines[gpu].copy_s == pytest.approx(0.2)
    assert lines[gpu].device_share(2.0) == pytest.approx(0.85)
    assert lines[cpu].device_s is None and lines[cpu].device_share(2.0) is None
    rows = {
        row.split()[0]: row.split()
        for row in analyse(make_trace({gpu: 100.0, cpu: 50.0}, chunks, seconds=2.0))
        .format()
        .splitlines()
        if row.strip().startswith("h/")
    }
    assert rows[gpu][4] == "85.0%" and rows[cpu][4] == "-"


def test_the_tail_runs_from_the_first_workers_last_result_to_the_end() -> None:
    chunks = [
        chunk("h/a", 0.0, 0.0, 0.1, 1.0, 1.1),
        chunk("h/a", 1.1, 1.1, 1.2, 2.0, 2.2),  # a's last result: 2.2
        chunk("h/b", 0.0, 0.0, 0.1, 3.0, 3.4),  # b runs on to the end
    ]
    breakdown = analyse(make_trace({"h/a": 100.0, "h/b": 100.0}, chunks, 4.0))
    assert breakdown.tail_seconds == pytest.approx(4.0 - 2.2)
    assert breakdown.tail_share == pytest.approx(1.8 / 4.0)
    assert "tail 1.800 s (45.0% of the span)" in breakdown.format()
