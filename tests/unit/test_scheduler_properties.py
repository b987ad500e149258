"""Property-based scheduler test (hypothesis): random sequences of add / step / abort /
error / preempt / lose for every policy with 1-4 micro-batches in flight, prefix caching
on and off (prompts that share prefixes), against the fake paged KV cache of
``test_scheduler`` (a slot holds its position and every token up to it, so a cache hit on
the wrong block, or on a block not written yet, is a failed read).

Invariants, checked as the operations run (``Checker`` on every micro-batch issued, the
blocks after every operation) and at the end:
- KV blocks are conserved: every block is free or held, as often as its reference count
  says (never negative), and only a published block is shared;
- no decoding sequence is in two micro-batches in flight; the token budget is respected;
- every request finishes once the operations stop (no stall), with every block free again;
- a request that ran to its length has exactly the unbatched reference output, however
  often it was preempted and recomputed.
"""

from __future__ import annotations

from collections import deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import (
    MAX_MODEL_LEN,
    POLICIES,
    Checker,
    FakeModel,
    Request,
    check_blocks,
    make_scheduler,
    make_seq,
    reference_output,
)

from sarathi_pp.microbatch import MicroBatch
from sarathi_pp.scheduler import Scheduler
from sarathi_pp.sequence import Sequence, SequenceStatus

OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12)),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("error"), st.integers(0, 30)),
    st.tuples(st.just("preempt")),
    st.tuples(st.just("shared"), st.integers(0, 2), st.integers(1, 14), st.integers(1, 12)),
    st.tuples(st.just("lose")),
)
# Prefixes the ``shared`` prompts start with (another position or another start: no hit).
PREFIXES = ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6, 7, 8, 1, 2, 3, 4], [9, 5, 6, 7, 8] * 4)


class Harness:
    """An engine-like driver whose every move is one operation."""

    def __init__(self, sched: Scheduler, num_inflight: int) -> None:
        bm = sched.block_manager
        self.sched = sched
        self.num_inflight = num_inflight
        self.model = FakeModel(bm.num_blocks, bm.block_size)
        self.checker = Checker(sched, [])
        self.inflight: deque[MicroBatch] = deque()
        self.seqs: list[Sequence] = []
        self.failed: set[int] = set()  # sequences a micro-batch failed on
        self.now = 0.0

    # --- operations ----------------------------------------------------------------------
    def add(self, prompt_len: int, max_tokens: int, prefix: tuple[int, ...] = ()) -> None:
        seq_id = len(self.seqs)
        suffix = [(seq_id * 7 + i) % 1000 for i in range(prompt_len)]
        req = Request(seq_id, [*prefix, *suffix], max_tokens)
        self.checker.ref[seq_id] = req.prompt + reference_output(seq_id, req.prompt, max_tokens)
        seq = make_seq(req)
        seq.metrics.arrival_time = self.now
        self.seqs.append(seq)
        self.sched.add(seq)

    def shared(self, k: int, suffix_len: int, max_tokens: int) -> None:
        self.add(suffix_len, max_tokens, tuple(PREFIXES[k]))

    def lose(self) -> None:
        """A stage is lost: every micro-batch in flight with it, and every K/V."""
        self.sched.on_microbatches_lost(list(self.inflight))
        self.inflight.clear()
        self.sched.on_kv_lost()
        self.model.wipe()

    def issue(self) -> None:
        while len(self.inflight) < (limit := self.sched.microbatch_limit(self.now)):
            assert limit <= self.num_inflight
            self.checker.before(self.now)
            microbatch = self.sched.schedule(self.now)
            if microbatch is None:
                return
            self.checker.check(microbatch, self.inflight, self.now)  # budget, decodes, blocks
            self.inflight.append(microbatch)

    def step(self, failing: int | None = None) -> None:
        """Issue, then complete the oldest micro-batch; ``failing``: a sequence of it that
        the executor reports as failed (it ends with ``finish_reason="error"``)."""
        self.issue()
        if not self.inflight:
            return
        microbatch = self.inflight.popleft()
        failed = frozenset() if failing is None else frozenset([failing])
        sampled = self.model.execute(microbatch, failed, frozenset(self.failed))
        self.failed |= failed
        for seq in self.sched.on_step_done(microbatch, sampled, self.now, failed):
            if seq.num_output_tokens >= seq.params.max_tokens:
                self.sched.finish(seq, SequenceStatus.FINISHED_LENGTH, self.now)
        if failing is not None:
            seq = self.sched.seqs.get(failing)
            if seq is not None and not seq.is_finished:
                self.sched.finish(seq, SequenceStatus.FINISHED_ERROR, self.now)
        self.now += 1.0

    def abort(self, k: int) -> None:
        live = [s for s in self.seqs if not s.is_finished]
        if live:
            self.sched.finish(live[k % len(live)], SequenceStatus.FINISHED_ABORTED, self.now)

    def error(self, k: int) -> None:
        if not self.inflight:
            self.issue()
        if self.inflight:
            chunks = self.inflight[0].chunks
            self.step(failing=chunks[k % len(chunks)].seq_id)

    def preempt(self) -> None:
        victim = self.sched._pick_victim(set())
        if victim is not None:
            self.sched._preempt(victim)

    # --- invariants ----------------------------------------------------------------------
    def check_blocks(self) -> None:
        check_blocks(self.sched)
        for seq in self.seqs:  # a sequence leaves the scheduler only when nothing holds it
            if seq.seq_id not in self.sched.seqs:
                assert seq.is_finished and not seq.block_table, seq

    def drain(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not (self.sched.has_unfinished() or self.inflight):
                return
            self.step()
        raise AssertionError(f"stalled: running {self.sched.running}, waiting {self.sched.waiting}")


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(POLICIES),
    num_inflight=st.integers(1, 4),
    num_decode_inflight=st.integers(1, 4),  # at most num_inflight: the scheduler caps it
    num_blocks=st.integers(13, 40),  # 13 blocks of 4 = 52 slots: the longest request fits
    chunk_size=st.integers(1, 48),
    caching=st.booleans(),
    balance=st.booleans(),
    ops=st.lists(OPS, max_size=60),
)
def test_random_operations_keep_the_invariants(
    policy, num_inflight, num_decode_inflight, num_blocks, chunk_size, caching, balance, ops
):
    sched = make_scheduler(
        policy, num_blocks, 4, num_inflight, num_decode_inflight, caching, chunk_size=chunk_size,
        tile_align=False, tile_size=4, balance_microbatches=balance, prefill_pacing=balance,
    )  # fmt: skip
    h = Harness(sched, num_inflight)
    for op, *args in ops:
        getattr(h, op)(*args)
        h.check_blocks()
    h.drain()
    h.check_blocks()
    assert sched.block_manager.num_free_blocks == num_blocks and not sched.seqs
    for seq in h.seqs:
        assert seq.is_finished, seq
        if seq.status is SequenceStatus.FINISHED_LENGTH:
            expected = reference_output(seq.seq_id, seq.prompt_token_ids, seq.params.max_tokens)
            assert seq.output_token_ids == expected, seq
    assert all(len(s.prompt_token_ids) + s.params.max_tokens <= MAX_MODEL_LEN for s in h.seqs)
