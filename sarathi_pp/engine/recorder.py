"""A run's records: what the engine loop reports, kept for the run dir.

``RunRecorder`` writes ``config.yaml`` when the run starts, keeps the event log (issue,
idle, done, stage and chunk-size records) and every finished request, and on ``write``
stores ``events.jsonl`` and ``requests.csv`` and rebuilds the report. ``NullRecorder``
takes the same calls and keeps nothing (no run dir): the loop never asks which it has.
"""

from __future__ import annotations

from typing import Any, Protocol

from sarathi_pp.config import EngineConfig
from sarathi_pp.events import EventLog
from sarathi_pp.microbatch import MicroBatch, StepResult
from sarathi_pp.outputs import RequestOutput
from sarathi_pp.report import write_report
from sarathi_pp.run_dir import RunDir
from sarathi_pp.scheduler import Scheduler
from sarathi_pp.scheduler.base import IDLE_NO_WORK


class Recorder(Protocol):
    @property
    def run_dir(self) -> RunDir | None: ...

    def before_schedule(self, now: float, scheduler: Scheduler) -> None: ...
    def idle(self, now: float, reason: str | None) -> None: ...
    def issued(self, microbatch: MicroBatch, now: float) -> None: ...
    def completed(self, microbatch: MicroBatch, result: StepResult, now: float) -> None: ...
    def added(self, request_id: str) -> None: ...
    def finished(self, output: RequestOutput) -> None: ...
    def write(self, now: float) -> dict[str, Any] | None: ...


class NullRecorder:
    """No run dir: records nothing."""

    run_dir = None

    def before_schedule(self, now: float, scheduler: Scheduler) -> None:
        pass

    def idle(self, now: float, reason: str | None) -> None:
        pass

    def issued(self, microbatch: MicroBatch, now: float) -> None:
        pass

    def completed(self, microbatch: MicroBatch, result: StepResult, now: float) -> None:
        pass

    def added(self, request_id: str) -> None:
        pass

    def finished(self, output: RequestOutput) -> None:
        pass

    def write(self, now: float) -> dict[str, Any] | None:
        return None


class RunRecorder:
    """Records into ``run_dir`` (prepared by the caller); ``config`` is the resolved config."""

    def __init__(self, run_dir: RunDir, config: EngineConfig, now: float) -> None:
        self.run_dir = run_dir
        run_dir.write_config(config)
        self.events = EventLog(config.parallel.pipeline_parallel_size, now, config.to_dict())
        # Every request added in this run, in order; its output once finished.
        self.outputs: dict[str, RequestOutput | None] = {}

    def before_schedule(self, now: float, scheduler: Scheduler) -> None:
        """The budget in force before each scheduling attempt: the log records it the first
        time and whenever it changed (``chunk_size: auto`` re-plans on add and finish)."""
        if scheduler.chunks_prompts:
            self.events.chunk_size(now, scheduler.chunk_size)

    def idle(self, now: float, reason: str | None) -> None:
        assert reason is not None, "the scheduler issued nothing without saying why"
        self.events.idle(now, reason)

    def issued(self, microbatch: MicroBatch, now: float) -> None:
        mb = microbatch
        self.events.issue(
            mb.microbatch_id, now, mb.kind, mb.num_prefill_tokens, mb.num_decode_tokens
        )

    def completed(self, microbatch: MicroBatch, result: StepResult, now: float) -> None:
        self.events.done(microbatch.microbatch_id, now)
        for e in result.events:
            self.events.stage(e)

    def added(self, request_id: str) -> None:
        self.outputs[request_id] = None

    def finished(self, output: RequestOutput) -> None:
        self.outputs[output.request_id] = output

    def write(self, now: float) -> dict[str, Any]:
        """``requests.csv`` (finished requests, in the order added), ``events.jsonl`` and
        the report files; the run's summary (``summary.json``)."""
        self.run_dir.write_requests([o for o in self.outputs.values() if o is not None])
        self.events.end_idle(now)
        self.events.write(self.run_dir.events)
        # Until the next request the engine has no work: a later call's log then shows the
        # gap as no_work, not as a scheduling bubble.
        self.events.idle(now, IDLE_NO_WORK)
        return write_report(self.run_dir.path)
