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
from sarathi_pp.stages.loader.weights import EMBED, LM_HEAD, NORM, load_tensors, stage_tensor_names
from sarathi_pp.stages.model.attention import ATTENTION_BACKENDS, AttentionMetadata
from sarathi_pp.stages.model.decoder_layer import DecoderLayer, layer_ops
from sarathi_pp.stages.model.kv_cache import KVCache
from sarathi_pp.stages.model.layer_loop import LayerLoop
from sarathi_pp.stages.model.linear import Linear
from sarathi_pp.stages.model.rope import RotaryEmbedding


def _lm_head(w: dict[str, torch.Tensor], is_first: bool, is_last: bool) -> Linear | None:
    """The last stage's lm_head as a ``Linear``: packed where ``Linear`` packs (CPU float32),
    like the layers' weights, except when it is the embedding this same stage looks tokens up
    in (tied weights, one stage), which stays one unpacked tensor (``F.linear``) rather than
    two copies.

    Note [packed lm_head]: decode steps sample every row, so lm_head multiplies few rows by
    the largest weight of a small model (SmolLM2-135M: 49152 x 576, a fifth of its
    parameters). With the weight evicted between calls, as in a step, prepacked for oneDNN it
    takes a fraction of ``F.linear``'s (MKL) time at 1 to 32 rows, for a larger head too (the
    figures: the lab notebook's "Figures moved out of the code", Note [packed lm_head]). With
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
        if self.is_first:
            assert self.embed is not None
            x = F.embedding(inputs, self.embed)
        else:
            x = inputs
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
        """The layers as one C call with cache ``kv`` (``layer_loop``), or None where it does
        not apply; built once per cache (the attention backend is set with the cache)."""
        if self._loop is None or self._loop[0] is not kv:
            self._loop = (kv, LayerLoop.build(self, kv))
        return self._loop[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden``: ``[num_sampled, hidden]`` rows to sample from -> float32 logits."""
        assert self.is_last
        assert self.lm_head is not None and self.norm is not None
        return self.lm_head(self.ops.rms_norm(hidden, self.norm, self.spec.rms_norm_eps)).float()
