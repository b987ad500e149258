"""What this process's machine offers the stages (``Resources`` for the placement rule)."""

from __future__ import annotations

import os

import torch

from sarathi_pp.placement import Resources
from sarathi_pp.stages.attention import flash_attn_available


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def probe_resources() -> Resources:
    """This machine: usable cores, CUDA devices (memory and bfloat16 of device 0), flash-attn."""
    if not torch.cuda.is_available():
        return Resources(num_cpu_cores=usable_cores())
    return Resources(
        num_cpu_cores=usable_cores(),
        num_cuda_devices=torch.cuda.device_count(),
        cuda_memory_bytes=torch.cuda.get_device_properties(0).total_memory,
        cuda_bf16=torch.cuda.is_bf16_supported(),
        flash_attn=flash_attn_available(),
    )


def set_num_threads(num_threads: int | None) -> None:
    """Apply a placement's CPU threads (``None``: keep torch's default)."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
