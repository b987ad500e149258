"""``sarathi-pp report RUN_DIR [RUN_DIR ...]``: rebuild each run's report files and print
its table; with two or more runs, print them side by side with ratios (the first run
against each other one). Runs are named by their dir name.

A data-parallel run's dir stands for its replicas' run dirs (``replica-<i>/``), compared
side by side.

A missing or invalid run dir, ``events.jsonl`` or ``requests.csv`` is a usage error (exit 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from sarathi_pp.cli.common import user_errors


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "report",
        help="rebuild a run's bubble report; compare runs",
        description="Rebuild summary.json, trace.json and timeline.png in each RUN_DIR from "
        "its events.jsonl and requests.csv and print the bubble and request tables; with two "
        "or more runs, compare them side by side (the first against each other one).",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run dir (runs/<name>)")
    p.add_argument(
        "--no-write", dest="write", action="store_false", help="only print; write no files"
    )
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip timeline.png")
    p.add_argument(
        "--interval",
        metavar="START:END",
        help="only print each stage's bubbles by class over [START, END] (seconds on the "
        "run's clock, as `sarathi-pp serve`'s /metrics gives them; a negative START as "
        "--interval=-30:30); writes no files",
    )
    p.set_defaults(func=run)


def run_names(run_dirs: list[str]) -> list[str]:
    """Each run's dir name; the path as given where two runs share a name."""
    names = [Path(d).resolve().name or d for d in run_dirs]
    return [d if names.count(n) > 1 else n for n, d in zip(names, run_dirs, strict=True)]


def with_replicas(run_dirs: list[str]) -> list[str]:
    """``run_dirs`` with a data-parallel run's dir (no ``events.jsonl`` of its own: the
    total's ``summary.json`` and ``requests.csv`` beside ``replica-<i>/``) given as its
    replicas' run dirs, each read and compared as any run."""
    from sarathi_pp.report.replicas import replica_dirs

    out: list[str] = []
    for d in run_dirs:
        out += [str(r) for r in replica_dirs(d)] or [d]
    return out


def run(args: argparse.Namespace) -> int:
    from sarathi_pp.report.text import format_comparison, format_run
    from sarathi_pp.report.writer import analyze_run, write_files

    args.run_dirs = with_replicas(args.run_dirs)
    if args.interval is not None:
        return run_interval(args)
    with user_errors():
        reports = [analyze_run(d) for d in args.run_dirs]
    names = run_names(args.run_dirs)
    for r in reports:
        if args.write:
            for path in write_files(r, plot=args.plot):
                print(f"wrote {path}", file=sys.stderr)
    if len(reports) == 1:
        print(format_run(names[0], reports[0].summary))
    else:
        print(format_comparison(names, [r.summary for r in reports]))
    return 0


def run_interval(args: argparse.Namespace) -> int:
    from sarathi_pp.records.run_dir import RunDir
    from sarathi_pp.report.interval import format_interval, interval_bubbles, parse_interval
    from sarathi_pp.report.log import load_log
    from sarathi_pp.report.writer import check_run_dir

    with user_errors():
        start, end = parse_interval(args.interval)
        logs = [load_log(RunDir(check_run_dir(d)).events) for d in args.run_dirs]
    for name, log in zip(run_names(args.run_dirs), logs, strict=True):
        print(format_interval(name, interval_bubbles(log, start, end, fill_drain=True)))
    return 0
