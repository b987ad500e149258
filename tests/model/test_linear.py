"""The decoder's ``Linear``: every kind that runs here (``panel_gemm``: our packed C kernel;
``onednn``: oneDNN with a prepacked weight; ``f_linear``) gives F.linear's values (to float32
rounding) for 0 to 1000 rows (row blocks of 6 (AVX2) or 16 (AVX-512) and their remainders, on
AVX-512 from 16 rows groups of 4 panels and the panels after them, the unsliced path and the
row-chunked one for many rows),
with a bias, a K that is no multiple of the slice, a non-contiguous and a 3-D input; on an
AVX-512 CPU the kernel's AVX2 build too; the choice between them follows the weight, the CPU
and the switches."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from sarathi_pp.stages.kernels.cpu import build as cpu_kernels
from sarathi_pp.stages.kernels.cpu.panel_gemm import load_gemm
from sarathi_pp.stages.model.linear import Linear, available_kinds, choose_kind

AVAILABLE = available_kinds()
# ``panel_gemm`` has two micro-kernels, chosen when it is built (``-march=native``). On an
# AVX-512 CPU its AVX2 one is built too (``-mno-avx512f``) and runs through the kind tests
# below as one more kind, so both are checked wherever AVX-512 runs (an AVX2-only CPU has
# only the AVX2 one, as ``panel_gemm``).
AVX2_BUILD = "panel_gemm-avx2"
KINDS_HERE = AVAILABLE + (
    [AVX2_BUILD] if "avx512f" in cpu_kernels.cpu_flags() and "panel_gemm" in AVAILABLE else []
)


def make_linear(w: torch.Tensor, b: torch.Tensor | None, kind: str) -> Linear:
    """``Linear(w, b, kind=kind)``; for ``AVX2_BUILD`` a ``panel_gemm`` one that calls the
    AVX2 build of the kernel."""
    if kind != AVX2_BUILD:
        return Linear(w, b, kind=kind)
    lin = Linear(w, b, kind="panel_gemm")
    avx2 = load_gemm(("-mno-avx512f",))
    assert avx2 is not None and avx2 is not load_gemm()
    lin._gemm = avx2
    return lin


@pytest.mark.parametrize("kind", KINDS_HERE)
@pytest.mark.parametrize("rows", [1, 3, 5, 6, 7, 13, 16, 17, 33, 64, 127, 128, 600])
def test_every_kind_equals_f_linear(kind, rows):
    torch.manual_seed(rows)
    w, b = torch.randn(1024, 300), torch.randn(1024)  # K = 300: no multiple of 16
    x = torch.randn(300, rows).t()  # [rows, 300], non-contiguous
    lin = make_linear(w, b, kind)
    assert lin.kind == kind.removesuffix("-avx2") and lin.is_packed == (kind != "f_linear")
    torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    x3 = torch.randn(2, rows, 300)
    torch.testing.assert_close(lin(x3), F.linear(x3, w, b), atol=1e-4, rtol=1e-5)
    assert lin.nbytes == w.numel() * 4


@pytest.mark.parametrize("kind", KINDS_HERE)
def test_many_rows_take_the_chunked_path_and_stay_exact(kind):
    """1000 rows x 1100 in (x above 2^20 floats): ``panel_gemm`` goes by chunks of 128 rows
    and K slices of 512, here with a 104-row last chunk (a tail block of 8) and a 76-wide
    last slice."""
    torch.manual_seed(1)
    w, b = torch.randn(256, 1100), torch.randn(256)
    x = torch.randn(1000, 1100)
    torch.testing.assert_close(make_linear(w, b, kind)(x), F.linear(x, w, b), atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS_HERE)
@pytest.mark.parametrize(
    ("out_features", "in_features", "rows"),
    [(1040, 300, 16), (1040, 300, 23), (1040, 300, 600), (48, 5500, 17), (1040, 1100, 1000)],
)
def test_groups_of_panels_and_the_panels_after_them_stay_exact(
    kind, out_features, in_features, rows
):
    """From 16 rows the AVX-512 kernel runs groups of 4 panels (64 outputs) 6 rows at a time
    and the panels after the last whole group one by one: 65 panels (16 groups and one), 3
    panels (no group), rows in 6-row pieces of 16-row blocks with remainders, and the
    row-chunked path (1000 x 1100) with a panel after the groups."""
    torch.manual_seed(rows)
    w, b = torch.randn(out_features, in_features), torch.randn(out_features)
    x = torch.randn(rows, in_features)
    torch.testing.assert_close(make_linear(w, b, kind)(x), F.linear(x, w, b), atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS_HERE)
def test_no_rows_give_no_rows(kind):
    y = make_linear(torch.randn(1024, 300), None, kind)(torch.randn(0, 300))
    assert y.shape == (0, 1024)


def test_the_choice_follows_the_weight_and_the_switches(monkeypatch):
    w = torch.randn(1024, 256)
    flags = cpu_kernels.cpu_flags()
    gemm_here = {"avx2", "fma"} <= flags and load_gemm() is not None
    onednn = "onednn" if torch.backends.mkldnn.is_available() else "f_linear"
    assert choose_kind(w) == ("panel_gemm" if gemm_here else onednn)
    assert choose_kind(torch.randn(1000, 300)) == onednn  # 1000 rows: no whole panels of 16
    assert choose_kind(w.bfloat16()) == "f_linear"
    assert choose_kind(torch.randn(16, 8)) == "f_linear"  # too small to gain from packing
    monkeypatch.setenv("SARATHI_PP_CPU_GEMM", "0")
    assert choose_kind(w) == onednn
    monkeypatch.setenv("SARATHI_PP_ONEDNN_LINEAR", "0")
    assert choose_kind(w) == "f_linear"
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    wb = torch.randn(16, 8, dtype=torch.bfloat16)
    assert torch.equal(Linear(wb)(x), F.linear(x, wb))


def test_a_kind_that_cannot_apply_is_refused():
    with pytest.raises(ValueError, match="panel_gemm cannot apply a \\(1000, 300\\) weight"):
        Linear(torch.randn(1000, 300), kind="panel_gemm")
    with pytest.raises(ValueError, match="kind must be one of"):
        Linear(torch.randn(16, 8), kind="mkl")


def test_the_gemm_kernel_builds_wherever_it_should():
    """A CPU with AVX2 + FMA (with or without AVX-512), a C compiler, torch on one libgomp
    (this project's machines): the kernel builds and loads, so the choice is never oneDNN by
    a silent build failure. Elsewhere there is nothing to check."""
    flags = cpu_kernels.cpu_flags()
    wanted = (
        {"avx2", "fma"} <= flags
        and (shutil.which("cc") or shutil.which("gcc"))
        and len(cpu_kernels.loaded_libgomp()) == 1
    )
    assert load_gemm() is not None or not wanted


@pytest.mark.parametrize("kind", KINDS_HERE)
def test_a_float64_default_dtype_changes_nothing(kind):
    w = torch.randn(1024, 256)
    x = torch.randn(5, 256)
    lin = make_linear(w, None, kind)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        y = lin(x)
    finally:
        torch.set_default_dtype(default)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, w), atol=1e-4, rtol=1e-5)
