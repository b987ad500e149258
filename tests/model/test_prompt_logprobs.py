"""``SamplingParams(prompt_logprobs=k)`` through ``LLM.generate``, checked against Hugging Face.

One HF forward pass over the prompt gives, at each position ``i >= 1``, the raw
``log_softmax`` of row ``i - 1``: the value and rank the engine must report for prompt token
``i``, and its ``k`` most likely tokens. Chunked prefills split the prompt over several
micro-batches (row ``r`` of a chunk predicts the token after it, the next chunk's first for
its last row), so every chunk size and scheduler is checked, and preemption (a prompt
recomputed: its positions are not taken twice).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import _hf_model
from test_vs_hf import make_prompts, preempting_run

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.sampling_params import SamplingParamsError

KW = dict(max_model_len=256, dtype="float32")
TOL = 1e-4


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt) - 1, vocab]``: row ``i`` is HF's log-probabilities of position ``i + 1``."""
    model = _hf_model(str(model_dir))
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt)])).logits[0].float()
    return logits[:-1].log_softmax(-1)


def check_prompt_logprobs(model_dir, prompt: list[int], out, k: int) -> None:
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt)
    assert plp[0] is None  # nothing precedes the first token
    ref = hf_prompt_logprobs(model_dir, prompt)
    for pos in range(1, len(prompt)):
        entry, row, token = plp[pos], ref[pos - 1], prompt[pos]
        assert next(iter(entry)) == token, f"position {pos}: the prompt token comes first"
        ours = entry[token]
        assert ours.logprob == pytest.approx(row[token].item(), abs=TOL), pos
        hf_rank = int((row > row[token]).sum()) + 1
        assert abs(ours.rank - hf_rank) <= int((abs(row - row[token]) < TOL).sum()), (
            pos,
            ours.rank,
        )
        top = sorted((e.rank, t, e.logprob) for t, e in entry.items() if e.rank <= k)
        if ours.rank > k:
            assert len(entry) == k + 1
        assert [r for r, _, _ in top] == list(range(1, k + 1)), (pos, top)
        for (_, tid, value), hf_value in zip(top, row.topk(k).values.tolist()):
            assert value == pytest.approx(hf_value, abs=TOL), pos
            assert value == pytest.approx(row[tid].item(), abs=TOL), (pos, tid)


@pytest.mark.parametrize(
    ("scheduler", "chunk_size"),
    [("sarathi", 1), ("sarathi", 7), ("sarathi", 1000), ("vllm", 64), ("orca", 16),
     ("simple_chunking", 5)],
)  # fmt: skip
def test_prompt_logprobs_match_hf(llama_dir, scheduler, chunk_size):
    prompts = make_prompts(seed=8)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    with LLM(
        str(llama_dir), scheduler=scheduler, chunk_size=chunk_size, tile_align=False, **KW
    ) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        plain = llm.generate(
            prompts, dataclasses.replace(params, prompt_logprobs=None), use_tqdm=False
        )
    ranks = []
    for prompt, out, p in zip(prompts, outs, plain):
        check_prompt_logprobs(llama_dir, prompt, out, 3)
        ranks += [e[t].rank for t, e in zip(prompt[1:], out.prompt_logprobs[1:])]
        # asking for them changes nothing else
        assert out.outputs[0].token_ids == p.outputs[0].token_ids
        assert p.prompt_logprobs is None and out.outputs[0].logprobs is None
    assert max(ranks) > 3  # random prompts: the prompt token is often not among the top 3


def test_prompt_logprobs_zero_and_one_token_prompts(llama_dir):
    with LLM(str(llama_dir), **KW) as llm:
        tokenizer = llm.get_tokenizer()
        outs = llm.generate(
            [[42], "Hello there"],
            SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0, logprobs=0),
            use_tqdm=False,
        )
    assert outs[0].prompt_logprobs == [None]
    plp, ids = outs[1].prompt_logprobs, outs[1].prompt_token_ids
    assert len(plp) == len(ids) > 2
    for t, e in zip(ids[1:], plp[1:]):  # the prompt token alone, with its text
        assert list(e) == [t] and e[t].decoded_token == tokenizer.decode([t])
        assert e[t].logprob <= 0 and math.isfinite(e[t].logprob)
    # the sampled tokens' entries are the generated ones, not the prompt's
    assert len(outs[1].outputs[0].logprobs) == len(outs[1].outputs[0].token_ids) == 2


def test_prompt_logprobs_survive_preemption(llama_dir):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    prompts, outs = preempting_run(llama_dir, params)
    for prompt, out in zip(prompts, outs):
        check_prompt_logprobs(llama_dir, prompt, out, 2)


def test_n_completions_share_the_prompts_logprobs(llama_dir):
    prompts = make_prompts(seed=9, lens=(12,))
    params = SamplingParams(n=2, max_tokens=3, seed=1, prompt_logprobs=1)
    with LLM(str(llama_dir), **KW) as llm:
        (out,) = llm.generate(prompts, params, use_tqdm=False)
    assert len(out.outputs) == 2
    check_prompt_logprobs(llama_dir, prompts[0], out, 1)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_name_the_field(value):
    with pytest.raises(SamplingParamsError, match="prompt_logprobs") as e:
        SamplingParams(prompt_logprobs=value)
    assert e.value.param == "prompt_logprobs"
