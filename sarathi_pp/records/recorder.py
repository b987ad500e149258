"""A run's records: what the engine loop reports (an ``Observer``), streamed into the run dir.

``RunRecorder`` writes nothing until the first request is added (a run whose input is
refused leaves the folder as it was): then it creates the run dir (with ``overwrite``,
removing what an earlier run wrote there), writes ``config.yaml``, and from then on
appends ``events.jsonl`` records and one ``requests.csv`` row per finished request as they
happen, flushed at least every second, so a crash loses at most the last second and a
long run holds no growing list. ``write`` flushes and rebuilds the report. A record that
cannot be written (disk full, folder removed) is logged once and recording stops; the
run and its outputs go on. ``NullRecorder`` takes the same calls and keeps nothing.
``write`` rebuilds the report with the writer it was given (``report.write_report``,
handed over by the engine: the records sit below the report, which reads their files).
"""

from __future__ import annotations

import csv
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from sarathi_pp.config import EngineConfig
from sarathi_pp.microbatch import MicroBatch, MicroBatchResult
from sarathi_pp.outputs import RequestOutput
from sarathi_pp.records.events import COMPACT_EVENTS_AFTER, EventLog
from sarathi_pp.records.observer import Observer
from sarathi_pp.records.run_dir import REQUEST_COLUMNS, RunDir, request_row
from sarathi_pp.scheduler.base import IDLE_NO_WORK

if TYPE_CHECKING:
    from sarathi_pp.scheduler import Scheduler

# Rebuilds a run dir's report files from its records; returns the summary.
ReportWriter = Callable[[Path], dict[str, Any]]

logger = logging.getLogger(__name__)


class NullRecorder(Observer):
    """No run dir: records nothing."""

    run_dir: RunDir | None = None
    path: Path | None = None

    def write(self, now: float) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        pass


def compact_after(compact_events: bool | str) -> int | None:
    """``run.compact_events`` as the completed micro-batches before ``events.jsonl`` turns
    compact (None: never)."""
    if compact_events == "auto":
        return COMPACT_EVENTS_AFTER
    return 0 if compact_events else None


class RunRecorder(Observer):
    """Records into ``run_dir`` (checked, not created, by the caller); ``config`` is the
    resolved config, ``now`` the log's time origin, ``write_report`` what rebuilds the
    report from the files."""

    def __init__(
        self,
        run_dir: RunDir,
        config: EngineConfig,
        now: float,
        overwrite: bool,
        write_report: ReportWriter,
    ) -> None:
        self.run_dir = run_dir
        self._write_report = write_report
        self.config = config
        self.overwrite = overwrite
        self.events = EventLog(
            config.parallel.pipeline_parallel_size,
            now,
            config.to_dict(),
            compact_after=compact_after(config.run.compact_events),
        )
        self._requests: IO[str] | None = None  # requests.csv, open once the run dir is
        self._rows: Any = None  # its csv writer
        self._rows_flushed_at = 0.0
        self._t0: float | None = None  # the first request's arrival: requests.csv's origin
        self._broken = False  # a write failed: recording stopped
        self._closed = False  # close() ran: the run dir is never created again

    @property
    def path(self) -> Path:
        return self.run_dir.path

    # --- the loop's records (held until the run dir opens, then streamed) ------------------
    def before_schedule(self, now: float, scheduler: Scheduler) -> None:
        """The budget in force before each scheduling attempt: the log records it the first
        time and whenever it changed (``chunk_size: auto`` re-plans on add and finish)."""
        if scheduler.chunks_prompts:
            self._safely(self.events.chunk_size, now, scheduler.chunk_size)

    def idle(self, now: float, reason: str | None) -> None:
        assert reason is not None, "the scheduler issued nothing without saying why"
        self._safely(self.events.idle, now, reason)

    def issued(self, microbatch: MicroBatch, now: float, submit: float | None = None) -> None:
        """``now``: scheduling began; ``submit``: the micro-batch goes to the executor."""
        self._safely(self.events.issued, microbatch, now, submit)

    def completed(
        self,
        microbatch: MicroBatch,
        result: MicroBatchResult,
        now: float,
        wait: float | None = None,
        full: bool | None = None,
    ) -> None:
        """``now``: the tokens are here; ``wait``: the driver began waiting for them;
        ``full``: the in-flight limit (not the scheduler) held the next micro-batch back."""
        self._safely(self.events.completed, microbatch, result, now, wait, full)

    def added(self, arrival_time: float) -> None:
        """A checked request joined the run: the run dir opens with the first one."""
        if self._t0 is None:
            self._t0 = arrival_time
            self._safely(self.events.requests_t0, arrival_time)
        if self._requests is None:
            self._safely(self._open)

    def finished(self, output: RequestOutput) -> None:
        self._safely(self._write_row, output)

    # --- files -------------------------------------------------------------------------
    def _open(self) -> None:
        self.run_dir.create(self.overwrite)
        self.run_dir.write_config(self.config)
        self.events.stream_to(open(self.run_dir.events, "w"))  # noqa: SIM115 - closed in close()
        self._requests = open(self.run_dir.requests, "w", newline="")  # noqa: SIM115
        self._rows = csv.DictWriter(self._requests, fieldnames=REQUEST_COLUMNS)
        self._rows.writeheader()
        self._requests.flush()

    def _write_row(self, output: RequestOutput) -> None:
        if self._requests is None:
            self._open()
        t0 = output.metrics.arrival_time if self._t0 is None else self._t0
        self._rows.writerow(request_row(output, t0))
        if time.monotonic() - self._rows_flushed_at >= EventLog.FLUSH_EVERY_S:
            self._flush()

    def _flush(self) -> None:
        self.events.flush()
        if self._requests is not None:
            self._requests.flush()
        self._rows_flushed_at = time.monotonic()

    def _safely(self, fn: Any, *args: Any) -> None:
        if self._broken or self._closed:
            return
        try:
            fn(*args)
        except OSError as e:
            self._broken = True
            logger.error("recording into %s stopped: %s (the run goes on)", self.run_dir.path, e)

    def write(self, now: float) -> dict[str, Any] | None:
        """Flush ``events.jsonl`` and ``requests.csv`` and rebuild the report files; the
        run's summary (``summary.json``), or ``None`` when recording failed (or the
        recorder was closed: the last ``write`` before it stands)."""
        if self._closed:
            return None
        if self._requests is None:
            self._safely(self._open)  # a run with no request: its records all the same
        self._safely(self.events.end_idle, now)
        self._safely(self._flush)
        # Until the next request the engine has no work: a later call's log then shows the
        # gap as no_work, not as a scheduling bubble.
        self._safely(self.events.idle, now, IDLE_NO_WORK)
        if self._broken:
            return None
        return self._write_report(self.run_dir.path)

    def close(self) -> None:
        """Flush and close the files (the engine shuts down, or another run starts); later
        records are dropped, never a new run dir created over this one's."""
        self._safely(self._flush)
        self._closed = True
        for f in (self.events.detach(), self._requests):
            if f is not None:
                f.close()
        self._requests = None
