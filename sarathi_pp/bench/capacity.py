"""Capacity search: the highest Poisson request rate whose latency meets an SLO.

As in Sarathi-Serve's capacity search: each probe serves the workload at one rate and
checks its P99 time between tokens (TBT) and, optionally, its P50 scheduling delay
against the SLO. The search first brackets the capacity (doubling the rate while probes
pass, halving it while they fail), then bisects the bracket (geometric midpoint) until it
is within ``rel_tol``. It is bounded: at most ``max_probes`` probes and, between probes,
a ``time_limit_s`` budget.

Why the scheduling-delay SLO matters: a scheduler that keeps TBT low under overload
(SARATHI does, by design) lets the queue grow instead; TBT alone then never fails and
the search ends at the top of its bracket with ``bound="lower"``: the capacity is at
least that rate. A P50 scheduling-delay SLO turns a growing queue into a failed probe.

Pure Python: a probe is any ``rate -> requests summary`` function (the keys of
``report.request_metrics.request_summary``), so the search is tested on a fake engine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Slo:
    tbt_p99_s: float
    """P99 of every gap between consecutive tokens, pooled over requests."""
    scheduling_delay_p50_s: float | None = None
    """P50 of first scheduled - arrival; ``None`` = not checked."""

    def __post_init__(self) -> None:
        _check_seconds("tbt_p99_s", self.tbt_p99_s)
        if self.scheduling_delay_p50_s is not None:
            _check_seconds("scheduling_delay_p50_s", self.scheduling_delay_p50_s)

    def check(self, requests: dict[str, Any]) -> tuple[bool, str]:
        """Whether a probe's requests summary meets the SLO, and why (the figures)."""
        tbt = requests["tbt_s"]["p99"]
        if tbt is None:
            raise ValueError(
                "the workload's requests have no token gaps (one output token each): "
                "a TBT SLO cannot be checked; give requests at least 2 output tokens"
            )
        parts = [
            f"TBT p99 {tbt * 1e3:.1f} ms {'<=' if tbt <= self.tbt_p99_s else '>'} "
            f"{self.tbt_p99_s * 1e3:.1f} ms"
        ]
        ok = tbt <= self.tbt_p99_s
        if self.scheduling_delay_p50_s is not None:
            delay = requests["scheduling_delay_s"]["p50"]
            delay_ok = delay is not None and delay <= self.scheduling_delay_p50_s
            parts.append(
                f"scheduling delay p50 {_ms(delay)} {'<=' if delay_ok else '>'} "
                f"{self.scheduling_delay_p50_s * 1e3:.1f} ms"
            )
            ok = ok and delay_ok
        return ok, ", ".join(parts)


def _check_seconds(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ValueError(f"SLO {name} must be a number > 0, got {v!r}")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f} ms"


@dataclass(frozen=True, slots=True)
class Probe:
    rate: float  # requests/s
    meets_slo: bool
    reason: str
    tbt_p99_s: float | None
    scheduling_delay_p50_s: float | None
    generated_tokens_per_s: float | None
    wall_s: float


@dataclass(frozen=True)
class CapacityResult:
    capacity: float | None
    """The highest probed rate that met the SLO; ``None`` when no probe met it."""
    bound: str
    """``exact`` (bracketed within ``rel_tol``), ``lower`` (the search stopped first: the
    capacity is at least ``capacity``, and below ``failed`` when a higher rate failed) or
    ``not_met`` (no probe met it: the capacity is below the lowest rate probed)."""
    stopped: str
    """``converged``, ``max_probes`` or ``time_limit``."""
    probes: tuple[Probe, ...]
    slo: Slo

    @property
    def failed(self) -> float | None:
        """The lowest probed rate above the capacity that failed the SLO, if any."""
        above = [p.rate for p in self.probes if not p.meets_slo and p.rate > (self.capacity or 0)]
        return min(above) if above else None

    def describe(self) -> str:
        n = len(self.probes)
        if self.capacity is None:
            low = min(p.rate for p in self.probes)
            return (
                f"SLO not met: no probe met it ({n} probes; the lowest rate, {low:.3g} req/s, "
                f"gave {self._probe_at(low).reason}); stopped: {self.stopped}"
            )
        if self.bound == "exact":
            return (
                f"capacity {self.capacity:.3g} req/s ({n} probes; {self.failed:.3g} req/s "
                f"failed; stopped: {self.stopped})"
            )
        if self.failed is not None:
            return (
                f"capacity between {self.capacity:.3g} and {self.failed:.3g} req/s ({n} probes: "
                f"stopped ({self.stopped}) before the bracket narrowed)"
            )
        return (
            f"capacity >= {self.capacity:.3g} req/s (every one of {n} probes met the SLO; "
            f"stopped: {self.stopped})"
        )

    def _probe_at(self, rate: float) -> Probe:
        return next(p for p in self.probes if p.rate == rate)

    def to_dict(self) -> dict[str, Any]:
        return {
            "capacity_rps": self.capacity,
            "failed_rps": self.failed,
            "bound": self.bound,
            "stopped": self.stopped,
            "slo": asdict(self.slo),
            "probes": [asdict(p) for p in self.probes],
            "description": self.describe(),
        }


def search_capacity(
    probe: Callable[[float], dict[str, Any]],
    slo: Slo,
    start_rate: float,
    *,
    max_probes: int = 8,
    rel_tol: float = 0.1,
    time_limit_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> CapacityResult:
    """Search the highest rate meeting ``slo``; ``probe(rate)`` serves the workload at
    ``rate`` and returns its requests summary. See the module docstring."""
    if not start_rate > 0 or not math.isfinite(start_rate):
        raise ValueError(f"start rate must be a number > 0, got {start_rate!r}")
    if isinstance(max_probes, bool) or not isinstance(max_probes, int) or max_probes < 1:
        raise ValueError(f"max_probes must be an integer >= 1, got {max_probes!r}")
    if not rel_tol > 0:
        raise ValueError(f"rel_tol must be > 0, got {rel_tol!r}")
    if time_limit_s is not None and not time_limit_s > 0:
        raise ValueError(f"time limit must be > 0 s, got {time_limit_s!r}")
    deadline = None if time_limit_s is None else clock() + time_limit_s
    probes: list[Probe] = []
    good: float | None = None  # highest rate that met the SLO
    bad: float | None = None  # lowest rate that failed it
    rate = start_rate
    stopped = "converged"
    while True:
        if len(probes) >= max_probes:
            stopped = "max_probes"
            break
        if deadline is not None and probes and clock() >= deadline:
            stopped = "time_limit"
            break
        p = _run_probe(probe, slo, rate, clock)
        probes.append(p)
        if p.meets_slo:
            good = rate if good is None else max(good, rate)
        else:
            bad = rate if bad is None else min(bad, rate)
        if good is not None and bad is not None and bad / good <= 1 + rel_tol:
            break
        rate = _next_rate(good, bad)
    if good is None:
        bound = "not_met"
    elif bad is not None and bad / good <= 1 + rel_tol:
        bound = "exact"
    else:
        bound = "lower"
    return CapacityResult(good, bound, stopped, tuple(probes), slo)


def _next_rate(good: float | None, bad: float | None) -> float:
    if bad is None:
        return 2 * good  # type: ignore[operator]  # every probe met: expand up
    if good is None:
        return bad / 2  # every probe failed: expand down
    return math.sqrt(good * bad)  # bisect the bracket on a log scale


def _run_probe(
    probe: Callable[[float], dict[str, Any]], slo: Slo, rate: float, clock: Callable[[], float]
) -> Probe:
    t0 = clock()
    summary = probe(rate)
    wall = clock() - t0
    ok, reason = slo.check(summary)
    return Probe(
        rate=rate,
        meets_slo=ok,
        reason=reason,
        tbt_p99_s=summary["tbt_s"]["p99"],
        scheduling_delay_p50_s=summary["scheduling_delay_s"]["p50"],
        generated_tokens_per_s=summary.get("generated_tokens_per_s"),
        wall_s=wall,
    )
