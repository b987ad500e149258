"""config.json shapes that cannot make a model are refused, naming the key and the value."""

from __future__ import annotations

import json
import re

import pytest

from sarathi_pp.checkpoint import load_model_spec
from sarathi_pp.model_spec import spec_from_dict

GOOD = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 259, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "eos_token_id": 2,
}  # fmt: skip


def test_good_config_and_derived_head_dim():
    spec = spec_from_dict(GOOD)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (4, 2, 16)
    assert spec_from_dict({**GOOD, "num_key_value_heads": None}).num_kv_heads == 4  # MHA
    assert spec_from_dict({**GOOD, "head_dim": 32, "hidden_size": 100}).head_dim == 32
    assert spec_from_dict({**GOOD, "hidden_size": 64.0}).hidden_size == 64  # integral float


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(num_attention_heads=0), "num_attention_heads must be an integer >= 1, got 0"),
        (dict(num_attention_heads=-4), "num_attention_heads must be an integer >= 1, got -4"),
        (dict(vocab_size=0), "vocab_size must be an integer >= 1, got 0"),
        (dict(num_hidden_layers=0), "num_hidden_layers must be an integer >= 1, got 0"),
        (dict(intermediate_size=-1), "intermediate_size must be an integer >= 1, got -1"),
        (dict(hidden_size="64"), "hidden_size must be an integer >= 1, got '64'"),
        (dict(hidden_size=True), "hidden_size must be an integer >= 1, got True"),
        (dict(hidden_size=64.5), "hidden_size must be an integer >= 1, got 64.5"),
        (dict(hidden_size=66), "hidden_size=66 is not divisible by num_attention_heads=4"),
        (
            dict(num_key_value_heads=3),
            "num_key_value_heads=3 does not divide num_attention_heads=4",
        ),
        (dict(num_key_value_heads=0), "num_key_value_heads must be an integer >= 1, got 0"),
        (dict(head_dim=0), "head_dim must be an integer >= 1, got 0"),
        (dict(head_dim=15), "head_dim=15 must be even"),
        (dict(max_position_embeddings=0), "max_position_embeddings must be an integer >= 1"),
        (dict(rms_norm_eps=-1e-6), r"rms_norm_eps must be a finite number > 0, got -1e-06"),
        (dict(rope_theta=float("nan")), "rope_theta must be a finite number > 0, got nan"),
        (dict(sliding_window=0), "sliding_window must be an integer >= 1, got 0"),
        (dict(eos_token_id=[2, -1]), "eos_token_id must be an integer >= 0, got -1"),
    ],
)
def test_nonsense_shapes_are_refused_naming_the_key(change, match):
    with pytest.raises(ValueError, match=f"^config.json: {match}"):
        spec_from_dict({**GOOD, **change})


def test_the_message_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**GOOD, "num_attention_heads": 0}))
    with pytest.raises(
        ValueError, match=re.escape(f"{tmp_path / 'config.json'}: num_attention_heads")
    ):
        load_model_spec(tmp_path)
