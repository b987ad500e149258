"""Prefix caching through the engine (one stage): greedy outputs identical with caching on
and off for every policy, chunk sizes that split a cached prefix mid-block, preemption
under a small cache, ``n > 1``, scheduling ahead; the same as Hugging Face; hits really
happen (the checks mean something). Pipelines: ``tests/dist/test_prefix_caching_pp.py``."""

from __future__ import annotations

import json
import random

import pytest
from helpers import assert_greedy_match, hf_greedy

from sarathi_pp import LLM, SamplingParams

POLICIES = ("sarathi", "vllm", "orca", "simple_chunking")
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def shared_prompts(seed: int = 0, num: int = 6, prefix_len: int = 45) -> list[list[int]]:
    """Prompts over one system prompt of ``prefix_len`` tokens, two of them also sharing a
    second part (a few-shot header), and one unrelated."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 256) for _ in range(prefix_len)]
    header = [rng.randrange(3, 256) for _ in range(21)]
    out = []
    for i in range(num):
        tail = [rng.randrange(3, 256) for _ in range(rng.randrange(1, 30))]
        out.append(system + (header if i % 3 == 1 else []) + tail)
    out.append([rng.randrange(3, 256) for _ in range(33)])
    return out


def generate(model_dir, prompts, params=GREEDY, **kw):
    kw.setdefault("max_model_len", 256)
    with LLM(str(model_dir), dtype="float32", **kw) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.scheduler.block_manager.stats
        bm = llm.engine.scheduler.block_manager
        bm.check()
        assert bm.num_free_blocks == bm.num_blocks  # nothing held once all finished
    return [[c.token_ids for c in o.outputs] for o in outs], outs, stats


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("chunk_size, block_size", [(7, 16), (24, 16), (256, 8)])
def test_outputs_identical_with_caching_on_and_off(llama_dir, policy, chunk_size, block_size):
    prompts = shared_prompts()
    kw = dict(scheduler=policy, chunk_size=chunk_size, block_size=block_size, tile_align=False)
    off, _, none = generate(llama_dir, prompts, enable_prefix_caching=False, **kw)
    on, outs, stats = generate(llama_dir, prompts, enable_prefix_caching=True, **kw)
    assert on == off
    # five requests hit the system prompt's full blocks
    assert none.queries == 0 and stats.hits >= 5 * (45 // block_size) * block_size
    assert outs[0].num_cached_tokens == 0 and all(o.num_cached_tokens for o in outs[1:6])


def test_cached_prefixes_give_hugging_face_tokens(llama_dir):
    prompts = shared_prompts(seed=1)
    got, outs, stats = generate(llama_dir, prompts, chunk_size=16, tile_align=False)
    assert stats.hits > 0
    for tokens, prompt in zip(got, prompts):
        ref, margins = hf_greedy(llama_dir, prompt, GREEDY.max_tokens)
        assert_greedy_match(tokens[0], ref, margins)


def test_preemption_under_a_small_cache(llama_dir):
    """Six ~55-token prompts over one prefix in 44 blocks of 4: decodes preempt, cached
    blocks are evicted and hit again; outputs as without caching."""
    prompts = shared_prompts(seed=3, num=6, prefix_len=30)[:6]
    kw = dict(chunk_size=24, block_size=4, num_kv_blocks=44, max_model_len=176)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    off, _, _ = generate(llama_dir, prompts, params, enable_prefix_caching=False, **kw)
    with LLM(str(llama_dir), dtype="float32", enable_prefix_caching=True, **kw) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.scheduler.block_manager.stats.hits > 0
    assert [[c.token_ids for c in o.outputs] for o in outs] == off


def test_parallel_sampling_children_share_the_prompt(llama_dir):
    prompts = shared_prompts(seed=2, num=2)
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    off, _, _ = generate(llama_dir, prompts, params, enable_prefix_caching=False)
    on, outs, stats = generate(llama_dir, prompts, params, enable_prefix_caching=True)
    assert on == off
    assert stats.requests == 3 * len(prompts) and stats.hits >= (2 * 3 - 1) * 32
    assert all(len(o.outputs) == 3 for o in outs)


@pytest.mark.parametrize("policy", POLICIES)
def test_schedule_ahead_with_caching(llama_dir, policy):
    prompts = shared_prompts(seed=4)
    kw = dict(scheduler=policy, chunk_size=16, tile_align=False, schedule_ahead=True)
    off, _, _ = generate(llama_dir, prompts, enable_prefix_caching=False, **kw)
    on, _, stats = generate(llama_dir, prompts, enable_prefix_caching=True, **kw)
    assert on == off and stats.hits > 0


def test_prompt_logprobs_requests_compute_their_whole_prompt(llama_dir):
    prompts = shared_prompts(seed=5, num=3)[:3]
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    wants = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    with LLM(str(llama_dir), dtype="float32", max_model_len=256) as llm:
        first = llm.generate(prompts[:1], plain, use_tqdm=False)[0]
        outs = llm.generate(prompts[1:], wants, use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert all(o.num_cached_tokens is None and o.prompt_logprobs for o in outs)
    with LLM(str(llama_dir), dtype="float32", max_model_len=256,
             enable_prefix_caching=False) as llm:  # fmt: skip
        ref = llm.generate(prompts[1:], wants, use_tqdm=False)
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [p and sorted(p) for p in a.prompt_logprobs] == [
            p and sorted(p) for p in b.prompt_logprobs
        ]


def test_hits_are_recorded_in_the_run_dir(llama_dir, tmp_path, capsys):
    from sarathi_pp.cli import main
    from sarathi_pp.report.request_metrics import load_requests

    prompts = shared_prompts(seed=6)
    run = tmp_path / "run"
    with LLM(str(llama_dir), dtype="float32", max_model_len=256, run_dir=str(run)) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    rows = load_requests(run / "requests.csv")
    cached = {r.request_id: r.num_cached_tokens for r in rows}  # in order of finishing
    assert cached == {o.request_id: o.num_cached_tokens for o in outs}
    pc = json.loads((run / "summary.json").read_text())["requests"]["prefix_cache"]
    hits = sum(o.num_cached_tokens for o in outs)
    assert hits > 0 and pc["hit_tokens"] == hits
    assert pc["queried_tokens"] == sum(map(len, prompts))
    assert main(["report", str(run)]) == 0
    assert (
        f"prefix cache: {hits} of {pc['queried_tokens']} prompt tokens" in capsys.readouterr().out
    )


def test_a_cache_salt_shares_blocks_only_with_its_own(llama_dir):
    prompt = shared_prompts(seed=7)[0]
    salted = [{"prompt_token_ids": prompt, "cache_salt": salt} for salt in ("a", "b", "a")] + [
        prompt
    ]
    with LLM(str(llama_dir), dtype="float32", max_model_len=256) as llm:
        outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in salted]
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate([{"prompt_token_ids": prompt, "cache_salt": ""}], GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, 0, (len(prompt) - 1) // 16 * 16, 0]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1


def test_reset_prefix_cache_forgets_what_was_cached(llama_dir):
    prompts = shared_prompts(seed=3)[:3]
    with LLM(str(llama_dir), dtype="float32", max_model_len=256) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        again = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert all(o.num_cached_tokens for o in again)  # every prompt cached by the first run
        llm.engine.add_request("busy", None, GREEDY, prompt_token_ids=prompts[0])
        assert llm.reset_prefix_cache() is False  # a request holds blocks: nothing forgotten
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        assert llm.engine.scheduler.block_manager.num_cached_blocks > 0
        assert llm.reset_prefix_cache() is True
        assert llm.engine.scheduler.block_manager.num_cached_blocks == 0
        after = llm.generate(prompts, GREEDY, use_tqdm=False)
        llm.engine.scheduler.block_manager.check()
    assert [o.num_cached_tokens for o in after] == [o.num_cached_tokens for o in first]
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in first]
