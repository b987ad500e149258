"""Scheduling ahead on one stage (``uniproc``, ``schedule_ahead=True``): the same tokens as
without it for every policy, greedy and seeded sampling, with stop tokens ending requests
whose next decode was already scheduled (its token dropped), and decodes really scheduled
ahead (the check means something). The pipeline (Ray, the token ring) is tested in
``tests/dist/test_schedule_ahead_ray.py``."""

from __future__ import annotations

import random

import pytest
from helpers import record_ahead

from sarathi_pp import LLM, SamplingParams

POLICIES = ("sarathi", "vllm", "orca", "simple_chunking")
KW = dict(max_model_len=256, dtype="float32")


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 17, 60, 150, 41, 9, 33)]


def run(llm: LLM, params) -> list[tuple[list[int], str | None]]:
    outs = llm.generate(prompts(), params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def settings() -> dict[str, object]:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = [
        SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True)
        for i in range(7)
    ]
    return {"greedy": greedy, "seeded": seeded}


@pytest.fixture(scope="module")
def reference(llama_dir):
    out = {}
    with LLM(str(llama_dir), **KW, schedule_ahead=False) as llm:
        for policy in POLICIES:
            llm.engine.set_scheduler(policy=policy, chunk_size=16, tile_align=False)
            for name, params in settings().items():
                out[policy, name] = run(llm, params)
    tokens = [t for t, _ in out["sarathi", "greedy"]]
    assert len({tuple(t) for t in tokens}) > 1 and len(set(tokens[0])) > 1  # varied
    return out


def test_ahead_equals_not_ahead_for_every_policy(llama_dir, reference):
    with LLM(str(llama_dir), **KW, schedule_ahead=True) as llm:
        assert llm.engine.schedule_ahead and llm.engine.max_inflight == 2
        ahead = record_ahead(llm.engine)
        for policy in POLICIES:
            llm.engine.set_scheduler(policy=policy, chunk_size=16, tile_align=False)
            for name, params in settings().items():
                ahead.clear()
                assert run(llm, params) == reference[policy, name], (policy, name)
                assert sum(ahead) >= 5, (policy, name, ahead)


def test_a_stop_token_ends_a_request_whose_next_decode_was_ahead(llama_dir, reference):
    # stop at each request's 5th greedy token: its 6th decode is already scheduled then
    greedy = [t for t, _ in reference["sarathi", "greedy"]]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[t[4]])
        for t in greedy
    ]
    expected = []
    for t in greedy:
        n = t.index(t[4]) + 1
        expected.append((t[:n], "stop"))
    with LLM(str(llama_dir), **KW, schedule_ahead=True, chunk_size=16, tile_align=False) as llm:
        assert run(llm, params) == expected
        bm = llm.engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()
