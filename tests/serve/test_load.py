"""The 20-second version of ``make serve-bench``: locust (headless, 4 users streaming) against
a live ``sarathi-pp serve`` subprocess on a small random model; the script exits 1 unless
the client's counts (requests, tokens) equal the server's ``/metrics`` and nothing failed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

# Never `import locust` here: it monkey-patches the whole process for gevent (sockets,
# threads, select) at import, and every later Ray or server test of the session then hangs.
if importlib.util.find_spec("locust") is None:
    pytest.skip("needs locust (the test extra): pip install locust", allow_module_level=True)

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
