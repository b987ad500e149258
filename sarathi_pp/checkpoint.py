"""A checkpoint as the runtime sees it: the local model folder, its ``ModelSpec`` and the
sequence length the engine runs with. ``load_checkpoint`` is the one place a ``model``
setting becomes these three, for the engine, every stage process, the planner and the
profiler.

Pure Python: a ``builtin:NAME`` model is built (with torch and transformers) by the module
named in ``BUILTIN_RESOLVER``, imported only when such a model is asked for, so the engine
loop and the simulator stay torch-free.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from sarathi_pp.config import BUILTIN_PREFIX, ModelConfig
from sarathi_pp.model_spec import ModelSpec, load_model_spec

BUILTIN_RESOLVER = "sarathi_pp.stages.builtin:resolve_builtin"


@dataclass(frozen=True)
class Checkpoint:
    path: str  # a local folder: config.json + safetensors (+ tokenizer files)
    spec: ModelSpec
    max_model_len: int  # prompt + output tokens of one sequence, within the checkpoint's limit


def load_checkpoint(model: ModelConfig) -> Checkpoint:
    """Resolve ``model.path``, read its config.json and settle ``max_model_len``; bad
    settings raise ``FileNotFoundError`` / ``ValueError`` naming the value."""
    path = resolve_model_path(model.path)
    spec = load_model_spec(path)
    return Checkpoint(path, spec, resolve_max_model_len(model, spec))


def resolve_model_path(path: str) -> str:
    """A local folder for ``path``: the folder itself, or the built ``builtin:NAME``."""
    if path.startswith(BUILTIN_PREFIX):
        module, _, name = BUILTIN_RESOLVER.partition(":")
        resolve_builtin = getattr(importlib.import_module(module), name)
        return resolve_builtin(path[len(BUILTIN_PREFIX) :])
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    return str(p)


def resolve_max_model_len(model: ModelConfig, spec: ModelSpec) -> int:
    limit = spec.max_position_embeddings
    max_len = model.max_model_len or limit
    if max_len > limit:
        raise ValueError(
            f"max_model_len={max_len} exceeds the checkpoint's limit "
            f"(max_position_embeddings={limit})"
        )
    if spec.sliding_window is not None and spec.sliding_window < max_len:
        raise ValueError(
            f"the checkpoint uses sliding-window attention (window {spec.sliding_window}) "
            f"shorter than max_model_len={max_len}; sliding windows are not supported: "
            f"set max_model_len <= {spec.sliding_window}"
        )
    return max_len
