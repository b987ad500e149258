"""Bubble attribution on hand-made event logs with known gaps, and on simulated runs (the
real engine loop on ``sarathi_pp.sim``, see ``tests/sim_runs.py``) with stated stage times
(see report/bubbles.py)."""

from __future__ import annotations

from itertools import pairwise

import pytest
import sim_runs

from sarathi_pp.report.bubbles import (
    BUBBLE_CLASSES,
    BUSY,
    BubbleAnalysis,
    Segment,
    analyze,
    pass_down,
    pb_class,
)
from sarathi_pp.report.log import parse_log
from sarathi_pp.sim.executor import Overheads

TOKENS = {"prefill": (8, 0), "decode": (0, 2), "hybrid": (6, 2)}


def header(num_stages: int) -> dict:
    return {
        "type": "header",
        "schema_version": 1,
        "num_stages": num_stages,
        "t0": 0.0,
        "config": {},
    }


def st(
    stage: int,
    mb: int,
    kind: str,
    cs: float,
    ce: float,
    se: float | None = None,
    ready: float | None = None,
) -> dict:
    p, d = TOKENS[kind]
    return {
        "type": "stage",
        "stage": stage,
        "mb": mb,
        "kind": kind,
        "num_prefill_tokens": p,
        "num_decode_tokens": d,
        "wait_start": cs if ready is None else ready,
        "input_ready": cs if ready is None else ready,
        "compute_start": cs,
        "compute_end": ce,
        "send_end": ce if se is None else se,
    }


def run(records: list[dict]) -> BubbleAnalysis:
    a = analyze(parse_log(records, "test/events.jsonl"))
    check_exact(a)
    return a


def check_exact(a: BubbleAnalysis) -> None:
    """Every stage: busy + idle == window, classes sum to idle, segments contiguous."""
    for b, segs in zip(a.stages, a.segments, strict=True):
        assert b.busy_s + b.idle_s == pytest.approx(a.window.duration, abs=1e-9)
        assert sum(b.bubbles_s.values()) == pytest.approx(b.idle_s, abs=1e-9)
        assert set(b.bubbles_s) == set(BUBBLE_CLASSES)
        assert segs[0].start == a.run_start and segs[-1].end == a.run_end
        assert all(x.end == y.start for x, y in pairwise(segs))
        assert all(s.end >= s.start for s in segs)


def only(bubbles: dict[str, float], **expected: float) -> None:
    """``bubbles`` has exactly ``expected`` (others zero), to 1e-9."""
    for c in BUBBLE_CLASSES:
        assert bubbles[c] == pytest.approx(expected.get(c, 0.0), abs=1e-9), c


def two_stage(kinds: list[str]) -> list[dict]:
    """Stage 0 computes each micro-batch in 1 s back to back; stage 1 in 0.5 s as soon as
    stage 0 is done, so stage 1 waits 0.5 s for each micro-batch after the first."""
    recs = [header(2)]
    for j, k in enumerate(kinds):
        recs += [st(0, j, k, j, j + 1), st(1, j, k, j + 1, j + 1.5)]
    return recs


# --- the PB classes -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prev", "kind", "cls"),
    [
        ("prefill", "prefill", "PB1"),
        ("decode", "decode", "PB3"),
        ("prefill", "decode", "PB2"),
        ("decode", "prefill", "PB2"),
        ("hybrid", "decode", "hybrid"),
        ("prefill", "hybrid", "hybrid"),
        ("hybrid", "hybrid", "hybrid"),
        (None, "decode", "PB3"),
        (None, "hybrid", "hybrid"),
    ],
)
def test_pb_class(prev, kind, cls):
    assert pb_class(prev, kind) == cls


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (["prefill", "prefill", "prefill"], {"PB1": 1.0}),
        (["decode", "decode", "decode"], {"PB3": 1.0}),
        (["prefill", "decode", "prefill"], {"PB2": 1.0}),
        (["decode", "hybrid", "decode"], {"hybrid": 1.0}),
        (["prefill", "prefill", "decode"], {"PB1": 0.5, "PB2": 0.5}),
        (["hybrid", "prefill", "prefill"], {"hybrid": 0.5, "PB1": 0.5}),
    ],
)
def test_pb_bubbles_on_stage_1(kinds, expected):
    a = run(two_stage(kinds))
    assert (a.window.start, a.window.end, a.window.steady_state) == (1.0, 3.0, True)
    only(a.stages[0].bubbles_s)  # stage 0 computes throughout the window
    assert a.stages[0].busy_s == pytest.approx(2.0)
    only(a.stages[1].bubbles_s, **expected)
    assert a.stages[1].busy_s == pytest.approx(1.0)
    assert a.stages[1].idle_s / a.stages[1].window_s == pytest.approx(0.5)


# --- comm -----------------------------------------------------------------------------------
def test_comm_send_and_transfer():
    # stage 0 sends for 0.25 s after each compute; the hidden states reach stage 1 0.25 s
    # after that, so stage 1 starts 0.5 s after stage 0's compute_end.
    recs = [header(2)]
    for j in range(3):
        cs = j * 1.25
        recs.append(st(0, j, "prefill", cs, cs + 1, cs + 1.25))
        recs.append(st(1, j, "prefill", cs + 1.5, cs + 1.75, ready=cs + 1.5))
    a = run(recs)
    assert (a.window.start, a.window.end) == (1.5, 3.5)
    only(a.stages[0].bubbles_s, comm=0.25)
    assert a.stages[0].busy_s == pytest.approx(1.75)
    # waits for mb 1 [1.75, 2.75] and mb 2 [3.0, 4.0]: PB1 while stage 0 computes, comm after
    only(a.stages[1].bubbles_s, PB1=1.0, comm=0.5)
    assert a.stages[1].busy_s == pytest.approx(0.5)


# --- scheduler classes on stage 0 and passed down -------------------------------------------
def scheduler_gap_log() -> list[dict]:
    """Stage 0 waits for mb 1 over [1, 2.75]: dependency [1, 1.5], no_work [1.5, 2], the micro-batch
    issued at 2.25 reaches the stage at 2.5 and compute starts at 2.75."""
    return [
        header(2),
        {
            "type": "issue",
            "mb": 0,
            "t": 0.0,
            "kind": "decode",
            "num_prefill_tokens": 0,
            "num_decode_tokens": 2,
        },
        st(0, 0, "decode", 0.0, 1.0),
        {"type": "idle", "start": 1.0, "end": 1.5, "reason": "dependency"},
        {"type": "idle", "start": 1.5, "end": 2.0, "reason": "no_work"},
        {
            "type": "issue",
            "mb": 1,
            "t": 2.25,
            "kind": "decode",
            "num_prefill_tokens": 0,
            "num_decode_tokens": 2,
        },
        st(0, 1, "decode", 2.75, 3.75, ready=2.5),
        st(0, 2, "decode", 3.75, 4.75),
        st(1, 0, "decode", 1.0, 1.25),
        st(1, 1, "decode", 4.0, 5.0, ready=4.0),
        st(1, 2, "decode", 5.0, 6.0),
    ]


def test_scheduler_classes_on_stage_0():
    a = run(scheduler_gap_log())
    assert (a.window.start, a.window.end) == (1.0, 4.75)
    only(a.stages[0].bubbles_s, dependency=0.5, no_work=0.5, schedule=0.75)
    assert a.stages[0].busy_s == pytest.approx(2.0)


def test_scheduler_classes_passed_down():
    a = run(scheduler_gap_log())
    # stage 1 waits for mb 1 over [1.25, 4.0]; stage 0 ends mb 1 at 3.75, then 0.25 s comm.
    # Before that (2.5 s): stage 0's whole 1.75 s scheduler gap, then PB3 for the 0.75 s
    # stage 0's mb 1 (1 s) took beyond stage 1's mb 0 (0.25 s).
    only(a.stages[1].bubbles_s, dependency=0.5, no_work=0.5, schedule=0.75, PB3=0.75, comm=0.25)
    gap = [s for s in a.segments[1] if s.mb == 1 and s.label != BUSY]
    assert [(s.start, s.label) for s in gap] == [
        (1.25, "dependency"),
        (1.75, "no_work"),
        (2.25, "schedule"),
        (2.75, "schedule"),
        (3.0, "PB3"),
        (3.75, "comm"),
    ]


def test_scheduler_gap_reaches_every_stage_of_a_balanced_pipeline(sim_model_dir, tmp_path):
    # 3 stages, 1 s per compute, four one-prefill requests: two at 0 s, two at 4 s. Stage 0
    # computes mb 0 and 1 by 2 s, then the scheduler has nothing ready (both in flight:
    # ``dependency``, the load's own share of it: ``load``) until 4 s. Every stage idles
    # exactly 2 s for it (one compute later per stage) and no PB bubble appears.
    reqs = sim_runs.requests([128] * 4, 1, [0.0, 0.0, 4.0, 4.0])
    d = sim_runs.run(tmp_path / "run", sim_model_dir, reqs, sim_runs.constant_s(1.0),
                     num_stages=3, chunk_size=128)  # fmt: skip
    records = sim_runs.events(d)
    a = run(records)
    assert [e.kind for e in parse_log(records, "x").stages[0]] == ["prefill"] * 4
    assert (a.window.start, a.window.end) == (2.0, 6.0)
    for b in a.stages:
        only(b.bubbles_s, load=2.0)
        assert b.busy_s == pytest.approx(2.0)
    unsplit = analyze(parse_log(records, "x"), split=False)
    for b in unsplit.stages:
        only(b.bubbles_s, dependency=2.0)


def test_gap_absorbed_by_a_busy_stage_is_not_passed_down():
    # stage 1 is still computing mb 0 for most of stage 0's 2 s gap: it idles 0.5 s only.
    recs = [
        header(2),
        st(0, 0, "decode", 0, 1),
        {"type": "idle", "start": 1.0, "end": 3.0, "reason": "dependency"},
        st(0, 1, "decode", 3, 4),
        st(0, 2, "decode", 4, 5),
        st(1, 0, "decode", 1, 3.5),
        st(1, 1, "decode", 4, 5),
        st(1, 2, "decode", 5, 6),
    ]
    a = run(recs)
    only(a.stages[1].bubbles_s, dependency=0.5)


def test_pass_down_keeps_the_latest_part():
    spans = [Segment(0, 1, "no_work", 3), Segment(1, 3, "schedule", 3)]
    assert pass_down(10, 11.5, spans, "PB1", 3) == [Segment(10, 11.5, "schedule", 3)]
    assert pass_down(10, 14, spans, "PB1", 3) == [
        Segment(10, 11, "no_work", 3),
        Segment(11, 13, "schedule", 3),
        Segment(13, 14, "PB1", 3),
    ]
    assert pass_down(10, 10, spans, "PB1", 3) == []


# --- window, fill and drain -----------------------------------------------------------------
def test_fill_and_drain_apart():
    a = run(two_stage(["prefill"] * 3))
    assert (a.run_start, a.run_end) == (0.0, 3.5)
    # stage 0: drain (3, 3.5] idle after its last send; stage 1: fill [0, 1) before mb 0
    assert (a.stages[0].fill_s, a.stages[0].drain_s) == (0.0, 0.5)
    assert (a.stages[1].fill_s, a.stages[1].drain_s) == (1.0, 0.0)
    assert a.stages[1].idle_s == pytest.approx(1.0)  # the fill is not in the window's idle


def test_run_starts_at_the_first_issue():
    recs = two_stage(["decode"] * 3)
    recs.insert(
        1,
        {
            "type": "issue",
            "mb": 0,
            "t": -0.5,
            "kind": "decode",
            "num_prefill_tokens": 0,
            "num_decode_tokens": 2,
        },
    )
    a = run(recs)
    assert a.run_start == -0.5
    assert a.stages[0].fill_s == pytest.approx(0.5)  # issue -> compute: schedule, in the fill
    assert a.segments[0][0] == Segment(-0.5, 0.0, "schedule", 0)


def test_too_short_for_a_steady_state():
    # one micro-batch through two stages: no moment when both are in steady state
    recs = [
        header(2),
        st(0, 0, "prefill", 0, 1),
        {"type": "idle", "start": 1.0, "end": 2.0, "reason": "dependency"},
        st(1, 0, "prefill", 1, 2),
    ]
    a = run(recs)
    assert not a.window.steady_state
    assert "too short" in a.window.note
    assert (a.window.start, a.window.end) == (0.0, 2.0)  # the whole run
    only(a.stages[0].bubbles_s, dependency=1.0)
    only(a.stages[1].bubbles_s, PB1=1.0)
    for b in a.stages:
        assert b.busy_s == pytest.approx(1.0)
        assert b.fill_s == b.drain_s == 0.0


def test_single_stage():
    a = run([header(1), st(0, 0, "prefill", 0, 1), st(0, 1, "decode", 1.5, 2)])
    assert a.window.steady_state and (a.window.start, a.window.end) == (0.0, 2.0)
    only(a.stages[0].bubbles_s, schedule=0.5)


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_exact_accounting_on_a_long_mixed_run(num_stages, sim_model_dir, tmp_path):
    # prefill, hybrid and decode micro-batches of a mixed load with arrival gaps; every
    # stage hands its output on (``handoff_s``) and sends take time: comm on every stage
    o = Overheads(driver_s=3e-4, dispatch_s=1e-4, handoff_s=1e-4)
    d = sim_runs.run(
        tmp_path / "run", sim_model_dir, sim_runs.mixed_requests(40, seed=num_stages),
        sim_runs.mixed_compute_s, num_stages, send_s=2e-4, return_s=3e-4, overheads=o,
        chunk_size=256,
    )  # fmt: skip
    records = sim_runs.events(d)
    a = run(records)
    assert a.window.steady_state
    kinds = [r["kind"] for r in records if r["type"] == "issue"]
    assert len(kinds) > 100 and set(kinds) == {"prefill", "decode", "hybrid"}
    for b in a.stages:
        assert 0 < b.idle_s < b.window_s
        assert b.bubbles_s["comm"] > 0
    # without keeping the segments (a long run's report): the same figures
    lean = analyze(parse_log(records, "test/events.jsonl"), keep_segments=False)
    assert lean.stages == a.stages and lean.window == a.window
    assert lean.segments == [[]] * num_stages and all(a.segments)


# --- errors name the file -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("records", "match"),
    [
        ([header(2)], "no stage records"),
        ([header(2), st(0, 0, "prefill", 0, 1)], "stages 0 and 1 ran different micro-batches"),
        (
            [header(1), st(0, 0, "prefill", 0, 1), st(0, 1, "prefill", 0.5, 2)],
            "before micro-batch 0 ends",
        ),
        ([header(1), {**st(0, 0, "prefill", 0, 1), "kind": "mixed"}], "kind must be one of"),
        (
            [header(1), st(0, 0, "prefill", 0, 1, se=0.5)],
            "compute_start <= compute_end <= send_end",
        ),
        ([header(1), st(3, 0, "prefill", 0, 1)], "stage 3 is out of range"),
        (
            [header(1), {k: v for k, v in st(0, 0, "prefill", 0, 1).items() if k != "compute_end"}],
            "lacks compute_end",
        ),
        (
            [
                header(1),
                st(0, 0, "prefill", 0, 1),
                {"type": "idle", "start": 0, "end": 1, "reason": "bored"},
            ],
            "idle reason must be one of",
        ),
        ([{**header(1), "num_stages": 0}], "num_stages"),
    ],
)
def test_invalid_logs(records, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_log(records, "test/events.jsonl")
    assert "test/events.jsonl" in str(info.value)


# --- before and after the last prefill ------------------------------------------------------
def _window_bubble(a) -> float:
    return sum(s.window_s - s.busy_s for s in a.stages) / sum(s.window_s for s in a.stages)


def test_prefill_split_cuts_at_the_last_prefill_and_adds_up_to_the_window(sim_model_dir, tmp_path):
    # a closed workload: six long prompts at once, chunked (prefills, then hybrids), then
    # their decodes alone
    o = Overheads(driver_s=0.002, dispatch_s=0.001, handoff_s=0.001)
    d = sim_runs.run(tmp_path / "run", sim_model_dir, sim_runs.requests([1000] * 6, 40),
                     sim_runs.mixed_compute_s, send_s=0.002, overheads=o, chunk_size=256)  # fmt: skip
    log = parse_log(sim_runs.events(d), "sim")
    a = analyze(log)
    split = a.prefill_split
    last = max((e for e in log.stages[0] if e.num_prefill_tokens > 0), key=lambda e: e.mb)
    assert last.kind == "hybrid" and last.mb > 20
    after = [e.kind for e in log.stages[0] if e.mb > last.mb]
    assert len(after) > 20 and set(after) == {"decode"}
    assert split.cut == last.compute_end  # the last hybrid on stage 0
    assert 0 < split.decode_only_share < 1
    assert split.while_prefills is not None and split.decode_only is not None
    # the fixed costs per micro-batch weigh more against the short decode-only computes
    assert split.decode_only > 2 * split.while_prefills > 0
    share = split.decode_only_share
    mixed = (1 - share) * split.while_prefills + share * split.decode_only
    assert mixed == pytest.approx(_window_bubble(a))
    # the same figures without the segments kept (a long run's report)
    assert analyze(log, keep_segments=False).prefill_split == split


def test_prefill_split_of_a_one_phase_log_leaves_the_other_empty(sim_model_dir, tmp_path):
    # four short prompts in the first micro-batch, then only their decodes: the window
    # (from stage 1's first compute on) holds no prefill
    d = sim_runs.run(tmp_path / "decodes", sim_model_dir, sim_runs.requests([32] * 4, 20),
                     sim_runs.constant_s(0.01), chunk_size=256)  # fmt: skip
    log = parse_log(sim_runs.events(d), "decodes")
    assert [e.kind for e in log.stages[0]][:2] == ["prefill", "decode"]
    assert {e.kind for e in log.stages[0][1:]} == {"decode"}
    a = analyze(log)
    split = a.prefill_split
    assert split.while_prefills is None and split.decode_only_share == 1.0
    assert split.decode_only == pytest.approx(_window_bubble(a))
    # one prompt per micro-batch, each request done with its first token: prefills only
    d = sim_runs.run(tmp_path / "prefills", sim_model_dir, sim_runs.requests([128] * 20, 1),
                     sim_runs.constant_s(0.01), chunk_size=128)  # fmt: skip
    log = parse_log(sim_runs.events(d), "prefills")
    assert [e.kind for e in log.stages[0]] == ["prefill"] * 20
    split = analyze(log).prefill_split
    assert split.decode_only is None and split.decode_only_share == 0.0
    assert split.while_prefills is not None
