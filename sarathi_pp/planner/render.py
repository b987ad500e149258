"""How ``sarathi-pp plan`` shows a ``Plan`` (``recommend.py``): the arithmetic as text
lines, one JSON record, and the ``scheduler:`` YAML snippet to paste into a config."""

from __future__ import annotations

from typing import Any

from sarathi_pp.model_spec import ModelSpec
from sarathi_pp.planner.chunk import ChunkPlan, DecodeCoverage
from sarathi_pp.planner.memory import StageBound, dtype_bytes
from sarathi_pp.planner.recommend import Plan
from sarathi_pp.stage_memory import StageMemory


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
        f"# chunk_size = C {c.prefill_chunk} + {c.num_decodes} decodes rounded to the tile: "
        f"{c.prefill_rows} prefill rows "
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
        "activation_bytes": m.activation_bytes,
        "kv_cache_bytes": bound.kv_cache_bytes,
        "max_decode_batch": bound.max_decode_batch,
    }


def plan_record(plan: Plan) -> dict[str, Any]:
    b, c, w, cov = plan.batch, plan.chunk, plan.workload, plan.coverage
    binding = stage_record(plan, b.binding)
    return {
        "model": plan.config.model.path,
        "device": plan.placement.device,
        "dtype": plan.placement.dtype,
        "num_stages": len(plan.bounds),
        "binding_stage": binding["stage_idx"],
        "max_decode_batch": binding["max_decode_batch"],
        "kv_bytes_per_token": binding["kv_bytes_per_token"],
        "param_bytes": binding["param_bytes"],
        "memory_bytes": binding["memory_bytes"],
        "activation_bytes": binding["activation_bytes"],
        "kv_cache_bytes": binding["kv_cache_bytes"],
        "memory_source": plan.placement.memory_source,
        "max_model_len": plan.max_model_len,
        "max_num_seqs": b.max_num_seqs,
        "block_size": plan.placement.block_size,
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
    m, spec = plan.placement, plan.spec
    lines = [
        f"model {plan.config.model.path}: {spec.num_layers} layers, {m.dtype} on {m.device}, "
        f"{len(plan.bounds)} stage(s); M_G = {m.memory_source} = {m.memory_bytes} bytes "
        f"({_gib(m.memory_bytes)}) per stage",
        f"1. decode batch bound B (L = max_model_len = {plan.max_model_len} tokens):",
    ]
    for bound in plan.bounds:
        s = bound.memory
        start, end = plan.ranges[s.stage_idx]
        m_a = ""
        if s.activation_bytes:
            m_a = f", M_A = {s.activation_bytes} bytes ({_gib(s.activation_bytes)}) activations"
        lines += [
            f"  stage {s.stage_idx}: layers [{start}, {end}), M_S = {s.param_bytes} bytes "
            f"({_gib(s.param_bytes)}){m_a}, {kv_formula(spec, end - start, m.dtype)}",
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
