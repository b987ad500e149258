"""What the engine does when a step fails, kept apart from the loop (``llm_engine.py``).

- Anything raised in a step (Ctrl-C included): the micro-batches in flight are abandoned,
  the executor forgets them (``Executor.reset``) and the scheduler recomputes their
  sequences (``Scheduler.on_microbatches_lost``: preempted by recompute, outputs
  unchanged). The engine stays usable.
- A lost stage (``StageLost``, Ray): the stages are replaced (``RayExecutor.restart``) up to
  ``parallel.max_stage_restarts`` times, and with them every KV cache, so every running
  sequence is recomputed (``Scheduler.on_kv_lost``); the outage is a ``recovery`` idle
  interval.
- Otherwise (``StageError``, or no restart left): the engine dies: stages released,
  ``is_alive()`` false, every later call raises ``EngineDeadError`` saying why.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from sarathi_pp.executors import StageError, StageLost
from sarathi_pp.executors.interrupts import deferred_interrupts
from sarathi_pp.scheduler.base import IDLE_RECOVERY

if TYPE_CHECKING:
    from sarathi_pp.config import EngineConfig
    from sarathi_pp.executors import Executor
    from sarathi_pp.microbatch import MicroBatch
    from sarathi_pp.records.observer import Observers
    from sarathi_pp.records.recorder import NullRecorder, RunRecorder
    from sarathi_pp.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine lost its pipeline for good; the message says why."""


class PipelineRecovery:
    """Mixed into ``LLMEngine``: the state it keeps in step when a step fails."""

    config: EngineConfig
    executor: Executor
    scheduler: Scheduler
    recorder: RunRecorder | NullRecorder
    observe: Observers
    _inflight: deque[MicroBatch]
    dead_reason: str | None = None  # set when the pipeline is lost for good
    _restarts = 0  # lost stages replaced so far

    if TYPE_CHECKING:  # LLMEngine's

        def now(self) -> float: ...
        def shutdown(self) -> None: ...

    @property
    def num_stage_restarts(self) -> int:
        """Lost stages replaced so far (at most ``parallel.max_stage_restarts``)."""
        return self._restarts

    def is_alive(self) -> bool:
        """False once the pipeline is lost for good (``dead_reason`` says why)."""
        return self.dead_reason is None

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_reason}")

    def _abandon_inflight(self, resync: bool = True) -> None:
        """The micro-batches in flight will not be applied: the executor forgets them
        (``resync``) and their sequences are recomputed (preempted by recompute: outputs
        unchanged). Stages that cannot be brought back in step end the engine."""
        with deferred_interrupts():
            lost = list(self._inflight)
            self._inflight.clear()
            self.scheduler.on_microbatches_lost(lost)
            if not resync:
                return
            try:
                self.executor.reset()
            except Exception as e:  # noqa: BLE001 - reported as the engine's death
                logger.exception("the stages could not be resynchronised")
                self.dead_reason = f"the stages could not be resynchronised: {e}"
                self.shutdown()

    def _die(self, error: StageError) -> None:
        """The pipeline is broken for good: release the stages; later calls say why. The
        run dir stays open: the requests this ends are still recorded (aborted rows) and
        the report written; ``shutdown`` closes it."""
        self.dead_reason = str(error)
        self._abandon_inflight(resync=False)
        self.executor.release_stages()

    def _recover(self, error: StageLost) -> None:
        """Replace the lost stage (all stages: one process group); every running sequence
        is recomputed (its KV went with the old stages). The outage is a ``recovery`` idle
        interval in the records."""
        self._restarts += 1
        logger.warning("%s: replacing the stages (restart %d of %d)", error, self._restarts,
                       self.config.parallel.max_stage_restarts)  # fmt: skip
        self.observe.idle(self.now(), IDLE_RECOVERY)
        self._abandon_inflight(resync=False)
        # The new stages' caches are empty: every running sequence had KV there, whether
        # a lost micro-batch held it or not.
        self.scheduler.on_kv_lost()
        try:
            self.executor.restart()
        except Exception as e:
            failed = StageError(error.stage_idx, f"{error}; replacing it failed: {e}")
            self._die(failed)
            raise failed from e

    def _on_step_failure(self, error: BaseException) -> None:
        """Called from ``step``'s ``except``: returns normally only when a lost stage was
        replaced (the step then returns what it has); otherwise the caller re-raises."""
        if (
            isinstance(error, StageLost)
            and self._restarts < self.config.parallel.max_stage_restarts
        ):
            self._recover(error)
            return
        if isinstance(error, StageError):
            self._die(error)
        else:
            self._abandon_inflight()
        raise error
