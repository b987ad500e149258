"""Bubbles over a chosen interval of a run (``sarathi-pp report --interval A:B`` and the
server's ``/metrics``, which shows the last 60 s): each stage's time in ``[A, B]`` (seconds
on the log's clock) split into ``busy`` and the bubble classes, as fractions of ``B - A``.

The segments are those of the whole-run analysis (``bubbles.stage_segments``), with the run
extended to ``B`` but not past the log's last record (the end of the scheduler's last
``idle`` span, when later than the last micro-batch; the server's window adds the idle span
going on now), so the time after the last micro-batch is classified as the run's tail is
(``no_work`` while no request is there). Time in ``[A, B]`` before the run's first record
or after its last is ``no_work``: the engine had nothing at all, or no longer ran.

``fill_drain`` (``report --interval`` on a run dir): idle time before the run's
steady-state window is ``fill`` and after it ``drain``, as the summary counts them and the
timeline draws them (stage 1 waiting for its first micro-batch is the pipeline filling,
not a PB1 bubble). The server's window leaves it off: its log is the last few minutes,
whose first and last micro-batches are no pipeline's fill or drain.

A server cannot keep its whole log: ``/metrics`` analyzes the records of the last few
minutes (whole micro-batches). A stage's segments depend only on its previous micro-batch
and the stage before it, so once a few micro-batches precede ``A`` the result equals that
of the full log over the same interval; the tests check it against ``report --interval``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sarathi_pp.report.bubbles import (
    BUBBLE_CLASSES,
    BUSY,
    FILL_DRAIN,
    label_fill_drain,
    run_span,
    stage_segments,
    steady_window,
)
from sarathi_pp.report.log import RunLog

NO_WORK = "no_work"


@dataclass(frozen=True)
class IntervalBubbles:
    start: float  # seconds on the log's clock (relative to its t0)
    end: float
    fractions: list[dict[str, float]]  # [stage_idx] -> busy and every bubble class

    def bubble_fraction(self, stage_idx: int) -> float:
        return 1.0 - self.fractions[stage_idx][BUSY]


def parse_interval(text: str) -> tuple[float, float]:
    """``"A:B"`` (seconds, ``A < B``) -> ``(A, B)``; ``ValueError`` naming the text."""
    a, sep, b = text.partition(":")
    try:
        lo, hi = float(a), float(b)
    except ValueError:
        lo = hi = float("nan")
    if not sep or not lo < hi:  # also false for nan
        raise ValueError(f"--interval expects START:END in seconds with START < END, got {text!r}")
    return lo, hi


def interval_bubbles(
    log: RunLog, start: float, end: float, fill_drain: bool = False
) -> IntervalBubbles:
    """Each stage's busy time and bubbles by class over ``[start, end]`` as fractions
    (with ``fill_drain``, also ``fill`` and ``drain``: the module docstring)."""
    if not end > start:
        raise ValueError(f"the interval must have end > start, got [{start}, {end}]")
    run_start, last_mb = run_span(log)
    log_end = max([last_mb, *(i.end for i in log.idles)])  # the log's last record
    # the segments end with the interval (the tail's classes depend on where the run ends:
    # the server's window and the full log then agree) but not past the log's last record
    run_end = max(last_mb, min(end, log_end))
    window = steady_window(log, run_start, last_mb) if fill_drain else None
    span = end - start
    fractions: list[dict[str, float]] = []
    prev = None
    for s in range(log.num_stages):
        prev = stage_segments(log, s, prev, run_start, run_end)
        segments = label_fill_drain(prev, window) if window is not None else prev
        secs = dict.fromkeys((BUSY, *BUBBLE_CLASSES, *(FILL_DRAIN if fill_drain else ())), 0.0)
        for seg in segments:
            secs[seg.label] += max(0.0, min(seg.end, end) - max(seg.start, start))
        secs[NO_WORK] += max(0.0, min(run_start, end) - start)  # before anything ran
        secs[NO_WORK] += max(0.0, end - max(log_end, start))  # after the log's last record
        fractions.append({k: v / span for k, v in secs.items()})
    return IntervalBubbles(start, end, fractions)


def format_interval(name: str, ib: IntervalBubbles) -> str:
    """The table ``sarathi-pp report --interval`` prints."""
    classes = [c for c in (*BUBBLE_CLASSES, *FILL_DRAIN) if c in ib.fractions[0]]
    widths = [max(len(c), 7) + 2 for c in classes]  # a column wider than its name
    head = f"{'stage':<7}{'bubble':>9}" + "".join(f"{c:>{w}}" for c, w in zip(classes, widths))
    lines = [f"== {name}: bubbles over [{ib.start:.3f}, {ib.end:.3f}] s", head]
    for s, f in enumerate(ib.fractions):
        cells = "".join(f"{100 * f[c]:>{w - 1}.2f}%" for c, w in zip(classes, widths))
        lines.append(f"{s:<7}{100 * ib.bubble_fraction(s):>8.2f}%{cells}")
    note = "share of the interval; busy = 100% - bubble"
    if FILL_DRAIN[0] in classes:
        note += "; fill / drain: idle before / after the run's steady-state window"
    lines.append(f"({note})")
    return "\n".join(lines)
