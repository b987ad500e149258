"""Decode attention on CUDA without flash-attn: FlexAttention over the paged cache in place.

The cache of a layer, ``[num_slots, kv_heads, head_dim]``, is viewed (no copy) as one
"physical" sequence ``[1, kv_heads, num_slots, head_dim]``; every decode row is a batch
entry that attends to it through a block mask whose KV blocks are the sequence's KV-cache
blocks, straight from its block table (``BlockMask.from_kv_blocks`` with KV block size =
``block_size``). A ``mask_mod`` maps each physical slot back to its position in the
sequence (``phys_to_logical``) to cut the partial last block. FlexAttention's kernel visits
only the listed blocks, so each decode reads its own K/V once, where it lies.

On CUDA the call is compiled (``torch.compile``, Triton, dynamic shapes: one compile for
all batch sizes); elsewhere it runs eagerly, a reference that materialises scores over
every slot (what the CPU tests use to check the masks). FlexAttention's Triton kernels
need KV blocks of at least 16 tokens in multiples of 16: ``select_backend`` picks this
backend on CUDA for such block sizes when flash-attn is missing. Prefill chunks keep
gather + SDPA (compute-bound: the copy of their context is small beside the attention).
"""

from __future__ import annotations

from functools import cache

import torch


def flex_block_size_ok(block_size: int) -> bool:
    """Block sizes FlexAttention's Triton kernels take as KV sparse blocks."""
    return block_size >= 16 and block_size % 16 == 0


@cache
def _flex(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if compiled else flex_attention


def paged_block_mask(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64, padded past each sequence's end
    context_lens: torch.Tensor,  # [num_seqs] int64: keys each query attends to (pos + 1)
    block_size: int,
    num_slots: int,
):
    """A BlockMask for queries ``[num_seqs, heads, 1, d]`` over the physical cache
    ``[1, kv_heads, num_slots, d]``: sequence b sees its blocks' slots up to its length."""
    from torch.nn.attention.flex_attention import BlockMask

    device = block_tables.device
    num_seqs, max_blocks = block_tables.shape
    num_blocks = num_slots // block_size
    used = -(-context_lens // block_size)  # [num_seqs] blocks each sequence owns
    logical = torch.arange(max_blocks, device=device).expand(num_seqs, -1)
    is_used = logical < used[:, None]
    # physical block -> its logical index in the sequence, -1 elsewhere; the extra column
    # takes the padding entries (which may name a block another entry owns)
    phys_to_logical = torch.full((num_seqs, num_blocks + 1), -1, dtype=torch.long, device=device)
    target = torch.where(is_used, block_tables, num_blocks)
    phys_to_logical.scatter_(1, target, torch.where(is_used, logical, -1))

    def mask_mod(b, h, q_idx, kv_idx):
        lb = phys_to_logical[b, kv_idx // block_size]
        return (lb >= 0) & (lb * block_size + kv_idx % block_size < context_lens[b])

    kv_num_blocks = used.to(torch.int32).view(num_seqs, 1, 1)
    # FlexAttention's index tensors span every KV block; the first kv_num_blocks count
    kv_indices = torch.zeros(num_seqs, 1, 1, num_blocks, dtype=torch.int32, device=device)
    kv_indices[..., :max_blocks] = block_tables.view(num_seqs, 1, 1, max_blocks)
    return BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        BLOCK_SIZE=(1, block_size),
        mask_mod=mask_mod,
        seq_lengths=(1, num_slots),
    )


def flex_paged_decode(
    q: torch.Tensor,  # [num_seqs, heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:  # [num_seqs, heads, head_dim]
    num_slots = k_cache.shape[0]
    mask = paged_block_mask(block_tables, context_lens, block_size, num_slots)
    kc = k_cache.unsqueeze(0).transpose(1, 2)  # [1, kv_heads, num_slots, d], a view
    vc = v_cache.unsqueeze(0).transpose(1, 2)
    flex = _flex(q.device.type == "cuda")
    out = flex(q.unsqueeze(2), kc, vc, block_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)
