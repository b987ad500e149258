"""Scheduling ahead (``parallel.schedule_ahead``) without a model: the scheduler's decodes of
tokens still being sampled (``RING_TOKEN`` inputs, ``ring_from``), their bookkeeping
through completion, stop and loss (and a lost micro-batch's ``released`` sequences);
``fill_ring``; the setting's checks and resolution; the token ring's wait in the bubble
report (``in_flight`` then ``ring``)."""

from __future__ import annotations

import pytest
from test_bubbles import header, only, st
from test_placement import SPEC
from test_runtime_split import done, idle, issue, run

from sarathi_pp.config import SchedulerConfig, make_config
from sarathi_pp.microbatch import RING_TOKEN, MicroBatch, ScheduledChunk, fill_ring
from sarathi_pp.placement import Resources, ScheduleAhead, resolve_placement, resolve_schedule_ahead
from sarathi_pp.report.runtime_split import LEGACY_CLASS
from sarathi_pp.sampling_params import SamplingParams
from sarathi_pp.scheduler import create_scheduler
from sarathi_pp.sequence import Sequence, SequenceStatus

BLOCK = 4


def scheduler(policy: str = "sarathi", num_blocks: int = 64, in_flight: int = 2):
    config = SchedulerConfig(policy=policy, chunk_size=16, tile_align=False, max_num_seqs=8)
    return create_scheduler(config, num_blocks, BLOCK, 128, in_flight)


def seq(seq_id: int, prompt_len: int = 6, max_tokens: int = 8) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Sequence(seq_id, f"r{seq_id}", list(range(3, 3 + prompt_len)), params, 0.0)


def chunks_of(mb: MicroBatch, seq_id: int) -> list[ScheduledChunk]:
    return [c for c in mb.chunks if c.seq_id == seq_id]


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "orca", "simple_chunking"])
def test_a_decode_is_scheduled_ahead_of_its_token_and_takes_it_in_order(policy):
    s = scheduler(policy)
    a = seq(0)
    s.add(a)
    mb0 = s.schedule(0.0)
    assert mb0 is not None and chunks_of(mb0, 0)[0].do_sample
    assert s.schedule(0.0) is None  # without the ring, the decode waits for the token
    # ... so a wait at the in-flight limit is the load's own, unless decodes go ahead
    assert not s.has_ready_work(0.0) and s.has_ready_work(0.0, ahead=True)
    mb1 = s.schedule(0.0, ring_upto=mb0.microbatch_id)
    assert mb1 is not None
    (d,) = chunks_of(mb1, 0)
    assert d.token_ids == (RING_TOKEN,) and d.ring_from == mb0.microbatch_id
    assert not d.is_prefill and d.start == 6 and d.do_sample
    assert d.num_output_tokens == 1  # the token it samples is the sequence's second
    assert mb1.ring_sources == (mb0.microbatch_id,)
    assert a.num_scheduled_tokens == 7 and a.num_inflight == 2
    assert s.schedule(0.0, ring_upto=mb0.microbatch_id) is None  # one token ahead at most
    assert not s.has_ready_work(0.0, ahead=True)
    assert len(a.block_table) * BLOCK >= 7  # a slot for the position decoded ahead
    s.on_step_done(mb0, {0: 50}, 1.0)
    assert a.output_token_ids == [50] and a.num_inflight == 1 and not a.is_decode
    mb2 = s.schedule(1.0, ring_upto=mb1.microbatch_id)  # ahead again, of mb1's token
    assert mb2 is not None and chunks_of(mb2, 0)[0].ring_from == mb1.microbatch_id
    s.on_step_done(mb1, {0: 51}, 2.0)
    s.on_step_done(mb2, {0: 52}, 3.0)
    assert a.output_token_ids == [50, 51, 52] and a.is_decode and a.num_inflight == 0
    mb3 = s.schedule(3.0)
    assert mb3 is not None and chunks_of(mb3, 0)[0].token_ids == (52,)


def test_no_decode_ahead_of_a_token_that_ends_the_sequence_by_length():
    s = scheduler()
    a, b = seq(0, max_tokens=1), seq(1, max_tokens=2)
    s.add(a)
    s.add(b)
    mb0 = s.schedule(0.0)
    assert mb0 is not None and set(mb0.sampled_seq_ids) == {0, 1}
    mb1 = s.schedule(0.0, ring_upto=mb0.microbatch_id)
    assert mb1 is not None and [c.seq_id for c in mb1.chunks] == [1]  # a's first is its last
    s.on_step_done(mb0, {0: 9, 1: 9}, 1.0)
    s.finish(a, SequenceStatus.FINISHED_LENGTH, 1.0)
    assert s.schedule(1.0, ring_upto=mb1.microbatch_id) is None  # b's second is its last
    assert not s.has_ready_work(1.0, ahead=True)


def one_decode_ahead():
    """A scheduler with one sequence: its prompt in micro-batch 0, its first token's decode
    scheduled ahead in micro-batch 1."""
    s = scheduler()
    a = seq(0)
    s.add(a)
    mb0 = s.schedule(0.0)
    assert mb0 is not None
    mb1 = s.schedule(0.0, ring_upto=mb0.microbatch_id)
    assert mb1 is not None and mb1.ring_sources == (mb0.microbatch_id,)
    return s, a, mb0, mb1


def test_a_sequence_stopped_by_the_token_before_drops_the_ahead_one_and_frees_after():
    s, a, mb0, mb1 = one_decode_ahead()
    free_before = s.block_manager.num_free_blocks
    s.on_step_done(mb0, {0: 2}, 1.0)
    s.finish(a, SequenceStatus.FINISHED_STOPPED, 1.0)  # e.g. the token was EOS
    assert s.block_manager.num_free_blocks == free_before  # mb1 still reads its blocks
    assert s.on_step_done(mb1, {0: 77}, 2.0) == []  # the ahead token is dropped
    assert a.output_token_ids == [2]
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
    assert 0 not in s.seqs


def test_lost_microbatches_forget_the_ahead_decode():
    s, a, mb0, mb1 = one_decode_ahead()
    requeued = s.on_microbatches_lost([mb0, mb1])
    assert requeued == [a] and a.sampling_microbatch == -1 and a.num_scheduled_tokens == 0
    again = s.schedule(1.0, ring_upto=mb1.microbatch_id)  # recomputed from its prompt
    assert again is not None and chunks_of(again, 0)[0].is_prefill


def test_decode_groups_stay_one_per_microbatch_in_flight():
    s = scheduler(in_flight=2)
    seqs = [seq(i, prompt_len=2) for i in range(4)]
    for x in seqs:
        s.add(x)
    first = s.schedule(0.0)  # every prompt (8 tokens) in one chunk
    assert first is not None and len(first.sampled_seq_ids) == 4
    ahead = s.schedule(0.0, ring_upto=first.microbatch_id)
    assert ahead is not None and ahead.num_decode_tokens == 2  # 4 running / 2 in flight


def test_fill_ring():
    params = SamplingParams(max_tokens=4)
    p = ScheduledChunk(1, 0, (5, 6), True, (0,), params)
    d = ScheduledChunk(2, 9, (RING_TOKEN,), False, (1, 2, 3), params, 3, ring_from=7)
    e = ScheduledChunk(3, 4, (RING_TOKEN,), False, (4, 5), params, 1, ring_from=8)
    mb = MicroBatch(10, (p, d, e))
    assert mb.ring_sources == (7, 8)
    assert fill_ring(mb, {}) is mb
    half = fill_ring(mb, {7: {2: 42}})
    assert half.chunks[1].token_ids == (42,) and half.chunks[1].ring_from == -1
    assert half.chunks[2] == e and half.ring_sources == (8,)
    full = fill_ring(half, {8: {}})  # mb 8 did not sample seq 3 (it failed there)
    assert full.chunks[2].token_ids == (0,) and full.ring_sources == ()
    assert (full.num_prefill_tokens, full.num_decode_tokens) == (2, 2)


def test_the_setting_is_checked_and_resolved():
    with pytest.raises(ValueError, match="schedule_ahead must be true, false or auto, got 'yes'"):
        make_config(schedule_ahead="yes")
    with pytest.raises(ValueError, match="needs an executor with a token ring.*ray_compiled"):
        make_config(schedule_ahead=True, pipeline_parallel_size=2, executor="ray_compiled")
    with pytest.raises(ValueError, match="torchrun"):
        make_config(schedule_ahead=True, pipeline_parallel_size=2, executor="torchrun")
    with pytest.raises(ValueError, match="needs num_microbatches_in_flight >= .* got 1"):
        make_config(schedule_ahead=True, pipeline_parallel_size=2, num_microbatches_in_flight=1)
    gpus = Resources(num_cpu_cores=2, num_cuda_devices=4, cuda_memory_bytes=2**34)
    # (stages, executor, threads per stage, resources) -> auto's choice
    auto = {
        (1, "auto", None, Resources(num_cpu_cores=8)): False,  # one stage
        (2, "auto", None, Resources(num_cpu_cores=2)): False,  # 2 x 1 thread: every core
        (2, "ray", None, Resources(num_cpu_cores=8)): False,  # 2 x 4 threads: every core
        (2, "ray", 1, Resources(num_cpu_cores=4)): True,  # a core left for the driver
        (2, "ray", None, gpus): True,  # GPUs: the driver has the CPU
        (2, "ray_compiled", None, gpus): False,  # no ring
        (2, "torchrun", None, gpus): False,
        (3, "ray", 1, Resources(num_cpu_cores=4)): True,  # num_microbatches_in_flight 3
        (3, "ray", 1, Resources(num_cpu_cores=5)): False,  # ... 2: fewer than the stages
    }  # fmt: skip
    for (pp, executor, threads, resources), expected in auto.items():
        in_flight = 2 if resources.num_cpu_cores == 5 else None
        config = make_config(
            pipeline_parallel_size=pp, executor=executor, num_threads_per_stage=threads,
            cpu_memory_budget=2**30, num_microbatches_in_flight=in_flight,
        )  # fmt: skip
        ahead = _ahead(config, resources)
        assert ahead.on is expected, (pp, executor, threads)
        assert ahead.source.startswith("auto: ")
    forced = make_config(schedule_ahead=True, cpu_memory_budget=2**30)
    ahead = _ahead(forced, Resources(num_cpu_cores=1))
    assert ahead.on and ahead.source == "parallel.schedule_ahead"
    off = make_config(pipeline_parallel_size=2, schedule_ahead=False, cpu_memory_budget=2**30)
    assert not _ahead(off, gpus)


def _ahead(config, resources: Resources) -> ScheduleAhead:
    """The executors' decision: the placement first, then scheduling ahead on it."""
    return resolve_schedule_ahead(config, resolve_placement(config, SPEC, resources), resources)


def ring_issue(mb: int, t: float, submit: float, ring: int) -> dict:
    return issue(mb, t, submit) | {"ring": ring}


def ahead_log() -> list[dict]:
    """PP=2, two in flight + one ahead. Micro-batch 2 (issued at 0.2, before 0 is done; at
    stage 0 at 0.35) takes 0's tokens over the ring: the last stage sent them at 2.3, they
    reached stage 0 at 2.35, which had been free since 2.2. Micro-batch 3 (at stage 0 at
    2.75) takes 1's: sent 3.3, at 3.4."""
    return [
        header(2),
        issue(0, 0.0, 0.1),
        issue(1, 0.1, 0.2),
        ring_issue(2, 0.2, 0.3, ring=0),
        idle(0.3, 2.6),
        ring_issue(3, 2.6, 2.7, ring=1),
        idle(2.7, 6.0),
        st(0, 0, "decode", 0.2, 1.2, ready=0.2),
        st(0, 1, "decode", 1.2, 2.2, ready=0.3),
        st(0, 2, "decode", 2.35, 3.35, ready=0.35),
        st(0, 3, "decode", 3.4, 4.4, ready=2.75),
        st(1, 0, "decode", 1.3, 2.3),
        st(1, 1, "decode", 2.3, 3.3),
        st(1, 2, "decode", 3.4, 4.4),
        st(1, 3, "decode", 4.45, 5.45),
        done(0, 2.5, 0.35),
        done(1, 3.45, 2.75),
        done(2, 4.6, 3.5),
        done(3, 5.6, 4.7, full=False),
    ]


def test_the_ring_wait_is_in_flight_then_ring():
    a = run(ahead_log())
    # stage 0 in the window [1.3, 4.4]: waits [2.2, 2.35] for mb 2 (0 still on the last
    # stage until 2.3, then the ring) and [3.35, 3.4] for mb 3 (1 was sent at 3.3)
    only(a.stages[0].bubbles_s, in_flight=0.1, ring=0.1)
    legacy = run(ahead_log(), split=False)  # the parts come out of dependency and schedule
    for b, old in zip(a.stages, legacy.stages, strict=True):
        parts = sum(b.bubbles_s[c] for c in LEGACY_CLASS)
        new = parts + b.bubbles_s["dependency"] + b.bubbles_s["schedule"]
        assert new == pytest.approx(old.bubbles_s["dependency"] + old.bubbles_s["schedule"])
    records = ahead_log()
    records[3] = issue(2, 0.2, 0.3)  # without the ring field: stage 0's own start
    only(run(records).stages[0].bubbles_s, schedule=0.15, ring=0.05)
    # 3 handed over late (at stage 0 at 3.37, after 1's tokens were sent): dispatch until
    # then, the ring after
    records = ahead_log()
    records[5] = ring_issue(3, 3.3, 3.32, ring=1)
    records[4], records[6] = idle(0.3, 3.3), idle(3.32, 6.0)
    records[10] = st(0, 3, "decode", 3.4, 4.4, ready=3.37)
    only(run(records).stages[0].bubbles_s, in_flight=0.1, ring=0.08, dispatch=0.02)


def test_lost_microbatches_pass_their_released_sequences_to_the_next():
    # a finished penalized sequence is forgotten by the last stage when a micro-batch names
    # it in ``released``; if that micro-batch is lost, the next one must name it again
    s = scheduler(in_flight=2)
    penalized = SamplingParams(max_tokens=8, temperature=0.0, presence_penalty=1.0)
    a = Sequence(0, "r0", [3, 4, 5], penalized, 0.0)
    b = Sequence(1, "r1", [6, 7, 8, 9], penalized, 0.0)
    s.add(a)
    s.add(b)
    mb0 = s.schedule(0.0)
    assert mb0 is not None and set(mb0.sampled_seq_ids) == {0, 1} and mb0.released == ()
    s.on_step_done(mb0, {0: 11, 1: 12}, 1.0)
    s.finish(a, SequenceStatus.FINISHED_STOPPED, 1.0)
    mb1 = s.schedule(1.0)
    assert mb1 is not None and mb1.released == (0,)
    s.on_microbatches_lost([mb1])
    mb2 = s.schedule(2.0)
    assert mb2 is not None and mb2.released == (0,)  # named again, once
    s.on_step_done(mb2, {}, 3.0)
    mb3 = s.schedule(3.0)
    assert mb3 is None or mb3.released == ()  # and not again after it arrived
