"""Bubbles over an interval (``report --interval``, the server's ``/metrics``): the whole
window equals the report's steady-state figures, classes add up, the time before and after
the run is ``no_work``, the pipeline's fill and drain are what the summary says they are,
and the server's trimmed window gives the same figures as the full log (on simulated runs,
``tests/sim_runs.py``)."""

from __future__ import annotations

import pytest
import sim_runs

from sarathi_pp.report.bubbles import BUBBLE_CLASSES, BUSY, FILL_DRAIN, analyze, run_span
from sarathi_pp.report.interval import format_interval, interval_bubbles, parse_interval
from sarathi_pp.report.log import parse_log
from sarathi_pp.serve.bubble_window import BubbleWindow
from sarathi_pp.sim.executor import Overheads


@pytest.fixture(scope="module")
def records(sim_model_dir, tmp_path_factory) -> list[dict]:
    """PP=3, a mixed load whose arrivals pause for 0.5 s after 15 requests (the engine runs
    out of work, then fills the pipeline again), the runtime's overheads and sends."""
    d = sim_runs.run(
        tmp_path_factory.mktemp("interval") / "run", sim_model_dir,
        sim_runs.mixed_requests(30, seed=1, pause=(15, 0.5)), sim_runs.mixed_compute_s,
        num_stages=3, send_s=0.002, chunk_size=256,
        overheads=Overheads(driver_s=0.002, dispatch_s=0.001, handoff_s=0.001),
    )  # fmt: skip
    return sim_runs.events(d)


def test_the_steady_window_equals_the_report(records):
    log = parse_log(records, "sim")
    a = analyze(log)
    ib = interval_bubbles(log, a.window.start, a.window.end)
    for s, stage in enumerate(a.stages):
        f = ib.fractions[s]
        assert f[BUSY] == pytest.approx(stage.busy_s / stage.window_s, abs=1e-12)
        for c in BUBBLE_CLASSES:
            assert f[c] == pytest.approx(stage.bubbles_s[c] / stage.window_s, abs=1e-12), c
        assert sum(f.values()) == pytest.approx(1.0, abs=1e-12)
    # the scheduler's gaps are in the window: for want of work, for the load, for tokens
    assert all(ib.fractions[0][c] > 0 for c in ("no_work", "load", "in_flight"))


def one_prefill_each(tmp_path, sim_model_dir, compute_s: float, at: float = 0.0) -> list[dict]:
    """Four one-prompt micro-batches (requests arriving at ``at``) through two stages."""
    reqs = sim_runs.requests([128] * 4, 1, [at] * 4)
    d = sim_runs.run(tmp_path / "run", sim_model_dir, reqs, sim_runs.constant_s(compute_s),
                     chunk_size=128)  # fmt: skip
    return sim_runs.events(d)


def test_time_before_the_run_is_no_work(sim_model_dir, tmp_path):
    records = one_prefill_each(tmp_path, sim_model_dir, 0.01, at=5.0)
    log = parse_log(records, "sim")
    assert log.issues[0].t == 5.0 and log.num_microbatches == 4
    ib = interval_bubbles(log, 0.0, 10.0)
    assert ib.fractions[0]["no_work"] >= 0.5  # [0, 5): nothing had run yet
    assert sum(ib.fractions[1].values()) == pytest.approx(1.0)


def test_time_after_the_run_is_no_work(sim_model_dir, tmp_path):
    log = parse_log(one_prefill_each(tmp_path, sim_model_dir, 0.5), "sim")
    _, run_end = run_span(log)
    after = interval_bubbles(log, run_end + 5.0, run_end + 10.0)
    for f in after.fractions:  # long after the run: the engine ran nothing, needed nothing
        assert f["no_work"] == pytest.approx(1.0) and f[BUSY] == 0.0
    half = interval_bubbles(log, run_end - 1.0, run_end + 1.0)
    assert half.fractions[0]["no_work"] >= 0.5  # the second after the run
    assert sum(half.fractions[1].values()) == pytest.approx(1.0)


def test_fill_and_drain_are_the_summary_s_not_pb1(sim_model_dir, tmp_path):
    """Stage 1 waiting for its first micro-batch is the pipeline filling: ``report
    --interval`` says ``fill`` there, and over the whole run its fill, drain and classes
    are the summary's; the server's view (no ``fill_drain``) keeps the classes."""
    d = sim_runs.run(tmp_path / "run", sim_model_dir, sim_runs.requests([256] * 3, 6),
                     sim_runs.mixed_compute_s, send_s=0.002, chunk_size=256,
                     overheads=Overheads(handoff_s=0.001))  # fmt: skip
    log = parse_log(sim_runs.events(d), "sim")
    assert log.stages[0][0].kind == "prefill" and log.stages[0][-1].kind == "decode"
    a = analyze(log)
    run_start, run_end = a.run_start, a.run_end
    first = log.stages[1][0].compute_start
    head = interval_bubbles(log, run_start, first, fill_drain=True).fractions[1]
    assert head["fill"] == pytest.approx(1.0) and head["PB1"] == 0.0
    plain = interval_bubbles(log, run_start, first).fractions[1]
    assert "fill" not in plain and plain[BUSY] == 0.0  # the class stage_segments gives it
    whole = interval_bubbles(log, run_start, run_end, fill_drain=True)
    span = run_end - run_start
    for s, stage in enumerate(a.stages):
        f = whole.fractions[s]
        assert f["fill"] * span == pytest.approx(stage.fill_s, abs=1e-12)
        assert f["drain"] * span == pytest.approx(stage.drain_s, abs=1e-12)
        for c in BUBBLE_CLASSES:
            assert f[c] * span == pytest.approx(stage.bubbles_s[c], abs=1e-12), (s, c)
        assert sum(f.values()) == pytest.approx(1.0, abs=1e-12)
    # stage 1 waits for stage 0's first micro-batch; stage 0 for stage 1's last
    assert whole.fractions[1]["fill"] > 0 and whole.fractions[0]["drain"] > 0
    table = format_interval("run", whole)
    head_line = table.splitlines()[1].split()
    assert head_line == ["stage", "bubble", *BUBBLE_CLASSES, *FILL_DRAIN]  # none run together
    assert "fill / drain: idle before / after" in table
    assert "fill" not in format_interval("run", interval_bubbles(log, run_start, run_end))


def test_trimmed_window_equals_the_full_log(records):
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
