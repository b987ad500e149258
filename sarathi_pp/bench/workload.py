"""Workload specs for the serving benchmark: how many requests, their prompt and output
lengths, when they arrive; YAML at the edge (``configs/workloads/*.yaml``), frozen values
inside. Pure Python (``random.Random``), no torch.

A workload file, every key but ``num_requests`` and the two lengths optional::

    name: mixed              # default: the file's stem
    num_requests: 32
    seed: 0                  # one seed; each quantity draws from its own stream (Note [streams])
    prompt_tokens: {choice: [128, 512, 1024], weights: [1, 1, 1]}
    output_tokens: 64
    arrivals: {kind: all_at_once}

Lengths (tokens, integers >= 1), for ``prompt_tokens`` and ``output_tokens``:

* ``512`` or ``{fixed: 512}``: every request;
* ``{choice: [128, 512, 1024], weights: [1, 2, 1]}``: one value per request, with
  probability proportional to its weight (``weights`` optional: equal);
* ``{uniform: [lo, hi]}``: integers in ``[lo, hi]``, both ends included;
* ``{zipf: {theta: 1.2, min: 16, max: 2048}}``: a bounded Zipf as in Vidur's
  ``ZipfGenerator`` (unscrambled): length ``min + r - 1`` has weight ``r ** -theta`` for
  rank ``r = 1 .. max - min + 1``, so ``min`` is the most common length; ``min`` default 1;
* ``{normal: {mean: 512, std: 128, min: 16, max: 2048}}``: a Gaussian draw rounded to the
  nearest integer, then clamped to ``[min, max]`` (``min`` default 1, ``max`` default none);
* output only, ``{pd_ratio: 8}``: each request's output = ``max(1, round(prompt / 8))``
  (half up), for a target prefill : decode token ratio.

Arrivals (seconds after the benchmark starts):

* ``{kind: all_at_once}`` (the default; also just ``all_at_once``): every request at t=0;
* ``{kind: poisson, rate: 2.0}``: exponential inter-arrival times, ``rate`` requests/s;
* ``{kind: gamma, rate: 2.0, burstiness: 0.5}``: vLLM ``benchmark_serving``'s definition,
  inter-arrival ~ Gamma(shape=burstiness, scale=1 / (rate x burstiness)): mean 1 / rate,
  coefficient of variation 1 / sqrt(burstiness); burstiness 1 (the default) is Poisson,
  lower is burstier. As in vLLM, the first request arrives at t=0, each gap after it;
* ``{kind: trace, path: trace.csv}``: replay a CSV (path relative to the YAML file) of
  ``arrival_s,prompt_tokens,output_tokens`` lines; an optional header line with exactly
  those names, blank lines and ``#`` comment lines are skipped. The trace gives arrivals
  and lengths exactly, so ``prompt_tokens``/``output_tokens`` are not allowed beside it;
  ``num_requests`` (default: every line) takes the first n. Arrivals must be >= 0 and
  non-decreasing; a malformed line is an error naming ``file:line``.

Prompts are random token ids, uniform in ``[0, vocab_size)``, of the requested lengths;
each request runs with ``ignore_eos`` and ``max_tokens = output_tokens``, so outputs have
the requested length. Unknown keys (the error lists the allowed ones), lengths < 1, rates
or burstiness <= 0, weights of the wrong count: ``ValueError`` naming the file and key.

Note [streams]: prompt lengths, output lengths, arrival gaps and token ids each draw from
their own ``random.Random`` seeded from (``seed``, stream name), one request after another.
So changing the rate changes no prompt (the capacity search relies on it), and
``with_num_requests(k)`` gives the first k requests of the larger workload.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

ARRIVAL_KINDS = ("all_at_once", "poisson", "gamma", "trace")
TRACE_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")
TOP_KEYS = ("name", "num_requests", "seed", "prompt_tokens", "output_tokens", "arrivals")
LENGTH_KINDS = ("fixed", "choice", "uniform", "zipf", "normal")
ARRIVAL_KEYS = {
    "all_at_once": ("kind",),
    "poisson": ("kind", "rate"),
    "gamma": ("kind", "rate", "burstiness"),
    "trace": ("kind", "path"),
}
NORMAL_TAIL_STDS = 12  # mass beyond 12 std (< 1e-32) is left out of the exact means


# --- checks ----------------------------------------------------------------------------------
def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_positive(name: str, value: Any) -> None:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


# --- lengths ---------------------------------------------------------------------------------
# Each length distribution draws ``sample(rng, n)``, gives its exact distribution as
# ``pmf()`` ((length, probability) pairs: the means are sums over it) and ``describe()``.
@dataclass(frozen=True, slots=True)
class Fixed:
    """Every request gets ``value`` tokens."""

    value: int

    def __post_init__(self) -> None:
        _check_int("fixed length", self.value, 1)

    def sample(self, rng: random.Random, n: int) -> list[int]:
        return [self.value] * n

    def pmf(self) -> tuple[tuple[int, float], ...]:
        return ((self.value, 1.0),)

    def describe(self) -> str:
        return str(self.value)


@dataclass(frozen=True, slots=True)
class Choice:
    """One of ``values`` per request, probability proportional to ``weights`` (None: equal)."""

    values: tuple[int, ...]
    weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(self.values))  # a YAML list -> hashable
        if not self.values:
            raise ValueError("choice needs at least one value")
        for v in self.values:
            _check_int("choice value", v, 1)
        if self.weights is None:
            return
        object.__setattr__(self, "weights", tuple(self.weights))
        if len(self.weights) != len(self.values):
            raise ValueError(
                f"weights must have one entry per choice value ({len(self.values)}), "
                f"got {len(self.weights)}: {list(self.weights)}"
            )
        for w in self.weights:
            if not _is_number(w) or not math.isfinite(w) or w < 0:
                raise ValueError(f"weights must be finite numbers >= 0, got {w!r}")
        if sum(self.weights) <= 0:
            raise ValueError(f"weights must not all be 0, got {list(self.weights)}")

    def _weights(self) -> tuple[float, ...]:
        return self.weights or (1.0,) * len(self.values)

    def sample(self, rng: random.Random, n: int) -> list[int]:
        # always weighted: ``choices`` draws differently without weights, and omitting
        # ``weights: [1, 1, 1]`` should not change the prompts
        return rng.choices(self.values, self._weights(), k=n)

    def pmf(self) -> tuple[tuple[int, float], ...]:
        total = sum(self._weights())
        return tuple((v, w / total) for v, w in zip(self.values, self._weights()))

    def describe(self) -> str:
        text = f"choice[{','.join(map(str, self.values))}]"
        if self.weights is not None and len(set(self.weights)) > 1:
            text += f" weights[{','.join(f'{w:g}' for w in self.weights)}]"
        return text


@dataclass(frozen=True, slots=True)
class Uniform:
    """Integers in ``[low, high]``, both ends included."""

    low: int
    high: int

    def __post_init__(self) -> None:
        _check_int("uniform min", self.low, 1)
        _check_int("uniform max", self.high, self.low)

    def sample(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randint(self.low, self.high) for _ in range(n)]

    def pmf(self) -> tuple[tuple[int, float], ...]:
        p = 1.0 / (self.high - self.low + 1)
        return tuple((v, p) for v in range(self.low, self.high + 1))

    def describe(self) -> str:
        return f"uniform[{self.low},{self.high}]"


@functools.lru_cache(maxsize=16)
def _zipf_cum_weights(theta: float, num_ranks: int) -> tuple[float, ...]:
    return tuple(itertools.accumulate(r**-theta for r in range(1, num_ranks + 1)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Zipf:
    """Bounded Zipf (Vidur's ``ZipfGenerator``, unscrambled): length ``low + r - 1`` has
    weight ``r ** -theta``, ``r = 1 .. high - low + 1``."""

    theta: float
    low: int = 1
    high: int

    def __post_init__(self) -> None:
        _check_positive("zipf theta", self.theta)
        _check_int("zipf min", self.low, 1)
        _check_int("zipf max", self.high, self.low)

    def _cum_weights(self) -> tuple[float, ...]:
        return _zipf_cum_weights(float(self.theta), self.high - self.low + 1)

    def sample(self, rng: random.Random, n: int) -> list[int]:
        lengths = range(self.low, self.high + 1)
        return rng.choices(lengths, cum_weights=self._cum_weights(), k=n)

    def pmf(self) -> tuple[tuple[int, float], ...]:
        total = self._cum_weights()[-1]
        return tuple(
            (self.low + r - 1, r**-self.theta / total) for r in range(1, self.high - self.low + 2)
        )

    def describe(self) -> str:
        return f"zipf(theta={self.theta:g})[{self.low},{self.high}]"


def _std_normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Normal:
    """A Gaussian draw rounded to the nearest integer, then clamped to ``[low, high]``."""

    mean: float
    std: float
    low: int = 1
    high: int | None = None  # None: no upper clamp

    def __post_init__(self) -> None:
        if not _is_number(self.mean) or not math.isfinite(self.mean):
            raise ValueError(f"normal mean must be a finite number, got {self.mean!r}")
        _check_positive("normal std", self.std)
        _check_int("normal min", self.low, 1)
        if self.high is not None:
            _check_int("normal max", self.high, self.low)

    def sample(self, rng: random.Random, n: int) -> list[int]:
        draws = (_round_half_up(rng.normalvariate(self.mean, self.std)) for _ in range(n))
        hi = math.inf if self.high is None else self.high
        return [int(min(max(d, self.low), hi)) for d in draws]

    def pmf(self) -> tuple[tuple[int, float], ...]:
        """P(length = k): the ends absorb the clamped tails; interior k gets the mass of
        ``[k - 0.5, k + 0.5)``, enumerated over mean +- NORMAL_TAIL_STDS std only."""

        def cdf(x: float) -> float:
            return _std_normal_cdf((x - self.mean) / self.std)

        hi = self.high if self.high is not None else math.inf
        if hi == self.low:
            return ((self.low, 1.0),)
        first = max(self.low + 1, math.floor(self.mean - NORMAL_TAIL_STDS * self.std))
        last = min(hi - 1, math.ceil(self.mean + NORMAL_TAIL_STDS * self.std))
        out = [(self.low, cdf(self.low + 0.5))]
        out += [(k, cdf(k + 0.5) - cdf(k - 0.5)) for k in range(first, int(last) + 1)]
        if self.high is not None:
            out.append((self.high, 1.0 - cdf(self.high - 0.5)))
        return tuple(out)

    def describe(self) -> str:
        bounds = f"[{self.low},{'' if self.high is None else self.high}]"
        return f"normal({self.mean:g}+-{self.std:g}){bounds}"


@dataclass(frozen=True, slots=True)
class TraceLengths:
    """The lengths a trace gives, request by request (one per request of the workload)."""

    values: tuple[int, ...]
    source: str = "trace"

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(self.values))
        if not self.values:
            raise ValueError(f"{self.source}: a trace needs at least one request")
        for v in self.values:
            _check_int(f"{self.source}: trace length", v, 1)

    def sample(self, rng: random.Random, n: int) -> list[int]:
        return list(self.values[:n])

    def pmf(self) -> tuple[tuple[int, float], ...]:
        counts = Counter(self.values)
        return tuple((v, c / len(self.values)) for v, c in counts.items())

    def describe(self) -> str:
        mean = sum(self.values) / len(self.values)
        return f"from {Path(self.source).name} (mean {mean:.0f})"


@dataclass(frozen=True, slots=True)
class PDRatio:
    """Output lengths from the prompt's: ``max(1, round(prompt / ratio))``, rounded half up."""

    ratio: float

    def __post_init__(self) -> None:
        _check_positive("pd_ratio", self.ratio)

    def output_for(self, prompt_tokens: int) -> int:
        return max(1, _round_half_up(prompt_tokens / self.ratio))

    def describe(self) -> str:
        return f"prompt/{self.ratio:g}"


LengthDist = Fixed | Choice | Uniform | Zipf | Normal | TraceLengths
OutputLengths = LengthDist | PDRatio
LENGTH_TYPES = (Fixed, Choice, Uniform, Zipf, Normal, TraceLengths)


# --- arrivals --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Arrivals:
    """When requests arrive: ``kind`` in ARRIVAL_KINDS (module docstring for each)."""

    kind: str = "all_at_once"
    rate: float | None = None  # requests/s: poisson and gamma only
    burstiness: float = 1.0  # gamma's shape: 1 = Poisson, lower = burstier
    times: tuple[float, ...] = ()  # trace only: arrival_s per request
    source: str = ""  # trace only: the file, for describe()

    def __post_init__(self) -> None:
        if self.kind not in ARRIVAL_KINDS:
            raise ValueError(f"arrivals kind must be one of {ARRIVAL_KINDS}, got {self.kind!r}")
        if self.kind in ("poisson", "gamma"):
            _check_rate(self.rate)
        elif self.rate is not None:
            raise ValueError(f"rate applies to poisson and gamma arrivals, not {self.kind}")
        if self.kind == "gamma":
            _check_positive("burstiness", self.burstiness)
        elif self.burstiness != 1.0:
            raise ValueError(f"burstiness applies to gamma arrivals, not {self.kind}")
        object.__setattr__(self, "times", tuple(self.times))
        if (self.kind == "trace") != bool(self.times):
            raise ValueError("arrival times are given by (and only by) a trace")
        for i, (a, b) in enumerate(zip((0.0,) + self.times, self.times)):
            if not _is_number(b) or not math.isfinite(b) or b < a:
                raise ValueError(f"trace arrival {i} must be >= 0 and non-decreasing, got {b!r}")

    def sample(self, rng: random.Random, n: int) -> list[float]:
        if self.kind == "all_at_once":
            return [0.0] * n
        if self.kind == "trace":
            return list(self.times[:n])
        assert self.rate is not None  # checked in __post_init__
        times, t = [], 0.0
        for _ in range(n):
            times.append(t)
            if self.kind == "poisson":
                t += rng.expovariate(self.rate)
            else:  # mean shape x scale = 1 / rate; CV = 1 / sqrt(shape)
                t += rng.gammavariate(self.burstiness, 1.0 / (self.rate * self.burstiness))
        return times

    def describe(self) -> str:
        if self.kind == "all_at_once":
            return "all at t=0"
        if self.kind == "poisson":
            return f"poisson {self.rate:g} req/s"
        if self.kind == "gamma":
            return f"gamma {self.rate:g} req/s, burstiness {self.burstiness:g}"
        return f"trace {Path(self.source).name}"


def _check_rate(rate: Any) -> None:
    if not _is_number(rate) or not math.isfinite(rate) or rate <= 0:
        raise ValueError(
            f"rate must be a finite number of requests/s > 0, got {rate!r} "
            "(for every request at t=0 use kind: all_at_once)"
        )


# --- the workload ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BenchRequest:
    request_id: str  # "0", "1", ... in arrival order
    arrival_s: float  # seconds after the benchmark starts (>= 0, non-decreasing)
    prompt_token_ids: tuple[int, ...]
    output_tokens: int  # max_tokens for this request (run with ignore_eos=True)


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    prompt_tokens: LengthDist
    output_tokens: OutputLengths  # a LengthDist or a PDRatio rule on the prompt's length
    arrivals: Arrivals = Arrivals()
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        _check_int("num_requests", self.num_requests, 1)
        _check_int("seed", self.seed, 0)
        if not isinstance(self.prompt_tokens, LENGTH_TYPES):
            raise ValueError(
                f"prompt_tokens must be a length distribution, got {self.prompt_tokens!r}"
            )
        if not isinstance(self.output_tokens, (*LENGTH_TYPES, PDRatio)):
            raise ValueError(
                f"output_tokens must be a length distribution or PDRatio, got {self.output_tokens!r}"
            )
        if not isinstance(self.arrivals, Arrivals):
            raise ValueError(f"arrivals must be an Arrivals, got {self.arrivals!r}")
        for what, size in self._trace_sizes():
            if size != self.num_requests:
                raise ValueError(
                    f"num_requests is {self.num_requests} but the trace's {what} cover {size}"
                )

    def _trace_sizes(self) -> list[tuple[str, int]]:
        """(what, number of requests) for each part that holds per-request trace values."""
        parts = {"prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens}
        sizes = [(k, len(d.values)) for k, d in parts.items() if isinstance(d, TraceLengths)]
        if self.arrivals.kind == "trace":
            sizes.append(("arrivals", len(self.arrivals.times)))
        return sizes

    # Exact expectations of the sampled lengths: sums over each distribution's pmf (normal:
    # tails beyond NORMAL_TAIL_STDS std left out; trace: the mean of its values).
    def mean_prompt_tokens(self) -> float:
        return sum(v * p for v, p in self.prompt_tokens.pmf())

    def mean_output_tokens(self) -> float:
        rule = self.output_tokens
        if isinstance(rule, PDRatio):
            return sum(rule.output_for(v) * p for v, p in self.prompt_tokens.pmf())
        return sum(v * p for v, p in rule.pmf())

    def pd_ratio(self) -> float:
        """Mean prompt tokens / mean output tokens (prefill : decode)."""
        output = self.mean_output_tokens()
        if output == 0:
            raise ValueError(f"workload {self.name!r}: mean output tokens is 0, no P:D ratio")
        return self.mean_prompt_tokens() / output

    @property
    def rate(self) -> float | None:
        """Requests/s for poisson and gamma arrivals, else None."""
        return self.arrivals.rate

    def with_rate(self, rate: float) -> Workload:
        """The same requests arriving at ``rate`` req/s: gamma keeps its burstiness, any
        other kind becomes Poisson. Lengths and prompts do not change (Note [streams])."""
        _check_rate(rate)
        if self.arrivals.kind == "gamma":
            return replace(self, arrivals=replace(self.arrivals, rate=rate))
        return replace(self, arrivals=Arrivals("poisson", rate=rate))

    def with_num_requests(self, n: int) -> Workload:
        """The first ``n`` requests (a trace can only shrink)."""
        _check_int("num_requests", n, 1)
        for _, size in self._trace_sizes():
            if n > size:
                raise ValueError(
                    f"workload {self.name!r} replays a trace of {size} requests, cannot make {n}"
                )
        return replace(
            self,
            num_requests=n,
            prompt_tokens=_head(self.prompt_tokens, n),
            output_tokens=_head(self.output_tokens, n),
            arrivals=_head(self.arrivals, n),
        )

    def _rng(self, stream: str) -> random.Random:
        # Note [streams]; a str seed is hashed with SHA-512: the same in every process
        return random.Random(f"sarathi-pp/{self.seed}/{stream}")

    def requests(self, vocab_size: int, max_model_len: int | None = None) -> list[BenchRequest]:
        """The requests in arrival order; the same for the same (workload, vocab_size)."""
        _check_int("vocab_size", vocab_size, 1)
        n = self.num_requests
        prompt_lens = self.prompt_tokens.sample(self._rng("prompt_tokens"), n)
        if isinstance(self.output_tokens, PDRatio):
            output_lens = [self.output_tokens.output_for(p) for p in prompt_lens]
        else:
            output_lens = self.output_tokens.sample(self._rng("output_tokens"), n)
        if max_model_len is not None:
            self._check_fits(prompt_lens, output_lens, max_model_len)
        arrivals = self.arrivals.sample(self._rng("arrivals"), n)
        token_rng, token_ids = self._rng("token_ids"), range(vocab_size)
        return [
            BenchRequest(str(i), t, tuple(token_rng.choices(token_ids, k=p)), o)
            for i, (t, p, o) in enumerate(zip(arrivals, prompt_lens, output_lens))
        ]

    def _check_fits(
        self, prompt_lens: list[int], output_lens: list[int], max_model_len: int
    ) -> None:
        _check_int("max_model_len", max_model_len, 1)
        for i, (p, o) in enumerate(zip(prompt_lens, output_lens)):
            if p + o > max_model_len:
                raise ValueError(
                    f"workload {self.name!r}: request {i}: prompt {p} + output {o} = "
                    f"{p + o} tokens > max_model_len {max_model_len}"
                )

    def describe(self) -> str:
        return (
            f"{self.name}: {self.num_requests} requests, prompt {self.prompt_tokens.describe()}, "
            f"output {self.output_tokens.describe()}, {self.arrivals.describe()}"
        )


def _head(part: Any, n: int) -> Any:
    """``part`` cut to the first ``n`` requests, where it holds per-request values."""
    if isinstance(part, TraceLengths):
        return replace(part, values=part.values[:n])
    if isinstance(part, Arrivals) and part.kind == "trace":
        return replace(part, times=part.times[:n])
    return part


# --- YAML ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _located(where: str) -> Iterator[None]:
    """Prefix a ValueError raised in the block with where it came from (file, key)."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def _check_keys(what: str, mapping: dict, allowed: tuple[str, ...]) -> None:
    unknown = [k for k in mapping if k not in allowed]
    if unknown:
        raise ValueError(
            f"unknown key(s) {', '.join(map(repr, unknown))} in {what}; allowed: {', '.join(allowed)}"
        )


def _required(what: str, mapping: dict, key: str, allowed: tuple[str, ...]) -> Any:
    if key not in mapping:
        raise ValueError(f"{what} needs {key!r} (keys: {', '.join(allowed)})")
    return mapping[key]


def _parse_zipf(body: Any) -> Zipf:
    keys = ("theta", "min", "max")
    if not isinstance(body, dict):
        raise ValueError(f"zipf takes a mapping with keys {', '.join(keys)}, got {body!r}")
    _check_keys("zipf", body, keys)
    theta, high = (_required("zipf", body, k, keys) for k in ("theta", "max"))
    return Zipf(theta=theta, low=body.get("min", 1), high=high)


def _parse_normal(body: Any) -> Normal:
    keys = ("mean", "std", "min", "max")
    if not isinstance(body, dict):
        raise ValueError(f"normal takes a mapping with keys {', '.join(keys)}, got {body!r}")
    _check_keys("normal", body, keys)
    mean, std = (_required("normal", body, k, keys) for k in ("mean", "std"))
    return Normal(mean=mean, std=std, low=body.get("min", 1), high=body.get("max"))


def _parse_uniform(body: Any) -> Uniform:
    if not isinstance(body, list) or len(body) != 2:
        raise ValueError(f"uniform takes [min, max], got {body!r}")
    return Uniform(*body)


def _parse_choice(body: Any, weights: Any) -> Choice:
    if not isinstance(body, list):
        raise ValueError(f"choice takes a list of lengths, got {body!r}")
    if weights is not None and not isinstance(weights, list):
        raise ValueError(f"weights takes a list of numbers, got {weights!r}")
    return Choice(tuple(body), None if weights is None else tuple(weights))


def _parse_length(spec: Any, *, is_output: bool) -> LengthDist | PDRatio:
    kinds = LENGTH_KINDS + (("pd_ratio",) if is_output else ())
    if isinstance(spec, int) and not isinstance(spec, bool):
        return Fixed(spec)
    if not isinstance(spec, dict):
        raise ValueError(
            f"expected an integer or a mapping with one of {', '.join(kinds)}, got {spec!r}"
        )
    if not is_output and "pd_ratio" in spec:
        raise ValueError("pd_ratio applies to output_tokens only (a ratio of the prompt's length)")
    present = [k for k in kinds if k in spec]
    if len(present) != 1:
        raise ValueError(f"expected exactly one of {', '.join(kinds)}, got keys {list(spec)}")
    kind = present[0]
    _check_keys(kind, spec, (kind, "weights") if kind == "choice" else (kind,))
    body = spec[kind]
    if kind == "fixed":
        return Fixed(body)
    if kind == "choice":
        return _parse_choice(body, spec.get("weights"))
    if kind == "uniform":
        return _parse_uniform(body)
    if kind == "zipf":
        return _parse_zipf(body)
    if kind == "normal":
        return _parse_normal(body)
    return PDRatio(body)


def _parse_trace_line(fields: list[str], previous_s: float) -> tuple[float, int, int]:
    if len(fields) != 3:
        raise ValueError(f"expected 3 fields {','.join(TRACE_COLUMNS)}, got {len(fields)}")
    try:
        arrival_s = float(fields[0])
    except ValueError:
        raise ValueError(f"arrival_s must be a number, got {fields[0]!r}") from None
    if not math.isfinite(arrival_s) or arrival_s < previous_s:
        raise ValueError(
            f"arrival_s must be >= 0 and non-decreasing, got {fields[0]} after {previous_s:g}"
        )
    lengths = []
    for name, text in zip(TRACE_COLUMNS[1:], fields[1:]):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {text!r}")
        lengths.append(value)
    return arrival_s, lengths[0], lengths[1]


def _read_trace(path: Path) -> list[tuple[float, int, int]]:
    """(arrival_s, prompt_tokens, output_tokens) per request, from a trace CSV."""
    if not path.is_file():
        raise FileNotFoundError(f"trace file {str(path)!r} does not exist")
    rows: list[tuple[float, int, int]] = []
    is_first = True  # only the first content line may be the header
    for line_no, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split(",")]
        if is_first and tuple(fields) == TRACE_COLUMNS:
            is_first = False
            continue
        is_first = False
        with _located(f"{path}:{line_no}"):
            rows.append(_parse_trace_line(fields, rows[-1][0] if rows else 0.0))
    if not rows:
        raise ValueError(f"{path}: no requests (every line is blank, a comment or the header)")
    return rows


def _parse_arrivals(spec: Any, base_dir: Path | None) -> tuple[Arrivals, list | None]:
    """The arrivals, and for a trace its rows (which also give the lengths)."""
    if spec is None or isinstance(spec, str):
        spec = {"kind": spec or "all_at_once"}
    if not isinstance(spec, dict):
        raise ValueError(f"expected a mapping with 'kind', got {spec!r}")
    kind = spec.get("kind")
    if kind not in ARRIVAL_KINDS:
        raise ValueError(f"kind must be one of {', '.join(ARRIVAL_KINDS)}, got {kind!r}")
    _check_keys(f"{kind} arrivals", spec, ARRIVAL_KEYS[kind])
    if kind == "trace":
        path = Path(_required("trace arrivals", spec, "path", ARRIVAL_KEYS[kind]))
        rows = _read_trace(path if base_dir is None or path.is_absolute() else base_dir / path)
        times = tuple(r[0] for r in rows)
        return Arrivals("trace", times=times, source=str(path)), rows
    if kind == "all_at_once":
        return Arrivals(), None
    rate = _required(f"{kind} arrivals", spec, "rate", ARRIVAL_KEYS[kind])
    return Arrivals(kind, rate=rate, burstiness=spec.get("burstiness", 1.0)), None


def workload_from_dict(d: dict, source: str = "<dict>", base_dir: Path | None = None) -> Workload:
    """A ``Workload`` from a parsed workload file (module docstring); ``source`` names it
    in errors and gives the default name; a trace path is relative to ``base_dir``."""
    if not isinstance(d, dict):
        raise ValueError(f"{source}: a workload must be a mapping, got {type(d).__name__}")
    with _located(source):
        _check_keys("the workload", d, TOP_KEYS)
    with _located(f"{source}: arrivals"):
        arrivals, trace = _parse_arrivals(d.get("arrivals"), base_dir)
    if trace is None:
        with _located(source):
            num_requests = _required("the workload", d, "num_requests", TOP_KEYS)
        lengths = []
        for key in ("prompt_tokens", "output_tokens"):
            with _located(f"{source}: {key}"):
                spec = _required("the workload", d, key, TOP_KEYS)
                lengths.append(_parse_length(spec, is_output=key == "output_tokens"))
        prompt, output = lengths
    else:
        prompt, output = _trace_lengths(d, source, arrivals, trace)
    name = d.get("name", "workload" if source == "<dict>" else Path(source).stem)
    seed = d.get("seed", 0)
    with _located(source):
        if trace is None:
            return Workload(name, num_requests, prompt, output, arrivals, seed)
        whole = Workload(name, len(trace), prompt, output, arrivals, seed)
        return whole.with_num_requests(d.get("num_requests", len(trace)))


def _trace_lengths(
    d: dict, source: str, arrivals: Arrivals, trace: list
) -> tuple[TraceLengths, TraceLengths]:
    for key in ("prompt_tokens", "output_tokens"):
        if key in d:
            raise ValueError(
                f"{source}: {key}: not allowed with trace arrivals ({arrivals.source} gives "
                "every request's lengths)"
            )
    prompt = TraceLengths(tuple(r[1] for r in trace), arrivals.source)
    output = TraceLengths(tuple(r[2] for r in trace), arrivals.source)
    return prompt, output


def load_workload(path: str | Path) -> Workload:
    """Read a workload YAML file (module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"workload file {str(p)!r} does not exist")
    try:
        d = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: not valid YAML: {e}") from e
    return workload_from_dict(d, source=str(p), base_dir=p.parent)
