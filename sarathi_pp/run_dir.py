"""A run's records on disk: ``config.yaml`` (resolved) and ``requests.csv`` (per request).

The pipeline-bubble report adds ``events.jsonl`` and the report files beside these.
"""

from __future__ import annotations

import csv
from pathlib import Path

import yaml

from sarathi_pp.config import EngineConfig
from sarathi_pp.outputs import RequestOutput

REQUEST_COLUMNS = (
    "request_id", "num_prompt_tokens", "num_output_tokens", "finish_reason", "error",
    "arrival_s", "first_scheduled_s", "first_token_s", "finished_s",
    "ttft_s", "scheduling_delay_s", "e2e_s", "tbt_mean_s", "tbt_max_s", "tpot_s",
    "num_preemptions", "token_times",
)  # token_times: every generated token's time after arrival, space-separated  # times in seconds; *_s instants are relative to the run's first arrival


def prepare_run_dir(path: str | Path, overwrite: bool) -> Path:
    d = Path(path)
    if d.exists() and not d.is_dir():
        raise ValueError(f"run dir {str(d)!r} exists and is not a directory")
    if d.is_dir() and any(d.iterdir()) and not overwrite:
        raise ValueError(f"run dir {str(d)!r} is not empty; pass overwrite=True (--overwrite) to reuse it")
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_config(d: Path, config: EngineConfig) -> None:
    (d / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))


def _row(out: RequestOutput, t0: float) -> dict:
    m = out.metrics
    rel = lambda t: None if t is None else t - t0  # noqa: E731
    tbt = m.tbt
    n_out = len(out.outputs[0].token_ids)
    tpot = (m.e2e_latency - m.ttft) / (n_out - 1) if n_out > 1 and m.ttft is not None and m.e2e_latency is not None else None
    return {
        "request_id": out.request_id,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_output_tokens": n_out,
        "finish_reason": out.outputs[0].finish_reason,
        "error": out.error or "",
        "arrival_s": rel(m.arrival_time),
        "first_scheduled_s": rel(m.first_scheduled_time),
        "first_token_s": rel(m.first_token_time),
        "finished_s": rel(m.finished_time),
        "ttft_s": m.ttft,
        "scheduling_delay_s": m.scheduling_delay,
        "e2e_s": m.e2e_latency,
        "tbt_mean_s": sum(tbt) / len(tbt) if tbt else None,
        "tbt_max_s": max(tbt) if tbt else None,
        "tpot_s": tpot,
        "num_preemptions": m.num_preemptions,
        "token_times": " ".join(f"{t - m.arrival_time:.6f}" for t in m.token_times),
    }


def write_requests_csv(d: Path, outputs: list[RequestOutput]) -> None:
    t0 = min((o.metrics.arrival_time for o in outputs), default=0.0)
    with open(d / "requests.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=REQUEST_COLUMNS)
        w.writeheader()
        for out in outputs:
            w.writerow({k: ("" if v is None else v) for k, v in _row(out, t0).items()})
