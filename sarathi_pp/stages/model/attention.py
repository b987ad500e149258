"""Split attention for a hybrid micro-batch.

The flat batch is ``[prefill rows | decode rows]``. Linear layers run once over all rows;
attention splits them (see DESIGN.md, "The hybrid micro-batch"):

* each prefill chunk's rows attend causally within the chunk and fully to the KV cached
  for earlier chunks of the same prompt;
* decode rows attend to their sequence's paged KV;

and the outputs are written back into one ``[num_tokens, heads * head_dim]`` tensor. The
new K/V of every row is written to its slot in the cache first, so a chunk reads its own
keys from the cache like the earlier ones.

Backends, by name (``ATTENTION_BACKENDS``): ``torch`` (SDPA over gathered K/V; CPU and
CUDA), ``cpu_paged`` (decodes, and on AVX-512 or AVX2 CPUs prefill chunks, read the paged
cache in place with small C kernels, ``kernels/cpu/paged_attention``; elsewhere prefill chunks as ``torch``),
``flex_paged`` (decodes the same on CUDA with FlexAttention, ``flex_paged.py``; block size a
multiple of 16) and ``flash_attn`` (flash-attn's varlen/paged kernels; CUDA, block size a
multiple of 256).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from sarathi_pp.config import ATTENTION_BACKEND_NAMES
from sarathi_pp.stages.kernels.cpu.paged_attention import (
    kernel_supports,
    load_prefill,
    paged_decode,
    paged_prefill,
)
from sarathi_pp.stages.model.backend_choice import (  # noqa: F401 - re-exported
    AttentionRecord,
    flash_attn_available,
    select_backend,
)
from sarathi_pp.stages.model.flex_paged import (  # noqa: F401 - flex_available re-exported
    FlexMasks,
    block_logical_map,
    decode_block_mask,
    flex_available,
    flex_paged_decode,
    flex_paged_prefill,
    prefill_block_mask,
)

log = logging.getLogger(__name__)


@dataclass
class PrefillSlice:
    """One prefill chunk: rows ``[row_start, row_end)`` at positions ``[start, start+len)``."""

    row_start: int
    row_end: int
    start: int  # position of the chunk's first token = tokens already cached before it
    context_blocks: torch.Tensor  # [ceil(end / block_size)] blocks holding positions 0 .. end-1


@dataclass
class AttentionMetadata:
    """Per micro-batch (several are in flight under PP, so never module-level state)."""

    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens] where each row's new K/V goes
    num_prefill_tokens: int
    prefills: list[PrefillSlice]
    decode_blocks: torch.Tensor | None  # [num_decodes, max_blocks] padded block tables
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] True = attend
    decode_lens: torch.Tensor | None = None  # [num_decodes] int64: keys per decode (pos + 1)
    # For flash-attn: block tables and lengths (built only when that backend is used).
    block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor | None = None  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor | None = None  # [num_prefills + 1] int32
    max_query_len: int = 0
    max_context_len: int = 0
    block_size: int = 0
    # For flex_paged: the block masks, built by the micro-batch's first layer for all.
    flex_masks: FlexMasks | None = None


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    # k_cache: [num_slots, kv_heads, head_dim]; k: [num_tokens, kv_heads, head_dim]
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


class TorchAttention:
    """PyTorch SDPA over gathered paged KV. Exact and portable; the CPU path."""

    name = "torch"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        record: AttentionRecord | None = None,
    ) -> None:
        # where this backend's fallbacks go (the stage's; a backend made alone keeps its own)
        self.record = record or AttentionRecord(0, self.name)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        # Reused buffers for the gathered K and V (see Note [gather workspace]).
        self._workspace: dict[str, torch.Tensor] = {}

    def _gather(
        self, name: str, cache: torch.Tensor, blocks: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """``gather_blocks`` into this backend's ``name`` buffer ("k" or "v"); the result
        is valid until the next ``_gather`` of the same name.

        Note [gather workspace]: a fresh tensor per gather costs more than the copy itself
        on CPU: tens of MB per layer per step come from mmap, and every page faults and is
        zeroed (32 decodes x 1 k context: 37 ms fresh vs 7 ms into a reused buffer). The
        layers of a stage run one after another and each consumes its K/V before the next
        gathers, so one "k" and one "v" buffer per stage suffice. They grow to the largest
        gather seen and stay (bounded by max_num_seqs x max_model_len tokens of one layer).
        """
        n = blocks.numel()
        shape = (n, block_size, *cache.shape[1:])
        ws = self._workspace.get(name)
        need = n * block_size * cache.shape[1] * cache.shape[2]
        if ws is None or ws.numel() < need or ws.dtype != cache.dtype or ws.device != cache.device:
            ws = torch.empty(need, dtype=cache.dtype, device=cache.device)
            self._workspace[name] = ws
        out = ws[:need].view(shape)
        return gather_blocks(cache, blocks, block_size, out=out)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, heads, head_dim]
        k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, heads * head_dim]
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        for p in meta.prefills:
            out[p.row_start : p.row_end] = self._prefill(
                q, k, v, k_cache, v_cache, p, meta.block_size
            )
        if meta.decode_blocks is not None:
            out[meta.num_prefill_tokens :] = self._decode(
                q[meta.num_prefill_tokens :], k_cache, v_cache, meta
            )
        return out.view(q.shape[0], -1)

    def _prefill(self, q, k, v, k_cache, v_cache, p: PrefillSlice, block_size: int) -> torch.Tensor:
        # 4-D [1, heads, len, head_dim]: with a batch dimension SDPA takes its fused (flash)
        # CPU kernel; 3-D inputs fall back to the unfused math path, 2x slower here.
        qc = q[p.row_start : p.row_end].transpose(0, 1)[None]
        if p.start == 0:  # first chunk: its own K/V is all the context
            kc = k[p.row_start : p.row_end].transpose(0, 1)[None]
            vc = v[p.row_start : p.row_end].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                qc, kc, vc, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            n = p.row_end - p.row_start
            end = p.start + n
            kc = self._gather("k", k_cache, p.context_blocks, block_size)[:end].transpose(0, 1)[
                None
            ]
            vc = self._gather("v", v_cache, p.context_blocks, block_size)[:end].transpose(0, 1)[
                None
            ]
            q_pos = torch.arange(p.start, end, device=q.device)
            k_pos = torch.arange(end, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]  # [len, context] causal with offset
            o = F.scaled_dot_product_attention(
                qc, kc, vc, attn_mask=mask[None, None], scale=self.scale, enable_gqa=True
            )
        return o[0].transpose(0, 1)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        qd = q.unsqueeze(2)  # [num_decodes, heads, 1, head_dim]
        bt = meta.decode_blocks
        assert bt is not None  # decode rows have block tables
        # [num_decodes, kv_heads, max_blocks * block_size, head_dim]
        kd = self._gather("k", k_cache, bt, meta.block_size).transpose(1, 2)
        vd = self._gather("v", v_cache, bt, meta.block_size).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=True
        )
        return o.squeeze(2)


def gather_blocks(
    cache: torch.Tensor, blocks: torch.Tensor, block_size: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy whole KV blocks out of the paged cache: ``blocks`` [..., num_blocks] ->
    [..., num_blocks * block_size, kv_heads, head_dim]. One contiguous copy per block, not
    per token (a per-slot gather dominated decode steps on CPU). ``out``: a contiguous
    [blocks.numel(), block_size, kv_heads, head_dim] buffer to copy into."""
    paged = cache.view(-1, block_size, *cache.shape[1:])  # [blocks, block_size, kvh, d]
    if out is None:
        out = paged.index_select(0, blocks.reshape(-1))
    else:
        torch.index_select(paged, 0, blocks.reshape(-1), out=out)
    return out.view(*blocks.shape[:-1], blocks.shape[-1] * block_size, *cache.shape[1:])


class CpuPagedAttention(TorchAttention):
    """``torch``, except that attention reads K/V from the paged cache where they lie:
    decode rows through ``paged_attention.paged_decode`` instead of gathering every context into
    a buffer first, and prefill chunks through ``paged_attention.paged_prefill`` where it is built
    (AVX-512 or AVX2 + FMA; 1.6-2.5x gather + SDPA with AVX-512, Note [paged prefill on
    CPU]), else gather + SDPA."""

    name = "cpu_paged"

    def _prefill(self, q, k, v, k_cache, v_cache, p: PrefillSlice, block_size: int) -> torch.Tensor:
        if load_prefill() is None:  # recorded once, when the backend was chosen
            return super()._prefill(q, k, v, k_cache, v_cache, p, block_size)
        if not kernel_supports(q, k_cache):
            self.record.fallback(f"prefill: the paged kernel takes float32, not {q.dtype}")
            return super()._prefill(q, k, v, k_cache, v_cache, p, block_size)
        return paged_prefill(
            q[p.row_start : p.row_end], k_cache, v_cache, p.context_blocks, p.start, block_size,
            self.scale,
        )  # fmt: skip

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if not kernel_supports(q, k_cache):
            self.record.fallback(f"decode: the paged kernel takes float32, not {q.dtype}")
            return super()._decode(q, k_cache, v_cache, meta)
        assert meta.decode_lens is not None  # decode rows have lengths
        assert meta.decode_blocks is not None
        return paged_decode(
            q, k_cache, v_cache, meta.decode_blocks, meta.decode_lens, meta.block_size, self.scale
        )


class FlexPagedAttention(TorchAttention):
    """``torch``, except that decode rows and prefill chunks read the paged cache in place
    with FlexAttention (``flex_paged.py``; compiled on CUDA, eager elsewhere unless
    ``compiled``). The block masks are built once per micro-batch, by the first layer, and
    kept on its metadata. A call that raises is a recorded fallback to gather + SDPA, and
    that kind of row (decode, prefill) stays on gather + SDPA for the rest of the run."""

    name = "flex_paged"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        record: AttentionRecord | None = None,
        max_blocks_per_seq: int | None = None,
        compiled: bool | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, record)
        self.max_blocks_per_seq = max_blocks_per_seq  # the masks' width; None: per micro-batch
        self.compiled = compiled  # None: on CUDA
        self.failed: dict[str, str] = {}  # "decode" / "prefill" -> why FlexAttention failed

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        compiled = q.device.type == "cuda" if self.compiled is None else self.compiled
        # inductor's CPU template wants index tensors spanning the whole cache (flex_cpu.py)
        whole_cache = compiled and q.device.type == "cpu"
        masks = self._masks(meta, k_cache.shape[0], whole_cache)
        out = torch.empty_like(q)
        for i, p in enumerate(meta.prefills):
            rows = slice(p.row_start, p.row_end)
            out[rows] = self._try(
                "prefill",
                partial(flex_paged_prefill, q[rows], k_cache, v_cache, masks.prefill[i],
                        self.scale, compiled),
                partial(self._prefill, q, k, v, k_cache, v_cache, p, meta.block_size),
            )  # fmt: skip
        if meta.decode_blocks is not None:
            qd = q[meta.num_prefill_tokens :]
            out[meta.num_prefill_tokens :] = self._try(
                "decode",
                partial(flex_paged_decode, qd, k_cache, v_cache, masks.decode, self.scale,
                        compiled),
                partial(self._decode, qd, k_cache, v_cache, meta),
            )  # fmt: skip
        return out.view(q.shape[0], -1)

    def _try(self, kind: str, flex, fallback) -> torch.Tensor:
        if kind not in self.failed:
            try:
                return flex()
            except Exception as e:  # noqa: BLE001 - a compiler failure must not fail requests
                self.failed[kind] = f"{type(e).__name__}: {str(e)[:300]}"
        self.record.fallback(f"{kind} rows run gather + SDPA: FlexAttention failed: "
                             f"{self.failed[kind]}")  # fmt: skip
        return fallback()

    def _masks(self, meta: AttentionMetadata, num_slots: int, whole_cache: bool) -> FlexMasks:
        """The micro-batch's block masks, built by its first layer (Note [flex block shapes]);
        ``whole_cache``: their width is every block of the cache."""
        if meta.flex_masks is not None:
            return meta.flex_masks
        bs = meta.block_size
        tables = [p.context_blocks for p in meta.prefills]
        if meta.decode_blocks is not None:
            assert meta.decode_lens is not None
            used = -(-meta.decode_lens // bs)
            logical = torch.arange(meta.decode_blocks.shape[1], device=used.device)
            tables.append(torch.where(logical < used[:, None], meta.decode_blocks, -1))
        width = self.max_blocks_per_seq or _width(max(t.shape[-1] for t in tables))
        if whole_cache:
            width = num_slots // bs
        phys_logical = block_logical_map(tables, num_slots // bs, meta.positions.device)
        masks = FlexMasks()
        for p in meta.prefills:
            n = p.row_end - p.row_start
            masks.prefill.append(
                prefill_block_mask(p.context_blocks, p.start, n, bs, num_slots, width, phys_logical)
            )
        if meta.decode_blocks is not None:
            assert meta.decode_lens is not None
            masks.decode = decode_block_mask(
                meta.decode_blocks, meta.decode_lens, bs, num_slots, width, phys_logical
            )
            masks.num_decodes = meta.decode_blocks.shape[0]
        meta.flex_masks = masks
        return masks


def _width(max_blocks: int) -> int:
    """A mask width for ``max_blocks`` when the run's is unknown: a power of two >= 16."""
    w = 16
    while w < max_blocks:
        w *= 2
    return w


class FlashAttention(TorchAttention):
    """flash-attn's paged kernels on CUDA: varlen for prefill chunks (queries attend to the
    paged cache through the block table), ``flash_attn_with_kvcache`` for decodes."""

    name = "flash_attn"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        record: AttentionRecord | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, record)
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        assert meta.block_tables is not None and meta.context_lens is not None
        block_size = meta.block_size
        kc = k_cache.view(-1, block_size, *k_cache.shape[1:])  # [blocks, block_size, kvh, d]
        vc = v_cache.view(-1, block_size, *v_cache.shape[1:])
        out = torch.empty_like(q)
        num_prefills = len(meta.prefills)
        npt = meta.num_prefill_tokens
        if num_prefills:
            lens_k = meta.context_lens[:num_prefills]
            cu_k = F.pad(lens_k.cumsum(0, dtype=torch.int32), (1, 0))
            out[:npt] = self._varlen(
                q[:npt],
                kc,
                vc,
                cu_seqlens_q=meta.cu_seqlens_q,
                cu_seqlens_k=cu_k,
                max_seqlen_q=meta.max_query_len,
                max_seqlen_k=meta.max_context_len,
                softmax_scale=self.scale,
                causal=True,
                block_table=meta.block_tables[:num_prefills],
            )
        if q.shape[0] > npt:
            out[npt:] = self._with_kvcache(
                q[npt:].unsqueeze(1),
                kc,
                vc,
                cache_seqlens=meta.context_lens[num_prefills:],
                block_table=meta.block_tables[num_prefills:],
                softmax_scale=self.scale,
                causal=True,
            ).squeeze(1)
        return out.view(q.shape[0], -1)


ATTENTION_BACKENDS = {
    "torch": TorchAttention,
    "cpu_paged": CpuPagedAttention,
    "flex_paged": FlexPagedAttention,
    "flash_attn": FlashAttention,
}
assert set(ATTENTION_BACKENDS) == set(ATTENTION_BACKEND_NAMES) - {"auto"}


def make_backend(
    name: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    record: AttentionRecord,
    max_blocks_per_seq: int | None = None,
) -> TorchAttention:
    """The backend ``name`` for one stage (shared by its layers), its fallbacks into
    ``record``; ``max_blocks_per_seq``: the most KV blocks one sequence holds (flex_paged's
    mask width)."""
    if name == "flex_paged":
        return FlexPagedAttention(num_heads, num_kv_heads, head_dim, record, max_blocks_per_seq)
    return ATTENTION_BACKENDS[name](num_heads, num_kv_heads, head_dim, record)
