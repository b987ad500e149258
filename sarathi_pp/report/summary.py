"""``summary.json``: bubbles per stage and overall, micro-batch statistics, request metrics.

Layout (times in seconds)::

    schema_version, num_stages, scheduler, steady_state, steady_state_note,
    run:    {start_s, end_s, duration_s}       # relative to the event log's t0
    window: {start_s, end_s, duration_s}       # the steady state (or the run, see the note)
    stages: [{stage, busy_s, idle_s, window_s, bubble_fraction, bubbles_s: {class: s},
              families_s: {shape, runtime, no_work}, fill_s, drain_s, fill_drain_s,
              microbatches: {prefill|decode|hybrid|all: {count, compute_mean_s, compute_cv}},
              stalls: {count, excess_s, listed: [{mb, kind, compute_s, expected_s}]}}]
            # stalls: micro-batches that computed far longer than their shape predicts
            # (``compute_stalls``); absent from an older summary
    overall: {busy_s, idle_s, window_s, bubble_fraction, bubbles_s, families_s, fill_s,
              drain_s, fill_drain_s, num_microbatches, microbatches_by_kind: {kind: count}}
    requests: see ``request_metrics.request_summary``, and ``bubble_time_s`` (p50, p90,
            p99, max, mean; all null for an older log: ``request_bubbles``)
    prefill_split: {cut_s, while_prefills, decode_only, decode_only_share,
                    request_bubble_time_s: {while_prefills, decode_only}}
            # the window cut where the last prefill left stage 0 (``bubbles.PrefillSplit``):
            # the bubble fraction of all stages before and after (null: that part is empty),
            # and the share of the window after; absent from an older summary.
            # request_bubble_time_s: each phase's per-request bubble time (p50, p90, p99,
            # max, mean over the requests that lived in it: ``phase_bubble_times``)
    chunk_size: {auto, initial, final, min, max, num_changes, changes: [[t_s, chunk_size]]}
            # the token budget over the run, from the log's chunk_size records (``changes``
            # lists every record, the first is the budget at the first micro-batch); null
            # without records (a policy that runs whole prompts, an older log)

``overall`` sums the stages; its ``bubble_fraction`` is total idle / total window.
``families_s`` groups ``bubbles_s``: ``shape`` (PB1-PB3, ``hybrid``: what SARATHI's
micro-batches remove), ``runtime`` (every other class but ``no_work``: what the runtime
adds, the load's own share ``load`` included) and ``no_work``; they add up to ``idle_s``.
"""

from __future__ import annotations

import statistics
from itertools import pairwise
from typing import Any

from sarathi_pp.microbatch import StageEvent
from sarathi_pp.report.bubbles import (
    BUBBLE_CLASSES,
    RUNTIME_CLASSES,
    SHAPE_CLASSES,
    BubbleAnalysis,
    StageBubbles,
)
from sarathi_pp.report.log import KINDS, RunLog
from sarathi_pp.report.request_bubbles import phase_bubble_times, request_bubble_times
from sarathi_pp.report.request_metrics import RequestRow, distribution, request_summary

SUMMARY_VERSION = 1


def build_summary(log: RunLog, analysis: BubbleAnalysis, rows: list[RequestRow]) -> dict[str, Any]:
    w = analysis.window
    stages = [_stage_entry(b, log.stages[b.stage_idx]) for b in analysis.stages]
    return {
        "schema_version": SUMMARY_VERSION,
        "num_stages": log.num_stages,
        "scheduler": (log.config.get("scheduler") or {}).get("policy"),
        "steady_state": w.steady_state,
        "steady_state_note": w.note,
        "run": _span(analysis.run_start, analysis.run_end),
        "window": _span(w.start, w.end),
        "stages": stages,
        "overall": _overall(analysis.stages, log),
        "prefill_split": prefill_split_entry(log, analysis, rows),
        "requests": requests_entry(log, rows),
        "chunk_size": chunk_size_summary(log),
        "attention": attention_summary(log),
    }


def attention_summary(log: RunLog) -> list[dict[str, Any]] | None:
    """Per stage, in stage order, the attention backend that ran and every fallback it took
    (``{"stage", "backend", "fallbacks"}``; ``backend`` None for a stage that recorded none);
    ``None`` when the log has no ``attention`` record (an older or simulated run)."""
    if not log.attention:
        return None
    out = []
    for s in range(log.num_stages):
        backend, fallbacks = log.attention.get(s, (None, ()))
        out.append({"stage": s, "backend": backend, "fallbacks": list(fallbacks)})
    return out


def prefill_split_entry(
    log: RunLog, analysis: BubbleAnalysis, rows: list[RequestRow]
) -> dict[str, Any]:
    """The prefill split with each phase's per-request bubble time."""
    phases = phase_bubble_times(log, rows, analysis.prefill_split.cut)
    before, after = phases or ([], [])
    return {
        **analysis.prefill_split.as_dict(),
        "request_bubble_time_s": {
            "while_prefills": distribution(before),
            "decode_only": distribution(after),
        },
    }


def requests_entry(log: RunLog, rows: list[RequestRow]) -> dict[str, Any]:
    """The request metrics with each request's pipeline bubble time."""
    times = request_bubble_times(log, rows)
    return {**request_summary(rows), "bubble_time_s": distribution(times or [])}


def chunk_size_summary(log: RunLog) -> dict[str, Any] | None:
    """The token budget over time; ``None`` when the log has no ``chunk_size`` record."""
    if not log.chunk_sizes:
        return None
    values = [v for _, v in log.chunk_sizes]
    return {
        "auto": (log.config.get("scheduler") or {}).get("chunk_size") == "auto",
        "initial": values[0],
        "final": values[-1],
        "min": min(values),
        "max": max(values),
        "num_changes": sum(1 for a, b in pairwise(values) if a != b),
        "changes": [[t, v] for t, v in log.chunk_sizes],
    }


def _span(start: float, end: float) -> dict[str, float]:
    return {"start_s": start, "end_s": end, "duration_s": end - start}


def _bubble_entry(
    busy: float, window: float, bubbles: dict[str, float], fill: float, drain: float
) -> dict[str, Any]:
    idle = sum(bubbles.values())
    return {
        "busy_s": busy,
        "idle_s": idle,
        "window_s": window,
        "bubble_fraction": idle / window if window > 0 else 0.0,
        "bubbles_s": {c: bubbles[c] for c in BUBBLE_CLASSES},
        "families_s": families(bubbles),
        "fill_s": fill,
        "drain_s": drain,
        "fill_drain_s": fill + drain,
    }


def families(bubbles: dict[str, float]) -> dict[str, float]:
    """Seconds by family: ``shape``, ``runtime`` and ``no_work`` (see the module)."""
    return {
        "shape": sum(bubbles[c] for c in SHAPE_CLASSES),
        "runtime": sum(bubbles[c] for c in RUNTIME_CLASSES),
        "no_work": bubbles["no_work"],
    }


def _stage_entry(b: StageBubbles, events: tuple[StageEvent, ...]) -> dict[str, Any]:
    entry = _bubble_entry(b.busy_s, b.window_s, b.bubbles_s, b.fill_s, b.drain_s)
    return {
        "stage": b.stage_idx,
        **entry,
        "microbatches": microbatch_stats(events),
        "stalls": compute_stalls(events),
    }


def _overall(stages: list[StageBubbles], log: RunLog) -> dict[str, Any]:
    bubbles = {c: sum(b.bubbles_s[c] for b in stages) for c in BUBBLE_CLASSES}
    entry = _bubble_entry(
        sum(b.busy_s for b in stages),
        sum(b.window_s for b in stages),
        bubbles,
        sum(b.fill_s for b in stages),
        sum(b.drain_s for b in stages),
    )
    counts = {k: sum(1 for e in log.stages[0] if e.kind == k) for k in KINDS}
    return {**entry, "num_microbatches": log.num_microbatches, "microbatches_by_kind": counts}


def microbatch_stats(events: tuple[StageEvent, ...]) -> dict[str, dict[str, Any]]:
    """Count, mean and coefficient of variation (std / mean) of compute time, by kind."""
    groups: dict[str, list[float]] = {k: [] for k in (*KINDS, "all")}
    for e in events:
        d = e.compute_end - e.compute_start
        groups["all"].append(d)
        groups[e.kind].append(d)
    return {kind: _mean_cv(xs) for kind, xs in groups.items()}


def _mean_cv(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"count": 0, "compute_mean_s": None, "compute_cv": None}
    mean = sum(xs) / len(xs)
    std = (sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5  # population std
    return {
        "count": len(xs),
        "compute_mean_s": mean,
        "compute_cv": std / mean if mean > 0 else None,
    }


# Note [compute stalls]: a micro-batch whose compute took far longer than its shape predicts
# on its stage (a page's first touch in a VM whose host backs memory on demand, a garbage
# collection, the hypervisor taking the core) delays the stages after it, and the wait it
# causes is counted in the class the shapes give it (``hybrid`` between two hybrids, PB1
# between two prefills) or, looping back, in stage 0's ``in_flight``: the classes say where
# the time went, these say why. Predicted: for a decode-only micro-batch the median compute
# of the stage's decode-only ones (they cost a read of the stage's weights whatever their
# size); for the others their kind's median compute per token times their tokens, but never
# less than the stage's 10th-percentile micro-batch (a few tokens still read the weights). A
# stall is more than STALL_FACTOR times that and STALL_MIN_S more: legitimate differences of
# shape (a decode-only micro-batch of 32 decodes against one of 4, a prefill chunk late in a
# long prompt) stay under it.
STALL_FACTOR = 3.0
STALL_MIN_S = 0.05
MAX_LISTED_STALLS = 8


def compute_stalls(events: tuple[StageEvent, ...]) -> dict[str, Any]:
    """One stage's compute stalls (Note [compute stalls]): how many, their seconds past the
    prediction, and the longest ``MAX_LISTED_STALLS`` (in micro-batch order)."""
    computes = [e.compute_end - e.compute_start for e in events]
    if not computes:
        return {"count": 0, "excess_s": 0.0, "listed": []}
    floor = sorted(computes)[len(computes) // 10]
    decode = [d for e, d in zip(events, computes, strict=True) if e.kind == "decode"]
    decode_median = statistics.median(decode) if decode else 0.0
    per_token: dict[str, list[float]] = {}
    for e, d in zip(events, computes, strict=True):
        if e.kind != "decode" and _tokens(e):
            per_token.setdefault(e.kind, []).append(d / _tokens(e))
    medians = {k: statistics.median(v) for k, v in per_token.items()}
    stalls: list[tuple[float, StageEvent, float, float]] = []  # excess, event, compute, predicted
    for e, d in zip(events, computes, strict=True):
        if e.kind == "decode":
            expected = decode_median
        else:
            expected = max(medians.get(e.kind, 0.0) * _tokens(e), floor)
        if d > STALL_FACTOR * expected + STALL_MIN_S:
            stalls.append((d - expected, e, d, expected))
    longest = sorted(stalls, key=lambda x: x[0], reverse=True)[:MAX_LISTED_STALLS]
    return {
        "count": len(stalls),
        "excess_s": sum(x[0] for x in stalls),
        "listed": [
            {"mb": e.mb, "kind": e.kind, "compute_s": d, "expected_s": p}
            for _, e, d, p in sorted(longest, key=lambda x: x[1].mb)
        ],
    }


def _tokens(e: StageEvent) -> int:
    return e.num_prefill_tokens + e.num_decode_tokens
