"""Load a stage's weights from a Hugging Face folder by the checkpoint's own names.

Single ``model.safetensors`` or sharded (``model.safetensors.index.json``). A stage reads
only the tensors it owns: its decoder layers, plus the embedding on the first stage and the
final norm and lm_head on the last (with tied embeddings, the embedding matrix serves as
lm_head there). Nothing is fetched from a hub.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

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
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: d / fname for name, fname in weight_map.items()}
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
        with safe_open(str(f), framework="pt") as sf:
            names.update({k: f for k in sf.keys()})  # noqa: SIM118 (safe_open has no __iter__)
    return names


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
    model_dir: str | Path, names: list[str], dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
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
    out = {}
    for f, file_names in by_file.items():
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for n in file_names:
                out[n] = sf.get_tensor(n).to(device=device, dtype=dtype)
    return out
