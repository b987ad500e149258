"""The 20-second version of ``make serve-bench``: locust (headless, 4 users streaming) against
a live ``sarathi-pp serve`` subprocess on a small random model; the script exits 1 unless
the client's counts (requests, tokens) equal the server's ``/metrics`` and nothing failed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("locust")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_load_run_agrees_with_the_server_metrics():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--quick"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "[ok] server finished (all by length) == client completed" in out
    completed = int(out.split("client (locust): ")[1].split()[0])
    assert completed > 0
