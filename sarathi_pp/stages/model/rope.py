"""Rotary position embeddings, computed exactly as Hugging Face transformers does
(``default``, ``linear`` and Llama 3's ``llama3`` frequency scaling)."""

from __future__ import annotations

import math

import torch

from sarathi_pp.model_spec import ModelSpec


def inv_frequencies(spec: ModelSpec) -> torch.Tensor:
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    p = spec.rope_params
    if spec.rope_type == "linear":
        return inv_freq / p["factor"]
    if spec.rope_type == "llama3":
        return _llama3(inv_freq, p)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for positions ``[0, max_positions)``, looked up per row."""

    def __init__(
        self, spec: ModelSpec, max_positions: int, dtype: torch.dtype, device: torch.device
    ):
        inv_freq = inv_frequencies(spec)
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(pos, inv_freq)  # [positions, head_dim / 2], float32 like HF
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [num_tokens, 1, head_dim]: broadcast over heads
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, heads, head_dim]; rotate_half as in HF (halves, not interleaved)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
