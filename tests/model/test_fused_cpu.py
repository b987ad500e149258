"""The fused element-wise kernels (``stages/kernels/cpu/fused.py``) give the values of the torch ops
they replace (``decoder_layer.TorchOps``: HF's RMSNorm, residual add, rotary and SiLU * up) to float32
rounding: one row and many (the threaded path), hidden sizes that leave SIMD tails, strided
rows (q and k as views of a fused QKV output), and extreme SiLU inputs; a position outside the
tables is an error, not a stray read; the model takes the kernels for float32 on CPU only."""

from __future__ import annotations

import shutil

import pytest
import torch

from sarathi_pp.model_spec import spec_from_dict
from sarathi_pp.stages.kernels.cpu import fused
from sarathi_pp.stages.model.decoder_layer import CpuFusedOps, TorchOps, layer_ops
from sarathi_pp.stages.model.rope import RotaryEmbedding

needs_fused = pytest.mark.skipif(
    fused.load_fused() is None, reason=f"fused kernels: {fused.fused_threads()}"
)
ROWS = [1, 3, 32, 300]  # 300 x 1000 elements: above the kernels' threading threshold
CPU = torch.device("cpu")


def rope_for(head_dim: int, max_positions: int = 512) -> RotaryEmbedding:
    spec = spec_from_dict(
        {
            "model_type": "llama", "hidden_size": 4 * head_dim, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
            "vocab_size": 64, "max_position_embeddings": max_positions, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
        }
    )  # fmt: skip
    return RotaryEmbedding(spec, max_positions, torch.float32, CPU)


def ops_pair(head_dim: int = 64) -> tuple[TorchOps, CpuFusedOps]:
    rope = rope_for(head_dim)
    return TorchOps(rope), CpuFusedOps(rope)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@needs_fused
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [1000, 37])
def test_rms_norm_and_add_rms_norm_equal_torch(rows, hidden):
    ref, fused = ops_pair()
    g = torch.Generator().manual_seed(rows * hidden)
    x, d, w = (torch.randn(n, generator=g) * 3 for n in ((rows, hidden), (rows, hidden), hidden))
    x0, d0 = x.clone(), d.clone()
    close(fused.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    strided = torch.randn(rows, 2 * hidden, generator=g)[:, ::2]  # rows with a stride
    close(fused.rms_norm(strided, w, 1e-5), ref.rms_norm(strided, w, 1e-5))
    (sum_f, h_f), (sum_r, h_r) = fused.add_rms_norm(x, d, w, 1e-6), ref.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(sum_f, sum_r)  # the residual stream is one exact add
    close(h_f, h_r)
    assert torch.equal(x, x0) and torch.equal(d, d0)  # inputs untouched


@needs_fused
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("head_dim", [64, 6])
def test_rotary_in_place_on_qkv_views_equals_torch(rows, head_dim):
    ref, fused = ops_pair(head_dim)
    heads, kv_heads = 8, 2
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    g = torch.Generator().manual_seed(rows + head_dim)
    qkv = torch.randn(rows, q_dim + 2 * kv_dim, generator=g)
    positions = torch.randint(0, 512, (rows,), generator=g)
    positions[0] = 511  # the table's last row
    before = qkv.clone()
    q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
    q_ref = ref.rotary(before[:, :q_dim].view(rows, heads, head_dim), ref.rotation(positions))
    k_ref = ref.rotary(
        before[:, q_dim : q_dim + kv_dim].view(rows, kv_heads, head_dim), ref.rotation(positions)
    )
    q_out = fused.rotary(q.view(rows, heads, head_dim), fused.rotation(positions))
    k_out = fused.rotary(k.view(rows, kv_heads, head_dim), fused.rotation(positions))
    close(q_out, q_ref)
    close(k_out, k_ref)
    assert q_out.data_ptr() == qkv.data_ptr()  # in place, in the QKV buffer
    assert torch.equal(v, before[:, q_dim + kv_dim :])  # V is not rotated


@needs_fused
def test_rotary_refuses_a_position_outside_the_tables():
    _, fused = ops_pair()
    x = torch.randn(2, 4, 64)
    with pytest.raises(IndexError, match=r"outside \[0, 512\) \(min 3, max 512\)"):
        fused.rotary(x, torch.tensor([3, 512]))
    with pytest.raises(IndexError, match=r"min -1"):
        fused.rotary(x, torch.tensor([-1, 0]))


@needs_fused
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", [1000, 13])
def test_silu_mul_equals_torch(rows, inter):
    ref, fused = ops_pair()
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 6
    gate_up[0, :4] = torch.tensor([-200.0, -88.5, 89.0, 300.0])  # exp's clamps
    close(fused.silu_mul(gate_up), ref.silu_mul(gate_up))


@needs_fused
def test_the_model_takes_the_kernels_for_float32_on_cpu_only(monkeypatch):
    rope = rope_for(64)
    assert isinstance(layer_ops(rope, torch.float32, CPU), CpuFusedOps)
    assert type(layer_ops(rope, torch.bfloat16, CPU)) is TorchOps
    assert type(layer_ops(rope, torch.float32, torch.device("cuda"))) is TorchOps
    monkeypatch.setenv("SARATHI_PP_CPU_FUSED", "0")
    fused.load_fused.cache_clear()
    try:
        assert type(layer_ops(rope, torch.float32, CPU)) is TorchOps
        assert fused.fused_threads() == "disabled by SARATHI_PP_CPU_FUSED=0"
    finally:
        fused.load_fused.cache_clear()


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no cc")
def test_the_kernels_build_where_a_compiler_is(tmp_path, monkeypatch):
    """With a C compiler the kernels build (no silent fallback to torch's ops), on torch's
    OpenMP threads where torch runs on one libgomp."""
    monkeypatch.setenv("SARATHI_PP_KERNEL_DIR", str(tmp_path))
    fused.load_fused.cache_clear()
    try:
        assert fused.load_fused() is not None, fused.fused_threads()
        assert list(tmp_path.glob("fused_cpu-*.so"))
    finally:
        fused.load_fused.cache_clear()


def test_without_a_compiler_the_model_keeps_torch_ops(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SARATHI_PP_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    fused.load_fused.cache_clear()
    try:
        assert fused.load_fused() is None
        assert "using torch ops" in caplog.text
        assert type(layer_ops(rope_for(64), torch.float32, CPU)) is TorchOps
    finally:
        fused.load_fused.cache_clear()
