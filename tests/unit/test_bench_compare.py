"""``comparison.json`` entries, ratios and the benchmark table on hand-made summaries."""

from __future__ import annotations

import pytest

from sarathi_pp.bench.compare import (
    build_comparison,
    engine_run_entry,
    format_table,
    peer_run_entry,
    ratio_entry,
)


def dist(v: float) -> dict:
    return {"p50": v, "p90": 2 * v, "p99": 4 * v, "max": 5 * v, "mean": v}


def requests(tps: float, tbt: float, ttft: float = 1.0) -> dict:
    return {
        "num_requests": 4,
        "num_generated_tokens": 40,
        "duration_s": 40 / tps,
        "generated_tokens_per_s": tps,
        "requests_per_s": tps / 10,
        "ttft_s": dist(ttft),
        "tbt_s": dist(tbt),
        "tbt_source": "token_times",
        "tpot_s": dist(tbt),
        "e2e_s": dist(10.0),
        "scheduling_delay_s": dist(0.01),
    }


def summary(policy: str, tps: float, tbt: float, bubbles: list[float], chunk=None) -> dict:
    return {
        "scheduler": policy,
        "overall": {"bubble_fraction": sum(bubbles) / len(bubbles)},
        "stages": [{"bubble_fraction": b} for b in bubbles],
        "requests": requests(tps, tbt),
        "chunk_size": chunk,
    }


AUTO = {
    "auto": True,
    "initial": 256,
    "final": 512,
    "min": 256,
    "max": 512,
    "num_changes": 2,
    "changes": [],
}


def runs(peer_comparable: bool = True) -> list[dict]:
    return [
        engine_run_entry("sarathi", "sarathi", summary("sarathi", 30.0, 0.1, [0.1, 0.3], AUTO)),
        engine_run_entry("vllm", "vllm", summary("vllm", 24.0, 0.4, [0.2, 0.4])),
        peer_run_entry(
            "peer-hf", "peer-hf", requests(10.0, 0.2), peer_comparable, "transformers x"
        ),
    ]


def test_ratios_ours_over_peer_and_first_over_others():
    c = build_comparison(runs(), {"name": "w"}, {})
    pairs = [(r["a"], r["b"]) for r in c["ratios"]]
    assert pairs == [("sarathi", "peer-hf"), ("vllm", "peer-hf"), ("sarathi", "vllm")]
    first = c["ratios"][0]
    assert first["generated_tokens_per_s"] == pytest.approx(3.0)
    assert first["tbt_p99"] == pytest.approx(0.4 / 0.8)
    assert c["ratios"][2]["tbt_p50"] == pytest.approx(0.25)


def test_latency_ratios_against_a_peer_without_arrivals_are_not_given():
    r = ratio_entry(runs()[0], runs(peer_comparable=False)[2])
    assert r["generated_tokens_per_s"] == pytest.approx(3.0)  # throughput still compares
    assert r["tbt_p99"] is None and r["ttft_p50"] is None


def test_table_shows_runs_side_by_side():
    text = format_table(build_comparison(runs(peer_comparable=False), {"name": "w"}, {}))
    lines = text.splitlines()
    assert lines[0].split() == ["sarathi", "vllm", "peer-hf"]
    row = {line[:22].strip(): line[22:].split() for line in lines[1:] if line[:1] not in (" ", "")}
    assert row["generated tokens/s"] == ["30.000", "24.000", "10.000"]
    assert row["tbt p99"] == ["400.00", "ms", "1600.00", "ms", "n/c"]
    assert row["chunk_size"] == ["auto", "256-512", "-", "-"]
    assert row["bubble fraction"] == ["0.200", "0.300", "-"]
    stage1 = next(line for line in lines if line.strip().startswith("stage 1"))
    assert stage1.split()[2:] == ["0.300", "0.400", "-"]
    assert "n/c: not comparable" in text
    assert "sarathi / vllm: throughput 1.25x" in text
    assert "sarathi / peer-hf: throughput 3.00x, TTFT p50 n/c" in text


def test_a_data_parallel_runs_stages_are_named_by_replica():
    total = summary("sarathi", 30.0, 0.1, [0.2, 0.3])
    total["stages"] = [
        {"replica": i, "stage": 0, "bubble_fraction": b} for i, b in ((0, 0.2), (1, 0.3))
    ]
    entry = engine_run_entry("sarathi", "run", total)
    assert entry["stage_names"] == ["replica 0 stage 0", "replica 1 stage 0"]
    text = format_table(build_comparison([entry], {"name": "w"}, {}))
    assert [line.split()[:4] for line in text.splitlines() if "replica" in line] == [
        ["replica", "0", "stage", "0"],
        ["replica", "1", "stage", "0"],
    ]


@pytest.mark.parametrize(
    "cap, cell",
    [
        ({"capacity_rps": 0.849, "failed_rps": 1.2, "bound": "lower"}, "0.849-1.2"),
        ({"capacity_rps": 0.5, "failed_rps": None, "bound": "lower"}, ">=0.5"),
        ({"capacity_rps": 0.7, "failed_rps": 0.75, "bound": "exact"}, "0.7"),
        ({"capacity_rps": None, "failed_rps": 0.1, "bound": "not_met"}, "not met"),
    ],
)
def test_capacity_cells_and_ratio(cap, cell):
    a, b = runs()[:2]
    a["capacity"] = cap
    b["capacity"] = {"capacity_rps": 0.25, "failed_rps": None, "bound": "lower"}
    c = build_comparison([a, b], {"name": "w"}, {})
    line = format_table(c).splitlines()[1]
    assert line.startswith("capacity (req/s)") and line[22:36].strip() == cell  # 14-wide cells
    ratio = c["ratios"][0]["capacity_rps"]
    assert ratio == (
        None if cap["capacity_rps"] is None else pytest.approx(cap["capacity_rps"] / 0.25)
    )
