"""A real benchmark run lands in the results file: ``benchmarks/linear_rows.py --quick`` (a
few seconds) appends one record, its command line as run and a figure per weight and row
count, to the file ``SARATHI_PP_RESULTS_FILE`` names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_linear_rows_quick_appends_a_record(tmp_path: Path):
    path = tmp_path / "results.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SARATHI_PP_RESULTS_FILE": str(path)}
    env.pop("SARATHI_PP_NO_RECORD", None)  # tests/conftest.py sets it
    cmd = [sys.executable, "benchmarks/linear_rows.py", "--quick", "--threads", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = path.read_text().splitlines()
    record = json.loads(line)
    assert record["benchmark"] == "linear_rows" and record["quick"] is True
    assert record["command"] == "python benchmarks/linear_rows.py --quick --threads 1"
    assert record["machine"]["torch_threads"] == 1
    names = [m["name"] for m in record["measures"]]
    assert len(names) == 4 * 3  # 4 weights x rows 1, 8, 64
    assert names[0] == "qkv 1536x1024, 1 rows: best kind"
    for m in record["measures"]:
        assert m["unit"] == "ms" and m["value"] > 0
        assert m["ratio"] == pytest.approx(m["value"] / m["baseline"], rel=1e-4)
    # --no-record: nothing more
    subprocess.run([*cmd, "--no-record"], cwd=ROOT, env=env, check=True, capture_output=True,
                   timeout=300)  # fmt: skip
    assert len(path.read_text().splitlines()) == 1
