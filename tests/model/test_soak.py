"""The soak benchmark's short version (``benchmarks/soak.py --quick``: 150 requests with
Poisson arrivals, aborts, poisoned requests and frequent preemption): every check passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_soak_passes_every_check():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--quick"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "FAIL" not in proc.stdout and proc.stdout.count("  ok ") == 6
    assert " preemptions" in proc.stdout and " 0 preemptions" not in proc.stdout
