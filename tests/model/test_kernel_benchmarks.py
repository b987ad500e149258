"""The CPU kernels' benchmarks run end to end on small sizes and print every kind they
compare, so they cannot rot: ``benchmarks/linear_rows.py`` (each ``Linear`` kind per weight
and row count), ``benchmarks/paged_attention.py`` (gather + SDPA vs the in-place kernels,
decodes and a prefill chunk), ``benchmarks/piggyback.py`` (every step kind against its
floors, with the kernels it ran on) and ``benchmarks/vs_hf.py`` (our side of it: the step
kinds and the decode-only steps by size against their floors)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sarathi_pp.stages.kernels.cpu.fused import load_fused
from sarathi_pp.stages.kernels.cpu.paged_attention import load_kernel, load_prefill
from sarathi_pp.stages.model.linear import choose_kind

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_linear_rows_prints_every_kind():
    out = run("linear_rows.py", "--rows", "1,7", "--repeats", "1", "--threads", "1")
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] in (["gate_up"], ["down"])]
    assert [(r[0], r[1]) for r in rows] == [
        ("gate_up", "1"),
        ("gate_up", "7"),
        ("down", "1"),
        ("down", "7"),
    ]
    assert f"chosen: {choose_kind(torch.randn(1024, 1024))}" in out
    assert "f_linear ms" in out and all(float(r[2]) > 0 for r in rows)


@pytest.mark.skipif(load_kernel() is None, reason="no C compiler: the kernel cannot build")
def test_paged_attention_benchmark_compares_both_paths():
    out = run(
        "paged_attention.py", "--decodes", "2", "--context", "40", "--prefill", "24",
        "--repeats", "1",
    )  # fmt: skip
    assert "kernel threads:" in out and "torch " in out and "cpu_paged " in out
    assert out.count("in place / gather + SDPA:") == (2 if load_prefill() else 1)
    if load_prefill():
        assert "prefill chunk of 24 tokens at [40, 64)" in out and "GFLOP/s" in out
    else:
        assert "prefill: no in-place kernel on this CPU" in out


def test_piggyback_benchmark_prints_every_step_against_its_floors():
    """On the embedded model (built on first use), ``--quick``: ~15 s."""
    out = run("piggyback.py", "--quick", "--threads", "1")
    steps = [
        ln.split()[:2] for ln in out.splitlines() if ln.split()[:1] in (["decode"], ["hybrid"])
    ]
    assert [" ".join(s) for s in steps if len(s) == 2] == [
        "decode 1", "hybrid 1", "decode 4", "hybrid 4",
    ]  # fmt: skip
    fused = "cpu_fused" if load_fused() is not None else "torch"
    assert f"element-wise ops: {fused}" in out and "floors: matmul" in out


def test_vs_hf_prints_steps_and_decode_sizes_against_their_floors():
    """``--quick --skip-hf`` on the embedded model: ~25 s. The decode-only steps grouped by
    size add up to the decode row; each group names the floor that binds it."""
    out = run("vs_hf.py", "--quick", "--skip-hf", "--no-prefault", "--threads", "1")
    lines = out.splitlines()
    kinds = {ln.split()[0]: ln.split() for ln in lines if ln.split()[:1] in (["prefill"], ["hybrid"], ["decode"])}  # fmt: skip
    assert "decode" in kinds and float(kinds["decode"][-1].rstrip("x")) > 0
    start = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["decodes", "steps"])
    groups = []
    for ln in lines[start + 2 :]:
        if ln.strip().startswith("(machine balance"):
            break
        groups.append(ln.split())
    assert groups and all(g[-1] in ("compute", "bandwidth") for g in groups)
    assert sum(int(g[1]) for g in groups) == int(kinds["decode"][1])
    assert "decode-only steps:" in out and "compute-bound from about" in out
