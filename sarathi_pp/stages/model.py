"""A Llama-family decoder slice (Llama, Mistral, Qwen2) over a flat token batch.

All rows of a hybrid micro-batch (prefill chunks + decode tokens) are concatenated to
``[num_tokens, hidden]``: every linear layer and the MLP is one matmul over ``Lp + Bd``
rows, which is what makes piggybacked decodes nearly free. Q/K/V and gate/up projections
are fused at load time (one matmul each instead of three and two). Only attention splits
the rows (``attention.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from sarathi_pp.model_spec import ModelSpec
from sarathi_pp.stages import fused_cpu
from sarathi_pp.stages.attention import ATTENTION_BACKENDS, AttentionMetadata
from sarathi_pp.stages.kv_cache import KVCache
from sarathi_pp.stages.layers_cpu import LayerLoop
from sarathi_pp.stages.linear import Linear
from sarathi_pp.stages.rope import RotaryEmbedding, apply_rotary
from sarathi_pp.stages.weights import EMBED, LM_HEAD, NORM, load_tensors, stage_tensor_names


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
    """The same ops as one C call each (``fused_cpu``): float32 on CPU."""

    name = "cpu_fused"

    def rotation(self, positions: torch.Tensor):
        return positions  # the kernel reads the cos/sin tables at each row's position

    def rotary(self, x: torch.Tensor, rotation) -> torch.Tensor:
        return fused_cpu.rotary_(x, rotation, self.rope.cos, self.rope.sin)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return fused_cpu.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_cpu.add_rms_norm(x, delta, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return fused_cpu.silu_mul(gate_up)


def layer_ops(rope: RotaryEmbedding, dtype: torch.dtype, device: torch.device) -> TorchOps:
    """``CpuFusedOps`` where its kernels apply (float32 on CPU, built, not turned off by
    ``SARATHI_PP_CPU_FUSED=0``), else ``TorchOps``."""
    return CpuFusedOps(rope) if fused_cpu.fused_applies(dtype, device) else TorchOps(rope)


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


def _lm_head(w: dict[str, torch.Tensor], is_first: bool, is_last: bool) -> Linear | None:
    """The last stage's lm_head as a ``Linear``: packed where ``Linear`` packs (CPU float32),
    like the layers' weights, except when it is the embedding this same stage looks tokens up
    in (tied weights, one stage), which stays one unpacked tensor (``F.linear``) rather than
    two copies.

    Note [packed lm_head]: decode steps sample every row, so lm_head multiplies few rows by
    the largest weight of a small model (SmolLM2-135M: 49152 x 576, a fifth of its
    parameters). Through ``F.linear`` (MKL) on a 2-core AVX-512 EPYC, 2 threads, the weight
    evicted between calls: 13.6 / 23.2 / 26.9 / 34.3 ms at 1 / 4 / 16 / 32 rows; prepacked
    for oneDNN 5.9 / 6.0 / 7.0 / 11.4 ms (2.3-3.9x); a 32000 x 1024 head 1.7-4.8x. With
    tied weights the last stage of a pipeline holds the embedding only as lm_head, so packing
    it there costs no memory; a single stage keeps ``F.linear`` (a packed copy would add the
    whole embedding to M_S, which the planner's ``stage_params`` does not count)."""
    if not is_last:
        return None
    if LM_HEAD in w:
        return Linear(w[LM_HEAD])
    return Linear(w[EMBED], kind="f_linear" if is_first else None)


class StageModel:
    """Decoder layers ``[layer_start, layer_end)``; the embedding on the first stage, the
    final norm and lm_head on the last."""

    def __init__(
        self,
        spec: ModelSpec,
        model_dir: str | Path,
        layer_start: int,
        layer_end: int,
        is_first: bool,
        is_last: bool,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        attention_backend: str = "torch",
    ) -> None:
        self.spec = spec
        self.is_first, self.is_last = is_first, is_last
        self.layer_start, self.layer_end = layer_start, layer_end
        names = stage_tensor_names(spec, layer_start, layer_end, is_first, is_last)
        w = load_tensors(model_dir, names, dtype, device, spec=spec)
        self.embed = w.get(EMBED) if is_first else None
        self.norm = w.get(NORM)
        self.lm_head = _lm_head(w, is_first, is_last)
        attention = ATTENTION_BACKENDS[attention_backend](
            spec.num_heads, spec.num_kv_heads, spec.head_dim
        )
        self.rope = RotaryEmbedding(spec, max_positions, dtype, device)
        self.ops = layer_ops(self.rope, dtype, device)
        self.layers = [
            DecoderLayer(spec, w, f"model.layers.{i}", attention, self.ops)
            for i in range(layer_start, layer_end)
        ]
        self.dtype, self.device = dtype, device
        self._loop: tuple[KVCache, LayerLoop | None] | None = None  # built at the first forward

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def param_bytes(self) -> int:
        ts = [self.embed, self.norm]
        linears = [lin for lyr in self.layers for lin in (lyr.qkv, lyr.o, lyr.gate_up, lyr.down)]
        if self.lm_head is not None and not (
            self.embed is not None and self.lm_head.weight is self.embed
        ):
            linears.append(self.lm_head)  # not the embedding itself (tied, one stage)
        for lyr in self.layers:
            ts += [lyr.qkv.bias, lyr.ln1, lyr.ln2]
        return sum(t.numel() * t.element_size() for t in ts if t is not None) + sum(
            lin.nbytes for lin in linears
        )

    def forward(self, inputs: torch.Tensor, meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        """``inputs``: token ids ``[num_tokens]`` on the first stage, else hidden states
        ``[num_tokens, hidden]``. Returns hidden states ``[num_tokens, hidden]`` (before the
        final norm)."""
        x = F.embedding(inputs, self.embed) if self.is_first else inputs
        loop = self.layer_loop(kv)
        if loop is not None and loop.applies(meta):
            # The loop updates x in place: the embedding's output is ours, hidden states are not.
            return loop(
                x if self.is_first else x.clone(memory_format=torch.contiguous_format), meta
            )
        return self.forward_layers(x, meta, kv)

    def forward_layers(self, x: torch.Tensor, meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        """The layers op by op from Python: where the layer loop does not apply (and the
        tests' reference for it)."""
        rotation = self.ops.rotation(meta.positions)
        for idx, layer in enumerate(self.layers):
            k_cache, v_cache = kv.flat(idx)
            x = layer(x, rotation, k_cache, v_cache, meta)
        return x

    def layer_loop(self, kv: KVCache) -> LayerLoop | None:
        """The layers as one C call with cache ``kv`` (``layers_cpu``), or None where it does
        not apply; built once per cache (the attention backend is set with the cache)."""
        if self._loop is None or self._loop[0] is not kv:
            self._loop = (kv, LayerLoop.build(self, kv))
        return self._loop[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden``: ``[num_sampled, hidden]`` rows to sample from -> float32 logits."""
        assert self.is_last
        assert self.lm_head is not None
        return self.lm_head(self.ops.rms_norm(hidden, self.norm, self.spec.rms_norm_eps)).float()
