"""A stage's peak activation memory measured by a profiling forward (``cache.activation_memory:
profile``), vLLM's way of sizing the KV cache on a GPU.

Note [profiling forward]: after its weights are loaded and before its KV cache exists, the
stage runs the largest micro-batch the policy can issue (``planner.memory.max_rows`` rows,
the last stage sampling ``max_num_seqs`` of them) over a temporary KV cache just large
enough for it, and reads the device allocator's peak above what was allocated before
(weights, the temporary cache, the inputs): that is ``M_A`` for one micro-batch. The hidden
states of the other micro-batches in flight waiting at the stage are added as the estimate
counts them (``rows x hidden`` each), since one forward cannot see them. The temporary
cache is dropped before the real one is allocated. ``MemoryProbe`` is the interface
(``CudaMemoryProbe``; a test passes a fake). Unchecked on a GPU: off by default.
"""

from __future__ import annotations

from typing import Protocol

import torch

from sarathi_pp.microbatch import MicroBatch, ScheduledChunk
from sarathi_pp.sampling_params import SamplingParams

PROFILE_NEEDS_UNIPROC = (
    "cache.activation_memory='profile' runs on the single-process executor only (uniproc, "
    "one stage), not on {executor} ({num_stages} stage(s)): use activation_memory='estimate'"
)


class MemoryProbe(Protocol):
    """The device allocator's figures."""

    def reset_peak(self) -> None:
        """Start measuring the peak from what is allocated now."""

    def allocated(self) -> int:
        """Bytes allocated now."""
        ...

    def peak(self) -> int:
        """The most bytes allocated at once since ``reset_peak``."""
        ...


class CudaMemoryProbe:
    """``torch.cuda``'s allocator statistics of ``device`` (set-up time: it synchronises)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


def profiling_microbatch(
    rows: int, num_seqs: int, max_model_len: int, block_size: int
) -> tuple[MicroBatch, int]:
    """A prefill micro-batch of ``rows`` tokens over ``num_seqs`` sequences (each at most
    ``max_model_len`` tokens, more sequences where needed), every one sampling greedily,
    and the KV blocks it writes (Note [profiling forward])."""
    num_seqs = max(num_seqs, -(-rows // max_model_len))
    base, extra = divmod(rows, num_seqs)
    chunks, next_block = [], 0
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    for i in range(num_seqs):
        n = base + int(i < extra)
        if n == 0:
            continue
        need = -(-n // block_size)
        table = tuple(range(next_block, next_block + need))
        next_block += need
        chunks.append(ScheduledChunk(i, 0, (0,) * n, True, table, sampling_params=greedy))
    return MicroBatch(-1, tuple(chunks)), next_block
