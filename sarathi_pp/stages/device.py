"""Resolve ``device: auto`` and ``dtype: auto`` for the machine at hand."""

from __future__ import annotations

import torch


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; use device='cpu' or 'auto'")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto``: bfloat16 on CUDA (when supported), float32 on CPU."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda") and torch.cuda.is_bf16_supported():
        return "bfloat16"
    return "float32"
