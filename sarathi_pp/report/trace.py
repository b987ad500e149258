"""``trace.json``: the run in Chrome trace event format (open it in https://ui.perfetto.dev).

One process per stage ("stage 0", ...) with two threads: ``compute`` (one complete ``X``
event per micro-batch, named ``mb <id> <kind>``, token counts in ``args``) and
``bubbles`` (one ``X`` event per idle segment, named by its class; ``args.phase`` is
``fill``, ``steady`` or ``drain``). A last process, "scheduler", holds the ``issue``
instants, the scheduler's ``idle`` spans (named by reason), the ``done`` instants and a
``chunk_size`` counter (the token budget in force, one sample per record and one at the
run's end to draw the last step); where the log records them (schema 2), a thread
``driver waits`` (``wait mb <id>``: the driver waiting for its tokens; ``args.full``: the
in-flight limit held the next micro-batch back) and a thread ``dispatch`` (``dispatch mb
<id>``: handed to the executor until stage 0 has it). Times are microseconds from the
event log's ``t0``.
"""

from __future__ import annotations

from typing import Any

from sarathi_pp.report.bubbles import BUSY, BubbleAnalysis, Segment, split_at
from sarathi_pp.report.log import RunLog

US = 1e6  # trace times are microseconds
COMPUTE_TID, BUBBLE_TID = 0, 1


def _meta(pid: int, name: str, threads: dict[int, str]) -> list[dict[str, Any]]:
    out = [
        {"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": name}},
        {
            "ph": "M",
            "pid": pid,
            "tid": 0,
            "name": "process_sort_index",
            "args": {"sort_index": pid},
        },
    ]
    out += [
        {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": n}}
        for tid, n in threads.items()
    ]
    return out


def _span(
    pid: int, tid: int, name: str, cat: str, start: float, end: float, args: dict[str, Any]
) -> dict[str, Any]:
    return {
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "name": name,
        "cat": cat,
        "ts": start * US,
        "dur": (end - start) * US,
        "args": args,
    }


def _instant(pid: int, name: str, cat: str, t: float, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "ph": "i",
        "s": "t",
        "pid": pid,
        "tid": 0,
        "name": name,
        "cat": cat,
        "ts": t * US,
        "args": args,
    }


def merge_segments(segments: list[Segment]) -> list[Segment]:
    """Adjacent segments with the same label and micro-batch joined into one."""
    out: list[Segment] = []
    for seg in segments:
        if out and out[-1].label == seg.label and out[-1].mb == seg.mb and out[-1].end == seg.start:
            out[-1] = out[-1]._replace(end=seg.end)
        else:
            out.append(seg)
    return out


def _phase(seg: Segment, analysis: BubbleAnalysis) -> str:
    w = analysis.window
    if seg.end <= w.start and seg.start < w.start:
        return "fill"
    if seg.start >= w.end and seg.end > w.end:
        return "drain"
    return "steady"


def stage_events(log: RunLog, analysis: BubbleAnalysis, s: int) -> list[dict[str, Any]]:
    pid = s + 1  # pid 0 is the kernel's idle task in some viewers
    out = _meta(pid, f"stage {s}", {COMPUTE_TID: "compute", BUBBLE_TID: "bubbles"})
    for e in log.stages[s]:
        args = {
            "mb": e.mb,
            "kind": e.kind,
            "num_prefill_tokens": e.num_prefill_tokens,
            "num_decode_tokens": e.num_decode_tokens,
            "num_tokens": e.num_prefill_tokens + e.num_decode_tokens,
        }
        out.append(
            _span(
                pid,
                COMPUTE_TID,
                f"mb {e.mb} {e.kind}",
                "compute",
                e.compute_start,
                e.compute_end,
                args,
            )
        )
    w = analysis.window
    cut = split_at(merge_segments(analysis.segments[s]), (w.start, w.end))
    for seg in cut:
        if seg.label == BUSY or seg.end <= seg.start:
            continue
        args = {"mb": seg.mb, "phase": _phase(seg, analysis)}
        out.append(_span(pid, BUBBLE_TID, seg.label, "bubble", seg.start, seg.end, args))
    return out


def scheduler_events(log: RunLog, pid: int, run_end: float | None = None) -> list[dict[str, Any]]:
    out = _meta(pid, "scheduler", {0: "scheduler", 1: "driver waits", 2: "dispatch"})
    first = log.by_mb(0)
    for i in log.issues:
        e = first.get(i.mb)
        if i.submit is not None and e is not None and e.input_ready > i.submit:
            args = {"mb": i.mb}
            out.append(
                _span(pid, 2, f"dispatch mb {i.mb}", "dispatch", i.submit, e.input_ready, args)
            )
    for w in log.waits:
        args = {"mb": w.mb, "full": w.full}
        out.append(_span(pid, 1, f"wait mb {w.mb}", "wait", w.start, w.end, args))
    for i in log.issues:
        out.append(
            _instant(
                pid,
                f"issue mb {i.mb} {i.kind}",
                "issue",
                i.t,
                {
                    "mb": i.mb,
                    "kind": i.kind,
                    "num_prefill_tokens": i.num_prefill_tokens,
                    "num_decode_tokens": i.num_decode_tokens,
                },
            )
        )
    for idle in log.idles:
        out.append(_span(pid, 0, idle.reason, "scheduler", idle.start, idle.end, {}))
    for mb, t in log.dones:
        out.append(_instant(pid, f"done mb {mb}", "done", t, {"mb": mb}))
    samples = list(log.chunk_sizes)
    if samples and run_end is not None and run_end > samples[-1][0]:
        samples.append((run_end, samples[-1][1]))
    for t, n in samples:
        out.append(
            {
                "ph": "C",
                "pid": pid,
                "tid": 0,
                "name": "chunk_size",
                "ts": t * US,
                "args": {"chunk_size": n},
            }
        )
    return out


def build_trace(log: RunLog, analysis: BubbleAnalysis) -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    for s in range(log.num_stages):
        events += stage_events(log, analysis, s)
    events += scheduler_events(log, log.num_stages + 1, analysis.run_end)
    w = analysis.window
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "steady_state": w.steady_state,
            "window_start_us": w.start * US,
            "window_end_us": w.end * US,
            "note": w.note,
        },
    }
