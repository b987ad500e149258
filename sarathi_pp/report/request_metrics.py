"""Request metrics from ``requests.csv``: TTFT, TBT, TPOT, end-to-end latency, scheduling
delay (each as p50/p90/p99/max/mean) and throughput.

TBT pools every gap between consecutive tokens of every request. It needs the per-token
times: the ``token_times`` column (times relative to the request's arrival,
space-separated). For a request without them (an older requests.csv) only the mean and max
gap are known; its gaps are then its ``tbt_mean_s`` repeated once per gap (the mean is
exact, the percentiles approximate, the max is the largest ``tbt_max_s``) and
``tbt_source`` says ``tbt_mean_s``.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from sarathi_pp.outputs import tpot

REQUIRED_COLUMNS = (
    "request_id",
    "num_output_tokens",
    "arrival_s",
    "finished_s",
    "ttft_s",
    "scheduling_delay_s",
    "e2e_s",
)
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class RequestRow:
    request_id: str
    num_output_tokens: int
    arrival_s: float | None
    finished_s: float | None
    ttft_s: float | None
    e2e_s: float | None
    scheduling_delay_s: float | None
    tbt_mean_s: float | None
    tbt_max_s: float | None
    token_times: tuple[float, ...] | None  # None: no token_times column
    first_scheduled_s: float | None = None
    num_prompt_tokens: int | None = None
    # prompt tokens read from the prefix cache; None: not looked up (or an older file)
    num_cached_tokens: int | None = None


def load_requests(path: str | Path) -> list[RequestRow]:
    """Read ``requests.csv``; ``FileNotFoundError``/``ValueError`` naming the file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no request metrics {str(p)!r}")
    with open(p, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None:
            raise ValueError(f"{p}: empty file, expected a CSV header")
        missing = [c for c in REQUIRED_COLUMNS if c not in reader.fieldnames]
        if missing:
            raise ValueError(f"{p}: missing column(s) {', '.join(missing)}")
        return [_row(r, f"{p}:{reader.line_num}") for r in reader]


def _float(r: dict[str, Any], key: str, where: str) -> float | None:
    v = r.get(key)
    if v is None or v == "":
        return None
    try:
        x = float(v)
    except ValueError:
        raise ValueError(f"{where}: column {key!r}: {v!r} is not a number") from None
    if not math.isfinite(x):
        raise ValueError(f"{where}: column {key!r}: {v!r} is not finite")
    return x


def _row(r: dict[str, Any], where: str) -> RequestRow:
    if None in r or any(v is None for v in r.values()):
        raise ValueError(f"{where}: wrong number of fields")
    n = _float(r, "num_output_tokens", where)
    if n is None or n != int(n) or n < 0:
        raise ValueError(
            f"{where}: column 'num_output_tokens': {r['num_output_tokens']!r} is not a count"
        )
    tt = None
    if "token_times" in r:
        try:
            tt = tuple(float(x) for x in r["token_times"].split())
        except ValueError:
            raise ValueError(
                f"{where}: column 'token_times': {r['token_times'][:40]!r} is not "
                "a space-separated list of numbers"
            ) from None
    return RequestRow(
        request_id=r["request_id"],
        num_output_tokens=int(n),
        arrival_s=_float(r, "arrival_s", where),
        finished_s=_float(r, "finished_s", where),
        ttft_s=_float(r, "ttft_s", where),
        e2e_s=_float(r, "e2e_s", where),
        scheduling_delay_s=_float(r, "scheduling_delay_s", where),
        tbt_mean_s=_float(r, "tbt_mean_s", where),
        tbt_max_s=_float(r, "tbt_max_s", where),
        token_times=tt,
        first_scheduled_s=_float(r, "first_scheduled_s", where),
        num_prompt_tokens=_count(r, "num_prompt_tokens", where),
        num_cached_tokens=_count(r, "num_cached_tokens", where),
    )


def _count(r: dict[str, Any], key: str, where: str) -> int | None:
    x = _float(r, key, where)
    if x is not None and (x != int(x) or x < 0):
        raise ValueError(f"{where}: column {key!r}: {r[key]!r} is not a count")
    return None if x is None else int(x)


def percentile(sorted_xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(sorted_xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def distribution(xs: list[float]) -> dict[str, float | None]:
    """``p50``, ``p90``, ``p99``, ``max``, ``mean`` (all ``None`` when ``xs`` is empty)."""
    keys = [f"p{q}" for q in PERCENTILES] + ["max", "mean"]
    if not xs:
        return dict.fromkeys(keys)
    s = sorted(xs)
    out: dict[str, float | None] = {f"p{q}": percentile(s, q) for q in PERCENTILES}
    out["max"] = s[-1]
    out["mean"] = sum(s) / len(s)
    return out


def tbt_pool(rows: list[RequestRow]) -> tuple[list[float], str]:
    """Every inter-token gap, and where it came from: ``token_times``, or ``tbt_mean_s``
    when some request with more than one token has no token times."""
    pool: list[float] = []
    source = "token_times"
    for r in rows:
        if r.token_times:
            pool += [b - a for a, b in pairwise(r.token_times)]
        elif r.tbt_mean_s is not None and r.num_output_tokens > 1:
            pool += [r.tbt_mean_s] * (r.num_output_tokens - 1)
            source = "tbt_mean_s"
    return pool, source


def request_summary(rows: list[RequestRow]) -> dict[str, Any]:
    tbt, source = tbt_pool(rows)
    tbt_dist = distribution(tbt)
    if source == "tbt_mean_s":
        maxes = [r.tbt_max_s for r in rows if r.tbt_max_s is not None]
        tbt_dist["max"] = max(maxes) if maxes else tbt_dist["max"]
    tpots = [t for r in rows if (t := tpot(r.e2e_s, r.ttft_s, r.num_output_tokens)) is not None]
    finished = [r.finished_s for r in rows if r.finished_s is not None]
    arrivals = [r.arrival_s for r in rows if r.arrival_s is not None]
    duration = (max(finished) - min(arrivals)) if finished and arrivals else None
    rate = (lambda x: x / duration) if duration else (lambda x: None)  # noqa: E731
    num_tokens = sum(r.num_output_tokens for r in rows)
    return {
        "num_requests": len(rows),
        "num_generated_tokens": num_tokens,
        "duration_s": duration,
        "generated_tokens_per_s": rate(num_tokens),
        "requests_per_s": rate(len(finished)),
        "ttft_s": distribution([r.ttft_s for r in rows if r.ttft_s is not None]),
        "tbt_s": tbt_dist,
        "tbt_source": source,
        "tpot_s": distribution(tpots),
        "e2e_s": distribution([r.e2e_s for r in rows if r.e2e_s is not None]),
        "scheduling_delay_s": distribution(
            [r.scheduling_delay_s for r in rows if r.scheduling_delay_s is not None]
        ),
        "prefix_cache": prefix_cache_summary(rows),
    }


def prefix_cache_summary(rows: list[RequestRow]) -> dict[str, Any] | None:
    """Prompt tokens of the requests looked up in the prefix cache (``queried_tokens``)
    and those found cached (``hit_tokens``, at each request's first lookup); ``None`` when
    no request was looked up (prefix caching off)."""
    looked = [r for r in rows if r.num_cached_tokens is not None and r.num_prompt_tokens]
    if not looked:
        return None
    queried = sum(r.num_prompt_tokens or 0 for r in looked)
    hits = sum(r.num_cached_tokens or 0 for r in looked)
    return {
        "num_requests": len(looked),
        "queried_tokens": queried,
        "hit_tokens": hits,
        "hit_rate": hits / queried if queried else None,
    }
