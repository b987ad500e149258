"""Arrivals of a workload: when each request arrives (seconds after the benchmark starts),
the value of the ``arrivals`` key of a workload file (the file's format:
``sarathi_pp/bench/workload.py``). Pure Python (``random.Random``), no torch.

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
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sarathi_pp.bench.lengths import (
    _check_keys,
    _check_positive,
    _is_number,
    _located,
    _required,
)

ARRIVAL_KINDS = ("all_at_once", "poisson", "gamma", "trace")
TRACE_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")
ARRIVAL_KEYS = {
    "all_at_once": ("kind",),
    "poisson": ("kind", "rate"),
    "gamma": ("kind", "rate", "burstiness"),
    "trace": ("kind", "path"),
}


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


# --- YAML ------------------------------------------------------------------------------------
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
