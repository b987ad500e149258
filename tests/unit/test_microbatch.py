"""MicroBatch / ScheduledChunk: small immutable values with a compact repr."""

from __future__ import annotations

import dataclasses

import pytest

from sarathi_pp.microbatch import MicroBatch, ScheduledChunk
from sarathi_pp.sampling_params import SamplingParams

P = SamplingParams(temperature=0.0)


def _chunk(seq_id, start, n, prefill, sample=False):
    return ScheduledChunk(
        seq_id=seq_id,
        start=start,
        token_ids=tuple(range(start, start + n)),
        is_prefill=prefill,
        block_table=(0, 1, 2),
        sampling_params=P if sample else None,
    )


def test_chunk_sizes_and_repr():
    c = _chunk(3, 8, 4, prefill=True)
    assert (c.num_tokens, c.end, c.do_sample) == (4, 12, False)
    assert repr(c) == "P3[8:12]"
    d = _chunk(5, 20, 1, prefill=False, sample=True)
    assert d.do_sample and repr(d) == "D5[20:21]*"


@pytest.mark.parametrize(
    ("chunks", "kind", "num_prefill", "num_decode"),
    [
        ((_chunk(0, 0, 7, True),), "prefill", 7, 0),
        ((_chunk(0, 9, 1, False, True), _chunk(1, 4, 1, False, True)), "decode", 0, 2),
        ((_chunk(0, 0, 5, True, True), _chunk(1, 4, 1, False, True)), "hybrid", 5, 1),
    ],
)
def test_microbatch_kind_and_counts(chunks, kind, num_prefill, num_decode):
    microbatch = MicroBatch(4, chunks)
    assert microbatch.kind == kind
    assert (
        microbatch.num_prefill_tokens == num_prefill and microbatch.num_decode_tokens == num_decode
    )
    assert microbatch.num_tokens == num_prefill + num_decode


def test_microbatch_repr_and_sampled_ids():
    microbatch = MicroBatch(
        7, (_chunk(2, 0, 6, True), _chunk(3, 6, 2, True, True), _chunk(1, 9, 1, False, True))
    )
    assert repr(microbatch) == "MB7<hybrid P=8 D=1: P2[0:6] P3[6:8]* D1[9:10]*>"
    assert microbatch.sampled_seq_ids == [3, 1]


def test_microbatch_rejects_prefill_after_decode():
    with pytest.raises(AssertionError, match="prefill chunk after a decode"):
        MicroBatch(0, (_chunk(1, 9, 1, False, True), _chunk(0, 0, 5, True)))


def test_microbatch_and_chunk_are_frozen():
    c = _chunk(0, 0, 1, True)
    microbatch = MicroBatch(0, (c,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        microbatch.microbatch_id = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.start = 3  # type: ignore[misc]
    assert hash(microbatch) == hash(MicroBatch(0, (_chunk(0, 0, 1, True),)))
