"""Pipeline parallelism on a Ray Compiled Graph: the same stage actors as ``ray.py``, driven
through one compiled graph instead of a task per stage per micro-batch.

The graph is ``input -> stage 0 -> stage 1 -> ... -> last stage -> driver``: the driver
writes each micro-batch once into a channel that every stage reads, each stage's
``PipelineStage.run_compiled`` receives the previous stage's hidden states as its argument
and returns its own, and only the last stage's ``MicroBatchResult`` comes back. Ray sets up the
channels when the graph is compiled and reuses them for every micro-batch: no task
submission, no object store, no scheduler on the per-micro-batch path (Ray documents tens
of microseconds per call against about a millisecond for an actor call).

Channels: on one node, shared memory (CPU tensors included); across nodes, the same
channels with the writes pushed to the reader's node over Ray's gRPC (a multi-node CPU
run works, at network latency); between GPUs the hidden states go over NCCL
(``with_tensor_transport("accelerator")``, Ray's own communicator), the rest of each
message over shared memory. No ``torch.distributed`` process group is formed: the
torchrun executor keeps the send/recv path (``comm/p2p.py``).

Failures (``tests/dist/test_faults.py`` runs on both Ray executors):
- a stage that raises on a micro-batch passes the failure down the graph; the micro-batch's
  sequences are retried one at a time, as in ``RayExecutor._isolate``;
- a dead actor is a system error: Ray tears the graph down, the executor names the stage
  (``StageLost``) and ``restart`` builds new actors and a new graph;
- a stalled stage: no result within ``stage_timeout_s``; the stages answer ``progress()``
  beside the graph's thread, which names the one holding the micro-batch (``StageError``);
- Ctrl-C (``reset``): the graph is torn down and compiled again on the next ``submit``,
  so no result half-read by the interrupted wait can be taken for a later micro-batch's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from sarathi_pp.executors.base import StageError, StageLost
from sarathi_pp.executors.interrupts import deferred_interrupts
from sarathi_pp.executors.ray import RayExecutor
from sarathi_pp.microbatch import MicroBatch, MicroBatchResult

logger = logging.getLogger(__name__)

PROGRESS_TIMEOUT_S = 5.0  # asking the stages which one holds a late micro-batch
POLL_MAX_S = 500e-6  # the longest sleep between two polls for a result


class RayCompiledExecutor(RayExecutor):
    _dag: Any = None
    _stalled = False  # a stage stopped answering: kill before tearing the graph down

    def _connect_stages(self) -> None:
        """Nothing to connect now: the compiled graph's channels are the data plane, set up
        when the graph is compiled (on the first ``submit``, after the KV caches exist)."""
        self._dag = None

    def _compile(self) -> None:
        from ray.dag import InputNode

        cuda = self.placement.device == "cuda"
        with InputNode() as microbatch:
            node = self.actors[0].run_compiled.bind(microbatch)
            for actor in self.actors[1:]:
                if cuda:  # hidden states GPU to GPU; events and failures over shared memory
                    node = node.with_tensor_transport(transport="accelerator")
                node = actor.run_compiled.bind(microbatch, node)
        start = time.monotonic()
        limit = self.max_inflight + 1  # _isolate's solo retry on top of a full pipeline
        self._dag = node.experimental_compile(
            _submit_timeout=self.timeout_s,
            _max_inflight_executions=limit,
            _max_buffered_results=limit,
        )
        logger.info("compiled the stages' graph in %.2f s", time.monotonic() - start)

    @property
    def max_inflight(self) -> int:
        return self._config.parallel.microbatches_in_flight

    # --- the per-micro-batch path ----------------------------------------------------------
    def oldest_ready(self, timeout_s: float = 0.0) -> bool:
        """Always true: a compiled graph's result is not polled here (``_collect`` polls it
        its own way), so a router of replicas steps a ``ray_compiled`` replica in turn."""
        return True

    def _run(self, microbatch: MicroBatch) -> Any:
        """The graph's execution of ``microbatch`` (``None`` for an empty one)."""
        if not microbatch.chunks:
            return None
        with deferred_interrupts():  # the graph's bookkeeping is not interrupt-safe
            try:
                if self._dag is None:
                    self._compile()
                return self._dag.execute(microbatch)
            except Exception as e:  # a dead stage (compiling or running), or Ray's own error
                raise self._graph_error(f"micro-batch {microbatch.microbatch_id}", e) from e

    def _graph_error(self, what: str, error: Exception) -> StageError:
        """``StageLost`` naming the dead stage when one is, else ``StageError``."""
        from ray.exceptions import RayActorError, RayChannelError

        self._stalled = True  # whatever broke, do not wait for the stages in a teardown
        dead = self._dead_stage() if isinstance(error, (RayActorError, RayChannelError)) else None
        if dead is not None:
            return StageLost(dead, f"{what}: the stage actor died")
        return StageError(0, f"{what}: the stages' compiled graph failed: {error!r}")

    def _collect(self, microbatch: MicroBatch, ref: Any) -> MicroBatchResult:
        """The last stage's result with every stage's timing; ``failure`` when a stage
        raised on the micro-batch."""
        if ref is None:
            return MicroBatchResult()
        from ray.exceptions import (
            RayActorError,
            RayChannelError,
            RayChannelTimeoutError,
            RayTaskError,
        )

        mb_id = microbatch.microbatch_id
        deadline = time.monotonic() + self.timeout_s
        try:
            self._poll_until_ready(ref, deadline)  # then the get waits out what is left
            result = ref.get(timeout=max(0.0, deadline - time.monotonic()))
        except RayChannelTimeoutError:
            self._stalled = True
            late = self._late_stage(mb_id)
            message = f"micro-batch {mb_id}: no result within {self.timeout_s:g} s"
            raise StageError(late, message) from None
        except RayTaskError as e:  # a bug outside run_compiled's own handling
            message = f"micro-batch {mb_id} failed: {e.cause!r}"
            raise StageError(self._late_stage(mb_id), message) from e
        except (RayActorError, RayChannelError) as e:  # Ray tore the graph down
            raise self._graph_error(f"micro-batch {mb_id}", e) from e
        result.events = [e.shifted(off) for e, off in zip(result.events, self.clock_offsets)]
        return result

    def _poll_until_ready(self, ref: Any, deadline: float) -> None:
        """Wait for ``ref``'s result without Ray's busy-wait: a blocking ``get`` spins on the
        output channel (Note [polling the compiled graph]: a large share of a core for the
        driver in a PP=2 run, taken from the stages on a machine with no core to spare; the
        figure: the lab notebook's "Figures moved out of the code"). Poll with a zero timeout
        instead and sleep between polls, 50 us doubling to at most 500 us (what it adds to the
        token return). Falls back to the blocking ``get`` where Ray's internals differ."""
        from ray.exceptions import RayChannelTimeoutError

        dag = self._dag
        index = getattr(ref, "_execution_index", None)
        if index is None or not hasattr(dag, "_execute_until"):
            return
        delay = 50e-6
        while dag._max_finished_execution_index < index:
            try:
                dag._execute_until(index, None, 0)
            except RayChannelTimeoutError:
                if time.monotonic() >= deadline:
                    return  # the blocking get times out and says so
                time.sleep(delay)
                delay = min(2 * delay, POLL_MAX_S)

    def _late_stage(self, mb_id: int) -> int:
        """The first stage that has not finished ``mb_id`` (asked beside the graph)."""
        ray = self._ray
        for i, actor in enumerate(self.actors):
            try:
                done = ray.get(actor.progress.remote(), timeout=PROGRESS_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - no answer: this is the stage to name
                return i
            if done < mb_id:
                return i
        return len(self.actors) - 1

    def _dead_stage(self) -> int | None:
        """The first stage whose actor no longer answers (``None``: every one does)."""
        ray = self._ray
        for i, actor in enumerate(self.actors):
            try:
                ray.get(actor.clock.remote(), timeout=PROGRESS_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - dead or unreachable
                return i
        return None

    def reset(self) -> None:
        """Forget the micro-batches in flight: tear the graph down (the executions under
        way finish or stop; their sequences are recomputed by the engine, which overwrites
        whatever K/V they wrote) and compile a fresh one on the next ``submit``."""
        self._inflight.clear()
        self._teardown()

    def _abandoned_results(self) -> list:
        """None to take: the graph's own references go with its teardown."""
        return []

    def _teardown(self) -> None:
        dag, self._dag = self._dag, None
        if dag is None:
            return
        # With a stage gone Ray logs each stage loop it could not cancel: expected here.
        ray_log = logging.getLogger("ray.dag.compiled_dag_node")
        level, ray_log.level = ray_log.level, logging.CRITICAL
        try:
            with contextlib.suppress(Exception):  # already torn down by a system error
                dag.teardown()
        finally:
            ray_log.setLevel(level)

    def _kill_actors(self) -> None:
        if not self._stalled:
            self._teardown()  # the stages answer: a clean teardown, then the actors go
        # A stalled stage would hold a teardown up (it waits for every stage's loop):
        # kill first, and the teardown returns at once.
        super()._kill_actors()
        self._teardown()
        self._stalled = False
