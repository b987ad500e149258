"""Prefix caching across a pipeline (real Ray actors, PP=2 and PP=3): the same greedy
tokens as one stage without caching for every policy, with more micro-batches in flight
and scheduling ahead; a poisoned request that writes a shared prefix fails alone (the
requests waiting for its blocks compute them themselves); a stage killed while cached
blocks are in use is replaced, every hash is forgotten, and the outputs are unchanged."""

from __future__ import annotations

import json
import os
import random
import subprocess

import pytest
from helpers import torchrun_command

from sarathi_pp import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
POLICIES = ("sarathi", "vllm", "orca", "simple_chunking")
KW = dict(max_model_len=256, dtype="float32")


def prompts(seed: int = 0, num: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 256) for _ in range(50)]
    return [
        system + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 25))] for _ in range(num)
    ]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(llama3_rope_dir):
    with LLM(str(llama3_rope_dir), enable_prefix_caching=False, **KW) as pp1:
        ref = tokens(pp1.generate(prompts(), GREEDY, use_tqdm=False))
    assert len({tuple(t) for t in ref}) > 1
    return ref


@pytest.mark.parametrize(
    "settings",
    [
        dict(pipeline_parallel_size=2),
        dict(pipeline_parallel_size=2, num_microbatches_in_flight=3, schedule_ahead=True),
        dict(pipeline_parallel_size=3),
    ],
    ids=["pp2", "pp2-ahead-m3", "pp3"],
)
def test_pipelines_with_caching_equal_one_stage_without(
    ray_cluster, llama3_rope_dir, reference, settings
):
    with LLM(str(llama3_rope_dir), **KW, **settings) as llm:
        for policy in POLICIES:
            llm.engine.set_scheduler(policy=policy, chunk_size=20, tile_align=False)
            outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
            bm = llm.engine.scheduler.block_manager
            assert tokens(outs) == reference, policy
            assert bm.stats.hits >= 5 * 48, (policy, bm.stats)
            assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("poisoned", [0, 2])
def test_a_poisoned_request_over_a_shared_prefix_fails_alone(
    ray_cluster, llama3_rope_dir, reference, poisoned
):
    """Request 0 writes the system prompt the others wait for; request 2 reads it."""
    fault = {"parallel.inject_fault": f"raise@stage=1,seq={poisoned}"}
    with LLM(str(llama3_rope_dir), pipeline_parallel_size=2, chunk_size=20, tile_align=False,
             **KW, **fault) as llm:  # fmt: skip
        outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
        bm = llm.engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks and llm.engine.is_alive()
        bm.check()
    assert outs[poisoned].outputs[0].finish_reason == "error"
    for i, out in enumerate(outs):
        if i != poisoned:
            assert out.error is None and out.outputs[0].token_ids == reference[i], i


def test_a_stage_lost_with_cached_blocks_in_use(ray_cluster, llama3_rope_dir, reference):
    with LLM(str(llama3_rope_dir), pipeline_parallel_size=2, chunk_size=20, tile_align=False,
             **KW) as llm:  # fmt: skip
        old = list(llm.engine.executor.actors)
        seen: list[int] = []

        def kill_once(index, output):  # after the first finished: cached blocks are held
            if not seen:
                seen.append(llm.engine.scheduler.block_manager.num_cached_blocks)
                ray_cluster.kill(old[1])

        outs = llm.generate(prompts() * 2, GREEDY, use_tqdm=False, on_finished=kill_once)
        assert seen and seen[0] > 0
        assert tokens(outs) == reference * 2
        assert llm.engine.executor.actors[1] is not old[1] and llm.engine.is_alive()
        bm = llm.engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        bm.check()


def test_torchrun_with_caching_equals_one_stage_without(llama_dir, tmp_path):
    """Rank 0's scheduler over torchrun's control plane: prompts over one shared text,
    hits recorded in the run dir, the tokens of one stage without caching."""
    shared = "the pipeline has two stages and a scheduler in front of them " * 3
    prompts = [shared + tail for tail in ("one", "two words", "and three words", "x")]
    out, run = tmp_path / "out.jsonl", tmp_path / "run"
    cmd = torchrun_command(
        llama_dir, "--pipeline-parallel-size", "2", "--max-tokens", "8", "--ignore-eos",
        "--output", str(out), "--chunk-size", "16", "--set", "scheduler.tile_align=false",
        "--set", "model.max_model_len=256", "--set", "parallel.stage_timeout_s=60",
        "--run-dir", str(run), *(a for p in prompts for a in ("--prompt", p)),
    )  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    with LLM(str(llama_dir), max_model_len=256, enable_prefix_caching=False) as pp1:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        ref = pp1.generate(prompts, params, use_tqdm=False)
    assert [r["token_ids"] for r in records] == tokens(ref)
    pc = json.loads((run / "summary.json").read_text())["requests"]["prefix_cache"]
    assert pc["hit_tokens"] >= 3 * 32, pc
