"""A checkpoint as the runtime sees it: the local model folder, its ``ModelSpec`` and the
sequence length the engine runs with. ``load_checkpoint`` is the one place a ``model``
setting becomes these three, for the engine, every stage process, the planner and the
profiler.

Pure Python: a ``builtin:NAME`` model is built (with torch and transformers) by the resolver
the caller passes in (``resolve_builtin``; the executors' registry hands out the stages'
one, ``executors.builtin_resolver``), so this module and the engine loop stay torch-free and
no tier below reaches up to find it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sarathi_pp.config import BUILTIN_PREFIX, ModelConfig
from sarathi_pp.generation_config import GenerationDefaults, load_generation_defaults
from sarathi_pp.model_spec import ModelSpec, spec_from_dict

# ``builtin:NAME``'s NAME -> the local folder it is built (or converted) into.
BuiltinResolver = Callable[[str], str]
# A Hugging Face hub id: "org/name" (letters, digits, "-", "_", "."), not a local path.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What a model needs from the hub: never the repo's other weights formats or its code.
HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt", "*.tiktoken"]


@dataclass(frozen=True)
class Checkpoint:
    path: str  # a local folder: config.json + safetensors (+ tokenizer files)
    spec: ModelSpec
    max_model_len: int  # prompt + output tokens of one sequence, within the checkpoint's limit
    # generation_config.json's sampling defaults (its EOS ids are in ``spec.eos_token_ids``)
    generation: GenerationDefaults = GenerationDefaults()
    # ``model.tokenizer`` where set (else the model folder's): the last stage reads it for
    # structured output's token masks
    tokenizer_path: str | None = None


def load_checkpoint(
    model: ModelConfig, resolve_builtin: BuiltinResolver | None = None
) -> Checkpoint:
    """Resolve ``model.path``, read its config.json and settle ``max_model_len``; bad
    settings raise ``FileNotFoundError`` / ``ValueError`` naming the value.
    ``resolve_builtin`` builds a ``builtin:NAME`` model (needed only for those)."""
    path = resolve_model_path(model.path, resolve_builtin)
    spec = load_model_spec(path)
    generation = load_generation_defaults(path)
    extra_eos = [t for t in generation.eos_token_ids if t not in spec.eos_token_ids]
    if extra_eos:  # vLLM's: generation_config.json's EOS ids stop every request too
        spec = dataclasses.replace(spec, eos_token_ids=(*spec.eos_token_ids, *extra_eos))
    max_model_len = resolve_max_model_len(model, spec)
    return Checkpoint(path, spec, max_model_len, generation, model.tokenizer)


def resolve_model_path(path: str, resolve_builtin: BuiltinResolver | None = None) -> str:
    """A local folder for ``path``: the folder itself, the built ``builtin:NAME`` (through
    ``resolve_builtin``), or the snapshot of hub id ``org/name`` (the local hub cache
    first, then a download)."""
    if path.startswith(BUILTIN_PREFIX):
        if resolve_builtin is None:
            raise ValueError(
                f"model {path!r} is a builtin model, and no builtin resolver was given "
                "(pass executors.builtin_resolver() to load_checkpoint)"
            )
        return resolve_builtin(path[len(BUILTIN_PREFIX) :])
    p = Path(path).expanduser()
    if p.is_dir():
        return str(p)
    if HUB_ID.fullmatch(path) and not p.exists():
        return resolve_hub_id(path)
    raise FileNotFoundError(f"model directory {path!r} does not exist")


def resolve_hub_id(repo_id: str) -> str:
    """The local snapshot of hub model ``repo_id``: from the hub cache (``HF_HUB_CACHE``)
    when it is there, else downloaded (safetensors, configs and tokenizer files only)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True)
    except (FileNotFoundError, HFValidationError, OSError, ValueError):
        pass  # not cached (huggingface_hub raises LocalEntryNotFoundError, an OSError)
    try:
        return snapshot_download(repo_id, allow_patterns=HUB_FILES)
    except Exception as e:  # offline, unknown repo, gated, ...: one clear message
        raise FileNotFoundError(
            f"model {repo_id!r} is not a local folder, not in the Hugging Face cache, and "
            f"could not be downloaded ({type(e).__name__}: {str(e).splitlines()[0]})"
        ) from e


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


def load_model_spec(model_dir: str | Path) -> ModelSpec:
    d = Path(model_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"model directory {str(d)!r} does not exist")
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"model directory {str(d)!r} has no config.json")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: not valid JSON: {e}") from e
    return spec_from_dict(cfg, source=str(cfg_path))
