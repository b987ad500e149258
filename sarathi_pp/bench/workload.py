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
    shared_prefix: {tokens: 512, groups: 2}   # optional

Lengths (tokens, integers >= 1), for ``prompt_tokens`` and ``output_tokens``: ``512`` or
``{fixed: 512}``, ``{choice: [...], weights: [...]}``, ``{uniform: [lo, hi]}``,
``{zipf: {theta, min, max}}``, ``{normal: {mean, std, min, max}}``, and for the output
only ``{pd_ratio: 8}``; each is described in ``sarathi_pp/bench/lengths.py``.

Arrivals (seconds after the benchmark starts): ``{kind: all_at_once}`` (the default),
``{kind: poisson, rate}``, ``{kind: gamma, rate, burstiness}`` and
``{kind: trace, path}`` (a CSV that gives arrivals and lengths, so ``prompt_tokens`` and
``output_tokens`` are not allowed beside it); each is described in
``sarathi_pp/bench/arrivals.py``.

``shared_prefix`` puts a shared head before every prompt (a system prompt, a few-shot
header: what prefix caching reuses): ``groups`` heads of ``tokens`` random token ids each
(default one group), request ``i`` gets head ``i % groups``, and ``prompt_tokens`` then
counts the tokens after it (each request's own). Without it no two prompts share a prefix
(beyond chance).

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

import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from sarathi_pp.bench.arrivals import (
    ARRIVAL_KEYS,
    ARRIVAL_KINDS,
    TRACE_COLUMNS,
    Arrivals,
    _check_rate,
    _parse_arrivals,
)
from sarathi_pp.bench.lengths import (
    LENGTH_KINDS,
    LENGTH_TYPES,
    NORMAL_TAIL_STDS,
    Choice,
    Fixed,
    LengthDist,
    Normal,
    OutputLengths,
    PDRatio,
    TraceLengths,
    Uniform,
    Zipf,
    _check_int,
    _check_keys,
    _located,
    _parse_length,
    _required,
)

# the length and arrival names stay importable from here (tests and older callers)
__all__ = [
    "ARRIVAL_KEYS",
    "ARRIVAL_KINDS",
    "LENGTH_KINDS",
    "LENGTH_TYPES",
    "NORMAL_TAIL_STDS",
    "TOP_KEYS",
    "TRACE_COLUMNS",
    "Arrivals",
    "BenchRequest",
    "Choice",
    "Fixed",
    "LengthDist",
    "Normal",
    "OutputLengths",
    "PDRatio",
    "TraceLengths",
    "Uniform",
    "Workload",
    "Zipf",
    "load_workload",
    "workload_from_dict",
]

TOP_KEYS = (
    "name", "num_requests", "seed", "prompt_tokens", "output_tokens", "arrivals",
    "shared_prefix",
)  # fmt: skip
SHARED_PREFIX_KEYS = ("tokens", "groups")


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """``groups`` heads of ``tokens`` token ids; request ``i`` starts with head
    ``i % groups`` (module docstring)."""

    tokens: int
    groups: int = 1

    def __post_init__(self) -> None:
        _check_int("shared_prefix.tokens", self.tokens, 1)
        _check_int("shared_prefix.groups", self.groups, 1)


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
    shared_prefix: SharedPrefix | None = None

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
        if self.shared_prefix is not None and not isinstance(self.shared_prefix, SharedPrefix):
            raise ValueError(f"shared_prefix must be a SharedPrefix, got {self.shared_prefix!r}")
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
        head = self.shared_prefix.tokens if self.shared_prefix is not None else 0
        return head + sum(v * p for v, p in self.prompt_tokens.pmf())

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
        heads: list[tuple[int, ...]] = [()]
        if (sp := self.shared_prefix) is not None:
            head_rng = self._rng("shared_prefix")  # its own stream: the rest stays the same
            heads = [tuple(head_rng.choices(range(vocab_size), k=sp.tokens))
                     for _ in range(sp.groups)]  # fmt: skip
        if max_model_len is not None:
            head = len(heads[0])
            self._check_fits([head + p for p in prompt_lens], output_lens, max_model_len)
        arrivals = self.arrivals.sample(self._rng("arrivals"), n)
        token_rng, token_ids = self._rng("token_ids"), range(vocab_size)
        return [
            BenchRequest(
                str(i), t, heads[i % len(heads)] + tuple(token_rng.choices(token_ids, k=p)), o
            )
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
        head = ""
        if (sp := self.shared_prefix) is not None:
            groups = "" if sp.groups == 1 else f" (one of {sp.groups})"
            head = f"a shared prefix of {sp.tokens} tokens{groups} + "
        return (
            f"{self.name}: {self.num_requests} requests, prompt {head}"
            f"{self.prompt_tokens.describe()}, output {self.output_tokens.describe()}, "
            f"{self.arrivals.describe()}"
        )


def _head(part: Any, n: int) -> Any:
    """``part`` cut to the first ``n`` requests, where it holds per-request values."""
    if isinstance(part, TraceLengths):
        return replace(part, values=part.values[:n])
    if isinstance(part, Arrivals) and part.kind == "trace":
        return replace(part, times=part.times[:n])
    return part


# --- YAML ------------------------------------------------------------------------------------
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
    with _located(f"{source}: shared_prefix"):
        shared = _parse_shared_prefix(d.get("shared_prefix"))
    with _located(source):
        if trace is None:
            return Workload(name, num_requests, prompt, output, arrivals, seed, shared)
        whole = Workload(name, len(trace), prompt, output, arrivals, seed, shared)
        return whole.with_num_requests(d.get("num_requests", len(trace)))


def _parse_shared_prefix(spec: Any) -> SharedPrefix | None:
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"expected a mapping {{tokens: N, groups: G}}, got {spec!r}")
    _check_keys("shared_prefix", spec, SHARED_PREFIX_KEYS)
    return SharedPrefix(
        _required("shared_prefix", spec, "tokens", SHARED_PREFIX_KEYS), spec.get("groups", 1)
    )


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
