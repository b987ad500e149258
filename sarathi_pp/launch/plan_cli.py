"""``sarathi-pp plan``: the decode batch bound B and the chunk size for a workload, with the
arithmetic shown (``sarathi_pp/planner.py`` has the formulas).

Reads the checkpoint's config.json only (no weights are loaded): the per-stage parameter
bytes come from the layer partition the executors use and equal what the loaded stages
report. Prints a YAML snippet (a ``scheduler:`` section) ready to paste into a config, or
writes it to ``--output``; ``--json`` prints one JSON object instead of the text.

Registered by ``sarathi_pp.launch.cli.build_parser`` through ``add_plan_parser``. Bad
input (a budget smaller than the parameters, zero output tokens, a profile CSV lacking
columns, ...) is a usage error (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sarathi_pp.block_manager import blocks_for
from sarathi_pp.config import EngineConfig
from sarathi_pp.memory import StageMemory, num_kv_blocks
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

DEFAULT_MAX_OVERHEAD = 0.2  # the profile's overhead threshold for the smallest chunk


def add_plan_parser(subparsers: Any) -> None:
    from sarathi_pp.launch.cli import add_engine_args  # cli imports this module

    p = subparsers.add_parser(
        "plan",
        help="plan max_num_seqs (B) and chunk_size for a workload",
        description="Compute the decode batch bound B = floor((M_G - M_S) / (L x m_kv)) of "
        "every stage and the chunk size C = P/D x ceil((B - 1) / n), clamped and rounded to "
        "the matmul tile; print the arithmetic and a YAML snippet for the config.",
    )
    add_engine_args(p)
    g = p.add_argument_group("workload (one of)")
    g.add_argument("--workload", metavar="FILE", help="workload YAML (configs/workloads/)")
    g.add_argument("--pd-ratio", type=float, metavar="X", help="mean prompt / output tokens")
    g.add_argument("--prompt-tokens", type=int, metavar="P", help="prompt tokens per request")
    g.add_argument("--output-tokens", type=int, metavar="D", help="output tokens per request")
    g = p.add_argument_group("machine profile")
    g.add_argument(
        "--profile",
        metavar="FILE",
        help="profile CSV of `sarathi-pp profile`: its smallest acceptable chunk replaces "
        "min_chunk_size and its tile (when found) tile_size",
    )
    g.add_argument(
        "--max-overhead",
        type=float,
        default=DEFAULT_MAX_OVERHEAD,
        metavar="F",
        help=f"overhead of chunked prefill the profile's chunk may cost (default {DEFAULT_MAX_OVERHEAD})",
    )
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON object instead")
    g.add_argument("--output", metavar="FILE", help="write the YAML snippet there")
    p.set_defaults(func=run_plan)


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
    from sarathi_pp.profile_analysis import analyze_profile, load_profile

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


# --- rendering ------------------------------------------------------------------------------
def kv_formula(spec: ModelSpec, num_layers: int, dtype: str) -> str:
    m_kv = spec.kv_bytes_per_token(num_layers, dtype)
    return (
        f"m_kv = 2 (K, V) x {num_layers} layers x {spec.num_kv_heads} KV heads x "
        f"{spec.head_dim} head dim x {dtype_bytes(dtype)} bytes ({dtype}) = {m_kv} bytes/token"
    )


def snippet(plan: Plan) -> str:
    """The ``scheduler:`` section to paste into a config (loadable by ``load_config``)."""
    c = plan.chunk
    lines = [
        f"# sarathi-pp plan: {plan.batch_summary()}",
        f"# chunk_size = tile-rounded C {c.prefill_chunk} + {c.num_decodes} decodes "
        f"(P:D {c.pd_ratio:.3f}, n = {plan.num_microbatches_in_flight} micro-batch(es) in flight)",
        "scheduler:",
        f"  chunk_size: {c.chunk_size}",
        f"  tile_size: {c.tile_size}",
        f"  max_num_seqs: {plan.decode_batch}",
    ]
    if plan.limits.min_chunk_size != plan.config.scheduler.min_chunk_size:
        lines.append(f"  min_chunk_size: {plan.limits.min_chunk_size}  # from the profile")
    return "\n".join(lines) + "\n"


def stage_record(plan: Plan, bound: StageBound) -> dict[str, Any]:
    m: StageMemory = bound.memory
    start, end = plan.ranges[m.stage_idx]
    return {
        "stage_idx": m.stage_idx,
        "layers": [start, end],
        "param_bytes": m.param_bytes,
        "kv_bytes_per_token": m.kv_bytes_per_token,
        "memory_bytes": m.memory_bytes,
        "kv_cache_bytes": bound.kv_cache_bytes,
        "max_decode_batch": bound.max_decode_batch,
    }


def plan_record(plan: Plan) -> dict[str, Any]:
    b, c, w, cov = plan.batch, plan.chunk, plan.workload, plan.coverage
    binding = stage_record(plan, b.binding)
    return {
        "model": plan.config.model.path,
        "device": plan.machine.device,
        "dtype": plan.machine.dtype,
        "num_stages": len(plan.bounds),
        "binding_stage": binding["stage_idx"],
        "max_decode_batch": binding["max_decode_batch"],
        "kv_bytes_per_token": binding["kv_bytes_per_token"],
        "param_bytes": binding["param_bytes"],
        "memory_bytes": binding["memory_bytes"],
        "kv_cache_bytes": binding["kv_cache_bytes"],
        "memory_source": plan.machine.memory_source,
        "max_model_len": plan.max_model_len,
        "max_num_seqs": b.max_num_seqs,
        "block_size": plan.machine.block_size,
        "kv_cache_blocks": plan.kv_cache_blocks,
        "kv_block_decode_batch": plan.block_seqs,
        "effective_decode_batch": plan.decode_batch,
        "binds": plan.binds,
        "pd_ratio": c.pd_ratio,
        "mean_prompt_tokens": w.prompt_tokens,
        "mean_output_tokens": w.output_tokens,
        "num_microbatches_in_flight": plan.num_microbatches_in_flight,
        "num_decodes": c.num_decodes,
        "raw_prefill_chunk": c.raw_prefill_chunk,
        "prefill_chunk": c.prefill_chunk,
        "clamped": c.clamped,
        "min_chunk_size": c.min_chunk_size,
        "max_chunk_size": c.max_chunk_size,
        "tile_size": c.tile_size,
        "chunk_size": c.chunk_size,
        "prefill_rows": c.prefill_rows,
        "reason": c.reason(),
        "limit_notes": list(plan.limits.notes),
        "decode_coverage": None
        if cov is None
        else {
            "num_requests": cov.num_requests,
            "num_decode_steps": cov.num_decode_steps,
            "num_prefill_chunks": cov.num_prefill_chunks,
            "decodes_per_chunk": cov.num_decodes,
            "carried": cov.carried,
            "missed": cov.missed,
        },
        "missed_decodes": None if cov is None else cov.missed,
        "stages": [stage_record(plan, bound) for bound in plan.bounds],
        "yaml": snippet(plan),
    }


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def batch_lines(plan: Plan) -> list[str]:
    m, spec = plan.machine, plan.spec
    lines = [
        f"model {plan.config.model.path}: {spec.num_layers} layers, {m.dtype} on {m.device}, "
        f"{len(plan.bounds)} stage(s); M_G = {m.memory_source} = {m.memory_bytes} bytes "
        f"({_gib(m.memory_bytes)}) per stage",
        f"1. decode batch bound B (L = max_model_len = {plan.max_model_len} tokens):",
    ]
    for bound in plan.bounds:
        s = bound.memory
        start, end = plan.ranges[s.stage_idx]
        lines += [
            f"  stage {s.stage_idx}: layers [{start}, {end}), M_S = {s.param_bytes} bytes "
            f"({_gib(s.param_bytes)}), {kv_formula(spec, end - start, m.dtype)}",
            f"    {bound.formula()}",
        ]
    b = plan.batch
    lines.append(
        f"  binding: stage {b.binding.memory.stage_idx} (B = {b.memory_bound}); "
        f"max_num_seqs = {b.max_num_seqs}; the engine's KV cache: {plan.kv_cache_blocks} blocks "
        f"of {m.block_size} tokens = {plan.block_seqs} sequences of {plan.max_model_len}"
    )
    if plan.block_seqs < plan.decode_batch:
        lines.append(
            f"  (whole blocks hold {plan.decode_batch - plan.block_seqs} full-length "
            "sequence(s) less: max_model_len is not a multiple of the block size)"
        )
    short = f"B = {b.memory_bound}; max_num_seqs = min(B, {b.max_num_seqs}) = {plan.decode_batch}"
    if plan.config.cache.num_kv_blocks is not None:
        short = plan.batch_summary()
    lines.append(f"  -> {short} sequences at once ({plan.binds} binds)")
    return lines


def chunk_lines(plan: Plan) -> list[str]:
    c, n = plan.chunk, plan.num_microbatches_in_flight
    lines = [
        f"2. chunk size ({plan.workload.description}; P:D = {c.pd_ratio:.3f}):",
        f"  decodes per micro-batch = ceil((B - 1) / n) = ceil({plan.decode_batch - 1} / {n}) "
        f"= {c.num_decodes}",
    ]
    lines += [f"  {note}" for note in plan.limits.notes]
    lines += [f"  {part}" for part in c.reason().split("; ")]
    cov = plan.coverage
    lines.append("3. decodes that miss a chunk (run in decode-only micro-batches):")
    if cov is None:
        lines.append("  n/a: needs --workload or --prompt-tokens/--output-tokens")
    else:
        lines.append(
            f"  {cov.num_requests} request(s) need {cov.num_decode_steps} decode steps (output "
            f"tokens - 1 each); their prompts take {cov.num_prefill_chunks} chunks of <= "
            f"{c.prefill_rows} prefill rows carrying up to {cov.num_prefill_chunks} x "
            f"{cov.num_decodes} decodes{_cap_note(cov, c)} -> {cov.missed} miss a chunk "
            f"({100 * cov.missed_fraction:.1f}%)"
        )
    return lines


def _cap_note(cov: DecodeCoverage, chunk: ChunkPlan) -> str:
    if cov.num_decodes == chunk.num_decodes:
        return ""
    return f" (not the planned {chunk.num_decodes}: only the other requests decode beside a chunk)"


def run_plan(args: argparse.Namespace) -> int:
    from sarathi_pp.launch.cli import config_from_args, user_errors

    with user_errors():
        config = config_from_args(args)
        if args.output is not None and not Path(args.output).parent.is_dir():
            raise FileNotFoundError(
                f"output folder {str(Path(args.output).parent)!r} does not exist"
            )
        plan = make_plan(config, args)
    text = snippet(plan)
    if args.json:
        print(json.dumps(plan_record(plan), indent=2))
    else:
        print("\n".join(batch_lines(plan) + chunk_lines(plan)))
        if args.output is None:
            print("YAML snippet for the config:")
            print(text, end="")
    if args.output is not None:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"sarathi-pp: wrote the YAML snippet to {args.output}", file=sys.stderr)
    return 0
