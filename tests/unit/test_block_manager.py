"""Paged KV block bookkeeping: grow as a sequence grows, free everything, reuse."""

from __future__ import annotations

import pytest

from sarathi_pp.sampling_params import SamplingParams
from sarathi_pp.scheduler.block_manager import BlockManager, blocks_for
from sarathi_pp.sequence import Sequence


def _seq(seq_id: int = 0, num_prompt: int = 5) -> Sequence:
    return Sequence(seq_id, str(seq_id), list(range(num_prompt)), SamplingParams(), 0.0)


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "expected"),
    [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (16, 16, 1), (17, 16, 2), (7, 1, 7)],
)
def test_blocks_for_is_ceil(num_tokens, block_size, expected):
    assert blocks_for(num_tokens, block_size) == expected


def test_grow_allocates_only_missing_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = _seq()
    assert bm.num_missing_blocks(seq, 5) == 2
    bm.grow(seq, 5)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    bm.grow(seq, 8)  # still inside the second block
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    assert bm.num_missing_blocks(seq, 3) == 0  # never negative
    bm.grow(seq, 9)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert len(set(seq.block_table)) == 3


def test_two_sequences_never_share_a_block():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = _seq(0), _seq(1)
    bm.grow(a, 5)
    bm.grow(b, 6)
    assert not set(a.block_table) & set(b.block_table)
    assert sorted(a.block_table + b.block_table) == list(range(6)) and bm.num_free_blocks == 0


def test_can_grow_and_out_of_blocks():
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = _seq()
    assert bm.can_grow(seq, 12) and not bm.can_grow(seq, 13)
    with pytest.raises(RuntimeError, match="need 4, 3 free"):
        bm.grow(seq, 13)
    assert seq.block_table == [] and bm.num_free_blocks == 3  # a failed grow takes nothing


def test_free_returns_every_block_and_they_are_reused_first():
    bm = BlockManager(num_blocks=5, block_size=4)
    a, b = _seq(0), _seq(1)
    bm.grow(a, 8)
    bm.grow(b, 4)
    freed = list(a.block_table)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 4
    c = _seq(2)
    bm.grow(c, 8)
    assert c.block_table == freed  # recently freed blocks come back first, in order
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 5
    d = _seq(3)
    bm.grow(d, 20)
    assert sorted(d.block_table) == list(range(5))


def test_free_of_empty_table_is_a_no_op():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = _seq()
    bm.free(seq)
    assert bm.num_free_blocks == 2
