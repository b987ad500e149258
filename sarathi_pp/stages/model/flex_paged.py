"""FlexAttention over the paged KV cache in place: decode rows and prefill chunks.

The cache of a layer, ``[num_slots, kv_heads, head_dim]``, is viewed (no copy) as one
"physical" sequence ``[1, kv_heads, num_slots, head_dim]``. Queries attend to it through a
``BlockMask`` whose KV blocks are the sequence's KV-cache blocks, straight from its block
table (``BlockMask.from_kv_blocks``, KV block = ``block_size``), so FlexAttention's kernel
visits only those blocks and reads each K/V once, where it lies. A ``mask_mod`` cuts what
the blocks hold beyond a query's position (Note [flex paged mask]).

* Decodes: one batch entry per decode row, ``[num_decodes, heads, 1, head_dim]``, the batch
  padded to a bucket (``DECODE_BUCKETS``).
* A prefill chunk: ``[1, heads, chunk, head_dim]``, causal with the chunk's offset, its rows
  padded to a bucket (``prefill_bucket``).

Note [flex block shapes]: FlexAttention's Triton templates (torch ``_inductor/kernel/flex/
flex_attention.py``, ``flex_decoding.py``) skip every configuration whose query block is not
a multiple of their ``BLOCK_M`` (16 or more), and KV blocks must be multiples of 16 tokens:
a query block of 1 left no valid choice on CUDA. The query block here is ``Q_BLOCK`` = 128
(a decode's single row sits in one padded query block). The masks' index tensors are
``[batch, 1, q_blocks, width]`` with ``width`` = the blocks one sequence can hold
(``max_blocks_per_seq``), fixed for the run, not the whole cache; blocks wholly visible to a
query block are listed as full (FlexAttention skips ``mask_mod`` there: a decode's every
block but its last), the rest as partial; no q-block indices are
built (``compute_q_blocks=False``: they serve only the backward pass). ``FlexMasks`` builds
them once per micro-batch, on its ``AttentionMetadata``, for every layer of the stage.

Note [flex compile buckets]: compiled (``torch.compile``, inductor; ``dynamic=False``: with
dynamic shapes inductor's CPU code fails to compile), every distinct shape compiles once.
The decode batch is padded to ``DECODE_BUCKETS`` and a chunk's rows to powers of two from
``Q_BLOCK``, and the mask width is fixed, so a run compiles at most
``len(DECODE_BUCKETS) + len(prefill buckets)`` times; the recompile limit is raised to that
(past it, dynamo would quietly run the call eagerly). Eager (CPU by default) FlexAttention is
a reference that materialises scores over every slot: exact, not fast.

Note [flex paged mask]: ``mask_mod`` must be exact over every slot (the eager reference
applies it everywhere, not only in the listed blocks). A physical block holds the same
logical block index in every sequence that holds it (a prefix-cached or forked block sits
at the same positions in each), so one 1-D map ``phys_logical[num_blocks]`` (int32, the
only tensor sized by the cache) gives a slot's logical position, and ``table[b, lb] ==
block`` says whether sequence b holds it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch

Q_BLOCK = 128  # query rows per sparse block: a multiple of every template's BLOCK_M
DECODE_BUCKETS = (8, 16, 32, 64, 128, 256, 512)  # decode batch sizes compiled; above: x512
MAX_PREFILL_BUCKET = 8192  # chunks above it pad to a multiple of it


def flex_available() -> bool:
    """FlexAttention with the ``BlockMask.from_kv_blocks`` this module builds masks with
    (``compute_q_blocks``, ``seq_lengths``)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:
        return False
    params = inspect.signature(BlockMask.from_kv_blocks).parameters
    return "compute_q_blocks" in params and "seq_lengths" in params


def flex_block_size_ok(block_size: int) -> bool:
    """Block sizes FlexAttention's Triton kernels take as KV sparse blocks."""
    return block_size >= 16 and block_size % 16 == 0


def decode_bucket(n: int) -> int:
    """The padded decode batch for ``n`` decodes."""
    for b in DECODE_BUCKETS:
        if n <= b:
            return b
    top = DECODE_BUCKETS[-1]
    return -(-n // top) * top


def prefill_bucket(n: int) -> int:
    """The padded rows of a prefill chunk of ``n`` tokens: a power of two >= ``Q_BLOCK``."""
    b = Q_BLOCK
    while b < n and b < MAX_PREFILL_BUCKET:
        b *= 2
    return b if n <= b else -(-n // MAX_PREFILL_BUCKET) * MAX_PREFILL_BUCKET


@cache
def _flex(compiled: bool) -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    import torch._dynamo.config as dynamo_config

    # Note [flex compile buckets]: every bucket may compile once (prefill buckets: 7)
    bound = len(DECODE_BUCKETS) + 8
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, bound)
    return torch.compile(flex_attention, dynamic=False)


@dataclass
class FlexMasks:
    """One micro-batch's block masks (Note [flex block shapes]): built by the first layer
    that runs it, reused by the rest of the stage's layers."""

    decode: Any = None  # BlockMask for the padded decode batch, or None
    num_decodes: int = 0
    prefill: list[Any] = field(default_factory=list)  # one BlockMask per prefill chunk


def block_logical_map(tables: list[torch.Tensor], num_blocks: int, device) -> torch.Tensor:
    """``[num_blocks]`` int32: each block's logical index in the sequences that hold it
    (``tables``: each a 1-D block table, or ``[n, blocks]`` with -1 padding), else -1."""
    # one spare entry past the cache takes the -1 padding's writes: a scatter without the
    # boolean mask, which would wait for the device (nonzero)
    m = torch.full((num_blocks + 1,), -1, dtype=torch.int32, device=device)
    for t in tables:
        t = t.reshape(-1, t.shape[-1])
        logical = torch.arange(t.shape[-1], dtype=torch.int32, device=device).expand_as(t)
        target = torch.where(t >= 0, t, num_blocks).to(torch.long)
        m.index_put_((target.flatten(),), logical.flatten())
    return m[:num_blocks]


def _padded_table(table: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``table`` [n, blocks] in a ``[rows, width]`` int32 tensor padded with -1."""
    n, blocks = table.shape
    if blocks > width:
        raise ValueError(f"a block table of {blocks} blocks is wider than the mask's {width}")
    out = torch.full((rows, width), -1, dtype=torch.int32, device=table.device)
    out[:n, :blocks] = table
    return out


def decode_block_mask(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks], padded past each sequence's end
    context_lens: torch.Tensor,  # [num_seqs]: keys each decode attends to (pos + 1)
    block_size: int,
    num_slots: int,
    width: int,
    phys_logical: torch.Tensor,  # block_logical_map
) -> Any:
    """A BlockMask for decode queries ``[decode_bucket(num_seqs), heads, 1, d]`` over the
    physical cache ``[1, kv_heads, num_slots, d]``: sequence b sees its slots before its
    length; padded entries see nothing."""
    from torch.nn.attention.flex_attention import BlockMask

    device = block_tables.device
    num_seqs = block_tables.shape[0]
    rows = decode_bucket(num_seqs)
    used = -(-context_lens // block_size)  # [num_seqs] blocks each sequence owns
    logical = torch.arange(block_tables.shape[1], device=device)
    table = _padded_table(torch.where(logical < used[:, None], block_tables, -1), rows, width)
    lens = torch.zeros(rows, dtype=torch.int64, device=device)
    lens[:num_seqs] = context_lens

    def mask_mod(b, h, q_idx, kv_idx):
        blk = kv_idx // block_size
        lb = phys_logical[blk]
        held = table[b, lb.clamp(min=0)] == blk
        return (lb >= 0) & held & (lb * block_size + kv_idx % block_size < lens[b])

    # Every block but the last is full: the kernel skips mask_mod there; the last is partial.
    used_rows = torch.zeros(rows, dtype=torch.int64, device=device)
    used_rows[:num_seqs] = used
    full_num_blocks = (used_rows - 1).clamp(min=0).to(torch.int32).view(rows, 1, 1)
    kv_num_blocks = (used_rows > 0).to(torch.int32).view(rows, 1, 1)
    kv_indices = torch.zeros(rows, 1, 1, width, dtype=torch.int32, device=device)
    last = table.gather(1, (used_rows - 1).clamp(min=0)[:, None])
    kv_indices[:, 0, 0, 0] = last[:, 0].clamp(min=0)
    return BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        full_num_blocks,
        table.clamp(min=0).view(rows, 1, 1, width),
        BLOCK_SIZE=(Q_BLOCK, block_size),
        mask_mod=mask_mod,
        seq_lengths=(1, num_slots),
        compute_q_blocks=False,
    )


def prefill_block_mask(
    context_blocks: torch.Tensor,  # [ceil(end / block_size)] the blocks of positions 0..end-1
    start: int,  # position of the chunk's first token
    num_tokens: int,
    block_size: int,
    num_slots: int,
    width: int,
    phys_logical: torch.Tensor,
) -> Any:
    """A BlockMask for a chunk's queries ``[1, heads, prefill_bucket(num_tokens), d]``: row
    i (position ``start + i``) sees positions ``0 .. start + i`` of its sequence."""
    from torch.nn.attention.flex_attention import BlockMask

    device = context_blocks.device
    rows = prefill_bucket(num_tokens)
    num_q_blocks = rows // Q_BLOCK
    table = _padded_table(context_blocks.view(1, -1), 1, width)[0]
    # a tensor, not an int: a compiled call would specialise on (recompile for) each start
    # (torch.full: a fill on the device; torch.tensor(start, device=...) waits for it)
    first = torch.full((), start, dtype=torch.int64, device=device)
    # q block i's rows sit at positions start + i * Q_BLOCK .. start + min((i + 1) * Q_BLOCK,
    # n) - 1: the blocks wholly at or before its first row are full for all of them (the
    # kernel skips mask_mod there), the rest up to its last row's block partial.
    first_row = torch.arange(num_q_blocks, device=device) * Q_BLOCK
    real = first_row < num_tokens
    last_pos = start + (first_row + Q_BLOCK).clamp(max=num_tokens) - 1
    needed = torch.where(real, last_pos // block_size + 1, 0)
    full = torch.where(real, (start + first_row + 1) // block_size, 0)
    full_indices = table.clamp(min=0).expand(num_q_blocks, width)
    shifted = (full[:, None] + torch.arange(width, device=device)).clamp(max=width - 1)
    partial_indices = full_indices.gather(1, shifted)

    def mask_mod(b, h, q_idx, kv_idx):
        blk = kv_idx // block_size
        lb = phys_logical[blk]
        held = table[lb.clamp(min=0)] == blk
        return (lb >= 0) & held & (lb * block_size + kv_idx % block_size <= first + q_idx)

    return BlockMask.from_kv_blocks(
        (needed - full).to(torch.int32).view(1, 1, num_q_blocks),
        partial_indices.reshape(1, 1, num_q_blocks, width),
        full.to(torch.int32).view(1, 1, num_q_blocks),
        full_indices.reshape(1, 1, num_q_blocks, width),
        BLOCK_SIZE=(Q_BLOCK, block_size),
        mask_mod=mask_mod,
        seq_lengths=(rows, num_slots),
        compute_q_blocks=False,
    )


def _as_physical(cache: torch.Tensor) -> torch.Tensor:
    return cache.unsqueeze(0).transpose(1, 2)  # [1, kv_heads, num_slots, d], a view


def flex_paged_decode(
    q: torch.Tensor,  # [num_seqs, heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,
    mask: Any,  # decode_block_mask
    scale: float,
    compiled: bool,
) -> torch.Tensor:  # [num_seqs, heads, head_dim]
    num_seqs = q.shape[0]
    rows = decode_bucket(num_seqs)
    qp = q.new_zeros(rows, q.shape[1], 1, q.shape[2])
    qp[:num_seqs, :, 0] = q
    out = _flex(compiled)(
        qp, _as_physical(k_cache), _as_physical(v_cache), block_mask=mask, scale=scale,
        enable_gqa=True,
    )  # fmt: skip
    return out[:num_seqs, :, 0]


def flex_paged_prefill(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]: one chunk's rows
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    mask: Any,  # prefill_block_mask
    scale: float,
    compiled: bool,
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    n = q.shape[0]
    rows = prefill_bucket(n)
    qp = q.new_zeros(1, q.shape[1], rows, q.shape[2])
    qp[0, :, :n] = q.transpose(0, 1)
    out = _flex(compiled)(
        qp, _as_physical(k_cache), _as_physical(v_cache), block_mask=mask, scale=scale,
        enable_gqa=True,
    )  # fmt: skip
    return out[0, :, :n].transpose(0, 1)
