"""bench/policies.py, run as a script: its table, CSV and chart."""

from __future__ import annotations

import subprocess
import sys

from tests.unit.test_simulator import ROOT, run  # noqa


def test_the_policy_bench_writes_its_table_csv_and_chart(tmp_path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "policies.py"),
            "--out",
            str(tmp_path),
            "--total",
            "20000",
            "--quick",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "equal-finish against fast-split" in done.stdout
    (csv_file,) = tmp_path.glob("*-policies-sim.csv")
    (png_file,) = tmp_path.glob("*-policies-sim.png")
    rows = csv_file.read_text().splitlines()
    assert rows[0].startswith("scenario,policy,parameter,value,images_per_s")
    assert sum(",fast-split," in row for row in rows) >= 8  # 4 ratios x 2 data sets, at least
    assert png_file.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
