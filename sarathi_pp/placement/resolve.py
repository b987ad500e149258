"""The one placement rule: where the stages run and with what (device, dtype, CPU threads,
memory budget M_G, KV block size, layer ranges).

Pure Python (no torch): the machine comes in as ``Resources``, which the callers probe
(``stages.device.probe_resources`` on this process's machine; the Ray executor from its
cluster). Every executor, the planner, the profiler and the benchmark's peer resolve
``auto`` settings through ``resolve_placement``, so they cannot disagree, and a simulator
can call it with the resources of a machine nobody here has.
"""

from __future__ import annotations

from dataclasses import dataclass

from sarathi_pp.config import EngineConfig, GiB
from sarathi_pp.model_spec import DTYPE_BYTES, ModelSpec
from sarathi_pp.placement.partition import partition_layers

# Tokens per KV block: flash-attn's paged kernels want multiples of 256; vLLM's default else.
FLASH_ATTN_BLOCK_SIZE = 256
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class Resources:
    """What the stages can be given. ``num_cuda_devices`` counts the devices available to the
    pipeline (one per stage: this machine's for one process or torchrun, the cluster's for
    Ray); the other CUDA fields describe one such device."""

    num_cpu_cores: int = 1
    """Cores a stage process may run on (its affinity mask, not the machine's count)."""
    num_cuda_devices: int = 0
    cuda_memory_bytes: int | None = None
    """Total memory of one CUDA device; ``None`` without CUDA."""
    cuda_bf16: bool = False
    """Whether the CUDA devices support bfloat16."""
    flash_attn: bool = False
    """Whether flash-attn is importable where the stages run."""
    memory_bytes: int | None = None
    """Memory this machine has for the stages (all of them when they share the machine:
    one process, local Ray, torchrun on one node): its cgroup limit, else MemTotal. The CPU
    memory budgets must fit in it; ``None``: unknown, not checked."""
    description: str = "this machine"
    """Where the figures come from, for messages."""


@dataclass(frozen=True)
class Placement:
    """Resolved settings of every stage (all stages are alike but for their layers)."""

    device: str  # "cpu" or "cuda" (a torchrun rank adds its local index)
    dtype: str  # float32 / bfloat16 / float16: never "auto"
    num_threads: int | None  # CPU intra-op threads per stage; None: torch's default
    threads_source: str  # why that number, for reports
    memory_bytes: int  # M_G: bytes one stage may use for parameters + KV cache
    memory_source: str  # how M_G was obtained, for reports
    block_size: int  # tokens per KV block
    layer_ranges: tuple[tuple[int, int], ...]  # [layer_start, layer_end) per stage
    attention_backend: str = "auto"  # model.attention_backend, as asked for
    strict_attention_backend: bool = False  # model.strict_attention_backend
    enforce_eager: bool = True  # model.enforce_eager: no CUDA graphs

    @property
    def num_stages(self) -> int:
        return len(self.layer_ranges)


def resolve_placement(config: EngineConfig, spec: ModelSpec, resources: Resources) -> Placement:
    """``config``'s stages on ``resources``; ``ValueError`` naming the setting that cannot be
    met (more stages than layers, CUDA asked for and missing, an unknown dtype)."""
    num_stages = config.parallel.pipeline_parallel_size
    ranges = tuple(partition_layers(spec, num_stages))  # ValueError: more stages than layers
    device = resolve_device(config.model.device, num_stages, resources)
    dtype = resolve_dtype(config.model.dtype, device, resources)
    threads, threads_source = resolve_threads(config, device, resources)
    memory, memory_source = resolve_memory(config, device, resources)
    m = config.model
    block_size = config.cache.block_size or preferred_block_size(
        device, resources, dtype, m.attention_backend
    )
    return Placement(
        device, dtype, threads, threads_source, memory, memory_source, block_size, ranges,
        m.attention_backend, m.strict_attention_backend, m.enforce_eager,
    )  # fmt: skip


def resolve_device(device: str, num_stages: int, resources: Resources) -> str:
    """``auto``: CUDA when every stage can have a device of its own, else CPU."""
    has_cuda = resources.num_cuda_devices >= num_stages
    if device == "auto":
        return "cuda" if has_cuda else "cpu"
    if device == "cuda" and not has_cuda:
        raise ValueError(
            f"device='cuda' needs {num_stages} CUDA device(s), one per stage; "
            f"{resources.description} has {resources.num_cuda_devices}: use device='cpu' or 'auto'"
        )
    return device


def resolve_dtype(dtype: str, device: str, resources: Resources) -> str:
    """``auto``: bfloat16 on CUDA devices that support it, else float32."""
    if dtype == "auto":
        return "bfloat16" if device == "cuda" and resources.cuda_bf16 else "float32"
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return dtype


def resolve_threads(
    config: EngineConfig, device: str, resources: Resources
) -> tuple[int | None, str]:
    """CPU threads per stage: ``num_threads_per_stage`` if set; one stage keeps torch's
    default; several (every replica's: ``data_parallel_size`` x ``pipeline_parallel_size``)
    share the usable cores evenly (at least one each)."""
    if device != "cpu":
        return None, f"{device}: threads do not apply"
    configured = config.parallel.num_threads_per_stage
    if configured is not None:
        return configured, "parallel.num_threads_per_stage"
    p = config.parallel
    num_stages = p.pipeline_parallel_size * p.data_parallel_size
    if num_stages == 1:
        return None, "torch's default (one stage)"
    threads = max(1, resources.num_cpu_cores // num_stages)
    stages = (
        f"{num_stages} stages"
        if p.data_parallel_size == 1
        else (f"{p.data_parallel_size} replicas x {p.pipeline_parallel_size} stages")
    )
    return threads, f"usable cores {resources.num_cpu_cores} // {stages}"


def resolve_memory(config: EngineConfig, device: str, resources: Resources) -> tuple[int, str]:
    """M_G: ``cpu_memory_budget`` on CPU; device memory x ``gpu_memory_utilization`` on CUDA.
    On CPU the stages' budgets together must fit in ``resources.memory_bytes`` (``ValueError``
    with the figures): the KV cache is mapped lazily (unless ``cache.prefault``), so an
    over-large budget would be accepted now and end in an out-of-memory kill mid-run."""
    cache = config.cache
    if device != "cuda":
        check_cpu_budget(cache.cpu_memory_budget, config.parallel.pipeline_parallel_size, resources)
        return cache.cpu_memory_budget, "cpu_memory_budget"
    if resources.cuda_memory_bytes is None:
        raise ValueError(f"the CUDA device memory of {resources.description} is unknown")
    total = resources.cuda_memory_bytes
    return (
        int(total * cache.gpu_memory_utilization),
        f"gpu_memory_utilization {cache.gpu_memory_utilization} x {total} device bytes",
    )


def check_cpu_budget(budget: int, num_stages: int, resources: Resources) -> None:
    """``num_stages`` x ``budget`` within the machine's memory, when it is known."""
    memory = resources.memory_bytes
    if memory is None or num_stages * budget <= memory:
        return
    gib = lambda n: f"{n} bytes ({n / GiB:.1f} GiB)"  # noqa: E731
    raise ValueError(
        f"cache.cpu_memory_budget={gib(budget)} x {num_stages} stage(s) = "
        f"{gib(num_stages * budget)} is more than the {gib(memory)} {resources.description} "
        f"has (its cgroup memory limit, or MemTotal without one): set cache.cpu_memory_budget "
        f"to at most {memory // num_stages} bytes"
    )


def preferred_block_size(
    device: str, resources: Resources, dtype: str = "bfloat16", attention_backend: str = "auto"
) -> int:
    """256 where flash-attn's paged kernels will run (CUDA, installed, float16/bfloat16,
    ``attention_backend`` auto or flash_attn), else 16."""
    wants_flash = attention_backend in ("auto", "flash_attn") and dtype != "float32"
    if device == "cuda" and resources.flash_attn and wants_flash:
        return FLASH_ATTN_BLOCK_SIZE
    return DEFAULT_BLOCK_SIZE
