"""Pipeline parallelism under torchrun: one rank per stage, rank 0 drives.

Rank 0 hosts the engine (with the scheduler) and stage 0 through ``TorchrunExecutor``;
ranks 1..P-1 each run one stage's loop, ``PipelineStage.serve``, driven by ``RankControl``
(``join_as_stage`` sets both up). ``python -m sarathi_pp.launch.torchrun``
starts both sides.

Process groups (every rank joins them in ``join_pipeline``, in the same order): the default
group (from torchrun's environment; NCCL on CUDA, gloo on CPU) is the data plane for hidden
states. Three gloo side groups form the control plane (``ControlPlane``): rank 0 sends each
micro-batch to every rank on ``microbatches``; the last rank sends each micro-batch's
sampled tokens, or its error, back to rank 0 on ``results``; middle ranks send their timing
on ``events``; set-up figures (each stage's memory, then the KV cache shape) go on
``setup``. Every message is plain data (``comm/codec.py``, no pickle) with a size limit
(``comm/objects.py``), and a message of the wrong kind is an error naming its rank. When
every rank is on this machine, gloo binds the loopback interface (``ranks_on_one_node``).
A middle rank that fails exits; the stage after it then fails its receive (closed
connection or timeout, naming the stages) and that error travels to rank 0 the same way.

A stage that raises on a micro-batch (a bad request) stays in step instead
(``PipelineStage.run``: zeros go on, the failure comes back: rank 0's own, a middle rank's
with its timing, the last rank's in its result), and rank 0 retries the micro-batch's
sequences one at a time, as the Ray executor does: only a request that fails alone fails.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from sarathi_pp.checkpoint import Checkpoint, load_checkpoint
from sarathi_pp.comm.dist_setup import bind_gloo_to_loopback, is_loopback, pick_backend
from sarathi_pp.comm.objects import ObjectChannel
from sarathi_pp.comm.p2p import StageCommError
from sarathi_pp.config import EngineConfig
from sarathi_pp.executors.base import StageError
from sarathi_pp.microbatch import (
    MicroBatch,
    MicroBatchResult,
    StageEvent,
    retry_one_at_a_time,
    without_failed,
)
from sarathi_pp.placement import Placement, Resources, resolve_placement, resolve_schedule_ahead
from sarathi_pp.planner.memory import with_activations
from sarathi_pp.stage_memory import StageMemory
from sarathi_pp.stages.loader.builtin import resolve_builtin
from sarathi_pp.stages.worker.device import probe_resources
from sarathi_pp.stages.worker.memory_probe import PROFILE_NEEDS_UNIPROC
from sarathi_pp.stages.worker.model_runner import StageSpec
from sarathi_pp.stages.worker.pipeline_stage import PipelineStage

logger = logging.getLogger(__name__)


@dataclass
class ControlPlane:
    microbatches: ObjectChannel  # rank 0 -> every other rank
    results: ObjectChannel  # last rank -> rank 0: sampled tokens or the error
    events: ObjectChannel  # middle ranks -> rank 0: their timing of each micro-batch
    setup: ObjectChannel  # set-up: StageMemory to rank 0, (num_blocks, block_size) back


def check_world_size(config: EngineConfig) -> None:
    """``ValueError`` unless torchrun started one rank per stage."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise ValueError(
            "not started by torchrun (no WORLD_SIZE/RANK in the environment): run "
            "`torchrun --nproc-per-node P -m sarathi_pp.launch.torchrun ...`, one rank per stage"
        )
    world = int(os.environ["WORLD_SIZE"])
    num_stages = config.parallel.pipeline_parallel_size
    if world != num_stages:
        raise ValueError(
            f"torchrun started {world} processes but pipeline_parallel_size={num_stages}: "
            f"use --nproc-per-node {num_stages} (one rank per stage)"
        )


def torchrun_resources() -> Resources:
    """This node as the placement rule sees it: the stages get CUDA devices when every
    local rank can have one (``LOCAL_WORLD_SIZE`` devices)."""
    local = probe_resources()
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    num_cuda = world if local.num_cuda_devices >= local_world else local.num_cuda_devices
    return dataclasses.replace(local, num_cuda_devices=num_cuda, description="this torchrun node")


def ranks_on_one_node(env: Mapping[str, str] = os.environ) -> bool:
    """Whether every rank runs on this machine: torchrun started them all here
    (``LOCAL_WORLD_SIZE == WORLD_SIZE``) or the rendezvous is on loopback (``--standalone``
    sets ``MASTER_ADDR=localhost``)."""
    local, world = env.get("LOCAL_WORLD_SIZE"), env.get("WORLD_SIZE")
    return (local is not None and local == world) or is_loopback(env.get("MASTER_ADDR", ""))


def join_pipeline(config: EngineConfig, placement: Placement) -> ControlPlane:
    """Join torchrun's process group (the data plane) and create the control plane."""
    t = config.parallel.stage_timeout_s
    timeout = timedelta(seconds=t)
    if ranks_on_one_node():
        bind_gloo_to_loopback()  # before any gloo group exists; GLOO_SOCKET_IFNAME wins
    dist.init_process_group(backend=pick_backend(placement.device), timeout=timeout)
    return ControlPlane(
        microbatches=ObjectChannel(dist.new_group(backend="gloo", timeout=timeout), t),
        results=ObjectChannel(dist.new_group(backend="gloo", timeout=timeout), t),
        events=ObjectChannel(dist.new_group(backend="gloo", timeout=timeout), t),
        setup=ObjectChannel(dist.new_group(backend="gloo", timeout=timeout), t),
    )


def _make_stage(
    config: EngineConfig, checkpoint: Checkpoint, placement: Placement, rank: int
) -> PipelineStage:
    device = placement.device
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
    # No token ring on torchrun ranks: the driver never schedules ahead here.
    spec = StageSpec.of(placement, rank, device, prefault=config.cache.prefault)
    stage = PipelineStage(spec, checkpoint, config.parallel)
    stage.attach_transport()
    return stage


class TorchrunExecutor:
    """Rank 0's executor: runs stage 0 itself, drives the other ranks over the control plane."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint) -> None:
        if config.cache.activation_memory == "profile":  # Note [profiling forward]
            n = config.parallel.pipeline_parallel_size
            raise ValueError(PROFILE_NEEDS_UNIPROC.format(executor="torchrun", num_stages=n))
        if "RANK" not in os.environ:
            raise RuntimeError(
                "the torchrun executor runs under `torchrun ... -m sarathi_pp.launch.torchrun`"
            )
        if int(os.environ["RANK"]) != 0:
            raise RuntimeError(
                "only rank 0 drives the pipeline; the others run PipelineStage.serve"
            )
        check_world_size(config)
        self.num_stages = config.parallel.pipeline_parallel_size
        resources = torchrun_resources()
        self.placement = resolve_placement(config, checkpoint.spec, resources)
        self.schedule_ahead = resolve_schedule_ahead(config, self.placement, resources)
        self.control = join_pipeline(config, self.placement)
        self.stage = _make_stage(config, checkpoint, self.placement, rank=0)
        self.config, self.checkpoint = config, checkpoint
        # (micro-batch, stage 0's result, stage 0's timing); no timing: nothing was run
        self._inflight: deque[tuple[MicroBatch, MicroBatchResult | None, StageEvent | None]] = (
            deque()
        )
        self._closed = False

    def load_model(self) -> list[StageMemory]:
        memories = [self.stage.load_model()]
        for rank in range(1, self.num_stages):
            try:
                memory = self.control.setup.recv(rank, "the stage's memory")
            except StageCommError as e:
                raise StageError(rank, str(e)) from e
            if not isinstance(memory, StageMemory) or memory.stage_idx != rank:
                raise _unexpected(rank, memory, f"stage {rank}'s StageMemory")
            memories.append(memory)
        c = self.checkpoint
        return with_activations(
            memories, self.config, c.spec, self.placement, c.max_model_len,
            schedule_ahead=self.schedule_ahead.on,
        )  # fmt: skip

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        for rank in range(1, self.num_stages):
            self.control.setup.send((num_blocks, block_size), rank)
        self.control.setup.flush()
        self.stage.init_kv_cache(num_blocks, block_size)

    def submit(self, microbatch: MicroBatch) -> None:
        if not microbatch.chunks:  # a retry left nothing of it (``_isolate``)
            self._inflight.append((microbatch, MicroBatchResult(), None))
            return
        for rank in range(1, self.num_stages):
            self.control.microbatches.send(microbatch, rank)
        self._inflight.append((microbatch, *self.stage.run(microbatch)))

    def wait_oldest(self) -> tuple[MicroBatch, MicroBatchResult]:
        microbatch, result = self._wait()
        if result.failure is not None:
            result = self._isolate(microbatch, result)
        return microbatch, result

    def _isolate(self, microbatch: MicroBatch, failed: MicroBatchResult) -> MicroBatchResult:
        """A stage raised on ``microbatch``: retry its sequences one at a time through the
        pipeline, so only a request that fails alone fails (``errors``). The micro-batches
        behind it may have read K/V it left unwritten: their results are drained and
        dropped, and they go again after the retry without the failed sequences (as
        ``RayExecutor._isolate``)."""
        logger.warning("micro-batch %d failed (%s): retrying its sequences one at a time",
                       microbatch.microbatch_id, failed.failure)  # fmt: skip
        behind = [mb for mb, _, _ in self._inflight]
        for _ in behind:
            self._wait()  # drained; whatever it computed is recomputed below
        result = retry_one_at_a_time(microbatch, failed, self._run_alone)
        for mb in behind:
            self.submit(without_failed(mb, result))
        return result

    def _run_alone(self, microbatch: MicroBatch) -> MicroBatchResult:
        """``microbatch`` through the pipeline, nothing else in flight: its result."""
        self.submit(microbatch)
        return self._wait()[1]

    def _wait(self) -> tuple[MicroBatch, MicroBatchResult]:
        """The oldest micro-batch's result as the stages left it: ``failure`` when one of
        them raised on it (rank 0's own, a middle rank's or the last rank's)."""
        microbatch, local, event = self._inflight.popleft()
        if event is None or self.num_stages == 1:  # nothing was run / rank 0 is the last
            assert local is not None
            if event is not None:
                local.events = [event]
            return microbatch, local
        last = self.num_stages - 1
        mb_id = microbatch.microbatch_id
        try:
            message = self.control.results.recv(last, f"micro-batch {mb_id}'s tokens")
        except StageCommError as e:  # the last rank died or the wait timed out
            raise StageError(last, str(e)) from e
        if not (isinstance(message, tuple) and len(message) == 4 and message[0] in _RESULT_KINDS):
            raise _unexpected(last, message, "a result")
        kind, stage_idx, got_id, payload = message
        if kind == "error":
            raise StageError(stage_idx, f"micro-batch {got_id} failed: {payload}")
        if got_id != mb_id:
            raise StageError(stage_idx, f"sent micro-batch {got_id}, expected {mb_id}")
        if not (isinstance(payload, tuple) and tuple(map(type, payload)) == _OK_PAYLOAD):
            raise _unexpected(last, payload, "(MicroBatchResult, StageEvent)")
        result, last_event = payload
        # Middle ranks sent their timing of this micro-batch before the last could finish it.
        middle = [self._stage_timing(r) for r in range(1, last)]
        # every stage's failure, in stage order: rank 0's, the middle ranks', the last's
        failures = [
            f for f in (local and local.failure, *(f for _, f in middle), result.failure) if f
        ]
        if failures:
            result = MicroBatchResult(failure="; ".join(failures))
        result.events = [event, *(e for e, _ in middle), last_event]
        return microbatch, result

    def _stage_timing(self, rank: int) -> tuple[StageEvent, str | None]:
        """A middle rank's timing of a micro-batch and its failure (``None``: it ran)."""
        try:
            message = self.control.events.recv(rank, "stage timing")
        except StageCommError as e:
            raise StageError(rank, str(e)) from e
        if not (
            isinstance(message, tuple)
            and len(message) == 2
            and isinstance(message[0], StageEvent)
            and isinstance(message[1], str | None)
        ):
            raise _unexpected(rank, message, "(StageEvent, failure or None)")
        return message

    def reset(self) -> None:
        """Forget the micro-batches in flight: the other ranks still run them (in order,
        before anything sent later), so their results and timings are received and dropped,
        keeping the control plane in step."""
        pending, self._inflight = list(self._inflight), deque()
        last = self.num_stages - 1
        for _, local, _ in pending:
            if local is None:  # the last rank answers for it
                self.control.results.recv(last, "an abandoned micro-batch's tokens")
                for rank in range(1, last):
                    self.control.events.recv(rank, "stage timing")

    def restart(self) -> None:
        """torchrun started the ranks and rank 0 cannot start new ones: a rank that dies is
        a ``StageError`` (the engine dies), never a ``StageLost``, so the engine never asks
        to replace it."""
        raise NotImplementedError("the torchrun executor cannot replace a lost stage")

    def release_stages(self) -> None:
        self.shutdown()  # nothing set up for the stages outlives them here

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            for rank in range(1, self.num_stages):
                self.control.microbatches.send(None, rank)
            self.control.microbatches.flush()
        except Exception:  # noqa: BLE001 - the others may be gone already
            pass
        self.stage.shutdown()


_RESULT_KINDS = ("ok", "error")
_OK_PAYLOAD = (MicroBatchResult, StageEvent)


def _unexpected(rank: int, got: object, expected: str) -> StageError:
    """A well-formed message of the wrong kind: the ranks disagree on the protocol."""
    return StageError(rank, f"sent {repr(got)[:200]} where {expected} was expected")


def resolve_stage(config: EngineConfig) -> tuple[Checkpoint, Placement]:
    """What a rank's stage runs; bad settings raise here, before any group is joined."""
    check_world_size(config)
    checkpoint = load_checkpoint(config.model, resolve_builtin)
    return checkpoint, resolve_placement(config, checkpoint.spec, torchrun_resources())


def join_as_stage(
    config: EngineConfig, rank: int, checkpoint: Checkpoint, placement: Placement
) -> tuple[PipelineStage, RankControl]:
    """Ranks 1..P-1: join the pipeline's groups; this rank's stage and what drives its loop
    (``stage.serve(control)`` runs it until rank 0 is done)."""
    control = join_pipeline(config, placement)
    stage = _make_stage(config, checkpoint, placement, rank)
    return stage, RankControl(control, rank, stage.stage.is_last)


class RankControl:
    """``StageControl`` for ranks 1..P-1 over the control plane: micro-batches from rank 0;
    the last rank's results (or the error that stops it) back to rank 0 on ``results``, a
    middle rank's timing and failure on ``events``."""

    def __init__(self, control: ControlPlane, rank: int, is_last: bool) -> None:
        self.control, self.rank, self.is_last = control, rank, is_last

    def send_memory(self, memory: StageMemory) -> None:
        self.control.setup.send(memory, 0)

    def recv_kv_shape(self) -> tuple[int, int]:
        shape = self.control.setup.recv(0, "the KV cache shape")
        if not (isinstance(shape, tuple) and tuple(map(type, shape)) == (int, int)):
            raise _unexpected(0, shape, "(num_blocks, block_size)")
        self.control.setup.flush()
        return shape

    def next_microbatch(self) -> MicroBatch | None:
        microbatch = self.control.microbatches.recv(0, "the next micro-batch")
        if not (microbatch is None or isinstance(microbatch, MicroBatch)):
            raise _unexpected(0, microbatch, "a MicroBatch or None")
        return microbatch

    def report(
        self, microbatch: MicroBatch, result: MicroBatchResult | None, event: StageEvent
    ) -> None:
        if self.is_last:
            payload = (result, event)
            self.control.results.send(("ok", self.rank, microbatch.microbatch_id, payload), 0)
        else:  # a middle stage that raised on it sent zeros on: rank 0 retries (_isolate)
            failure = result.failure if result is not None else None
            self.control.events.send((event, failure), 0)

    def report_error(self, microbatch: MicroBatch, error: BaseException) -> None:
        if self.is_last:  # rank 0 waits on the last rank: tell it what failed
            text = f"{type(error).__name__}: {error}".encode(errors="replace").decode()
            self.control.results.send(("error", self.rank, microbatch.microbatch_id, text), 0)
            self.control.results.flush()

    def close(self) -> None:
        self.control.events.flush()
        self.control.results.flush()
