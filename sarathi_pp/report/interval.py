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

``prefill_split`` cuts a window where the last prefill leaves stage 0: before, every
micro-batch could carry a prefill chunk for decodes to ride along with (SARATHI's steady
state); after, only decode-only micro-batches remain (a closed workload's tail), whose
computes are short against the runtime's fixed cost per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from sarathi_pp.report.bubbles import BUBBLE_CLASSES, BUSY, Segment, run_span, stage_segments
from sarathi_pp.report.log import RunLog

NO_WORK = "no_work"


@dataclass(frozen=True)
class IntervalBubbles:
    start: float  # seconds on the log's clock (relative to its t0)
    end: float
    fractions: list[dict[str, float]]  # [stage_idx] -> busy and every bubble class

    def bubble_fraction(self, stage_idx: int) -> float:
        return 1.0 - self.fractions[stage_idx][BUSY]


@dataclass(frozen=True)
class PrefillSplit:
    """A window cut where the last prefill left stage 0 (see the module)."""

    start: float
    cut: float  # stage 0's compute_end of the last micro-batch with prefill tokens
    end: float
    while_prefills: float | None  # bubble fraction over [start, cut] (None: empty)
    decode_only: float | None  # bubble fraction over [cut, end] (None: empty)

    @property
    def decode_only_share(self) -> float:
        """The share of the window after the last prefill."""
        return (self.end - self.cut) / (self.end - self.start) if self.end > self.start else 0.0

    def as_dict(self) -> dict[str, float | None]:
        """``summary.json``'s ``prefill_split``."""
        return {
            "cut_s": self.cut,
            "while_prefills": self.while_prefills,
            "decode_only": self.decode_only,
            "decode_only_share": self.decode_only_share,
        }


def prefill_split(
    log: RunLog, start: float, end: float, segments: list[list[Segment]] | None = None
) -> PrefillSplit:
    """The bubble fraction (all stages: idle over their time) over ``[start, end]`` before
    and after the last micro-batch with prefill tokens left stage 0 (its ``compute_end``,
    clamped to the interval; a log without prefills is decode-only throughout).
    ``segments``: the stages' segments if at hand (``analyze``'s, which cover its run)."""
    ends = [e.compute_end for e in log.stages[0] if e.num_prefill_tokens > 0]
    cut = min(max(max(ends, default=start), start), end)
    segs = segments if segments is not None else _segments(log, end)

    def fraction(a: float, b: float) -> float | None:
        if not b > a:
            return None
        idle = sum(
            max(0.0, min(seg.end, b) - max(seg.start, a))
            for stage in segs
            for seg in stage
            if seg.label != BUSY
        )
        return idle / ((b - a) * log.num_stages)

    return PrefillSplit(start, cut, end, fraction(start, cut), fraction(cut, end))


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
    run_start = run_span(log)[0]
    span = end - start
    fractions: list[dict[str, float]] = []
    for segments in _segments(log, end):
        secs = dict.fromkeys((BUSY, *BUBBLE_CLASSES), 0.0)
        for seg in segments:
            secs[seg.label] += max(0.0, min(seg.end, end) - max(seg.start, start))
        secs[NO_WORK] += max(0.0, min(run_start, end) - start)  # before anything ran
        fractions.append({k: v / span for k, v in secs.items()})
    return IntervalBubbles(start, end, fractions)


def _segments(log: RunLog, end: float) -> list[list[Segment]]:
    """Every stage's segments, the run extended to ``end`` (see the module)."""
    run_start, run_end = run_span(log)
    out: list[list[Segment]] = []
    prev = None
    for s in range(log.num_stages):
        prev = stage_segments(log, s, prev, run_start, max(run_end, end))
        out.append(prev)
    return out


def format_interval(name: str, ib: IntervalBubbles) -> str:
    """The table ``sarathi-pp report --interval`` prints."""
    head = f"{'stage':<7}{'bubble':>9}" + "".join(f"{c:>11}" for c in BUBBLE_CLASSES)
    lines = [f"== {name}: bubbles over [{ib.start:.3f}, {ib.end:.3f}] s", head]
    for s, f in enumerate(ib.fractions):
        cells = "".join(f"{100 * f[c]:>10.2f}%" for c in BUBBLE_CLASSES)
        lines.append(f"{s:<7}{100 * ib.bubble_fraction(s):>8.2f}%{cells}")
    lines.append("(share of the interval; busy = 100% - bubble)")
    return "\n".join(lines)
