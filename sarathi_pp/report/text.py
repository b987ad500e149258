"""Plain-text tables of summaries: one run, or several side by side with ratios."""

from __future__ import annotations

from typing import Any

from sarathi_pp.report.bubbles import RUNTIME_CLASSES, SHAPE_CLASSES

DIST_ROWS = (
    ("ttft", "ttft_s"),
    ("tbt", "tbt_s"),
    ("tpot", "tpot_s"),
    ("e2e", "e2e_s"),
    ("sched delay", "scheduling_delay_s"),
)
# (label, path into the summary, unit, word for "first run is smaller", for "larger")
COMPARED = (
    ("bubble fraction", ("overall", "bubble_fraction"), "", "fewer", "more"),
    ("bubble while prefills", ("prefill_split", "while_prefills"), "", "fewer", "more"),
    ("bubble after prefills", ("prefill_split", "decode_only"), "", "fewer", "more"),
    ("decode-only share", ("prefill_split", "decode_only_share"), "", "smaller", "larger"),
    ("ttft p50", ("requests", "ttft_s", "p50"), "ms", "lower", "higher"),
    ("ttft p99", ("requests", "ttft_s", "p99"), "ms", "lower", "higher"),
    ("tbt p50", ("requests", "tbt_s", "p50"), "ms", "lower", "higher"),
    ("tbt p99", ("requests", "tbt_s", "p99"), "ms", "lower", "higher"),
    ("tpot p50", ("requests", "tpot_s", "p50"), "ms", "lower", "higher"),
    ("e2e p50", ("requests", "e2e_s", "p50"), "ms", "lower", "higher"),
    ("generated tokens/s", ("requests", "generated_tokens_per_s"), "", "lower", "higher"),
    ("requests/s", ("requests", "requests_per_s"), "", "lower", "higher"),
    ("prefix cache hit rate", ("requests", "prefix_cache", "hit_rate"), "", "lower", "higher"),
)


def get_path(summary: Any, path: tuple[str, ...]) -> Any:
    """``summary[path[0]][path[1]]...``, or ``None`` where a level is missing."""
    for key in path:
        summary = summary.get(key) if isinstance(summary, dict) else None
    return summary


def fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    if unit == "ms":
        return f"{v * 1e3:.2f} ms"
    return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"


def _pct(x: float, window: float) -> str:
    return f"{x / window:.1%}" if window > 0 else "-"


def _kinds(summary: dict[str, Any]) -> str:
    o = summary["overall"]
    by = ", ".join(f"{n} {k}" for k, n in o["microbatches_by_kind"].items())
    return f"{o['num_microbatches']} micro-batches: {by}"


# Shown only when some stage has them: the unsplit rest of an older log, stage recovery.
_RARE_CLASSES = ("dependency", "recovery")


def _secs(e: dict[str, Any], c: str) -> float:
    return e["bubbles_s"].get(c, 0.0)  # an older summary lacks the split classes


def family_secs(e: dict[str, Any]) -> dict[str, float]:
    """``shape``, ``runtime`` and ``no_work`` seconds of a summary entry (an older
    summary's entry, without ``families_s``, summed from its classes)."""
    if "families_s" in e:
        return e["families_s"]
    return {
        "shape": sum(_secs(e, c) for c in SHAPE_CLASSES),
        "runtime": sum(_secs(e, c) for c in RUNTIME_CLASSES),
        "no_work": _secs(e, "no_work"),
    }


def runtime_columns(entries: list[dict[str, Any]]) -> tuple[str, ...]:
    """The runtime classes to show: all but the rare ones no entry has."""
    return tuple(
        c for c in RUNTIME_CLASSES if c not in _RARE_CLASSES or any(_secs(e, c) for e in entries)
    )


def _table(title: str, classes: tuple[str, ...], entries: list[tuple[str, Any]]) -> list[str]:
    widths = [max(8, len(c) + 2) for c in classes]
    cols = list(zip(classes, widths, strict=True))
    lines = [title, f"{'stage':<6}" + "".join(f"{c:>{w}}" for c, w in cols)]
    for name, e in entries:
        cells = "".join(f"{_pct(_secs(e, c), e['window_s']):>{w}}" for c, w in cols)
        lines.append(f"{name:<6}{cells}")
    return lines


def _bubble_rows(summary: dict[str, Any]) -> list[str]:
    entries = [(str(e["stage"]), e) for e in summary["stages"]] + [("all", summary["overall"])]
    head = f"{'stage':<6}{'bubble':>8}{'shape':>9}{'runtime':>9}{'no_work':>9}"
    lines = [head + f"{'fill+drain':>12}"]
    for name, e in entries:
        f = family_secs(e)
        cells = "".join(f"{_pct(f[k], e['window_s']):>9}" for k in ("shape", "runtime", "no_work"))
        lines.append(f"{name:<6}{e['bubble_fraction']:>8.1%}{cells}{e['fill_drain_s']:>11.4f}s")
    lines += _table("shape classes (what SARATHI removes):", SHAPE_CLASSES, entries)
    runtime = runtime_columns([e for _, e in entries])
    lines += _table("runtime classes (what the runtime adds; load: the load's own share):",
                    runtime, entries)  # fmt: skip
    lines.append(
        "(bubble and classes: share of the stage's window; fill+drain: idle seconds outside it)"
    )
    split = prefill_split_text(summary)
    if split is not None:
        lines.append(split)
    lines += stalls_text(summary)
    return lines


def stalls_text(summary: dict[str, Any]) -> list[str]:
    """The stages' compute stalls (``summary.compute_stalls``), a line each stage that has
    any; nothing for an older summary or a run without."""
    stages = [e for e in summary["stages"] if (e.get("stalls") or {}).get("count")]
    if not stages:
        return []
    lines = [
        "compute stalls (a micro-batch > 3x what its shape predicts on its stage; the waits "
        "they cause are in the classes above):"
    ]
    for e in stages:
        st = e["stalls"]
        shown = ", ".join(
            f"mb {x['mb']} {x['compute_s']:.3f} s (~{x['expected_s']:.3f})" for x in st["listed"]
        )
        more = (
            f" and {st['count'] - len(st['listed'])} more"
            if st["count"] > len(st["listed"])
            else ""
        )
        lines.append(
            f"  stage {e['stage']}: {st['count']}, {st['excess_s']:.3f} s past the prediction: "
            f"{shown}{more}"
        )
    return lines


def prefill_split_text(summary: dict[str, Any]) -> str | None:
    """The window's bubble before and after the last prefill left stage 0 (``None``: an
    older summary, or a window all on one side)."""
    p = summary.get("prefill_split")
    if not p or p["while_prefills"] is None or p["decode_only"] is None:
        return None
    text = (
        f"bubble while prefills remain {p['while_prefills']:.1%}, after the last prefill "
        f"(at {p['cut_s']:.3f} s; decode-only micro-batches, {p['decode_only_share']:.0%} "
        f"of the window) {p['decode_only']:.1%}"
    )
    per_request = p.get("request_bubble_time_s") or {}
    before, after = per_request.get("while_prefills"), per_request.get("decode_only")
    if before and after and before["p50"] is not None and after["p50"] is not None:
        text += (
            f"; per request p50/p99 {before['p50']:.4f}/{before['p99']:.4f} s while prefills "
            f"remain, {after['p50']:.4f}/{after['p99']:.4f} s after"
        )
    return text


def _request_rows(req: dict[str, Any]) -> list[str]:
    lines = [
        f"requests: {req['num_requests']}, {req['num_generated_tokens']} tokens generated "
        f"in {fmt(req['duration_s'])} s: {fmt(req['generated_tokens_per_s'])} tokens/s, "
        f"{fmt(req['requests_per_s'])} requests/s"
    ]
    lines.append(
        f"{'(ms)':<12}" + "".join(f"{k:>10}" for k in ("p50", "p90", "p99", "max", "mean"))
    )
    for label, key in DIST_ROWS:
        d = req[key]
        cells = "".join(
            f"{'-' if d[k] is None else f'{d[k] * 1e3:.2f}':>10}"
            for k in ("p50", "p90", "p99", "max", "mean")
        )
        lines.append(f"{label:<12}{cells}")
    if req.get("tbt_source") == "tbt_mean_s":
        lines.append("(tbt from per-request means: requests.csv has no token_times)")
    if (pc := req.get("prefix_cache")) is not None:
        rate = "-" if pc["hit_rate"] is None else f"{pc['hit_rate']:.1%}"
        lines.append(
            f"prefix cache: {pc['hit_tokens']} of {pc['queried_tokens']} prompt tokens "
            f"cached ({rate}) over {pc['num_requests']} requests"
        )
    return lines


def chunk_size_text(summary: dict[str, Any]) -> str | None:
    """``chunk_size auto: 256 at the start, 384 at the end (256-512, 5 changes)``, or
    ``chunk_size 256``; ``None`` when the summary has none (older ones lack the key)."""
    c = summary.get("chunk_size")
    if not c:
        return None
    if not c["auto"] and c["num_changes"] == 0:
        return f"chunk_size {c['final']}"
    head = "chunk_size auto" if c["auto"] else "chunk_size"
    return (
        f"{head}: {c['initial']} at the start, {c['final']} at the end "
        f"({c['min']}-{c['max']}, {c['num_changes']} changes)"
    )


def attention_text(summary: dict[str, Any]) -> list[str]:
    """``attention: stage 0 flex_paged, stage 1 flex_paged (no fallback)``, then one line per
    fallback (``  stage 1 fell back: ...``); empty when the summary has none (older ones
    lack the key)."""
    entries = summary.get("attention")
    if not entries:
        return []
    backends = ", ".join(f"stage {e['stage']} {e['backend'] or '?'}" for e in entries)
    fallbacks = [(e["stage"], f) for e in entries for f in e["fallbacks"]]
    lines = [f"attention: {backends}" + ("" if fallbacks else " (no fallback)")]
    lines += [f"  stage {s} fell back: {f}" for s, f in fallbacks]
    return lines


def _chunk_cell(summary: dict[str, Any]) -> str:
    """``256``, or ``auto 256-512`` (the range the budget took)."""
    c = summary.get("chunk_size")
    if not c:
        return "-"
    span = str(c["min"]) if c["min"] == c["max"] else f"{c['min']}-{c['max']}"
    return f"auto {span}" if c["auto"] else span


def format_run(name: str, summary: dict[str, Any]) -> str:
    w = summary["window"]
    lines = [
        f"== {name} (scheduler {summary.get('scheduler') or '?'}, "
        f"{summary['num_stages']} stage{'' if summary['num_stages'] == 1 else 's'}, "
        f"{_kinds(summary)})"
    ]
    chunk = chunk_size_text(summary)
    if chunk is not None:
        lines.append(chunk)
    lines += attention_text(summary)
    if summary["steady_state"]:
        lines.append(
            f"steady-state window {w['start_s']:.4f}-{w['end_s']:.4f} s "
            f"({w['duration_s']:.4f} s); fill and drain reported apart"
        )
    else:
        lines.append(summary["steady_state_note"])
    return "\n".join(lines + _bubble_rows(summary) + _request_rows(summary["requests"]))


def ratio_text(
    label: str,
    names: tuple[str, str],
    values: tuple[float | None, float | None],
    unit: str,
    words: tuple[str, str],
) -> str:
    """``bubble fraction a 0.040 vs b 0.310: 7.8x fewer`` (``a`` relative to ``b``)."""
    a, b = values
    head = f"{label} {names[0]} {fmt(a, unit)} vs {names[1]} {fmt(b, unit)}"
    if a is None or b is None:
        return f"{head}: not comparable"
    if a == b:
        return f"{head}: the same"
    word = words[0] if a < b else words[1]
    small, large = sorted((abs(a), abs(b)))
    if small == 0:
        return f"{head}: {word} (one is zero)"
    r = large / small
    return f"{head}: {r:.2f}x {word}" if r < 2 else f"{head}: {r:.1f}x {word}"


def format_comparison(names: list[str], summaries: list[dict[str, Any]]) -> str:
    width = max(14, *(len(n) + 2 for n in names))
    row = lambda label, cells: f"{label:<26}" + "".join(f"{c:>{width}}" for c in cells)  # noqa: E731
    lines = [row("", names), row("scheduler", [s.get("scheduler") or "?" for s in summaries])]
    lines.append(row("chunk_size", [_chunk_cell(s) for s in summaries]))
    for label, path, unit, *_ in COMPARED:
        lines.append(row(label, [fmt(get_path(s, path), unit) for s in summaries]))
    num_stages = max(s["num_stages"] for s in summaries)
    for i in range(num_stages):
        lines.append(
            row(
                f"  stage {i} bubbles",
                [
                    f"{s['stages'][i]['bubble_fraction']:.3f}" if i < len(s["stages"]) else "-"
                    for s in summaries
                ],
            )
        )
    overall = [s["overall"] for s in summaries]
    runtime = runtime_columns(overall)
    families = (("shape", SHAPE_CLASSES), ("runtime", runtime), ("no_work", ()))
    for family, classes in families:
        cells = [_pct(family_secs(o)[family], o["window_s"]) for o in overall]
        lines.append(row(f"  {family} (of window)", cells))
        for c in classes:
            lines.append(row(f"    {c}", [_pct(_secs(o, c), o["window_s"]) for o in overall]))
    for other, s in zip(names[1:], summaries[1:], strict=True):
        lines.append(f"{names[0]} vs {other}:")
        for label, path, unit, low, high in COMPARED:
            values = (get_path(summaries[0], path), get_path(s, path))
            lines.append("  " + ratio_text(label, (names[0], other), values, unit, (low, high)))
    return "\n".join(lines)
