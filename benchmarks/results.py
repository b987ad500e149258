"""The results file: every benchmark run appends one JSON record (one line) to
``benchmarks/results.jsonl``; ``render_results.py`` renders the tables from it. Figures
are never typed by hand.

A script records a run in a few lines::

    run = results.Run("piggyback", argv, quick=args.quick, enabled=not args.no_record)
    run.measure("decode token cost, N=16", piggy_ms, "ms", baseline=alone_ms,
                baseline_label="decode-only", better="lower", headline="piggyback ratio")
    run.note("...")
    run.write()

Record schema (``schema`` 1), one object per line:

- ``schema``: 1; ``benchmark``: the script's name (``piggyback``); ``quick``: a ``--quick``
  (or smoke) run, on smaller sizes than the script's default;
- ``date``: UTC start of the run, ``YYYY-MM-DDTHH:MM:SSZ``; ``duration_s``: start to write;
- ``command``: the command line as run from the repository root (``python
  benchmarks/piggyback.py --quick``);
- ``commit``: ``git rev-parse HEAD`` (null outside a git checkout); ``dirty``: files other
  than markdown and this results file differ from that commit;
- ``machine``: ``common.machine_info()`` (CPU model, arch, logical CPUs, usable cores, GPU
  and count, torch, torch threads at the end, python) plus ``load_avg_1m_start`` and
  ``load_avg_1m_end`` (the 1-minute load average when the run began and ended: above the
  core count, other processes competed);
- ``settings``: the script's own parameters worth reading beside the figures (workload,
  threads, ...);
- ``measures``: a list of ``{name, value, unit, baseline, baseline_label, ratio, better,
  headline, detail}``. ``name`` is unique within the record and stable across runs (the
  renderer keeps the newest record per benchmark and name); ``baseline`` is the figure it
  is compared with, measured in the same run (``baseline_label`` names it), ``ratio`` =
  value / baseline; ``better`` is ``higher`` or ``lower`` (for the value); ``headline``,
  where set, is the label of the README's table row this measure fills; ``detail`` free text
  (e.g. which kernel won). Missing or not-a-number figures are ``null``;
- ``notes``: what a reader needs to read the figures (e.g. the machine's cores shared);
- ``checks``: ``[{what, ok}]`` for scripts that check as well as measure.

``SARATHI_PP_RESULTS_FILE`` names another file (tests use it); ``SARATHI_PP_NO_RECORD=1``
or a script's ``--no-record`` appends nothing. The file is append-only:
``.gitattributes`` merges it with ``merge=union``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCHEMA = 1
ROOT = Path(__file__).resolve().parents[1]
RESULTS_FILE = ROOT / "benchmarks" / "results.jsonl"
FILE_ENV = "SARATHI_PP_RESULTS_FILE"
NO_RECORD_ENV = "SARATHI_PP_NO_RECORD"


def results_path() -> Path:
    """``$SARATHI_PP_RESULTS_FILE`` if set, else ``benchmarks/results.jsonl``."""
    return Path(os.environ.get(FILE_ENV) or RESULTS_FILE)


def add_record_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-record",
        action="store_true",
        help=f"append nothing to the results file ({RESULTS_FILE.relative_to(ROOT)}; "
        f"also {NO_RECORD_ENV}=1)",
    )


def load_average() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _utc(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_state() -> tuple[str | None, bool | None]:
    """(commit, dirty): dirty when a file other than markdown or the results file differs
    from the commit or is untracked (a rendered page or this file does not move a figure)."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = _git("status", "--porcelain") or ""
    paths = [line[3:].split(" -> ")[-1].strip('"') for line in status.splitlines() if line]
    dirty = any(not p.endswith(".md") and not p.endswith("results.jsonl") for p in paths)
    return commit.strip(), dirty


def _number(x: float | int | None) -> float | int | None:
    """Six significant figures; JSON has no NaN or infinity: those become null."""
    if x is None or isinstance(x, bool):
        return x
    if isinstance(x, float):
        return float(f"{x:.6g}") if math.isfinite(x) else None  # 6 figures: beyond the noise
    return x


def cores_note(num_stages: int, threads_per_stage: int = 1) -> str | None:
    """The note pipeline figures need when the stages take every usable core (or more)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    need = num_stages * threads_per_stage
    if cores is None or need < cores:
        return None
    if need > cores:
        return (f"PP={num_stages} x {threads_per_stage} threads on {cores} usable cores: "
                "the stages cannot all run at once.")  # fmt: skip
    return (f"PP={num_stages}: the {num_stages} stages take all {cores} usable cores and the "
            "driver (scheduling, Ray calls) competes with them.")  # fmt: skip


class Run:
    """One run of a benchmark script: created when the run starts (its date and load average),
    filled with measures, notes and checks, then ``write()`` appends it as one line."""

    def __init__(
        self,
        benchmark: str,
        argv: list[str] | None = None,
        *,
        quick: bool = False,
        enabled: bool = True,
    ) -> None:
        self.benchmark = benchmark
        self.argv = list(sys.argv[1:] if argv is None else argv)
        self.quick = quick
        self.enabled = enabled and os.environ.get(NO_RECORD_ENV, "") in ("", "0")
        self.started = time.time()
        self.load_start = load_average()
        self.settings: dict[str, Any] = {}
        self.measures: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.checks: list[dict[str, Any]] = []

    def measure(
        self,
        name: str,
        value: float | None,
        unit: str,
        *,
        baseline: float | None = None,
        baseline_label: str | None = None,
        better: str | None = None,
        headline: str | None = None,
        detail: str | None = None,
    ) -> None:
        """One figure; ``ratio`` = value / baseline is computed here."""
        if any(m["name"] == name for m in self.measures):
            raise ValueError(f"{self.benchmark}: measure {name!r} recorded twice")
        if better not in (None, "higher", "lower"):
            raise ValueError(f"better must be 'higher' or 'lower', got {better!r}")
        ratio = value / baseline if value is not None and baseline else None
        value, baseline = _number(value), _number(baseline)
        self.measures.append(
            {
                "name": name,
                "value": value,
                "unit": unit,
                "baseline": baseline,
                "baseline_label": baseline_label,
                "ratio": _number(ratio),
                "better": better,
                "headline": headline,
                "detail": detail,
            }
        )

    def note(self, text: str | None) -> None:
        if text:
            self.notes.append(text)

    def check(self, what: str, ok: bool) -> None:
        self.checks.append({"what": what, "ok": bool(ok)})

    def record(self) -> dict[str, Any]:
        from common import machine_info  # torch: only when a record is made

        commit, dirty = git_state()
        machine = {
            **machine_info(),
            "load_avg_1m_start": self.load_start,
            "load_avg_1m_end": load_average(),
        }
        return {
            "schema": SCHEMA,
            "benchmark": self.benchmark,
            "quick": self.quick,
            "date": _utc(self.started),
            "duration_s": round(time.time() - self.started, 1),
            "command": "python " + shlex.join([f"benchmarks/{self.benchmark}.py", *self.argv]),
            "commit": commit,
            "dirty": dirty,
            "machine": machine,
            "settings": self.settings,
            "measures": self.measures,
            "notes": self.notes,
            "checks": self.checks,
        }

    def write(self, path: Path | None = None) -> Path | None:
        """Append the record; the file written, or None when recording is off."""
        if not self.enabled:
            return None
        if not self.measures and not self.checks:
            print(f"results: {self.benchmark} measured nothing; no record", file=sys.stderr)
            return None
        path = path or results_path()
        line = json.dumps(self.record(), allow_nan=False) + "\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:  # one write of one line: runs never interleave mid-line
            f.write(line)
        print(f"results: {len(self.measures)} measures appended to {path}", file=sys.stderr)
        return path
