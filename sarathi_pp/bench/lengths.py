"""Length distributions of a workload: tokens per request (integers >= 1), the values of
the ``prompt_tokens`` and ``output_tokens`` keys of a workload file (the file's format:
``sarathi_pp/bench/workload.py``). Pure Python (``random.Random``), no torch.

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

A trace (``arrivals: {kind: trace}``, ``sarathi_pp/bench/arrivals.py``) gives the lengths
request by request: ``TraceLengths``.

The checks and YAML helpers below (``_check_int``, ``_located``, ...) are shared with
``arrivals.py`` and ``workload.py``, which import them from here.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LENGTH_KINDS = ("fixed", "choice", "uniform", "zipf", "normal")
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
