"""SamplingParams' types: numpy integers accepted as plain ints; bools, floats where an
integer is expected, and NaN/inf refused naming the field and the value."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sarathi_pp.sampling_params import SamplingParams


def test_numpy_integers_are_accepted_and_stored_as_int():
    p = SamplingParams(
        max_tokens=np.int64(7), top_k=np.int32(5), seed=np.uint16(3), n=np.int8(1),
        stop_token_ids=[np.int64(2), 4], temperature=np.float32(0.5), top_p=np.float64(0.9),
    )  # fmt: skip
    assert (p.max_tokens, p.top_k, p.seed, p.n, p.stop_token_ids) == (7, 5, 3, 1, (2, 4))
    for v in (p.max_tokens, p.top_k, p.seed, p.n, *p.stop_token_ids):
        assert type(v) is int
    assert type(p.temperature) is float and type(p.top_p) is float
    assert SamplingParams(top_k=np.int64(-1)).top_k == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(temperature=math.nan), "temperature must be finite, got nan"),
        (dict(temperature=math.inf), "temperature must be finite, got inf"),
        (dict(temperature=np.float64("nan")), "temperature must be finite"),
        (dict(top_p=math.nan), "top_p must be finite, got nan"),
        (dict(top_p=-math.inf), "top_p must be finite, got -inf"),
        (dict(temperature="0.5"), r"temperature must be a real number, got '0.5' \(str\)"),
        (dict(temperature=True), r"temperature must be a real number, got True \(bool\)"),
        (dict(max_tokens=True), r"max_tokens must be an integer or None, got True \(bool\)"),
        (dict(max_tokens=3.0), r"max_tokens must be an integer or None, got 3.0 \(float\)"),
        (dict(max_tokens=np.float64(3.0)), r"max_tokens must be an integer or None, got .*3.0"),
        (dict(top_k=False), r"top_k must be an integer, got False"),
        (dict(seed=True), r"seed must be an integer or None, got True"),
        (dict(seed=1.5), r"seed must be an integer or None, got 1.5"),
        (dict(n=True), r"n must be an integer, got True"),
        (dict(logprobs=True), r"logprobs must be an integer or None, got True"),
        (dict(stop_token_ids=[2, True]), r"stop_token_ids must be non-negative integers, got True"),
        (dict(stop_token_ids=[2.0]), r"stop_token_ids must be non-negative integers, got 2.0"),
        (dict(stop_token_ids=7), r"stop_token_ids must be a list, got 7"),
        (dict(stop=5), r"stop must be a list, got 5"),
        (dict(ignore_eos="false"), r"ignore_eos must be True or False, got 'false'"),
    ],
)
def test_bad_types_are_refused_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
