"""The simulated executor: the ``Executor`` contract (``sarathi_pp/executors/base.py``)
with stages that take a cost model's time on a virtual clock instead of running tensors.

For micro-batch ``j`` submitted at ``t`` (after the driver's own ``driver_s`` per
micro-batch): stage 0 has it at ``t + dispatch_s``; stage ``s`` starts it when it is free
(done with ``j-1``) and its input is there (stage ``s-1`` handed ``j`` on + the send);
stages run micro-batches in issue order. Handing the output on takes the stage
``handoff_s`` after it computed (its ``send_end``; 0 by default: a stage is free once it
computed), the send itself is asynchronous. The driver has the sampled tokens
``return_s`` after the last stage handed them on, and ``wait_oldest`` moves the clock
there. Each stage's timing is the ``StageEvent`` a real
stage reports, so ``events.jsonl`` reads as a real run's.

A micro-batch scheduled ahead (``parallel.schedule_ahead``) starts on stage 0 no earlier
than its ring sources' tokens get there: as on the Ray task path, they go from the last
stage straight to stage 0 over the token ring, a message of a few bytes: the link's
latency (the cost model's token return) plus the runtime's own per-send ``send_s``, with
no driver (``driver_s``, ``dispatch_s``, a measured ``return_s``) on the way.

Sampled tokens are a fixed non-EOS id: outputs end by length (the workloads run with
``ignore_eos``), which is all the schedulers look at.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from sarathi_pp.checkpoint import Checkpoint
from sarathi_pp.config import EngineConfig
from sarathi_pp.microbatch import MicroBatch, MicroBatchResult, StageEvent
from sarathi_pp.placement import Placement, Resources, resolve_placement, resolve_schedule_ahead
from sarathi_pp.planner.memory import spec_stage_memory, with_activations
from sarathi_pp.sim.clock import SimClock
from sarathi_pp.sim.cost_model import CostModel
from sarathi_pp.stage_memory import StageMemory


@dataclass(frozen=True)
class Overheads:
    """The runtime's own time around the stages, seconds per micro-batch."""

    driver_s: float = 0.0  # scheduling + output processing on the driver (serial)
    dispatch_s: float = 0.0  # driver -> stage 0
    return_s: float | None = None  # last stage -> driver; None: the cost model's figure
    send_s: float = 0.0  # added to every stage-to-stage send (a runtime's own cost)
    # each stage's own time handing its output on after computing (``send_end -
    # compute_end`` in a real run's log: the transport's send call, the last stage's
    # tokens put on their way); the stage takes its next micro-batch after it
    handoff_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("driver_s", "dispatch_s", "return_s", "send_s", "handoff_s"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")


def _token_id(eos_ids: tuple[int, ...]) -> int:
    return next(t for t in range(len(eos_ids) + 1) if t not in eos_ids)


class SimExecutor:
    def __init__(
        self,
        config: EngineConfig,
        checkpoint: Checkpoint,
        resources: Resources,
        cost_model: Callable[[Placement], CostModel],
        clock: SimClock,
        overheads: Overheads | None = None,
        tp: int = 1,
    ) -> None:
        self.config = config
        self.placement = resolve_placement(config, checkpoint.spec, resources)
        self.schedule_ahead = resolve_schedule_ahead(config, self.placement, resources)
        self.spec, self.tp, self.clock = checkpoint.spec, tp, clock
        self.max_model_len = checkpoint.max_model_len
        self.cost_model = cost_model(self.placement)
        self.overheads = overheads or Overheads()
        self.num_stages = self.placement.num_stages
        self._token = _token_id(checkpoint.spec.eos_token_ids)
        self._free = [clock.now()] * self.num_stages  # when each stage handed its last output on
        self._inflight: deque[tuple[MicroBatch, float, list[StageEvent]]] = deque()
        self._ring_ready: dict[int, float] = {}  # micro-batch in flight -> its tokens at stage 0

    def load_model(self) -> list[StageMemory]:
        """Each GPU's share of its stage: parameters and K/V split over ``tp``; on a
        simulated GPU, the stage's peak activation memory ``M_A`` for one GPU of ``tp``
        (``planner.memory.with_activations``, as the real executors), which the KV cache
        cannot have."""
        p = self.placement
        stages = spec_stage_memory(self.spec, self.num_stages, p.dtype, p.memory_bytes)
        kv_split = min(self.tp, self.spec.num_kv_heads)  # KV heads replicated past that
        per_gpu = [
            StageMemory(s.stage_idx, s.param_bytes // self.tp,
                        max(1, s.kv_bytes_per_token // kv_split), s.memory_bytes)
            for s in stages
        ]  # fmt: skip
        return with_activations(
            per_gpu, self.config, self.spec, p, self.max_model_len, self.tp,
            schedule_ahead=self.schedule_ahead.on,
        )  # fmt: skip

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size

    def submit(self, microbatch: MicroBatch) -> None:
        o = self.overheads
        self.clock.advance(o.driver_s)
        cost = self.cost_model.costs(microbatch)
        mb, events = microbatch, []
        ready = self.clock.now() + o.dispatch_s
        # scheduled ahead: stage 0 also waits for its sources' tokens over the ring
        ring = max((self._ring_ready[j] for j in mb.ring_sources), default=ready)
        for s in range(self.num_stages):
            start = max(ready, self._free[s], ring) if s == 0 else max(ready, self._free[s])
            end = start + cost.compute_s[s]
            sent = end + o.handoff_s
            events.append(
                StageEvent(s, mb.microbatch_id, mb.kind, mb.num_prefill_tokens,
                           mb.num_decode_tokens, self._free[s], ready, start, end, sent)
            )  # fmt: skip
            self._free[s] = sent
            ready = sent + cost.send_s[s] + o.send_s
        back = cost.return_s if o.return_s is None else o.return_s
        self._inflight.append((mb, events[-1].send_end + back, events))
        self._ring_ready[mb.microbatch_id] = events[-1].send_end + cost.return_s + o.send_s

    def next_done(self) -> float | None:
        """When the driver will have the oldest micro-batch's tokens (None: none in flight)."""
        return self._inflight[0][1] if self._inflight else None

    def wait_oldest(self) -> tuple[MicroBatch, MicroBatchResult]:
        mb, done, events = self._inflight.popleft()
        self._ring_ready.pop(mb.microbatch_id, None)
        self.clock.advance_to(done)
        sampled = dict.fromkeys(mb.sampled_seq_ids, self._token)
        return mb, MicroBatchResult(sampled=sampled, events=events)

    def reset(self) -> None:
        self._inflight.clear()
        self._ring_ready.clear()
        self._free = [self.clock.now()] * self.num_stages

    def restart(self) -> None:
        """Simulated stages never fail (no ``StageLost``), so the engine never asks to
        replace them. Raising rather than doing nothing: a no-op would have the engine
        carry on as if stages had been replaced, with no outage on the clock."""
        raise NotImplementedError("the simulated executor cannot replace a lost stage")

    def release_stages(self) -> None:
        self.shutdown()  # nothing set up for the stages outlives them here

    def shutdown(self) -> None:
        self._inflight.clear()
