"""Rebuild a run dir's report files from ``events.jsonl`` and ``requests.csv``:
``summary.json``, ``trace.json`` and ``timeline.png``."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sarathi_pp.records.run_dir import RunDir
from sarathi_pp.report.bubbles import BubbleAnalysis, analyze
from sarathi_pp.report.log import RunLog, load_log
from sarathi_pp.report.request_metrics import load_requests
from sarathi_pp.report.summary import build_summary
from sarathi_pp.report.trace import build_trace
from sarathi_pp.report.window import MAX_DRAWN_MICROBATCHES, head_window


@dataclass(frozen=True)
class RunReport:
    run_dir: Path
    log: RunLog
    analysis: BubbleAnalysis
    summary: dict[str, Any]


def check_run_dir(run_dir: str | Path) -> Path:
    d = Path(run_dir)
    if not d.exists():
        raise FileNotFoundError(f"run dir {str(d)!r} does not exist")
    if not d.is_dir():
        raise ValueError(f"run dir {str(d)!r} is not a directory")
    if not RunDir(d).events.exists() and (inner := run_dirs_inside(d)):
        # `sarathi-pp bench`/`simulate` write a folder of run dirs: name them
        shown = ", ".join(repr(str(p)) for p in inner[:6]) + (", ..." if len(inner) > 6 else "")
        raise FileNotFoundError(
            f"{str(d)!r} is not a run dir but holds {len(inner)}: {shown}; "
            f"`sarathi-pp report` reads those (several at once to compare them)"
        )
    return d


def run_dirs_inside(d: Path) -> list[Path]:
    """The run dirs (folders with an event log) in a benchmark's folder: its schedulers'
    (``DIR/<scheduler>/``) and a capacity search's probes (``.../probes/rate-<r>/``)."""
    found = {p.parent for p in d.glob("*/events.jsonl")}
    found |= {p.parent for p in d.glob("probes/*/events.jsonl")}
    found |= {p.parent for p in d.glob("*/probes/*/events.jsonl")}
    return sorted(found)


def analyze_run(run_dir: str | Path) -> RunReport:
    """Read and analyse a run dir; errors name the missing or bad file."""
    d = check_run_dir(run_dir)
    log = load_log(RunDir(d).events)
    rows = load_requests(RunDir(d).requests)
    # A run drawn through a window (write_files) needs no segments of the whole run.
    analysis = analyze(log, keep_segments=log.num_microbatches <= MAX_DRAWN_MICROBATCHES)
    return RunReport(d, log, analysis, build_summary(log, analysis, rows))


def write_files(report: RunReport, plot: bool = True) -> list[Path]:
    """Write summary.json, trace.json and (when ``plot`` and matplotlib is there)
    timeline.png into the run dir; the paths written."""
    d = RunDir(report.run_dir)
    written = [d.summary, d.trace]
    d.summary.write_text(json.dumps(report.summary, indent=2, allow_nan=False) + "\n")
    log, analysis, title = report.log, report.analysis, timeline_title(report)
    window = head_window(log)  # a long run: the pictures show its start
    if window is not None:
        log, analysis = window, analyze(window)
        title += f"; drawn: the first {MAX_DRAWN_MICROBATCHES} micro-batches"
    d.trace.write_text(json.dumps(build_trace(log, analysis)))
    if plot:
        try:
            from sarathi_pp.report.timeline import draw_timeline

            draw_timeline(log, analysis, d.timeline, title=title)
            written.append(d.timeline)
        except ImportError:
            warnings.warn(
                "matplotlib is not installed: no timeline.png (pip install matplotlib)",
                stacklevel=2,
            )
    return written


def timeline_title(report: RunReport) -> str:
    s = report.summary
    state = "steady state" if s["steady_state"] else "whole run (too short for a steady state)"
    return (
        f"{report.run_dir.name}: scheduler {s.get('scheduler') or '?'}, "
        f"{s['num_stages']} stages, {s['overall']['num_microbatches']} micro-batches; "
        f"bubble fraction {s['overall']['bubble_fraction']:.1%} over the {state}"
    )


def write_report(run_dir: str | Path, plot: bool = True) -> dict[str, Any]:
    """Rebuild ``summary.json``, ``trace.json`` and ``timeline.png`` in ``run_dir`` from its
    ``events.jsonl`` and ``requests.csv``; returns the summary.

    ``FileNotFoundError`` / ``ValueError`` naming the file when one is missing or invalid.
    """
    report = analyze_run(run_dir)
    write_files(report, plot=plot)
    return report.summary
