"""Scheduler policies driven by a pure-Python simulation (no torch, no model).

The fake model reads each sequence's context back from a fake paged KV cache through the
block table carried by the micro-batch, and samples ``hash((seq_id, context)) % 1000``. So a
request's tokens equal the unbatched reference only if every chunk carried the right
tokens, the block tables were right and no block was reused while still live.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import pairwise

import pytest

from sarathi_pp.config import SchedulerConfig
from sarathi_pp.microbatch import MicroBatch
from sarathi_pp.sampling_params import SamplingParams
from sarathi_pp.scheduler import create_scheduler, scheduler_names
from sarathi_pp.scheduler.base import IDLE_DEPENDENCY, IDLE_NO_WORK, Scheduler
from sarathi_pp.sequence import Sequence, SequenceStatus

POLICIES = ["sarathi", "vllm", "orca", "simple_chunking"]
MAX_MODEL_LEN = 64


def next_token(seq_id: int, context: tuple[int, ...]) -> int:
    return hash((seq_id, context)) % 1000


def reference_output(seq_id: int, prompt: list[int], max_tokens: int) -> list[int]:
    """What the fake model generates for one request without any batching."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(seq_id, tuple(tokens)))
    return tokens[len(prompt) :]


class FakeModel:
    """Runs micro-batches in issue order against a fake paged KV cache whose every slot
    holds what real K/V depends on: its position and every token up to it. A read checks
    that the slot at each position holds the prefix read so far plus one token, so a block
    hit in the prefix cache must hold the same tokens after the same prefix."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[tuple[int, tuple[int, ...] | None] | None] = [None] * (
            num_blocks * block_size
        )

    def _slot(self, block_table: tuple[int, ...], pos: int) -> int:
        return block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(
        self, microbatch: MicroBatch, failed: frozenset[int] = frozenset(), dropped=frozenset()
    ) -> dict:
        """The sampled tokens; a sequence in ``failed`` writes garbage K/V (a stage raised
        on it) and samples nothing; one in ``dropped`` is left out (it failed in an earlier
        micro-batch: the executor runs the ones behind without it)."""
        sampled = {}
        for c in microbatch.chunks:
            if c.seq_id in dropped:
                continue
            context: list[int] = []
            for pos in range(c.start):  # attend to the prefix through the block table
                entry = self.slots[self._slot(c.block_table, pos)]
                assert entry is not None and entry[0] == pos and entry[1] is not None, (
                    f"{microbatch}: seq {c.seq_id} pos {pos} reads {entry}"
                )
                assert entry[1][:-1] == tuple(context), (
                    f"{microbatch}: seq {c.seq_id} pos {pos} reads K/V of another prefix"
                )
                context.append(entry[1][-1])
            for i, token in enumerate(c.token_ids):  # write K/V, then attend to it
                context.append(token)
                kv = None if c.seq_id in failed else tuple(context)
                self.slots[self._slot(c.block_table, c.start + i)] = (c.start + i, kv)
            if c.do_sample and c.seq_id not in failed:
                sampled[c.seq_id] = next_token(c.seq_id, tuple(context))
        return sampled

    def wipe(self) -> None:
        """The stages were replaced: every K/V is gone."""
        self.slots = [None] * len(self.slots)


@dataclass
class Request:
    seq_id: int
    prompt: list[int]
    max_tokens: int
    arrival_time: float = 0.0


def make_requests(num: int, seed: int, max_prompt: int = 40, max_out: int = 12) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i in range(num):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, max_prompt))]
        reqs.append(
            Request(i, prompt, rng.randint(1, max_out), arrival_time=float(rng.randint(0, 6)))
        )
    return reqs


def make_scheduler(
    policy: str,
    num_blocks: int = 64,
    block_size: int = 4,
    num_inflight: int = 1,
    num_decode_inflight: int | None = None,
    caching: bool = False,
    **kw,
) -> Scheduler:
    return create_scheduler(
        SchedulerConfig(policy=policy, **kw), num_blocks, block_size, MAX_MODEL_LEN,
        num_inflight, num_decode_microbatches_in_flight=num_decode_inflight,
        enable_prefix_caching=caching,
    )  # fmt: skip


def make_seq(req: Request) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens)
    return Sequence(req.seq_id, f"r{req.seq_id}", req.prompt, params, req.arrival_time)


@dataclass
class SimResult:
    microbatches: list[MicroBatch] = field(default_factory=list)
    outputs: dict[int, list[int]] = field(default_factory=dict)
    idle_reasons: list[tuple[str | None, int]] = field(default_factory=list)  # (reason, inflight)
    # (has_ready_work before, schedule() gave a micro-batch, it preempted) per schedule call
    readiness: list[tuple[bool, bool, bool]] = field(default_factory=list)
    # per micro-batch: the micro-batches in flight when it was issued, and the limit then
    issued_at: list[tuple[int, int]] = field(default_factory=list)


class Checker:
    """Invariants checked on every micro-batch at the moment it is issued."""

    def __init__(self, sched: Scheduler, reqs: list[Request]) -> None:
        self.sched = sched
        self.cfg = sched.config
        self.ref = {
            r.seq_id: r.prompt + reference_output(r.seq_id, r.prompt, r.max_tokens) for r in reqs
        }
        self.issued_end: dict[int, int] = {}
        self.preemptions_seen: dict[int, int] = {}
        self.last_kind: str | None = None

    def before(self, now: float) -> None:
        self.ready_decodes = {s.seq_id for s in self.sched.running if s.is_decode}
        self.known = {s.seq_id: s.num_tokens for s in self.sched.seqs.values()}
        # this micro-batch's share of the decodes: the running ones over the limit in force
        self.groups = self.sched.microbatch_limit(now)
        self.decode_share = max(1, -(-len(self.sched.running) // self.groups))
        prefilling = [s for s in self.sched.running if s.is_schedulable and not s.is_decode]
        self.num_decoding = len(self.sched.running) - len(prefilling)

    def _balanced_share(self, num_inflight: int) -> int:
        """``balance_microbatches``: the decodes (past their prompt) over the limit, and the
        ready ones over the micro-batches still to issue."""
        if not self.cfg.balance_microbatches:
            return self.decode_share
        cap = -(-self.num_decoding // self.groups)
        free = max(1, self.groups - num_inflight)
        return max(1, min(cap, -(-len(self.ready_decodes) // free)))

    def check(self, microbatch: MicroBatch, inflight: deque[MicroBatch], now: float) -> None:
        cfg, sched = self.cfg, self.sched
        ids = [c.seq_id for c in microbatch.chunks]
        assert microbatch.chunks and len(ids) == len(set(ids)), microbatch
        kinds = [c.is_prefill for c in microbatch.chunks]
        assert kinds == sorted(kinds, reverse=True), f"layout: prefill rows first: {microbatch}"
        if cfg.policy in ("sarathi", "simple_chunking"):
            assert microbatch.num_tokens <= sched.chunk_size, microbatch  # the budget in force
        if cfg.policy in ("vllm", "simple_chunking"):
            assert microbatch.kind != "hybrid", microbatch
        if cfg.policy == "sarathi":
            self._check_decodes_first(microbatch, len(inflight))
        if cfg.policy == "simple_chunking" and self.last_kind == "prefill":
            assert microbatch.kind == "decode" or not self._decodes_could_run(microbatch), (
                f"a decode step must follow a prefill step: {microbatch}"
            )
        self.last_kind = microbatch.kind
        if (
            cfg.tile_align
            and cfg.policy in ("sarathi", "simple_chunking")
            and microbatch.num_prefill_tokens
        ):
            rem = microbatch.num_tokens % cfg.tile_size
            assert rem == 0 or microbatch.num_prefill_tokens <= rem, (
                f"tile {cfg.tile_size}: {microbatch}"
            )
        sampling_inflight = {c.seq_id for p in inflight for c in p.chunks if c.do_sample}
        held_inflight = {c.seq_id for p in inflight for c in p.chunks}
        for c in microbatch.chunks:
            seq = sched.seqs_by_id(c.seq_id)
            assert seq.metrics.arrival_time <= now, f"not arrived: {c} at {now}"
            assert c.seq_id not in sampling_inflight, f"waits for its token: {c} in {microbatch}"
            if not c.is_prefill:
                assert c.num_tokens == 1 and c.do_sample, c
                assert c.seq_id not in held_inflight, f"decode twice in flight: {c}"
            assert c.do_sample == (c.end == self.known[c.seq_id]), c
            assert c.token_ids == tuple(self.ref[c.seq_id][c.start : c.end]), c
            assert len(c.block_table) * sched.block_manager.block_size >= c.end, c
            self._check_contiguous(seq, c.seq_id, c.start, c.end)
        self._check_blocks()

    def _decodes_could_run(self, microbatch: MicroBatch) -> bool:
        """Some decode that was ready is still running, not in ``microbatch`` and has a KV slot."""
        in_plan = {c.seq_id for c in microbatch.chunks}
        for seq_id in self.ready_decodes - in_plan:
            seq = self.sched.seqs.get(seq_id)
            running = seq is not None and seq.status is SequenceStatus.RUNNING
            if running and self.sched.block_manager.can_grow(seq, seq.num_tokens):
                return True
        return False

    def _check_decodes_first(self, microbatch: MicroBatch, num_inflight: int) -> None:
        """A ready decode may be left out of a micro-batch with prefill rows only when the budget
        or the micro-batch's share of the decodes was full, or when it had no KV block (then it was
        preempted or had no victim)."""
        limit = min(self.sched.chunk_size, self._balanced_share(num_inflight))
        if microbatch.num_prefill_tokens and microbatch.num_decode_tokens < limit:
            assert not self._decodes_could_run(microbatch), (
                f"a ready decode left out of {microbatch}"
            )

    def _check_contiguous(self, seq: Sequence, seq_id: int, start: int, end: int) -> None:
        expected = self.issued_end.get(seq_id, 0)
        preempted = seq.metrics.num_preemptions > self.preemptions_seen.get(seq_id, 0)
        fresh = preempted or seq_id not in self.issued_end
        assert start == expected or (fresh and start == cached_prefix(self.sched, seq)), (
            seq_id, start, expected,
        )  # fmt: skip
        self.issued_end[seq_id] = end
        self.preemptions_seen[seq_id] = seq.metrics.num_preemptions

    def _check_blocks(self) -> None:
        check_blocks(self.sched)


def cached_prefix(sched: Scheduler, seq: Sequence) -> int:
    """Tokens at the start of ``seq`` held by published blocks (where a started prefill
    may begin: 0 without prefix caching)."""
    bm = sched.block_manager
    n = 0
    for block in seq.block_table:
        if block not in bm._block_hash:
            break
        n += 1
    return n * bm.block_size


def check_blocks(sched: Scheduler) -> None:
    """KV blocks conserved: each held as often as its reference count says, free exactly
    when no sequence holds it; a block shared by two sequences is a published one."""
    bm = sched.block_manager
    held = Counter(b for s in sched.seqs.values() for b in s.block_table)
    for b in range(bm.num_blocks):
        assert held[b] == bm.ref_count(b), (b, held[b], bm.ref_count(b))
        assert held[b] <= 1 or b in bm._block_hash, f"block {b} shared but not published"
    assert sorted([*held, *bm._free, *bm._evictable]) == list(range(bm.num_blocks)), "lost"
    bm.check()


def simulate(
    sched: Scheduler, reqs: list[Request], num_inflight: int, max_steps: int = 20_000
) -> SimResult:
    """An engine-like loop: up to ``num_inflight`` micro-batches outstanding (fewer while
    the scheduler's ``microbatch_limit`` says so), done in issue order; a request finishes
    at ``max_tokens`` (FINISHED_LENGTH); one time unit per step."""
    bm = sched.block_manager
    model = FakeModel(bm.num_blocks, bm.block_size)
    seqs = {r.seq_id: make_seq(r) for r in reqs}
    for seq in seqs.values():
        sched.add(seq)
    checker = Checker(sched, reqs)
    result = SimResult()
    inflight: deque[MicroBatch] = deque()
    now = 0.0
    for _ in range(max_steps):
        if not (sched.has_unfinished() or inflight):
            break
        while len(inflight) < (limit := sched.microbatch_limit(now)):
            assert limit <= num_inflight
            checker.before(now)
            ready, preemptions = sched.has_ready_work(now), sched.num_preemptions
            microbatch = sched.schedule(now)
            preempted = sched.num_preemptions > preemptions
            result.readiness.append((ready, microbatch is not None, preempted))
            if microbatch is None:
                result.idle_reasons.append((sched.idle_reason, len(inflight)))
                break
            assert sched.idle_reason is None
            checker.check(microbatch, inflight, now)
            result.issued_at.append((len(inflight), limit))
            inflight.append(microbatch)
            result.microbatches.append(microbatch)
        if inflight:
            microbatch = inflight.popleft()
            for seq in sched.on_step_done(microbatch, model.execute(microbatch), now):
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq, SequenceStatus.FINISHED_LENGTH, now)
            now += 1.0
        else:  # nothing in flight and nothing to issue: only a future arrival may help
            assert sched.idle_reason == IDLE_NO_WORK, f"stuck at {now}: {sched.running}"
            now = min(s.metrics.arrival_time for s in sched.waiting)
    else:
        raise AssertionError(
            f"no progress after {max_steps} steps: {sched.running} {sched.waiting}"
        )
    for seq_id, seq in seqs.items():
        assert seq.status is SequenceStatus.FINISHED_LENGTH, seq
        result.outputs[seq_id] = seq.output_token_ids
    return result


# name -> (SchedulerConfig keywords, num_blocks, block_size, expect preemption)
CONFIGS = {
    "chunk1": (dict(chunk_size=1, tile_align=False), 64, 4, False),
    "chunk7": (dict(chunk_size=7, tile_align=False), 64, 4, False),
    "chunk16_tile8": (dict(chunk_size=16, tile_align=True, tile_size=8), 64, 4, False),
    "chunk64_tile8": (dict(chunk_size=64, tile_align=True, tile_size=8), 64, 4, False),
    "chunk64": (dict(chunk_size=64, tile_align=False), 64, 4, False),
    "chunk10000": (dict(chunk_size=10000, tile_align=False), 64, 4, False),
    "chunk7_tile8": (dict(chunk_size=7, tile_align=True, tile_size=8), 64, 4, False),
    "max_seqs2": (dict(chunk_size=16, tile_align=False, max_num_seqs=2), 64, 4, False),
    # 15 blocks of 4 = 60 slots: one longest request (52 tokens) fits, several do not.
    "small_cache": (dict(chunk_size=16, tile_align=True, tile_size=8), 15, 4, True),
    "small_cache_chunk7": (dict(chunk_size=7, tile_align=False), 15, 4, True),
    "small_cache_big_chunk": (dict(chunk_size=10000, tile_align=False), 15, 4, True),
}


@pytest.mark.parametrize("num_inflight, num_decode_inflight", [(1, None), (3, None), (3, 2)])
@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("policy", POLICIES)
def test_simulation_matches_unbatched_reference(
    policy, config_name, num_inflight, num_decode_inflight
):
    kw, num_blocks, block_size, expect_preemption = CONFIGS[config_name]
    sched = make_scheduler(policy, num_blocks, block_size, num_inflight, num_decode_inflight, **kw)
    seed = list(CONFIGS).index(config_name)
    # Under a small cache: short prompts, long outputs, so that growing decodes collide.
    sizes = dict(max_prompt=24, max_out=24) if expect_preemption else {}
    reqs = make_requests(12, seed=seed, **sizes)
    result = simulate(sched, reqs, num_inflight)
    for r in reqs:
        out = result.outputs[r.seq_id]
        assert len(out) == r.max_tokens
        assert out == reference_output(r.seq_id, r.prompt, r.max_tokens), r.seq_id
    assert sched.block_manager.num_free_blocks == num_blocks
    assert sched.seqs == {} and not sched.has_unfinished()
    if expect_preemption:
        assert sched.num_preemptions > 0
    # has_ready_work (asked by the engine when the in-flight limit is reached) says what
    # schedule() finds: a micro-batch exactly when it is true, but for a preemption making
    # room that it does not try.
    for ready, scheduled, preempted in result.readiness:
        assert scheduled == ready or (scheduled and preempted), (ready, scheduled, preempted)
    assert any(r for r, _, _ in result.readiness)
    if num_inflight > 1:  # then schedule() is also called with everything in flight
        assert not all(r for r, _, _ in result.readiness)
    # Reasons are only ever the two documented ones; "dependency" needs work in flight.
    for reason, n_inflight in result.idle_reasons:
        assert reason in (IDLE_NO_WORK, IDLE_DEPENDENCY)
        if n_inflight == 0:
            assert reason == IDLE_NO_WORK


@pytest.mark.parametrize("policy", POLICIES)
def test_many_seeds_small_cache_pipelined(policy):
    """More random workloads through the tightest config, K=3 (the preemption paths)."""
    for seed in range(6):
        sched = make_scheduler(
            policy, 15, 4, 3, chunk_size=8 + seed, tile_align=bool(seed % 2), tile_size=4
        )
        reqs = make_requests(10, seed=100 + seed)
        result = simulate(sched, reqs, num_inflight=3)
        for r in reqs:
            assert result.outputs[r.seq_id] == reference_output(r.seq_id, r.prompt, r.max_tokens)
        assert sched.block_manager.num_free_blocks == 15 and not sched.seqs


# --- policy shapes ---------------------------------------------------------------------


def _run_kinds(policy: str, **kw) -> list[MicroBatch]:
    sched = make_scheduler(policy, 256, 4, **kw)
    reqs = [Request(i, list(range(1, 30)), 8, arrival_time=float(2 * i)) for i in range(6)]
    return simulate(sched, reqs, num_inflight=1).microbatches


def test_sarathi_piggybacks_decodes_on_prefill_chunks():
    microbatches = _run_kinds("sarathi", chunk_size=16, tile_align=False)
    kinds = [p.kind for p in microbatches]
    assert "hybrid" in kinds
    # A prompt of 29 tokens never runs in one micro-batch.
    assert all(p.num_prefill_tokens <= 16 for p in microbatches)


def test_simple_chunking_alternates_prefill_and_decode_steps():
    microbatches = _run_kinds("simple_chunking", chunk_size=16, tile_align=False)
    kinds = [p.kind for p in microbatches]
    assert "hybrid" not in kinds and "prefill" in kinds and "decode" in kinds
    # Staggered arrivals: prefill and decode steps interleave (the Checker asserts the
    # strict alternation while decodes are ready).
    assert ("prefill", "decode") in set(pairwise(kinds))
    assert ("decode", "prefill") in set(pairwise(kinds))


def test_vllm_runs_whole_prompts_in_prefill_only_steps():
    microbatches = _run_kinds("vllm", chunk_size=16)
    assert {p.kind for p in microbatches} == {"prefill", "decode"}
    for p in microbatches:
        for c in p.chunks:
            if c.is_prefill:
                assert c.start == 0 and c.num_tokens == 29 and c.do_sample


def test_vllm_respects_max_num_batched_tokens():
    sched = make_scheduler("vllm", 256, 4, max_num_batched_tokens=40)
    reqs = [Request(i, list(range(20)), 2) for i in range(5)]
    microbatches = simulate(sched, reqs, num_inflight=1).microbatches
    first = microbatches[0]
    assert first.kind == "prefill" and first.num_prefill_tokens == 40  # two prompts, not three


def test_orca_batches_decodes_with_whole_prompts():
    microbatches = _run_kinds("orca", chunk_size=16)
    assert "hybrid" in [p.kind for p in microbatches]
    for p in microbatches:
        for c in p.chunks:
            if c.is_prefill:
                assert c.start == 0 and c.num_tokens == 29


def test_sarathi_fills_budget_with_decodes_then_prefill_chunk():
    sched = make_scheduler("sarathi", 256, 4, chunk_size=10, tile_align=False)
    for i in range(3):
        sched.add(make_seq(Request(i, [1, 2, 3], 50)))
    microbatch = sched.schedule(0.0)
    assert [(c.seq_id, c.start, c.end) for c in microbatch.chunks] == [
        (0, 0, 3),
        (1, 0, 3),
        (2, 0, 3),
    ]
    sched.on_step_done(microbatch, {0: 7, 1: 7, 2: 7}, 1.0)
    sched.add(make_seq(Request(3, list(range(20)), 5)))
    microbatch = sched.schedule(1.0)
    # Three decodes first, then 7 prefill tokens of the new prompt: 10 rows.
    assert microbatch.num_decode_tokens == 3 and microbatch.num_prefill_tokens == 7
    assert microbatch.chunks[0].seq_id == 3 and microbatch.chunks[0].end == 7
    assert microbatch.kind == "hybrid"


def test_sarathi_tile_align_trims_prefill_not_to_nothing():
    sched = make_scheduler("sarathi", 256, 4, chunk_size=30, tile_align=True, tile_size=8)
    for i in range(3):
        sched.add(make_seq(Request(i, [1, 2, 3], 50)))
    microbatch = sched.schedule(0.0)  # 9 prefill rows -> trimmed to 8
    assert microbatch.num_tokens == 8 and [c.num_tokens for c in microbatch.chunks] == [3, 3, 2]
    sched.on_step_done(microbatch, {0: 5, 1: 5}, 1.0)
    microbatch = sched.schedule(1.0)  # 2 decodes + 1 prefill token: 3 % 8 == 3 >= 1, not trimmed
    assert microbatch.num_decode_tokens == 2 and microbatch.num_prefill_tokens == 1
    assert microbatch.num_tokens == 3


def test_sarathi_decodes_rotate_when_more_than_budget():
    """More ready decodes than the budget: least recently scheduled go first, nobody starves."""
    sched = make_scheduler("sarathi", 256, 4, chunk_size=3, tile_align=False)
    for i in range(7):
        sched.add(make_seq(Request(i, [1], 100)))
    prefills = [sched.schedule(0.0) for _ in range(3)]  # 3 + 3 + 1 one-token prompts
    assert [p.num_prefill_tokens for p in prefills] == [3, 3, 1]
    for p in prefills:
        sched.on_step_done(p, {i: 1 for i in p.sampled_seq_ids}, 0.0)
    waits = {i: 0 for i in range(7)}
    for step in range(1, 40):
        microbatch = sched.schedule(float(step))
        assert microbatch.kind == "decode" and microbatch.num_tokens == 3
        ids = {c.seq_id for c in microbatch.chunks}
        for i in waits:
            waits[i] = 0 if i in ids else waits[i] + 1
            assert waits[i] <= 2, f"seq {i} starved at step {step}"  # 7 seqs / 3 rows
        sched.on_step_done(microbatch, {i: 1 for i in microbatch.sampled_seq_ids}, float(step))


def test_sarathi_decodes_fill_budget_before_new_prompts():
    """Decode-first: a budget of running decodes leaves no room for a waiting prompt."""
    sched = make_scheduler("sarathi", 256, 4, chunk_size=3, tile_align=False)
    for i in range(4):
        sched.add(make_seq(Request(i, [1], 5)))
    p = sched.schedule(0.0)
    sched.on_step_done(p, {0: 1, 1: 1, 2: 1}, 0.0)
    p = sched.schedule(1.0)
    assert p.kind == "decode" and {c.seq_id for c in p.chunks} == {0, 1, 2}


def test_max_num_seqs_limits_running():
    for policy in POLICIES:
        sched = make_scheduler(policy, 256, 4, chunk_size=64, max_num_seqs=2, tile_align=False)
        for i in range(5):
            sched.add(make_seq(Request(i, [1, 2, 3, 4], 5)))
        microbatch = sched.schedule(0.0)
        assert len(sched.running) == 2 and {c.seq_id for c in microbatch.chunks} == {0, 1}, policy


# --- arrivals and idle reasons ------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_future_arrivals_are_not_scheduled(policy):
    sched = make_scheduler(policy, 64, 4, chunk_size=64, tile_align=False)
    sched.add(make_seq(Request(0, [1, 2, 3], 2, arrival_time=5.0)))
    assert sched.schedule(0.0) is None and sched.idle_reason == IDLE_NO_WORK
    assert sched.schedule(4.999) is None and sched.idle_reason == IDLE_NO_WORK
    microbatch = sched.schedule(5.0)
    assert microbatch is not None and microbatch.chunks[0].seq_id == 0 and sched.idle_reason is None


@pytest.mark.parametrize("policy", POLICIES)
def test_idle_reason_dependency_while_tokens_in_flight(policy):
    sched = make_scheduler(policy, 64, 4, chunk_size=64, tile_align=False)
    sched.add(make_seq(Request(0, [1, 2, 3], 3)))
    sched.add(make_seq(Request(1, [4, 5], 3, arrival_time=100.0)))
    p0 = sched.schedule(0.0)  # whole prompt, samples
    assert p0 is not None and p0.sampled_seq_ids == [0]
    assert sched.schedule(0.0) is None and sched.idle_reason == IDLE_DEPENDENCY
    sched.on_step_done(p0, {0: 9}, 1.0)
    p1 = sched.schedule(1.0)  # the decode of seq 0
    assert p1.kind == "decode" and p1.chunks[0].token_ids == (9,)
    assert sched.schedule(1.0) is None and sched.idle_reason == IDLE_DEPENDENCY
    sched.on_step_done(p1, {0: 8}, 2.0)
    sched.finish(sched.seqs_by_id(0), SequenceStatus.FINISHED_LENGTH, 2.0)
    assert sched.schedule(2.0) is None and sched.idle_reason == IDLE_NO_WORK


def test_prefill_chunks_pipeline_while_previous_in_flight():
    """The next chunk of a prompt is issued while the previous one is in flight."""
    sched = make_scheduler("sarathi", 64, 4, chunk_size=8, tile_align=False)
    sched.add(make_seq(Request(0, list(range(20)), 2)))
    microbatches = [sched.schedule(0.0) for _ in range(3)]
    assert [(p.chunks[0].start, p.chunks[0].end) for p in microbatches] == [
        (0, 8),
        (8, 16),
        (16, 20),
    ]
    assert [p.sampled_seq_ids for p in microbatches] == [[], [], [0]]
    assert sched.schedule(0.0) is None and sched.idle_reason == IDLE_DEPENDENCY


# --- finishing and aborting while in flight -------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_abort_while_in_flight_frees_blocks_after_microbatch_done(policy):
    sched = make_scheduler(policy, 32, 4, chunk_size=64, tile_align=False)
    sched.add(make_seq(Request(0, list(range(10)), 5)))
    sched.add(make_seq(Request(1, list(range(6)), 5)))
    microbatch = sched.schedule(0.0)
    seq0 = sched.seqs_by_id(0)
    held = list(seq0.block_table)
    assert len(held) == 3
    sched.finish(seq0, SequenceStatus.FINISHED_ABORTED, 0.5, "abort")
    assert seq0.status is SequenceStatus.FINISHED_ABORTED and seq0.block_table == held
    assert sched.block_manager.num_free_blocks == 32 - 3 - 2
    assert 0 in sched.seqs  # still known to the micro-batch in flight
    updated = sched.on_step_done(microbatch, {0: 11, 1: 12}, 1.0)
    assert [s.seq_id for s in updated] == [1]  # no token for the aborted one
    assert seq0.output_token_ids == [] and seq0.block_table == []
    assert 0 not in sched.seqs and sched.block_manager.num_free_blocks == 32 - 2
    assert not set(held) & set(sched.seqs_by_id(1).block_table)
    # Nothing of seq 0 is scheduled again.
    nxt = sched.schedule(1.0)
    assert [c.seq_id for c in nxt.chunks] == [1]


def test_finish_of_waiting_and_idle_sequences_frees_at_once():
    sched = make_scheduler("sarathi", 32, 4, chunk_size=4, tile_align=False)
    sched.add(make_seq(Request(0, list(range(10)), 5)))
    sched.add(make_seq(Request(1, list(range(10)), 5)))
    microbatch = sched.schedule(0.0)  # 4 tokens of seq 0
    sched.on_step_done(microbatch, {}, 1.0)
    s0, s1 = sched.seqs_by_id(0), sched.seqs_by_id(1)
    assert s0.block_table and s0.num_inflight == 0
    sched.finish(s0, SequenceStatus.FINISHED_ABORTED, 1.0)
    sched.finish(s1, SequenceStatus.FINISHED_ABORTED, 1.0)  # still waiting
    assert sched.block_manager.num_free_blocks == 32 and sched.seqs == {}
    assert not sched.has_unfinished() and sched.schedule(1.0) is None
    sched.finish(s0, SequenceStatus.FINISHED_LENGTH, 2.0)  # twice: ignored
    assert s0.status is SequenceStatus.FINISHED_ABORTED


def test_finish_in_flight_decode_keeps_blocks_until_done():
    sched = make_scheduler("sarathi", 16, 4, chunk_size=16, tile_align=False)
    sched.add(make_seq(Request(0, [1, 2, 3, 4], 5)))
    p = sched.schedule(0.0)
    sched.on_step_done(p, {0: 5}, 1.0)
    p = sched.schedule(1.0)  # decode of token 5 needs a second block
    seq = sched.seqs_by_id(0)
    assert p.kind == "decode" and len(seq.block_table) == 2
    sched.finish(seq, SequenceStatus.FINISHED_STOPPED, 1.5, 5)
    assert sched.block_manager.num_free_blocks == 14
    sched.on_step_done(p, {0: 6}, 2.0)
    assert sched.block_manager.num_free_blocks == 16 and seq.output_token_ids == [5]


# --- preemption ---------------------------------------------------------------------------


def test_preemption_picks_most_recent_not_in_flight():
    """Decodes that need a block preempt the most recently admitted idle sequence."""
    sched = make_scheduler("vllm", 4, 4, chunk_size=64)
    for i in range(3):
        sched.add(make_seq(Request(i, [1, 2, 3, 4], 5)))
    microbatch = sched.schedule(0.0)  # three whole prompts: 3 blocks, 1 free
    assert microbatch.kind == "prefill" and sched.block_manager.num_free_blocks == 1
    sched.on_step_done(microbatch, {0: 1, 1: 1, 2: 1}, 1.0)
    microbatch = sched.schedule(1.0)  # each decode needs a 2nd block: seq 0 gets the free one,
    # seq 1 preempts seq 2 (most recent) and takes its block; seq 2 is not scheduled.
    assert sorted(c.seq_id for c in microbatch.chunks) == [0, 1]
    s2 = sched.seqs_by_id(2)
    assert s2.status is SequenceStatus.WAITING and s2.num_scheduled_tokens == 0
    assert s2.output_token_ids == [1] and s2.block_table == [] and sched.waiting[0] is s2
    assert sched.num_preemptions == 1 and s2.metrics.num_preemptions == 1


@pytest.mark.parametrize("policy", scheduler_names())
def test_kv_lost_recomputes_every_running_sequence_in_admission_order(policy):
    """A lost stage takes every KV cache with it: the sequences of the lost micro-batch and
    the one between micro-batches are all recomputed (tokens kept, blocks freed), the
    oldest admitted first, ahead of a request never admitted."""
    sched = make_scheduler(policy, 64, 4, num_inflight=2, chunk_size=64)
    for i in range(3):
        sched.add(make_seq(Request(i, [1, 2, 3, 4 + i], 5)))
    first = sched.schedule(0.0)  # the three prompts
    assert first is not None and sorted(first.sampled_seq_ids) == [0, 1, 2]
    sched.on_step_done(first, {0: 7, 1: 8, 2: 9}, 1.0)
    sched.add(make_seq(Request(3, [5, 6], 5, arrival_time=5.0)))  # not arrived yet
    decodes = sched.schedule(1.0)  # two of the three decodes (shared over two in flight)
    assert decodes is not None and len(decodes.chunks) == 2
    (between,) = [s for s in sched.running if s.num_inflight == 0]
    assert sched.on_microbatches_lost([decodes]) == [
        sched.seqs_by_id(c.seq_id) for c in sorted(decodes.chunks, key=lambda c: c.seq_id)
    ]
    assert between.block_table and between.status is SequenceStatus.RUNNING
    assert sched.on_kv_lost() == [between]
    assert [s.seq_id for s in sched.waiting] == [0, 1, 2, 3] and not sched.running
    assert sched.block_manager.num_free_blocks == 64
    for i in range(3):
        s = sched.seqs_by_id(i)
        assert s.output_token_ids == [7 + i] and s.num_scheduled_tokens == 0 and not s.block_table
    again = sched.schedule(2.0)  # recomputed from the prompt and the token each has
    assert again is not None and 0 in again.sampled_seq_ids
    assert [c.token_ids for c in again.chunks if c.seq_id == 0] == [(1, 2, 3, 4, 7)]


def test_no_preemption_of_sequences_in_flight():
    sched = make_scheduler("sarathi", 3, 4, chunk_size=64, tile_align=False)
    sched.add(make_seq(Request(0, [1, 2, 3, 4], 5)))
    sched.add(make_seq(Request(1, [1, 2, 3, 4], 5)))
    p0 = sched.schedule(0.0)
    sched.on_step_done(p0, {0: 1, 1: 1}, 1.0)
    s0, s1 = sched.seqs_by_id(0), sched.seqs_by_id(1)
    s1.num_inflight += 1  # pretend seq 1 is held by another micro-batch in flight
    p1 = sched.schedule(1.0)  # seq 0 takes the only free block; seq 1 cannot preempt anyone
    assert [c.seq_id for c in p1.chunks] == [0]
    assert s1.status is SequenceStatus.RUNNING and sched.num_preemptions == 0
    assert len(s0.block_table) == 2


# --- registry -----------------------------------------------------------------------------


def test_registry_names_and_unknown_policy():
    assert set(scheduler_names()) == set(POLICIES)
    cfg = SchedulerConfig(policy="sarathi")
    object.__setattr__(cfg, "policy", "fcfs")  # bypass config validation on purpose
    with pytest.raises(ValueError, match="fcfs.*sarathi.*vllm"):
        create_scheduler(cfg, 8, 4, 64)


def test_most_recent_decode_preempts_itself_not_an_older_one():
    """Two decodes, one free block left: the newer sequence is the victim, not the older."""
    sched = make_scheduler("sarathi", 3, 8, chunk_size=2, tile_align=False)
    sched.add(make_seq(Request(0, [1], 50)))
    sched.add(make_seq(Request(1, [1], 50)))
    sched.add(make_seq(Request(2, [1] * 7, 50)))  # never fits beside them; stays waiting
    s0, s1 = sched.seqs_by_id(0), sched.seqs_by_id(1)
    for step in range(12):
        microbatch = sched.schedule(float(step))
        sched.on_step_done(microbatch, {i: 1 for i in microbatch.sampled_seq_ids}, float(step))
        assert s0.metrics.num_preemptions == 0, f"older seq preempted at step {step}: {microbatch}"
    assert s1.metrics.num_preemptions >= 1 and s0.num_output_tokens == 12


def test_vllm_newest_decode_without_block_is_preempted_not_left_holding():
    sched = make_scheduler("vllm", 2, 4, chunk_size=64)
    sched.add(make_seq(Request(0, [1, 2], 5)))
    sched.add(make_seq(Request(1, [1, 2, 3, 4], 5)))
    microbatch = sched.schedule(0.0)
    sched.on_step_done(microbatch, {0: 1, 1: 1}, 1.0)
    microbatch = sched.schedule(1.0)  # seq 0 fits its block; seq 1 needs a 2nd one, none is free
    s0, s1 = sched.seqs_by_id(0), sched.seqs_by_id(1)
    assert [c.seq_id for c in microbatch.chunks] == [0]
    assert s1.status is SequenceStatus.WAITING and s1.block_table == []
    assert s0.metrics.num_preemptions == 0 and sched.block_manager.num_free_blocks == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_decodes_spread_over_the_microbatches_in_flight(policy):
    """With K micro-batches in flight, a micro-batch takes at most ceil(running / K) decodes, so the K
    micro-batches stay alike instead of the first holding every decode."""
    k = 3
    sched = make_scheduler(policy, 512, 4, k, chunk_size=64, tile_align=False)
    reqs = [Request(i, list(range(1, 9)), 20) for i in range(12)]
    result = simulate(sched, reqs, num_inflight=k)
    decodes = [p.num_decode_tokens for p in result.microbatches]
    assert max(decodes) <= -(-12 // k)
    # ...and in steady state (all 12 decoding) each micro-batch carries about a third of them.
    assert decodes.count(4) >= 20, decodes


@pytest.mark.parametrize("policy", POLICIES)
def test_max_waiting_refuses_past_the_limit(policy):
    from sarathi_pp.scheduler.base import QueueFullError

    sched = make_scheduler(policy, max_waiting=2)
    reqs = make_requests(3, seed=3)
    sched.add(make_seq(reqs[0]))
    sched.add(make_seq(reqs[1]))
    with pytest.raises(QueueFullError, match=r"2 requests wait \(scheduler.max_waiting=2\)"):
        sched.add(make_seq(reqs[2]))
    assert len(sched.waiting) == 2 and 2 not in sched.seqs
    microbatch = sched.schedule(10.0)  # both admitted: the queue has room again
    assert microbatch is not None and not sched.waiting
    sched.add(make_seq(reqs[2]))


@pytest.mark.parametrize("policy", POLICIES)
def test_decode_only_steps_take_the_decode_limit(policy):
    """M = 3 in flight, 2 while only decodes run: with prompts left a micro-batch takes at most
    ceil(12 / 3) decodes; once every sequence decodes at most 2 micro-batches are in flight
    and each takes ceil(12 / 2), so a decode step is 2 micro-batches, not 3."""
    reqs = [Request(i, list(range(1, 9)), 20) for i in range(12)]

    def run(num_decode_inflight):
        sched = make_scheduler(
            policy, 512, 4, 3, num_decode_inflight, chunk_size=64, tile_align=False
        )
        return simulate(sched, reqs, num_inflight=3)

    two, three = run(2), run(None)
    for result in (two, three):  # the same outputs either way
        for r in reqs:
            assert result.outputs[r.seq_id] == reference_output(r.seq_id, r.prompt, r.max_tokens)
    decode_only = [
        (mb.num_decode_tokens, at) for mb, at in zip(two.microbatches, two.issued_at)
        if not mb.num_prefill_tokens
    ]  # fmt: skip
    assert all(n <= 6 and inflight < limit == 2 for n, (inflight, limit) in decode_only)
    assert [n for n, _ in decode_only].count(6) >= 20, decode_only
    assert all(
        mb.num_decode_tokens <= 4 for mb in two.microbatches if mb.num_prefill_tokens
    )  # while prompts remain, the decodes are shared out over the 3
    steps = [sum(1 for mb in r.microbatches if not mb.num_prefill_tokens) for r in (two, three)]
    assert steps[0] < 0.75 * steps[1], steps  # 2 micro-batches per decode step, not 3


@pytest.mark.parametrize("policy", POLICIES)
def test_microbatch_limit_is_the_decode_limit_only_while_only_decodes_run(policy):
    sched = make_scheduler(policy, 512, 4, 3, 2, chunk_size=4, tile_align=False)
    assert sched.microbatch_limit(0.0) == 2  # nothing there at all
    sched.add(make_seq(Request(0, list(range(1, 11)), 5, arrival_time=1.0)))
    assert sched.microbatch_limit(0.0) == 2  # not arrived yet
    assert sched.microbatch_limit(1.0) == 3  # arrived: its prompt waits
    microbatch = sched.schedule(1.0)
    assert microbatch is not None
    chunked = microbatch.num_prefill_tokens < 10  # vllm and orca issue the whole prompt
    assert chunked == sched.chunks_prompts
    assert sched.microbatch_limit(1.0) == (3 if chunked else 2)  # prompt tokens left or not
    while (microbatch := sched.schedule(1.0)) is not None:
        pass
    assert sched.microbatch_limit(1.0) == 2  # the whole prompt is issued
    assert make_scheduler(policy, 512, 4, 3, 5).microbatch_limit(0.0) == 3  # capped at M
