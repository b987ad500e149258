"""A stage's decoder layers over one micro-batch as one C call (CPU, float32).

Each op of a layer already runs in C (``linear``'s panel GEMM, ``fused_cpu``'s norms, rotary
and SiLU, ``paged_cpu``'s attention), but one at a time from Python: per layer ~12 calls,
each with its tensor views, an output ``torch.empty``, argument conversion and a ctypes
call. Here a small C loop calls the same kernels, through their addresses, in the same order
on the same buffers, for every layer of the stage: the arithmetic is the per-op path's, bit
for bit (the tests compare the two), and Python runs once per micro-batch.

Note [the layer loop]: a decode step's small ops cost far more in a step than on their own.
On a 2-core AVX-512 EPYC (2026-12-02, the embedded model, 16 decodes at 600 tokens of
context, 2 threads) one ``fused_cpu.rms_norm`` of 16 x 1024 takes 16-23 us in a loop
(4 us of it the C call) but 66 us inside a step: between two ops the GEMMs stream 45 MB of
weights per layer through the caches, so the interpreter and torch's dispatcher start cold
every time. Of that step's 33 ms, the linears took 18 ms and the attention kernel 8.2 ms;
~6 ms were the Python between and around the kernels (norms, rotary, SiLU and adds 3 ms,
the attention's wrapper 1.5 ms, the linears' wrappers the rest). The loop removes that time
from every step. Measured with it off and on alternated (the same machine and day; README,
issue 15's eighth round): ``benchmarks/piggyback.py`` decode-only steps at 600 tokens of
context, 16 decodes 32.4-33.2 -> 26.8-29.9 ms, 1 decode 17.0-19.3 -> 14.9-16.1 ms, 32 x 1 k
66.0 / 66.6 -> 58.8 / 55.8 ms; prefill and hybrid steps no slower; ``make demo``'s
``generate`` (SmolLM2-135M, 30 layers of hidden 576) at PP=1 29.7 / 26.5 -> 33.8 / 32.4
tokens/s, at PP=2 33.5 / 32.8 -> 35.3 / 34.5 (two stages and the driver on 2 cores).

Applies (``LayerLoop.build``) when every layer's linears are ``panel_gemm``, the element-wise
ops are ``fused_cpu``'s and attention is ``cpu_paged`` with its kernels built; per
micro-batch when the kernels its rows need are there (the prefill kernel for prefill chunks).
``SARATHI_PP_CPU_LAYER_LOOP=0`` turns it off (the per-op path, for comparisons).
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import cache
from typing import TYPE_CHECKING

import torch

from sarathi_pp.model_spec import ModelSpec
from sarathi_pp.stages import fused_cpu
from sarathi_pp.stages.attention import AttentionMetadata, CpuPagedAttention
from sarathi_pp.stages.cpu_kernels import KernelUnavailable, build
from sarathi_pp.stages.kv_cache import KVCache
from sarathi_pp.stages.linear import load_gemm
from sarathi_pp.stages.paged_cpu import load_kernel, load_prefill
from sarathi_pp.stages.rope import RotaryEmbedding

if TYPE_CHECKING:  # model.py imports this module
    from sarathi_pp.stages.model import DecoderLayer, StageModel

log = logging.getLogger(__name__)

SWITCH = "SARATHI_PP_CPU_LAYER_LOOP"

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

typedef int (*gemm_fn)(const float *, int64_t, int64_t, const float *, int64_t, float *, int);
typedef void (*rms_fn)(const float *, int64_t, const float *, float *, const float *, float *,
                       int64_t, int64_t, float, int);
typedef int (*rot_fn)(float *, int64_t, int64_t, int, int, const float *, const float *,
                      const int64_t *, int64_t, int);
typedef void (*silu_fn)(const float *, float *, int64_t, int64_t, int);
typedef int (*decode_fn)(const float *, const float *, const float *, const int64_t *, int64_t,
                         const int64_t *, float *, int, int, int, int, int, float, int);
typedef int (*prefill_fn)(const float *, int64_t, const float *, const float *, const int64_t *,
                          float *, int64_t, int, int, int, int, int, int, float, int);

typedef struct {
    gemm_fn gemm; rms_fn rms; rot_fn rot; silu_fn silu; decode_fn decode; prefill_fn prefill;
} kernels_t;

typedef struct {  /* one decoder layer: its weights (linears packed for gemm) and K/V cache */
    const float *ln1, *ln2, *qkv, *qkv_bias, *o, *gate_up, *down;
    float *k_cache, *v_cache;
} layer_t;

typedef struct {
    int64_t hidden, inter;
    int heads, kv_heads, head_dim, block_size;
    float eps, scale;
    const float *cos, *sin;
    int64_t max_positions;
} dims_t;

typedef struct {  /* the micro-batch's rows: prefill chunks first, then one row per decode */
    int64_t rows;
    const int64_t *positions, *slots;
    int64_t num_prefills;
    const int64_t *prefill_row, *prefill_len, *prefill_start;
    const int64_t *const *prefill_blocks;
    int64_t num_decodes;
    const int64_t *decode_tables;
    int64_t decode_stride;
    const int64_t *decode_lens;
} batch_t;

/* x [rows, hidden] <- the layers applied to it, in place. ws: rows x ws_floats() floats of
   scratch (ws_floats in Python sums the buffers laid out below). Returns 0; 1 when a kernel
   could not allocate its scratch memory; 2 when a position is outside the rotary tables; 3
   when a kernel the rows need is missing. */
int layer_loop_f32(const kernels_t *kn, const layer_t *layers, int num_layers, const dims_t *d,
                   const batch_t *b, float *x, float *ws, int nt) {
    const int64_t R = b->rows, H = d->hidden, I = d->inter;
    const int64_t Q = (int64_t)d->heads * d->head_dim, KV = (int64_t)d->kv_heads * d->head_dim;
    const int64_t QKV = Q + 2 * KV;
    float *h = ws, *qkv = h + R * H, *qc = qkv + R * QKV, *att = qc + R * Q, *o = att + R * Q;
    float *gu = o + R * H, *act = gu + R * 2 * I, *dn = act + R * I;
    const int64_t dec0 = R - b->num_decodes;
    if (b->num_prefills && kn->prefill == NULL) return 3;
    if (b->num_decodes && kn->decode == NULL) return 3;
    for (int l = 0; l < num_layers; l++) {
        const layer_t *L = layers + l;
        kn->rms(x, H, NULL, NULL, L->ln1, h, R, H, d->eps, nt);
        if (kn->gemm(h, R, H, L->qkv, QKV, qkv, nt)) return 1;
        if (L->qkv_bias)
            for (int64_t r = 0; r < R; r++)
                for (int64_t c = 0; c < QKV; c++) qkv[r * QKV + c] += L->qkv_bias[c];
        if (kn->rot(qkv, QKV, R, d->heads, d->head_dim, d->cos, d->sin, b->positions,
                    d->max_positions, nt)) return 2;
        if (kn->rot(qkv + Q, QKV, R, d->kv_heads, d->head_dim, d->cos, d->sin, b->positions,
                    d->max_positions, nt)) return 2;
        for (int64_t r = 0; r < R; r++) {  /* this step's K/V into the cache */
            memcpy(L->k_cache + b->slots[r] * KV, qkv + r * QKV + Q, sizeof(float) * KV);
            memcpy(L->v_cache + b->slots[r] * KV, qkv + r * QKV + Q + KV, sizeof(float) * KV);
        }
        for (int64_t p = 0; p < b->num_prefills; p++) {
            const int64_t r0 = b->prefill_row[p];
            if (kn->prefill(qkv + r0 * QKV, QKV, L->k_cache, L->v_cache, b->prefill_blocks[p],
                            att + r0 * Q, Q, (int)b->prefill_len[p], (int)b->prefill_start[p],
                            d->heads, d->kv_heads, d->head_dim, d->block_size, d->scale, nt))
                return 1;
        }
        if (b->num_decodes) {  /* the decode kernel reads q contiguous */
            for (int64_t r = dec0; r < R; r++) memcpy(qc + (r - dec0) * Q, qkv + r * QKV, sizeof(float) * Q);
            if (kn->decode(qc, L->k_cache, L->v_cache, b->decode_tables, b->decode_stride,
                           b->decode_lens, att + dec0 * Q, (int)b->num_decodes, d->heads,
                           d->kv_heads, d->head_dim, d->block_size, d->scale, nt))
                return 1;
        }
        if (kn->gemm(att, R, Q, L->o, H, o, nt)) return 1;
        kn->rms(x, H, o, x, L->ln2, h, R, H, d->eps, nt);  /* x += o; h = norm(x) */
        if (kn->gemm(h, R, H, L->gate_up, 2 * I, gu, nt)) return 1;
        kn->silu(gu, act, R, I, nt);
        if (kn->gemm(act, R, I, L->down, H, dn, nt)) return 1;
        for (int64_t i = 0; i < R * H; i++) x[i] += dn[i];
    }
    return 0;
}
"""


def ws_floats(hidden: int, inter: int, q_dim: int, kv_dim: int) -> int:
    """Scratch floats per row (the C loop's h, qkv, q, attention out, o, gate_up, act, down)."""
    return hidden + (q_dim + 2 * kv_dim) + 2 * q_dim + hidden + 3 * inter + hidden


P = ctypes.c_void_p


class _Kernels(ctypes.Structure):
    _fields_ = [(n, P) for n in ("gemm", "rms", "rot", "silu", "decode", "prefill")]


class _Layer(ctypes.Structure):
    _fields_ = [(n, P) for n in ("ln1", "ln2", "qkv", "qkv_bias", "o", "gate_up", "down", "k", "v")]


class _Dims(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64), ("inter", ctypes.c_int64), ("heads", ctypes.c_int),
        ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int), ("block_size", ctypes.c_int),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("cos", P), ("sin", P),
        ("max_positions", ctypes.c_int64),
    ]  # fmt: skip


class _Batch(ctypes.Structure):
    _fields_ = [
        ("rows", ctypes.c_int64), ("positions", P), ("slots", P), ("num_prefills", ctypes.c_int64),
        ("prefill_row", P), ("prefill_len", P), ("prefill_start", P), ("prefill_blocks", P),
        ("num_decodes", ctypes.c_int64), ("decode_tables", P), ("decode_stride", ctypes.c_int64),
        ("decode_lens", P),
    ]  # fmt: skip


@cache
def load_loop() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The compiled ``layer_loop_f32``, or None where nothing builds (logged once). It only
    calls other kernels, so it needs no OpenMP."""
    try:
        lib, _ = build("layer_loop", _SOURCE)
    except KernelUnavailable as e:
        log.warning("CPU layer loop unavailable, running layers op by op: %s", e)
        return None
    fn = lib.layer_loop_f32
    fn.argtypes = [P, P, ctypes.c_int, P, P, P, P, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


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
        fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
    ) -> None:
        lib = fused_cpu.load_fused()
        gemm, decode, prefill = load_gemm(), load_kernel(), load_prefill()
        assert lib is not None and gemm is not None and decode is not None
        self.fn = fn
        self.kernels = _Kernels(
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
            entries.append(_Layer(*[None if t is None else t.data_ptr() for t in tensors]))
        self.layers = (_Layer * len(entries))(*entries)
        self.num_layers = len(entries)
        layer = layers[0]
        self.hidden = spec.hidden_size
        self.inter = layer.down.in_features
        self.dims = _Dims(
            spec.hidden_size, self.inter, spec.num_heads, spec.num_kv_heads, spec.head_dim,
            kv.block_size, layer.eps, layer.attention.scale, rope.cos.data_ptr(),
            rope.sin.data_ptr(), rope.cos.shape[0],
        )  # fmt: skip
        self.row_floats = ws_floats(spec.hidden_size, self.inter, layer.q_dim, layer.kv_dim)
        self._ws = torch.empty(0)

    @classmethod
    def build(cls, model: StageModel, kv: KVCache) -> LayerLoop | None:
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
        keep = [positions, slots]  # every tensor the pointers below point into, alive
        n_pre = len(meta.prefills)
        batch = _Batch(rows, positions.data_ptr(), slots.data_ptr(), n_pre)
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
            raise fused_cpu.position_error(positions, self.dims.max_positions)
        if rc:
            raise RuntimeError(f"layer loop: a kernel the rows need is missing (code {rc})")
        return x
