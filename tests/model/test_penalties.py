"""Presence, frequency and repetition penalties (``stages/worker/penalties.py``).

The repetition penalty is Hugging Face's: greedy tokens with ``repetition_penalty`` equal
HF's ``generate(repetition_penalty=...)`` for every scheduler and chunk size, through
preemption (the recompute brings the sequence's tokens to the last stage again).
Presence and frequency penalties (vLLM's and OpenAI's; HF has none) are checked on
hand-made logits against their definition, and end to end against a reference sampler
that applies them to HF's logits step by step.
"""

from __future__ import annotations

import pytest
import torch
from helpers import _hf_model, assert_greedy_match, hf_processed_greedy, record_submits
from test_vs_hf import make_prompts, preempting_run

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.microbatch import MicroBatch, ScheduledChunk
from sarathi_pp.stages.worker.penalties import PenaltyState, apply_penalties

KW = dict(max_model_len=256, dtype="float32")
MAX_TOKENS = 12


def hf_penalized_greedy(model_dir, prompt, max_new_tokens, presence=0.0, frequency=0.0, rep=1.0):
    """Greedy decoding over HF's logits with the penalties applied by hand (HF's own
    ``repetition_penalty`` processor checked to agree); the tokens and each step's top-2
    margin."""

    def penalize(logits, tokens, out):
        if rep != 1.0:
            seen = torch.tensor(sorted(set(tokens)))
            x = logits[seen]
            logits[seen] = torch.where(x > 0, x / rep, x * rep)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=len(logits))
        return logits - frequency * counts - presence * (counts > 0).float()

    return hf_processed_greedy(model_dir, prompt, max_new_tokens, penalize)


def test_the_reference_agrees_with_hf_generate(llama_dir):
    prompt = make_prompts(seed=9)[1]
    model = _hf_model(str(llama_dir))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        hf = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
            repetition_penalty=1.7, eos_token_id=None, pad_token_id=model.config.pad_token_id,
        )[0, len(prompt):].tolist()  # fmt: skip
    ours, _ = hf_penalized_greedy(llama_dir, prompt, MAX_TOKENS, rep=1.7)
    assert ours == hf


@pytest.mark.parametrize(
    ("scheduler", "chunk_size"), [("sarathi", 7), ("sarathi", 1000), ("vllm", 64), ("orca", 16)]
)
def test_repetition_penalty_matches_hf(llama_dir, scheduler, chunk_size):
    prompts = make_prompts(seed=9)
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, repetition_penalty=1.7
    )
    with LLM(
        str(llama_dir), scheduler=scheduler, chunk_size=chunk_size, tile_align=False, **KW
    ) as llm:
        chunks = record_submits(llm.engine, lambda mb: mb.chunks)
        outs = llm.generate(prompts, params, use_tqdm=False)
        plain = llm.generate(
            prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )  # fmt: skip
        assert llm.engine.executor.runner.penalties.tokens == {}  # all released
    for prompt, out in zip(prompts, outs):
        ref, margins = hf_penalized_greedy(llama_dir, prompt, MAX_TOKENS, rep=1.7)
        assert_greedy_match(out.outputs[0].token_ids, ref, margins)
    # each prompt's sampling chunk brought the tokens before it, exactly
    last = [
        c for mb in chunks for c in mb
        if c.is_prefill and c.do_sample and c.sampling_params.has_penalties
    ]  # fmt: skip
    chunked = scheduler == "sarathi" and chunk_size < 150  # vllm and orca run whole prompts
    assert len(last) == len(prompts) and any(c.history for c in last) == chunked
    for c, prompt in zip(sorted(last, key=lambda c: c.seq_id), prompts):
        assert [*c.history, *c.token_ids] == prompt
    # the penalty changes what is generated
    assert [o.outputs[0].token_ids for o in outs] != [o.outputs[0].token_ids for o in plain]


def test_presence_and_frequency_penalties_match_the_reference(llama_dir):
    prompts = make_prompts(seed=10, lens=(4, 30))
    kinds = [dict(presence=1.5), dict(frequency=0.8), dict(presence=-0.5, frequency=1.0, rep=1.2)]
    with LLM(str(llama_dir), chunk_size=16, tile_align=False, **KW) as llm:
        for kind in kinds:
            params = SamplingParams(
                max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                presence_penalty=kind.get("presence", 0.0),
                frequency_penalty=kind.get("frequency", 0.0),
                repetition_penalty=kind.get("rep", 1.0),
            )  # fmt: skip
            outs = llm.generate(prompts, params, use_tqdm=False)
            for prompt, out in zip(prompts, outs):
                ref, margins = hf_penalized_greedy(llama_dir, prompt, MAX_TOKENS, **kind)
                assert_greedy_match(out.outputs[0].token_ids, ref, margins)


def test_penalties_with_logit_bias_report_the_raw_logprobs(llama_dir):
    """A penalized row's logits are a copy that ``logit_bias`` then changes in place: the
    reported log-probabilities stay the raw model's (the same as with the bias alone, where
    the bias works on a copy of its own)."""
    prompts = make_prompts(seed=11, lens=(4, 20))
    common = dict(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1, logit_bias={5: 100})
    with LLM(str(llama_dir), chunk_size=16, tile_align=False, **KW) as llm:
        both = llm.generate(
            prompts, SamplingParams(repetition_penalty=1.7, frequency_penalty=0.5, **common),
            use_tqdm=False,
        )  # fmt: skip
        bias = llm.generate(prompts, SamplingParams(**common), use_tqdm=False)
    for a, b in zip(both, bias):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == [5] * 6
        raw = [pos[5].logprob for pos in b.outputs[0].logprobs]
        assert [pos[5].logprob for pos in a.outputs[0].logprobs] == pytest.approx(raw, abs=1e-6)
        assert all(v < -1e-3 for v in raw)  # the model's own, not the biased logit's ~0


def test_penalties_survive_preemption(llama_dir):
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, frequency_penalty=1.0,
        repetition_penalty=1.3,
    )  # fmt: skip
    prompts, outs = preempting_run(llama_dir, params)
    for prompt, out in zip(prompts, outs):
        ref, margins = hf_penalized_greedy(llama_dir, prompt, MAX_TOKENS, frequency=1.0, rep=1.3)
        assert_greedy_match(out.outputs[0].token_ids, ref, margins)


def _chunk(seq_id, start, tokens, is_prefill, num_out, history=(), **penalties):
    params = SamplingParams(temperature=0.0, **penalties)
    return ScheduledChunk(
        seq_id, start, tuple(tokens), is_prefill, (0,), params, num_out, history=tuple(history)
    )


def test_penalties_on_hand_made_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]] * 2)
    # prompt [0, 1], outputs [3, 3, 2] (5 tokens; the last 3 are output)
    chunk = _chunk(7, 4, [2], False, 3, presence_penalty=0.5, frequency_penalty=0.25)
    rep = _chunk(8, 4, [2], False, 3, repetition_penalty=2.0)
    history = [0, 1, 3, 3, 2]
    out = apply_penalties(logits, [0, 1], [history, history], [chunk, rep])
    # counts: token 3 twice, token 2 once
    assert out[0].tolist() == [2.0, -1.0, 0.5 - 0.25 - 0.5, 3.0 - 0.5 - 0.5, 0.0]
    # every token of prompt and output: positive halved, negative doubled; token 4 untouched
    assert out[1].tolist() == [1.0, -2.0, 0.25, 1.5, 0.0]
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 3.0, 0.0]  # the raw logits stay


def test_penalty_state_follows_the_sequence_and_forgets_it():
    state = PenaltyState()
    last = _chunk(1, 3, [12, 13], True, 0, history=[10, 11, 9], presence_penalty=1.0)
    assert state.before_sampling(last) == [10, 11, 9, 12, 13]
    state.sampled(last, 20)
    decode = _chunk(1, 5, [20], False, 1, presence_penalty=1.0)
    assert state.before_sampling(decode) == [10, 11, 9, 12, 13, 20]
    state.sampled(decode, 21)
    state.before_sampling(decode)  # the same micro-batch again (a retry): as after one run
    state.sampled(decode, 22)
    assert state.tokens[1] == [10, 11, 9, 12, 13, 20, 22]
    with pytest.raises(ValueError, match="knows 0 of its tokens"):
        state.before_sampling(_chunk(2, 5, [1], False, 1, presence_penalty=1.0))
    state.release(MicroBatch(9, (), released=(1,)))
    assert state.tokens == {}
