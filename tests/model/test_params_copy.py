"""``SamplingParams`` is settable, as vLLM's; the engine copies it when a request is added,
so changing it afterwards reaches no request in flight: not its ``n > 1`` completions, not
its recomputation after a preemption."""

from __future__ import annotations

import pytest
from test_vs_hf import PREEMPTING, make_prompts

from sarathi_pp import LLMEngine, SamplingParams, load_config


def _params(n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.8, seed=1, max_tokens=30, ignore_eos=True)


def _run(model_dir, mutate: bool) -> tuple[dict, int]:
    """Two requests share one params object with ``n=1``, two another with ``n=2``."""
    engine = LLMEngine(load_config(None, model=str(model_dir), dtype="float32", **PREEMPTING))
    shared = [_params(1), _params(2)]
    try:
        for i, prompt in enumerate(make_prompts(seed=3, lens=(40, 41, 42, 43))):
            engine.add_request(str(i), None, shared[i % 2], prompt_token_ids=prompt)
        done: dict[str, list] = {}
        first = True
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = [c.token_ids for c in out.outputs]
            if mutate and first:  # every request in flight: change everything
                first = False
                for params in shared:
                    params.n, params.temperature, params.seed = 3, 0.0, 9
                    params.max_tokens, params.ignore_eos = 1, False
                    params.stop_token_ids = tuple(range(300))
        return done, engine.scheduler.num_preemptions
    finally:
        engine.shutdown()


def test_changing_params_after_add_changes_no_request(llama_dir) -> None:
    reference, _ = _run(llama_dir, mutate=False)
    mutated, num_preemptions = _run(llama_dir, mutate=True)
    assert num_preemptions > 0  # a recomputation ran with the params it was added with
    assert mutated == reference
    assert [len(mutated[str(i)]) for i in range(4)] == [1, 2, 1, 2]
    assert all(len(t) == 30 for c in mutated.values() for t in c)


def test_a_bad_value_set_later_is_refused_when_added(llama_dir) -> None:
    params = _params()  # n=1 with a seed: nothing else rebuilds it
    params.top_p = 3.0
    engine = LLMEngine(load_config(None, model=str(llama_dir)))
    try:
        with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 3.0") as e:
            engine.add_request("0", None, params, prompt_token_ids=[5, 6, 7])
        assert e.value.param == "top_p"
        assert not engine.has_unfinished_requests()
    finally:
        engine.shutdown()
