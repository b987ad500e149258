"""What the engine needs of an executor, and the registry it finds one in.

An executor runs micro-batches on the pipeline's stages: ``uniproc`` (one stage in this
process), ``ray`` (one actor per stage), ``ray_compiled`` (the same actors in one Ray
Compiled Graph) or ``torchrun`` (one rank per stage). The engine
reaches them by name through ``create_executor``, whose lazy imports keep the engine loop
free of torch, torch.distributed and Ray (the simulator drives the same loop).

Contract (``Executor``): ``placement`` is the resolved placement of the stages (the
placement rule on the resources the executor sees) and ``schedule_ahead`` whether the driver
schedules ahead on it (``placement.resolve_schedule_ahead``); ``load_model()`` -> per-stage memory
figures; ``init_kv_cache``; ``submit(microbatch)`` issues a micro-batch (it may run
asynchronously); ``wait_oldest()`` returns the oldest outstanding micro-batch with its
``MicroBatchResult``; micro-batches complete in issue order. ``restart()`` replaces lost
stages (``StageLost``): only the Ray executors lose a stage and can replace it; the others
raise. ``reset()`` forgets every micro-batch in flight (an interrupted step): their results
are never returned, and the next ``submit`` starts afresh.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

from sarathi_pp.config import EXECUTORS

if TYPE_CHECKING:
    from sarathi_pp.checkpoint import BuiltinResolver, Checkpoint
    from sarathi_pp.config import EngineConfig
    from sarathi_pp.microbatch import MicroBatch, MicroBatchResult
    from sarathi_pp.placement import Placement, ScheduleAhead
    from sarathi_pp.stage_memory import StageMemory


class StageError(RuntimeError):
    """A pipeline stage died, failed or timed out; the message names the stage."""

    def __init__(self, stage_idx: int, message: str) -> None:
        super().__init__(f"pipeline stage {stage_idx}: {message}")
        self.stage_idx = stage_idx


class StageLost(StageError):
    """A stage's process is gone (its actor died): an executor that can ``restart`` may
    replace it (``parallel.max_stage_restarts``)."""


class Executor(Protocol):
    placement: Placement
    schedule_ahead: ScheduleAhead

    def load_model(self) -> list[StageMemory]: ...
    def init_kv_cache(self, num_blocks: int, block_size: int) -> None: ...
    def submit(self, microbatch: MicroBatch) -> None: ...
    def wait_oldest(self) -> tuple[MicroBatch, MicroBatchResult]: ...
    def reset(self) -> None: ...

    def restart(self) -> None:
        """Replace the stages after one was lost (``StageLost``), as the engine's recovery
        does (``PipelineRecovery._recover`` in ``engine/recovery.py``, at most ``parallel.max_stage_restarts`` times):
        every stage is started afresh with its weights loaded and a KV cache of the shape
        ``init_kv_cache`` gave, empty; the micro-batches in flight are gone (the engine has
        abandoned them and recomputes every running sequence). An executor that never
        raises ``StageLost`` cannot replace a stage and raises instead; the engine then
        dies, saying why."""
        ...

    def release_stages(self) -> None: ...  # the pipeline is lost for good: free the stages
    def shutdown(self) -> None: ...


# Name -> "module:class"; the names are config.EXECUTORS (less "auto", which the config
# resolves), so a config can be checked without importing any executor.
_EXECUTORS = {
    "uniproc": "sarathi_pp.executors.uniproc:UniprocExecutor",
    "ray": "sarathi_pp.executors.ray:RayExecutor",
    "ray_compiled": "sarathi_pp.executors.ray_compiled:RayCompiledExecutor",
    "torchrun": "sarathi_pp.executors.torchrun:TorchrunExecutor",
}
assert set(_EXECUTORS) == set(EXECUTORS) - {"auto"}, (_EXECUTORS, EXECUTORS)


# The stages' builder of ``builtin:NAME`` models (torch and transformers), handed to
# ``checkpoint.load_checkpoint`` from here: the registry is where the torch-free engine
# reaches the stages' code, so the checkpoint module (a tier below) never looks upward.
_BUILTIN_RESOLVER = "sarathi_pp.stages.loader.builtin:resolve_builtin"


def builtin_resolver() -> BuiltinResolver:
    """The resolver of ``builtin:NAME`` models; torch is imported only when one is built."""

    def resolve(name: str) -> str:
        module, _, fn = _BUILTIN_RESOLVER.partition(":")
        resolve_builtin: BuiltinResolver = getattr(importlib.import_module(module), fn)
        return resolve_builtin(name)

    return resolve


def executor_names() -> list[str]:
    return list(_EXECUTORS)


def create_executor(name: str, config: EngineConfig, checkpoint: Checkpoint) -> Executor:
    if name not in _EXECUTORS:
        raise ValueError(f"unknown executor {name!r}; valid: {', '.join(_EXECUTORS)}")
    module, _, cls = _EXECUTORS[name].partition(":")
    return getattr(importlib.import_module(module), cls)(config, checkpoint)
