"""``benchmarks/pipeline_scaling.py``'s ceiling: the least wall time a pipeline could take
with the stages' measured compute spans (fill and drain included, nothing else)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from pipeline_scaling import RunResult, ceiling_ratio, least_wall_s, phases  # noqa: E402


def spans(*lengths: float) -> list[tuple[float, float]]:
    """Back-to-back spans of these lengths (their placement does not matter)."""
    out, t = [], 0.0
    for n in lengths:
        out.append((t, t + n))
        t += n
    return out


def test_least_wall_is_the_busiest_stage_plus_its_fill_and_drain():
    # stage 0: 1 + 3 x 2 = 7; stage 1: 2 x 3 + 1 = 7. Stage 0's work then stage 1's last
    # micro-batch (1): 8; stage 0's first (1) then all of stage 1: 8.
    assert least_wall_s([spans(1, 2, 2, 2), spans(2, 2, 2, 1)]) == pytest.approx(8.0)
    # a slow middle stage: 1 (stage 0's first) + 10 + 0.5 (stage 2's last)
    three = [spans(1, 1, 1), spans(4, 3, 3), spans(2, 2, 0.5)]
    assert least_wall_s(three) == pytest.approx(11.5)
    assert least_wall_s([spans(3, 4)]) == pytest.approx(7.0)  # one stage: its compute


def test_ceiling_ratio_is_pp1_wall_over_the_least_pipelined_wall():
    base = RunResult("PP=1", wall_s=16.0)
    pp = RunResult("PP=2", wall_s=10.0)
    pp.stage_spans = [{"execute": spans(1, 2, 2, 2)}, {"execute": spans(2, 2, 2, 1)}]
    assert ceiling_ratio([base, pp]) == pytest.approx(2.0)  # 16 / 8, not 16 / 7 nor 16 / 10


def test_thread_cpu_delta_counts_new_threads_from_zero_and_sums_by_name():
    from pipeline_scaling import thread_cpu_delta

    before = {(1, 1): ("python", "python", 5.0), (1, 2): ("python", "worker", 1.0),
              (9, 9): ("gone", "gone", 3.0)}  # fmt: skip
    after = {(1, 1): ("python", "python", 7.5), (1, 2): ("python", "worker", 1.0),
             (1, 3): ("python", "worker", 0.5), (2, 2): ("ray::Stage", "ray::Stage", 4.0)}  # fmt: skip
    # a thread that ended is not in the second snapshot; an idle one drops out
    assert thread_cpu_delta(before, after) == {
        ("python", "python"): 2.5, ("python", "worker"): 0.5, ("ray::Stage", "ray::Stage"): 4.0
    }  # fmt: skip


def test_thread_cpu_sees_this_thread_work():
    import time

    from pipeline_scaling import thread_cpu, thread_cpu_delta

    before = thread_cpu()
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.3:  # 30 ticks of the kernel's 1/100 s
        pass
    delta = thread_cpu_delta(before, thread_cpu())
    assert max(delta.values()) >= 0.2, delta


def test_side_by_side_bound_is_two_runs_over_the_window():
    from pipeline_scaling import SideBySide

    base = RunResult("PP=1", wall_s=10.0)
    side = SideBySide(walls=[11.0, 10.5], window_s=11.0, compute_s=[10.9, 10.4], tokens=[[], []])
    assert side.ratio(base) == pytest.approx(20.0 / 11.0)


def test_cores_ratio_is_pp1_wall_over_the_pipelined_runs_busy_cpu_spread_over_the_cores():
    from pipeline_scaling import busy_core_s, cores_ratio

    base = RunResult("PP=1", wall_s=30.0)
    pp = RunResult("PP=2", wall_s=17.0)
    # every busy field counts (the kernel's irq time too); idle, iowait and steal do not
    pp.machine_cpu = {"user": 26.0, "nice": 0.5, "system": 2.5, "irq": 0.4, "softirq": 0.6,
                      "idle": 2.0, "iowait": 0.5, "steal": 1.5}  # fmt: skip
    assert busy_core_s(pp) == pytest.approx(30.0)
    assert cores_ratio([base, pp], cores=2) == pytest.approx(2.0)  # 30 / (30 / 2)
    assert cores_ratio([base, pp], cores=4) == pytest.approx(4.0)
    pp.machine_cpu["user"] += 10.0  # more work done in the same wall: a lower bound
    assert cores_ratio([base, pp], cores=2) == pytest.approx(1.5)


def test_phases_cut_where_the_last_prompt_micro_batch_leaves_the_last_stage():
    r = RunResult("PP=2", wall_s=10.0, window=(100.0, 110.0))
    r.microbatches = [("prefill", 256), ("hybrid", 256), ("decode", 8), ("hybrid", 250)]
    r.microbatches += [("decode", 8), ("decode", 4)]
    first = {"execute": [(100.0, 101.0), (101.0, 102.0), (102.0, 102.1), (102.1, 103.0)]}
    last = {"execute": [(101.0, 102.0), (102.0, 103.0), (103.0, 103.2), (103.2, 104.5)]}
    r.stage_spans = [first, last]
    assert phases(r) == pytest.approx((4.5, 5.5))  # the 4th (a hybrid) ends at 104.5
    r.microbatches = [("decode", 8)] * 6  # no micro-batch holds prompt tokens: no cut
    assert phases(r) == (10.0, 0.0)
