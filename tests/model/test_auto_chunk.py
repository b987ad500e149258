"""``chunk_size: auto`` end to end on a tiny random Llama: greedy outputs still match Hugging
Face while the budget moves, and the run dir records the budget over time (events.jsonl,
summary.json, trace.json)."""

from __future__ import annotations

import bisect
import json
import random

from helpers import assert_greedy_match, hf_greedy

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.planner.memory import batch_bound, stage_bounds
from sarathi_pp.records.events import read_events

# B = 32 blocks x 16 tokens / max_model_len 128 = 4: 3 decodes per micro-batch, so the plan
# is C = 3 x P:D clamped to [8, 96], plus 3, rounded down to the tile of 8 but keeping 8
# prefill rows (min_chunk_size): 16 to 96.
AUTO = dict(
    max_model_len=128,
    dtype="float32",
    block_size=16,
    num_kv_blocks=32,
    chunk_size="auto",
    min_chunk_size=8,
    max_chunk_size=96,
    tile_size=8,
    auto_chunk_window=4,
)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(length)] for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def check_hf(model_dir, outs, ps, max_tokens: int) -> None:
    for out, p in zip(outs, ps, strict=True):
        ref, margins = hf_greedy(model_dir, p, max_tokens)
        assert_greedy_match(out.outputs[0].token_ids, ref, margins)


def budget_at(records: list[dict], t: float) -> int:
    """The chunk_size in force at ``t`` by the log's records."""
    times = [r["t"] for r in records]
    return records[bisect.bisect_right(times, t) - 1]["chunk_size"]


def test_auto_moves_the_budget_and_the_run_dir_shows_it(llama_dir, tmp_path):
    run = tmp_path / "run"
    llm = LLM(str(llama_dir), run_dir=str(run), **AUTO)
    tuner = llm.engine.scheduler.tuner
    assert tuner.max_decode_batch == 4
    # Short prompts with long outputs (P:D 1/3), then long prompts with short ones (P:D 45):
    # the second workload's prompts are chunked while the budget climbs.
    short, long = prompts(4, 8, seed=1), prompts(6, 90, seed=2)
    check_hf(llama_dir, llm.generate(short, greedy(24), use_tqdm=False), short, 24)
    low = llm.engine.scheduler.chunk_size
    assert low == tuner.plan(1 / 3) == 16  # 8 + 3 = 11: 8 would keep 5 prefill rows
    check_hf(llama_dir, llm.generate(long, greedy(2), use_tqdm=False), long, 2)
    assert llm.engine.scheduler.chunk_size == tuner.plan(45.0) == 96
    llm.engine.set_scheduler(chunk_size=32)  # a fixed budget for the next workload
    check_hf(llama_dir, llm.generate(short[:2], greedy(4), use_tqdm=False), short[:2], 4)

    events = read_events(run / "events.jsonl")
    records = [r for r in events if r["type"] == "chunk_size"]
    values = [r["chunk_size"] for r in records]
    # The window fills with long requests one by one: P:D 1.5, 3.8 (both 16), 9.3, then 45.
    assert values == [16, 24, 96, 32]
    assert all(v % 8 == 0 and 8 <= v <= 96 for v in values)
    issues = [r for r in events if r["type"] == "issue"]
    assert records[0]["t"] <= issues[0]["t"]
    for i in issues:  # every micro-batch within the budget in force when it was issued
        assert i["num_prefill_tokens"] + i["num_decode_tokens"] <= budget_at(records, i["t"])
    # the long prompts ran in chunks of more than one budget
    prefill_sizes = {i["num_prefill_tokens"] for i in issues if i["num_prefill_tokens"] > 8}
    assert len(prefill_sizes) >= 2

    summary = json.loads((run / "summary.json").read_text())
    c = summary["chunk_size"]
    assert c["auto"] is True and (c["initial"], c["final"]) == (16, 32)
    assert c["num_changes"] == len(records) - 1 and [v for _, v in c["changes"]] == values
    trace = json.loads((run / "trace.json").read_text())["traceEvents"]
    counter = [e["args"]["chunk_size"] for e in trace if e["ph"] == "C"]
    assert counter[: len(values)] == values


def test_auto_b_from_the_stages_memory(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=128, chunk_size="auto", max_num_seqs=1000)
    e = llm.engine
    bound = batch_bound(stage_bounds(e.stage_memory, 128), 1000)
    assert e.scheduler.tuner.max_decode_batch == bound.effective
    p = prompts(2, 20, seed=3)
    check_hf(llama_dir, llm.generate(p, greedy(5), use_tqdm=False), p, 5)


def test_auto_is_ignored_by_vllm(llama_dir, tmp_path):
    llm = LLM(
        str(llama_dir),
        max_model_len=128,
        scheduler="vllm",
        chunk_size="auto",
        run_dir=str(tmp_path / "r"),
    )
    p = prompts(2, 20, seed=3)
    check_hf(llama_dir, llm.generate(p, greedy(5), use_tqdm=False), p, 5)
    records = [
        json.loads(line) for line in (tmp_path / "r" / "events.jsonl").read_text().splitlines()
    ]
    assert not [r for r in records if r["type"] == "chunk_size"]
