"""``y = x W^T (+ b)`` for the decoder's weights, through oneDNN with the weight prepacked on
CPU (float32), else ``F.linear``.

Why (see Note [small-row matmuls on CPU]): decode-only steps multiply few rows
(``[num_decodes, hidden]``) by every weight, and ``F.linear``'s MKL path handles few rows
poorly on this class of CPU; oneDNN with a weight reordered once at load time into its
blocked layout is 2-8x faster from 4 to 64 rows, 1.2-1.5x faster at 256-512 rows (prefill
chunks), and on par at 1 row. Only the packed weight is kept (no second copy).
``SARATHI_PP_ONEDNN_LINEAR=0`` turns it off.

Note [small-row matmuls on CPU]: tiny-llama's gate/up weight (5632 x 1024, float32) on a
2-core AMD EPYC VM, torch 2.13, best of 12: 1 thread, ms for 1 / 8 / 32 / 256 rows: MKL
2.1 / 8.4 / 12.7 / 58.7, oneDNN prepacked 2.6 / 4.3 / 8.2 / 48.0; 2 threads (busy machine,
load ~3): MKL 2.0 / 23.2 / 31.9 / 70.8, oneDNN 4.8 / 2.9 / 9.6 / 48.1. The batch-size hint
of the reorder changed little; none is given. ``benchmarks/linear_rows.py`` reruns it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# Smaller weights stay on F.linear: MKL runs them on one thread, oneDNN always opens a
# parallel region, whose fixed cost dominates tiny matmuls (and on a busy machine a thread may
# wait a whole time slice for a core: a 2-layer hidden-64 test model stepped 8x slower).
MIN_PACKED_ELEMENTS = 1 << 18


def onednn_usable(weight: torch.Tensor) -> bool:
    """Prepack ``weight``? CPU, float32, at least ``MIN_PACKED_ELEMENTS``, a torch built
    with oneDNN, not turned off."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.numel() >= MIN_PACKED_ELEMENTS
        and torch.backends.mkldnn.is_available()
        and os.environ.get("SARATHI_PP_ONEDNN_LINEAR", "1") != "0"
    )


class Linear:
    """One weight ``[out, in]`` (and optional bias ``[out]``), applied to ``x [rows, in]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.nbytes = weight.numel() * weight.element_size()
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = weight
        if onednn_usable(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
            self.weight = None

    @property
    def is_packed(self) -> bool:
        return self.packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed, self.bias, "none", [], ""
        )
