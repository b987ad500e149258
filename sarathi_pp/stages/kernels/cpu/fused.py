"""Fused element-wise kernels for a decoder layer on CPU (float32): RMSNorm (with the residual
add before it), rotary embedding in place, and SiLU(gate) * up.

Why (see Note [small ops of a decode step]): as torch ops, a Llama layer's element-wise work
is ~30 small ops (RMSNorm alone is pow, mean, add, rsqrt, mul, mul; rotary is two slices, a
neg, a cat, two muls and an add, for q and for k), each a dispatch, an allocation and, on
tensors above torch's grain size, a fork-join over its OpenMP threads. On the rows of a decode
step that overhead is a sizeable share of a decode-only step. Here each is one C call over
the rows.

The arithmetic is HF's (``transformers``' ``LlamaRMSNorm``, ``apply_rotary_pos_emb``,
``silu``): RMSNorm as ``w * (x * rsqrt(mean(x^2) + eps))`` in float32, rotary as ``x * cos +
rotate_half(x) * sin`` from the same cos/sin tables (``rope.RotaryEmbedding``), SiLU as
``x / (1 + exp(-x))``. Sums and exp round differently from torch's vectorised ones (a few
ulp), which the HF-exact tests cover as they do the matmul kernels' summation order.

Built and loaded by ``build.build`` (on torch's OpenMP threads where torch runs on
libgomp; elsewhere one thread: these loops are short). Where nothing builds, or
``SARATHI_PP_CPU_FUSED=0``, ``load_fused`` returns None and the model keeps torch's ops.

Note [small ops of a decode step]: ``torch.profiler`` over a decode step of 32 x 1k
(``benchmarks/piggyback.py``'s micro-batch, the embedded model) shows a few hundred aten
ops, most of them mul and add, then RMSNorm's pow/sum/div/rsqrt, rotary's cat/neg and SiLU,
plus views, slices and copies. The linears (``panel_gemm``) and attention
(``paged_attention``) are ctypes calls and not among them. (The figures: the lab notebook's
"Figures moved out of the code", Note [small ops of a decode step].)
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from sarathi_pp.stages.kernels.cpu.build import KERNEL_DIR, build_unless_off

_SOURCE = KERNEL_DIR / "fused.c"

_threads = "not loaded"


@cache
def load_fused() -> ctypes.CDLL | None:
    """The compiled kernels, or None (no compiler, or disabled by ``SARATHI_PP_CPU_FUSED=0``);
    the reason is logged once."""
    global _threads
    lib, _threads = build_unless_off(
        "fused_cpu", _SOURCE, "SARATHI_PP_CPU_FUSED", "CPU fused element-wise kernels",
        "using torch ops",
    )  # fmt: skip
    if lib is None:
        return None
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.rms_norm_f32.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, f32, i32]
    lib.rms_norm_f32.restype = None
    lib.rotary_f32.argtypes = [ptr, i64, i64, i32, i32, ptr, ptr, ptr, i64, i32]
    lib.rotary_f32.restype = i32
    lib.silu_mul_f32.argtypes = [ptr, ptr, i64, i64, i32]
    lib.silu_mul_f32.restype = None
    return lib


def fused_threads() -> str:
    """How the kernels run their threads, or why they are unavailable (benchmarks' headers)."""
    load_fused()
    return _threads


def fused_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """Do the fused kernels run a model of ``dtype`` on ``device``? float32 on CPU, built."""
    return device.type == "cpu" and dtype == torch.float32 and load_fused() is not None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as rows whose last dimension is contiguous (a copy only where it is not)."""
    assert x.dtype == torch.float32 and x.device.type == "cpu", (x.dtype, x.device)
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm of ``x [..., hidden]`` (float32)."""
    lib = load_fused()
    assert lib is not None
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=torch.float32)
    lib.rms_norm_f32(
        rows.data_ptr(), rows.stride(0), None, None, weight.contiguous().data_ptr(),
        out.data_ptr(), rows.shape[0], rows.shape[1], eps, torch.get_num_threads(),
    )  # fmt: skip
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rms_norm(x + delta))``: the residual add and the norm after it in one
    pass (float32, same shapes)."""
    lib = load_fused()
    assert lib is not None and x.shape == delta.shape, (x.shape, delta.shape)
    rows, d = _rows(x), _rows(delta).contiguous()
    total = torch.empty(rows.shape, dtype=torch.float32)
    out = torch.empty(rows.shape, dtype=torch.float32)
    lib.rms_norm_f32(
        rows.data_ptr(), rows.stride(0), d.data_ptr(), total.data_ptr(),
        weight.contiguous().data_ptr(), out.data_ptr(), rows.shape[0], rows.shape[1], eps,
        torch.get_num_threads(),
    )  # fmt: skip
    return total.view(x.shape), out.view(x.shape)


def rotary_(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotate ``x [rows, heads, head_dim]`` in place (heads and head_dim contiguous; rows may
    be strided, e.g. a view of a fused QKV output) by ``cos``/``sin`` tables ``[max_positions,
    head_dim]`` at ``positions [rows]``; returns ``x``."""
    lib = load_fused()
    assert lib is not None and x.dim() == 3 and x.dtype == torch.float32
    n, heads, head_dim = x.shape
    assert x.stride(2) == 1 and x.stride(1) == head_dim, x.stride()
    assert cos.shape == sin.shape and cos.shape[1] == head_dim and cos.is_contiguous()
    assert sin.is_contiguous() and cos.dtype == sin.dtype == torch.float32
    pos = positions.to(torch.int64).contiguous()
    assert pos.shape == (n,), (pos.shape, n)
    failed = lib.rotary_f32(
        x.data_ptr(), x.stride(0), n, heads, head_dim, cos.data_ptr(), sin.data_ptr(),
        pos.data_ptr(), cos.shape[0], torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise position_error(pos, cos.shape[0])
    return x


def position_error(positions: torch.Tensor, max_positions: int) -> IndexError:
    """The error for rotary positions outside the tables ``[0, max_positions)``."""
    return IndexError(
        f"rotary: a position outside [0, {max_positions}) "
        f"(min {int(positions.min())}, max {int(positions.max())})"
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [rows, 2 * inter]`` = ``[gate | up]`` per row."""
    lib = load_fused()
    assert lib is not None
    rows = _rows(gate_up).contiguous()
    inter = rows.shape[1] // 2
    assert rows.shape[1] == 2 * inter, rows.shape
    out = torch.empty(rows.shape[0], inter, dtype=torch.float32)
    lib.silu_mul_f32(rows.data_ptr(), out.data_ptr(), rows.shape[0], inter, torch.get_num_threads())
    return out.view(*gate_up.shape[:-1], inter)
