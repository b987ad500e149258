"""Executors: run micro-batches on the pipeline's stages (``base`` has the contract and the
registry; ``uniproc``, ``ray`` and ``torchrun`` are imported only when chosen)."""

from sarathi_pp.executors.base import (
    Executor,
    StageError,
    StageLost,
    builtin_resolver,
    create_executor,
    executor_names,
)

__all__ = [
    "Executor",
    "StageError",
    "StageLost",
    "builtin_resolver",
    "create_executor",
    "executor_names",
]
