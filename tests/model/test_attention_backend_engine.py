"""The engine with ``model.attention_backend`` set: ``flex_paged`` on CPU (FlexAttention
eagerly, decodes and prefill chunks) gives the greedy tokens of the ``torch`` backend, and
the run dir says which backend ran on the stage and that nothing fell back; a backend that
cannot run here is a recorded fallback, or under ``strict_attention_backend`` an error at
start. (PP=2 on Ray: ``tests/dist/test_attention_backend_pp2.py``.)"""

from __future__ import annotations

import json
import random

import pytest

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.report.text import attention_text
from sarathi_pp.stages.model.backend_choice import AttentionFallbackError

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 40, 90, 17)]


def run(model_dir, run_dir, backend: str, **kw) -> tuple[list[list[int]], dict]:
    with LLM(
        str(model_dir), max_model_len=256, dtype="float32", chunk_size=32, tile_align=False,
        block_size=16, run_dir=str(run_dir), **{"model.attention_backend": backend}, **kw,
        **{"cache.num_kv_blocks": 64},  # eager FlexAttention scores every slot of the cache
    ) as llm:  # fmt: skip
        outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
        llm.engine.write_run_records()
    summary = json.loads((run_dir / "summary.json").read_text())
    return [o.outputs[0].token_ids for o in outs], summary


def test_flex_paged_engine_equals_torch_and_records_it(llama_dir, tmp_path):
    ref, ref_summary = run(llama_dir, tmp_path / "torch", "torch")
    got, summary = run(
        llama_dir, tmp_path / "flex", "flex_paged", **{"model.strict_attention_backend": True}
    )
    assert len({tuple(t) for t in ref}) > 1  # varied, so equality means something
    assert got == ref
    assert summary["attention"] == [{"stage": 0, "backend": "flex_paged", "fallbacks": []}]
    assert ref_summary["attention"] == [{"stage": 0, "backend": "torch", "fallbacks": []}]
    assert attention_text(summary) == ["attention: stage 0 flex_paged (no fallback)"]


def test_a_backend_that_cannot_run_is_recorded(llama_dir, tmp_path):
    got, summary = run(llama_dir, tmp_path / "flash", "flash_attn")
    (entry,) = summary["attention"]
    assert entry["backend"] in ("torch", "cpu_paged") and entry["backend"] != "flash_attn"
    assert entry["fallbacks"][0].startswith("flash_attn cannot run here: it runs on CUDA")
    lines = attention_text(summary)
    assert (
        lines[0].startswith("attention: stage 0 ") and "stage 0 fell back: flash_attn" in lines[1]
    )


def test_strict_refuses_to_start_on_a_fallback(llama_dir):
    with pytest.raises(AttentionFallbackError, match="flash_attn cannot run here"):
        LLM(
            str(llama_dir), max_model_len=256, dtype="float32",
            **{"model.attention_backend": "flash_attn", "model.strict_attention_backend": True},
        )  # fmt: skip
