"""``scheduler.balance_microbatches``: decodes shared evenly across the micro-batches in
flight (counts within one of each other, every phase, M = 1..4); ``scheduler.prefill_pacing``:
prefill chunks paced by the pending prefill work so that prefill reaches what would be the
decode-only tail.

Driven by the pure-Python simulation of ``test_scheduler`` (fake model, reference outputs).
"""

from __future__ import annotations

from collections import deque

import pytest
from test_scheduler import FakeModel, Request, make_seq, reference_output

from sarathi_pp.config import SchedulerConfig
from sarathi_pp.microbatch import MicroBatch
from sarathi_pp.scheduler import Scheduler, create_scheduler
from sarathi_pp.sequence import SequenceStatus

MAX_LEN = 256


def make(num_inflight: int, balance: bool = True, num_blocks: int = 256, **kw) -> Scheduler:
    """``balance``: both rules on (``balance_microbatches`` and ``prefill_pacing``) or off."""
    config = SchedulerConfig(
        policy=kw.pop("policy", "sarathi"), balance_microbatches=balance, prefill_pacing=balance,
        **kw,
    )  # fmt: skip
    return create_scheduler(config, num_blocks, 4, MAX_LEN, num_inflight)


def decode_key(sched: Scheduler) -> frozenset[int]:
    """The sequences whose prompt is fully issued: the decodes to share out."""
    return frozenset(
        s.seq_id for s in sched.running if s.num_scheduled_tokens >= s.num_prompt_tokens
    )


def run(sched: Scheduler, reqs: list[Request], num_inflight: int):
    """Closed workload, micro-batches done in issue order. Yields, after each issue, the
    micro-batches in flight, the limit in force and the decode sets of the last issues."""
    model = FakeModel(sched.block_manager.num_blocks, sched.block_manager.block_size)
    seqs = {r.seq_id: make_seq(r) for r in reqs}
    for seq in seqs.values():
        sched.add(seq)
    inflight: deque[MicroBatch] = deque()
    keys: list[frozenset[int]] = []
    for _ in range(10_000):
        if not (sched.has_unfinished() or inflight):
            break
        while len(inflight) < (limit := sched.microbatch_limit(0.0)):
            keys.append(decode_key(sched))
            microbatch = sched.schedule(0.0)
            if microbatch is None:
                break
            inflight.append(microbatch)
            yield list(inflight), limit, keys
        microbatch = inflight.popleft()
        for seq in sched.on_step_done(microbatch, model.execute(microbatch), 0.0):
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH, 0.0)
    for r in reqs:
        assert seqs[r.seq_id].output_token_ids == reference_output(r.seq_id, r.prompt, r.max_tokens)


def workload(num: int = 14, prompt_len: int = 40, max_tokens: int = 24) -> list[Request]:
    return [
        Request(i, [(7 * i + j) % 997 for j in range(prompt_len)], max_tokens + i % 3)
        for i in range(num)
    ]


@pytest.mark.parametrize("num_inflight", [1, 2, 3, 4])
def test_decode_counts_in_flight_differ_by_at_most_one_in_every_phase(num_inflight):
    # max_num_seqs 7 < 14 requests: prompts wait while others decode (the hybrid phase),
    # then the last ones decode alone (the tail). Checked wherever the decodes to share did
    # not change over the last M + 1 issues (a prompt turning into a decode or a request
    # finishing changes them; a micro-batch in flight cannot give its decodes back).
    sched = make(num_inflight, chunk_size=16, tile_align=False, max_num_seqs=7)
    checked = {"hybrid": 0, "decode": 0}
    for inflight, limit, keys in run(sched, workload(prompt_len=80), num_inflight):
        window = keys[-(num_inflight + 1) :]
        if len(window) < num_inflight + 1 or len(set(window)) != 1:
            continue
        counts = [mb.num_decode_tokens for mb in inflight]
        phase = "hybrid" if any(mb.num_prefill_tokens for mb in inflight) else "decode"
        if len(window[0]) >= limit and len(inflight) == limit:
            assert max(counts) - min(counts) <= 1, (phase, counts, inflight)
            checked[phase] += 1
        elif phase == "decode" and len(window[0]) >= limit:
            # every micro-batch in flight has decodes; the last one issued completes the set
            assert len(inflight) < limit and min(counts) >= 1, (counts, inflight)
    assert checked["decode"] > 0, checked
    if num_inflight > 1:
        assert checked["hybrid"] > 0, checked


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "orca", "simple_chunking"])
def test_five_decodes_over_four_microbatches_fill_every_one(policy):
    # The rule before: ceil(5 / 4) = 2 each, so 2, 2, 1 and the fourth micro-batch empty.
    counts = {}
    for balance in (True, False):
        sched = make(4, balance, policy=policy, chunk_size=64, tile_align=False)
        reqs = [Request(i, [i + 1, i + 2], 8) for i in range(5)]
        steps = run(sched, reqs, 4)
        for inflight, _, _ in steps:  # the prompts, then the decodes
            if all(mb.kind == "decode" for mb in inflight) and len(inflight) >= 3:
                counts[balance] = sorted(mb.num_decode_tokens for mb in inflight)
                break
        for _ in steps:  # run to the end: outputs checked against the reference
            pass
    assert counts[True][0] >= 1 and max(counts[True]) - min(counts[True]) <= 1, counts
    assert counts[False] == [1, 2, 2], counts  # three micro-batches, one slot left empty


def test_prefill_is_paced_by_the_pending_prefill_work():
    # Two decodes running and a 40-token prompt waiting, two micro-batches in flight: the
    # first takes ceil(40 / 2) prompt tokens, the second ceil(20 / 2), instead of the first
    # taking all 40 and the second being decodes alone (or nothing); the floor is one tile.
    prompt = Request(2, [(5 * j) % 97 for j in range(40)], 3)
    for balance, expect in ((True, [20, 10]), (False, [40, 0])):
        sched = make(2, balance, chunk_size=64, tile_align=False, tile_size=8)
        for i in range(2):
            sched.add(make_seq(Request(i, [1 + i, 2, 3], 6)))
        first = sched.schedule(0.0)
        assert first is not None and first.num_prefill_tokens == 6
        sched.on_step_done(first, FakeModel(256, 4).execute(first), 0.0)
        sched.add(make_seq(prompt))
        got = []
        for _ in range(2):  # two in flight
            if (mb := sched.schedule(0.0)) is not None:
                got.append(mb.num_prefill_tokens)
        assert got == expect, (balance, got)


def test_pacing_carries_prefill_into_the_tail_when_prompts_wait():
    # 300 prompt tokens wait, more than the two micro-batches in flight start at once (64
    # each): with pacing the last prompts' chunks end later in the run, in what would be
    # the decode-only tail, and none is above the budget (outputs equal to the reference
    # either way: ``run``).
    last_prefill = {}
    for balance in (True, False):
        sched = make(2, balance, chunk_size=64, tile_align=False, tile_size=8)
        issued = []
        for inflight, _, _ in run(sched, workload(10, 30, 12), 2):
            issued.append(inflight[-1])
        with_prefill = [i for i, mb in enumerate(issued) if mb.num_prefill_tokens]
        last_prefill[balance] = with_prefill[-1] / len(issued)
        assert max(mb.num_tokens for mb in issued) <= 64
    assert last_prefill[True] > last_prefill[False], last_prefill


def test_pacing_waits_for_decodes_to_balance_against():
    # Fewer decodes than micro-batches in flight: nothing to balance, a prompt split further
    # would only wait longer for its first token, so the chunk fills the budget.
    sched = make(2, chunk_size=64, tile_align=False, tile_size=8)
    sched.add(make_seq(Request(0, [(3 * j) % 97 for j in range(40)], 3)))
    mb = sched.schedule(0.0)
    assert mb is not None and mb.num_prefill_tokens == 40


@pytest.mark.parametrize("field", ["balance_microbatches", "prefill_pacing"])
def test_the_settings_must_be_bools(field):
    with pytest.raises(ValueError, match=f"{field} must be true or false, got 'x'"):
        SchedulerConfig(**{field: "x"})


@pytest.mark.parametrize("num_inflight", [2, 3, 4])
def test_token_counts_in_flight_within_one_tile_while_prompts_wait(num_inflight):
    # The defaults (balanced decodes, no pacing, tile alignment): while the prompts' tokens
    # not yet issued fill the budget, every micro-batch takes the budget less at most the
    # tile trim, so the micro-batches in flight differ by less than one tile in tokens.
    budget, tile = 64, 8
    config = SchedulerConfig(chunk_size=budget, tile_size=tile, max_num_seqs=64)
    sched = create_scheduler(config, 1024, 4, MAX_LEN, num_inflight)

    def prompt_tokens_left() -> int:
        live = list(sched.waiting) + sched.running
        return sum(max(s.num_prompt_tokens - s.num_scheduled_tokens, 0) for s in live)

    full: dict[int, bool] = {}  # micro-batch id: the prompts' tokens filled its budget
    checked = 0
    for inflight, _, _ in run(sched, workload(num=16, prompt_len=70, max_tokens=12), num_inflight):
        microbatch = inflight[-1]  # just issued: the tokens left before it include its own
        left_before = prompt_tokens_left() + microbatch.num_prefill_tokens
        full[microbatch.microbatch_id] = left_before >= budget
        if full[microbatch.microbatch_id]:
            assert budget - tile < microbatch.num_tokens <= budget, microbatch
            assert microbatch.num_tokens % tile == 0, microbatch
        if len(inflight) >= 2 and all(full[mb.microbatch_id] for mb in inflight):
            counts = [mb.num_tokens for mb in inflight]
            assert max(counts) - min(counts) < tile, counts
            checked += 1
    assert checked > 0
