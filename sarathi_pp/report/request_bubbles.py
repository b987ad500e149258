"""``requests.bubble_time_s``: the pipeline idle time each request lived through.

Per request: the idle seconds of every stage between the request's first scheduled time
and its finish, summed over the stages and divided by the number of stages. Idle is
everything but compute (``[compute_start, compute_end]`` of the stage's records), so a
stage's share is ``(finish - first_scheduled) - its compute inside that span``. A request
that waits behind others in a busy pipeline sees little; one whose micro-batches leave
stages waiting (long and short micro-batches in turn, the runtime's own gaps) sees more.

``phase_bubble_times``: the same, cut at the prefill split (``bubbles.PrefillSplit``):
each request's bubble time while prefills remain (before the cut) and after the last
prefill (the decode-only tail), a request counted in a phase only if it lived in it.

The requests' instants (``requests.csv``, relative to the first arrival) are put on the
event log's clock by its ``requests_t0`` record; a log without one (an older run) gives
no figure (``None``).
"""

from __future__ import annotations

import bisect
from itertools import accumulate

from sarathi_pp.report.log import RunLog
from sarathi_pp.report.request_metrics import RequestRow


class StageBusy:
    """One stage's compute intervals (sorted, not overlapping) with prefix sums: busy
    time in any span in O(log n)."""

    def __init__(self, intervals: list[tuple[float, float]]) -> None:
        self.starts = [a for a, _ in intervals]
        self.ends = [b for _, b in intervals]
        self.prefix = [0.0, *accumulate(b - a for a, b in intervals)]

    def busy_until(self, t: float) -> float:
        """Compute time before ``t``."""
        i = bisect.bisect_right(self.starts, t)  # intervals starting at or before t
        if i == 0:
            return 0.0
        return self.prefix[i - 1] + min(t, self.ends[i - 1]) - self.starts[i - 1]

    def idle(self, a: float, b: float) -> float:
        return (b - a) - (self.busy_until(b) - self.busy_until(a))


def request_bubble_times(
    log: RunLog,
    rows: list[RequestRow],
    span: tuple[float, float] = (float("-inf"), float("inf")),
) -> list[float] | None:
    """Each scheduled and finished request's bubble time (seconds), in row order; ``None``
    when the log cannot place the requests on its clock. ``span`` (the log's clock): only
    the part of each request's life inside it, and only the requests that lived in it."""
    if log.requests_t0 is None:
        return None
    stages = [
        StageBusy([(e.compute_start, e.compute_end) for e in events]) for events in log.stages
    ]
    t0 = log.requests_t0
    out = []
    for r in rows:
        if r.first_scheduled_s is None or r.finished_s is None:
            continue
        a, b = max(t0 + r.first_scheduled_s, span[0]), min(t0 + r.finished_s, span[1])
        if b > a:
            out.append(sum(s.idle(a, b) for s in stages) / len(stages))
    return out


def phase_bubble_times(
    log: RunLog, rows: list[RequestRow], cut: float
) -> tuple[list[float], list[float]] | None:
    """The requests' bubble times before ``cut`` (prefills remain) and after it (the tail)."""
    before = request_bubble_times(log, rows, (float("-inf"), cut))
    after = request_bubble_times(log, rows, (cut, float("inf")))
    return None if before is None or after is None else (before, after)
