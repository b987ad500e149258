"""``scheduler.max_waiting`` at the engine: a refused request leaves no trace."""

from __future__ import annotations

import pytest

from sarathi_pp import LLMEngine, SamplingParams, load_config
from sarathi_pp.scheduler.base import QueueFullError


def test_full_queue_refuses_and_recovers(llama_dir):
    engine = LLMEngine(load_config(None, model=str(llama_dir), max_model_len=128, max_waiting=1))
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("a", None, sp, prompt_token_ids=[5, 6, 7])
    with pytest.raises(QueueFullError, match="max_waiting=1"):
        engine.add_request("b", None, sp, prompt_token_ids=[8, 9])
    done = []
    while engine.has_unfinished_requests():
        done += [o.request_id for o in engine.step() if o.finished]
    assert done == ["a"]  # "b" was never queued
    engine.add_request("b", None, sp, prompt_token_ids=[8, 9])  # the id is free, room again
    while engine.has_unfinished_requests():
        done += [o.request_id for o in engine.step() if o.finished]
    assert done == ["a", "b"]
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    engine.shutdown()
