"""The prefix cache of the block manager (``scheduler/block_manager.py``) and how the
scheduler uses it: hashes chained over the prefix, reference counts, least-recently-used
eviction, blocks hittable only once published, a lookup when a prefill starts."""

from __future__ import annotations

from collections import deque

import pytest
from test_scheduler import FakeModel, check_blocks, make_scheduler

from sarathi_pp.sampling_params import SamplingParams
from sarathi_pp.scheduler.block_manager import BlockManager, hash_block
from sarathi_pp.sequence import Sequence, SequenceStatus

BS = 4


def seq(seq_id: int, tokens: list[int], **params) -> Sequence:
    p = SamplingParams(temperature=0.0, max_tokens=params.pop("max_tokens", 4), **params)
    return Sequence(seq_id, f"r{seq_id}", tokens, p, 0.0)


def started(bm: BlockManager, s: Sequence) -> int:
    """Start ``s`` as the scheduler does: its hit, then blocks for every token."""
    hit = bm.lookup(s)
    assert not hit.wait
    cached = bm.take_hit(s, hit)
    bm.grow(s, s.num_tokens)
    bm.expect(s)
    return cached


def written(bm: BlockManager, s: Sequence) -> None:
    """Every token of ``s`` computed on every stage."""
    bm.publish(s, s.num_tokens)


A = list(range(10, 22))  # three blocks of 4


def test_a_published_prefix_is_hit_by_block_and_leaves_a_token_to_compute() -> None:
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = seq(0, A + [1, 2])
    assert started(bm, a) == 0
    written(bm, a)
    b = seq(1, A + [3])  # 13 tokens: 3 full blocks shared
    assert started(bm, b) == 12 and b.block_table[:3] == a.block_table[:3]
    assert all(bm.ref_count(x) == 2 for x in a.block_table[:3])
    c = seq(2, A)  # 12 tokens, all cached: the last block is computed again for its logits
    assert started(bm, c) == 8 and c.block_table[:2] == a.block_table[:2]
    assert c.block_table[2] != a.block_table[2]
    assert bm.stats.queries == 14 + 13 + 12 and bm.stats.hits == 12 + 8
    check_blocks_alone(bm, [a, b, c])


def check_blocks_alone(bm: BlockManager, seqs: list[Sequence]) -> None:
    held: dict[int, int] = {}
    for s in seqs:
        for b in s.block_table:
            held[b] = held.get(b, 0) + 1
    assert all(bm.ref_count(b) == n for b, n in held.items())
    bm.check()


def test_the_same_tokens_at_another_position_or_after_another_prefix_do_not_hit() -> None:
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = seq(0, A + [1])
    started(bm, a)
    written(bm, a)
    shifted = seq(1, [7] + A)  # A's blocks one position later
    other_start = seq(2, [9, 9, 9, 9] + A[4:] + [1])  # A's 2nd and 3rd blocks, other 1st
    for s in (shifted, other_start):
        assert bm.lookup(s).blocks == () and not bm.lookup(s).wait
    assert hash_block(None, A[4:8]) != hash_block(hash_block(None, A[:4]), A[4:8])


def test_a_block_is_not_hittable_before_its_micro_batch_completes() -> None:
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = seq(0, A + [1])
    started(bm, a)  # its prefill started: blocks pending
    b = seq(1, A + [2])
    assert bm.lookup(b).blocks == () and bm.lookup(b).wait
    bm.publish(a, 6)  # its first chunk (6 tokens) completed: one block
    hit = bm.lookup(b)
    assert hit.blocks == (a.block_table[0],) and hit.wait
    written(bm, a)
    assert bm.lookup(b).blocks == tuple(a.block_table[:3]) and not bm.lookup(b).wait


def test_a_prefill_freed_unwritten_is_never_published() -> None:
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = seq(0, A + [1])
    started(bm, a)
    bm.publish(a, 4)
    bm.free(a)  # lost or failed after its first block
    b = seq(1, A + [2])
    hit = bm.lookup(b)
    assert len(hit.blocks) == 1 and not hit.wait  # nothing pending any more
    bm.check()


def test_eviction_takes_unhashed_blocks_first_then_the_least_recently_used() -> None:
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    a, b = seq(0, A[:8] + [1]), seq(1, [50 + i for i in range(8)] + [1])
    for s in (a, b):
        started(bm, s)
        written(bm, s)
    bm.free(a)  # a's blocks now cached and free, last block first (evicted first)
    bm.free(b)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4
    c = seq(2, [90] * 8)  # needs 2: the two blocks without a hash (a's and b's 3rd)
    started(bm, c)
    assert bm.num_cached_blocks == 4
    d = seq(3, [91] * 4)  # needs 1 more: evicts a's 2nd block (the least recently freed)
    started(bm, d)
    assert bm.num_cached_blocks == 3
    assert len(bm.lookup(seq(4, A[:8] + [5])).blocks) == 1  # a's 1st block still hits
    assert len(bm.lookup(seq(5, [50 + i for i in range(8)] + [5])).blocks) == 2
    check_blocks_alone(bm, [c, d])


def test_a_hit_block_is_used_again_and_not_evicted_while_held() -> None:
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = seq(0, A[:8] + [1])
    started(bm, a)
    written(bm, a)
    bm.free(a)
    b = seq(1, A[:8] + [2])
    assert started(bm, b) == 8  # takes its two blocks back from the free cached ones
    assert bm.num_free_blocks == 1
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.grow(seq(2, [1]), 8)
    check_blocks_alone(bm, [b])


def test_reset_forgets_every_hash() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = seq(0, A + [1])
    started(bm, a)
    written(bm, a)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8
    assert bm.lookup(seq(1, A + [2])).blocks == ()


def test_caching_off_never_hits() -> None:
    bm = BlockManager(8, BS)
    a = seq(0, A + [1])
    started(bm, a)
    written(bm, a)
    assert bm.lookup(seq(1, A + [2])).blocks == () and bm.num_cached_blocks == 0


# --- through the scheduler ---------------------------------------------------------------


def run(sched, seqs, num_inflight: int, max_steps: int = 500) -> list:
    """An engine-like loop (micro-batches done in issue order); the micro-batches issued."""
    bm = sched.block_manager
    model = FakeModel(bm.num_blocks, bm.block_size)
    for s in seqs:
        sched.add(s)
    inflight: deque = deque()
    issued = []
    for _ in range(max_steps):
        if not (sched.has_unfinished() or inflight):
            return issued
        while len(inflight) < num_inflight and (mb := sched.schedule(0.0)) is not None:
            inflight.append(mb)
            issued.append(mb)
        mb = inflight.popleft()
        for s in sched.on_step_done(mb, model.execute(mb), 0.0):
            if s.num_output_tokens >= s.params.max_tokens:
                sched.finish(s, SequenceStatus.FINISHED_LENGTH, 0.0)
        check_blocks(sched)
    raise AssertionError("stalled")


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "orca", "simple_chunking"])
def test_requests_sent_together_share_a_prefix_being_written(policy) -> None:
    """Three requests over one 24-token prefix, all there at once, two micro-batches in
    flight: the first computes the prefix, the others wait for its blocks and start after
    them (their chunks begin at 24)."""
    shared = list(range(100, 124))
    seqs = [seq(i, shared + [i, i + 1]) for i in range(3)]
    sched = make_scheduler(policy, 64, BS, 2, caching=True, chunk_size=8, tile_align=False)
    issued = run(sched, seqs, num_inflight=2)
    starts = {c.seq_id: c.start for mb in reversed(issued) for c in mb.chunks}
    assert starts == {0: 0, 1: 24, 2: 24}
    assert [s.metrics.num_cached_tokens for s in seqs] == [0, 24, 24]
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in seqs)


def test_a_request_for_prompt_logprobs_computes_its_whole_prompt() -> None:
    shared = list(range(100, 124))
    first = seq(0, shared + [1])
    wants = seq(1, shared + [2], prompt_logprobs=1)
    sched = make_scheduler("sarathi", 64, BS, 1, caching=True, chunk_size=64, tile_align=False)
    run(sched, [first], 1)
    issued = run(sched, [wants], 1)
    assert issued[0].chunks[0].start == 0 and wants.metrics.num_cached_tokens is None
    assert sched.block_manager.stats.requests == 1  # not looked up


def test_preemption_keeps_the_cached_blocks() -> None:
    """A preempted sequence's published blocks stay cached: its recompute starts after
    them."""
    sched = make_scheduler("sarathi", 64, BS, 1, caching=True, chunk_size=64, tile_align=False)
    s = seq(0, list(range(100, 121)), max_tokens=8)
    sched.add(s)
    model = FakeModel(64, BS)
    for _ in range(3):  # the prompt, then two decodes
        mb = sched.schedule(0.0)
        sched.on_step_done(mb, model.execute(mb), 0.0)
    assert s.num_output_tokens == 3 and s.num_tokens == 24
    sched._preempt(s)
    mb = sched.schedule(0.0)
    assert mb.chunks[0].start == 20 and s.metrics.num_preemptions == 1  # 5 blocks cached
    assert s.metrics.num_cached_tokens == 0  # the first lookup's, as vLLM's
    sched.on_step_done(mb, model.execute(mb), 0.0)
    check_blocks(sched)
