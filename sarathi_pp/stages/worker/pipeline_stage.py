"""One pipeline stage as a process: its ``ModelRunner`` plus the transport to its neighbours.

The same class runs inside a Ray actor (``executors/ray.py``) and inside a torchrun
rank (``executors/torchrun.py``). ``run(microbatch)`` is called for every micro-batch in the order the
scheduler issued them: stage s > 0 receives the micro-batch's hidden states from stage s-1,
runs its layers (writing its KV blocks), and sends the result on; the last stage returns the
sampled tokens. Activations never pass through the control plane.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import pickle
import socket
import time
from typing import Any, Protocol

import torch

from sarathi_pp.checkpoint import Checkpoint
from sarathi_pp.comm.dist_setup import (
    destroy_stage_group,
    init_stage_group,
    node_ip,
    pick_backend,
    rendezvous_listener,
)
from sarathi_pp.comm.p2p import StageTransport
from sarathi_pp.comm.ring import TokenRing
from sarathi_pp.config import ParallelConfig
from sarathi_pp.microbatch import MicroBatch, MicroBatchResult, StageEvent, fill_ring
from sarathi_pp.stage_memory import StageMemory
from sarathi_pp.stages.worker.device import set_num_threads
from sarathi_pp.stages.worker.fault_injector import FaultInjector
from sarathi_pp.stages.worker.model_runner import ModelRunner, StageSpec

logger = logging.getLogger(__name__)


class StageControl(Protocol):
    """What drives a stage that runs its own loop (``PipelineStage.serve``; a torchrun rank:
    ``executors/torchrun.RankControl`` over torchrun's control plane)."""

    def send_memory(self, memory: StageMemory) -> None:
        """Hand the driver this stage's memory figures (after its weights are loaded)."""

    def recv_kv_shape(self) -> tuple[int, int]:
        """The KV cache the driver sized for this stage: ``(num_blocks, block_size)``."""
        ...

    def next_microbatch(self) -> MicroBatch | None:
        """The next micro-batch to run; ``None``: the pipeline is shutting down."""

    def report(
        self, microbatch: MicroBatch, result: MicroBatchResult | None, event: StageEvent
    ) -> None:
        """``run``'s result and timing of ``microbatch``, to the driver."""

    def report_error(self, microbatch: MicroBatch, error: BaseException) -> None:
        """``run`` raised on ``microbatch`` (the stage stops): tell the driver what failed."""

    def close(self) -> None:
        """Flush what is still being sent (the loop has ended)."""


class PipelineStage:
    def __init__(self, stage: StageSpec, checkpoint: Checkpoint, parallel: ParallelConfig) -> None:
        if stage.device == "cpu":
            set_num_threads(stage.num_threads)
        elif stage.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(stage.device))
        self.stage = stage
        self.spec = checkpoint.spec
        self.faults = FaultInjector(parallel.inject_fault, stage.stage_idx)
        self.runner = ModelRunner(
            checkpoint.spec, checkpoint.path, stage, checkpoint.max_model_len,
            checkpoint.tokenizer_path,
        )  # fmt: skip
        self.timeout_s = parallel.stage_timeout_s
        # A stage may run this many micro-batches ahead of the next one (Note in comm/p2p).
        self.max_pending_sends = parallel.microbatches_in_flight + 1 + int(stage.token_ring)
        self.transport: StageTransport | None = None
        # The token ring (stage 0 and the last stage; ``parallel.schedule_ahead``): set up
        # with the process group by ``init_group``.
        self.ring: TokenRing | None = None
        self._listener: socket.socket | None = None  # stage 0's rendezvous, from address()
        self._free_since = time.monotonic()  # when the stage last became free
        self.last_done = -1  # the last micro-batch id run_compiled finished

    # --- set-up ------------------------------------------------------------------------------
    def address(self, loopback: bool = False) -> tuple[str, int]:
        """Where this stage (stage 0) hosts the process group's rendezvous: 127.0.0.1 when
        every stage is on this node (``loopback``), else this node's IP; the port is held
        open from now until ``init_group`` (no other process can take it meanwhile)."""
        if self._listener is not None:
            self._listener.close()
        self._listener = rendezvous_listener("127.0.0.1" if loopback else node_ip())
        addr, port = self._listener.getsockname()[:2]
        return str(addr), int(port)

    def init_group(self, master_addr: str, master_port: int) -> None:
        """Join the stages' process group (every stage calls this at once). A loopback
        ``master_addr`` binds gloo to loopback too (``comm/dist_setup.py``)."""
        s = self.stage
        listener, self._listener = self._listener, None
        init_stage_group(
            s.stage_idx,
            s.num_stages,
            master_addr,
            master_port,
            pick_backend(s.device),
            self.timeout_s,
            listener=listener,
        )
        self.attach_transport()
        if s.token_ring:  # every stage joins the ring's group (a collective call)
            group = torch.distributed.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s)
            )
            if s.is_first or s.is_last:
                self.ring = TokenRing(
                    s.stage_idx, s.num_stages, self.timeout_s, group, self.max_pending_sends
                )

    def attach_transport(self) -> None:
        """Talk to the neighbours over the (already initialised) default process group."""
        s = self.stage
        self.transport = StageTransport(
            s.stage_idx,
            s.num_stages,
            s.device,
            self.timeout_s,
            max_pending_sends=self.max_pending_sends,
        )

    def load_model(self) -> StageMemory:
        return self.runner.memory(self.runner.load_model())

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.runner.init_kv_cache(num_blocks, block_size)
        self._free_since = time.monotonic()

    # --- one micro-batch -----------------------------------------------------------------------
    def run(self, microbatch: MicroBatch) -> tuple[MicroBatchResult | None, StageEvent]:
        """Run one micro-batch; returns the sampled tokens (last stage, else ``None``) and
        this stage's timing of it (a few clock reads: no per-token work).

        Scheduled ahead (``microbatch.ring_sources``): stage 0 first takes the decodes'
        input tokens from the token ring (``comm/ring.py``; waiting for the last stage if
        they are not here yet, between its ``input_ready``, the micro-batch's arrival, and
        ``compute_start``). With the ring on, stage 0 posts every micro-batch's receive and
        the last stage sends its tokens.

        A micro-batch that raises here does not stop the pipeline: the stage sends zeros of
        the right shape on (the stages after it stay in step; what they compute for it is
        dropped) and returns ``MicroBatchResult(failure=...)``; the executor then retries its
        sequences one at a time (see ``RayExecutor``)."""
        assert self.transport is not None, "init_group/attach_transport first"
        s = self.stage
        wait_start = self._free_since
        arrived = time.monotonic()  # stage 0: the micro-batch is here; s > 0: now wait for input
        if s.is_first and microbatch.ring_sources:
            assert self.ring is not None, "a micro-batch scheduled ahead needs the token ring"
            microbatch = fill_ring(microbatch, self.ring.tokens(microbatch.ring_sources))
        hidden = None
        if not s.is_first:
            hidden = self.transport.recv(
                microbatch.microbatch_id,
                microbatch.num_tokens,
                self.spec.hidden_size,
                self.runner.dtype,
            )
        host_start = time.monotonic()
        out, failure = self._execute(microbatch, hidden)
        # Note [compute spans from CUDA events] (stages/worker/timing.py); CPU: the host's
        compute_start, compute_end = self.runner.clock.span(
            microbatch.microbatch_id, host_start, time.monotonic()
        )
        result = MicroBatchResult(failure=failure) if failure is not None else None
        if self.ring is not None and s.is_first:  # before the hidden states go on
            self.ring.expect(microbatch.microbatch_id, microbatch.sampled_seq_ids)
        if s.is_last:
            result = result or out
            if self.ring is not None:
                ids = microbatch.sampled_seq_ids
                self.ring.send(microbatch.microbatch_id, ids, result.sampled)
        else:
            if out is None:  # keep the next stage in step: zeros of the expected shape
                out = torch.zeros(
                    microbatch.num_tokens, self.spec.hidden_size,
                    dtype=self.runner.dtype, device=self.runner.device,
                )  # fmt: skip
            self.transport.send(microbatch.microbatch_id, out)
        self._free_since = time.monotonic()
        input_ready = arrived if s.is_first else host_start  # the micro-batch / the hidden states
        event = StageEvent(
            s.stage_idx,
            microbatch.microbatch_id,
            microbatch.kind,
            microbatch.num_prefill_tokens,
            microbatch.num_decode_tokens,
            min(wait_start, arrived),
            input_ready,
            compute_start,
            compute_end,
            self._free_since,
            self.runner.take_attention_report(),
        )
        return result, event

    def serve(self, control: StageControl) -> None:
        """The stage loop of a stage that drives itself (a torchrun rank): load the weights and
        report their memory, take the KV cache shape, then ``run`` every micro-batch
        ``control`` hands over and report it, until ``None``; then shut down. A micro-batch
        that ``run`` cannot contain (a transport failure) is reported and re-raised: the rank
        exits, and the stages after it fail their receive with a clear error."""
        control.send_memory(self.load_model())
        self.init_kv_cache(*control.recv_kv_shape())
        while (microbatch := control.next_microbatch()) is not None:
            try:
                result, event = self.run(microbatch)
            except Exception as e:
                control.report_error(microbatch, e)
                raise
            control.report(microbatch, result, event)
        control.close()
        self.shutdown()

    def run_packed(self, packed: bytes) -> bytes:
        """``run`` for the Ray executor: the micro-batch arrives pickled, and the result and
        event leave pickled (Note [packed micro-batches] in ``executors/ray.py``)."""
        microbatch = pickle.loads(packed)  # from the driver that owns this actor
        return pickle.dumps(self.run(microbatch), protocol=pickle.HIGHEST_PROTOCOL)

    def run_compiled(
        self, microbatch: MicroBatch, incoming: tuple | None = None
    ) -> tuple | MicroBatchResult:
        """``run`` for a Ray Compiled Graph (``executors/ray_compiled.py``): the hidden
        states arrive as ``incoming`` and leave as the return value, over the graph's
        channels (shared memory on one node, NCCL between GPUs), with the timings of the
        stages before. ``incoming`` = ``(hidden, events, failure)`` from the previous stage
        (``None`` on stage 0); the last stage returns the ``MicroBatchResult`` with every stage's
        event. A stage that raises passes the failure on and the stages after it skip the
        micro-batch (nothing waits on a channel for it); the executor retries its sequences
        one at a time, as on the other path."""
        s = self.stage
        wait_start, arrived = self._free_since, time.monotonic()
        hidden, events, failure = incoming if incoming is not None else (None, [], None)
        out: Any = None  # hidden states, or on the last stage its MicroBatchResult
        if failure is None:
            out, failure = self._execute(microbatch, hidden)
        end = self._free_since = time.monotonic()
        self.last_done = microbatch.microbatch_id
        start, compute_end = self.runner.clock.span(microbatch.microbatch_id, arrived, end)
        event = StageEvent(
            s.stage_idx, microbatch.microbatch_id, microbatch.kind,
            microbatch.num_prefill_tokens, microbatch.num_decode_tokens,
            min(wait_start, arrived), arrived, start, compute_end, end,
            self.runner.take_attention_report(),
        )  # fmt: skip
        events = [*events, event]
        if not s.is_last:
            return out, events, failure
        result = MicroBatchResult(failure=failure) if failure is not None else out
        result.events = events
        return result

    def _execute(
        self, microbatch: MicroBatch, hidden: torch.Tensor | None
    ) -> tuple[Any, str | None]:
        """This stage's work on ``microbatch`` (after any injected fault): its output and
        ``None``, or ``None`` and the failure (logged; isolated by the executor's retry)."""
        try:
            self.faults.before(microbatch)
            return self.runner.execute(microbatch, hidden), None
        except Exception as e:  # noqa: BLE001 - isolated by the executor's retry
            s = self.stage
            logger.exception(
                "stage %d: micro-batch %d failed", s.stage_idx, microbatch.microbatch_id
            )
            return None, f"stage {s.stage_idx}: {type(e).__name__}: {e}"

    def progress(self) -> int:
        """The last micro-batch ``run_compiled`` finished (-1: none), answered beside a
        running compiled graph: which stage holds a late micro-batch."""
        return self.last_done

    def group_initialized(self) -> bool:
        """Whether this process joined a ``torch.distributed`` group (not for a graph)."""
        return torch.distributed.is_available() and torch.distributed.is_initialized()

    def clock(self) -> float:
        """This process's clock, for the driver to measure the offset between processes."""
        return time.monotonic()

    def shutdown(self) -> None:
        if self.transport is not None:
            # Briefly: after a failure the next stage may never receive.
            with contextlib.suppress(Exception):
                self.transport.flush(timeout_s=min(5.0, self.timeout_s))
        if self.ring is not None:
            with contextlib.suppress(Exception):
                self.ring.flush(timeout_s=min(5.0, self.timeout_s))
        destroy_stage_group()
        self.runner.release()
