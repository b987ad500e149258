"""Which attention backend a stage runs: ``auto`` over device x dtype x block size x
installed packages (flash-attn stubbed), float32 never choosing flash-attn; a backend asked
for by name where it cannot run falls back to ``auto``'s choice, recorded with its reason
(strict: an error); the config refuses unknown names."""

from __future__ import annotations

import pytest
import torch

from sarathi_pp.config import make_config
from sarathi_pp.stages.kernels.cpu import paged_attention
from sarathi_pp.stages.model import backend_choice
from sarathi_pp.stages.model.backend_choice import (
    AttentionFallbackError,
    AttentionRecord,
    choose_backend,
    select_backend,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("block_size", [8, 16, 256, 512])
def test_auto_on_cuda(monkeypatch, flash, dtype, block_size):
    monkeypatch.setattr(backend_choice, "flash_attn_available", lambda: flash)
    got = select_backend(CUDA, block_size, dtype)
    if flash and dtype != F32 and block_size % 256 == 0:
        want = "flash_attn"
    elif block_size % 16 == 0:
        want = "flex_paged"
    else:
        want = "torch"  # FlexAttention's KV blocks: multiples of 16
    assert got == want


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_auto_on_cpu(monkeypatch, kernel, dtype):
    monkeypatch.setattr(backend_choice, "flash_attn_available", lambda: True)  # never on CPU
    monkeypatch.setattr(backend_choice, "load_kernel", lambda: object() if kernel else None)
    want = "cpu_paged" if kernel and dtype == F32 else "torch"
    assert select_backend(CPU, 256, dtype) == want


@pytest.mark.parametrize(
    "requested, device, dtype, block_size, flash, ran, why",
    [
        ("flash_attn", CUDA, F32, 256, True, "flex_paged", "float16/bfloat16, not float32"),
        ("flash_attn", CUDA, BF16, 256, False, "flex_paged", "not installed"),
        ("flash_attn", CUDA, BF16, 16, True, "flex_paged", "multiple of 256"),
        ("flash_attn", CPU, BF16, 256, True, "torch", "on CUDA, not cpu"),
        ("flex_paged", CUDA, BF16, 8, False, "torch", "multiple of 16 tokens, not 8"),
        ("cpu_paged", CUDA, F32, 16, False, "flex_paged", "on CPU, not cuda"),
        ("cpu_paged", CPU, BF16, 16, False, "torch", "float32, not bfloat16"),
    ],
)
def test_a_backend_that_cannot_run_falls_back(
    monkeypatch, requested, device, dtype, block_size, flash, ran, why
):
    monkeypatch.setattr(backend_choice, "flash_attn_available", lambda: flash)
    record = AttentionRecord(1, "torch")
    assert choose_backend(requested, device, dtype, block_size, record) == ran
    assert record.backend == ran
    (reason,) = record.fallbacks
    assert reason.startswith(f"{requested} cannot run here") and why in reason
    assert reason.endswith(f"running {ran}")
    with pytest.raises(AttentionFallbackError, match=f"stage 1: attention backend {requested}"):
        choose_backend(requested, device, dtype, block_size, AttentionRecord(1, "torch", True))


@pytest.mark.parametrize("requested", ["auto", "torch", "flex_paged"])
def test_a_backend_that_can_run_runs(monkeypatch, requested):
    monkeypatch.setattr(backend_choice, "load_kernel", lambda: None)
    record = AttentionRecord(0, "torch", strict=True)
    want = "torch" if requested == "auto" else requested
    assert choose_backend(requested, CPU, F32, 16, record) == want
    assert record.fallbacks == []


def test_cpu_paged_without_its_prefill_kernel_says_so(monkeypatch):
    if paged_attention.load_kernel() is None:
        pytest.skip("no C compiler: the CPU paged kernel cannot build")
    monkeypatch.setattr(backend_choice, "load_prefill", lambda: None)
    record = AttentionRecord(0, "torch")
    assert choose_backend("cpu_paged", CPU, F32, 16, record) == "cpu_paged"
    assert record.fallbacks == [
        "prefill chunks run gather + SDPA: the paged prefill kernel needs AVX-512 or AVX2 + FMA"
    ]


def test_the_config_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match="unknown attention_backend 'flash'.*flex_paged"):
        make_config(**{"model.attention_backend": "flash"})
    with pytest.raises(ValueError, match="strict_attention_backend must be true or false"):
        make_config(**{"model.strict_attention_backend": "yes"})
    c = make_config(**{"model.attention_backend": "flex_paged"})
    assert c.model.attention_backend == "flex_paged" and not c.model.strict_attention_backend
