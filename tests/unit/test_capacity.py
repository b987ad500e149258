"""Capacity search on a fake engine with a known latency curve."""

from __future__ import annotations

import itertools

import pytest

from sarathi_pp.bench.capacity import Slo, search_capacity


def fake_summary(tbt_p99: float | None, delay_p50: float | None = 0.0, tps: float = 1.0) -> dict:
    return {
        "tbt_s": {"p50": tbt_p99, "p90": tbt_p99, "p99": tbt_p99},
        "scheduling_delay_s": {"p50": delay_p50, "p90": delay_p50, "p99": delay_p50},
        "generated_tokens_per_s": tps,
    }


def knee_engine(knee: float, calls: list[float]):
    """TBT p99 grows slowly up to ``knee`` req/s, then explodes (queueing)."""

    def probe(rate: float) -> dict:
        calls.append(rate)
        tbt = 0.1 + 0.01 * rate if rate <= knee else 10.0 * rate
        return fake_summary(tbt)

    return probe


@pytest.mark.parametrize("start", [0.1, 1.0, 3.0, 40.0])
@pytest.mark.parametrize("knee", [0.37, 2.5, 7.0])
def test_finds_the_knee_within_tolerance(start: float, knee: float) -> None:
    calls: list[float] = []
    result = search_capacity(knee_engine(knee, calls), Slo(0.5), start, max_probes=30, rel_tol=0.05)
    assert result.bound == "exact" and result.stopped == "converged"
    assert result.capacity <= knee < result.capacity * 1.05
    # every probe is recorded in order, with its verdict
    assert [p.rate for p in result.probes] == calls
    assert all(p.meets_slo == (p.rate <= knee) for p in result.probes)
    assert "capacity" in result.describe()


def test_probe_count_is_bounded() -> None:
    calls: list[float] = []
    result = search_capacity(knee_engine(5.0, calls), Slo(0.5), 1.0, max_probes=3, rel_tol=0.01)
    assert len(calls) == 3
    assert result.stopped == "max_probes"
    assert result.bound == "lower" and result.capacity == 4.0  # 1, 2, 4 all met
    assert result.describe().startswith("capacity >= 4") and result.failed is None


def test_a_bracket_not_yet_narrowed_says_between():
    result = search_capacity(knee_engine(5.0, []), Slo(0.5), 1.0, max_probes=4, rel_tol=0.01)
    assert [p.rate for p in result.probes] == [1.0, 2.0, 4.0, 8.0]
    assert (result.bound, result.capacity, result.failed) == ("lower", 4.0, 8.0)
    assert result.describe().startswith("capacity between 4 and 8 req/s")
    assert result.to_dict()["failed_rps"] == 8.0


def test_slo_never_met_is_reported_not_looped() -> None:
    calls: list[float] = []

    def probe(rate: float) -> dict:
        calls.append(rate)
        return fake_summary(1.0)  # always above the SLO

    result = search_capacity(probe, Slo(0.5), 2.0, max_probes=5)
    assert result.capacity is None and result.bound == "not_met"
    assert calls == [2.0, 1.0, 0.5, 0.25, 0.125]
    assert "SLO not met" in result.describe() and "0.125" in result.describe()
    assert result.to_dict()["capacity_rps"] is None


def test_time_limit_stops_between_probes() -> None:
    clock = itertools.count(0.0, 10.0)  # each clock read advances 10 s
    calls: list[float] = []
    result = search_capacity(
        knee_engine(100.0, calls),
        Slo(5.0),
        1.0,
        max_probes=50,
        time_limit_s=25,
        clock=lambda: next(clock),
    )
    assert result.stopped == "time_limit"
    assert 1 <= len(calls) < 5


def test_scheduling_delay_slo_fails_a_growing_queue() -> None:
    # TBT stays low at every rate (as under SARATHI); the queue grows above 3 req/s.
    def probe(rate: float) -> dict:
        return fake_summary(0.1, delay_p50=0.01 if rate <= 3.0 else 5.0)

    tbt_only = search_capacity(probe, Slo(0.5), 1.0, max_probes=6)
    assert tbt_only.bound == "lower" and tbt_only.capacity == 32.0
    both = search_capacity(probe, Slo(0.5, 1.0), 1.0, max_probes=20, rel_tol=0.02)
    assert both.bound == "exact" and both.capacity <= 3.0 < both.capacity * 1.02
    failed = next(p for p in both.probes if not p.meets_slo)
    assert "scheduling delay p50 5000.0 ms > 1000.0 ms" in failed.reason


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"start_rate": 0.0}, "start rate"),
        ({"start_rate": float("inf")}, "start rate"),
        ({"max_probes": 0}, "max_probes"),
        ({"rel_tol": 0.0}, "rel_tol"),
        ({"time_limit_s": -1.0}, "time limit"),
    ],
)
def test_bad_search_arguments(kwargs: dict, message: str) -> None:
    args = {"start_rate": 1.0, **kwargs}
    start = args.pop("start_rate")
    with pytest.raises(ValueError, match=message):
        search_capacity(knee_engine(1.0, []), Slo(0.5), start, **args)


@pytest.mark.parametrize("bad", [0, -0.5, "fast", True])
def test_bad_slo(bad) -> None:
    with pytest.raises(ValueError, match="tbt_p99_s"):
        Slo(bad)
    with pytest.raises(ValueError, match="scheduling_delay_p50_s"):
        Slo(0.5, bad)


def test_slo_needs_token_gaps() -> None:
    with pytest.raises(ValueError, match="no token gaps"):
        Slo(0.5).check(fake_summary(None))
