"""A micro-batch as tensors: token ids, the attention metadata of its rows and the rows the
last stage samples.

Rows follow the micro-batch's chunks: prefill chunks first, then one row per decode. Each
half is built on its own (``_prefill_rows``, ``_decode_rows``) and the two are concatenated.
Every integer is computed on the host and reaches the device in one copy per micro-batch
(Note [one upload per micro-batch] in ``upload.py``): the tensors below are views of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from sarathi_pp.microbatch import MicroBatch, ScheduledChunk
from sarathi_pp.stages.model.attention import AttentionMetadata, PrefillSlice
from sarathi_pp.stages.worker.upload import PinnedUpload, Upload

HOST = torch.device("cpu")


class StageInputs(NamedTuple):
    """What a stage runs a micro-batch on, on its device."""

    token_ids: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampled] int64: the last row of every sampling chunk


@dataclass
class _Rows:
    """Token ids, positions and KV slots of one half of the rows (host tensors)."""

    tokens: list[int] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)


class _Pack:
    """Host int64 tensors laid end to end in one buffer, uploaded at once, handed back as
    views of the device copy in the order they were added."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []

    def add(self, t: torch.Tensor) -> int:
        self.parts.append(t)
        return len(self.parts) - 1

    def upload(self, upload: Upload, pin: bool) -> list[torch.Tensor]:
        if not getattr(upload, "packs", True):  # CPU: the host tensors themselves
            return list(self.parts)
        flat = [p.reshape(-1).to(torch.long) for p in self.parts]
        size = sum(p.numel() for p in flat)
        host = torch.empty(size, dtype=torch.long, pin_memory=pin)
        torch.cat(flat, out=host)
        buf = upload(host)
        views, offset = [], 0
        for p in self.parts:
            views.append(buf[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        return views


def _slots(block_table: torch.Tensor, block_size: int, num_tokens: int) -> torch.Tensor:
    """Slot ids of positions ``[0, num_tokens)`` of a sequence, from its block table."""
    offsets = torch.arange(block_size, device=block_table.device)
    return (block_table.unsqueeze(-1) * block_size + offsets).flatten(-2)[..., :num_tokens]


def _prefill_rows(
    chunks: list[ScheduledChunk], block_size: int
) -> tuple[_Rows, list[PrefillSlice]]:
    """Each prefill chunk's rows attend causally within the chunk and to its cached prefix."""
    rows, prefills, row = _Rows(), [], 0
    for c in chunks:
        num_ctx_blocks = -(-c.end // block_size)
        bt = torch.tensor(c.block_table[:num_ctx_blocks], dtype=torch.long)
        rows.tokens += c.token_ids
        rows.positions.append(torch.arange(c.start, c.end))
        rows.slots.append(_slots(bt, block_size, c.end)[c.start :])
        prefills.append(PrefillSlice(row, row + c.num_tokens, c.start, bt))
        row += c.num_tokens
    return rows, prefills


def _decode_rows(
    chunks: list[ScheduledChunk], block_size: int
) -> tuple[_Rows, torch.Tensor | None]:
    """One row per decode over its padded paged context: the rows (positions in
    ``rows.positions[0]``) and the block tables ``[num_decodes, max_blocks]``."""
    rows = _Rows()
    if not chunks:
        return rows, None
    rows.tokens = [c.token_ids[0] for c in chunks]
    pos = [c.start for c in chunks]
    pos_t = torch.tensor(pos)
    rows.positions.append(pos_t)
    max_blocks = max(-(-(p + 1) // block_size) for p in pos)
    tables = [c.block_table[:max_blocks] for c in chunks]
    padded = [list(t) + [0] * (max_blocks - len(t)) for t in tables]  # 0: masked out
    blocks = torch.tensor(padded, dtype=torch.long)  # [num_decodes, max_blocks]
    # slot of each decode token: its block's id * block_size + offset
    own_block = blocks.gather(1, (pos_t // block_size).unsqueeze(1)).squeeze(1)
    rows.slots.append(own_block * block_size + pos_t % block_size)
    return rows, blocks


def build_inputs(
    microbatch: MicroBatch,
    block_size: int,
    device: torch.device,
    backend: str = "torch",
    upload: Upload | None = None,
) -> StageInputs:
    """``microbatch``'s token ids, attention metadata (prefills first) and sampled rows, on
    ``device`` through one ``upload`` (default: ``PinnedUpload(device)``)."""
    upload = upload or PinnedUpload(device)
    chunks = list(microbatch.chunks)
    prefill, prefills = _prefill_rows([c for c in chunks if c.is_prefill], block_size)
    decode, decode_blocks = _decode_rows([c for c in chunks if not c.is_prefill], block_size)
    pack = _Pack()
    i_tokens = pack.add(torch.tensor(prefill.tokens + decode.tokens, dtype=torch.long))
    i_positions = pack.add(torch.cat(prefill.positions + decode.positions))
    i_slots = pack.add(torch.cat(prefill.slots + decode.slots))
    i_context = [pack.add(p.context_blocks) for p in prefills]
    i_blocks = pack.add(decode_blocks) if decode_blocks is not None else None
    i_sample = pack.add(torch.tensor(sample_rows(microbatch), dtype=torch.long))
    i_flash = _pack_flash(pack, chunks) if backend == "flash_attn" else None
    views = pack.upload(upload, getattr(upload, "pin", False))
    for p, i in zip(prefills, i_context):
        p.context_blocks = views[i]
    positions = views[i_positions]
    num_prefill = len(prefill.tokens)
    blocks = None if i_blocks is None else views[i_blocks]
    meta = AttentionMetadata(
        positions=positions,
        slot_mapping=views[i_slots],
        num_prefill_tokens=num_prefill,
        prefills=prefills,
        decode_blocks=blocks,
        decode_mask=None,
        block_size=block_size,
    )
    if blocks is not None:  # device ops on the copy: no host round trip
        decode_pos = positions[num_prefill:]
        meta.decode_lens = decode_pos + 1
        arange = torch.arange(blocks.shape[1] * block_size, device=positions.device)
        meta.decode_mask = (arange.unsqueeze(0) <= decode_pos.unsqueeze(1))[:, None, None, :]
    if i_flash is not None:
        _set_flash(meta, views, i_flash, chunks)
    return StageInputs(views[i_tokens], meta, views[i_sample])


def build_metadata(
    microbatch: MicroBatch, block_size: int, device: torch.device, backend: str = "torch"
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Token ids ``[num_tokens]`` and attention metadata for ``microbatch`` (prefills first)."""
    inputs = build_inputs(microbatch, block_size, device, backend)
    return inputs.token_ids, inputs.meta


def _pack_flash(pack: _Pack, chunks: list[ScheduledChunk]) -> tuple[int, int, int]:
    """flash-attn's block tables, context lengths and ``cu_seqlens_q`` (int32 on the
    device), in the pack."""
    max_blocks = max(len(c.block_table) for c in chunks)  # prefills first, then decodes
    tables = [list(c.block_table) + [0] * (max_blocks - len(c.block_table)) for c in chunks]
    cu = [0]
    for c in chunks:
        if c.is_prefill:
            cu.append(cu[-1] + c.num_tokens)
    return (
        pack.add(torch.tensor(tables, dtype=torch.long)),
        pack.add(torch.tensor([c.end for c in chunks], dtype=torch.long)),
        pack.add(torch.tensor(cu, dtype=torch.long)),
    )


def _set_flash(
    meta: AttentionMetadata,
    views: list[torch.Tensor],
    idx: tuple[int, int, int],
    chunks: list[ScheduledChunk],
) -> None:
    tables, lens, cu = (views[i].to(torch.int32) for i in idx)  # device casts
    meta.block_tables, meta.context_lens, meta.cu_seqlens_q = tables, lens, cu
    meta.max_query_len = max((c.num_tokens for c in chunks if c.is_prefill), default=0)
    meta.max_context_len = max(c.end for c in chunks)


def sample_rows(microbatch: MicroBatch) -> list[int]:
    """Row index of the last token of every chunk that samples."""
    rows, row = [], 0
    for c in microbatch.chunks:
        row += c.num_tokens
        if c.do_sample:
            rows.append(row - 1)
    return rows
