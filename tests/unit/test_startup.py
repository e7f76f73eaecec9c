"""Start-up timelines: process start times from /proc, stages in order."""

from __future__ import annotations

import subprocess
import sys
import time

from farm.startup import Timeline, breakdown, process_started


def test_a_process_start_time_is_read_to_the_kernel_tick() -> None:
    before = time.time()
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    after = time.time()
    try:
        started = process_started(child.pid)
    finally:
        child.communicate(b"")
    tick = 0.011  # /proc counts in 10 ms ticks
    assert before - tick <= started <= after + tick


def test_stages_print_in_time_order_with_the_gap_since_the_previous() -> None:
    mine = Timeline({"process": 100.0, "imported": 100.25})
    worker = Timeline({"process": 100.3, "loaded": 100.9})
    rows = mine.rows(100.0) + worker.rows(100.0, "worker cpu:0")
    lines = breakdown(rows)
    assert [line.split(")")[-1].strip() for line in lines] == [
        "process",
        "imported",
        "worker cpu:0: process",
        "worker cpu:0: loaded",
    ]
    assert lines[2].split() == ["0.300", "s", "(+0.050)", "worker", "cpu:0:", "process"]
    assert lines[3].split()[:3] == ["0.900", "s", "(+0.600)"]
