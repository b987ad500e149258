"""The builtin model: byte tokenizer, cache reuse, atomic build, determinism.

The full ~91M-parameter recipe is never built here (~12 s); the tests swap in a small
recipe through the ``BUILTIN_MODELS`` registry.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType

import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer

from sarathi_pp.stages.loader import builtin
from sarathi_pp.stages.loader.builtin import (
    BOS_TOKEN_ID,
    BYTE_VOCAB_SIZE,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    BuiltinRecipe,
    build_tiny_llama_dir,
    resolve_builtin,
    save_byte_tokenizer,
)

SMALL = MappingProxyType(
    {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    }
)


@pytest.fixture
def small_recipe(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Register ``small`` (a cheap recipe); returns the list of folders it was built into."""
    calls: list[Path] = []

    class Counting(BuiltinRecipe):
        def build(self, path: str | Path) -> Path:
            calls.append(Path(path))
            return super().build(path)

    monkeypatch.setitem(builtin.BUILTIN_MODELS, "small", Counting(version="t1", overrides=SMALL))
    return calls


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("byte_tokenizer")
    save_byte_tokenizer(path, model_max_length=128)
    return path


def test_tokenizer_round_trips(tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = "Hello, wörld!"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))  # token id == byte value
    assert tok.decode(ids) == text
    assert tok.encode(text)[0] == BOS_TOKEN_ID
    assert len(tok) == BYTE_VOCAB_SIZE


def test_tokenizer_special_ids(tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        BOS_TOKEN_ID,
        EOS_TOKEN_ID,
        PAD_TOKEN_ID,
    )


def test_unknown_name_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="tiny-llama"):
        resolve_builtin("no-such-model")


def test_resolve_builds_once_and_reuses(tmp_path: Path, small_recipe: list[Path]) -> None:
    first = Path(resolve_builtin("small", cache_dir=tmp_path))
    assert first == tmp_path / "small-t1"
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    second = Path(resolve_builtin("builtin:small", cache_dir=tmp_path))
    assert second == first
    assert len(small_recipe) == 1
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small-t1"]  # no temp left


def test_built_folder_config_matches_tokenizer(tmp_path: Path, small_recipe: list[Path]) -> None:
    folder = Path(resolve_builtin("small", cache_dir=tmp_path))
    cfg = json.loads((folder / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(folder)
    assert cfg["bos_token_id"] == tok.bos_token_id
    assert cfg["eos_token_id"] == tok.eos_token_id
    assert cfg["vocab_size"] == len(tok)
    assert cfg["dtype"] == "float32"
    assert cfg["tie_word_embeddings"] is False


def test_cache_dir_from_env(
    tmp_path: Path, small_recipe: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(builtin.CACHE_ENV, str(tmp_path))
    assert resolve_builtin("small") == str(tmp_path / "small-t1")


def test_losing_a_build_race_uses_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "small-t1"

    class Racing(BuiltinRecipe):
        def build(self, path: str | Path) -> Path:
            # Another process finishes first: its folder appears under the final name.
            super().build(dest)
            (dest / "theirs").touch()
            return super().build(path)

    monkeypatch.setitem(builtin.BUILTIN_MODELS, "small", Racing(version="t1", overrides=SMALL))
    assert resolve_builtin("small", cache_dir=tmp_path) == str(dest)
    assert (dest / "theirs").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small-t1"]  # ours discarded


def test_build_is_deterministic(tmp_path: Path) -> None:
    a = build_tiny_llama_dir(tmp_path / "a", **SMALL)
    b = build_tiny_llama_dir(tmp_path / "b", **SMALL)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    c = build_tiny_llama_dir(tmp_path / "c", seed=1, **SMALL)
    tensors_a, tensors_c = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    assert not tensors_a["lm_head.weight"].equal(tensors_c["lm_head.weight"])


def test_default_recipe_dims() -> None:
    # The default is checked without building it: ~91M params, GQA, byte vocab.
    from sarathi_pp.model_spec import spec_from_dict

    cfg = builtin.tiny_llama_config().to_dict()
    spec = spec_from_dict({**cfg, "architectures": ["LlamaForCausalLM"]})
    assert (spec.num_heads, spec.num_kv_heads, spec.num_layers) == (16, 4, 8)
    assert 80e6 < spec.num_params() < 120e6
    assert spec.vocab_size == BYTE_VOCAB_SIZE


def test_checkpoint_takes_the_builtin_resolver_from_its_caller(tmp_path: Path) -> None:
    """``checkpoint.py`` never finds the stages' builder itself: a ``builtin:`` model without
    a resolver is a clear error naming it; the registry's resolver builds through the stages."""
    from sarathi_pp.checkpoint import resolve_model_path
    from sarathi_pp.executors import builtin_resolver

    with pytest.raises(ValueError, match="'builtin:tiny-llama'.*no builtin resolver"):
        resolve_model_path("builtin:tiny-llama")
    asked: list[str] = []
    assert resolve_model_path("builtin:x", lambda name: asked.append(name) or "/m") == "/m"
    assert asked == ["x"]
    with pytest.raises(ValueError, match="unknown builtin model 'nope'"):
        builtin_resolver()("nope")
