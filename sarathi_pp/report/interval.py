"""Bubbles over a chosen interval of a run (``sarathi-pp report --interval A:B`` and the
server's ``/metrics``, which shows the last 60 s): each stage's time in ``[A, B]`` (seconds
on the log's clock) split into ``busy`` and the bubble classes, as fractions of ``B - A``.

The segments are those of the whole-run analysis (``bubbles.stage_segments``), with the run
extended to ``B`` so the time after the last micro-batch is classified as the run's tail
is (the scheduler's ``idle`` records: ``no_work`` while no request is there). Time in
``[A, B]`` before the run's first record is ``no_work``: the engine had nothing at all.

A server cannot keep its whole log: ``/metrics`` analyzes the records of the last few
minutes (whole micro-batches). A stage's segments depend only on its previous micro-batch
and the stage before it, so once a few micro-batches precede ``A`` the result equals that
of the full log over the same interval; the tests check it against ``report --interval``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sarathi_pp.report.bubbles import BUBBLE_CLASSES, BUSY, run_span, stage_segments
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


def interval_bubbles(log: RunLog, start: float, end: float) -> IntervalBubbles:
    """Each stage's busy time and bubbles by class over ``[start, end]`` as fractions."""
    if not end > start:
        raise ValueError(f"the interval must have end > start, got [{start}, {end}]")
    run_start, run_end = run_span(log)
    run_end = max(run_end, end)
    span = end - start
    fractions: list[dict[str, float]] = []
    prev = None
    for s in range(log.num_stages):
        prev = stage_segments(log, s, prev, run_start, run_end)
        secs = dict.fromkeys((BUSY, *BUBBLE_CLASSES), 0.0)
        for seg in prev:
            secs[seg.label] += max(0.0, min(seg.end, end) - max(seg.start, start))
        secs[NO_WORK] += max(0.0, min(run_start, end) - start)  # before anything ran
        fractions.append({k: v / span for k, v in secs.items()})
    return IntervalBubbles(start, end, fractions)


def format_interval(name: str, ib: IntervalBubbles) -> str:
    """The table ``sarathi-pp report --interval`` prints."""
    head = f"{'stage':<7}{'bubble':>9}" + "".join(f"{c:>11}" for c in BUBBLE_CLASSES)
    lines = [f"== {name}: bubbles over [{ib.start:.3f}, {ib.end:.3f}] s", head]
    for s, f in enumerate(ib.fractions):
        cells = "".join(f"{100 * f[c]:>10.2f}%" for c in BUBBLE_CLASSES)
        lines.append(f"{s:<7}{100 * ib.bubble_fraction(s):>8.2f}%{cells}")
    lines.append("(share of the interval; busy = 100% - bubble)")
    return "\n".join(lines)
