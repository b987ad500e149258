"""``model.attention_backend: flex_paged`` at PP=2 on Ray (CPU, FlexAttention eagerly): the
greedy tokens of one stage on the ``torch`` backend, and the run dir says flex_paged ran on
every stage with no fallback (each stage's report reaches the driver with its events)."""

from __future__ import annotations

import json
import random

import pytest

from sarathi_pp import LLM, SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
KW = {
    **dict(max_model_len=256, dtype="float32", chunk_size=32, tile_align=False, block_size=16),
    "cache.num_kv_blocks": 64,  # eager FlexAttention scores every slot of the cache
}


def test_pp2_flex_paged_equals_pp1_torch(ray_cluster, llama_dir, tmp_path):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 70, 33)]
    with LLM(str(llama_dir), **KW, **{"model.attention_backend": "torch"}) as pp1:
        ref = [o.outputs[0].token_ids for o in pp1.generate(prompts, GREEDY, use_tqdm=False)]
    run = tmp_path / "run"
    with LLM(
        str(llama_dir), **KW, pipeline_parallel_size=2, executor="ray", run_dir=str(run),
        **{"model.attention_backend": "flex_paged", "model.strict_attention_backend": True},
    ) as llm:  # fmt: skip
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        llm.engine.write_run_records()
    assert got == ref
    summary = json.loads((run / "summary.json").read_text())
    assert summary["attention"] == [
        {"stage": s, "backend": "flex_paged", "fallbacks": []} for s in (0, 1)
    ]
