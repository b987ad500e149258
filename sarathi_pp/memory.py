"""How many KV blocks the stages can hold (pure arithmetic; shown to the user on error).

Per stage: ``M_G`` = memory the stage may use (CPU: ``cpu_memory_budget``; CUDA: device
memory x ``gpu_memory_utilization``), ``M_S`` = its parameter bytes, ``m_kv`` = bytes of one
token's K and V in its layers. Its KV cache gets ``M_G - M_S`` bytes (or ``kv_cache_memory``
when given), i.e. ``(M_G - M_S) // (block_size * m_kv)`` blocks. All stages share one block
table, so the engine uses the smallest count over the stages, capped at what
``max_num_seqs`` sequences of ``max_model_len`` tokens can ever use (more would sit idle).
"""

from __future__ import annotations

from dataclasses import dataclass

from sarathi_pp.block_manager import blocks_for
from sarathi_pp.config import CacheConfig


@dataclass(frozen=True)
class StageMemory:
    stage_idx: int
    param_bytes: int  # M_S
    kv_bytes_per_token: int  # m_kv
    memory_bytes: int  # M_G


def stage_blocks(cache: CacheConfig, stage: StageMemory, block_size: int) -> int:
    block_bytes = block_size * stage.kv_bytes_per_token
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory // block_bytes
    free = stage.memory_bytes - stage.param_bytes
    if free <= 0:
        raise ValueError(
            f"stage {stage.stage_idx}: parameters need {stage.param_bytes} bytes but the stage "
            f"may use only {stage.memory_bytes} (M_G); raise cpu_memory_budget / "
            "gpu_memory_utilization or use more pipeline stages"
        )
    return free // block_bytes


def num_kv_blocks(
    cache: CacheConfig,
    stages: list[StageMemory],
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
) -> int:
    """The shared block count; ``ValueError`` if one ``max_model_len`` sequence won't fit."""
    needed = blocks_for(max_model_len, block_size)
    if cache.num_kv_blocks is not None:
        blocks, how = cache.num_kv_blocks, f"num_kv_blocks={cache.num_kv_blocks}"
    else:
        per_stage = [stage_blocks(cache, s, block_size) for s in stages]
        blocks = min(per_stage)
        binding = stages[per_stage.index(blocks)]
        budget = cache.kv_cache_memory or binding.memory_bytes - binding.param_bytes
        how = (
            f"stage {binding.stage_idx}: {budget} bytes // ({block_size} tokens x "
            f"{binding.kv_bytes_per_token} bytes/token) = {blocks} blocks"
        )
        blocks = min(blocks, max_num_seqs * needed)
    if blocks < needed:
        raise ValueError(
            f"the KV cache cannot hold one sequence of max_model_len={max_model_len} tokens: "
            f"it needs {needed} blocks of {block_size} tokens, {how}"
        )
    return blocks
