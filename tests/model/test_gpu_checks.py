"""tests/gpu/run_checks.sh in its CPU smoke mode: its environment report, the GPU tests
(skipped here, each with its reason) and every figure of benchmarks/gpu_checks.py on tiny
shapes, so the GPU check cannot rot on machines without one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sarathi_pp.stages.kernels.cpu import paged_attention

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the real check runs instead")
def test_run_checks_smoke_mode():
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", "tests/gpu/run_checks.sh", "--smoke"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    for section in ("== environment", "== GPU tests", "== figures", "== done (exit 0)"):
        assert section in out
    assert "SKIPPED" in out and "needs a CUDA device" in out  # each skip with its reason
    for figure in (
        "matmul rate", "prefill MFU", "tile quantization", "piggyback (",
        "decode-only step", "CUDA graph: skipped (not on CUDA)", "control plane",
        "engine decode step (1 decodes): eager", "CUDA graphs: skipped (not on CUDA)",
        "profiled KV capacity: skipped (not on CUDA", "PP=1 bubble report (wall_clock)",
        "attention: cpu_paged, no fallback" if paged_attention.load_kernel() else "attention: torch",
        "end to end (mixed, 2 requests", "greedy agreement with transformers (float32): ",
    ):  # fmt: skip
        assert figure in out, figure
