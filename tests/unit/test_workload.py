"""Workload specs: length and arrival generators (moments for fixed seeds), determinism,
trace replay, the shipped YAML files and every bad input."""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from sarathi_pp.bench.workload import (
    Arrivals,
    Choice,
    Fixed,
    Normal,
    PDRatio,
    Uniform,
    Workload,
    Zipf,
    load_workload,
    workload_from_dict,
)

WORKLOADS_DIR = Path(__file__).resolve().parents[2] / "configs" / "workloads"
N = 4000  # draws per moment check


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.fmean(values)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def workload(**kw) -> Workload:
    kw.setdefault("name", "w")
    kw.setdefault("num_requests", 8)
    kw.setdefault("prompt_tokens", Fixed(16))
    kw.setdefault("output_tokens", Fixed(4))
    return Workload(**kw)


# --- generators ------------------------------------------------------------------------------
def test_choice_frequencies_follow_weights():
    counts = Counter(Choice((128, 512, 1024), (1, 2, 1)).sample(random.Random(0), N))
    for value, expected in ((128, 0.25), (512, 0.5), (1024, 0.25)):
        assert counts[value] / N == pytest.approx(expected, abs=0.02)


def test_uniform_mean_and_bounds():
    draws = Uniform(10, 100).sample(random.Random(0), N)
    assert min(draws) == 10 and max(draws) == 100
    assert statistics.fmean(draws) == pytest.approx(55, rel=0.02)
    assert workload(prompt_tokens=Uniform(10, 100)).mean_prompt_tokens() == pytest.approx(55)


def test_normal_moments_unclamped():
    draws = Normal(mean=500, std=100).sample(random.Random(0), N)
    assert statistics.fmean(draws) == pytest.approx(500, rel=0.01)
    assert statistics.pstdev(draws) == pytest.approx(100, rel=0.05)
    assert workload(prompt_tokens=Normal(mean=500, std=100)).mean_prompt_tokens() == (
        pytest.approx(500, abs=1e-4)  # the clamp at 1 adds ~6e-6
    )


def test_normal_clamped_matches_its_exact_moments():
    dist = Normal(mean=100, std=60, low=50, high=200)
    draws = dist.sample(random.Random(0), N)
    assert min(draws) == 50 and max(draws) == 200  # both tails clamped
    mean = sum(v * p for v, p in dist.pmf())
    std = math.sqrt(sum((v - mean) ** 2 * p for v, p in dist.pmf()))
    assert mean > 100  # the clamp at 50 cuts more of the distribution than the one at 200
    assert statistics.fmean(draws) == pytest.approx(mean, rel=0.02)
    assert statistics.pstdev(draws) == pytest.approx(std, rel=0.05)
    assert sum(p for _, p in dist.pmf()) == pytest.approx(1.0)


def test_zipf_is_bounded_and_skewed():
    dist = Zipf(theta=1.2, low=16, high=2048)
    draws = dist.sample(random.Random(0), N)
    assert min(draws) >= 16 and max(draws) <= 2048
    counts = Counter(draws)
    assert counts.most_common(1)[0][0] == 16  # the first rank is the most common length
    assert counts[16] > counts[17] > counts[20]
    assert statistics.median(draws) < 32  # most mass near min, a long tail up to max
    exact = workload(prompt_tokens=dist).mean_prompt_tokens()
    assert statistics.fmean(draws) == pytest.approx(exact, rel=0.1)


def test_poisson_gaps_are_exponential():
    times = Arrivals("poisson", rate=2.0).sample(random.Random(0), N)
    assert times[0] == 0.0 and times == sorted(times)
    assert statistics.fmean(gaps(times)) == pytest.approx(0.5, rel=0.05)
    assert cv(gaps(times)) == pytest.approx(1.0, abs=0.07)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_cv_is_one_over_sqrt_burstiness(burstiness):
    times = Arrivals("gamma", rate=2.0, burstiness=burstiness).sample(random.Random(0), N)
    assert statistics.fmean(gaps(times)) == pytest.approx(0.5, rel=0.07)
    assert cv(gaps(times)) == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_all_at_once():
    reqs = workload(num_requests=5).requests(vocab_size=100)
    assert [r.arrival_s for r in reqs] == [0.0] * 5
    assert [r.request_id for r in reqs] == ["0", "1", "2", "3", "4"]


# --- means and the P:D rule ------------------------------------------------------------------
def test_mean_prompt_tokens_exact_for_choice():
    w = workload(prompt_tokens=Choice((128, 512, 1024)), output_tokens=Fixed(64))
    assert w.mean_prompt_tokens() == pytest.approx((128 + 512 + 1024) / 3, abs=1e-9)
    assert w.mean_output_tokens() == 64
    assert w.pd_ratio() == pytest.approx((128 + 512 + 1024) / 3 / 64)


def test_pd_ratio_rule():
    w = workload(num_requests=50, prompt_tokens=Uniform(1, 100), output_tokens=PDRatio(8))
    for r in w.requests(vocab_size=50):
        assert r.output_tokens == max(1, math.floor(len(r.prompt_token_ids) / 8 + 0.5))
    exact = sum(max(1, math.floor(p / 8 + 0.5)) for p in range(1, 101)) / 100
    assert w.mean_output_tokens() == pytest.approx(exact)
    assert w.pd_ratio() == pytest.approx(50.5 / exact)


def test_pd_ratio_from_yaml():
    w = workload_from_dict(
        {"num_requests": 4, "prompt_tokens": 100, "output_tokens": {"pd_ratio": 8}}
    )
    assert [r.output_tokens for r in w.requests(10)] == [13] * 4  # round(12.5) half up
    assert w.describe() == "workload: 4 requests, prompt 100, output prompt/8, all at t=0"


# --- determinism and streams -----------------------------------------------------------------
def test_requests_are_deterministic():
    w = workload(num_requests=20, prompt_tokens=Uniform(1, 64), arrivals=Arrivals("poisson", 3.0))
    a, b = w.requests(vocab_size=1000), w.requests(vocab_size=1000)
    assert a == b
    assert all(0 <= t < 1000 for r in a for t in r.prompt_token_ids)
    assert [len(r.prompt_token_ids) for r in a] != [16] * 20
    assert w.requests(1000) != replace(w, seed=1).requests(1000)


def test_omitted_weights_draw_like_equal_weights():
    equal = workload(num_requests=30, prompt_tokens=Choice((8, 16, 32), (1, 1, 1)))
    assert equal.requests(64) == replace(equal, prompt_tokens=Choice((8, 16, 32))).requests(64)


def test_prompts_do_not_depend_on_the_rate():
    w = workload(num_requests=10, prompt_tokens=Choice((8, 32)), output_tokens=Uniform(1, 9))
    slow, fast = w.with_rate(0.5).requests(256), w.with_rate(5.0).requests(256)
    assert [(r.prompt_token_ids, r.output_tokens) for r in slow] == [
        (r.prompt_token_ids, r.output_tokens) for r in fast
    ]
    assert [r.arrival_s for r in slow] != [r.arrival_s for r in fast]
    assert w.requests(256)[3].prompt_token_ids == slow[3].prompt_token_ids
    assert w.rate is None and w.with_rate(0.5).rate == 0.5


def test_with_rate_keeps_gamma_burstiness():
    w = workload(arrivals=Arrivals("gamma", rate=1.0, burstiness=0.5)).with_rate(3.0)
    assert w.arrivals == Arrivals("gamma", rate=3.0, burstiness=0.5)
    assert workload().with_rate(2.0).arrivals == Arrivals("poisson", rate=2.0)


def test_with_num_requests_takes_a_prefix():
    w = workload(num_requests=12, prompt_tokens=Uniform(1, 50), arrivals=Arrivals("poisson", 1.0))
    assert w.with_num_requests(5).requests(99) == w.requests(99)[:5]
    assert w.with_num_requests(5).num_requests == 5


# --- traces ----------------------------------------------------------------------------------
TRACE = """# a comment
arrival_s,prompt_tokens,output_tokens

0.0,10,3
0.25,20,1
# another comment
0.25,30,2
1.5,40,7
"""


def test_trace_replay_is_exact(tmp_path):
    write(tmp_path, "t.csv", TRACE)
    path = write(tmp_path, "t.yaml", "arrivals: {kind: trace, path: t.csv}\n")
    w = load_workload(path)
    reqs = w.requests(vocab_size=7)
    assert w.name == "t" and w.num_requests == 4
    assert [(r.arrival_s, len(r.prompt_token_ids), r.output_tokens) for r in reqs] == [
        (0.0, 10, 3),
        (0.25, 20, 1),
        (0.25, 30, 2),
        (1.5, 40, 7),
    ]
    assert w.mean_prompt_tokens() == 25 and w.mean_output_tokens() == pytest.approx(13 / 4)


def test_trace_num_requests_takes_the_first_lines(tmp_path):
    write(tmp_path, "t.csv", TRACE)
    path = write(tmp_path, "t.yaml", "num_requests: 2\narrivals: {kind: trace, path: t.csv}\n")
    w = load_workload(path)
    assert [len(r.prompt_token_ids) for r in w.requests(7)] == [10, 20]
    assert w.mean_prompt_tokens() == 15
    with pytest.raises(ValueError, match="trace of 2 requests, cannot make 3"):
        w.with_num_requests(3)


def test_trace_without_header(tmp_path):
    write(tmp_path, "t.csv", "0,5,5\n2.5,6,6\n")
    w = load_workload(write(tmp_path, "t.yaml", "arrivals: {kind: trace, path: t.csv}\n"))
    assert [r.arrival_s for r in w.requests(7)] == [0.0, 2.5]


@pytest.mark.parametrize(
    "text, line, message",
    [
        ("0,1,1\n1,2\n", 2, "expected 3 fields"),
        (
            "arrival_s,prompt_tokens,output_tokens\n0,1,1\n\n# c\nx,1,1\n",
            5,
            "arrival_s must be a number",
        ),
        ("0,1,1\n1,0,1\n", 2, "prompt_tokens must be an integer >= 1"),
        ("0,1,1\n1,1,-3\n", 2, "output_tokens must be an integer >= 1"),
        ("0,1.5,1\n", 1, "prompt_tokens must be an integer"),
        ("2,1,1\n1,1,1\n", 2, "non-decreasing"),
        ("-1,1,1\n", 1, ">= 0"),
        ("0,1,1\narrival_s,prompt_tokens,output_tokens\n", 2, "arrival_s must be a number"),
    ],
)
def test_malformed_trace_line_names_the_line(tmp_path, text, line, message):
    write(tmp_path, "bad.csv", text)
    path = write(tmp_path, "t.yaml", "arrivals: {kind: trace, path: bad.csv}\n")
    with pytest.raises(ValueError, match=rf"bad\.csv:{line}: .*{message}"):
        load_workload(path)


def test_trace_errors(tmp_path):
    write(tmp_path, "empty.csv", "# nothing\narrival_s,prompt_tokens,output_tokens\n")
    with pytest.raises(ValueError, match=r"empty\.csv: no requests"):
        load_workload(write(tmp_path, "e.yaml", "arrivals: {kind: trace, path: empty.csv}\n"))
    with pytest.raises(FileNotFoundError, match="missing.csv"):
        load_workload(write(tmp_path, "m.yaml", "arrivals: {kind: trace, path: missing.csv}\n"))
    write(tmp_path, "t.csv", TRACE)
    both = "prompt_tokens: 8\narrivals: {kind: trace, path: t.csv}\n"
    with pytest.raises(ValueError, match=r"b\.yaml: prompt_tokens: not allowed with trace"):
        load_workload(write(tmp_path, "b.yaml", both))
    too_many = "num_requests: 9\narrivals: {kind: trace, path: t.csv}\n"
    with pytest.raises(ValueError, match=r"n\.yaml: .*trace of 4 requests, cannot make 9"):
        load_workload(write(tmp_path, "n.yaml", too_many))


# --- shipped files ---------------------------------------------------------------------------
def test_every_shipped_workload_loads():
    paths = sorted(WORKLOADS_DIR.glob("*.yaml"))
    assert {"mixed.yaml", "mixed-poisson.yaml", "short.yaml", "trace-example.yaml"} <= {
        p.name for p in paths
    }
    for path in paths:
        w = load_workload(path)
        assert w.name == path.stem
        reqs = w.requests(vocab_size=256)
        assert len(reqs) == w.num_requests and w.describe().startswith(f"{w.name}: ")
        assert path.read_text().startswith("#")  # each file explains itself


def test_mixed_is_the_issues_workload():
    w = load_workload(WORKLOADS_DIR / "mixed.yaml")
    assert w.describe() == "mixed: 32 requests, prompt choice[128,512,1024], output 64, all at t=0"
    assert {len(r.prompt_token_ids) for r in w.requests(256)} == {128, 512, 1024}
    poisson = load_workload(WORKLOADS_DIR / "mixed-poisson.yaml")
    assert poisson.rate == 0.5 and poisson.prompt_tokens == w.prompt_tokens
    assert [r.prompt_token_ids for r in poisson.requests(256)] == [
        r.prompt_token_ids for r in w.requests(256)
    ]


# --- bad input -------------------------------------------------------------------------------
MIXED = {
    "num_requests": 4,
    "prompt_tokens": {"choice": [128, 512], "weights": [1, 1]},
    "output_tokens": 8,
}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"promt_tokens": 5}, r"unknown key\(s\) 'promt_tokens'.*allowed: name, num_requests"),
        ({"prompt_tokens": -5}, r"prompt_tokens: fixed length must be an integer >= 1, got -5"),
        ({"output_tokens": 0}, r"output_tokens: fixed length must be an integer >= 1, got 0"),
        ({"output_tokens": True}, r"output_tokens: expected an integer"),
        ({"prompt_tokens": {"fixed": 0}}, r"prompt_tokens: fixed length"),
        ({"prompt_tokens": {"choice": [128, -1]}}, r"prompt_tokens: choice value .* got -1"),
        (
            {"prompt_tokens": {"choice": [1, 2], "weights": [1]}},
            r"prompt_tokens: weights must have one entry per choice value \(2\)",
        ),
        ({"prompt_tokens": {"choice": [1, 2], "weights": [0, 0]}}, r"weights must not all be 0"),
        (
            {"prompt_tokens": {"uniform": [10, 5]}},
            r"prompt_tokens: uniform max must be an integer >= 10",
        ),
        ({"prompt_tokens": {"uniform": 10}}, r"uniform takes \[min, max\]"),
        ({"prompt_tokens": {"zipf": {"theta": 1.2}}}, r"prompt_tokens: zipf needs 'max'"),
        (
            {"prompt_tokens": {"zipf": {"theta": 0, "max": 9}}},
            r"zipf theta must be a finite number > 0",
        ),
        (
            {"prompt_tokens": {"zipf": {"alpha": 1, "max": 9}}},
            r"unknown key\(s\) 'alpha' in zipf; allowed: theta, min, max",
        ),
        (
            {"prompt_tokens": {"normal": {"mean": 5, "std": -1}}},
            r"normal std must be a finite number > 0",
        ),
        (
            {"prompt_tokens": {"normal": {"mean": 5, "std": 1, "min": 0}}},
            r"normal min must be an integer >= 1",
        ),
        ({"prompt_tokens": {"gauss": 5}}, r"prompt_tokens: expected exactly one of fixed, choice"),
        ({"prompt_tokens": {"fixed": 5, "uniform": [1, 2]}}, r"expected exactly one of"),
        ({"prompt_tokens": {"fixed": 5, "weights": [1]}}, r"unknown key\(s\) 'weights' in fixed"),
        (
            {"prompt_tokens": {"pd_ratio": 8}},
            r"prompt_tokens: pd_ratio applies to output_tokens only",
        ),
        (
            {"output_tokens": {"pd_ratio": 0}},
            r"output_tokens: pd_ratio must be a finite number > 0",
        ),
        ({"num_requests": 0}, r"num_requests must be an integer >= 1, got 0"),
        ({"num_requests": None}, r"num_requests must be an integer >= 1, got None"),
        ({"seed": -1}, r"seed must be an integer >= 0"),
        ({"name": ""}, r"name must be a non-empty string"),
        (
            {"arrivals": {"kind": "poisson", "rate": 0}},
            r"arrivals: rate must be .* > 0, got 0 \(for every request at t=0 use kind: all_at_once\)",
        ),
        ({"arrivals": {"kind": "poisson", "rate": -2}}, r"arrivals: rate .* got -2"),
        ({"arrivals": {"kind": "poisson", "rate": float("inf")}}, r"arrivals: rate .* got inf"),
        ({"arrivals": {"kind": "poisson"}}, r"arrivals: poisson arrivals needs 'rate'"),
        (
            {"arrivals": {"kind": "gamma", "rate": 1, "burstiness": 0}},
            r"arrivals: burstiness must be a finite number > 0",
        ),
        (
            {"arrivals": {"kind": "poisson", "rate": 1, "burstiness": 2}},
            r"unknown key\(s\) 'burstiness' in poisson arrivals; allowed: kind, rate",
        ),
        (
            {"arrivals": {"kind": "all_at_once", "rate": 1}},
            r"unknown key\(s\) 'rate' in all_at_once arrivals",
        ),
        (
            {"arrivals": {"kind": "burst"}},
            r"arrivals: kind must be one of all_at_once, poisson, gamma, trace, got 'burst'",
        ),
        ({"arrivals": {"kind": "trace"}}, r"arrivals: trace arrivals needs 'path'"),
        ({"arrivals": 5}, r"arrivals: expected a mapping"),
    ],
)
def test_bad_workload_names_file_and_key(tmp_path, change, message):
    path = write(tmp_path, "bad.yaml", yaml.safe_dump({**MIXED, **change}))
    with pytest.raises(ValueError, match=rf"bad\.yaml: .*{message}"):
        load_workload(path)


@pytest.mark.parametrize("key", ["num_requests", "prompt_tokens", "output_tokens"])
def test_missing_required_key(key):
    d = {k: v for k, v in MIXED.items() if k != key}
    with pytest.raises(ValueError, match=rf"<dict>: .*needs '{key}'"):
        workload_from_dict(d)


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_workload(tmp_path / "nope.yaml")
    with pytest.raises(ValueError, match=r"list\.yaml: a workload must be a mapping"):
        load_workload(write(tmp_path, "list.yaml", "- 1\n- 2\n"))
    with pytest.raises(ValueError, match=r"broken\.yaml: not valid YAML"):
        load_workload(write(tmp_path, "broken.yaml", "a: [1,\n"))


def test_bad_calls():
    w = workload(prompt_tokens=Choice((8, 100)), output_tokens=Fixed(30))
    for rate in (0, -1.0, math.nan):
        with pytest.raises(ValueError, match="rate must be"):
            w.with_rate(rate)
    with pytest.raises(ValueError, match="num_requests must be an integer >= 1"):
        w.with_num_requests(0)
    with pytest.raises(ValueError, match="vocab_size must be an integer >= 1"):
        w.requests(0)
    with pytest.raises(
        ValueError,
        match=r"workload 'w': request \d+: prompt 100 \+ output 30 = 130 tokens > max_model_len 64",
    ):
        w.requests(256, max_model_len=64)
    assert len(w.requests(256, max_model_len=130)) == 8


def test_shared_prefix_heads_every_prompt() -> None:
    base = {"num_requests": 6, "prompt_tokens": {"uniform": [3, 9]}, "output_tokens": 4}
    plain = workload_from_dict(base).requests(500)
    w = workload_from_dict({**base, "shared_prefix": {"tokens": 20, "groups": 2}})
    reqs = w.requests(500)
    heads = [r.prompt_token_ids[:20] for r in reqs]
    assert heads[0] == heads[2] == heads[4] != heads[1] == heads[3] == heads[5]
    # each request's own part is the plain workload's prompt (its own stream)
    assert [r.prompt_token_ids[20:] for r in reqs] == [r.prompt_token_ids for r in plain]
    assert w.mean_prompt_tokens() == 20 + 6 and "shared prefix of 20 tokens (one of 2)" in (
        w.describe()
    )
    with pytest.raises(ValueError, match="prompt 20 \\+ 9|> max_model_len 25"):
        w.requests(500, max_model_len=25)


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"tokens": 0}, "shared_prefix.tokens must be an integer >= 1"),
        ({"tokens": 8, "groups": 0}, "shared_prefix.groups must be an integer >= 1"),
        ({"groups": 2}, "needs 'tokens'"),
        ({"tokens": 8, "size": 2}, "unknown key"),
        (8, "expected a mapping"),
    ],
)
def test_bad_shared_prefix_is_named(spec, match) -> None:
    base = {"num_requests": 2, "prompt_tokens": 4, "output_tokens": 4, "shared_prefix": spec}
    with pytest.raises(ValueError, match=match):
        workload_from_dict(base, source="w.yaml")
