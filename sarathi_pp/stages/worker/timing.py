"""Where a stage's compute span comes from: the host's clock (CPU), or CUDA events.

Note [compute spans from CUDA events]: on CUDA a stage's kernels run after the host has
queued them, so the host's clock around ``execute`` measures launch time, not GPU time,
except where the host waited (the last stage's token copy). ``CudaEventClock`` records an
event before and after each micro-batch on the stage's stream and reads their times only
once both have completed (``event.query()``): reading adds no wait. The times are put on
the host's clock through an anchor, an event whose host time was taken when the stage was
set up (one ``synchronize`` then, never in a step): ``anchor_host + anchor.elapsed_time(e)``.
The last stage's events are complete when it reports (its token copy waited for them), so
its span is the GPU's; a stage whose events are still running when it reports (a stage
before the last, under PP) reports the host's span, counts it in ``host_spans`` and says
so once in the stage's record (the run dir's fallbacks); its event carries no later
correction yet.

``StageClock`` is the interface; ``WallClock`` (CPU) leaves the host's span as it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)


class StageClock(Protocol):
    """Marks a micro-batch's compute on the device and gives its span."""

    def begin(self, microbatch_id: int) -> None: ...

    def end(self, microbatch_id: int) -> None: ...

    def span(self, microbatch_id: int, host_start: float, host_end: float) -> tuple[float, float]:
        """The micro-batch's compute span on the host's clock (``host_start``/``host_end``:
        the host's reads around it, the answer where nothing better is known yet)."""
        ...


class WallClock:
    """CPU: the work runs while the host waits for it; the host's span is the span."""

    name = "wall_clock"

    def begin(self, microbatch_id: int) -> None:
        pass

    def end(self, microbatch_id: int) -> None:
        pass

    def span(self, microbatch_id: int, host_start: float, host_end: float) -> tuple[float, float]:
        return host_start, host_end


class CudaEventClock:
    """CUDA events around each micro-batch, read once complete (Note [compute spans from
    CUDA events]). ``event``: makes an event (``torch.cuda.Event(enable_timing=True)``; a
    test passes fakes with ``record``, ``query``, ``elapsed_time`` and ``synchronize``);
    ``now``: the host's clock."""

    name = "cuda_events"

    def __init__(
        self,
        stage_idx: int,
        event: Callable[[], Any] | None = None,
        now: Callable[[], float] = time.monotonic,
        record: Callable[[str], None] | None = None,
    ) -> None:
        self.stage_idx = stage_idx
        self.record = record  # where a host span's reason goes (the stage's run-dir record)
        self.event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self.now = now
        self.anchor = self.event()
        self.anchor.record()
        self.anchor.synchronize()  # once, at set-up
        self.anchor_host = now()
        self.pending: dict[int, list[Any]] = {}  # microbatch_id -> [start event, end event]
        self.gpu_spans = 0  # spans read from events
        self.host_spans = 0  # spans reported from the host's clock (events still running)

    def begin(self, microbatch_id: int) -> None:
        e = self.event()
        e.record()
        self.pending[microbatch_id] = [e]

    def end(self, microbatch_id: int) -> None:
        e = self.event()
        e.record()
        self.pending[microbatch_id].append(e)

    def read(self, microbatch_id: int) -> tuple[float, float] | None:
        """The span of ``microbatch_id`` from its events, or ``None`` while they run
        (deferred: the events stay until a later read finds them complete)."""
        events = self.pending.get(microbatch_id)
        if events is None or len(events) < 2 or not events[1].query():
            return None
        del self.pending[microbatch_id]
        start, end = (self.anchor_host + self.anchor.elapsed_time(e) / 1e3 for e in events)
        return start, end

    def span(self, microbatch_id: int, host_start: float, host_end: float) -> tuple[float, float]:
        got = self.read(microbatch_id)
        if got is None:
            self.pending.pop(microbatch_id, None)  # nothing would read it later
            self.host_spans += 1
            if self.host_spans == 1:
                why = (
                    "timing: compute spans from the host's clock where the stage's CUDA events "
                    "had not completed when it reported (Note [compute spans from CUDA events])"
                )
                if self.record is not None:
                    self.record(why)
                else:
                    logger.warning("stage %d: %s", self.stage_idx, why)
            return host_start, host_end
        self.gpu_spans += 1
        # on the report's time line: within what the host saw around the micro-batch's end
        return max(got[0], host_start), min(max(got[1], got[0]), host_end)


def stage_clock(
    device: torch.device, stage_idx: int, record: Callable[[str], None] | None = None
) -> StageClock:
    """The clock of a stage on ``device``: CUDA events on CUDA (a host span's reason to
    ``record``), else the host's."""
    if device.type == "cuda":
        return CudaEventClock(stage_idx, record=record)
    return WallClock()
