"""``SamplingParams(logprobs=k)`` and ``SamplingParams(n=k)`` through ``LLM.generate``.

Log-probabilities are checked against Hugging Face: one forward pass of the HF model over
the prompt and the tokens we generated gives, at each generated position, the raw
``log_softmax`` the engine must report (the sampled token's value and rank, the ``k`` most
likely tokens), for greedy and for seeded random sampling, every scheduler, chunked or not,
and through preemption. ``n`` runs ``n`` seeded children (``seed + j``).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import _hf_model
from test_vs_hf import make_prompts, preempting_run

from sarathi_pp import LLM, SamplingParams

KW = dict(max_model_len=256, dtype="float32")
TOL = 1e-4


def hf_logprobs(model_dir, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """HF's log-probabilities ``[len(generated), vocab]`` at each generated position."""
    model = _hf_model(str(model_dir))
    ids = torch.tensor([list(prompt) + list(generated)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)].log_softmax(-1)


def check_against_hf(model_dir, prompt: list[int], completion, k: int) -> None:
    ref = hf_logprobs(model_dir, prompt, completion.token_ids)
    assert completion.logprobs is not None
    assert len(completion.logprobs) == len(completion.token_ids)
    total = 0.0
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[step]
        keys = list(entry)
        assert keys[0] == token, f"step {step}: the sampled token comes first: {keys}"
        ours = entry[token]
        assert ours.logprob == pytest.approx(row[token].item(), abs=TOL), step
        assert (
            ours.rank == int((row > row[token] + TOL).sum()) + 1
            or abs(row.sort(descending=True).values[ours.rank - 1] - row[token]) < TOL
        ), (step, ours.rank)
        total += ours.logprob
        # The k most likely, in order, with HF's values (ties within TOL may swap).
        top = sorted(((e.rank, t, e.logprob) for t, e in entry.items() if e.rank <= k))
        assert [r for r, _, _ in top] == list(range(1, k + 1)), (step, top)
        hf_top = row.topk(k).values.tolist()
        for (rank, tid, value), hf_value in zip(top, hf_top):
            assert value == pytest.approx(hf_value, abs=TOL), (step, rank)
            assert value == pytest.approx(row[tid].item(), abs=TOL), (step, rank, tid)
        assert len(entry) in (k, k + 1)
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-9)


@pytest.mark.parametrize(
    ("scheduler", "chunk_size"), [("sarathi", 7), ("sarathi", 1000), ("vllm", 64), ("orca", 16)]
)
def test_greedy_logprobs_match_hf(llama_dir, scheduler, chunk_size):
    prompts = make_prompts(seed=5)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    with LLM(
        str(llama_dir), scheduler=scheduler, chunk_size=chunk_size, tile_align=False, **KW
    ) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        check_against_hf(llama_dir, prompt, c, 3)
        assert all(entry[t].rank == 1 for t, entry in zip(c.token_ids, c.logprobs))
    varied = {t for o in outs for t in o.outputs[0].token_ids}
    assert len(varied) > 8, varied  # a model repeating one token would prove little


def test_sampled_logprobs_are_the_raw_models(llama_dir):
    """With temperature, top-k and top-p the reported values are still the model's raw
    distribution (vLLM's default), and sampled tokens are not always the most likely."""
    prompts = make_prompts(seed=6)
    params = SamplingParams(
        max_tokens=10, temperature=1.3, top_k=50, top_p=0.9, seed=11, ignore_eos=True, logprobs=5
    )
    with LLM(str(llama_dir), **KW) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts, params, use_tqdm=False)
        plain = llm.generate(prompts, dataclasses.replace(params, logprobs=None), use_tqdm=False)
    ranks = []
    for prompt, out, rerun, p in zip(prompts, outs, again, plain):
        c = out.outputs[0]
        check_against_hf(llama_dir, prompt, c, 5)
        ranks += [entry[t].rank for t, entry in zip(c.token_ids, c.logprobs)]
        # seeded: the same again (the rerun reads its prompt's K/V from the prefix cache,
        # computed in other chunks: the values agree to float32's last bits)
        assert rerun.outputs[0].token_ids == c.token_ids
        for got, want in zip(rerun.outputs[0].logprobs, c.logprobs, strict=True):
            assert {t: e.rank for t, e in got.items()} == {t: e.rank for t, e in want.items()}
            assert [e.logprob for e in got.values()] == pytest.approx(
                [e.logprob for e in want.values()], abs=1e-5
            )
        # asking for log-probabilities does not change what is sampled
        assert p.outputs[0].token_ids == c.token_ids
        assert p.outputs[0].logprobs is None and p.outputs[0].cumulative_logprob is None
    assert max(ranks) > 1, ranks


def test_logprobs_zero_gives_the_sampled_token_alone_with_its_text(llama_dir):
    with LLM(str(llama_dir), **KW) as llm:
        (out,) = llm.generate(
            ["Hello there"],
            SamplingParams(max_tokens=5, temperature=0.0, logprobs=0),
            use_tqdm=False,
        )
        tokenizer = llm.get_tokenizer()
    c = out.outputs[0]
    assert [list(e) for e in c.logprobs] == [[t] for t in c.token_ids]
    for t, e in zip(c.token_ids, c.logprobs):
        assert e[t].decoded_token == tokenizer.decode([t])
        assert e[t].logprob <= 0 and math.isfinite(e[t].logprob)


def test_logprobs_survive_preemption(llama_dir):
    """Recomputed tokens are not sampled again: each token keeps the one entry it got."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts, outs = preempting_run(llama_dir, params)
    for prompt, out in zip(prompts, outs):
        check_against_hf(llama_dir, prompt, out.outputs[0], 2)


def test_n_completions_are_seeded_children(llama_dir):
    prompts = make_prompts(seed=7, lens=(5, 30))
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=21, ignore_eos=True)
    finished = []
    with LLM(str(llama_dir), **KW) as llm:
        outs = llm.generate(
            prompts, params, use_tqdm=False, on_finished=lambda i, o: finished.append(i)
        )
        alone = [
            llm.generate(prompts, dataclasses.replace(params, n=1, seed=21 + j), use_tqdm=False)
            for j in range(3)
        ]
        greedy = llm.generate(
            prompts[:1], SamplingParams(n=2, max_tokens=8, temperature=0.0), use_tqdm=False
        )
        assert not llm.engine.has_unfinished_requests()
    assert sorted(finished) == [0, 1]  # once per prompt, when all its completions are done
    for i, out in enumerate(outs):
        assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
        # completion j is the request with seed + j, alone
        assert [c.token_ids for c in out.outputs] == [a[i].outputs[0].token_ids for a in alone]
        assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # they differ
        # the request's metrics span its completions
        m = out.metrics
        assert len(m.token_times) == 3 * 8 and m.token_times == sorted(m.token_times)
        assert m.first_token_time == m.token_times[0] <= m.token_times[-1] <= m.finished_time
    assert greedy[0].outputs[0].token_ids == greedy[0].outputs[1].token_ids


def test_the_engine_takes_n_completions_as_one_parent_request(llama_dir):
    """``add_request`` with ``n=2`` (the front door, ``add_requests``): two child requests
    whose outputs ``step`` hands out merged under the parent's id, never a child's, one
    output a step; the parent's id and its children's are in use while it runs; aborting
    the parent ends every completion."""
    greedy = SamplingParams(n=2, max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(str(llama_dir), **KW) as llm:
        engine = llm.engine
        engine.add_request("x", None, greedy, prompt_token_ids=[1, 2, 3])
        with pytest.raises(ValueError, match="'x' is already in use"):
            engine.add_request("x", None, SamplingParams(), prompt_token_ids=[1])
        with pytest.raises(ValueError, match="'1_x' is already in use"):
            engine.add_request("1_x", None, SamplingParams(), prompt_token_ids=[1])
        seen = []
        while engine.has_unfinished_requests():
            outs = engine.step()
            assert len({o.request_id for o in outs}) == len(outs)  # one output a request
            seen += outs
        assert {o.request_id for o in seen} == {"x"}
        assert [o.finished for o in seen].count(True) == 1 and seen[-1].finished
        final = seen[-1]
        assert [c.index for c in final.outputs] == [0, 1]
        assert [len(c.token_ids) for c in final.outputs] == [4, 4]
        assert final.outputs[0].token_ids == final.outputs[1].token_ids  # greedy
        engine.add_request("x", None, SamplingParams(max_tokens=1), prompt_token_ids=[1])
        while engine.has_unfinished_requests():  # a finished parent's id is free again
            engine.step()

        long = SamplingParams(n=3, max_tokens=100, temperature=1.0, seed=1, ignore_eos=True)
        engine.add_request("y", None, long, prompt_token_ids=[1, 2, 3])
        engine.step()
        engine.abort("y")
        outs = engine.step()
        while engine.has_unfinished_requests():
            outs += engine.step()
        (last,) = [o for o in outs if o.finished]
        assert last.request_id == "y"
        assert [c.finish_reason for c in last.outputs] == ["abort"] * 3


def test_a_failing_request_leaves_the_others_logprobs_whole(llama_dir):
    """The one-stage executor retries a failed micro-batch one sequence at a time: the
    others keep one entry per token (a lost entry would pair the rest with wrong tokens)."""
    prompts = make_prompts(seed=4)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    with LLM(str(llama_dir), **KW) as llm:
        ref = llm.generate(prompts, params, use_tqdm=False)
    with LLM(str(llama_dir), **KW, **{"parallel.inject_fault": "raise@stage=0,seq=2"}) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[2].outputs[0].finish_reason == "error"
    for i in (0, 1, 3):
        c, r = outs[i].outputs[0], ref[i].outputs[0]
        assert c.token_ids == r.token_ids and len(c.logprobs) == len(c.token_ids)
        assert [list(e) for e in c.logprobs] == [list(e) for e in r.logprobs]
