"""``chunk_size: auto``: the tuner on synthetic request streams, the schedulers with a budget
that changes mid-run (the fake-model simulation of ``test_scheduler``), B for the engine,
and the budget over time in the event log and the report files (simulated runs, the tuner
in the engine: ``tests/sim_runs.py``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import sim_runs
from test_scheduler import (
    MAX_MODEL_LEN,
    Request,
    make_scheduler,
    make_seq,
    reference_output,
    simulate,
)

from sarathi_pp.config import CacheConfig, SchedulerConfig
from sarathi_pp.planner.chunk import planned_chunk_size
from sarathi_pp.planner.memory import (
    batch_bound,
    engine_decode_batch,
    kv_decode_batch,
    stage_bounds,
)
from sarathi_pp.planner.tuner import ChunkTuner
from sarathi_pp.records.events import EventLog
from sarathi_pp.report import load_log, write_report
from sarathi_pp.report.text import format_comparison, format_run
from sarathi_pp.scheduler import create_scheduler
from sarathi_pp.sequence import SequenceStatus
from sarathi_pp.stage_memory import StageMemory

B, N = 65, 1  # 64 decodes per micro-batch


def tuner(max_model_len: int = 4096, **kw) -> ChunkTuner:
    return ChunkTuner(SchedulerConfig(chunk_size="auto", **kw), B, N, max_model_len)


def planned(t: ChunkTuner, pd_ratio: float) -> int:
    c = t.config
    return planned_chunk_size(
        pd_ratio, B, N, c.min_chunk_size, c.max_chunk_size, c.tile_size
    ).chunk_size


# --- the tuner ------------------------------------------------------------------------------
def test_converges_to_the_plan_of_a_new_pd_ratio_within_the_window():
    t = tuner()  # window 32, clamp [128, 2048], tile 128
    for _ in range(40):  # P:D 1
        t.on_added(64, 64)
        t.on_finished(64, 64)
    assert t.pd_ratio == 1.0 and t.chunk_size == planned(t, 1.0)
    before = t.chunk_size
    seen = []
    for _ in range(32):  # P:D 8: P = 512, D = 64
        t.on_added(512, 64)
        t.on_finished(512, 64)
        seen.append(t.chunk_size)
    assert t.pd_ratio == 8.0 and t.chunk_size == planned(t, 8.0) == 512
    assert before < 512 and seen == sorted(seen)  # it drifts up, never back
    for _ in range(10):  # and stays there
        t.on_finished(512, 64)
        assert t.chunk_size == 512


def test_stays_tile_aligned_and_within_the_clamp():
    t = tuner(min_chunk_size=100, max_chunk_size=900, tile_size=64, auto_chunk_window=8)
    lo, hi = planned(t, 1e-6), planned(t, 1e6)  # the plan's smallest and largest budgets
    rng = random.Random(0)
    values = set()
    for _ in range(300):
        p, d = rng.randint(1, 2000), rng.randint(1, 300)
        t.on_added(p, d)
        if rng.random() < 0.8:
            t.on_finished(p, rng.randint(1, d))
        assert t.chunk_size % 64 == 0 and lo <= t.chunk_size <= hi
        assert t.chunk_size == planned(t, t.pd_ratio)
        values.add(t.chunk_size)
    assert len(values) > 3


def test_starts_from_the_added_requests():
    t = tuner(max_model_len=1000)
    assert t.pd_ratio is None and t.chunk_size == planned(t, t.config.max_chunk_size)
    t.on_added(400, 100)  # max_tokens as the expected output
    assert t.pd_ratio == 4.0 and t.chunk_size == planned(t, 4.0)
    t.on_added(900, 5000)  # expected output capped at max_model_len: 100 tokens
    assert t.pd_ratio == (400 + 900) / (100 + 100)


def test_a_request_without_max_tokens_is_no_prior():
    """``max_tokens=None`` bounds the output by the context, it does not estimate it: the
    request says nothing until it finishes."""
    t = tuner(max_model_len=1000)
    t.on_added(100, None)
    assert t.pd_ratio is None and t.chunk_size == planned(t, t.config.max_chunk_size)
    t.on_added(400, 100)
    assert t.pd_ratio == 4.0
    t.on_added(100, None)
    assert t.pd_ratio == 4.0
    t.on_finished(100, 50)  # observed once finished
    assert t.pd_ratio != 4.0


def test_an_early_stop_moves_the_estimate_by_one_slot():
    t = tuner()
    for _ in range(10):
        t.on_added(400, 100)
    t.on_finished(400, 2)  # stopped at EOS after 2 tokens
    assert t.pd_ratio == pytest.approx(32 * 400 / (31 * 100 + 2))
    for _ in range(32):  # a full window: only what was observed counts
        t.on_finished(400, 2)
    assert t.pd_ratio == 200.0 and t.chunk_size == planned(t, 200.0)


def test_a_full_window_ignores_new_arrivals():
    t = tuner(auto_chunk_window=2)
    t.on_added(100, 100)
    t.on_finished(100, 100)
    t.on_finished(100, 100)
    t.on_added(4000, 1)
    assert t.pd_ratio == 1.0


def test_scheduler_observes_finished_not_aborted_requests():
    sched = make_scheduler("sarathi", chunk_size="auto", auto_chunk_window=4)
    a, b = (make_seq(Request(i, [1] * 20, 10)) for i in range(2))
    sched.add(a)
    sched.add(b)
    assert sched.tuner.pd_ratio == 2.0
    sched.finish(a, SequenceStatus.FINISHED_ABORTED, 0.0)
    assert not sched.tuner.window
    b.append_token(5, 0.0)
    sched.finish(b, SequenceStatus.FINISHED_STOPPED, 0.0)
    assert list(sched.tuner.window) == [(20, 1)]
    assert sched.chunk_size == sched.tuner.chunk_size


@pytest.mark.parametrize("policy", ["vllm", "orca"])
def test_auto_is_ignored_by_whole_prompt_policies(policy):
    # As every setting a policy does not use: one config serves every policy.
    sched = make_scheduler(policy, chunk_size="auto")
    assert sched.tuner is None and not sched.chunks_prompts


def test_fixed_chunk_size_has_no_tuner():
    sched = make_scheduler("sarathi", chunk_size=24)
    assert sched.tuner is None and sched.chunk_size == 24


# --- a budget that changes mid-run ----------------------------------------------------------
def two_phase_requests() -> list[Request]:
    """Short prompts with long outputs first, then long prompts with short outputs."""
    rng = random.Random(7)
    reqs = [Request(i, [rng.randrange(1000) for _ in range(3)], 20) for i in range(5)]
    for i in range(5, 12):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(35, 45))]
        reqs.append(Request(i, prompt, 2, arrival_time=float(4 * i)))
    return reqs


@pytest.mark.parametrize("num_inflight", [1, 3])
@pytest.mark.parametrize("policy", ["sarathi", "simple_chunking"])
def test_budget_changes_mid_run_and_every_microbatch_respects_the_budget_in_force(
    policy, num_inflight
):
    sched = make_scheduler(
        policy,
        64,
        4,
        num_inflight,
        chunk_size="auto",
        min_chunk_size=4,
        max_chunk_size=64,
        tile_size=4,
        auto_chunk_window=3,
    )
    assert sched.tuner.max_decode_batch == kv_decode_batch(64, 4, MAX_MODEL_LEN, 256) == 4
    issued: list[tuple[int, int]] = []  # (budget in force, rows of the micro-batch)
    schedule = sched.schedule

    def recording_schedule(now: float):
        budget = sched.chunk_size
        microbatch = schedule(now)
        assert sched.chunk_size == budget  # never changes inside schedule
        if microbatch is not None:
            issued.append((budget, microbatch.num_tokens))
        return microbatch

    sched.schedule = recording_schedule  # type: ignore[method-assign]
    reqs = two_phase_requests()
    result = simulate(sched, reqs, num_inflight)  # its Checker checks every micro-batch too
    for r in reqs:
        assert result.outputs[r.seq_id] == reference_output(r.seq_id, r.prompt, r.max_tokens)
    assert all(rows <= budget for budget, rows in issued)
    budgets = [budget for budget, _ in issued]
    assert len(set(budgets)) >= 2, budgets
    assert max(budgets) > budgets[0], budgets  # the long prompts pulled it up
    long_chunks = {c.num_tokens for mb in result.microbatches for c in mb.chunks if c.seq_id >= 5}
    assert len(long_chunks) >= 2  # their prompts were cut by more than one budget


# --- B for the engine -----------------------------------------------------------------------
def stages(free: list[int]) -> list[StageMemory]:
    return [StageMemory(i, 1000, 10, 1000 + f) for i, f in enumerate(free)]


def test_engine_decode_batch_from_memory_kv_bytes_and_blocks():
    mem = stages([64_000, 40_000])  # B = free / (L 100 x m_kv 10): 64 and 40
    assert engine_decode_batch(CacheConfig(), mem, 999, 16, 100, 256) == 40
    assert engine_decode_batch(CacheConfig(), mem, 999, 16, 100, 256) == (
        batch_bound(stage_bounds(mem, 100), 256).effective
    )
    assert engine_decode_batch(CacheConfig(), mem, 999, 16, 100, 8) == 8  # max_num_seqs
    fixed = CacheConfig(kv_cache_memory=20_000)
    assert engine_decode_batch(fixed, mem, 999, 16, 100, 256) == 20
    blocks = CacheConfig(num_kv_blocks=50)  # what the engine has: 50 x 16 tokens / 100
    assert engine_decode_batch(blocks, mem, 50, 16, 100, 256) == 8
    assert kv_decode_batch(3, 16, 100, 256) == 1  # never below one


def test_create_scheduler_takes_the_engines_b():
    cfg = SchedulerConfig(chunk_size="auto")
    sched = create_scheduler(cfg, 64, 4, MAX_MODEL_LEN, 2, max_decode_batch=33)
    assert (sched.tuner.max_decode_batch, sched.tuner.num_microbatches_in_flight) == (33, 2)


# --- the event log and the report -----------------------------------------------------------
def test_event_log_records_the_first_value_and_changes_only():
    log = EventLog(1, 100.0, {})
    for t, v in [(100.5, 256), (101.0, 256), (102.0, 384), (103.0, 384), (104.0, 256)]:
        log.chunk_size(t, v)
    recs = [r for r in log.records if r["type"] == "chunk_size"]
    assert recs == [
        {"type": "chunk_size", "t": 0.5, "chunk_size": 256},
        {"type": "chunk_size", "t": 2.0, "chunk_size": 384},
        {"type": "chunk_size", "t": 4.0, "chunk_size": 256},
    ]


def test_report_shows_the_budget_over_time(sim_model_dir, tmp_path: Path):
    # the tuner re-plans from the last finished request (a window of 1) within the clamp
    # [128, 512], 4 decodes per micro-batch (8 sequences over 2 in flight): P:D 8 plans the
    # 128 clamp (256 with the decodes, tile 128), then 95 plans 384, then 200 plans 512
    reqs = sim_runs.requests(
        [64, 64, 1140, 1140, 1200, 1200], [8, 8, 12, 12, 6, 6], [0.0, 0.0, 1.0, 1.0, 3.0, 3.0]
    )
    d = sim_runs.run(
        tmp_path / "auto", sim_model_dir, reqs, sim_runs.constant_s(0.01), report=True,
        chunk_size="auto", min_chunk_size=128, max_chunk_size=512, auto_chunk_window=1,
        max_num_seqs=8, num_microbatches_in_flight=2,
    )  # fmt: skip
    records = [r for r in sim_runs.events(d) if r["type"] == "chunk_size"]
    changes = [[r["t"], r["chunk_size"]] for r in records]
    assert [v for _, v in changes] == [256, 384, 512]
    assert changes[0][0] == 0.0 < changes[1][0] < changes[2][0]
    summary = write_report(d)
    assert summary["chunk_size"] == {
        "auto": True,
        "initial": 256,
        "final": 512,
        "min": 256,
        "max": 512,
        "num_changes": 2,
        "changes": changes,
    }
    assert json.loads((d / "summary.json").read_text())["chunk_size"] == summary["chunk_size"]
    trace = json.loads((d / "trace.json").read_text())["traceEvents"]
    counter = [e for e in trace if e["ph"] == "C" and e["name"] == "chunk_size"]
    assert [e["args"]["chunk_size"] for e in counter] == [256, 384, 512, 512]  # + the run end
    assert [e["ts"] for e in counter[:3]] == pytest.approx([t * 1e6 for t, _ in changes])
    assert counter[-1]["ts"] == pytest.approx(summary["run"]["end_s"] * 1e6)
    assert (d / "timeline.png").stat().st_size > 0
    text = format_run("auto", summary)
    assert "chunk_size auto: 256 at the start, 512 at the end (256-512, 2 changes)" in text
    fixed_dir = sim_runs.run(tmp_path / "fixed", sim_model_dir, reqs, sim_runs.constant_s(0.01),
                             chunk_size=256)  # fmt: skip
    fixed = write_report(fixed_dir, plot=False)
    assert fixed["chunk_size"]["auto"] is False and fixed["chunk_size"]["num_changes"] == 0
    assert "\nchunk_size 256\n" in format_run("fixed", fixed)
    table = format_comparison(["auto", "fixed"], [summary, fixed])
    assert "auto 256-512" in table and "chunk_size" in table


def test_a_log_without_chunk_size_records_still_loads(sim_model_dir, tmp_path: Path):
    # a policy that runs whole prompts has no budget: its log has no chunk_size records
    d = sim_runs.run(tmp_path / "old", sim_model_dir, sim_runs.requests([8] * 2, 3),
                     sim_runs.constant_s(0.01), scheduler="orca")  # fmt: skip
    assert "chunk_size" not in {r["type"] for r in sim_runs.events(d)}
    assert load_log(d / "events.jsonl").chunk_sizes == ()
    summary = write_report(d)
    assert summary["chunk_size"] is None
    assert "chunk_size" not in format_run("old", summary)
