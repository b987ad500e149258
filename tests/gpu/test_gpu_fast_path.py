"""The GPU fast path (issue 55) on a GPU; skipped without one: no host wait inside a step
but the sampled tokens' copy (torch's sync debug mode), the decode graphs' tokens equal
the eager run's, CUDA-event compute spans on PP=1, and the profiling forward's M_A."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from sarathi_pp import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 17, 60, 9, 33)]


def generate(model_dir, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(
        str(model_dir), device="cuda", dtype="float32", chunk_size=64, max_model_len=256, **kw
    )
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_a_step_waits_for_the_device_only_for_the_sampled_tokens(llama_dir):
    _, llm = generate(llama_dir)  # warm-up: kernels compiled, buffers grown
    with llm:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                llm.generate(prompts(), GREEDY, use_tqdm=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where = {(w.filename.rsplit("/", 1)[-1], w.lineno) for w in caught
             if "synchroniz" in str(w.message)}  # fmt: skip
    assert where and all(f == "sampler.py" for f, _ in where), sorted(where)


def test_decode_graphs_give_the_eager_tokens(llama_dir):
    eager, llm = generate(llama_dir)
    llm.shutdown()
    graphs, llm = generate(llama_dir, **{"model.enforce_eager": False})
    with llm:
        g = llm.engine.executor.runner.graphs
        assert g is not None and g.static and not g.failed, g and g.failed
        assert g.replays > 0
    assert graphs == eager


def test_pp1_compute_spans_come_from_cuda_events(llama_dir):
    _, llm = generate(llama_dir)
    with llm:
        clock = llm.engine.executor.runner.clock
        assert clock.name == "cuda_events"
        assert clock.gpu_spans > 0 and clock.host_spans == 0  # PP=1: the token copy waited


def test_profiling_forward_measures_activations(llama_dir):
    with LLM(str(llama_dir), device="cuda", max_model_len=256,
             **{"cache.activation_memory": "profile"}) as llm:  # fmt: skip
        measured = llm.engine.stage_memory[0].activation_bytes
        tokens = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert measured > 0 and len(tokens) == len(prompts())
