"""Load a stage's weights from a Hugging Face folder by the checkpoint's own names.

Single ``model.safetensors`` or sharded (``model.safetensors.index.json``). A stage reads
only the tensors it owns: its decoder layers, plus the embedding on the first stage and the
final norm and lm_head on the last (with tied embeddings, the embedding matrix serves as
lm_head there). Nothing is fetched from a hub.

What is read is checked first, each failure naming the file or tensor: index entries stay
inside the model folder, files are whole safetensors files, and every tensor has the shape
config.json implies (``expected_shape``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from sarathi_pp.model_spec import ModelSpec

EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
LAYER_KEYS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
BIAS_KEYS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


def weight_files(model_dir: str | Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return _indexed_files(d, index)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        extra = (
            " (only PyTorch .bin weights found; convert them to safetensors)"
            if list(d.glob("*.bin"))
            else ""
        )
        raise FileNotFoundError(f"model directory {str(d)!r} has no safetensors weights{extra}")
    names: dict[str, Path] = {}
    for f in files:
        with _open(f) as sf:
            names.update({k: f for k in sf.keys()})  # noqa: SIM118 (safe_open has no __iter__)
    return names


def _indexed_files(d: Path, index: Path) -> dict[str, Path]:
    """``weight_map`` of a sharded checkpoint's index, each file checked to be a file inside
    ``d`` (``ValueError`` naming the entry: the index must not point anywhere else)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not an index with a 'weight_map' ({e!r})") from e
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: 'weight_map' must map tensor names to file names")
    files: dict[str, Path] = {}
    for fname in weight_map.values():
        # Lexical check, symlinks not followed: a Hugging Face cache's snapshot folder links
        # its files to blobs elsewhere, and that is fine; a name going elsewhere is not.
        if not isinstance(fname, str) or _leaves_folder(fname):
            raise ValueError(
                f"{index}: weight_map entry {fname!r} is not a file name inside the model "
                f"folder {str(d)!r}"
            )
        if fname not in files:
            if not (d / fname).is_file():
                raise FileNotFoundError(f"{index}: weight_map names {fname!r}, which is missing")
            files[fname] = d / fname
    return {name: files[fname] for name, fname in weight_map.items()}


def _leaves_folder(fname: str) -> bool:
    """Whether ``fname`` is absolute or its ``..`` parts climb out of the folder."""
    return Path(fname).is_absolute() or Path(os.path.normpath(fname)).parts[:1] == ("..",)


@contextmanager
def _open(path: Path) -> Iterator[Any]:
    """``safe_open`` with its errors (a truncated or corrupt file) as ``ValueError`` naming
    the file, not a traceback from inside safetensors."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as sf:
            yield sf
    except (SafetensorError, OSError) as e:
        raise ValueError(
            f"weights file {str(path)!r} cannot be read ({e}): it is truncated or corrupt "
            "(an interrupted download or copy?); fetch it again"
        ) from e


def expected_shape(spec: ModelSpec, name: str) -> tuple[tuple[int, ...], str]:
    """The shape config.json implies for tensor ``name``, and how (for messages). Checked
    before use: a disagreeing tensor would load and then fail every request."""
    key = name.split(".", 3)[3] if name.startswith("model.layers.") else name
    q, kv = "num_attention_heads*head_dim", "num_key_value_heads*head_dim"
    formulas = {
        EMBED: ("vocab_size", "hidden_size"),
        LM_HEAD: ("vocab_size", "hidden_size"),
        NORM: ("hidden_size",),
        "self_attn.q_proj.weight": (q, "hidden_size"),
        "self_attn.k_proj.weight": (kv, "hidden_size"),
        "self_attn.v_proj.weight": (kv, "hidden_size"),
        "self_attn.o_proj.weight": ("hidden_size", q),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "mlp.gate_proj.weight": ("intermediate_size", "hidden_size"),
        "mlp.up_proj.weight": ("intermediate_size", "hidden_size"),
        "mlp.down_proj.weight": ("hidden_size", "intermediate_size"),
        "input_layernorm.weight": ("hidden_size",),
        "post_attention_layernorm.weight": ("hidden_size",),
    }
    figures = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        q: spec.num_heads * spec.head_dim,
        kv: spec.num_kv_heads * spec.head_dim,
    }
    dims = formulas[key]
    return tuple(figures[d] for d in dims), f"[{', '.join(dims)}]"


def stage_tensor_names(
    spec: ModelSpec, layer_start: int, layer_end: int, is_first: bool, is_last: bool
) -> list[str]:
    names = []
    if is_first or (is_last and spec.tie_word_embeddings):
        names.append(EMBED)
    for i in range(layer_start, layer_end):
        keys = LAYER_KEYS + (BIAS_KEYS if spec.attention_bias else ())
        names += [f"model.layers.{i}.{k}" for k in keys]
    if is_last:
        names.append(NORM)
        if not spec.tie_word_embeddings:
            names.append(LM_HEAD)
    return names


def load_tensors(
    model_dir: str | Path,
    names: list[str],
    dtype: torch.dtype,
    device: torch.device,
    *,
    spec: ModelSpec,
) -> dict[str, torch.Tensor]:
    """Tensors ``names``, each of the shape ``spec`` implies (``ValueError`` naming the
    tensor, its file and both shapes otherwise, before any data is read)."""
    where = weight_files(model_dir)
    missing = [n for n in names if n not in where]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        )
        raise ValueError(f"model directory {str(model_dir)!r} lacks weights: {shown}")
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(where[n], []).append(n)
    for f, file_names in by_file.items():  # every shape first: nothing read in vain
        with _open(f) as sf:
            for n in file_names:
                _check_shape(spec, n, tuple(sf.get_slice(n).get_shape()), f)
    out = {}
    for f, file_names in by_file.items():
        with _open(f) as sf:
            for n in file_names:
                out[n] = sf.get_tensor(n).to(device=device, dtype=dtype)
    return out


def _check_shape(spec: ModelSpec, name: str, shape: tuple[int, ...], path: Path) -> None:
    want, formula = expected_shape(spec, name)
    if shape != want:
        raise ValueError(
            f"weight {name} in {str(path)!r} has shape {list(shape)}, but config.json implies "
            f"{list(want)} ({formula}): the weights do not belong to this config.json"
        )
