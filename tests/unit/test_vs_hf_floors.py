"""``benchmarks/vs_hf.py``'s floors: each step is held to its own larger floor (compute or
bandwidth), and decode-only steps are grouped by size with the floor that binds each group."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from vs_hf import Step, StepTotals, larger_floor_s, print_decode_sizes, total  # noqa: E402

GFLOPS, GBPS = 1.0, 1.0  # 1e9 FLOP/s and 1e9 B/s: a floor in seconds = GFLOP or GB


def test_larger_floor_is_summed_step_by_step():
    # one step bound by bandwidth (3 s against 1 s), one by compute (4 s against 1 s)
    steps = [Step(5.0, 10**9, 3 * 10**9, 2, 100), Step(6.0, 4 * 10**9, 10**9, 30, 900)]
    assert larger_floor_s(steps, GFLOPS, GBPS) == pytest.approx(7.0)
    # the larger of the summed floors would be 5 s: it lets each step off its own bound
    assert larger_floor_s(steps[:1], GFLOPS, GBPS) == pytest.approx(3.0)


def test_totals_keep_every_step_by_kind():
    totals = StepTotals()
    totals.add("decode", Step(1.0, 10, 20, 4, 40))
    totals.add("decode", Step(2.0, 30, 40, 8, 80))
    totals.add("hybrid", Step(4.0, 50, 60, 3, 500))
    by_kind = totals.by_kind
    assert {kind: len(steps) for kind, steps in by_kind.items()} == {"decode": 2, "hybrid": 1}
    assert {kind: total(steps).seconds for kind, steps in by_kind.items()} == {
        "decode": 3.0,
        "hybrid": 4.0,
    }
    assert total(by_kind["decode"]).flops == 40 and total(by_kind["decode"]).nbytes == 60
    assert [s.num_decodes for s in by_kind["decode"]] == [4, 8]
    assert total(by_kind["decode"]) == Step(3.0, 40, 60, 12, 120)


def test_decode_sizes_name_the_floor_that_binds(capsys):
    steps = [
        Step(2.0, 10**9, 2 * 10**9, 1, 50),  # bandwidth-bound, 1 decode
        Step(2.0, 10**9, 2 * 10**9, 3, 150),  # bandwidth-bound, 3 decodes
        Step(9.0, 6 * 10**9, 3 * 10**9, 20, 2000),  # compute-bound, 20 decodes
    ]
    print_decode_sizes(steps, GFLOPS, GBPS, weight_bytes=4)
    rows = {ln.split()[0]: ln.split() for ln in capsys.readouterr().out.splitlines()[2:-1]}
    assert set(rows) == {"1-4", "17-32"}
    small, large = rows["1-4"], rows["17-32"]
    assert small[1] == "2" and small[-1] == "bandwidth"
    assert float(small[3]) == pytest.approx(2000.0)  # ms per step
    assert small[-3] == "1.00x" and small[-2] == "2.00x"  # against bandwidth, compute
    assert large[1] == "1" and large[-1] == "compute" and large[-2] == "1.50x"
    assert float(large[4]) == pytest.approx(100.0)  # context tokens per decode
