"""A micro-batch as tensors: token ids and the attention metadata of its rows.

Rows follow the micro-batch's chunks: prefill chunks first, then one row per decode. Each
half is built on its own (``_prefill_rows``, ``_decode_rows``) and the two are concatenated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sarathi_pp.microbatch import MicroBatch, ScheduledChunk
from sarathi_pp.stages.model.attention import AttentionMetadata, PrefillSlice


@dataclass
class _Rows:
    """Token ids, positions and KV slots of one half of the rows."""

    tokens: list[int] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)


def _slots(block_table: torch.Tensor, block_size: int, num_tokens: int) -> torch.Tensor:
    """Slot ids of positions ``[0, num_tokens)`` of a sequence, from its block table."""
    offsets = torch.arange(block_size, device=block_table.device)
    return (block_table.unsqueeze(-1) * block_size + offsets).flatten(-2)[..., :num_tokens]


def _prefill_rows(
    chunks: list[ScheduledChunk], block_size: int, device: torch.device
) -> tuple[_Rows, list[PrefillSlice]]:
    """Each prefill chunk's rows attend causally within the chunk and to its cached prefix."""
    rows, prefills, row = _Rows(), [], 0
    for c in chunks:
        num_ctx_blocks = -(-c.end // block_size)
        bt = torch.tensor(c.block_table[:num_ctx_blocks], dtype=torch.long, device=device)
        rows.tokens += c.token_ids
        rows.positions.append(torch.arange(c.start, c.end, device=device))
        rows.slots.append(_slots(bt, block_size, c.end)[c.start :])
        prefills.append(PrefillSlice(row, row + c.num_tokens, c.start, bt))
        row += c.num_tokens
    return rows, prefills


def _decode_rows(
    chunks: list[ScheduledChunk], block_size: int, device: torch.device
) -> tuple[_Rows, torch.Tensor | None, torch.Tensor | None]:
    """One row per decode over its padded paged context: the rows (positions in
    ``rows.positions[0]``), the block tables ``[num_decodes, max_blocks]`` and the mask
    ``[num_decodes, 1, 1, max_blocks * block_size]``."""
    rows = _Rows()
    if not chunks:
        return rows, None, None
    rows.tokens = [c.token_ids[0] for c in chunks]
    pos = [c.start for c in chunks]
    pos_t = torch.tensor(pos, device=device)
    rows.positions.append(pos_t)
    max_blocks = max(-(-(p + 1) // block_size) for p in pos)
    tables = [c.block_table[:max_blocks] for c in chunks]
    padded = [list(t) + [0] * (max_blocks - len(t)) for t in tables]  # 0: masked out
    blocks = torch.tensor(padded, dtype=torch.long, device=device)  # [num_decodes, max_blocks]
    # slot of each decode token: its block's id * block_size + offset
    own_block = blocks.gather(1, (pos_t // block_size).unsqueeze(1)).squeeze(1)
    rows.slots.append(own_block * block_size + pos_t % block_size)
    arange = torch.arange(max_blocks * block_size, device=device)
    mask = (arange.unsqueeze(0) <= pos_t.unsqueeze(1))[:, None, None, :]
    return rows, blocks, mask


def build_metadata(
    microbatch: MicroBatch, block_size: int, device: torch.device, backend: str = "torch"
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Token ids ``[num_tokens]`` and attention metadata for ``microbatch`` (prefills first)."""
    chunks = list(microbatch.chunks)
    prefill, prefills = _prefill_rows([c for c in chunks if c.is_prefill], block_size, device)
    decode, decode_blocks, decode_mask = _decode_rows(
        [c for c in chunks if not c.is_prefill], block_size, device
    )
    meta = AttentionMetadata(
        positions=torch.cat(prefill.positions + decode.positions),
        slot_mapping=torch.cat(prefill.slots + decode.slots),
        num_prefill_tokens=len(prefill.tokens),
        prefills=prefills,
        decode_blocks=decode_blocks,
        decode_mask=decode_mask,
        decode_lens=decode.positions[0] + 1 if decode.positions else None,
        block_size=block_size,
    )
    if backend == "flash_attn":
        _add_flash_metadata(meta, microbatch, device)
    tokens = torch.tensor(prefill.tokens + decode.tokens, dtype=torch.long, device=device)
    return tokens, meta


def _add_flash_metadata(
    meta: AttentionMetadata, microbatch: MicroBatch, device: torch.device
) -> None:
    chunks = list(microbatch.chunks)  # prefills first, then decodes: the same order as the rows
    max_blocks = max(len(c.block_table) for c in chunks)
    tables = [list(c.block_table) + [0] * (max_blocks - len(c.block_table)) for c in chunks]
    meta.block_tables = torch.tensor(tables, dtype=torch.int32, device=device)
    meta.context_lens = torch.tensor([c.end for c in chunks], dtype=torch.int32, device=device)
    q_lens = [c.num_tokens for c in chunks if c.is_prefill]
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    meta.cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=device)
    meta.max_query_len = max(q_lens, default=0)
    meta.max_context_len = max(c.end for c in chunks)


def sample_rows(microbatch: MicroBatch) -> list[int]:
    """Row index of the last token of every chunk that samples."""
    rows, row = [], 0
    for c in microbatch.chunks:
        row += c.num_tokens
        if c.do_sample:
            rows.append(row - 1)
    return rows
