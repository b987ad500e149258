"""SamplingParams: vLLM's defaults and shape; unsupported or bad values raise
``SamplingParamsError`` (a ``ValueError``) naming the field in its message and ``param``."""

from __future__ import annotations

import pytest

from sarathi_pp.sampling_params import SamplingParams, SamplingParamsError


def test_vllm_defaults():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, 0, 16)
    assert p.seed is None and p.stop == () and p.stop_token_ids == () and not p.is_greedy
    assert SamplingParams(temperature=0.0).is_greedy


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[2, 3], top_k=-1)
    assert p.stop == ("###",) and p.stop_token_ids == (2, 3) and p.top_k == 0
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_settable_as_vllms_and_checked_when_cloned():
    """vLLM's documented ``params.temperature = 0.5`` works; a bad value set later is
    refused, naming the field, when the params are used (``clone``: the engine's copy)."""
    p = SamplingParams(logit_bias=[(7, 1), (2, -1)])
    assert p.logit_bias == {2: -1.0, 7: 1.0}  # a dict, as vLLM's
    p.temperature = 0.5
    p.max_tokens = None
    p.stop = "x"
    q = p.clone()
    assert (q.temperature, q.max_tokens, q.stop) == (0.5, None, ("x",)) and q is not p
    q.logit_bias[3] = 1.0
    assert 3 not in p.logit_bias  # the copy shares no container
    p.top_p = 5.0
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 5.0") as e:
        p.clone()
    assert e.value.param == "top_p"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(max_tokens=0), "max_tokens.*0"),
        (dict(max_tokens=-3), "max_tokens.*-3"),
        (dict(max_tokens=2.5), "max_tokens.*2.5"),
        (dict(temperature=-0.1), "temperature.*-0.1"),
        (dict(top_p=0.0), r"top_p.*\(0, 1\].*0.0"),
        (dict(top_p=1.5), "top_p.*1.5"),
        (dict(top_k=-2), "top_k.*-2"),
        (dict(n=0), "n must be an integer >= 1, got 0"),
        (dict(logprobs=-1), r"logprobs must be None or an integer in \[0, 20\], got -1"),
        (dict(logprobs=21), "logprobs.*21"),
        (dict(use_beam_search=True), "beam search"),
        (dict(min_p=1.5), r"min_p must be in \[0, 1\], got 1.5"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_tokens=5, max_tokens=4), r"min_tokens must be in \[0, max_tokens=4\], got 5"),
        (dict(logit_bias={-1: 1.0}), "logit_bias must map token ids >= 0"),
        (dict(logit_bias={3: 101}), "biases in \\[-100, 100\\], got 3: 101.0"),
        (dict(logit_bias={3: "x"}), "logit_bias must be a real number, got 'x'"),
        (dict(logit_bias=[3]), "logit_bias must map token ids to numbers, got 3"),
        (dict(seed="x"), "seed.*'x'"),
        (dict(stop=[""]), "stop strings"),
        (dict(stop_token_ids=[-1]), "stop_token_ids.*-1"),
        (dict(stop=5), "stop must be a list, got 5"),
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (dict(temperature=float("nan")), "temperature must be finite"),
        (dict(ignore_eos="yes"), "ignore_eos must be True or False"),
    ],
)
def test_bad_values_raise_value_error_naming_them(kwargs, match):
    with pytest.raises(SamplingParamsError, match=match) as e:
        SamplingParams(**kwargs)
    assert isinstance(e.value, ValueError)
    # the field, for a CLI's flag or a server's ``param``: the first one given here
    expected = "use_beam_search" if "use_beam_search" in kwargs else next(iter(kwargs))
    assert e.value.param == expected


def test_boundary_values_are_accepted():
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=5, seed=0)
    SamplingParams(top_p=1e-6, logprobs=None, n=1)
    SamplingParams(n=5, logprobs=0)
    SamplingParams(logprobs=20)
    assert SamplingParams(logit_bias={5: 1, 2: -3.5}).logit_bias == {2: -3.5, 5: 1.0}
    assert SamplingParams(logit_bias={5: 1}) == SamplingParams(logit_bias=[(5, 1.0)])


def test_tiny_temperature_is_greedy_not_an_overflow():
    assert SamplingParams(temperature=1e-7).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy


def test_the_error_survives_a_pickle():
    import pickle

    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(top_p=2.0)
    again = pickle.loads(pickle.dumps(e.value))
    assert type(again) is SamplingParamsError and again.param == "top_p"
    assert str(again) == str(e.value) == "top_p must be in (0, 1], got 2.0"
