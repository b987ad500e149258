"""CUDA decode attention without flash-attn: FlexAttention (compiled) over the paged cache in
place equals SDPA over the same K/V laid out contiguously; the backend CUDA picks when
flash-attn is missing; and a whole engine run on it matches Hugging Face. Skipped without a
GPU (the same masks run eagerly on CPU in tests/model/test_paged_attention.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_greedy_match, hf_greedy

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.stages.model import attention
from sarathi_pp.stages.model.attention import ATTENTION_BACKENDS, AttentionMetadata, select_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def paged_case(lens, block_size, heads, kv_heads, head_dim, dtype):
    g = torch.Generator().manual_seed(block_size)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 5
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(lens), max(need), dtype=torch.long)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(order[:n])
        order = order[n:]
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    cuda = lambda t: t.to("cuda", dtype if t.is_floating_point() else t.dtype)  # noqa: E731
    return cuda(q), cuda(k_cache), cuda(v_cache), cuda(tables)


def reference(q, k_cache, v_cache, tables, lens, block_size):
    outs = []
    for i, n in enumerate(lens):
        slots = tables[i, :, None] * block_size + torch.arange(block_size, device="cuda")
        slots = slots.flatten()[:n]
        k, v = (c[slots].transpose(0, 1)[None].float() for c in (k_cache, v_cache))
        o = torch.nn.functional.scaled_dot_product_attention(
            q[i][None, :, None].float(), k, v, scale=q.shape[-1] ** -0.5, enable_gqa=True
        )
        outs.append(o[0, :, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_decode_without_flash_attn_equals_sdpa(monkeypatch, block_size, dtype):
    monkeypatch.setattr(attention, "flash_attn_available", lambda: False)
    backend = select_backend(torch.device("cuda"), block_size)
    assert backend == ("torch" if block_size == 1 else "flex_paged")
    lens = [1, 17, 300, block_size, block_size + 1, 513]
    q, k_cache, v_cache, tables = paged_case(lens, block_size, 8, 2, 64, dtype)
    lens_t = torch.tensor(lens, device="cuda")
    max_len = tables.shape[1] * block_size
    meta = AttentionMetadata(
        positions=lens_t - 1,
        slot_mapping=torch.empty(0, dtype=torch.long, device="cuda"),
        num_prefill_tokens=0,
        prefills=[],
        decode_blocks=tables,
        decode_mask=(torch.arange(max_len, device="cuda") < lens_t[:, None])[:, None, None],
        decode_lens=lens_t,
        block_size=block_size,
    )
    attn = ATTENTION_BACKENDS[backend](8, 2, 64)
    out = attn._decode(q, k_cache, v_cache, meta)
    assert getattr(attn, "failed", None) is None  # FlexAttention ran (no silent fallback)
    ref = reference(q, k_cache, v_cache, tables, lens, block_size)
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.float(), ref, **tol)


def test_engine_on_flex_paged_matches_hf(monkeypatch, llama_dir):
    monkeypatch.setattr(attention, "flash_attn_available", lambda: False)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((3, 40, 300))]
    with LLM(
        str(llama_dir), device="cuda", dtype="float32", block_size=16, chunk_size=64,
        max_model_len=512,
    ) as llm:  # fmt: skip
        assert llm.engine.executor.runner.backend == "flex_paged"
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        assert llm.engine.executor.runner.model.layers[0].attention.failed is None
    for out, p in zip(outs, prompts):
        ref, margins = hf_greedy(llama_dir, p, 12)
        assert_greedy_match(out.outputs[0].token_ids, ref, margins)
