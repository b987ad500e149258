"""``timeline.png``: stages as rows, micro-batches as boxes coloured by kind, bubbles as thin
bars under each row coloured by class, the scheduler's idle spans on a row of their own (with
its issue ticks and, when the log has it, the chunk_size budget as a step line), and the
pipeline fill and drain shaded grey.

The picture says what ``summary.json`` says: idle time before the steady-state window is
drawn as ``fill`` and after it as ``drain`` (hatched grey, whatever its class: the summary
counts it as ``fill_s``/``drain_s``, not as PB1-PB3), the bars inside the window carry the
classes the summary counts, and the legend lists only what the picture shows. The bubble
colours differ from the micro-batch kinds' (the ``hybrid`` bubble is not the hybrid box's
colour). ``bubble_bars`` and ``legend_entries`` are what is drawn, as values.

Drawn with matplotlib's object API on an Agg canvas (no ``pyplot``: nothing global
changes for a caller that plots too). matplotlib is a base dependency; should it be missing,
``draw_timeline`` raises ``ImportError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sarathi_pp.report.bubbles import (
    BUBBLE_CLASSES,
    BUSY,
    FILL_DRAIN,
    BubbleAnalysis,
    label_fill_drain,
)
from sarathi_pp.report.log import IDLE_REASONS, KINDS, RunLog
from sarathi_pp.report.trace import merge_segments

KIND_COLORS = {"prefill": "#3b6fb6", "decode": "#5fb35f", "hybrid": "#9a6fc4"}
CLASS_COLORS = {
    "PB1": "#d62728",
    "PB2": "#ff7f0e",
    "PB3": "#e6c229",
    "hybrid": "#f4a6a6",  # salmon: apart from the hybrid micro-batch's purple
    "comm": "#17becf",
    "load": "#393b79",
    "in_flight": "#8c564b",
    "token_return": "#d6616b",
    "driver": "#637939",
    "schedule": "#7f7f7f",
    "dispatch": "#00a087",
    "ring": "#e377c2",
    "dependency": "#a55194",
    "recovery": "#bcbd22",
    "no_work": "#1a1a1a",
}
FILL_DRAIN_STYLE = {"facecolors": "#d9d9d9", "edgecolor": "#9a9a9a", "hatch": "////"}
LABEL_MAX_MICROBATCHES = 40  # above this many per stage the boxes are too narrow for ids
BOX = (0.42, 0.5)  # a stage row's micro-batch boxes: (bottom offset, height)
BAR = (0.12, 0.22)  # its bubble bar under them
CHUNK_BAND = (0.45, 0.4)  # the scheduler row's chunk_size line: (bottom offset, height)
LABEL_MAX_CHUNK_CHANGES = 12  # above this many the budget's values are not written


def _time_unit(duration: float) -> tuple[float, str]:
    return (1e3, "ms") if duration < 2.0 else (1.0, "s")


def _stage_rows(ax: Any, log: RunLog, analysis: BubbleAnalysis, scale: float) -> None:
    label = log.num_microbatches <= LABEL_MAX_MICROBATCHES
    for s in range(log.num_stages):
        y = log.num_stages - 1 - s  # stage 0 on top
        for kind in KINDS:
            spans = [
                ((e.compute_start) * scale, (e.compute_end - e.compute_start) * scale)
                for e in log.stages[s]
                if e.kind == kind
            ]
            ax.broken_barh(
                spans,
                (y + BOX[0], BOX[1]),
                facecolors=KIND_COLORS[kind],
                edgecolor="white",
                linewidth=0.4,
            )
        if label:
            for e in log.stages[s]:
                ax.text(
                    (e.compute_start + e.compute_end) / 2 * scale,
                    y + BOX[0] + BOX[1] / 2,
                    str(e.mb),
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white",
                )
        bars = bubble_bars(analysis, s)
        for cls in (*BUBBLE_CLASSES, *FILL_DRAIN):
            spans = [(a * scale, (b - a) * scale) for a, b, label in bars if label == cls]
            if not spans:
                continue
            # an edge as wide as a pixel keeps sub-pixel gaps visible in a long run
            style = (
                {**FILL_DRAIN_STYLE, "linewidth": 0.3}
                if cls in FILL_DRAIN
                else {"facecolors": CLASS_COLORS[cls], "edgecolor": CLASS_COLORS[cls]}
            )
            ax.broken_barh(spans, (y + BAR[0], BAR[1]), **{"linewidth": 0.5, **style})


def bubble_bars(analysis: BubbleAnalysis, s: int) -> list[tuple[float, float, str]]:
    """Stage ``s``'s idle time as drawn: ``(start, end, label)``, the class inside the
    steady-state window, ``fill`` before it and ``drain`` after it (a run without a steady
    state: its whole span is the window, as in the summary)."""
    segs = label_fill_drain(merge_segments(analysis.segments[s]), analysis.window)
    return [(g.start, g.end, g.label) for g in segs if g.label != BUSY and g.end > g.start]


def legend_entries(log: RunLog, analysis: BubbleAnalysis) -> list[tuple[str, str]]:
    """``(label, key)`` of what the picture shows, in a fixed order: the micro-batch kinds
    that ran (key: the kind), the bubble classes drawn, ``fill/drain`` when drawn, and the
    scheduler's idle reasons (key: ``idle:<reason>``)."""
    kinds = {e.kind for e in log.stages[0]}
    drawn = {label for s in range(log.num_stages) for *_, label in bubble_bars(analysis, s)}
    reasons = {i.reason for i in log.idles if i.end > i.start}
    out = [(f"{k} micro-batch", k) for k in KINDS if k in kinds]
    out += [(f"bubble: {c}", c) for c in BUBBLE_CLASSES if c in drawn]
    if drawn & set(FILL_DRAIN):
        out.append(("fill / drain (idle outside the window)", "fill"))
    out += [(f"scheduler idle: {r}", f"idle:{r}") for r in IDLE_REASONS if r in reasons]
    return out


def _scheduler_row(ax: Any, log: RunLog, scale: float) -> None:
    y = log.num_stages
    for reason in IDLE_REASONS:
        spans = [
            (i.start * scale, (i.end - i.start) * scale) for i in log.idles if i.reason == reason
        ]
        if spans:
            ax.broken_barh(spans, (y + BAR[0], BAR[1]), facecolors=CLASS_COLORS[reason])
    ts = [i.t * scale for i in log.issues]
    ax.vlines(ts, y + 0.4, y + 0.8, colors="#444444", linewidth=0.5)


def _chunk_size_line(ax: Any, log: RunLog, run_end: float, scale: float) -> None:
    """The budget in force as a step line over the scheduler row, low to high."""
    if not log.chunk_sizes:
        return
    ts = [t for t, _ in log.chunk_sizes] + [max(run_end, log.chunk_sizes[-1][0])]
    values = [v for _, v in log.chunk_sizes]
    lo, hi = min(values), max(values)
    y0 = log.num_stages + CHUNK_BAND[0]
    ys = [y0 + CHUNK_BAND[1] * ((v - lo) / (hi - lo) if hi > lo else 0.5) for v in values]
    ax.step([t * scale for t in ts], [*ys, ys[-1]], where="post", color="#d62728", linewidth=1)
    if len(values) <= LABEL_MAX_CHUNK_CHANGES:
        for t, v, y in zip(ts[:-1], values, ys, strict=True):
            ax.text(t * scale, y, f" {v}", fontsize=6, color="#d62728", va="bottom")


def _yticks(ax: Any, log: RunLog, analysis: BubbleAnalysis) -> None:
    labels = [
        f"stage {s}\nbubbles {analysis.stages[s].idle_s / analysis.window.duration:.0%}"
        if analysis.window.duration > 0
        else f"stage {s}"
        for s in range(log.num_stages)
    ]
    ticks = [log.num_stages - 1 - s + 0.5 for s in range(log.num_stages)]
    sched = "scheduler\n(idle | issue)" + ("\n+ chunk_size" if log.chunk_sizes else "")
    ax.set_yticks([*ticks, log.num_stages + 0.5], [*labels, sched])
    ax.set_ylim(0, log.num_stages + 1)


def _shade_fill_drain(ax: Any, analysis: BubbleAnalysis, scale: float) -> None:
    w = analysis.window
    ax.set_xlim(analysis.run_start * scale, analysis.run_end * scale)
    if not w.steady_state:
        return
    for lo, hi, name in ((analysis.run_start, w.start, "fill"), (w.end, analysis.run_end, "drain")):
        if hi > lo:
            ax.axvspan(lo * scale, hi * scale, color="#000000", alpha=0.07, linewidth=0)
            ax.text(
                (lo + hi) / 2 * scale,
                0.995,  # the top of the scheduler row, above its issue ticks
                name,
                ha="center",
                va="top",
                fontsize=7,
                color="#555555",
                transform=ax.get_xaxis_transform(),
            )


def _legend(fig: Any, log: RunLog, analysis: BubbleAnalysis) -> None:
    from matplotlib.patches import Patch

    handles = []
    for label, key in legend_entries(log, analysis):
        if key in KIND_COLORS:
            handles.append(Patch(color=KIND_COLORS[key], label=label))
        elif key == "fill":
            st = FILL_DRAIN_STYLE
            handles.append(
                Patch(facecolor=st["facecolors"], edgecolor=st["edgecolor"], hatch=st["hatch"],
                      label=label)
            )  # fmt: skip
        else:
            handles.append(Patch(color=CLASS_COLORS[key.removeprefix("idle:")], label=label))
    fig.legend(handles=handles, loc="lower center", ncol=6, fontsize=7, frameon=False)


def draw_timeline(
    log: RunLog, analysis: BubbleAnalysis, path: str | Path, title: str | None = None
) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    scale, unit = _time_unit(analysis.run_end - analysis.run_start)
    width = min(24.0, max(10.0, 0.15 * log.num_microbatches + 4))
    fig = Figure(figsize=(width, 1.6 + 0.9 * (log.num_stages + 1)), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    _layout(fig, ax)
    _stage_rows(ax, log, analysis, scale)
    _scheduler_row(ax, log, scale)
    _chunk_size_line(ax, log, analysis.run_end, scale)
    _yticks(ax, log, analysis)
    _shade_fill_drain(ax, analysis, scale)
    ax.set_xlabel(f"time ({unit}, from the event log's t0)")
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    ax.set_axisbelow(True)
    if title:
        ax.set_title(title, fontsize=9, loc="left")
    _legend(fig, log, analysis)
    fig.savefig(path)


def _layout(fig: Any, ax: Any) -> None:
    """Fixed margins in inches: legend and axis label below, title above."""
    w_in, h_in = fig.get_size_inches()
    bottom, top = 1.0 / h_in, 0.35 / h_in
    ax.set_position((1.2 / w_in, bottom, 1 - 1.45 / w_in, 1 - bottom - top))
