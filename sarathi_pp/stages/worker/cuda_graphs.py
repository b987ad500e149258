"""CUDA graphs for decode-only micro-batches (``model.enforce_eager: false``).

Note [decode graphs]: a decode step launches a few dozen kernels per layer, each tiny at
small batches, so on CUDA the host's launches, not the GPU, bound it. A graph captured
once per batch-size bucket (``graph_buckets``) replays a whole stage's layers in one
launch. A decode-only micro-batch of ``n`` sequences runs the graph of the smallest bucket
``>= n``: its inputs are copied into the graph's static buffers (device to device, no host
wait), the rows past ``n`` padded with a harmless decode (position 0, its K/V written to a
scratch block the block manager never hands out, the cache's last), and the first ``n``
output rows taken. Prefill and hybrid micro-batches run eagerly (not a fallback); a
decode micro-batch with no graph (more sequences than the largest bucket, or a bucket
whose capture failed) runs eagerly, logged once per reason and recorded in the run dir
(the stage's attention record, ``summary.json``'s ``attention``).

The graph covers the layers (``StageModel.forward``); sampling stays eager. The layers'
attention is a fresh instance of the stage's backend for the capture, so the buffers it
gathers into live in the graph's memory pool and an eager micro-batch never frees them.
``DecodeGraphs`` decides (bucket, fallback) and owns the static buffers; ``capture`` turns
a function into its replay (``cuda_capture`` on CUDA; a test passes the function itself,
so the padding and static buffers run on CPU). Unchecked on a GPU: off by default.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from sarathi_pp.microbatch import MicroBatch
from sarathi_pp.stages.model.attention import AttentionMetadata
from sarathi_pp.stages.model.kv_cache import KVCache

logger = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4)  # then multiples of 8, as vLLM's capture sizes
BUCKET_STEP = 8


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes a stage captures: 1, 2, 4, then every multiple of 8 up to
    ``max_batch`` rounded up to one."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    top = -(-max_batch // BUCKET_STEP) * BUCKET_STEP
    small = tuple(b for b in SMALL_BUCKETS if b < top)
    return small + tuple(range(BUCKET_STEP, top + 1, BUCKET_STEP))


class Forward(Protocol):
    """A stage's layers: ``StageModel.forward``."""

    def __call__(
        self, inputs: torch.Tensor, meta: AttentionMetadata, kv: KVCache
    ) -> torch.Tensor: ...


def cuda_capture(fn: Callable[[], torch.Tensor], pool: Any) -> Callable[[], torch.Tensor]:
    """``fn``'s kernels as a CUDA graph (after one warm-up call on a side stream, as torch
    asks); returns its replay, which gives the graph's static output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    replay.graph = graph  # type: ignore[attr-defined]  # kept alive with its replay
    return replay


class _StaticDecode:
    """One bucket's static inputs (``rows`` decodes, block tables ``width`` blocks wide)
    and the replay of the layers over them."""

    def __init__(
        self, rows: int, width: int, block_size: int, scratch_block: int, hidden: int | None,
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        long = torch.long
        self.rows, self.width, self.scratch_block = rows, width, scratch_block
        # stage 0 reads token ids, the others hidden states [rows, hidden]
        self.inputs = (
            torch.zeros(rows, dtype=long, device=device) if hidden is None
            else torch.zeros(rows, hidden, dtype=dtype, device=device)
        )  # fmt: skip
        self.positions = torch.zeros(rows, dtype=long, device=device)
        self.slots = torch.full((rows,), scratch_block * block_size, dtype=long, device=device)
        self.blocks = torch.full((rows, width), scratch_block, dtype=long, device=device)
        self.lens = torch.ones(rows, dtype=long, device=device)
        self.arange = torch.arange(width * block_size, device=device)
        self.mask = torch.zeros(rows, 1, 1, width * block_size, dtype=torch.bool, device=device)
        self.mask[:, 0, 0, 0] = True
        self.meta = AttentionMetadata(
            positions=self.positions, slot_mapping=self.slots, num_prefill_tokens=0,
            prefills=[], decode_blocks=self.blocks, decode_mask=self.mask,
            decode_lens=self.lens, block_size=block_size,
            block_tables=torch.full((rows, width), scratch_block, dtype=torch.int32,
                                    device=device),
            context_lens=torch.ones(rows, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=device),
            max_context_len=width * block_size,
        )  # fmt: skip
        self.replay: Callable[[], torch.Tensor] | None = None

    def fill(self, inputs: torch.Tensor, meta: AttentionMetadata) -> None:
        """Copy a decode micro-batch's ``inputs`` and metadata into the first rows (device
        copies); the rest keep their padding, written at construction."""
        assert meta.decode_blocks is not None and meta.decode_lens is not None
        n, used = meta.decode_blocks.shape
        self.inputs[:n].copy_(inputs)
        self.positions[:n].copy_(meta.positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.blocks[:n, :used].copy_(meta.decode_blocks)
        self.blocks[:n, used:] = self.scratch_block  # masked out
        self.lens[:n].copy_(meta.decode_lens)
        torch.le(self.arange[None, :], self.positions[:n, None], out=self.mask[:n, 0, 0])
        self.meta.block_tables[:n].copy_(self.blocks[:n])  # type: ignore[index]
        self.meta.context_lens[:n].copy_(self.lens[:n])  # type: ignore[index]

    def reset_rows(self, n: int) -> None:
        """Rows ``[n, rows)`` back to the padding decode (an earlier, larger batch used them)."""
        if n >= self.rows:
            return
        self.positions[n:] = 0
        self.slots[n:] = self.scratch_block * self.meta.block_size
        self.blocks[n:] = self.scratch_block
        self.lens[n:] = 1
        self.mask[n:] = False
        self.mask[n:, 0, 0, 0] = True
        self.meta.block_tables[n:] = self.scratch_block  # type: ignore[index]
        self.meta.context_lens[n:] = 1  # type: ignore[index]


def _layers_over(forward: Forward, st: _StaticDecode, kv: KVCache) -> Callable[[], torch.Tensor]:
    """The function a bucket's graph captures: the layers over its static buffers, the
    FlexAttention block masks rebuilt inside (captured too, so a replay rebuilds them from
    the buffers; masks kept from the warm-up call would be the padding's)."""

    def layers() -> torch.Tensor:
        st.meta.flex_masks = None
        return forward(st.inputs, st.meta, kv)

    return layers


class DecodeGraphs:
    """Which decode micro-batches replay a graph, the graphs and their static buffers
    (Note [decode graphs]). ``record``: where a fallback's reason goes (logged once and kept
    for the run dir by the stage's record)."""

    def __init__(
        self, stage_idx: int, buckets: tuple[int, ...], record: Callable[[str], None]
    ) -> None:
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be increasing sizes >= 1, got {buckets}")
        self.stage_idx = stage_idx
        self.buckets = buckets
        self.record = record
        self.static: dict[int, _StaticDecode] = {}
        self.failed: dict[int, str] = {}  # bucket -> why its capture failed
        self.replays = 0
        self.eager_decodes = 0  # decode micro-batches that found no graph
        # the attention the graphs were captured with: its buffers, which the graphs read
        # and write, live as long as the graphs
        self.attention: object | None = None

    def bucket_for(self, num_decodes: int) -> int | None:
        """The smallest bucket that holds ``num_decodes`` rows; ``None`` above the largest."""
        for b in self.buckets:
            if b >= num_decodes:
                return b
        return None

    def plan(self, microbatch: MicroBatch) -> int | None:
        """The bucket whose graph runs ``microbatch``, or ``None``: eager (a prefill or
        hybrid micro-batch; a decode one with no graph, recorded)."""
        if microbatch.num_prefill_tokens or not microbatch.num_decode_tokens:
            return None
        b = self.bucket_for(microbatch.num_decode_tokens)
        if b is None:
            why = f"decode micro-batches above {self.buckets[-1]} sequences run eagerly"
        elif b in self.failed:
            why = f"decode micro-batches of bucket {b} run eagerly: {self.failed[b]}"
        elif b not in self.static:
            why = f"decode micro-batches of bucket {b} run eagerly: no graph captured"
        else:
            return b
        self.eager_decodes += 1
        self.record(f"CUDA graphs: {why}")
        return None

    def capture(
        self,
        forward: Forward,
        layers: list[Any],
        attention: object,
        kv: KVCache,
        width: int,
        hidden: int | None,
        dtype: torch.dtype,
        capture: Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]],
    ) -> None:
        """Capture every bucket, largest first (smaller ones reuse its memory), over
        ``kv`` whose last block is the scratch block, with ``layers`` running ``attention``
        meanwhile (a fresh instance, kept with the graphs: they use its buffers); a bucket
        that fails is recorded."""
        eager = [layer.attention for layer in layers]
        self.attention = attention
        for layer in layers:
            layer.attention = attention
        try:
            for b in reversed(self.buckets):
                self._capture_one(b, forward, kv, width, hidden, dtype, capture)
        finally:
            for layer, a in zip(layers, eager):
                layer.attention = a
        logger.info(
            "stage %d: CUDA graphs captured for decode batches %s%s", self.stage_idx,
            sorted(self.static), f" (failed: {sorted(self.failed)})" if self.failed else "",
        )  # fmt: skip

    def _capture_one(self, bucket, forward, kv, width, hidden, dtype, capture) -> None:
        device = kv.k[0].device if kv.k else torch.device("cpu")
        scratch = kv.num_blocks - 1  # the scratch block
        st = _StaticDecode(bucket, width, kv.block_size, scratch, hidden, dtype, device)
        try:
            st.replay = capture(_layers_over(forward, st, kv))
        except Exception as e:  # noqa: BLE001 - a failed capture must not fail the stage
            self.failed[bucket] = f"its capture failed: {type(e).__name__}: {str(e)[:200]}"
            logger.warning("stage %d: CUDA graph of bucket %d: %s", self.stage_idx, bucket,
                           self.failed[bucket])  # fmt: skip
            return
        self.static[bucket] = st

    def replay(self, bucket: int, inputs: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The layers over a decode micro-batch through ``bucket``'s graph: its output rows
        ``[num_decodes, hidden]``."""
        st = self.static[bucket]
        assert st.replay is not None
        n = inputs.shape[0]
        st.reset_rows(n)
        st.fill(inputs, meta)
        self.replays += 1
        # a copy: the next replay rewrites the static output while this one is sent on
        return st.replay()[:n].clone()
