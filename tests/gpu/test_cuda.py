"""CUDA paths (flash-attn's paged kernels, bf16, NCCL between stages); skipped without a GPU.

The oracle is the same as on CPU: Hugging Face greedy tokens on each prompt alone (float32,
so the tie rule stays meaningful), and PP=1 for the pipeline.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import assert_greedy_match, hf_greedy

from sarathi_pp import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 17, 60, 300)]


@pytest.mark.parametrize("block_size", [16, 256])  # 256: flash-attn's paged kernels when installed
def test_cuda_float32_matches_hf(llama_dir, block_size):
    with LLM(
        str(llama_dir),
        device="cuda",
        dtype="float32",
        block_size=block_size,
        chunk_size=64,
        max_model_len=512,
    ) as llm:
        outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    for out, p in zip(outs, prompts()):
        ref, margins = hf_greedy(llama_dir, p, 12)
        assert_greedy_match(out.outputs[0].token_ids, ref, margins)


def test_cuda_bf16_runs_and_mostly_agrees(llama_dir):
    with LLM(str(llama_dir), device="cuda", dtype="bfloat16", max_model_len=512) as llm:
        outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    first = [o.outputs[0].token_ids[0] for o in outs]
    ref = [hf_greedy(llama_dir, p, 12)[0][0] for p in prompts()]
    assert sum(a == b for a, b in zip(first, ref)) >= 3  # bf16 rounding may flip a near-tie


def test_cuda_kv_cache_leaves_the_activations_and_shutdown_hands_memory_back(llama_dir):
    """On CUDA the stage's KV budget is M_G - M_S - M_A (``planner.memory.with_activations``:
    the peak activations of the largest micro-batch, which vLLM measures with a profiling
    pass), and a shut-down engine holds no device memory (``ModelRunner.release``)."""
    from sarathi_pp.planner.memory import kv_cache_bytes

    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    with LLM(
        str(llama_dir), device="cuda", dtype="float32", max_model_len=512, chunk_size=64
    ) as llm:
        [m] = llm.engine.stage_memory
        assert m.activation_bytes > 0
        assert kv_cache_bytes(m) == m.memory_bytes - m.param_bytes - m.activation_bytes
        [out] = llm.generate([prompts()[1]], GREEDY, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 12
        assert torch.cuda.memory_allocated() > before
    # the weights and the KV cache are tens of MB; under 1 MiB stays (none is expected)
    assert torch.cuda.memory_allocated() - before < 1 << 20


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_pp2_over_nccl_equals_pp1(llama_dir):
    with LLM(str(llama_dir), device="cuda", dtype="float32", max_model_len=512) as pp1:
        ref = [o.outputs[0].token_ids for o in pp1.generate(prompts(), GREEDY, use_tqdm=False)]
    with LLM(
        str(llama_dir), device="cuda", dtype="float32", max_model_len=512, pipeline_parallel_size=2
    ) as pp2:
        ours = [o.outputs[0].token_ids for o in pp2.generate(prompts(), GREEDY, use_tqdm=False)]
    assert ours == ref


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_pp2_compiled_graph_over_nccl_channels_equals_pp1(llama_dir):
    """``ray_compiled`` on GPUs: the hidden states between the stages go over the graph's
    NCCL channels (Ray's communicator, ``with_tensor_transport``), the rest over shared
    memory. Ray Compiled Graphs need cupy for NCCL: ``pip install 'ray[cgraph]'``."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        pytest.skip("needs Ray (pip install 'ray[default]')")
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("needs cupy for Ray's NCCL channels (pip install 'ray[cgraph]')")
    kw = dict(device="cuda", dtype="float32", max_model_len=512)
    with LLM(str(llama_dir), **kw) as pp1:
        ref = [o.outputs[0].token_ids for o in pp1.generate(prompts(), GREEDY, use_tqdm=False)]
    with LLM(str(llama_dir), **kw, pipeline_parallel_size=2, executor="ray_compiled") as pp2:
        ours = [o.outputs[0].token_ids for o in pp2.generate(prompts(), GREEDY, use_tqdm=False)]
    assert ours == ref
