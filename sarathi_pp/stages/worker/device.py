"""What this process's machine offers the stages (``Resources`` for the placement rule)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from sarathi_pp.placement import Resources
from sarathi_pp.stages.model.attention import flash_attn_available


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


CGROUP_V2_MAX = Path("/sys/fs/cgroup/memory.max")
CGROUP_V1_LIMIT = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")
MEMINFO = Path("/proc/meminfo")


def machine_memory_bytes(
    cgroup_v2: Path = CGROUP_V2_MAX, cgroup_v1: Path = CGROUP_V1_LIMIT, meminfo: Path = MEMINFO
) -> int | None:
    """Memory this machine has for the stages: its ``MemTotal``, or this process's cgroup
    limit (v2 ``memory.max``, else v1 ``memory.limit_in_bytes``) when one is set below it
    (``max`` or v1's huge "unlimited" value is no limit). ``None`` if neither can be read.

    A capacity, not ``MemAvailable``: what other processes use now comes and goes, and a
    start-up refusal should not depend on it."""
    total = _meminfo_kib(meminfo, "MemTotal")
    total = None if total is None else total * 1024
    for path in (cgroup_v2, cgroup_v1):
        limit = _read_int(path)
        if limit is not None:
            return limit if total is None else min(limit, total)
    return total


def _read_int(path: Path) -> int | None:
    """The integer a cgroup file holds; ``None`` if absent, unreadable or ``max``."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo_kib(path: Path, key: str) -> int | None:
    """``key``'s figure in /proc/meminfo (kB, i.e. KiB); ``None`` if absent."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, rest = line.partition(":")
        fields = rest.split()
        if name.strip() == key and fields and fields[0].isdigit():
            return int(fields[0])
    return None


def probe_resources() -> Resources:
    """This machine: usable cores, memory, CUDA devices (memory and bfloat16 of device 0),
    flash-attn."""
    memory = machine_memory_bytes()
    if not torch.cuda.is_available():
        return Resources(num_cpu_cores=usable_cores(), memory_bytes=memory)
    return Resources(
        num_cpu_cores=usable_cores(),
        memory_bytes=memory,
        num_cuda_devices=torch.cuda.device_count(),
        cuda_memory_bytes=torch.cuda.get_device_properties(0).total_memory,
        cuda_bf16=torch.cuda.is_bf16_supported(),
        flash_attn=flash_attn_available(),
    )


def set_num_threads(num_threads: int | None) -> None:
    """Apply a placement's CPU threads (``None``: keep torch's default)."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)


def free_memory_error(free: int, total: int, needed: int, what: str, device: str) -> str | None:
    """Why ``device`` cannot hold ``what`` (``needed`` bytes) with only ``free`` of its
    ``total`` bytes free, or ``None``."""
    if free >= needed:
        return None
    gib = 2**30
    return (
        f"{what} needs {needed / gib:.2f} GiB but {device} has {free / gib:.2f} GiB free of "
        f"{total / gib:.2f} GiB: another process holds memory on the device, or the settings "
        "ask for more than it has (lower gpu_memory_utilization, or set kv_cache_memory / "
        "num_kv_blocks)"
    )


def check_free_cuda_memory(device: torch.device, needed: int, what: str) -> None:
    """``RuntimeError`` (``free_memory_error``) before allocating ``needed`` bytes on a CUDA
    ``device`` that has fewer free (torch's own out-of-memory error would not say which
    setting asked for them); nothing on CPU. Free: the device's, plus what this process's
    caching allocator holds unused (an engine shut down earlier in the process)."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    error = free_memory_error(free, total, needed, what, str(device))
    if error is not None:
        raise RuntimeError(error)
