"""The last minute of the pipeline's bubbles, for ``GET /metrics``.

An observer of the engine loop (``LLMEngine.add_observer``): the engine thread feeds this
window the same records its recorder streams into a run dir's ``events.jsonl`` (an in-memory ``EventLog`` on the same clock: with a run dir, the run
dir's own ``t0``), and trims it to whole micro-batches of the last few minutes, so memory
stays bounded under continuous traffic. At a scrape the HTTP thread analyzes a copy with
the report's own code (``report.interval``): per stage, the fraction of the last
``WINDOW_S`` seconds spent busy and in each bubble class. ``sarathi-pp report RUN_DIR
--interval A:B`` with the interval ``/metrics`` shows (``sarathi_pp_bubble_interval_*``)
gives the same figures.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from sarathi_pp.records.events import EventLog
from sarathi_pp.records.observer import Observer
from sarathi_pp.report.bubbles import BUBBLE_CLASSES
from sarathi_pp.report.interval import IntervalBubbles, interval_bubbles
from sarathi_pp.report.log import parse_log

WINDOW_S = 60.0  # what /metrics shows
KEEP_S = 180.0  # what is kept: enough micro-batches before the window to classify its start
_TRIM_EVERY = 256  # records between trims


class BubbleWindow(Observer):
    def __init__(self, num_stages: int, t0: float, now: Any) -> None:
        """``t0``: the clock's origin (the run dir's, when there is one); ``now``: the
        engine's clock."""
        self.now = now
        self.t0 = t0
        self._log = EventLog(num_stages, t0, {})  # no sink: records held in memory
        self._lock = threading.Lock()
        self._since_trim = 0

    # --- the engine thread (an observer's calls) ------------------------------------------
    def idle(self, now: float, reason: str | None) -> None:
        if reason is not None:
            with self._lock:
                self._log.idle(now, reason)

    def issued(self, mb: Any, now: float, submit: float | None = None) -> None:
        with self._lock:
            self._log.issued(mb, now, submit)  # the run dir's recorder makes the same call

    def completed(
        self, mb: Any, result: Any, now: float, wait: float | None = None, full: bool | None = None
    ) -> None:
        with self._lock:
            self._log.completed(mb, result, now, wait, full)
            self._since_trim += 1 + len(result.events)
            if self._since_trim >= _TRIM_EVERY:
                self._trim(now - self.t0 - KEEP_S)

    def _trim(self, cutoff: float) -> None:
        """Drop what ended before ``cutoff`` (log time): whole micro-batches, idle spans."""
        records = self._log.records
        old_mbs = {r["mb"] for r in records if r["type"] == "done" and r["t"] < cutoff}
        keep = [records[0]]  # the header
        for r in records[1:]:
            kind = r["type"]
            if kind in ("stage", "issue", "done") and r["mb"] in old_mbs:
                continue
            if kind == "idle" and r["end"] < cutoff:
                continue
            keep.append(r)
        self._log.records = keep
        self._since_trim = 0

    # --- the HTTP thread (a scrape) ------------------------------------------------------
    def snapshot(self) -> IntervalBubbles | None:
        """Busy and bubble fractions per stage over the last ``WINDOW_S`` seconds (completed
        micro-batches only); ``None`` before the first micro-batch."""
        now = self.now()
        with self._lock:
            records = list(self._log.records)
            open_idle = self._log.open_idle
        if open_idle is not None and now > open_idle[0]:  # the idle span going on now
            start, reason = open_idle
            records.append(
                {"type": "idle", "start": start - self.t0, "end": now - self.t0, "reason": reason}
            )
        if not any(r["type"] == "stage" for r in records):
            return None
        log = parse_log(records, "the server's recent events")
        end = now - self.t0
        return interval_bubbles(log, end - WINDOW_S, end)


class BubbleCollector(Collector):
    """Computes the bubble gauges at each scrape from a ``BubbleWindow``, or from several
    (one per data-parallel replica: each gauge then has a ``replica`` label, and the names
    ``prefix``)."""

    def __init__(
        self, window: BubbleWindow | list[BubbleWindow], prefix: str = "sarathi_pp"
    ) -> None:
        self.windows = window if isinstance(window, list) else [window]
        self.by_replica = isinstance(window, list)
        self.prefix = prefix

    def collect(self) -> Any:
        replica = ["replica"] if self.by_replica else []
        busy = GaugeMetricFamily(
            f"{self.prefix}_stage_busy_fraction",
            f"Fraction of the last {WINDOW_S:.0f} s each stage computed micro-batches",
            labels=[*replica, "stage"],
        )
        bubble = GaugeMetricFamily(
            f"{self.prefix}_stage_bubble_fraction",
            f"Fraction of the last {WINDOW_S:.0f} s each stage sat idle, by bubble class "
            "(as sarathi-pp report classifies it)",
            labels=[*replica, "stage", "class"],
        )
        bounds = GaugeMetricFamily(
            f"{self.prefix}_bubble_interval_seconds",
            "The interval the bubble fractions cover, on the run's clock (seconds from its "
            "t0): `sarathi-pp report RUN_DIR --interval START:END` gives the same figures",
            labels=[*replica, "edge"],
        )
        for i, window in enumerate(self.windows):
            snap = window.snapshot()
            if snap is None:
                continue
            r = [str(i)] if self.by_replica else []
            for s, fractions in enumerate(snap.fractions):
                busy.add_metric([*r, str(s)], fractions["busy"])
                for c in BUBBLE_CLASSES:
                    bubble.add_metric([*r, str(s), c], fractions[c])
            bounds.add_metric([*r, "start"], snap.start)
            bounds.add_metric([*r, "end"], snap.end)
        yield from (busy, bubble, bounds)
