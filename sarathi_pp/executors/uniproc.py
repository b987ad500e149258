"""The single-process executor: one stage holding every layer, run synchronously.

A micro-batch that raises is retried one sequence at a time, so one failing request
finishes with an error of its own while the others go on (K/V writes are idempotent: a
retried chunk writes the same values to the same slots).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace

from sarathi_pp.checkpoint import Checkpoint
from sarathi_pp.config import EngineConfig
from sarathi_pp.microbatch import MicroBatch, MicroBatchResult, StageEvent, fill_ring
from sarathi_pp.placement import resolve_placement, resolve_schedule_ahead
from sarathi_pp.planner.memory import max_rows, with_activations
from sarathi_pp.stage_memory import StageMemory
from sarathi_pp.stages.worker.device import probe_resources, set_num_threads
from sarathi_pp.stages.worker.fault_injector import FaultInjector
from sarathi_pp.stages.worker.memory_probe import CudaMemoryProbe, MemoryProbe
from sarathi_pp.stages.worker.model_runner import ModelRunner, StageSpec

logger = logging.getLogger(__name__)


class UniprocExecutor:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint) -> None:
        resources = probe_resources()
        self.placement = resolve_placement(config, checkpoint.spec, resources)
        self.schedule_ahead = resolve_schedule_ahead(config, self.placement, resources)
        assert self.placement.num_stages == 1, "uniproc runs one stage"
        set_num_threads(self.placement.num_threads)
        stage = StageSpec.of(
            self.placement, 0, token_ring=self.schedule_ahead.on, prefault=config.cache.prefault
        )
        self.runner = ModelRunner(
            checkpoint.spec, checkpoint.path, stage, checkpoint.max_model_len,
            checkpoint.tokenizer_path,
        )  # fmt: skip
        self.config, self.checkpoint = config, checkpoint
        self.faults = FaultInjector(config.parallel.inject_fault, 0)
        self._done: deque[tuple[MicroBatch, MicroBatchResult]] = deque()
        self._free_since = time.monotonic()
        m = config.parallel.microbatches_in_flight
        if m > 1:
            logger.warning(
                "num_microbatches_in_flight=%d on the single-process executor: each "
                "micro-batch is computed as it is submitted, so nothing overlaps; above 1 it "
                "only shares the running decodes out over %d micro-batches, each sequence "
                "decoding once every %d (about %dx the time between its tokens while "
                "prompts remain). 1 is best here.", m, m, m, m,
            )  # fmt: skip

    def load_model(self) -> list[StageMemory]:
        memory = [self.runner.memory(self.runner.load_model())]
        c = self.checkpoint
        memory = with_activations(
            memory, self.config, c.spec, self.placement, c.max_model_len,
            schedule_ahead=self.schedule_ahead.on,
        )  # fmt: skip
        if self.config.cache.activation_memory == "profile" and self.runner.device.type == "cuda":
            memory = self.profiled(memory, CudaMemoryProbe(self.runner.device))
        return memory

    def profiled(self, memory: list[StageMemory], probe: MemoryProbe) -> list[StageMemory]:
        """``memory`` with ``M_A`` measured by a profiling forward (``cache.activation_memory:
        profile``; Note [profiling forward]) instead of the estimate."""
        c = self.config
        rows = max_rows(c.scheduler, self.checkpoint.max_model_len)
        in_flight = c.parallel.microbatches_in_flight + int(self.schedule_ahead.on)
        measured = self.runner.profile_activations(
            rows, c.scheduler.max_num_seqs, in_flight, self.placement.block_size, probe
        )
        logger.info(
            "stage 0: M_A by a profiling forward of %d rows: %d bytes (the estimate: %d)",
            rows, measured, memory[0].activation_bytes,
        )  # fmt: skip
        return [replace(memory[0], activation_bytes=measured)]

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.runner.init_kv_cache(num_blocks, block_size)
        self._free_since = time.monotonic()

    def submit(self, microbatch: MicroBatch) -> None:
        compute_start = time.monotonic()
        if microbatch.ring_sources:  # scheduled ahead: its sources ran already, in _done
            ring = {mb.microbatch_id: r.sampled for mb, r in self._done}
            result = self._run(fill_ring(microbatch, ring))
        else:
            result = self._run(microbatch)
        end = time.monotonic()
        # Note [compute spans from CUDA events] (stages/worker/timing.py); CPU: the host's
        start, compute_end = self.runner.clock.span(microbatch.microbatch_id, compute_start, end)
        result.events = [
            StageEvent(0, microbatch.microbatch_id, microbatch.kind, microbatch.num_prefill_tokens,
                       microbatch.num_decode_tokens, self._free_since, compute_start, start,
                       compute_end, end, self.runner.take_attention_report())
        ]  # fmt: skip
        self._free_since = end
        self._done.append((microbatch, result))

    def wait_oldest(self) -> tuple[MicroBatch, MicroBatchResult]:
        return self._done.popleft()

    def reset(self) -> None:
        self._done.clear()
        self._free_since = time.monotonic()

    def restart(self) -> None:
        """The stage is this process: it is never lost (no ``StageLost``), so the engine
        never asks to replace it, and nothing here could."""
        raise NotImplementedError("the uniproc executor cannot replace a lost stage")

    def release_stages(self) -> None:
        self.shutdown()  # nothing set up for the stages outlives them here

    def shutdown(self) -> None:
        self._done.clear()
        self.runner.release()

    def _run(self, microbatch: MicroBatch) -> MicroBatchResult:
        try:
            self.faults.before(microbatch)
            return self.runner.execute(microbatch)
        except Exception as e:  # noqa: BLE001 - isolate the request(s) that fail
            if len(microbatch.chunks) == 1:
                seq_id = microbatch.chunks[0].seq_id
                logger.exception("request of sequence %d failed", seq_id)
                return MicroBatchResult(errors={seq_id: f"{type(e).__name__}: {e}"})
        result = MicroBatchResult()
        for chunk in microbatch.chunks:  # one at a time, to find the culprit(s)
            result.add(
                self._run(MicroBatch(microbatch.microbatch_id, (chunk,), microbatch.released))
            )
        return result
