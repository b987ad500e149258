"""Executors run micro-batches on the stages; the engine reaches them by name through
this registry, with lazy imports, so the core never imports torch.distributed or Ray.

Contract (``Executor``): ``load_model()`` -> per-stage memory figures;
``preferred_block_size()`` (what the attention backend wants); ``init_kv_cache``;
``submit(micro-batch)`` issues a micro-batch (it may run asynchronously); ``wait_oldest()`` returns the
oldest outstanding micro-batch with its ``StepResult``; micro-batches complete in issue order.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from sarathi_pp.events import StageEvent

if TYPE_CHECKING:
    from sarathi_pp.config import EngineConfig
    from sarathi_pp.memory import StageMemory
    from sarathi_pp.model_spec import ModelSpec
    from sarathi_pp.microbatch import MicroBatch


class StageError(RuntimeError):
    """A pipeline stage died, failed or timed out; the message names the stage."""

    def __init__(self, stage_idx: int, message: str) -> None:
        super().__init__(f"pipeline stage {stage_idx}: {message}")
        self.stage_idx = stage_idx


@dataclass
class StepResult:
    sampled: dict[int, int] = field(default_factory=dict)  # seq_id -> token id
    errors: dict[int, str] = field(default_factory=dict)  # seq_id -> why it failed
    events: list[StageEvent] = field(default_factory=list)  # each stage's timing of the micro-batch


class Executor(Protocol):
    def load_model(self) -> list[StageMemory]: ...
    def preferred_block_size(self) -> int: ...
    def init_kv_cache(self, num_blocks: int, block_size: int) -> None: ...
    def submit(self, microbatch: MicroBatch) -> None: ...
    def wait_oldest(self) -> tuple[MicroBatch, StepResult]: ...
    def shutdown(self) -> None: ...


_EXECUTORS = {
    "uniproc": "sarathi_pp.stages.executor:UniprocExecutor",
    "ray": "sarathi_pp.launch.ray_executor:RayExecutor",
    "torchrun": "sarathi_pp.launch.torchrun:TorchrunExecutor",
}


def executor_names() -> list[str]:
    return list(_EXECUTORS)


def create_executor(
    name: str, config: EngineConfig, spec: ModelSpec, model_dir: str, max_model_len: int
) -> Executor:
    if name not in _EXECUTORS:
        raise ValueError(f"unknown executor {name!r}; valid: {', '.join(_EXECUTORS)}")
    module, _, cls = _EXECUTORS[name].partition(":")
    return getattr(importlib.import_module(module), cls)(config, spec, model_dir, max_model_len)
