"""A model folder's ``generation_config.json`` as vLLM reads it (``--generation-config
auto``, its default): the sampling defaults a request's own values override, and the extra
EOS token ids (an instruct model's end-of-turn token often lives only there).

Read: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` (vLLM's
``get_diff_sampling_param`` keys) and ``eos_token_id`` (an id or a list). Not read:
``max_new_tokens`` (vLLM caps its default ``max_tokens`` with it; here a request without
``max_tokens`` runs to the end of the context, see docs/guide/serving.md), ``do_sample``
(vLLM ignores it too) and the rest. A file that is missing is no defaults; a file that is
not valid JSON, or a value of the wrong type, is a ``ValueError`` naming the file and key.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FILENAME = "generation_config.json"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    """``sampling``: ``SamplingParams`` field -> the folder's default (only those it sets);
    ``eos_token_ids``: its EOS ids (stop every request, as config.json's)."""

    sampling: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()


def load_generation_defaults(model_dir: str | Path) -> GenerationDefaults:
    path = Path(model_dir) / FILENAME
    if not path.is_file():
        return GenerationDefaults()
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return defaults_from_dict(cfg, str(path))


def defaults_from_dict(cfg: dict[str, Any], source: str = FILENAME) -> GenerationDefaults:
    sampling: dict[str, Any] = {}
    for key in SAMPLING_KEYS:
        value = cfg.get(key)
        if value is None:
            continue
        kind = numbers.Integral if key == "top_k" else numbers.Real
        if isinstance(value, bool) or not isinstance(value, kind):
            what = "an integer" if key == "top_k" else "a number"
            raise ValueError(f"{source}: {key} must be {what}, got {value!r}")
        sampling[key] = value
    eos = cfg.get("eos_token_id")
    ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"{source}: eos_token_id must be token ids >= 0, got {eos!r}")
    return GenerationDefaults(sampling, tuple(ids))
