"""Render the results file (``benchmarks/results.jsonl``, written by the benchmark scripts
through ``results.Run``) into ``docs/benchmarks/results.md`` (one table per benchmark) and
the README's table of headline results (between ``<!-- results:begin -->`` and
``<!-- results:end -->``).

Each measure (a benchmark and a measure name) shows its newest record, a full run preferred:
a ``--quick`` run's figure is shown only when no full run recorded that measure, and is
labelled *quick*. The README's rows are the measures the scripts mark ``headline``, from
full runs only (a quick run's small workload is a smoke test, not a figure to lead with),
the newest per headline label. The output depends on the results file alone (no clock),
so ``--check`` can tell whether the rendered files are current.

    python benchmarks/render_results.py            # rewrite the page and the README block
    python benchmarks/render_results.py --check    # exit 1 if either is out of date (CI)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/results.py

from results import ROOT, results_path  # noqa: E402

PAGE = ROOT / "docs" / "benchmarks" / "results.md"
README = ROOT / "README.md"
PAGE_LINK = "docs/benchmarks/results.md"  # from the README
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
# The page's order; benchmarks not named here follow, by name.
ORDER = (
    "pipeline_scaling", "vs_hf", "vs_vllm", "piggyback", "bubbles", "control_plane", "serve_load",
    "soak", "paged_attention", "linear_rows", "simulate_checks", "gpu_checks",
)  # fmt: skip


@dataclass(frozen=True)
class Figure:
    """One measure of one record: what a table row shows."""

    record: dict[str, Any]
    measure: dict[str, Any]
    index: int  # the measure's position in its record (rows keep the script's order)


def load_records(path: Path) -> list[dict[str, Any]]:
    """Every record of the file, in file order; ``ValueError`` naming the line if one is
    not a JSON object with a benchmark, a date and measures."""
    records = []
    text = path.read_text() if path.exists() else ""
    for num, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{num}: not JSON: {e}") from None
        if not isinstance(record, dict) or not {"benchmark", "date", "measures"} <= record.keys():
            raise ValueError(f"{path}:{num}: a record needs benchmark, date and measures")
        records.append(record)
    return records


def _newer(a: Figure, b: Figure | None) -> bool:
    """``a`` wins over ``b``: a full run over a quick one, then the later date (a tie goes to
    ``a``, the later line of the file)."""
    if b is None:
        return True
    return (not a.record.get("quick"), a.record["date"]) >= (
        not b.record.get("quick"),
        b.record["date"],
    )


def choose(records: list[dict[str, Any]]) -> dict[tuple[str, str], Figure]:
    """The figure shown per (benchmark, measure name)."""
    chosen: dict[tuple[str, str], Figure] = {}
    for record in records:
        for i, m in enumerate(record["measures"]):
            key = (record["benchmark"], m["name"])
            fig = Figure(record, m, i)
            if _newer(fig, chosen.get(key)):
                chosen[key] = fig
    return chosen


def headlines(records: list[dict[str, Any]]) -> list[Figure]:
    """The README's rows: per headline label, the newest figure of a full run; in the
    page's benchmark order, then the script's."""
    chosen: dict[str, Figure] = {}
    for record in records:
        if record.get("quick"):
            continue
        for i, m in enumerate(record["measures"]):
            if m.get("headline") and _newer(Figure(record, m, i), chosen.get(m["headline"])):
                chosen[m["headline"]] = Figure(record, m, i)
    return sorted(chosen.values(), key=lambda f: (_bench_rank(f.record["benchmark"]), f.index))


def _bench_rank(name: str) -> tuple[int, str]:
    return (ORDER.index(name) if name in ORDER else len(ORDER), name)


# --- formatting ------------------------------------------------------------------------------
def fmt_number(x: float | int | None) -> str:
    """About three significant figures; ``-`` for a missing figure."""
    if x is None:
        return "-"
    if isinstance(x, int) or float(x).is_integer() and abs(x) >= 100:
        return f"{x:,.0f}"
    a = abs(x)
    if a >= 100:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def fmt_value(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    if unit in ("x", "%"):
        return fmt_number(x) + unit
    return f"{fmt_number(x)} {unit}".strip()


def fmt_baseline(m: dict[str, Any]) -> str:
    if m.get("baseline") is None:
        return ""
    label = f"{m['baseline_label']}: " if m.get("baseline_label") else ""
    return label + fmt_value(m["baseline"], m["unit"])


def fmt_ratio(m: dict[str, Any]) -> str:
    return "" if m.get("ratio") is None else f"{m['ratio']:.2f}x"


def fmt_machine(record: dict[str, Any]) -> str:
    mc = record.get("machine", {})
    cpus = mc.get("usable_cores") or mc.get("logical_cpus")
    text = f"{mc.get('cpu', '?')}, {cpus} cores"
    if mc.get("gpu"):
        text += f", {mc.get('num_gpus', 1)} x {mc['gpu']}"
    a, b = mc.get("load_avg_1m_start"), mc.get("load_avg_1m_end")
    if a is not None and b is not None:
        text += f"; load {a:.2f} -> {b:.2f}"
    return text


def fmt_commit(record: dict[str, Any]) -> str:
    commit = (record.get("commit") or "?")[:7]
    return commit + (" (dirty)" if record.get("dirty") else "")


def cell(text: str) -> str:
    """Safe inside a markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def code(text: str) -> str:
    return f"`{cell(text)}`"


# --- the page --------------------------------------------------------------------------------
def render_page(records: list[dict[str, Any]]) -> str:
    chosen = choose(records)
    by_bench: dict[str, list[Figure]] = {}
    for (bench, _), fig in chosen.items():
        by_bench.setdefault(bench, []).append(fig)
    lines = [
        "# Benchmark results",
        "",
        "<!-- Rendered by `python benchmarks/render_results.py` from `benchmarks/results.jsonl`;"
        " do not edit by hand. -->",
        "",
        "Every figure here was written by a benchmark script into `benchmarks/results.jsonl` "
        "(one record per run: command, commit, machine, date, figures and the baseline from the "
        "same run) and rendered by `python benchmarks/render_results.py`. Each row is the "
        "newest record of its measure; a full run is preferred, and a figure from a `--quick` "
        "run (smaller sizes, a check that the script works more than a measurement) is marked "
        "*quick*. *ratio* = value / baseline, both from the same run. *machine* names the "
        "CPU, the cores the run could use and the 1-minute load average at its start and end: "
        "a load above the core count means other processes competed for the cores, so read "
        "the ratios before the absolute figures.",
    ]
    if not records:
        lines += ["", "No results recorded yet: run a script in `benchmarks/`."]
    for bench in sorted(by_bench, key=_bench_rank):
        lines += ["", *render_benchmark(bench, by_bench[bench])]
    return "\n".join(lines) + "\n"


def render_benchmark(bench: str, figures: list[Figure]) -> list[str]:
    """The benchmark's table (rows in the order of the newest record, older measures after),
    then the notes and checks of the runs the rows come from."""
    figures = sorted(figures, key=lambda f: (_desc(f.record["date"]), f.index, f.measure["name"]))
    lines = [
        f"## {bench}",
        "",
        "| measure | value | baseline | ratio | date | commit | machine | command |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        m, r = f.measure, f.record
        value = fmt_value(m.get("value"), m["unit"]) + (" *quick*" if r.get("quick") else "")
        name = m["name"] + (f" ({m['detail']})" if m.get("detail") else "")
        lines.append(
            "| "
            + " | ".join(
                [
                    cell(name),
                    cell(value),
                    cell(fmt_baseline(m)),
                    fmt_ratio(m),
                    r["date"][:10],
                    code(fmt_commit(r)),
                    cell(fmt_machine(r)),
                    code(r.get("command", "?")),
                ]
            )
            + " |"
        )
    runs: dict[str, dict[str, Any]] = {}
    for f in figures:
        runs.setdefault(_run_key(f.record), f.record)
    for key, r in sorted(runs.items(), key=lambda kv: _desc(kv[1]["date"])):
        extra = r.get("notes", []) + [
            ("ok: " if c["ok"] else "FAILED: ") + c["what"] for c in r.get("checks", [])
        ]
        if extra:
            lines += ["", f"Run of {key}:", ""] + [f"- {cell(x)}" for x in extra]
    return lines


def _run_key(record: dict[str, Any]) -> str:
    quick = ", quick" if record.get("quick") else ""
    return f"{record['date']}{quick} (`{fmt_commit(record)}`)"


def _desc(date: str) -> tuple[int, ...]:
    """Sorts newest first."""
    return tuple(-ord(c) for c in date)


# --- the README ------------------------------------------------------------------------------
def render_readme_block(records: list[dict[str, Any]]) -> str:
    """The lines between the markers (markers excluded)."""
    rows = headlines(records)
    if not rows:
        return "No results recorded yet (`python benchmarks/render_results.py`).\n"
    lines = [
        "| result | value | baseline | ratio | measured |",
        "|---|---|---|---|---|",
    ]
    for f in rows:
        m, r = f.measure, f.record
        mc = r.get("machine", {})
        cores = mc.get("usable_cores") or mc.get("logical_cpus")
        where = f"{r['date'][:10]}, {cores} cores" + (f", {mc['gpu']}" if mc.get("gpu") else "")
        if mc.get("load_avg_1m_start") is not None:
            where += f", load {mc['load_avg_1m_start']:.1f}"
        where += ", quick" if r.get("quick") else ""
        link = f"[{cell(m['headline'])}]({PAGE_LINK}#{r['benchmark']})"
        lines.append(
            f"| {link} | {cell(fmt_value(m.get('value'), m['unit']))} | "
            f"{cell(fmt_baseline(m))} | {fmt_ratio(m)} | {cell(where)} |"
        )
    lines += [
        "",
        f"The newest run of each (ratio = value / baseline, from the same run); commands, "
        f"machines and every other figure in [{PAGE_LINK}]({PAGE_LINK}), rendered from "
        "`benchmarks/results.jsonl` by `benchmarks/render_results.py`.",
    ]
    return "\n".join(lines) + "\n"


def replace_block(text: str, block: str) -> str | None:
    """``text`` with the lines between the markers replaced by ``block``; None without both
    markers (each on a line of its own, begin before end)."""
    lines = text.splitlines(keepends=True)
    try:
        begin = next(i for i, ln in enumerate(lines) if ln.strip() == BEGIN)
        end = next(i for i, ln in enumerate(lines) if ln.strip() == END and i > begin)
    except StopIteration:
        return None
    return "".join(lines[: begin + 1]) + block + "".join(lines[end:])


# --- main ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=None, help="default: the results file")
    p.add_argument("--page", type=Path, default=PAGE)
    p.add_argument("--readme", type=Path, default=README)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if out of date")
    args = p.parse_args(argv)
    try:
        records = load_records(args.results or results_path())
    except ValueError as e:
        print(f"render_results: error: {e}", file=sys.stderr)
        return 2
    outputs = {args.page: render_page(records)}
    readme_text = args.readme.read_text() if args.readme.exists() else ""
    readme = replace_block(readme_text, render_readme_block(records))
    if readme is None:
        print(
            f"render_results: {args.readme} has no '{BEGIN}' ... '{END}' lines: its table of "
            "results is left alone (add the two lines where the table belongs)",
            file=sys.stderr,
        )
    else:
        outputs[args.readme] = readme
    stale = [path for path, text in outputs.items() if not _same(path, text)]
    if args.check:
        for path in stale:
            print(f"render_results: {path} is out of date: run python benchmarks/render_results.py")
        return 1 if stale else 0
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(outputs[path])
        print(f"render_results: wrote {path}")
    return 0


def _same(path: Path, text: str) -> bool:
    return path.exists() and path.read_text() == text


if __name__ == "__main__":
    sys.exit(main())
