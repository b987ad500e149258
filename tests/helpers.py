"""Tiny random Hugging Face models and the Hugging Face greedy oracle for the tests.

Each variant is a small causal LM (hidden 64, 2-3 layers, byte vocab) built from a
transformers config class with seeded random weights, saved as float32 safetensors next to
the byte tokenizer (``sarathi_pp.stages.loader.builtin``). ``initializer_range=0.3`` makes greedy
outputs vary token to token, so a wrong token is visible rather than hidden in a repeat.

The oracle is ``hf_greedy``: Hugging Face's own ``generate`` on one unpadded prompt. Random
models produce near-ties now and then; ``assert_greedy_match`` accepts a divergence only
at a step where the reference's top-2 logit margin is below ``tol``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from sarathi_pp.stages.loader.builtin import (
    BOS_TOKEN_ID,
    BYTE_VOCAB_SIZE,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    build_model_dir,
)

TINY_DIMS: dict[str, Any] = {
    "vocab_size": BYTE_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA: 2 query heads per KV head
    "max_position_embeddings": 512,
    "initializer_range": 0.3,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": PAD_TOKEN_ID,
    "dtype": "float32",
}

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Below max_position_embeddings, so prompts past 128 tokens hit the scaled band.
    "original_max_position_embeddings": 128,
}


def _llama() -> LlamaConfig:
    return LlamaConfig(**TINY_DIMS, tie_word_embeddings=False)


def _llama3_rope() -> LlamaConfig:
    return LlamaConfig(**{**TINY_DIMS, "num_hidden_layers": 3}, rope_scaling=LLAMA3_ROPE)


def _mistral() -> MistralConfig:
    # No sliding window: the runtime attends to the whole context, as HF then does.
    return MistralConfig(**TINY_DIMS, sliding_window=None, tie_word_embeddings=False)


def _qwen2() -> Qwen2Config:
    # Qwen2: q/k/v projections carry a bias; input and output embeddings are shared.
    return Qwen2Config(**TINY_DIMS, tie_word_embeddings=True, use_sliding_window=False)


def _qwen2_deep() -> Qwen2Config:
    # Four layers: enough for a 4-stage pipeline, whose last stage needs the tied embedding.
    return Qwen2Config(
        **{**TINY_DIMS, "num_hidden_layers": 4}, tie_word_embeddings=True, use_sliding_window=False
    )


# name -> (config factory, seed, max_shard_size or None). Distinct seeds: Mistral without a
# window is Llama's architecture, and the same seed would give it the very same weights.
VARIANTS: dict[str, tuple[Callable[[], Any], int, str | None]] = {
    "llama": (_llama, 0, None),
    "llama3-rope": (_llama3_rope, 1, None),
    "mistral": (_mistral, 2, None),
    "qwen2": (_qwen2, 3, None),
    "llama-sharded": (_llama, 0, "40KB"),  # llama's weights in shards + an index json
    "qwen2-4layer": (_qwen2_deep, 4, None),
}


def build_variant(name: str, root: str | Path) -> Path:
    """Build tiny model ``name`` (a key of ``VARIANTS``) into ``root/name``."""
    if name not in VARIANTS:
        raise ValueError(f"unknown tiny model {name!r}; valid: {', '.join(VARIANTS)}")
    make_config, seed, max_shard_size = VARIANTS[name]
    return build_model_dir(Path(root) / name, make_config(), seed, max_shard_size)


# --- the Hugging Face oracle -----------------------------------------------------------------
@lru_cache(maxsize=8)
def _hf_model(model_dir: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


_HF_CACHE: dict[tuple[str, tuple[int, ...], int, bool], tuple[list[int], list[float]]] = {}


def _top2_margins(step_logits: Sequence[torch.Tensor]) -> list[float]:
    # step_logits: one [1, vocab] tensor per generated token
    top2 = torch.stack([s[0] for s in step_logits]).float().topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


def hf_processed_greedy(
    model_dir: str | Path,
    prompt: Sequence[int],
    max_new_tokens: int,
    process: Callable[[torch.Tensor, list[int], list[int]], torch.Tensor],
) -> tuple[list[int], list[float]]:
    """Greedy decoding over HF's logits, step by step, each step's logits first passed
    through ``process(logits, tokens, out)`` (``tokens``: prompt and output so far, ``out``:
    the output alone; a reference for the engine's own logits rules); the tokens and each
    step's top-2 margin."""
    model = _hf_model(str(model_dir))
    tokens, out, margins = list(prompt), [], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = process(model(torch.tensor([tokens])).logits[0, -1].float(), tokens, out)
            top2 = logits.topk(2).values
            margins.append((top2[0] - top2[1]).item())
            token = int(logits.argmax())
            out.append(token)
            tokens.append(token)
    return out, margins


def hf_greedy(
    model_dir: str | Path,
    prompt_token_ids: Sequence[int],
    max_new_tokens: int,
    ignore_eos: bool = True,
) -> tuple[list[int], list[float]]:
    """Hugging Face's greedy tokens for one prompt and the top-2 logit margin of each step.

    ``ignore_eos=True`` (how the engine is usually compared) generates exactly
    ``max_new_tokens``, through any EOS; otherwise generation stops after the EOS token,
    which is included. Results are cached per (model, prompt, n, ignore_eos).
    """
    key = (str(model_dir), tuple(prompt_token_ids), max_new_tokens, ignore_eos)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = _run_hf_greedy(*key)
    generated, margins = _HF_CACHE[key]
    return list(generated), list(margins)


def _run_hf_greedy(
    model_dir: str, prompt: tuple[int, ...], max_new_tokens: int, ignore_eos: bool
) -> tuple[list[int], list[float]]:
    model = _hf_model(model_dir)
    # eos_token_id=None overrides the checkpoint's generation_config (checked in
    # test_fixtures); min_new_tokens would instead mask EOS and change the argmax.
    eos: dict[str, Any] = {"eos_token_id": None} if ignore_eos else {}
    input_ids = torch.tensor([list(prompt)], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=model.config.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
            **eos,
        )
    generated = out.sequences[0, len(prompt) :].tolist()
    if ignore_eos:
        assert len(generated) == max_new_tokens, f"HF stopped early: {generated}"
    return generated, _top2_margins(out.logits)


def assert_greedy_match(
    ours: Sequence[int], ref: Sequence[int], margins: Sequence[float], tol: float = 1e-4
) -> None:
    """Pass if ``ours == ref``, or if they first differ where the reference nearly tied.

    After a near-tie (top-2 margin < ``tol``) either token is a correct greedy choice and
    the continuations legitimately differ, so nothing after it is compared.
    """
    for step_idx, (a, b) in enumerate(zip(ours, ref, strict=False)):  # lengths checked below
        if a == b:
            continue
        if margins[step_idx] < tol:
            return
        raise AssertionError(
            f"greedy tokens diverge at step {step_idx}: ours {a} vs HF {b} "
            f"(HF top-2 margin {margins[step_idx]:.3g} >= tol {tol:g})\n"
            f"  ours: {list(ours)}\n  HF:   {list(ref)}"
        )
    if len(ours) != len(ref):
        raise AssertionError(
            f"greedy outputs agree on {min(len(ours), len(ref))} tokens but have lengths "
            f"{len(ours)} (ours) vs {len(ref)} (HF)\n  ours: {list(ours)}\n  HF:   {list(ref)}"
        )


def torchrun_command(model_dir: Path, *args: str) -> list[str]:
    """``torchrun --standalone --nproc-per-node 2 -m sarathi_pp.launch.torchrun --model
    model_dir *args`` with this interpreter."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "sarathi_pp.launch.torchrun", "--model", str(model_dir), *args,
    ]  # fmt: skip


def record_submits(engine: Any, fact: Callable[[Any], Any]) -> list:
    """From now on, ``fact(microbatch)`` for each micro-batch ``engine`` hands its executor,
    taken as it is handed over; the list fills as it runs."""
    submit, seen = engine.executor.submit, []

    def recording(microbatch: Any) -> None:
        seen.append(fact(microbatch))
        submit(microbatch)

    engine.executor.submit = recording
    return seen


def record_ahead(engine: Any) -> list[bool]:
    """From now on, for each micro-batch ``engine`` hands its executor, whether it was
    scheduled ahead (takes decode inputs over the token ring); the list fills as it runs."""
    return record_submits(engine, lambda microbatch: bool(microbatch.ring_sources))


def paged_microbatch(
    spans: Sequence[tuple[int, int, bool]], block_size: int, spare_blocks: int, seed: int
) -> tuple[Any, int]:
    """A micro-batch of one chunk per ``(start, num_tokens, is_prefill)`` span (sequence ids
    0, 1, ...), each given the blocks it needs in an order shuffled by ``seed``, and the
    cache's block count (what the spans need + ``spare_blocks``)."""
    from sarathi_pp.microbatch import MicroBatch, ScheduledChunk

    num_blocks = sum(-(-(start + n) // block_size) for start, n, _ in spans) + spare_blocks
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    chunks = []
    for seq_id, (start, n, prefill) in enumerate(spans):
        need = -(-(start + n) // block_size)
        table, order = tuple(order[:need]), order[need:]
        chunks.append(ScheduledChunk(seq_id, start, tuple(range(n)), prefill, table))
    return MicroBatch(1, tuple(chunks)), num_blocks
