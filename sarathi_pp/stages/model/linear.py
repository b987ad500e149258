"""``y = x W^T (+ b)`` for the decoder's weights. On CPU float32 the weight is prepacked once at
load time for one of two kernels, else ``F.linear``:

- ``panel_gemm`` (x86 with AVX2 + FMA; torch on libgomp): our small C kernel
  (``kernels/cpu/panel_gemm``), the weight packed in panels of 16 output columns (``[N/16, K, 16]``),
  each panel streamed once per call while a block of rows accumulates in registers over the
  whole of K, panels split over torch's OpenMP threads. Two micro-kernels, chosen at build
  time (``-march=native``): with AVX2, 6 rows at a time (2 x 6 accumulators, a broadcast of x
  and two loads of W per k); with AVX-512, 16 rows at a time (16 zmm accumulators, one load
  of W per k) from a copy of x packed by blocks of 16 rows (see Note [the AVX-512 panel
  kernel]), and from 16 rows groups of 4 panels 6 rows at a time (Note [the AVX-512 panel
  kernel's groups]).
- ``onednn``: oneDNN with the weight reordered into its blocked layout
  (``mkldnn._linear_pointwise``); where the kernel does not load, or with
  ``SARATHI_PP_CPU_GEMM=0``.
- ``f_linear``: other dtypes and devices, small weights, ``SARATHI_PP_ONEDNN_LINEAR=0``.

Only the packed weight is kept (no second copy).

Why (see Note [small-row matmuls on CPU]): decode-only steps multiply few rows
(``[num_decodes, hidden]``) by every weight. ``F.linear``'s MKL path handles few rows poorly
on this class of CPU (AMD), oneDNN prepacked is 2-8x faster from 4 to 64 rows; the panel
kernel is 1.1-1.3x faster than oneDNN again from 1 to 64 rows with the weights coming from
memory (as in a step), and on par or faster at 128 to 2048 rows (prefill chunks, whole
prompts), on an AVX2 EPYC; on an AVX-512 one, see Note [the AVX-512 panel kernel].

Note [small-row matmuls on CPU]: tiny-llama's gate/up weight (5632 x 1024, float32) on a
2-core AMD EPYC VM, torch 2.13, best of 12: 1 thread, ms for 1 / 8 / 32 / 256 rows: MKL
2.1 / 8.4 / 12.7 / 58.7, oneDNN prepacked 2.6 / 4.3 / 8.2 / 48.0; 2 threads (busy machine,
load ~3): MKL 2.0 / 23.2 / 31.9 / 70.8, oneDNN 4.8 / 2.9 / 9.6 / 48.1. The batch-size hint
of the reorder changed little; none is given. Panel kernel vs oneDNN, 2 threads, a quieter
machine (load ~1.5), the same weight called again and again (so the small ones stay in the
32 MB L3: this flatters the panel kernel at few rows), ms for 1 / 4 / 16 / 32 / 64 / 256 / 1024 rows: gate/up 0.75 / 0.99 /
2.05 / 2.87 / 5.03 / 21.6 / 82.5 vs 0.90 / 1.40 / 2.58 / 3.92 / 6.06 / 22.9 / 111.5; down
(1024 x 2816) 0.16 / 0.20 / 0.78 / 1.23 / 2.61 / 10.9 / 37.3 vs 0.27 / 0.31 / 1.17 / 1.75 /
2.92 / 11.8 / 40.6 (gate/up at 32 rows: 129 GFLOP/s, the machine's matmul rate). With the
kinds interleaved (``benchmarks/linear_rows.py``: each call finds its weight evicted), gate/up
at 1 / 4 / 16 / 32 / 64 / 256 rows: 1.56 / 1.79 / 3.20 / 4.14 / 7.25 / 23.0 vs 1.90 / 2.36 /
3.57 / 4.47 / 7.56 / 23.3; at 1 thread 2.11 / 2.48 / 5.18 / 6.84 / 13.0 / 37.9 vs 2.26 / 3.27
/ 5.94 / 8.11 / 13.8 / 42.7 (MKL's gemv is faster at 1 row on one thread: 1.82). Prefetching
the panel 2 KB ahead gained 5-13% at 4-32 rows.

The panel kernel itself, its micro-kernels and their measurements: ``kernels/cpu/panel_gemm.py``.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sarathi_pp.stages.kernels.cpu.panel_gemm import PANEL, load_gemm
from sarathi_pp.stages.model.host_pages import empty_huge

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

log = logging.getLogger(__name__)

# Smaller weights stay on F.linear: MKL runs them on one thread, oneDNN always opens a
# parallel region, whose fixed cost dominates tiny matmuls (and on a busy machine a thread may
# wait a whole time slice for a core: a 2-layer hidden-64 test model stepped 8x slower).
MIN_PACKED_ELEMENTS = 1 << 18
KINDS = ("panel_gemm", "onednn", "f_linear")


def _packable(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.numel() >= MIN_PACKED_ELEMENTS
    )


def onednn_usable(weight: torch.Tensor) -> bool:
    """Prepack ``weight`` for oneDNN? CPU, float32, at least ``MIN_PACKED_ELEMENTS``, a torch
    built with oneDNN, not turned off."""
    return (
        _packable(weight)
        and torch.backends.mkldnn.is_available()
        and os.environ.get("SARATHI_PP_ONEDNN_LINEAR", "1") != "0"
    )


def available_kinds() -> list[str]:
    """The kinds that can run here (for some weight), in ``KINDS``' order."""
    usable = {
        "panel_gemm": load_gemm() is not None,
        "onednn": torch.backends.mkldnn.is_available(),
        "f_linear": True,
    }
    return [kind for kind in KINDS if usable[kind]]


def panel_gemm_applies(weight: torch.Tensor) -> bool:
    """Can ``panel_gemm`` apply ``weight``? Packable, its rows fill whole panels, and the
    kernel loads here."""
    return _packable(weight) and weight.shape[0] % PANEL == 0 and load_gemm() is not None


def choose_kind(weight: torch.Tensor) -> str:
    """``panel_gemm`` where it applies (unless ``SARATHI_PP_CPU_GEMM=0``), else ``onednn``
    where usable, else ``f_linear``."""
    if os.environ.get("SARATHI_PP_CPU_GEMM", "1") != "0" and panel_gemm_applies(weight):
        return "panel_gemm"
    return "onednn" if onednn_usable(weight) else "f_linear"


class Linear:
    """One weight ``[out, in]`` (and optional bias ``[out]``), applied to ``x [rows, in]``.
    ``kind`` (one of ``KINDS``) is chosen by ``choose_kind`` unless given."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, kind: str | None = None
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.nbytes = weight.numel() * weight.element_size()
        self.kind = kind or choose_kind(weight)
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        self._gemm: CFuncPtr | None = None
        if self.kind == "panel_gemm":
            if not panel_gemm_applies(weight):
                raise ValueError(f"panel_gemm cannot apply a {tuple(weight.shape)} weight here")
            self._gemm = load_gemm()
            n, k = weight.shape
            self.packed = empty_huge((n // PANEL, k, PANEL), weight.dtype)  # Note [huge pages]
            self.packed.copy_(weight.reshape(n // PANEL, PANEL, k).transpose(1, 2))
        elif self.kind == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        elif self.kind == "f_linear":
            self.weight = weight
        else:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")

    @property
    def is_packed(self) -> bool:
        return self.packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if self.kind == "panel_gemm":
            assert self._gemm is not None and self.packed is not None
            assert x.dtype == torch.float32, x.dtype
            rows = x.reshape(-1, self.in_features).contiguous()
            y = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
            failed = self._gemm(
                rows.data_ptr(), rows.shape[0], self.in_features, self.packed.data_ptr(),
                self.out_features, y.data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
            if failed:
                raise MemoryError(
                    f"panel_gemm: no memory for a packed copy of {tuple(rows.shape)} rows"
                )
            if self.bias is not None:
                y.add_(self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.packed, self.bias, "none", [], ""
            )
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)
