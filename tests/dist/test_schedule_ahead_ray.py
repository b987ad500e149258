"""Scheduling ahead over Ray (``schedule_ahead=True``: stage 0 takes the decodes' input
tokens from the last stage over the token ring, ``comm/ring.py``): the same greedy tokens as
one stage for every policy at PP=2, PP=2 with 3 in flight and PP=3; decodes really went
ahead; the run dir names each one's ring source and the report splits stage 0's wait for
it into ``in_flight`` and ``ring``; penalties and bad words (the last stage keeps the
tokens) with decodes ahead. The fault tests run with it in ``test_faults.py``."""

from __future__ import annotations

import pytest
from helpers import record_ahead
from test_ray_compiled import SCHEDULERS, make_prompts, one_stage_tokens, tokens

from sarathi_pp import LLM
from sarathi_pp.records.events import read_events
from sarathi_pp.report import write_report

KW = dict(max_model_len=256, dtype="float32")


@pytest.mark.parametrize("num_stages, in_flight", [(2, None), (2, 3), (3, None), (2, "auto")])
def test_ahead_pipeline_equals_one_stage_for_every_policy(
    ray_cluster, llama3_rope_dir, num_stages, in_flight
):
    prompts = make_prompts(seed=10 + num_stages)
    reference = one_stage_tokens(llama3_rope_dir, prompts)
    with LLM(
        str(llama3_rope_dir), **KW, pipeline_parallel_size=num_stages, schedule_ahead=True,
        num_microbatches_in_flight=in_flight,
    ) as llm:  # fmt: skip
        m = num_stages if in_flight == "auto" else in_flight or num_stages  # auto: P + ahead
        assert llm.engine.schedule_ahead and llm.engine.max_inflight == m + 1
        ahead = record_ahead(llm.engine)
        for policy in SCHEDULERS:
            llm.engine.set_scheduler(policy=policy, chunk_size=16, tile_align=False)
            ahead.clear()
            assert tokens(llm, prompts) == reference[policy], policy
            assert sum(ahead) >= 5, (policy, ahead)


def test_ahead_run_dir_names_ring_sources_and_the_report_the_ring(ray_cluster, llama_dir, tmp_path):
    run = tmp_path / "run"
    prompts = make_prompts(lens=(40, 60, 80, 100, 120, 30, 50, 70))
    with LLM(
        str(llama_dir), **KW, pipeline_parallel_size=2, schedule_ahead=True, chunk_size=32,
        tile_align=False, run_dir=str(run),
    ) as llm:  # fmt: skip
        tokens(llm, prompts)
        llm.engine.write_run_records()
    records = read_events(run / "events.jsonl")
    issues = {r["mb"]: r for r in records if r["type"] == "issue"}
    ahead = [r for r in issues.values() if "ring" in r]
    assert len(ahead) >= 5
    for r in ahead:  # the source was issued 2 (the stages) micro-batches before or earlier
        assert r["ring"] in issues and r["ring"] <= r["mb"] - 2
    stages = {(r["stage"], r["mb"]): r for r in records if r["type"] == "stage"}
    for r in ahead:  # stage 0 started it only once the last stage had sampled its source
        assert stages[0, r["mb"]]["compute_start"] >= stages[1, r["ring"]]["compute_end"]
    summary = write_report(run, plot=False)
    classes = summary["overall"]["bubbles_s"]
    assert classes["ring"] > 0


def test_ahead_with_penalties_and_bad_words_equals_one_stage(ray_cluster, llama_dir):
    """Penalized decodes, and decodes with bad words of two tokens (the last stage matches
    the output so far), scheduled ahead: the last stage knows their input token (it sampled
    it), though its copy of the micro-batch holds the ring's placeholder."""
    from sarathi_pp import SamplingParams

    prompts = make_prompts(seed=21)
    common = dict(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    penalized = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, **common)
    with LLM(str(llama_dir), **KW, chunk_size=16, tile_align=False) as one:
        plain = one.generate(prompts, SamplingParams(**common), use_tqdm=False)
        words = [tuple(o.outputs[0].token_ids[2:4]) for o in plain]
        allowed = sorted({t for o in plain for t in o.outputs[0].token_ids})
        ruled = SamplingParams(bad_words_token_ids=words, allowed_token_ids=allowed, **common)
        ref = [one.generate(prompts, p, use_tqdm=False) for p in (penalized, ruled)]
    assert [o.outputs[0].token_ids for o in ref[1]] != [o.outputs[0].token_ids for o in plain]
    with LLM(
        str(llama_dir), **KW, pipeline_parallel_size=2, schedule_ahead=True, chunk_size=16,
        tile_align=False,
    ) as llm:  # fmt: skip
        ahead = record_ahead(llm.engine)
        outs = [llm.generate(prompts, p, use_tqdm=False) for p in (penalized, ruled)]
    assert sum(ahead) >= 10, ahead
    for got, want in zip(outs, ref):
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert all(o.outputs[0].finish_reason == "length" for o in got)
