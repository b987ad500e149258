"""One Llama-family decoder layer over a flat token batch, and its element-wise ops (torch's, or
the fused CPU kernels').

The layer runs every row of a hybrid micro-batch (``[Lp + Bd, hidden]``) through one matmul
per fused weight (Q/K/V in one, gate/up in one); only attention splits the rows
(``attention.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sarathi_pp.model_spec import ModelSpec
from sarathi_pp.stages.kernels.cpu import fused
from sarathi_pp.stages.model.attention import AttentionMetadata
from sarathi_pp.stages.model.linear import Linear
from sarathi_pp.stages.model.rope import RotaryEmbedding, apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As HF's LlamaRMSNorm: normalise in float32, scale in the model dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class TorchOps:
    """A layer's element-wise ops (RMSNorm, the residual add before it, rotary, SiLU * up) as
    torch ops, exactly as HF writes them: any device and dtype."""

    name = "torch"

    def __init__(self, rope: RotaryEmbedding) -> None:
        self.rope = rope

    def rotation(self, positions: torch.Tensor):
        """What ``rotary`` needs for these rows, computed once per forward: cos and sin."""
        return self.rope(positions)

    def rotary(self, x: torch.Tensor, rotation) -> torch.Tensor:
        cos, sin = rotation
        return apply_rotary(x, cos, sin)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + delta
        return x, rms_norm(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class CpuFusedOps(TorchOps):
    """The same ops as one C call each (``kernels/cpu/fused``): float32 on CPU."""

    name = "cpu_fused"

    def rotation(self, positions: torch.Tensor):
        return positions  # the kernel reads the cos/sin tables at each row's position

    def rotary(self, x: torch.Tensor, rotation) -> torch.Tensor:
        return fused.rotary_(x, rotation, self.rope.cos, self.rope.sin)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return fused.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused.add_rms_norm(x, delta, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return fused.silu_mul(gate_up)


def layer_ops(rope: RotaryEmbedding, dtype: torch.dtype, device: torch.device) -> TorchOps:
    """``CpuFusedOps`` where its kernels apply (float32 on CPU, built, not turned off by
    ``SARATHI_PP_CPU_FUSED=0``), else ``TorchOps``."""
    return CpuFusedOps(rope) if fused.fused_applies(dtype, device) else TorchOps(rope)


class DecoderLayer:
    def __init__(
        self, spec: ModelSpec, w: dict[str, torch.Tensor], prefix: str, attention, ops: TorchOps
    ) -> None:
        g = lambda k: w[f"{prefix}.{k}"]  # noqa: E731
        qkv_bias = None
        if spec.attention_bias:
            qkv_bias = torch.cat(
                [g("self_attn.q_proj.bias"), g("self_attn.k_proj.bias"), g("self_attn.v_proj.bias")]
            )
        qkv = [g(f"self_attn.{p}_proj.weight") for p in "qkv"]
        self.qkv = Linear(torch.cat(qkv), qkv_bias)
        self.o = Linear(g("self_attn.o_proj.weight"))
        self.gate_up = Linear(torch.cat([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")]))
        self.down = Linear(g("mlp.down_proj.weight"))
        self.ln1 = g("input_layernorm.weight")
        self.ln2 = g("post_attention_layernorm.weight")
        self.eps = spec.rms_norm_eps
        self.q_dim = spec.num_heads * spec.head_dim
        self.kv_dim = spec.num_kv_heads * spec.head_dim
        self.head_dim = spec.head_dim
        self.attention = attention
        self.ops = ops

    def __call__(self, x, rotation, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        # x: [num_tokens, hidden]; rotation: ``self.ops.rotation(meta.positions)``
        ops = self.ops
        h = ops.rms_norm(x, self.ln1, self.eps)
        qkv = self.qkv(h)  # [num_tokens, q_dim + 2 * kv_dim]
        q, k, v = qkv.split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        n = x.shape[0]
        q = ops.rotary(q.view(n, -1, self.head_dim), rotation)
        k = ops.rotary(k.view(n, -1, self.head_dim), rotation)
        v = v.reshape(n, -1, self.head_dim)
        attn = self.attention.forward(q, k, v, k_cache, v_cache, meta)
        x, h = ops.add_rms_norm(x, self.o(attn), self.ln2, self.eps)
        return x + self.down(ops.silu_mul(self.gate_up(h)))
