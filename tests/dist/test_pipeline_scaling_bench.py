"""``benchmarks/pipeline_scaling.py --quick --repeat 2`` (its short version): PP=1 and PP=2
alternated twice on the embedded model, every pair's outputs as requested and identical,
and the summary line names both pairs' ratios with their median and range; each pair's
ratio is under its ceiling (PP=1's wall over the least time PP=2's compute allows). With
``--side-by-side``, two PP=1 engines in two processes after each pair: their outputs equal
PP=1's and the two-core bound is printed for each pair; the CPU table accounts for the
machine's time over each run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_quick_pipeline_scaling_alternates_the_pairs():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pipeline_scaling.py"), "--quick",
         "--repeat", "2", "--side-by-side"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    found = re.findall(
        r"^pair \d/2: .*: ([0-9.]+)x \(ceiling ([0-9.]+)x, cores ([0-9.]+)x\); "
        r"steal [0-9.]+ / [0-9.]+ s$",
        out,
        re.M,
    )
    pairs = [float(r) for r, _, _ in found]
    assert len(pairs) == 2 and all(r > 0 for r in pairs), out
    # no run beats the least wall its own compute spans allow (fill and drain included)
    assert all(float(r) <= float(c) for r, c, _ in found), out
    # nor the least time its machine's busy CPU seconds take on the cores (1/100 s ticks)
    assert all(float(r) <= float(k) * 1.05 for r, _, k in found), out
    bound = re.search(
        r"^the cores' bound .*: PP=2's ([0-9.]+) busy core-s need ([0-9.]+) s on (\d+) cores at "
        r"the least, whatever the schedule: ([0-9.]+)x",
        out,
        re.M,
    )
    assert bound, out
    busy, least, cores, _ = map(float, bound.groups())
    assert least == pytest.approx(busy / cores, abs=0.01), out
    checks = re.findall(
        r"^outputs: lengths as requested in 2/2 runs; (\d+)/(\d+) requests identical", out, re.M
    )
    assert len(checks) == 2 and all(a == b for a, b in checks), out
    summary = re.search(
        r"over 2 alternated pairs: median ([0-9.]+)x, range ([0-9.]+)-([0-9.]+)x", out
    )
    assert summary, out
    median, low, high = map(float, summary.groups())
    assert low == min(pairs) and high == max(pairs) and low <= median <= high, out
    sides = re.findall(
        r"^2 x PP=1 side by side: .*: ([0-9.]+)x PP=1's throughput .*; outputs (.*)$", out, re.M
    )
    assert len(sides) == 2, out
    assert all(float(b) > 0 and same == "identical to PP=1's" for b, same in sides), out
    assert re.search(r"^two-core bound over 2 runs: median [0-9.]+x", out, re.M), out
    # the last pair's two phases add up to each run's wall (the throughput table's)
    walls = dict(
        re.findall(r"^(PP=[12]) +[0-9+]+ +[0-9+-]+ +([0-9.]+) +[0-9.]+ +[0-9.]+$", out, re.M)
    )
    ph = re.search(
        r"^phases: prompts PP=1 ([0-9.]+) s, PP=2 ([0-9.]+) s \([0-9.]+x\); decode-only tail "
        r"PP=1 ([0-9.]+) s \((\d+) decodes\), PP=2 ([0-9.]+) s \((\d+) decodes\)",
        out,
        re.M,
    )
    assert ph and set(walls) == {"PP=1", "PP=2"}, out
    p1, p2, t1, _, t2, _ = map(float, ph.groups())
    assert p1 + t1 == pytest.approx(float(walls["PP=1"]), abs=0.02), out
    assert p2 + t2 == pytest.approx(float(walls["PP=2"]), abs=0.02), out
    assert t1 > 0 and t2 > 0, out  # short.yaml's prompts end before its decodes do
    # every run's CPU accounting: the stages' compute is part of the machine's busy time
    table = out[out.index("\ncpu s ") :].splitlines()[2:4]
    cpu = [
        re.match(r"(PP=[12]) +([0-9.]+) +([0-9.]+) +([0-9.]+) ", line).groups() for line in table
    ]
    assert [name for name, *_ in cpu] == ["PP=1", "PP=2"], out
    assert all(0 < float(compute) <= float(busy) + 0.05 for _, _, busy, compute in cpu), out
