"""Greedy token ids identical to Hugging Face for every scheduler, chunk size, tile setting,
model family, and with preemption (each prompt compared with HF run on it alone)."""

from __future__ import annotations

import random

import pytest
from helpers import assert_greedy_match, hf_greedy

from sarathi_pp import LLM, SamplingParams

PROMPT_LENS = (3, 17, 60, 150)
MAX_TOKENS = 12
SCHEDULERS = ("sarathi", "vllm", "orca", "simple_chunking")
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def make_prompts(vocab: int = 256, seed: int = 0, lens=PROMPT_LENS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def check_against_hf(model_dir, outputs, prompts) -> None:
    for out, prompt in zip(outputs, prompts):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].finish_reason == "length"
        ref, margins = hf_greedy(model_dir, prompt, MAX_TOKENS)
        assert_greedy_match(out.outputs[0].token_ids, ref, margins)


# Four prompts of ~40 tokens fit in 44 blocks of 4 tokens, but not once each has grown by
# 12 tokens (13-14 blocks each): decodes must preempt.
PREEMPTING = dict(chunk_size=24, block_size=4, num_kv_blocks=44, max_model_len=176)


def preempting_run(model_dir, params):
    """``make_prompts(seed=3)``'s four ~40-token prompts on a cache that forces preemption:
    the prompts and their outputs (``num_preemptions > 0`` checked)."""
    prompts = make_prompts(seed=3, lens=(40, 41, 42, 43))
    with LLM(str(model_dir), dtype="float32", **PREEMPTING) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
    return prompts, outs


def run(model_dir, prompts, **kwargs):
    kwargs.setdefault("max_model_len", 256)
    llm = LLM(str(model_dir), dtype="float32", **kwargs)
    return llm, llm.generate(prompts, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64, 1000])
def test_schedulers_and_chunk_sizes_match_hf(llama_dir, scheduler, chunk_size):
    prompts = make_prompts()
    _, outs = run(llama_dir, prompts, scheduler=scheduler, chunk_size=chunk_size, tile_align=False)
    check_against_hf(llama_dir, outs, prompts)


@pytest.mark.parametrize("scheduler", ["sarathi", "simple_chunking"])
@pytest.mark.parametrize("chunk_size", [20, 44])  # not multiples of the tile: trimming must happen
def test_tile_alignment_trims_and_matches_hf(llama_dir, scheduler, chunk_size):
    prompts = make_prompts(seed=1)
    llm = LLM(
        str(llama_dir),
        max_model_len=256,
        scheduler=scheduler,
        chunk_size=chunk_size,
        tile_align=True,
        tile_size=8,
    )
    sizes = []
    real_submit = llm.engine.executor.submit
    llm.engine.executor.submit = lambda microbatch: (
        sizes.append((microbatch.num_prefill_tokens, microbatch.num_tokens)),
        real_submit(microbatch),
    )[1]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    check_against_hf(llama_dir, outs, prompts)
    trimmed = [(p, n) for p, n in sizes if p and n < chunk_size and n % 8 == 0]
    assert trimmed, f"tile alignment never trimmed a chunk: {sizes}"
    for p, n in sizes:
        assert n <= chunk_size
        if p > n % 8:  # the never-to-nothing rule allows misalignment only otherwise
            assert n % 8 == 0, (p, n)


@pytest.mark.parametrize("variant", ["llama3-rope", "mistral", "qwen2", "llama-sharded"])
@pytest.mark.parametrize("scheduler", ["sarathi", "vllm"])
def test_model_families_match_hf(tiny_model, variant, scheduler):
    model_dir = tiny_model(variant)
    prompts = make_prompts(seed=2)
    _, outs = run(
        model_dir, prompts, scheduler=scheduler, chunk_size=32, tile_align=True, tile_size=16
    )
    check_against_hf(model_dir, outs, prompts)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_preemption_keeps_outputs_exact(llama_dir, scheduler):
    prompts = make_prompts(seed=3, lens=(40, 41, 42, 43))
    # Four prompts of ~40 tokens fit in 44 blocks of 4 tokens, but not once each has grown
    # by 12 tokens (13-14 blocks each): decodes must preempt.
    llm, outs = run(
        llama_dir,
        prompts,
        scheduler=scheduler,
        chunk_size=24,
        block_size=4,
        num_kv_blocks=44,
        max_model_len=176,
    )
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(o.metrics.num_preemptions > 0 for o in outs)
    check_against_hf(llama_dir, outs, prompts)
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # nothing leaked


def test_outputs_vary(llama_dir):
    """A model that repeats one token would make the comparisons above meaningless."""
    _, outs = run(llama_dir, make_prompts(), scheduler="sarathi")
    for out in outs:
        assert len(set(out.outputs[0].token_ids)) > 3, out.outputs[0].token_ids
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == len(outs)


def test_torch_ops_without_the_cpu_kernels_match_hf(llama_dir, monkeypatch):
    """The portable path (every CPU kernel off: torch's element-wise ops, F.linear, gather +
    SDPA; what bf16 and non-x86 CPUs run) stays exact too."""
    from sarathi_pp.stages.kernels.cpu import fused, paged_attention

    for switch in ("SARATHI_PP_CPU_FUSED", "SARATHI_PP_CPU_GEMM", "SARATHI_PP_ONEDNN_LINEAR"):
        monkeypatch.setenv(switch, "0")
    monkeypatch.setenv("SARATHI_PP_CPU_KERNEL", "0")
    fused.load_fused.cache_clear()
    paged_attention.load_kernel.cache_clear()
    try:
        prompts = make_prompts(seed=3)
        llm, outs = run(llama_dir, prompts, scheduler="sarathi", chunk_size=16)
        model = llm.engine.executor.runner.model
        assert model.ops.name == "torch" and llm.engine.executor.runner.backend == "torch"
        assert {lin.kind for lyr in model.layers for lin in (lyr.qkv, lyr.gate_up)} == {"f_linear"}
        check_against_hf(llama_dir, outs, prompts)
    finally:
        fused.load_fused.cache_clear()
        paged_attention.load_kernel.cache_clear()


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_packed_weights_and_lm_head_match_hf(tiny_model, variant, monkeypatch):
    """The test models' weights are below ``MIN_PACKED_ELEMENTS`` (``F.linear``): with the
    threshold at 1 every layer weight and the lm_head take the packed kernels the real models
    take, and stay exact (with the panel kernel the layers run as the layer loop). Tied
    embeddings on one stage keep the lm_head unpacked (it is the embedding the stage looks
    tokens up in)."""
    from sarathi_pp.stages.kernels.cpu import layer_loop as kernel_layer_loop
    from sarathi_pp.stages.model import linear

    monkeypatch.setattr(linear, "MIN_PACKED_ELEMENTS", 1)
    model_dir = tiny_model(variant)
    prompts = make_prompts(seed=4)
    llm, outs = run(model_dir, prompts, scheduler="sarathi", chunk_size=16)
    model = llm.engine.executor.runner.model
    kinds = {lin.kind for lyr in model.layers for lin in (lyr.qkv, lyr.o, lyr.gate_up, lyr.down)}
    if linear.available_kinds() != ["f_linear"]:  # oneDNN or the panel kernel here
        assert "f_linear" not in kinds
    if kinds == {"panel_gemm"} and kernel_layer_loop.load_loop() is not None:
        # the layers ran as one C call (``layers_cpu``), with the kernels below it
        assert model.layer_loop(llm.engine.executor.runner.kv) is not None
    if variant == "qwen2":  # tied
        assert model.lm_head.kind == "f_linear" and model.lm_head.weight is model.embed
    else:
        # packed as the layers are (its kind may differ: panel_gemm needs whole panels of 16
        # rows, and the test vocabularies are not all multiples of 16)
        assert model.lm_head.is_packed == (kinds != {"f_linear"})
    check_against_hf(model_dir, outs, prompts)
