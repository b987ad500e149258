"""The plan of ``sarathi-pp plan``, assembled from the config, the checkpoint's config.json
and the workload: the machine (device, dtype, M_G, block size), the per-stage decode batch
bounds, the engine's KV blocks, the chunk limits (from the config or a profile CSV) and the
chunk size (``sarathi_pp/planner.py`` has the formulas; ``plan_render.py`` prints them).

No weights are loaded: the per-stage parameter bytes come from the layer partition the
executors use and equal what the loaded stages report. Bad input raises ``ValueError``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from sarathi_pp.block_manager import blocks_for
from sarathi_pp.config import EngineConfig
from sarathi_pp.memory import num_kv_blocks
from sarathi_pp.model_spec import ModelSpec
from sarathi_pp.planner import (
    BatchBound,
    ChunkPlan,
    DecodeCoverage,
    StageBound,
    batch_bound,
    decode_coverage,
    dtype_bytes,
    pd_ratio_of,
    planned_chunk_size,
    spec_stage_memory,
    stage_bounds,
)
from sarathi_pp.scheduler.chunk_tuner import engine_decode_batch


# --- the inputs -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Machine:
    device: str
    dtype: str
    memory_bytes: int  # M_G per stage
    memory_source: str  # how M_G was obtained, for the report
    block_size: int


def resolve_machine(config: EngineConfig) -> Machine:
    """Device, dtype, M_G and block size as the engine resolves them. torch is imported
    only when something is ``auto`` or CUDA (the planner itself never needs it)."""
    device, dtype, block_size = config.model.device, config.model.dtype, config.cache.block_size
    if device == "auto" or dtype == "auto" or device == "cuda":
        from sarathi_pp.stages.device import resolve_device, resolve_dtype

        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
    dtype_bytes(dtype)  # ValueError for an unknown dtype, naming the known ones
    cache = config.cache
    if device == "cuda":
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        memory = int(total * cache.gpu_memory_utilization)
        source = f"gpu_memory_utilization {cache.gpu_memory_utilization} x {total} device bytes"
    else:
        memory, source = cache.cpu_memory_budget, "cpu_memory_budget"
    if block_size is None:
        block_size = 16
        if device == "cuda":
            import torch

            from sarathi_pp.stages.attention import preferred_block_size

            block_size = preferred_block_size(torch.device("cuda"))
    return Machine(device, dtype, memory, source, block_size)


@dataclass(frozen=True)
class WorkloadInfo:
    description: str
    pd_ratio: float
    prompt_tokens: float | None  # means, when known
    output_tokens: float | None
    requests: list[tuple[int, int]] | None  # (prompt, output) tokens; None: ratio only
    from_file: bool = False  # a workload file (its requests may all run at once)


def workload_info(args: argparse.Namespace, spec: ModelSpec, max_model_len: int) -> WorkloadInfo:
    given = [
        name
        for name, v in (
            ("--workload", args.workload),
            ("--pd-ratio", args.pd_ratio),
            ("--prompt-tokens/--output-tokens", (args.prompt_tokens, args.output_tokens)),
        )
        if v not in (None, (None, None))
    ]
    if len(given) != 1:
        raise ValueError(
            "give one of --workload FILE, --pd-ratio X or --prompt-tokens P --output-tokens D"
            + (f" (got {' and '.join(given)})" if given else "")
        )
    if args.workload is not None:
        return _from_workload_file(args.workload, spec, max_model_len)
    if args.pd_ratio is not None:
        ratio = args.pd_ratio
        if not ratio > 0:
            raise ValueError(f"--pd-ratio must be > 0, got {ratio}")
        return WorkloadInfo(f"--pd-ratio {ratio}", ratio, None, None, None)
    if args.prompt_tokens is None or args.output_tokens is None:
        raise ValueError("--prompt-tokens and --output-tokens go together")
    p, d = args.prompt_tokens, args.output_tokens
    ratio = pd_ratio_of(p, d)
    return WorkloadInfo(f"P = {p}, D = {d} tokens per request", ratio, p, d, [(p, d)])


def _from_workload_file(path: str, spec: ModelSpec, max_model_len: int) -> WorkloadInfo:
    from sarathi_pp.bench.workload import load_workload

    w = load_workload(path)
    p, d = w.mean_prompt_tokens(), w.mean_output_tokens()
    ratio = pd_ratio_of(p, d)  # ValueError for zero output tokens
    sampled = w.requests(spec.vocab_size, max_model_len)  # ValueError if one won't fit
    reqs = [(len(r.prompt_token_ids), r.output_tokens) for r in sampled]
    desc = f"{path}: {len(reqs)} requests, mean P {p:.1f}, D {d:.1f} tokens"
    return WorkloadInfo(desc, ratio, p, d, reqs, from_file=True)


@dataclass(frozen=True)
class ChunkLimits:
    min_chunk_size: int
    tile_size: int
    notes: tuple[str, ...]  # where they came from when not the config


def chunk_limits(config: EngineConfig, profile: str | None, max_overhead: float) -> ChunkLimits:
    sched = config.scheduler
    if profile is None:
        return ChunkLimits(sched.min_chunk_size, sched.tile_size, ())
    from sarathi_pp.profile_analysis import analyze_profile
    from sarathi_pp.profile_csv import load_profile

    findings = analyze_profile(load_profile(profile), max_overhead=max_overhead)
    min_chunk = findings.min_chunk.get(max_overhead)
    if min_chunk is None:
        known = ", ".join(f"{k:g}" for k in sorted(findings.min_chunk)) or "none"
        raise ValueError(
            f"profile {profile!r}: no chunk keeps the chunked-prefill overhead within "
            f"{max_overhead:g} (thresholds with a chunk: {known})"
        )
    if min_chunk > sched.max_chunk_size:
        raise ValueError(
            f"profile {profile!r}: the smallest chunk within {max_overhead:g} overhead is "
            f"{min_chunk} tokens, above max_chunk_size={sched.max_chunk_size}"
        )
    notes = [f"min_chunk_size {min_chunk} from the profile (overhead <= {max_overhead:g})"]
    tile = sched.tile_size
    if findings.tile_size is not None:
        tile = findings.tile_size
        notes.append(f"tile_size {tile} from the profile")
    else:
        notes.append(f"the profile shows no clear tile steps: tile_size {tile} from the config")
    return ChunkLimits(min_chunk, tile, tuple(notes))


# --- the plan -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    config: EngineConfig
    spec: ModelSpec
    machine: Machine
    max_model_len: int
    ranges: list[tuple[int, int]]
    bounds: list[StageBound]
    batch: BatchBound
    kv_cache_blocks: int  # the engine's shared block count for these figures
    block_seqs: int  # full-length sequences those blocks hold
    decode_batch: int  # the B planned with: as chunk_size: auto (engine_decode_batch)
    workload: WorkloadInfo
    limits: ChunkLimits
    chunk: ChunkPlan
    coverage: DecodeCoverage | None

    @property
    def num_microbatches_in_flight(self) -> int:
        return self.config.parallel.microbatches_in_flight

    @property
    def binds(self) -> str:
        """What sets ``decode_batch``: ``memory``, ``max_num_seqs`` or ``num_kv_blocks``."""
        if self.config.cache.num_kv_blocks is not None and self.decode_batch < min(
            self.batch.memory_bound, self.batch.max_num_seqs
        ):
            return "num_kv_blocks"
        return self.batch.binds

    def batch_summary(self) -> str:
        b = self.batch
        if self.config.cache.num_kv_blocks is not None:
            return (
                f"B = num_kv_blocks {self.config.cache.num_kv_blocks} x block_size "
                f"{self.machine.block_size} // L {self.max_model_len}; max_num_seqs = "
                f"min(B, {b.max_num_seqs}) = {self.decode_batch}"
            )
        return (
            f"{b.binding.formula()} (stage {b.binding.memory.stage_idx}); "
            f"max_num_seqs = min(B, {b.max_num_seqs}) = {self.decode_batch}"
        )


def make_plan(config: EngineConfig, args: argparse.Namespace) -> Plan:
    from sarathi_pp.engine import resolve_max_model_len
    from sarathi_pp.model_path import resolve_model_path
    from sarathi_pp.model_spec import load_model_spec
    from sarathi_pp.stages.partition import partition_layers

    spec = load_model_spec(resolve_model_path(config.model.path))
    max_model_len = resolve_max_model_len(config, spec)
    machine = resolve_machine(config)
    num_stages = config.parallel.pipeline_parallel_size
    stages = spec_stage_memory(spec, num_stages, machine.dtype, machine.memory_bytes)
    bounds = stage_bounds(stages, max_model_len, config.cache.kv_cache_memory)
    blocks = num_kv_blocks(
        config.cache, stages, machine.block_size, max_model_len, config.scheduler.max_num_seqs
    )
    block_seqs = blocks // blocks_for(max_model_len, machine.block_size)
    batch = batch_bound(bounds, config.scheduler.max_num_seqs)
    decode_batch = engine_decode_batch(
        config.cache, stages, blocks, machine.block_size, max_model_len,
        config.scheduler.max_num_seqs,
    )  # fmt: skip
    workload = workload_info(args, spec, max_model_len)
    limits = chunk_limits(config, args.profile, args.max_overhead)
    chunk = planned_chunk_size(
        workload.pd_ratio,
        decode_batch,
        config.parallel.microbatches_in_flight,
        limits.min_chunk_size,
        config.scheduler.max_chunk_size,
        limits.tile_size,
    )
    coverage = None
    if workload.requests is not None:
        coverage = decode_coverage(
            workload.requests,
            chunk.prefill_rows,
            chunk.num_decodes,
            config.parallel.microbatches_in_flight,
            # a workload file: all its requests may run at once; P/D flags: a steady stream
            len(workload.requests) if workload.from_file else None,
        )
    ranges = partition_layers(spec, num_stages)
    return Plan(
        config, spec, machine, max_model_len, ranges, bounds, batch, blocks, block_seqs,
        decode_batch, workload, limits, chunk, coverage,
    )  # fmt: skip
