"""A synthetic run: a small pipeline simulator that writes ``events.jsonl`` and
``requests.csv`` in the engine's formats, for tests and for looking at the report without
a model (``python -m sarathi_pp.report.synthetic RUN_DIR`` then ``sarathi-pp report``).

Stage 0 runs the micro-batches back to back (after any scheduler idle gap before one and a
fixed control-plane overhead); stage s > 0 starts a micro-batch once it is free and the
hidden states arrived (``send_s`` after stage s-1's compute, then ``transfer_s``). The
driver has a micro-batch's tokens ``return_s`` after the last stage sent them. With
``driver_records`` the log has schema 2's driver fields (``issue.submit`` halfway through
the overhead, ``done.wait`` from the later of the previous ``done`` and the micro-batch's
issue, ``done.full`` on every other micro-batch); without them it reads as an older log.
"""

from __future__ import annotations

import csv
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from sarathi_pp.records.events import SCHEMA_VERSION
from sarathi_pp.records.run_dir import REQUEST_COLUMNS, RunDir


@dataclass(frozen=True)
class MB:
    kind: str
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0


@dataclass(frozen=True)
class SimConfig:
    num_stages: int = 2
    compute_s: Callable[[int, MB], float] = lambda s, mb: 0.01  # (stage_idx, mb) -> seconds
    send_s: float = 0.0  # compute_end -> send_end on every stage
    transfer_s: float = 0.0  # send_end on stage s-1 -> input_ready on stage s
    overhead_s: float = 0.0  # stage 0: issue -> input_ready
    start_s: float = 0.0  # the first issue
    idle_before: dict[int, tuple[str, float]] = field(default_factory=dict)  # mb -> (reason, s)
    policy: str = "sarathi"
    return_s: float = 0.0  # the last stage's send_end -> the done record
    driver_records: bool = False  # issue.submit, done.wait, done.full (schema 2)


def simulate(mbs: list[MB], cfg: SimConfig) -> list[dict[str, Any]]:
    """The event records of running ``mbs`` (ids 0, 1, ...) through the pipeline."""
    records: list[dict[str, Any]] = [
        {
            "type": "header",
            "schema_version": SCHEMA_VERSION,
            "num_stages": cfg.num_stages,
            "t0": 1000.0,
            "config": {"scheduler": {"policy": cfg.policy}},
        }
    ]
    free = [cfg.start_s] * cfg.num_stages  # when each stage finished sending its previous one
    prev_done = cfg.start_s
    for j, mb in enumerate(mbs):
        t = free[0]
        if j in cfg.idle_before:
            reason, d = cfg.idle_before[j]
            records.append({"type": "idle", "start": t, "end": t + d, "reason": reason})
            t += d
        issue = {
            "type": "issue",
            "mb": j,
            "t": t,
            "kind": mb.kind,
            "num_prefill_tokens": mb.num_prefill_tokens,
            "num_decode_tokens": mb.num_decode_tokens,
        }
        if cfg.driver_records:
            issue["submit"] = t + cfg.overhead_s / 2
        records.append(issue)
        ready = t + cfg.overhead_s
        for s in range(cfg.num_stages):
            start = max(ready, free[s])
            end = start + cfg.compute_s(s, mb)
            rec = _stage_record(s, j, mb, free[s], ready, start, end, end + cfg.send_s)
            records.append(rec)
            free[s] = rec["send_end"]
            ready = rec["send_end"] + cfg.transfer_s
        done = {"type": "done", "mb": j, "t": free[-1] + cfg.return_s}
        if cfg.driver_records:
            done.update(wait=min(max(prev_done, t), done["t"]), full=j % 2 == 0)
        prev_done = done["t"]
        records.append(done)
    return records


def _stage_record(
    s: int, j: int, mb: MB, wait: float, ready: float, start: float, end: float, send_end: float
) -> dict[str, Any]:
    return {
        "type": "stage",
        "stage": s,
        "mb": j,
        "kind": mb.kind,
        "num_prefill_tokens": mb.num_prefill_tokens,
        "num_decode_tokens": mb.num_decode_tokens,
        "wait_start": wait,
        "input_ready": ready,
        "compute_start": start,
        "compute_end": end,
        "send_end": send_end,
    }


def write_events(path: str | Path, records: list[dict[str, Any]]) -> None:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))


def request_rows(num_requests: int, seed: int = 0, num_tokens: int = 8) -> list[dict[str, Any]]:
    """``requests.csv`` rows (with ``token_times``) of made-up but consistent requests."""
    rng = random.Random(seed)
    rows = []
    for i in range(num_requests):
        arrival = i * 0.05
        sched = arrival + rng.uniform(0.0, 0.02)
        times = [sched - arrival + rng.uniform(0.02, 0.1)]
        for _ in range(num_tokens - 1):
            times.append(times[-1] + rng.uniform(0.01, 0.04))
        rows.append(
            {
                "request_id": str(i),
                "num_prompt_tokens": 100,
                "num_output_tokens": num_tokens,
                "finish_reason": "length",
                "error": "",
                "arrival_s": arrival,
                "first_scheduled_s": sched,
                "first_token_s": arrival + times[0],
                "finished_s": arrival + times[-1],
                "ttft_s": times[0],
                "scheduling_delay_s": sched - arrival,
                "e2e_s": times[-1],
                "tbt_mean_s": (times[-1] - times[0]) / (num_tokens - 1) if num_tokens > 1 else "",
                "tbt_max_s": max((b - a for a, b in pairwise(times)), default=""),
                "tpot_s": "",
                "num_preemptions": 0,
                "token_times": " ".join(repr(t) for t in times),
            }
        )
    return rows


def write_requests(
    path: str | Path, rows: list[dict[str, Any]], columns: list[str] | None = None
) -> None:
    """``rows`` as ``requests.csv`` (``columns`` default: the engine's)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns or list(REQUEST_COLUMNS), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def mixed_workload(num_microbatches: int, seed: int = 0) -> list[MB]:
    """Prefills, decodes and hybrids in the proportions a vLLM-like run shows."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_microbatches):
        kind = rng.choices(["prefill", "decode", "hybrid"], weights=[2, 5, 3])[0]
        p = rng.randint(64, 512) if kind != "decode" else 0
        d = rng.randint(4, 32) if kind != "prefill" else 0
        out.append(MB(kind, p, d))
    return out


def mixed_compute_s(stage_idx: int, mb: MB) -> float:
    """A made-up cost model: per-token prefill cost plus a fixed decode-step floor."""
    return 0.002 + 4e-5 * mb.num_prefill_tokens + 1e-4 * mb.num_decode_tokens + 5e-4 * stage_idx


def write_demo_run(
    run_dir: str | Path, num_stages: int = 2, num_microbatches: int = 60, seed: int = 0
) -> Path:
    d = Path(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    gaps = {
        j: (rng.choice(["dependency", "no_work"]), rng.uniform(0.002, 0.01))
        for j in range(1, num_microbatches)
        if rng.random() < 0.1
    }
    cfg = SimConfig(
        num_stages=num_stages,
        compute_s=mixed_compute_s,
        send_s=2e-4,
        transfer_s=3e-4,
        overhead_s=5e-4,
        idle_before=gaps,
        policy="vllm",
    )
    write_events(RunDir(d).events, simulate(mixed_workload(num_microbatches, seed), cfg))
    write_requests(RunDir(d).requests, request_rows(max(1, num_microbatches // 4), seed))
    return d


if __name__ == "__main__":
    print(write_demo_run(sys.argv[1] if len(sys.argv) > 1 else "runs/synthetic"))
