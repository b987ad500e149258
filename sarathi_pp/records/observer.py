"""The engine loop's seam for whoever watches it: ``LLMEngine(..., observers=[...])`` or
``LLMEngine.add_observer``.

An ``Observer`` is told, on the engine's thread and clock, what the loop does: each
scheduling attempt (``before_schedule``), each span it issued nothing (``idle``, with the
scheduler's reason), each micro-batch issued and completed (with every stage's timing in
``result.events``), each request added (``added``) and each engine request finished
(``finished``: a child of an ``n > 1`` request on its own, as the scheduler ran it). Every
method is a no-op here: an observer overrides the ones it needs. The run dir's recorder
(``recorder.py``) is one; the server's bubble window and stage-time metrics are others.
An observer must not raise: what it raises ends the step like any failure of the loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sarathi_pp.microbatch import MicroBatch, MicroBatchResult
    from sarathi_pp.outputs import RequestOutput
    from sarathi_pp.scheduler import Scheduler


class Observer:
    """What the engine loop reports (see the module docstring); nothing by default."""

    def before_schedule(self, now: float, scheduler: Scheduler) -> None:
        """The scheduler is about to be asked for a micro-batch."""

    def idle(self, now: float, reason: str | None) -> None:
        """From ``now`` the loop issues nothing, for ``reason`` (``scheduler/base.py``'s
        ``IDLE_*``); it ends with the next ``issued``."""

    def issued(self, microbatch: MicroBatch, now: float, submit: float | None = None) -> None:
        """``now``: scheduling began; ``submit``: the micro-batch went to the executor."""

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

    def added(self, arrival_time: float) -> None:
        """A checked engine request joined the run."""

    def finished(self, output: RequestOutput) -> None:
        """An engine request finished (its final output)."""


class Observers(Observer):
    """Several observers as one, told in order."""

    def __init__(self, observers: Iterable[Observer] = ()) -> None:
        self.observers: list[Observer] = list(observers)

    def before_schedule(self, now: float, scheduler: Scheduler) -> None:
        for o in self.observers:
            o.before_schedule(now, scheduler)

    def idle(self, now: float, reason: str | None) -> None:
        for o in self.observers:
            o.idle(now, reason)

    def issued(self, microbatch: MicroBatch, now: float, submit: float | None = None) -> None:
        for o in self.observers:
            o.issued(microbatch, now, submit)

    def completed(
        self,
        microbatch: MicroBatch,
        result: MicroBatchResult,
        now: float,
        wait: float | None = None,
        full: bool | None = None,
    ) -> None:
        for o in self.observers:
            o.completed(microbatch, result, now, wait, full)

    def added(self, arrival_time: float) -> None:
        for o in self.observers:
            o.added(arrival_time)

    def finished(self, output: RequestOutput) -> None:
        for o in self.observers:
            o.finished(output)
