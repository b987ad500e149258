"""The plan of ``sarathi-pp plan``: the per-stage decode batch bounds, the engine's KV
blocks, the chunk limits (from the config or a profile CSV) and the chunk size, for one
config, checkpoint, placement and workload (``memory.py`` and ``chunk.py`` have the
formulas; ``render.py`` prints them).

No weights are loaded: the per-stage parameter bytes come from the layer partition the
executors use and equal what the loaded stages report. Bad input raises ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sarathi_pp.checkpoint import Checkpoint
from sarathi_pp.config import EngineConfig
from sarathi_pp.model_spec import ModelSpec
from sarathi_pp.placement import Placement
from sarathi_pp.planner.chunk import (
    ChunkPlan,
    DecodeCoverage,
    check_pd_ratio,
    decode_coverage,
    pd_ratio_of,
    planned_chunk_size,
)
from sarathi_pp.planner.memory import (
    BatchBound,
    StageBound,
    batch_bound,
    engine_decode_batch,
    num_kv_blocks,
    spec_stage_memory,
    stage_bounds,
    with_activations,
)
from sarathi_pp.planner.profile_analysis import analyze_profile
from sarathi_pp.planner.profile_csv import load_profile
from sarathi_pp.scheduler.block_manager import blocks_for


# --- the inputs -----------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkloadInfo:
    """What the plan knows of the workload: its P:D ratio at least."""

    description: str
    pd_ratio: float
    prompt_tokens: float | None  # means, when known
    output_tokens: float | None
    requests: list[tuple[int, int]] | None  # (prompt, output) tokens; None: ratio only
    from_file: bool = False  # a workload file (its requests may all run at once)

    @classmethod
    def from_ratio(cls, pd_ratio: float, description: str | None = None) -> WorkloadInfo:
        """A ratio alone: coverage cannot be counted without request lengths."""
        check_pd_ratio(pd_ratio)
        return cls(description or f"P:D ratio {pd_ratio}", pd_ratio, None, None, None)

    @classmethod
    def from_lengths(cls, prompt_tokens: int, output_tokens: int) -> WorkloadInfo:
        ratio = pd_ratio_of(prompt_tokens, output_tokens)
        desc = f"P = {prompt_tokens}, D = {output_tokens} tokens per request"
        return cls(desc, ratio, prompt_tokens, output_tokens, [(prompt_tokens, output_tokens)])

    @classmethod
    def from_workload_file(
        cls, name: str, prompt_tokens: float, output_tokens: float, requests: list[tuple[int, int]]
    ) -> WorkloadInfo:
        """A workload file: its mean lengths and its requests, (prompt, output) tokens
        each; all of them may run at once."""
        ratio = pd_ratio_of(prompt_tokens, output_tokens)  # ValueError for zero output tokens
        desc = (
            f"{name}: {len(requests)} requests, mean P {prompt_tokens:.1f}, "
            f"D {output_tokens:.1f} tokens"
        )
        return cls(desc, ratio, prompt_tokens, output_tokens, requests, from_file=True)


@dataclass(frozen=True)
class ChunkLimits:
    min_chunk_size: int
    tile_size: int
    notes: tuple[str, ...]  # where they came from when not the config


def chunk_limits(config: EngineConfig, profile: str | None, max_overhead: float) -> ChunkLimits:
    sched = config.scheduler
    if profile is None:
        return ChunkLimits(sched.min_chunk_size, sched.tile_size, ())
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
    checkpoint: Checkpoint
    placement: Placement
    bounds: list[StageBound]
    batch: BatchBound
    kv_cache_blocks: int  # the engine's shared block count for these figures
    block_seqs: int  # full-length sequences those blocks hold
    decode_batch: int  # the B planned with: as chunk_size: auto (engine_decode_batch)
    workload: WorkloadInfo
    limits: ChunkLimits
    chunk: ChunkPlan
    coverage: DecodeCoverage | None
    schedule_ahead: bool = False  # the placement's decision (the in-flight limit follows)

    @property
    def spec(self) -> ModelSpec:
        return self.checkpoint.spec

    @property
    def max_model_len(self) -> int:
        return self.checkpoint.max_model_len

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return self.placement.layer_ranges

    @property
    def num_microbatches_in_flight(self) -> int:
        return self.config.parallel.in_flight_limit(self.schedule_ahead)

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
                f"{self.placement.block_size} // L {self.max_model_len}; max_num_seqs = "
                f"min(B, {b.max_num_seqs}) = {self.decode_batch}"
            )
        return (
            f"{b.binding.formula()} (stage {b.binding.memory.stage_idx}); "
            f"max_num_seqs = min(B, {b.max_num_seqs}) = {self.decode_batch}"
        )


def make_plan(
    config: EngineConfig,
    checkpoint: Checkpoint,
    placement: Placement,
    workload: WorkloadInfo,
    profile: str | None = None,
    max_overhead: float = 0.2,
    schedule_ahead: bool = False,
) -> Plan:
    """The plan for ``workload`` on ``placement``'s stages; ``profile``: a profile CSV whose
    smallest chunk within ``max_overhead`` replaces ``min_chunk_size`` (and its tile);
    ``schedule_ahead``: the driver keeps one micro-batch more in flight (its activations)."""
    spec, max_model_len = checkpoint.spec, checkpoint.max_model_len
    block_size, num_stages = placement.block_size, placement.num_stages
    stages = spec_stage_memory(spec, num_stages, placement.dtype, placement.memory_bytes)
    stages = with_activations(  # as the engine
        stages, config, spec, placement, max_model_len, schedule_ahead=schedule_ahead
    )
    bounds = stage_bounds(stages, max_model_len, config.cache.kv_cache_memory)
    max_num_seqs = config.scheduler.max_num_seqs
    blocks = num_kv_blocks(config.cache, stages, block_size, max_model_len, max_num_seqs)
    block_seqs = blocks // blocks_for(max_model_len, block_size)
    batch = batch_bound(bounds, max_num_seqs)
    decode_batch = engine_decode_batch(
        config.cache, stages, blocks, block_size, max_model_len, max_num_seqs
    )
    limits = chunk_limits(config, profile, max_overhead)
    in_flight = config.parallel.in_flight_limit(schedule_ahead)  # as the engine
    chunk = planned_chunk_size(
        workload.pd_ratio,
        decode_batch,
        in_flight,
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
            in_flight,
            # a workload file: all its requests may run at once; P/D flags: a steady stream
            len(workload.requests) if workload.from_file else None,
        )
    return Plan(
        config, checkpoint, placement, bounds, batch, blocks, block_seqs, decode_batch,
        workload, limits, chunk, coverage, schedule_ahead,
    )  # fmt: skip
