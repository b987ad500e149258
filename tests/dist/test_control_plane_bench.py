"""``benchmarks/control_plane.py --quick`` (its short version): both Ray executors, the task
path also scheduling ahead (the token ring), run the same workload at PP=2 and the table has
each one's bubble figures (the window's, and before / after the last prefill, which add up to
it) and per-micro-batch costs, measured (numbers, not blanks)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_quick_control_plane_benchmark_measures_both_executors(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "control_plane.py"), "--quick",
         "--schedulers", "sarathi", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()
            if line.startswith("sarathi-")}  # fmt: skip
    assert set(rows) == {"sarathi-ray", "sarathi-ray+ahead", "sarathi-ray_compiled"}, proc.stdout
    for name, cells in rows.items():
        tokens_per_s, bubble = float(cells[1]), float(cells[2].rstrip("%"))
        dispatch, ret, driver, _, loop = (float(c) for c in cells[8:13])
        assert tokens_per_s > 0 and 0 <= bubble < 100, name
        # the bubble before and after the last prefill add up to the window's
        share = float(cells[7].rstrip("%")) / 100
        phases = [0.0 if c == "-" else float(c.rstrip("%")) for c in cells[5:7]]
        assert (1 - share) * phases[0] + share * phases[1] == pytest.approx(bubble, abs=0.2), name
        assert all(math.isfinite(v) and v > 0 for v in (dispatch, ret, driver, loop)), name
        assert (tmp_path / name / "summary.json").is_file()
