"""``generation_config.json`` read as vLLM reads it: sampling defaults and extra EOS ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sarathi_pp.generation_config import GenerationDefaults, load_generation_defaults


def test_missing_file_is_no_defaults(tmp_path: Path) -> None:
    assert load_generation_defaults(tmp_path) == GenerationDefaults()


def test_sampling_keys_and_eos_ids(tmp_path: Path) -> None:
    cfg = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "eos_token_id": [2, 7],
           "do_sample": True, "max_new_tokens": 5, "repetition_penalty": 1.1}  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps(cfg))
    d = load_generation_defaults(tmp_path)
    assert d.sampling == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    assert d.eos_token_ids == (2, 7)


@pytest.mark.parametrize(
    "cfg, match",
    [({"temperature": "hot"}, "temperature must be a number"),
     ({"top_k": 2.5}, "top_k must be an integer"),
     ({"eos_token_id": [-1]}, "eos_token_id must be token ids")],
)  # fmt: skip
def test_bad_values_name_the_file_and_key(tmp_path: Path, cfg: dict, match: str) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        load_generation_defaults(tmp_path)
