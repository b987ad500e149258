"""Pipeline bubbles: each stage's time cut into compute and idle gaps classified by cause.

Spans (all from ``events.jsonl``; ``s`` a stage, ``j`` a micro-batch, ``j-1`` the one the
same stage computed before ``j``):

- run: from the first ``issue`` (or the first ``compute_start`` if earlier / no issues) to
  the last ``send_end`` of any stage.
- window (steady state): from the last stage's first ``compute_start`` to stage 0's last
  ``compute_end``. If that is empty (fewer micro-batches than it takes to fill the
  pipeline) the run is too short for a steady state: ``steady_state`` is false, the note
  says so and the window is the whole run.

Every stage's run is cut into contiguous segments, each ``busy`` or one bubble class:

1. ``busy``: ``[compute_start(j), compute_end(j)]``.
2. ``comm`` (sending): ``[compute_end(j), send_end(j)]``, cut short at the next
   ``compute_start`` (or the run's end).
3. The wait for ``j``: from where 2. ended for ``j-1`` (the run's start for the first
   micro-batch) to ``compute_start(j)``; it includes ``input_ready -> compute_start``.

   - Stage 0, up to ``r = input_ready(j)`` (the micro-batch reached the stage): where a scheduler
     ``idle`` record overlaps, its reason (``no_work`` / ``dependency`` / ``recovery``); elsewhere
     ``schedule``. After ``r`` (the micro-batch is there, compute not started): ``schedule``.
     Then ``dependency`` and ``schedule`` are cut into their measured parts (``load``,
     ``in_flight``, ``token_return``, ``driver``; ``dispatch``): ``runtime_split.py``.
   - Stage s > 0, split at ``c = compute_end(s-1, j)``: after ``c`` (the transfer and
     receive) is ``comm``. Before ``c`` (length ``L``): let ``G`` be stage s-1's own wait
     for ``j`` restricted to its scheduler classes (``no_work``, ``dependency``,
     ``schedule`` and their parts; themselves possibly passed down from stage s-2), in time
     order. The last
     ``min(L, |G|)`` seconds of ``G``, with their classes and order, fill the start of the
     wait; the rest takes the kinds of ``j-1`` and ``j`` on stage s, checked in this order:
     ``hybrid`` if either is hybrid, ``PB1`` if both are prefill, ``PB3`` if both are
     decode, else ``PB2``. For the first micro-batch (no ``j-1``) the kind of ``j`` is
     paired with itself.

     Why by amount and not by overlap in time: stage s-1 starting ``j`` late by ``g`` for
     the scheduler delays stage s by up to ``g`` one compute later, when stage s-1 is
     already computing ``j``; overlap in time would call that delay a PB bubble (in a
     balanced pipeline every stage-0 gap shorter than a compute would reach the later
     stages as PB). By amount, the PB part is what the compute times of consecutive
     micro-batches explain (stage s-1's ``j`` against stage s's ``j-1``), and a gap that
     stage s absorbed while still busy (``L < |G|``) is not counted twice.
4. After the stage's last micro-batch (to the run's end): stage 0 as in 3. without ``r``;
   stage s > 0 as in 3. with ``c`` the run's end and ``G`` stage s-1's scheduler classes
   after its last micro-batch; the rest is ``schedule``.

Per stage the window is the sum of the segments clipped to it, so ``busy + idle == window``
and the classes add up to ``idle``. Idle time outside the window is ``fill_s`` (before)
and ``drain_s`` (after), reported apart; both are zero when there is no steady state.

``prefill_split`` cuts the window where the last micro-batch with prefill tokens leaves
stage 0 (its ``compute_end``): before, every micro-batch could carry a prefill chunk for
decodes to ride along with (SARATHI's steady state); after, only decode-only micro-batches
remain (a closed workload's tail), short against the runtime's fixed cost per micro-batch.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import NamedTuple

from sarathi_pp.report.log import RunLog
from sarathi_pp.report.runtime_split import (
    DEPENDENCY,
    LEGACY_CLASS,
    SCHEDULE,
    dependency_rest,
    dependency_spans,
    dispatch_spans,
)

# The shape classes: what SARATHI's micro-batches remove (their compute times differ).
SHAPE_CLASSES = ("PB1", "PB2", "PB3", "hybrid")
# The runtime classes: what the runtime adds (``runtime_split.py``); ``load`` is the load's
# own share (too few sequences to fill the micro-batches in flight), ``dependency`` the
# unsplit rest of an older log, ``recovery`` the engine replacing a lost stage.
RUNTIME_CLASSES = (
    "comm", "load", "in_flight", "token_return", "driver", "schedule", "dispatch", "ring",
    DEPENDENCY, "recovery",
)  # fmt: skip
BUBBLE_CLASSES = (*SHAPE_CLASSES, *RUNTIME_CLASSES, "no_work")
SCHEDULER_CLASSES = ("no_work", DEPENDENCY, SCHEDULE, "recovery", *LEGACY_CLASS)
BUSY = "busy"


class Segment(NamedTuple):
    """``[start, end]`` of one stage spent ``label`` (``busy`` or a bubble class).

    ``mb``: the micro-batch computed (busy), sent (comm after compute) or waited for (a
    gap); ``None`` after the stage's last micro-batch.
    """

    start: float
    end: float
    label: str
    mb: int | None


@dataclass(frozen=True, slots=True)
class Window:
    start: float
    end: float
    steady_state: bool
    note: str

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class StageBubbles:
    stage_idx: int
    busy_s: float
    idle_s: float
    window_s: float
    bubbles_s: dict[str, float]  # every class of BUBBLE_CLASSES
    fill_s: float
    drain_s: float

    @property
    def bubble_fraction(self) -> float:
        return self.idle_s / self.window_s if self.window_s > 0 else 0.0


@dataclass(frozen=True)
class PrefillSplit:
    """The window cut where the last prefill left stage 0 (see the module)."""

    start: float
    cut: float  # stage 0's compute_end of the last micro-batch with prefill tokens, clamped
    end: float
    while_prefills: float | None  # bubble fraction of all stages over [start, cut] (None: empty)
    decode_only: float | None  # over [cut, end]

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


@dataclass(frozen=True)
class BubbleAnalysis:
    run_start: float
    run_end: float
    window: Window
    stages: list[StageBubbles]
    # [stage_idx], contiguous over the run; empty lists when analysed without keeping them
    segments: list[list[Segment]] = field(repr=False)
    prefill_split: PrefillSplit


def analyze(log: RunLog, split: bool = True, keep_segments: bool = True) -> BubbleAnalysis:
    """``split=False``: ``dependency`` and ``schedule`` whole (what their parts add up to);
    ``keep_segments=False``: the figures only (stage s needs stage s-1's segments, so at
    most two stages' are held: a simulated run of 600,000 micro-batches x 8 stages would
    hold 5 GB of them for pictures that show its first 2,000)."""
    run_start, run_end = run_span(log)
    window = steady_window(log, run_start, run_end)
    ends = [e.compute_end for e in log.stages[0] if e.num_prefill_tokens > 0]
    cut = min(max(max(ends, default=window.start), window.start), window.end)
    segments: list[list[Segment]] = []
    stages: list[StageBubbles] = []
    before = after = 0.0  # idle seconds of all stages in the window, before / after ``cut``
    prev: list[Segment] | None = None
    for s in range(log.num_stages):
        segs = stage_segments(log, s, prev, run_start, run_end, split)
        stages.append(stage_bubbles(s, segs, window, run_start, run_end))
        before += _idle_in(segs, window.start, cut)
        after += _idle_in(segs, cut, window.end)
        segments.append(segs if keep_segments else [])
        prev = segs

    def fraction(idle: float, a: float, b: float) -> float | None:
        return idle / ((b - a) * log.num_stages) if b > a else None

    prefill = PrefillSplit(
        window.start, cut, window.end,
        fraction(before, window.start, cut), fraction(after, cut, window.end),
    )  # fmt: skip
    return BubbleAnalysis(run_start, run_end, window, stages, segments, prefill)


def _idle_in(segments: list[Segment], a: float, b: float) -> float:
    """Seconds of ``segments`` other than ``busy`` inside ``[a, b]``."""
    return sum(max(0.0, min(g.end, b) - max(g.start, a)) for g in segments if g.label != BUSY)


def run_span(log: RunLog) -> tuple[float, float]:
    start = min(stage[0].compute_start for stage in log.stages)
    if log.issues:
        start = min(start, log.issues[0].t)
    end = max(e.send_end for stage in log.stages for e in stage)
    return start, end


def steady_window(log: RunLog, run_start: float, run_end: float) -> Window:
    first_last = log.stages[-1][0].compute_start
    last_first = log.stages[0][-1].compute_end
    if last_first > first_last:
        return Window(
            first_last,
            last_first,
            True,
            "steady state: from the last stage's first micro-batch to stage 0's last",
        )
    return Window(
        run_start,
        run_end,
        False,
        f"run too short for a steady state (the last stage started its first "
        f"micro-batch at {first_last:.6g} s, after stage 0 ended its last at "
        f"{last_first:.6g} s): the whole run is used and fill/drain are not apart",
    )


def pb_class(prev_kind: str | None, kind: str) -> str:
    """The bubble class of a wait for a ``kind`` micro-batch after a ``prev_kind`` one."""
    prev_kind = prev_kind or kind
    if "hybrid" in (prev_kind, kind):
        return "hybrid"
    if prev_kind == kind:
        return "PB1" if kind == "prefill" else "PB3"
    return "PB2"


def paint(a: float, b: float, spans: list[Segment], default: str, mb: int | None) -> list[Segment]:
    """``[a, b]`` cut into segments: ``spans`` (sorted, disjoint) where they overlap, else
    ``default``; contiguous, first start ``a``, last end ``b``. Empty if ``b <= a``."""
    if not spans:  # the common case, once per stage per micro-batch: no list walk
        return [Segment(a, b, default, mb)] if b > a else []
    out: list[Segment] = []
    cursor = a
    first = bisect.bisect_right(spans, a, key=lambda sp: sp.end)  # ends sorted: spans disjoint
    for i in range(first, len(spans)):  # not spans[first:]: a copy per call is quadratic
        sp = spans[i]
        if sp.start >= b:
            break
        x, y = max(sp.start, cursor), min(sp.end, b)
        if y <= x:
            continue
        if x > cursor:
            out.append(Segment(cursor, x, default, mb))
        out.append(Segment(x, y, sp.label, mb))
        cursor = y
    if cursor < b:
        out.append(Segment(cursor, b, default, mb))
    return out


def pass_down(
    a: float, c: float, spans: list[Segment], default: str, mb: int | None
) -> list[Segment]:
    """``[a, c]`` cut into segments: the last ``c - a`` seconds of ``spans`` (sorted, disjoint;
    their labels, laid end to end from ``a``), then ``default``. Empty if ``c <= a``."""
    if c <= a:
        return []
    total = sum(sp.end - sp.start for sp in spans)
    skip = max(0.0, total - (c - a))  # the earlier part, absorbed while stage s was busy
    out: list[Segment] = []
    t = a
    for sp in spans:
        d = sp.end - sp.start - skip
        skip = max(0.0, -d)
        if d > 0 and t < c:
            out.append(Segment(t, min(t + d, c), sp.label, mb))
            t = out[-1].end
    if t < c and c - t <= 1e-12 * max(1.0, abs(c)) and out:
        out[-1] = out[-1]._replace(end=c)  # float rounding of the laid-out lengths
    elif t < c:
        out.append(Segment(t, c, default, mb))
    return out


def _sched_spans(segments: list[Segment] | None) -> dict[int | None, list[Segment]]:
    """A stage's scheduler-class wait segments keyed by the micro-batch waited for."""
    out: dict[int | None, list[Segment]] = {}
    for seg in segments or ():
        if seg.label in SCHEDULER_CLASSES:
            out.setdefault(seg.mb, []).append(seg)
    return out


def stage_segments(
    log: RunLog,
    s: int,
    prev: list[Segment] | None,
    run_start: float,
    run_end: float,
    split: bool = True,
) -> list[Segment]:
    """Stage ``s``'s run as contiguous segments; ``prev``: stage ``s-1``'s segments;
    ``split``: stage 0's ``dependency`` and ``schedule`` cut into their measured parts."""
    # stage 0's scheduler gaps (later stages get theirs passed down)
    idles = [Segment(i.start, i.end, i.reason, None) for i in log.idles] if s == 0 else []
    passed = _sched_spans(prev)
    prev_stage = log.by_mb(s - 1) if s else {}
    events = log.stages[s]
    out: list[Segment] = []
    cursor, prev_kind = run_start, None
    for k, e in enumerate(events):
        if s == 0:
            r = min(max(e.input_ready, cursor), e.compute_start)
            out += paint(cursor, r, idles, "schedule", e.mb)
            out += paint(r, e.compute_start, [], "schedule", e.mb)
        else:
            c = min(max(prev_stage[e.mb].compute_end, cursor), e.compute_start)
            out += pass_down(cursor, c, passed.get(e.mb, []), pb_class(prev_kind, e.kind), e.mb)
            out += paint(c, e.compute_start, [], "comm", e.mb)
        out.append(Segment(e.compute_start, e.compute_end, BUSY, e.mb))
        nxt = events[k + 1].compute_start if k + 1 < len(events) else run_end
        cursor = min(e.send_end, nxt)
        out += paint(e.compute_end, cursor, [], "comm", e.mb)
        prev_kind = e.kind
    if s == 0:
        out += paint(cursor, run_end, idles, "schedule", None)
        return split_runtime(log, out) if split else out
    out += pass_down(cursor, run_end, passed.get(None, []), "schedule", None)
    return out


def split_runtime(log: RunLog, segments: list[Segment]) -> list[Segment]:
    """Stage 0's ``segments`` with ``dependency`` and ``schedule`` cut into their measured
    parts (``runtime_split.py``); every other segment as it is."""
    waits = [Segment(a, b, label, None) for a, b, label in dependency_spans(log)]
    rest = dependency_rest(log)
    dispatch = dispatch_spans(log)
    out: list[Segment] = []
    for seg in segments:
        if seg.label not in (DEPENDENCY, SCHEDULE):
            out.append(seg)
            continue
        pieces = [seg]
        if seg.mb in dispatch:  # stage 0 waits for a micro-batch already handed over
            spans = [Segment(a, b, label, None) for a, b, label in dispatch[seg.mb]]
            pieces = paint(seg.start, seg.end, spans, seg.label, seg.mb)
        for p in pieces:
            out += paint(p.start, p.end, waits, rest, p.mb) if p.label == DEPENDENCY else [p]
    return out


def _overlap(seg: Segment, lo: float, hi: float) -> float:
    return max(0.0, min(seg.end, hi) - max(seg.start, lo))


def stage_bubbles(
    s: int, segments: list[Segment], window: Window, run_start: float, run_end: float
) -> StageBubbles:
    busy = 0.0
    bubbles = dict.fromkeys(BUBBLE_CLASSES, 0.0)
    fill = drain = 0.0
    lo, hi = window.start, window.end
    for seg in segments:
        within = lo <= seg.start and seg.end <= hi  # most segments: no overlaps to compute
        inside = seg.end - seg.start if within else _overlap(seg, lo, hi)
        if seg.label == BUSY:
            busy += inside
            continue
        bubbles[seg.label] = bubbles.get(seg.label, 0.0) + inside
        if not within:
            fill += _overlap(seg, run_start, lo)
            drain += _overlap(seg, hi, run_end)
    idle = sum(bubbles.values())
    return StageBubbles(s, busy, idle, window.duration, bubbles, fill, drain)


FILL, DRAIN = "fill", "drain"  # idle time before / after the steady-state window
FILL_DRAIN = (FILL, DRAIN)


def label_fill_drain(segments: list[Segment], window: Window) -> list[Segment]:
    """``segments`` cut at the steady-state window's edges, their idle time before it
    labelled ``fill`` and after it ``drain``, as the summary counts them (``fill_s``,
    ``drain_s``: outside the window, not a bubble class) and the timeline draws them.
    Unchanged without a steady state (the whole run is the window)."""
    if not window.steady_state:
        return segments
    out = []
    for g in split_at(segments, (window.start, window.end)):
        if g.label != BUSY and g.end <= window.start:
            g = g._replace(label=FILL)
        elif g.label != BUSY and g.start >= window.end:
            g = g._replace(label=DRAIN)
        out.append(g)
    return out


def split_at(segments: list[Segment], points: tuple[float, ...]) -> list[Segment]:
    """``segments`` with each one cut where it crosses one of ``points``."""
    out = []
    for seg in segments:
        start = seg.start
        for p in sorted(points):
            if start < p < seg.end:
                out.append(seg._replace(start=start, end=p))
                start = p
        out.append(seg._replace(start=start))
    return out
