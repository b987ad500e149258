"""The last stage's sampler on hand-made logits: what each filter lets through, and the
log-probabilities it reports."""

from __future__ import annotations

import math

import torch

from sarathi_pp.sampling_params import SamplingParams
from sarathi_pp.stages.worker.sampler import INVALID_TOKEN, logprobs, processed_logits, sample

# Probabilities 0.4, 0.3, 0.15, 0.1, 0.05 for tokens 0..4.
PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
LOGITS = PROBS.log().unsqueeze(0)


def draws(params: SamplingParams, num: int = 400) -> set[int]:
    rows = LOGITS.repeat(num, 1)
    return set(sample(rows, [params] * num, list(range(num))))


def test_min_p_drops_tokens_below_its_share_of_the_most_likely():
    # min_p=0.5: only tokens with p >= 0.5 * 0.4 = 0.2 (tokens 0, 1)
    assert draws(SamplingParams(temperature=1.0, min_p=0.5, seed=1)) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, min_p=0.3, seed=1)) == {0, 1, 2}
    assert draws(SamplingParams(temperature=1.0, seed=1)) == {0, 1, 2, 3, 4}
    # min_p=1: only the most likely
    assert draws(SamplingParams(temperature=1.0, min_p=1.0, seed=1)) == {0}


def test_min_p_applies_after_temperature():
    # temperature 0.5 squares the ratios: p ~ 0.16 : 0.09 : 0.0225 : ... so token 1 has
    # 0.5625 of the top token's probability and token 2 0.14: min_p=0.2 keeps tokens 0, 1.
    assert draws(SamplingParams(temperature=0.5, min_p=0.2, seed=2)) == {0, 1}


def test_logprobs_report_the_raw_distribution_with_ranks():
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.7, top_k=2, logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    logits = LOGITS.repeat(3, 1)
    tokens = [0, 1, 0]
    out = logprobs(logits, params, tokens)
    assert set(out) == {0, 1}  # the third did not ask
    assert out[0].rank == 1 and math.isclose(out[0].logprob, math.log(0.4), rel_tol=1e-5)
    assert out[0].top_ids == (0, 1)
    assert [round(math.exp(v), 5) for v in out[0].top_logprobs] == [0.4, 0.3]
    # raw: neither temperature nor top-k change the values
    assert out[1].rank == 2 and math.isclose(out[1].logprob, math.log(0.3), rel_tol=1e-5)
    assert out[1].top_ids == () and out[1].top_logprobs == ()
    # a failed row (non-finite logits) reports nothing
    assert logprobs(logits, params[:1], [INVALID_TOKEN]) == {}


def test_logit_bias_and_min_tokens():
    params = [
        SamplingParams(temperature=0.0, logit_bias={4: 100.0, 0: -100}),
        SamplingParams(temperature=0.0, min_tokens=3, max_tokens=5, stop_token_ids=[1]),
        SamplingParams(temperature=0.0, min_tokens=3, max_tokens=5),
        SamplingParams(temperature=0.0),
    ]
    logits = LOGITS.repeat(4, 1)
    out = processed_logits(logits, params, [0, 2, 3, 0], eos_token_ids=(0,))
    assert sample(out, params, [0] * 4) == [4, 2, 0, 0]
    # row 1: fewer than min_tokens outputs: EOS (0) and its stop token (1) ruled out
    assert out[1, 0] == out[1, 1] == torch.finfo(out.dtype).min
    assert torch.equal(out[2], logits[2]) and torch.equal(out[3], logits[3])  # 3 >= min_tokens
    assert torch.equal(logits, LOGITS.repeat(4, 1))  # the raw logits stay
    assert processed_logits(logits, params[3:], [0], (0,)) is logits  # nothing asked: no copy
    # the caller's own copy (penalized logits): changed in place, the same values as a copy
    own = logits.clone()
    assert processed_logits(own, params, [0, 2, 3, 0], (0,), in_place=True) is own
    assert torch.equal(own, out)
