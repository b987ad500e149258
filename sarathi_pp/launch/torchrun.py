"""``torchrun --nproc-per-node P -m sarathi_pp.launch.torchrun --config ... [generate flags]``

One rank per pipeline stage. Rank 0 hosts the scheduler (the engine) and stage 0 and writes
the outputs, exactly as ``sarathi-pp generate`` does; ranks 1..P-1 each serve one stage.

Process groups: the default group (from torchrun's environment; NCCL on CUDA, gloo on CPU)
is the data plane for hidden states. Two gloo side groups form the control plane: rank 0
broadcasts each micro-batch on ``micro-batches``; the last rank sends each micro-batch's sampled
tokens, or its error, back to rank 0 on ``results``. A middle rank that fails exits; the
stage after it then fails its receive (closed connection or timeout, naming the stages)
and that error travels to rank 0 the same way.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from sarathi_pp.comm.objects import ObjectChannel
from sarathi_pp.comm.p2p import StageCommError
from sarathi_pp.config import EngineConfig
from sarathi_pp.events import StageEvent
from sarathi_pp.executor import StageError, StepResult
from sarathi_pp.memory import StageMemory
from sarathi_pp.model_spec import ModelSpec, load_model_spec
from sarathi_pp.microbatch import MicroBatch
from sarathi_pp.stages.device import resolve_device, resolve_dtype
from sarathi_pp.stages.partition import partition_layers
from sarathi_pp.stages.pipeline_stage import PipelineStage
from sarathi_pp.stages.runner import StageSpec


@dataclass
class _Groups:
    microbatches: ObjectChannel  # rank 0 -> every other rank
    results: ObjectChannel  # last rank -> rank 0: sampled tokens or the error
    events: ObjectChannel  # middle ranks -> rank 0: their timing of each micro-batch
    setup: object  # gloo group for the one-off collectives of set-up


_GROUPS: _Groups | None = None  # set once per process by ``init_torchrun``
_ACTIVE: list[TorchrunExecutor] = []  # rank 0's executor, released in ``main`` whatever happens


def init_torchrun(config: EngineConfig) -> _Groups:
    """Join torchrun's process group and create the control-plane side groups."""
    global _GROUPS
    world = int(os.environ["WORLD_SIZE"])
    num_stages = config.parallel.pipeline_parallel_size
    if world != num_stages:
        raise ValueError(
            f"torchrun started {world} processes but pipeline_parallel_size={num_stages}: "
            f"use --nproc-per-node {num_stages} (one rank per stage)"
        )
    from sarathi_pp.comm.dist_setup import pick_backend

    device = resolve_device(config.model.device)
    timeout = timedelta(seconds=config.parallel.stage_timeout_s)
    dist.init_process_group(backend=pick_backend(device), timeout=timeout)
    t = config.parallel.stage_timeout_s
    _GROUPS = _Groups(
        microbatches=ObjectChannel(dist.new_group(backend="gloo", timeout=timeout), t),
        results=ObjectChannel(dist.new_group(backend="gloo", timeout=timeout), t),
        events=ObjectChannel(dist.new_group(backend="gloo", timeout=timeout), t),
        setup=dist.new_group(backend="gloo", timeout=timeout),
    )
    return _GROUPS


def _make_stage(config: EngineConfig, spec: ModelSpec, model_dir: str, max_model_len: int, rank: int) -> PipelineStage:
    n = config.parallel.pipeline_parallel_size
    start, end = partition_layers(spec, n)[rank]
    device = resolve_device(config.model.device)
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
    dtype = resolve_dtype(config.model.dtype, device)
    stage = StageSpec(rank, n, start, end, dtype, device)
    s = PipelineStage(stage, spec, model_dir, max_model_len, config.parallel, config.cache)
    s.attach_transport()
    return s


class TorchrunExecutor:
    """Rank 0's executor: runs stage 0 itself, drives the other ranks over the side groups."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, model_dir: str, max_model_len: int) -> None:
        if _GROUPS is None:
            raise RuntimeError("the torchrun executor runs under `python -m sarathi_pp.launch.torchrun`")
        self.groups = _GROUPS
        self.num_stages = config.parallel.pipeline_parallel_size
        self.stage = _make_stage(config, spec, model_dir, max_model_len, rank=0)
        self._inflight: deque[tuple[MicroBatch, StepResult | None, StageEvent]] = deque()
        self._closed = False
        _ACTIVE.append(self)

    def load_model(self) -> list[StageMemory]:
        memories: list = [None] * self.num_stages
        dist.all_gather_object(memories, self.stage.load_model(), group=self.groups.setup)
        return memories

    def preferred_block_size(self) -> int:
        return self.stage.preferred_block_size()

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        dist.broadcast_object_list([(num_blocks, block_size)], src=0, group=self.groups.setup)
        self.stage.init_kv_cache(num_blocks, block_size)

    def submit(self, microbatch: MicroBatch) -> None:
        for rank in range(1, self.num_stages):
            self.groups.microbatches.send(microbatch, rank)
        self._inflight.append((microbatch, *self.stage.run(microbatch)))

    def wait_oldest(self) -> tuple[MicroBatch, StepResult]:
        microbatch, local, event = self._inflight.popleft()
        if local is not None:  # a single stage: rank 0 is also the last
            local.events = [event]
            return microbatch, local
        last = self.num_stages - 1
        try:
            message = self.groups.results.recv(last, f"micro-batch {microbatch.microbatch_id}'s tokens")
        except StageCommError as e:  # the last rank died or the wait timed out
            raise StageError(last, str(e)) from e
        kind, stage_idx, microbatch_id, payload = message
        if kind == "error":
            raise StageError(stage_idx, f"micro-batch {microbatch_id} failed: {payload}")
        if microbatch_id != microbatch.microbatch_id:
            raise StageError(stage_idx, f"sent micro-batch {microbatch_id}, expected {microbatch.microbatch_id}")
        result, last_event = payload
        # Middle ranks sent their timing of this micro-batch before the last rank could finish it.
        middle = [self.groups.events.recv(r, "stage timing") for r in range(1, last)]
        result.events = [event, *middle, last_event]
        return microbatch, result

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            for rank in range(1, self.num_stages):
                self.groups.microbatches.send(None, rank)
            self.groups.microbatches.flush()
        except Exception:  # noqa: BLE001 - the others may be gone already
            pass
        self.stage.shutdown()


def serve_stage(config: EngineConfig, rank: int) -> None:
    """Ranks 1..P-1: run one stage on every micro-batch rank 0 broadcasts, until ``None``."""
    from sarathi_pp.engine import resolve_max_model_len
    from sarathi_pp.model_path import resolve_model_path

    groups = _GROUPS
    assert groups is not None
    model_dir = resolve_model_path(config.model.path)
    spec = load_model_spec(model_dir)
    stage = _make_stage(config, spec, model_dir, resolve_max_model_len(config, spec), rank)
    dist.all_gather_object([None] * stage.stage.num_stages, stage.load_model(), group=groups.setup)
    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=groups.setup)
    stage.init_kv_cache(*box[0])
    while (microbatch := groups.microbatches.recv(0, "the next micro-batch")) is not None:
        try:
            result, event = stage.run(microbatch)
        except Exception as e:
            if stage.stage.is_last:  # rank 0 waits on the last rank: tell it what failed
                groups.results.send(("error", rank, microbatch.microbatch_id, f"{type(e).__name__}: {e}"), 0)
                groups.results.flush()
            raise
        if stage.stage.is_last:
            groups.results.send(("ok", rank, microbatch.microbatch_id, (result, event)), 0)
        else:
            groups.events.send(event, 0)
    groups.events.flush()
    groups.results.flush()
    stage.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Same flags as ``sarathi-pp generate``; rank 0 prints and writes the outputs."""
    from sarathi_pp.launch import cli

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = cli.build_parser()
    args = parser.parse_args(["generate", *argv, "--set", "parallel.executor=torchrun"])
    try:
        with cli.user_errors():
            config = cli.config_from_args(args)
            init_torchrun(config)
        rank = dist.get_rank()
        if rank == 0:
            return args.func(args)
        serve_stage(config, rank)
        return 0
    except cli.UsageError as e:
        print(f"{cli.PROG}: error: {e}", file=sys.stderr)
        return 2
    finally:
        for executor in _ACTIVE:  # e.g. a bad prompt after the model loaded: free the ranks
            executor.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    # Run the importable module's main, not this ``__main__`` copy: the executor that the
    # engine's registry imports must see the groups that ``init_torchrun`` set.
    from sarathi_pp.launch.torchrun import main as _main

    sys.exit(_main())
