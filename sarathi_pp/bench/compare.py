"""``comparison.json`` and the benchmark's table: runs side by side, with ratios.

``comparison.json`` (``COMPARISON_VERSION``)::

    schema_version, workload: {name, description, pd_ratio, rate}, config: {...},
    runs: [{name, kind: "engine" | "peer", scheduler, run_dir,
            overall: <summary.json "overall"> | null (a peer has no stages),
            stages: [bubble_fraction per stage] | null,
            requests: <summary.json "requests">,
            chunk_size: <summary.json "chunk_size"> | null (a peer, a whole-prompt policy),
            latency_comparable: bool, note: str,
            capacity: <capacity result> | null,
            token_agreement (a peer): {num_identical, num_compared, first_mismatch}}],
    ratios: [{a, b, capacity_rps, generated_tokens_per_s, requests_per_s, ttft_p50, tbt_p99, ...}]

A ratio is ``a / b`` of the figure: our run over the peer for every engine run, and the
first scheduler over each other one. A latency ratio against a peer whose arrivals were
not honoured is ``null``.
"""

from __future__ import annotations

from typing import Any

from sarathi_pp.report.text import fmt, get_path

COMPARISON_VERSION = 1

# (label, path into a run's "requests" summary, unit): the table's latency rows.
LATENCY_ROWS = tuple(
    (f"{label} {q}", (key, q), "ms")
    for label, key in (
        ("ttft", "ttft_s"),
        ("tbt", "tbt_s"),
        ("tpot", "tpot_s"),
        ("e2e", "e2e_s"),
        ("sched delay", "scheduling_delay_s"),
    )
    for q in ("p50", "p90", "p99")
)
THROUGHPUT_ROWS = (
    ("generated tokens/s", ("generated_tokens_per_s",), ""),
    ("requests/s", ("requests_per_s",), ""),
)
# Figures the ratios are taken of: (name, path into "requests", is a latency).
RATIO_FIGURES = (
    ("generated_tokens_per_s", ("generated_tokens_per_s",), False),
    ("requests_per_s", ("requests_per_s",), False),
    ("ttft_p50", ("ttft_s", "p50"), True),
    ("ttft_p99", ("ttft_s", "p99"), True),
    ("tbt_p50", ("tbt_s", "p50"), True),
    ("tbt_p99", ("tbt_s", "p99"), True),
    ("tpot_p50", ("tpot_s", "p50"), True),
    ("e2e_p50", ("e2e_s", "p50"), True),
)


def engine_run_entry(name: str, run_dir: str, summary: dict[str, Any]) -> dict[str, Any]:
    """One of our runs, from its ``summary.json``."""
    return {
        "name": name,
        "kind": "engine",
        "scheduler": summary.get("scheduler"),
        "run_dir": run_dir,
        "overall": summary["overall"],
        "stages": [s["bubble_fraction"] for s in summary["stages"]],
        # a data-parallel run's total lists every replica's stages in turn
        "stage_names": [_stage_name(i, s) for i, s in enumerate(summary["stages"])],
        "requests": summary["requests"],
        "chunk_size": summary.get("chunk_size"),
        "latency_comparable": True,
        "note": "",
        "capacity": None,
    }


def _stage_name(i: int, stage: dict[str, Any]) -> str:
    """A stage's row name; a data-parallel run's total lists every replica's stages in turn."""
    name = f"stage {stage.get('stage', i)}"
    return f"replica {stage['replica']} {name}" if "replica" in stage else name


def peer_run_entry(
    name: str, run_dir: str, requests: dict[str, Any], latency_comparable: bool, note: str
) -> dict[str, Any]:
    return {
        "name": name,
        "kind": "peer",
        "scheduler": None,
        "run_dir": run_dir,
        "overall": None,
        "stages": None,
        "requests": requests,
        "chunk_size": None,
        "latency_comparable": latency_comparable,
        "note": note,
        "capacity": None,
    }


def token_agreement(ours: dict[str, list[int]], peer: dict[str, list[int]]) -> dict[str, Any]:
    """How many requests the peer generated token for token as our first scheduler did
    (greedy on both sides): ``{num_identical, num_compared, first_mismatch}``, where
    ``first_mismatch`` is ``{request_id, index}`` of the first differing request (its first
    differing token) or ``None``. Requests missing on either side (failed) are not compared."""
    ids = [i for i in ours if i in peer and peer[i]]
    mismatch = None
    num_identical = 0
    for i in ids:
        a, b = ours[i], peer[i]
        if a == b:
            num_identical += 1
        elif mismatch is None:
            index = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            mismatch = {"request_id": i, "index": index}
    return {"num_identical": num_identical, "num_compared": len(ids), "first_mismatch": mismatch}


def ratio_entry(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """``a / b`` for each figure in ``RATIO_FIGURES`` (``None`` when not comparable)."""
    comparable = a["latency_comparable"] and b["latency_comparable"]
    out: dict[str, Any] = {"a": a["name"], "b": b["name"]}
    caps = [(r.get("capacity") or {}).get("capacity_rps") for r in (a, b)]
    out["capacity_rps"] = caps[0] / caps[1] if None not in caps else None
    for name, path, is_latency in RATIO_FIGURES:
        x, y = get_path(a["requests"], path), get_path(b["requests"], path)
        ok = x is not None and y not in (None, 0) and (comparable or not is_latency)
        out[name] = x / y if ok else None
    return out


def build_comparison(
    runs: list[dict[str, Any]], workload: dict[str, Any], config: dict[str, Any]
) -> dict[str, Any]:
    engines = [r for r in runs if r["kind"] == "engine"]
    peers = [r for r in runs if r["kind"] == "peer"]
    ratios = [ratio_entry(e, p) for p in peers for e in engines]
    ratios += [ratio_entry(engines[0], e) for e in engines[1:]]
    return {
        "schema_version": COMPARISON_VERSION,
        "workload": workload,
        "config": config,
        "runs": runs,
        "ratios": ratios,
    }


def format_table(comparison: dict[str, Any]) -> str:
    """The runs side by side (rows: figures; columns: runs), then the ratio lines."""
    runs = comparison["runs"]
    names = [r["name"] for r in runs]
    width = max(14, *(len(n) + 2 for n in names))  # "118984.31 ms" and a space
    row = lambda label, cells: f"{label:<22}" + "".join(f"{c:>{width}}" for c in cells)  # noqa: E731
    lines = [row("", names)]
    if any(r["capacity"] for r in runs):
        lines.append(row("capacity (req/s)", [_capacity_cell(r) for r in runs]))
    for label, path, unit in THROUGHPUT_ROWS:
        lines.append(row(label, [fmt(get_path(r["requests"], path), unit) for r in runs]))
    for label, path, unit in LATENCY_ROWS:
        cells = [
            fmt(get_path(r["requests"], path), unit) if r["latency_comparable"] else "n/c"
            for r in runs
        ]
        lines.append(row(label, cells))
    if any(r.get("chunk_size") for r in runs):
        lines.append(row("chunk_size", [_chunk_cell(r.get("chunk_size")) for r in runs]))
    lines.append(row("bubble fraction", [_bubble(r["overall"]) for r in runs]))
    num_stages = max((len(r["stages"]) for r in runs if r["stages"]), default=0)
    names = max((r.get("stage_names") or [] for r in runs), key=len, default=[])
    for i in range(num_stages):
        cells = [
            f"{r['stages'][i]:.3f}" if r["stages"] and i < len(r["stages"]) else "-" for r in runs
        ]
        lines.append(row(f"  {names[i] if i < len(names) else f'stage {i}'}", cells))
    if any(not r["latency_comparable"] for r in runs):
        lines.append("n/c: not comparable (the peer could not replay the arrival times)")
    for r in runs:
        if r["note"]:
            lines.append(f"{r['name']}: {r['note']}")
    for r in runs:
        if r.get("token_agreement"):
            lines.append(_agreement_line(r["name"], runs[0]["name"], r["token_agreement"]))
    for ratio in comparison["ratios"]:
        lines.append(_ratio_line(ratio))
    return "\n".join(lines)


def _agreement_line(name: str, ours: str, agreement: dict[str, Any]) -> str:
    line = (
        f"{name}: tokens identical to {ours}'s for {agreement['num_identical']}/"
        f"{agreement['num_compared']} requests"
    )
    m = agreement.get("first_mismatch")
    if m is not None:
        line += f" (first difference: request {m['request_id']}, token {m['index']})"
    return line


def _bubble(overall: dict[str, Any] | None) -> str:
    return "-" if overall is None else f"{overall['bubble_fraction']:.3f}"


def _chunk_cell(chunk: dict[str, Any] | None) -> str:
    """The budget in force: one value, or its range when it moved (``auto 512-1152``)."""
    if not chunk:
        return "-"
    auto = "auto " if chunk["auto"] else ""
    if chunk["min"] == chunk["max"]:
        return f"{auto}{chunk['final']}"
    return f"{auto}{chunk['min']}-{chunk['max']}"


def _capacity_cell(run: dict[str, Any]) -> str:
    """``X`` (bracketed), ``X-Y`` (between a passing and a failing rate), ``>=X`` (every
    probe passed) or ``not met``."""
    cap = run["capacity"]
    if not cap:
        return "-"
    if cap["capacity_rps"] is None:
        return "not met"
    if cap["bound"] == "exact":
        return f"{cap['capacity_rps']:.3g}"
    if cap.get("failed_rps") is not None:
        return f"{cap['capacity_rps']:.3g}-{cap['failed_rps']:.3g}"
    return f">={cap['capacity_rps']:.3g}"


def _ratio_line(r: dict[str, Any]) -> str:
    def x(name: str) -> str:
        v = r[name]
        return "n/c" if v is None else f"{v:.2f}x"

    capacity = "" if r.get("capacity_rps") is None else f"capacity {x('capacity_rps')}; at it: "
    return (
        f"{r['a']} / {r['b']}: {capacity}throughput {x('generated_tokens_per_s')}, "
        f"TTFT p50 {x('ttft_p50')}, TBT p50 {x('tbt_p50')}, TBT p99 {x('tbt_p99')}, "
        f"TPOT p50 {x('tpot_p50')}"
    )
