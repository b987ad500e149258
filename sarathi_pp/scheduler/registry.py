"""Scheduler policies by name, with lazy imports: the names are ``config.SCHEDULER_POLICIES``,
so a config is checked without importing any policy."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from sarathi_pp.config import SCHEDULER_POLICIES

if TYPE_CHECKING:
    from sarathi_pp.config import SchedulerConfig
    from sarathi_pp.scheduler.base import Scheduler

_POLICIES = {
    "sarathi": "sarathi_pp.scheduler.sarathi:SarathiScheduler",
    "vllm": "sarathi_pp.scheduler.vllm:VLLMScheduler",
    "orca": "sarathi_pp.scheduler.orca:OrcaScheduler",
    "simple_chunking": "sarathi_pp.scheduler.simple_chunking:SimpleChunkingScheduler",
}
assert tuple(_POLICIES) == SCHEDULER_POLICIES, (_POLICIES, SCHEDULER_POLICIES)


def scheduler_names() -> list[str]:
    return list(_POLICIES)


def policy_class(policy: str) -> type[Scheduler]:
    if policy not in _POLICIES:
        raise ValueError(f"unknown scheduler {policy!r}; valid: {', '.join(scheduler_names())}")
    module, _, name = _POLICIES[policy].partition(":")
    return getattr(importlib.import_module(module), name)


def create_scheduler(
    config: SchedulerConfig,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    num_microbatches_in_flight: int = 1,
    max_decode_batch: int | None = None,
    first_microbatch_id: int = 0,
    num_decode_microbatches_in_flight: int | None = None,
    enable_prefix_caching: bool = False,
) -> Scheduler:
    """``max_decode_batch``: B for ``chunk_size: auto``; ``first_microbatch_id``: where the
    micro-batch ids start; ``num_decode_microbatches_in_flight``: the limit while only
    decodes run (see ``Scheduler``); ``enable_prefix_caching``: ``cache.enable_prefix_caching``."""
    return policy_class(config.policy)(
        config,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        num_microbatches_in_flight=num_microbatches_in_flight,
        max_decode_batch=max_decode_batch,
        first_microbatch_id=first_microbatch_id,
        num_decode_microbatches_in_flight=num_decode_microbatches_in_flight,
        enable_prefix_caching=enable_prefix_caching,
    )
