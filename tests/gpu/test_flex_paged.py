"""CUDA attention without flash-attn: ``flex_paged`` (FlexAttention compiled by inductor to
Triton) over the paged cache in place, decode rows and prefill chunks, equals gather + SDPA
with no fallback (the record is strict: a fallback raises); the backend CUDA picks when
flash-attn is missing; and a whole engine run on it matches Hugging Face, the run dir
saying flex_paged ran with no fallback. Skipped without a GPU (the same code runs on CPU,
eagerly and compiled, in tests/model/test_flex_paged_cpu.py). Unverified: never run on a GPU
yet."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_greedy_match, hf_greedy, paged_microbatch

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.microbatch import MicroBatch
from sarathi_pp.stages.model import backend_choice
from sarathi_pp.stages.model.attention import FlexPagedAttention, TorchAttention
from sarathi_pp.stages.model.backend_choice import AttentionRecord, select_backend
from sarathi_pp.stages.worker.metadata import build_metadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def hybrid(block_size: int) -> tuple[MicroBatch, int]:
    """Two prefill chunks (one over a cached prefix) and decodes of mixed lengths."""
    spans = [(0, 40, True), (300, 77, True), (0, 1, False), (16, 1, False), (512, 1, False)]
    spans.append((2 * block_size - 1, 1, False))
    return paged_microbatch(spans, block_size, spare_blocks=5, seed=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 256])
def test_flex_paged_equals_gather_sdpa(monkeypatch, block_size, dtype):
    monkeypatch.setattr(backend_choice, "flash_attn_available", lambda: False)
    assert select_backend(torch.device("cuda"), block_size, dtype) == "flex_paged"
    microbatch, num_blocks = hybrid(block_size)
    g = torch.Generator().manual_seed(2)
    n = microbatch.num_tokens
    q, k, v = (torch.randn(n, h, 64, generator=g) for h in (8, 2, 2))
    kc, vc = torch.randn(2, num_blocks * block_size, 2, 64, generator=g).unbind(0)
    q, k, v, kc, vc = (t.to("cuda", dtype) for t in (q, k, v, kc, vc))
    cuda = torch.device("cuda")
    _, meta = build_metadata(microbatch, block_size, cuda, "flex_paged")
    record = AttentionRecord(0, "flex_paged", strict=True)
    out = FlexPagedAttention(8, 2, 64, record).forward(q, k, v, kc.clone(), vc.clone(), meta)
    assert record.fallbacks == []
    _, meta = build_metadata(microbatch, block_size, cuda, "torch")
    f = [t.float() for t in (q, k, v, kc, vc)]
    ref = TorchAttention(8, 2, 64).forward(*f, meta)
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.float(), ref, **tol)


def test_engine_on_flex_paged_matches_hf(monkeypatch, llama_dir, tmp_path):
    monkeypatch.setattr(backend_choice, "flash_attn_available", lambda: False)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((3, 40, 300))]
    with LLM(
        str(llama_dir), device="cuda", dtype="float32", block_size=16, chunk_size=64,
        max_model_len=512, run_dir=str(tmp_path / "run"),
        **{"model.attention_backend": "flex_paged", "model.strict_attention_backend": True},
    ) as llm:  # fmt: skip
        assert llm.engine.executor.runner.backend == "flex_paged"
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        llm.engine.write_run_records()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["attention"] == [{"stage": 0, "backend": "flex_paged", "fallbacks": []}]
    for out, p in zip(outs, prompts):
        ref, margins = hf_greedy(llama_dir, p, 12)
        assert_greedy_match(out.outputs[0].token_ids, ref, margins)
