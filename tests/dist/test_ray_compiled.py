"""The Ray Compiled Graph executor (``executor="ray_compiled"``): the same greedy tokens as
one stage for every scheduler at PP=2 and PP=3, with more micro-batches in flight than
stages too; every stage's timing of every micro-batch in the run dir, in pipeline order;
no ``torch.distributed`` group (the graph's channels carry the hidden states).

The fault tests (a request that makes a stage raise, a killed stage, no restart left, a
stalled stage, Ctrl-C) run on both Ray executors in ``test_faults.py``."""

from __future__ import annotations

import random

import pytest

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.records.events import read_events

SCHEDULERS = ("sarathi", "vllm", "orca", "simple_chunking")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def make_prompts(lens=(3, 17, 60, 150, 41), seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lens]


def tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def one_stage_tokens(model_dir, prompts) -> dict[str, list[list[int]]]:
    """Per scheduler, the tokens of one stage (no pipeline) on ``prompts``; varied, so an
    equality with them means something."""
    out = {}
    with LLM(str(model_dir), max_model_len=256, dtype="float32") as pp1:
        for policy in SCHEDULERS:
            pp1.engine.set_scheduler(policy=policy, chunk_size=16, tile_align=False)
            out[policy] = tokens(pp1, prompts)
    assert len({tuple(t) for t in out["sarathi"]}) > 1
    return out


@pytest.fixture(scope="module")
def pp1_reference(llama_dir):
    prompts = make_prompts()
    return prompts, one_stage_tokens(llama_dir, prompts)


@pytest.mark.parametrize("num_stages, in_flight", [(2, None), (2, 3), (3, None), (2, "auto")])
def test_compiled_pipeline_equals_one_stage_for_every_policy(
    ray_cluster, llama3_rope_dir, num_stages, in_flight
):
    prompts = make_prompts(seed=num_stages)
    kw = dict(max_model_len=256, dtype="float32")
    reference = one_stage_tokens(llama3_rope_dir, prompts)
    with LLM(
        str(llama3_rope_dir), **kw, pipeline_parallel_size=num_stages, executor="ray_compiled",
        num_microbatches_in_flight=in_flight,
    ) as llm:  # fmt: skip
        # auto: the stages (a compiled graph has no token ring: nothing ahead)
        expected = num_stages if in_flight == "auto" else in_flight or num_stages
        assert llm.engine.max_inflight == expected
        for policy in SCHEDULERS:
            llm.engine.set_scheduler(policy=policy, chunk_size=16, tile_align=False)
            assert tokens(llm, prompts) == reference[policy], policy


def test_compiled_run_dir_has_every_stage_in_pipeline_order(
    ray_cluster, llama_dir, pp1_reference, tmp_path
):
    prompts, reference = pp1_reference
    run = tmp_path / "run"
    with LLM(
        str(llama_dir), pipeline_parallel_size=2, max_model_len=256, dtype="float32",
        executor="ray_compiled", chunk_size=16, tile_align=False, run_dir=str(run),
    ) as llm:  # fmt: skip
        assert tokens(llm, prompts) == reference["sarathi"]
        group = llm.engine.executor.actors[0].group_initialized.remote()
        assert ray_cluster.get(group) is False  # the graph's channels, no gloo group
    records = read_events(run / "events.jsonl")
    issued = sorted(r["mb"] for r in records if r["type"] == "issue")
    assert len(issued) > 10
    stages = {(r["stage"], r["mb"]): r for r in records if r["type"] == "stage"}
    for mb in issued:
        first, last = stages[(0, mb)], stages[(1, mb)]
        assert first["compute_start"] <= first["compute_end"] <= first["send_end"]
        # stage 1 starts on the hidden states stage 0 produced (one clock on one node)
        assert last["input_ready"] >= first["compute_end"] - 1e-3, mb
        assert last["compute_start"] <= last["compute_end"]
