"""The decoder's ``Linear``: oneDNN with a prepacked weight on CPU float32 gives F.linear's
values (to float32 rounding) for 1 to 600 rows, with a bias, on a non-contiguous input; other
dtypes, small weights and ``SARATHI_PP_ONEDNN_LINEAR=0`` keep F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sarathi_pp.stages.linear import Linear


@pytest.mark.parametrize("rows", [1, 3, 8, 64, 600])
def test_packed_linear_equals_f_linear(rows):
    torch.manual_seed(rows)
    w, b = torch.randn(1024, 256), torch.randn(1024)  # packed: >= MIN_PACKED_ELEMENTS
    x = torch.randn(256, rows).t()  # [rows, 256], non-contiguous
    lin = Linear(w, b)
    assert lin.is_packed == torch.backends.mkldnn.is_available()
    torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    assert lin.nbytes == w.numel() * 4


def test_other_dtypes_and_the_switch_keep_f_linear(monkeypatch):
    w = torch.randn(16, 8, dtype=torch.bfloat16)
    assert not Linear(w).is_packed
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(Linear(w)(x), F.linear(x, w))
    monkeypatch.setenv("SARATHI_PP_ONEDNN_LINEAR", "0")
    assert not Linear(torch.randn(1024, 256)).is_packed
    monkeypatch.delenv("SARATHI_PP_ONEDNN_LINEAR")
    assert not Linear(torch.randn(16, 8)).is_packed  # too small to gain from oneDNN
