"""What timeline.png draws, as values: fill and drain apart from the classes, a legend of
what occurs, bubble colours apart from the micro-batch kinds' (on hand-made logs and
simulated runs, ``tests/sim_runs.py``)."""

from __future__ import annotations

import pytest
import sim_runs
from matplotlib.colors import to_rgb
from test_bubbles import header, st

from sarathi_pp.report.bubbles import BUBBLE_CLASSES, analyze
from sarathi_pp.report.log import IDLE_REASONS, parse_log
from sarathi_pp.report.timeline import (
    CLASS_COLORS,
    KIND_COLORS,
    bubble_bars,
    draw_timeline,
    legend_entries,
)
from sarathi_pp.sim.executor import Overheads


def three_prefills() -> list[dict]:
    """PP=2, three prefills of 1 s each: stage 1 waits [0, 1] for the first (the pipeline
    filling), stage 0 sits [3, 4] while stage 1 ends (draining)."""
    records = [header(2)]
    for j in range(3):
        records.append(st(0, j, "prefill", j, j + 1.0))
        records.append(st(1, j, "prefill", j + 1.0, j + 2.0))
    return records


def test_fill_and_drain_are_not_drawn_as_pb1():
    log = parse_log(three_prefills(), "x")
    a = analyze(log)
    assert a.window.steady_state and (a.window.start, a.window.end) == (1.0, 3.0)
    assert a.stages[1].bubbles_s["PB1"] == 0  # what the summary says
    assert bubble_bars(a, 1) == [(0.0, 1.0, "fill")]
    assert bubble_bars(a, 0) == [(3.0, 4.0, "drain")]
    labels = [label for label, _ in legend_entries(log, a)]
    assert labels == ["prefill micro-batch", "fill / drain (idle outside the window)"]


def test_legend_lists_what_is_drawn(sim_model_dir, tmp_path):
    # a mixed load with a pause in the arrivals (the scheduler idles for want of work, and
    # for tokens in flight), the runtime's overheads, sends and the tokens' return
    reqs = sim_runs.mixed_requests(10, seed=1, pause=(5, 0.5))
    d = sim_runs.run(
        tmp_path / "run", sim_model_dir, reqs,
        sim_runs.mixed_compute_s, send_s=3e-4, return_s=1e-3, chunk_size=256,
        overheads=Overheads(driver_s=3e-4, dispatch_s=2e-4, handoff_s=2e-4),
    )  # fmt: skip
    log = parse_log(sim_runs.events(d), "x")
    a = analyze(log)
    entries = legend_entries(log, a)
    drawn = {label for s in range(2) for *_, label in bubble_bars(a, s)}
    in_window = {c for b in a.stages for c, v in b.bubbles_s.items() if v > 0}
    assert in_window <= drawn
    shown = {key for _, key in entries}
    assert {c for c in BUBBLE_CLASSES if c in drawn} <= shown
    assert not {c for c in BUBBLE_CLASSES if c not in drawn} & shown  # none that never occurs
    # the scheduler's idle reasons that occur, and only those (a real engine always has
    # tokens in flight to wait for: dependency; no stage was lost: never recovery)
    reasons = {i.reason for i in log.idles if i.end > i.start}
    assert reasons == {"no_work", "dependency"}
    assert {k for k in shown if k.startswith("idle:")} == {f"idle:{r}" for r in reasons}
    assert "idle:recovery" not in shown and "recovery" in IDLE_REASONS
    assert {k for k in KIND_COLORS if k in shown} == {e.kind for e in log.stages[0]}
    assert {e.kind for e in log.stages[0]} == {"prefill", "decode", "hybrid"}


def _distance(a: str, b: str) -> float:
    return sum((x - y) ** 2 for x, y in zip(to_rgb(a), to_rgb(b), strict=True)) ** 0.5


def test_colours():
    assert set(CLASS_COLORS) == set(BUBBLE_CLASSES)
    for c, colour in CLASS_COLORS.items():
        for kind, kc in KIND_COLORS.items():
            assert _distance(colour, kc) > 0.2, (c, kind)
    assert _distance(CLASS_COLORS["hybrid"], KIND_COLORS["hybrid"]) > 0.4


@pytest.mark.parametrize("driver_records", [True, False])
def test_draws(sim_model_dir, tmp_path, driver_records):
    d = sim_runs.run(tmp_path / "run", sim_model_dir, sim_runs.mixed_requests(4, seed=2),
                     sim_runs.constant_s(0.01), return_s=1e-3, chunk_size=256)  # fmt: skip
    records = sim_runs.events(d)
    if not driver_records:
        records = sim_runs.older_schema(records)
    log = parse_log(records, "x")
    assert bool(log.waits) is driver_records
    draw_timeline(log, analyze(log), tmp_path / "t.png", title="t")
    assert (tmp_path / "t.png").stat().st_size > 1000
