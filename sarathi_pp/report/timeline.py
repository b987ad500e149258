"""``timeline.png``: stages as rows, micro-batches as boxes coloured by kind, bubbles as thin
bars under each row coloured by class, the scheduler's idle spans on a row of their own (with
its issue ticks and, when the log has it, the chunk_size budget as a step line), and the
pipeline fill and drain shaded grey.

Drawn with matplotlib's object API on an Agg canvas (no ``pyplot``: nothing global
changes for a caller that plots too). matplotlib is a base dependency; should it be missing,
``draw_timeline`` raises ``ImportError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sarathi_pp.report.bubbles import BUBBLE_CLASSES, BUSY, BubbleAnalysis
from sarathi_pp.report.log import KINDS, RunLog
from sarathi_pp.report.trace import merge_segments

KIND_COLORS = {"prefill": "#3b6fb6", "decode": "#5fb35f", "hybrid": "#9a6fc4"}
CLASS_COLORS = {
    "PB1": "#d62728",
    "PB2": "#ff7f0e",
    "PB3": "#e6c229",
    "hybrid": "#e377c2",
    "comm": "#17becf",
    "dependency": "#8c564b",
    "schedule": "#7f7f7f",
    "recovery": "#bcbd22",
    "no_work": "#1a1a1a",
}
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
        segs = [g for g in merge_segments(analysis.segments[s]) if g.label != BUSY]
        for cls in BUBBLE_CLASSES:
            spans = [(g.start * scale, (g.end - g.start) * scale) for g in segs if g.label == cls]
            # an edge as wide as a pixel keeps sub-pixel gaps visible in a long run
            ax.broken_barh(
                spans,
                (y + BAR[0], BAR[1]),
                facecolors=CLASS_COLORS[cls],
                edgecolor=CLASS_COLORS[cls],
                linewidth=0.5,
            )


def _scheduler_row(ax: Any, log: RunLog, scale: float) -> None:
    y = log.num_stages
    for reason in ("no_work", "dependency", "recovery"):
        spans = [
            (i.start * scale, (i.end - i.start) * scale) for i in log.idles if i.reason == reason
        ]
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


def _legend(fig: Any, ax: Any) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=KIND_COLORS[k], label=f"{k} micro-batch") for k in KINDS]
    handles += [Patch(color=CLASS_COLORS[c], label=f"bubble: {c}") for c in BUBBLE_CLASSES]
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
    _legend(fig, ax)
    fig.savefig(path)


def _layout(fig: Any, ax: Any) -> None:
    """Fixed margins in inches: legend and axis label below, title above."""
    w_in, h_in = fig.get_size_inches()
    bottom, top = 1.0 / h_in, 0.35 / h_in
    ax.set_position((1.2 / w_in, bottom, 1 - 1.45 / w_in, 1 - bottom - top))
