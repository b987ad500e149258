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
on this class of CPU (AMD), and oneDNN prepacked is several times faster from 4 to 64 rows;
the panel kernel is faster than oneDNN again from 1 to 64 rows with the weights coming from
memory (as in a step), and on par or faster at 128 to 2048 rows (prefill chunks, whole
prompts), on an AVX2 EPYC; on an AVX-512 one, see Note [the AVX-512 panel kernel].

Note [small-row matmuls on CPU]: on a 2-core AMD EPYC VM, MKL falls far behind oneDNN prepacked
from a few rows on, the more so on 2 threads; the batch-size hint of oneDNN's reorder changed
little, so none is given. The panel kernel beats oneDNN at every row count from 1 to 1024 with
the same weight called again and again (the small ones then stay in L3, which flatters the panel
kernel at few rows) and still from 1 to 64 rows with the kinds interleaved so that each call
finds its weight evicted (``benchmarks/linear_rows.py``), on 1 thread as on 2 (though at 1 row
on one thread MKL's gemv is faster still). Prefetching the panel 2 KB ahead helped at 4-32 rows.
The figures: the lab notebook's "Figures moved out of the code", Note [small-row matmuls on CPU].

The panel kernel itself and its micro-kernels: ``kernels/cpu/panel_gemm.py``.
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
