"""Moving a dead replica's unfinished requests to a live one (``engine/replicas.py``).

A replica whose pipeline is lost for good (``PipelineRecovery._die``: no restart left) still
holds every unfinished request's tokens, as the driver always does: ``release_unfinished``
takes them out of it, each sequence reset as preempted by recompute (its KV gone, its
prompt and output tokens kept), and ``adopt`` queues them on another replica, which
recomputes their KV from those tokens and goes on: nothing is lost, and the output (its
text state moves with it) continues where it stopped. The children of one ``n > 1`` request
move together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sarathi_pp.engine.parallel_sampling import ParentRequest
    from sarathi_pp.outputs import RequestOutput
    from sarathi_pp.records.observer import Observers
    from sarathi_pp.scheduler import Scheduler
    from sarathi_pp.sequence import Sequence


@dataclass
class Handoff:
    """One request's sequences (a parent's children, or one) with their output state."""

    request_id: str  # the parent's id, or the one sequence's request id
    seqs: list[Sequence]
    texts: dict[int, Any]  # seq_id -> its output text state (OutputProcessor's)
    parent: ParentRequest | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids


@dataclass
class Released:
    """What a dead replica gives up: its unfinished requests and the aborts' final outputs
    it had not handed out yet."""

    requests: list[Handoff] = field(default_factory=list)
    aborted: list[RequestOutput] = field(default_factory=list)


class ReplicaHandoff:
    """Mixed into ``LLMEngine``."""

    scheduler: Scheduler
    observe: Observers
    outputs: Any
    _requests: dict[str, Sequence]
    _parents: dict[str, ParentRequest]
    _parent_ids: dict[str, ParentRequest]
    _aborted: list[RequestOutput]

    def release_unfinished(self) -> Released:
        """Take every unfinished request out of this (dead) engine, its sequences reset
        for recompute. Only once nothing is in flight (the engine died: ``_die``)."""
        self.scheduler.on_kv_lost()  # the running ones preempted: all now wait
        seqs = [s for s in self.scheduler.waiting if not s.is_finished]
        self.scheduler.waiting.clear()
        by_request: dict[str, Handoff] = {}
        for seq in seqs:
            self.scheduler.seqs.pop(seq.seq_id, None)
            self._requests.pop(seq.request_id, None)
            text = self.outputs._text.pop(seq.seq_id)
            parent = self._parents.pop(seq.request_id, None)
            key = parent.request_id if parent is not None else seq.request_id
            if parent is not None:
                self._parent_ids.pop(parent.request_id, None)
            h = by_request.setdefault(key, Handoff(key, [], {}, parent))
            h.seqs.append(seq)
            h.texts[seq.seq_id] = text
        aborted, self._aborted = self._aborted, []
        return Released(list(by_request.values()), aborted)

    def adopt(self, handoff: Handoff) -> None:
        """Queue ``handoff``'s sequences here (recomputed from their tokens);
        ``QueueFullError`` where ``scheduler.max_waiting`` leaves no room (the router then
        tries another replica)."""
        parent = handoff.parent
        for seq in handoff.seqs:
            self._requests[seq.request_id] = seq
            self.outputs._text[seq.seq_id] = handoff.texts[seq.seq_id]
            if parent is not None:
                self._parents[seq.request_id] = parent
            self.observe.added(seq.metrics.arrival_time)
            self.scheduler.add(seq)
        if parent is not None:
            self._parent_ids[parent.request_id] = parent
