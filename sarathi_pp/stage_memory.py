"""One stage's memory figures, the values the planner's arithmetic reads (no torch, no I/O).

A stage reports its ``StageMemory`` after loading its layers (``ModelRunner.memory``); the
executors carry it to the driver (``comm/codec.py`` encodes it for torchrun ranks) and
``planner/memory.py`` turns the stages' figures into KV blocks and the decode batch ``B``.
"""

from __future__ import annotations

from dataclasses import dataclass

# Prompt rows the last stage turns into logits at once (``SamplingParams.prompt_logprobs``):
# 256 rows of a 150K vocabulary are 150 MB of float32.
PROMPT_LOGITS_ROWS = 256


@dataclass(frozen=True)
class StageMemory:
    """``M_S``, ``m_kv``, ``M_G`` and ``M_A`` of one stage, in bytes."""

    stage_idx: int
    param_bytes: int  # M_S
    kv_bytes_per_token: int  # m_kv
    memory_bytes: int  # M_G
    activation_bytes: int = 0  # M_A: peak activations (CUDA; ``with_activations``)
