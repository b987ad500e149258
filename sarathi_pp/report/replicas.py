"""The records of data-parallel replicas in total: each replica records into its own run dir
``<run dir>/replica-<i>/`` (which ``sarathi-pp report`` reads as any run dir), and the run dir
itself gets the merged ``requests.csv`` and a ``summary.json`` whose ``requests`` pool every
request, ``stages`` list every replica's stages in turn (each with its ``replica``) and
``overall`` sums them. The runtime's replicas (``engine/replicas.py``) and the simulator's
(``sim/cluster.py``) write the same layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sarathi_pp.outputs import RequestOutput
from sarathi_pp.records.run_dir import RunDir
from sarathi_pp.report.bubbles import BUBBLE_CLASSES
from sarathi_pp.report.log import load_log
from sarathi_pp.report.request_bubbles import request_bubble_times
from sarathi_pp.report.request_metrics import distribution, load_requests, request_summary

REPLICA_PREFIX = "replica-"


def replica_dir(run_dir: str | Path, replica_idx: int) -> Path:
    """Where replica ``replica_idx`` records."""
    return Path(run_dir) / f"{REPLICA_PREFIX}{replica_idx}"


def replica_dirs(run_dir: str | Path) -> list[Path]:
    """The replicas' run dirs of a data-parallel run's dir, in replica order; ``[]`` for a
    run dir of one pipeline (it has its own ``events.jsonl``) or anything else."""
    d = Path(run_dir)
    if not d.is_dir() or RunDir(d).events.exists():
        return []
    found = [p for p in d.glob(f"{REPLICA_PREFIX}*") if p.is_dir() and RunDir(p).events.exists()]
    suffix = lambda p: p.name[len(REPLICA_PREFIX) :]  # noqa: E731
    return sorted((p for p in found if suffix(p).isdigit()), key=lambda p: int(suffix(p)))


def write_total(
    run_dir: Path,
    dirs: list[Path],
    outputs: list[RequestOutput],
    summaries: list[dict[str, Any] | None],
    **fields: Any,
) -> dict[str, Any]:
    """Write the run dir's total (``requests.csv`` of ``outputs``, every finished engine
    request of every replica; ``summary.json``) over the replicas' run dirs ``dirs`` and their
    ``summaries``; ``fields`` join the summary (``routing``, ``replicas_lost``)."""
    run = RunDir(run_dir)
    run.write_requests(outputs)
    rows = load_requests(run.requests)
    times: list[float] = []
    for d in dirs:
        if RunDir(d).events.exists() and RunDir(d).requests.exists():
            got = request_bubble_times(
                load_log(RunDir(d).events), load_requests(RunDir(d).requests)
            )
            times += got or []
    ids = [int(d.name[len(REPLICA_PREFIX) :]) for d in dirs]  # replica-<i>: i
    parts = [(i, s) for i, s in zip(ids, summaries, strict=True) if s is not None]
    if not parts:
        raise RuntimeError(f"no replica of {run_dir} wrote its records")
    first = parts[0][1]
    summary = {
        "schema_version": 1,
        "num_stages": first["num_stages"],
        "scheduler": first["scheduler"],
        "replicas": len(dirs),
        **fields,
        "replica_dirs": [d.name for d in dirs],
        "stages": [{**s, "replica": i} for i, p in parts for s in p["stages"]],
        "overall": merge_overall([p["overall"] for _, p in parts]),
        "requests": {**request_summary(rows), "bubble_time_s": distribution(times)},
        "chunk_size": first.get("chunk_size"),
    }
    run.summary.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def merge_overall(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Several pipelines' ``overall`` entries as one: times and counts summed."""
    keys = ("busy_s", "idle_s", "window_s", "fill_s", "drain_s", "fill_drain_s", "num_microbatches")
    out: dict[str, Any] = {k: sum(e[k] for e in entries) for k in keys}
    out["bubbles_s"] = {c: sum(e["bubbles_s"][c] for e in entries) for c in BUBBLE_CLASSES}
    out["bubble_fraction"] = out["idle_s"] / out["window_s"] if out["window_s"] > 0 else 0.0
    kinds = {k for e in entries for k in e["microbatches_by_kind"]}
    out["microbatches_by_kind"] = {
        k: sum(e["microbatches_by_kind"].get(k, 0) for e in entries) for k in sorted(kinds)
    }
    return out
