"""The tiny fixture models and the Hugging Face oracle are fit to be the reference.

If a fixture repeated one token, or HF stopped at EOS while the engine ran on, every
comparison test built on them would pass or fail for the wrong reason.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import VARIANTS, assert_greedy_match, hf_greedy
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from sarathi_pp.checkpoint import load_model_spec

PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]  # <s>Hello, world


def test_greedy_outputs_vary(any_model_dir: Path) -> None:
    generated, margins = hf_greedy(any_model_dir, PROMPT, 16)
    assert len(generated) == len(margins) == 16
    assert len(set(generated)) > 3, f"greedy output repeats: {generated}"


def test_spec_matches_hf_parameter_count(any_model_dir: Path) -> None:
    spec = load_model_spec(any_model_dir)
    model = AutoModelForCausalLM.from_pretrained(any_model_dir)
    assert spec.num_params() == sum(p.numel() for p in model.parameters())


def test_tokenizer_is_saved_with_each_model(any_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(any_model_dir)
    assert tok.decode(tok.encode("Hello, wörld!", add_special_tokens=False)) == "Hello, wörld!"
    assert tok.eos_token_id in load_model_spec(any_model_dir).eos_token_ids


def test_variant_features(
    llama_dir: Path, llama3_rope_dir: Path, mistral_dir: Path, qwen2_dir: Path
) -> None:
    llama, llama3 = load_model_spec(llama_dir), load_model_spec(llama3_rope_dir)
    mistral, qwen2 = load_model_spec(mistral_dir), load_model_spec(qwen2_dir)
    assert (llama.num_heads, llama.num_kv_heads, llama.tie_word_embeddings) == (4, 2, False)
    assert (llama3.rope_type, llama3.num_layers) == ("llama3", 3)
    assert mistral.architecture == "MistralForCausalLM" and mistral.sliding_window is None
    assert qwen2.attention_bias and qwen2.tie_word_embeddings
    # Biases are randomized (HF zero-inits them), so a loader that drops them is caught.
    bias = load_file(qwen2_dir / "model.safetensors")["model.layers.0.self_attn.q_proj.bias"]
    assert bias.abs().max() > 0


def test_sharded_variant_matches_unsharded(llama_dir: Path, llama_sharded_dir: Path) -> None:
    index = json.loads((llama_sharded_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    tensors = {}
    for shard in shards:
        tensors.update(load_file(llama_sharded_dir / shard))
    whole = load_file(llama_dir / "model.safetensors")
    assert tensors.keys() == whole.keys()
    assert all(tensors[k].equal(whole[k]) for k in whole)


def test_hf_greedy_ignores_eos_only_when_asked(llama_dir: Path, tmp_path: Path) -> None:
    generated, _ = hf_greedy(llama_dir, PROMPT, 16)
    # Same weights, but EOS is a token greedy decoding is known to emit at step k.
    k = 5
    eos = generated[k]
    first_idx = generated.index(eos)
    model_dir = shutil.copytree(llama_dir, tmp_path / "eos_model")
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((model_dir / name).read_text())
        cfg["eos_token_id"] = eos
        (model_dir / name).write_text(json.dumps(cfg))
    assert hf_greedy(model_dir, PROMPT, 16, ignore_eos=True)[0] == generated
    assert hf_greedy(model_dir, PROMPT, 16, ignore_eos=False)[0] == generated[: first_idx + 1]


def test_hf_greedy_is_cached(qwen2_dir: Path) -> None:
    first = hf_greedy(qwen2_dir, PROMPT, 8)
    first[0].append(-1)  # callers get copies: mutating one must not poison the cache
    assert hf_greedy(qwen2_dir, PROMPT, 8)[0] == first[0][:-1]


def test_assert_greedy_match() -> None:
    ref, margins = [1, 2, 3, 4], [1.0, 1.0, 1e-6, 1.0]
    assert_greedy_match([1, 2, 3, 4], ref, margins)
    assert_greedy_match([1, 2, 9, 9, 9], ref, margins)  # diverged at a near-tie: accepted
    with pytest.raises(AssertionError, match="step 1"):
        assert_greedy_match([1, 9, 3, 4], ref, margins)
    with pytest.raises(AssertionError, match="lengths"):
        assert_greedy_match([1, 2, 3], ref, margins)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_fixture_is_built_once(name: str, tiny_model: Callable[[str], Path]) -> None:
    assert tiny_model(name) is tiny_model(name)
