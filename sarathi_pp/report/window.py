"""A window of a long run for the pictures: ``trace.json`` and ``timeline.png`` of a run
with more than ``MAX_DRAWN_MICROBATCHES`` micro-batches show its first that many (a
simulated run has hundreds of thousands: neither Perfetto nor a PNG shows them usefully,
and drawing them takes minutes). ``summary.json`` always covers the whole run."""

from __future__ import annotations

import dataclasses

from sarathi_pp.report.log import RunLog

MAX_DRAWN_MICROBATCHES = 2000


def head_window(log: RunLog, num_microbatches: int = MAX_DRAWN_MICROBATCHES) -> RunLog | None:
    """The run up to the end of its first ``num_microbatches`` micro-batches (in stage 0's
    order), or ``None`` when the run is no longer than that."""
    if log.num_microbatches <= num_microbatches:
        return None
    kept = {e.mb for e in log.stages[0][:num_microbatches]}
    stages = tuple(tuple(e for e in events if e.mb in kept) for events in log.stages)
    end = max(e.send_end for events in stages for e in events)
    return dataclasses.replace(
        log,
        stages=stages,
        idles=tuple(
            dataclasses.replace(i, end=min(i.end, end)) for i in log.idles if i.start < end
        ),
        issues=tuple(i for i in log.issues if i.mb in kept),
        dones=tuple(d for d in log.dones if d[0] in kept),
        waits=tuple(w for w in log.waits if w.mb in kept),
        chunk_sizes=tuple(c for c in log.chunk_sizes if c[0] <= end),
    )
