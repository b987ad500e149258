"""Bubbles over an interval (``report --interval``, the server's ``/metrics``): the whole
window equals the report's steady-state figures, classes add up, the time before the run is
``no_work``, and the server's trimmed window gives the same figures as the full log."""

from __future__ import annotations

import pytest

from sarathi_pp.report.bubbles import BUBBLE_CLASSES, BUSY, analyze
from sarathi_pp.report.interval import interval_bubbles, parse_interval
from sarathi_pp.report.log import parse_log
from sarathi_pp.report.synthetic import MB, SimConfig, mixed_compute_s, mixed_workload, simulate
from sarathi_pp.serve.bubble_window import BubbleWindow

CFG = SimConfig(
    num_stages=3,
    compute_s=mixed_compute_s,
    send_s=0.001,
    transfer_s=0.002,
    overhead_s=0.003,
    idle_before={5: ("dependency", 0.02), 40: ("no_work", 0.5), 41: ("dependency", 0.01)},
)


def _records() -> list[dict]:
    return simulate(mixed_workload(120, seed=1), CFG)


def test_the_steady_window_equals_the_report():
    log = parse_log(_records(), "synthetic")
    a = analyze(log)
    ib = interval_bubbles(log, a.window.start, a.window.end)
    for s, stage in enumerate(a.stages):
        f = ib.fractions[s]
        assert f[BUSY] == pytest.approx(stage.busy_s / stage.window_s, abs=1e-12)
        for c in BUBBLE_CLASSES:
            assert f[c] == pytest.approx(stage.bubbles_s[c] / stage.window_s, abs=1e-12), c
        assert sum(f.values()) == pytest.approx(1.0, abs=1e-12)
    assert any(ib.fractions[0][c] > 0 for c in ("dependency", "no_work"))


def test_time_before_the_run_is_no_work():
    records = simulate([MB("prefill", 8)] * 4, SimConfig(start_s=5.0))
    ib = interval_bubbles(parse_log(records, "synthetic"), 0.0, 10.0)
    assert ib.fractions[0]["no_work"] >= 0.5  # [0, 5): nothing had run yet
    assert sum(ib.fractions[1].values()) == pytest.approx(1.0)


def test_trimmed_window_equals_the_full_log():
    records = _records()
    full = parse_log(records, "full")
    t_end = max(r["send_end"] for r in records if r["type"] == "stage")
    window = BubbleWindow(3, t0=0.0, now=lambda: t_end)
    window._log.records = [records[0], *records[1:]]
    cutoff = t_end * 0.5
    window._trim(cutoff)
    kept = window._log.records
    assert len(kept) < len(records) / 1.5  # something was dropped
    lo = cutoff + 0.3 * (t_end - cutoff)  # a few micro-batches after the cut
    a = interval_bubbles(full, lo, t_end)
    b = interval_bubbles(parse_log(kept, "trimmed"), lo, t_end)
    for fa, fb in zip(a.fractions, b.fractions, strict=True):
        assert fa == pytest.approx(fb, abs=1e-12)


@pytest.mark.parametrize("text", ["3", "5:2", "a:b", "1:1", ":4"])
def test_bad_interval_is_a_clear_error(text):
    with pytest.raises(ValueError, match="--interval expects START:END"):
        parse_interval(text)
    assert parse_interval("1.5:4") == (1.5, 4.0)
