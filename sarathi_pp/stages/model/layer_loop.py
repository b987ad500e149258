"""A stage's decoder layers over one micro-batch as one C call (CPU, float32).

Each op of a layer already runs in C (``linear``'s panel GEMM, ``kernels/cpu/fused``'s norms, rotary
and SiLU, ``kernels/cpu/paged_attention``'s attention), but one at a time from Python: per layer ~12 calls,
each with its tensor views, an output ``torch.empty``, argument conversion and a ctypes
call. Here a small C loop calls the same kernels, through their addresses, in the same order
on the same buffers, for every layer of the stage: the arithmetic is the per-op path's, bit
for bit (the tests compare the two), and Python runs once per micro-batch.

Note [the layer loop]: a decode step's small ops cost far more in a step than on their own:
between two ops the GEMMs stream a layer's weights through the caches, so the interpreter
and torch's dispatcher start cold every time, and the Python between and around the
kernels (norms, rotary, SiLU, adds, the wrappers) becomes a sizeable share of a decode
step. The loop removes that time from every step; prefill and hybrid steps are no slower.
The measurements: the lab notebook's "Figures moved out of the code", Note [the layer loop].

Applies (``LayerLoop.build``) when every layer's linears are ``panel_gemm``, the element-wise
ops are ``kernels/cpu/fused``'s and attention is ``cpu_paged`` with its kernels built; per
micro-batch when the kernels its rows need are there (the prefill kernel for prefill chunks).
``SARATHI_PP_CPU_LAYER_LOOP=0`` turns it off (the per-op path, for comparisons).
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING, Protocol

import torch

from sarathi_pp.model_spec import ModelSpec
from sarathi_pp.stages.kernels.cpu import fused
from sarathi_pp.stages.kernels.cpu.layer_loop import (
    Batch,
    Dims,
    Kernels,
    Layer,
    load_loop,
    ws_floats,
)
from sarathi_pp.stages.kernels.cpu.paged_attention import load_kernel, load_prefill
from sarathi_pp.stages.kernels.cpu.panel_gemm import load_gemm
from sarathi_pp.stages.model.attention import AttentionMetadata, CpuPagedAttention
from sarathi_pp.stages.model.decoder_layer import DecoderLayer, TorchOps
from sarathi_pp.stages.model.kv_cache import KVCache
from sarathi_pp.stages.model.rope import RotaryEmbedding

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

SWITCH = "SARATHI_PP_CPU_LAYER_LOOP"
P = ctypes.c_void_p


class LayerStack(Protocol):
    """What the loop reads of a stage's model (``llama.StageModel``)."""

    spec: ModelSpec
    layers: list[DecoderLayer]
    ops: TorchOps
    rope: RotaryEmbedding
    dtype: torch.dtype
    device: torch.device


def _address(fn) -> int:
    return ctypes.cast(fn, P).value or 0


class LayerLoop:
    """The layers of one stage, their kernels and dimensions, ready for ``layer_loop_f32``."""

    def __init__(
        self,
        layers: list[DecoderLayer],
        spec: ModelSpec,
        rope: RotaryEmbedding,
        kv: KVCache,
        fn: CFuncPtr,
    ) -> None:
        lib = fused.load_fused()
        gemm, decode, prefill = load_gemm(), load_kernel(), load_prefill()
        assert lib is not None and gemm is not None and decode is not None
        self.fn = fn
        self.kernels = Kernels(
            _address(gemm), _address(lib.rms_norm_f32), _address(lib.rotary_f32),
            _address(lib.silu_mul_f32), _address(decode), _address(prefill) if prefill else None,
        )  # fmt: skip
        self.has_prefill = prefill is not None
        self.num_slots = kv.num_blocks * kv.block_size
        self._keep = [rope.cos, rope.sin]  # what the pointers below point into
        entries = []
        for idx, layer in enumerate(layers):
            k, v = kv.flat(idx)
            tensors = [
                layer.ln1.contiguous(), layer.ln2.contiguous(), layer.qkv.packed,
                None if layer.qkv.bias is None else layer.qkv.bias.contiguous(), layer.o.packed,
                layer.gate_up.packed, layer.down.packed, k, v,
            ]  # fmt: skip
            self._keep += [t for t in tensors if t is not None]
            entries.append(Layer(*[None if t is None else t.data_ptr() for t in tensors]))
        self.layers = (Layer * len(entries))(*entries)
        self.num_layers = len(entries)
        layer = layers[0]
        self.hidden = spec.hidden_size
        self.inter = layer.down.in_features
        self.dims = Dims(
            spec.hidden_size, self.inter, spec.num_heads, spec.num_kv_heads, spec.head_dim,
            kv.block_size, layer.eps, layer.attention.scale, rope.cos.data_ptr(),
            rope.sin.data_ptr(), rope.cos.shape[0],
        )  # fmt: skip
        self.row_floats = ws_floats(spec.hidden_size, self.inter, layer.q_dim, layer.kv_dim)
        self._ws = torch.empty(0)

    @classmethod
    def build(cls, model: LayerStack, kv: KVCache) -> LayerLoop | None:
        """The loop over ``model``'s layers with cache ``kv``, or None where it does not
        apply (see the module docstring) or ``SARATHI_PP_CPU_LAYER_LOOP=0``."""
        fn = load_loop() if os.environ.get(SWITCH, "1") != "0" else None
        layers = model.layers
        if fn is None or not layers or model.ops.name != "cpu_fused":
            return None
        if model.dtype != torch.float32 or model.device.type != "cpu":
            return None
        if not kv.k or kv.k[0].dtype != torch.float32 or load_kernel() is None:
            return None
        for layer in layers:
            if not isinstance(layer.attention, CpuPagedAttention):
                return None
            if any(
                lin.kind != "panel_gemm" for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
            ):
                return None
        return cls(layers, model.spec, model.rope, kv, fn)

    def applies(self, meta: AttentionMetadata) -> bool:
        """Does this micro-batch's attention have its kernels here?"""
        if meta.prefills and not self.has_prefill:
            return False
        return meta.decode_blocks is None or meta.decode_lens is not None

    def __call__(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``x [rows, hidden]`` (float32, contiguous, owned: updated in place) through every
        layer; returns ``x``."""
        rows = x.shape[0]
        assert x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] == self.hidden
        need = rows * self.row_floats
        if self._ws.numel() < need:  # grows to the largest micro-batch and stays
            self._ws = torch.empty(need)
        positions = meta.positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        if rows:  # C would write out of bounds
            lo, hi = (int(t) for t in torch.aminmax(slots))
            if lo < 0 or hi >= self.num_slots:
                raise IndexError(f"layer loop: a KV slot outside [0, {self.num_slots}): {lo}..{hi}")
        # every tensor (and ctypes array) the pointers below point into, alive
        keep: list[object] = [positions, slots]
        n_pre = len(meta.prefills)
        batch = Batch(rows, positions.data_ptr(), slots.data_ptr(), n_pre)
        if n_pre:
            info = torch.tensor(
                [[p.row_start for p in meta.prefills], [p.row_end - p.row_start for p in meta.prefills],
                 [p.start for p in meta.prefills]], dtype=torch.int64,
            )  # fmt: skip
            blocks = [p.context_blocks.to(torch.int64).contiguous() for p in meta.prefills]
            ptrs = (P * n_pre)(*[t.data_ptr() for t in blocks])
            keep += [info, ptrs, *blocks]
            batch.prefill_row, batch.prefill_len = info[0].data_ptr(), info[1].data_ptr()
            batch.prefill_start = info[2].data_ptr()
            batch.prefill_blocks = ctypes.cast(ptrs, P)
        if meta.decode_blocks is not None:
            assert meta.decode_lens is not None
            assert meta.decode_blocks.dtype == torch.int64
            tables = meta.decode_blocks.contiguous()
            lens = meta.decode_lens.to(torch.int64).contiguous()
            keep += [tables, lens]
            batch.num_decodes = tables.shape[0]
            batch.decode_tables, batch.decode_stride = tables.data_ptr(), tables.stride(0)
            batch.decode_lens = lens.data_ptr()
        rc = self.fn(
            ctypes.byref(self.kernels), self.layers, self.num_layers, ctypes.byref(self.dims),
            ctypes.byref(batch), x.data_ptr(), self._ws.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc == 1:
            raise MemoryError("layer loop: a kernel could not allocate its scratch memory")
        if rc == 2:
            raise fused.position_error(positions, self.dims.max_positions)
        if rc:
            raise RuntimeError(f"layer loop: a kernel the rows need is missing (code {rc})")
        return x
