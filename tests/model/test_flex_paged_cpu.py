"""``flex_paged``: FlexAttention over the paged cache in place, for decode rows and prefill
chunks, equals gather + SDPA (the ``torch`` backend) eagerly and compiled by inductor at
the bucket shapes (a second micro-batch in the same buckets compiles nothing), in float32
and bfloat16, with no fallback (the record is strict: a fallback would raise). Its masks: a query block the Triton templates take, index tensors as
wide as one sequence's blocks (not the cache), no q-block indices, built once per
micro-batch. A FlexAttention failure is a recorded fallback (strict: an error).

Compiles are few and small (2 cores in CI): one micro-batch shape, tiny heads."""

from __future__ import annotations

import pytest
import torch
from helpers import paged_microbatch
from torch._dynamo.utils import counters

from sarathi_pp.microbatch import MicroBatch
from sarathi_pp.stages.model import attention
from sarathi_pp.stages.model.attention import FlexPagedAttention, TorchAttention
from sarathi_pp.stages.model.backend_choice import AttentionFallbackError, AttentionRecord
from sarathi_pp.stages.model.flex_paged import (
    DECODE_BUCKETS,
    Q_BLOCK,
    decode_bucket,
    prefill_bucket,
)
from sarathi_pp.stages.worker.metadata import build_metadata

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def hybrid(block_size: int) -> tuple[MicroBatch, int]:
    """A first chunk, a later chunk over its cached prefix, and decodes of mixed lengths
    (one on a block boundary), their blocks handed out in shuffled order."""
    spans = [(0, 9, True), (20, 12, True), (0, 1, False), (33, 1, False), (47, 1, False)]
    spans.append((2 * block_size - 1, 1, False))
    return paged_microbatch(spans, block_size, spare_blocks=3, seed=7)


def tensors(microbatch: MicroBatch, num_blocks: int, block_size: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(3)
    n = microbatch.num_tokens
    q, k, v = (torch.randn(n, h, HEAD_DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    caches = torch.randn(2, num_blocks * block_size, KV_HEADS, HEAD_DIM, generator=g)
    return [t.to(dtype) for t in (q, k, v, *caches.unbind(0))]


def gather_sdpa(microbatch, num_blocks, block_size, dtype) -> torch.Tensor:
    """The ``torch`` backend in float32 on the same (rounded) values."""
    q, k, v, kc, vc = (t.float() for t in tensors(microbatch, num_blocks, block_size, dtype))
    _, meta = build_metadata(microbatch, block_size, torch.device("cpu"), "torch")
    return TorchAttention(HEADS, KV_HEADS, HEAD_DIM).forward(q, k, v, kc, vc, meta)


@pytest.mark.parametrize(
    "compiled, dtype",
    [
        (False, torch.float32),
        (False, torch.bfloat16),
        (True, torch.float32),
        (True, torch.bfloat16),
    ],
)
def test_flex_paged_equals_gather_sdpa(compiled, dtype):
    block_size = 16
    microbatch, num_blocks = hybrid(block_size)
    q, k, v, kc, vc = tensors(microbatch, num_blocks, block_size, dtype)
    _, meta = build_metadata(microbatch, block_size, torch.device("cpu"), "flex_paged")
    record = AttentionRecord(0, "flex_paged", strict=True)  # any fallback raises
    flex = FlexPagedAttention(HEADS, KV_HEADS, HEAD_DIM, record, compiled=compiled)
    out = flex.forward(q, k, v, kc, vc, meta)
    assert record.fallbacks == [] and flex.failed == {}
    ref = gather_sdpa(microbatch, num_blocks, block_size, dtype)
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    if compiled:  # another micro-batch in the same buckets (other starts, fewer decodes)
        graphs = counters["stats"]["unique_graphs"]
        other = MicroBatch(2, microbatch.chunks[1:2] + microbatch.chunks[3:5])
        _, meta = build_metadata(other, block_size, torch.device("cpu"), "flex_paged")
        rows = other.num_tokens
        flex.forward(q[:rows], k[:rows], v[:rows], kc, vc, meta)
        assert counters["stats"]["unique_graphs"] == graphs  # no recompile


@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_flex_paged_eager_takes_any_block_size(block_size):
    """Eagerly (CPU) any block size works; CUDA's kernels need multiples of 16, which the
    backend choice checks (``test_backend_choice.py``)."""
    microbatch, num_blocks = hybrid(block_size)
    q, k, v, kc, vc = tensors(microbatch, num_blocks, block_size, torch.float32)
    _, meta = build_metadata(microbatch, block_size, torch.device("cpu"), "flex_paged")
    flex = FlexPagedAttention(HEADS, KV_HEADS, HEAD_DIM, AttentionRecord(0, "flex_paged", True))
    out = flex.forward(q, k, v, kc, vc, meta)
    ref = gather_sdpa(microbatch, num_blocks, block_size, torch.float32)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_masks_are_built_once_per_microbatch_and_sized_to_a_sequence():
    block_size = 16
    microbatch, num_blocks = hybrid(block_size)
    q, k, v, kc, vc = tensors(microbatch, num_blocks, block_size, torch.float32)
    _, meta = build_metadata(microbatch, block_size, torch.device("cpu"), "flex_paged")
    flex = FlexPagedAttention(HEADS, KV_HEADS, HEAD_DIM, max_blocks_per_seq=8)
    flex.forward(q, k, v, kc, vc, meta)
    masks = meta.flex_masks
    assert masks is not None and len(masks.prefill) == 2 and masks.num_decodes == 4
    flex.forward(q, k, v, kc, vc, meta)  # the next layer: the same masks
    assert meta.flex_masks is masks
    d = masks.decode
    assert (Q_BLOCK, block_size) == d.BLOCK_SIZE  # a query block the Triton templates take
    assert d.kv_indices.shape == (decode_bucket(4), 1, 1, 8)  # one sequence's, not the cache's
    assert num_blocks > 8
    assert d.q_indices is None and d.q_num_blocks is None  # inference needs no q blocks
    # the decodes' blocks but the last are full (no mask_mod there); contexts 1, 34, 48, 32
    assert d.full_kv_num_blocks.flatten().tolist()[:4] == [0, 2, 2, 1]
    assert d.kv_num_blocks.flatten().tolist() == [1, 1, 1, 1] + [0] * (decode_bucket(4) - 4)
    p = masks.prefill[1]  # 12 rows at positions 20..31: block 0 full, block 1 partial
    assert p.kv_indices.shape == (1, 1, 1, 8)
    assert p.full_kv_num_blocks.flatten().tolist() == [
        1
    ] and p.kv_num_blocks.flatten().tolist() == [1]
    table = microbatch.chunks[1].block_table
    assert p.full_kv_indices[0, 0, 0, 0] == table[0] and p.kv_indices[0, 0, 0, 0] == table[1]


def test_buckets_bound_the_shapes():
    assert [decode_bucket(n) for n in (1, 8, 9, 100, 512, 513)] == [8, 8, 16, 128, 512, 1024]
    assert tuple(sorted(DECODE_BUCKETS)) == DECODE_BUCKETS
    assert [prefill_bucket(n) for n in (1, 128, 129, 256, 2000)] == [128, 128, 256, 256, 2048]
    assert all(prefill_bucket(n) % Q_BLOCK == 0 for n in range(1, 3000, 37))


def test_a_flex_failure_is_a_recorded_fallback(monkeypatch, caplog):
    """FlexAttention failing (a compiler error on some GPU) falls back to gather + SDPA with
    the same values, logs a WARNING once, and the record says why; strict, it raises."""

    def broken(*args, **kwargs):
        raise RuntimeError("no Triton here")

    monkeypatch.setattr(attention, "flex_paged_decode", broken)
    microbatch, num_blocks = hybrid(16)
    q, k, v, kc, vc = tensors(microbatch, num_blocks, 16, torch.float32)
    _, meta = build_metadata(microbatch, 16, torch.device("cpu"), "flex_paged")
    record = AttentionRecord(0, "flex_paged")
    flex = FlexPagedAttention(HEADS, KV_HEADS, HEAD_DIM, record)
    out = flex.forward(q, k, v, kc, vc, meta)
    flex.forward(q, k, v, kc, vc, meta)
    assert record.fallbacks == [
        "decode rows run gather + SDPA: FlexAttention failed: RuntimeError: no Triton here"
    ]
    assert caplog.text.count("fell back") == 1
    report = record.take_report()
    assert report is not None and report.fallbacks == tuple(record.fallbacks)
    assert record.take_report() is None  # nothing new since
    torch.testing.assert_close(out, gather_sdpa(microbatch, num_blocks, 16, torch.float32))
    strict = FlexPagedAttention(HEADS, KV_HEADS, HEAD_DIM, AttentionRecord(0, "flex_paged", True))
    with pytest.raises(AttentionFallbackError, match="no Triton here"):
        strict.forward(q, k, v, kc, vc, meta)
