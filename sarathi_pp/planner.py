"""The chunk-size and batch-size planner: how many sequences fit, and what chunk suits them.

Pure Python (no torch): the CLI passes the device memory in. Three steps (``sarathi-pp
plan`` prints each with its numbers):

1. **Decode batch bound B.** A stage may use ``M_G`` bytes (CPU: ``cpu_memory_budget``;
   CUDA: device memory x ``gpu_memory_utilization``) and holds ``M_S`` bytes of parameters;
   its KV cache gets the rest, ``M_G - M_S`` (the same figure ``memory.stage_blocks`` sizes
   the engine's cache from). One sequence of ``L = max_model_len`` tokens needs
   ``L x m_kv`` bytes, so ``B = floor((M_G - M_S) / (L x m_kv))`` sequences fit. The stage
   with the smallest B binds; the scheduler never runs more than ``max_num_seqs`` either.
2. **Chunk from the P:D ratio.** A hybrid micro-batch holds one prefill chunk of C tokens
   and the decodes it piggybacks; the best P:D ratio is ``C / decodes``, so a workload of
   mean P prompt and D output tokens wants ``C = P/D x decodes``. With ``n`` micro-batches
   in flight the ``B - 1`` decoding sequences are spread over them: ``ceil((B - 1) / n)``
   each (see ``decodes_per_microbatch``). C is clamped to ``[min_chunk_size,
   max_chunk_size]``; the token budget ``chunk_size`` is C plus those decodes.
3. **Tile quantization.** The budget is rounded down to a multiple of the matmul tile
   (a few rows past a tile boundary cost a whole extra tile), never below one tile.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from sarathi_pp.memory import StageMemory
from sarathi_pp.model_spec import DTYPE_BYTES, ModelSpec
from sarathi_pp.stages.partition import partition_layers, stage_params


# --- 1. the decode batch bound B ------------------------------------------------------------
def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of ``dtype``; ``ValueError`` naming the known ones."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def max_decode_batch(
    memory_bytes: int, param_bytes: int, max_model_len: int, kv_bytes_per_token: int
) -> int:
    """``B = floor((M_G - M_S) / (L x m_kv))``: sequences of ``max_model_len`` tokens whose
    K and V fit next to the parameters. ``ValueError`` with the numbers when not one fits."""
    if max_model_len < 1 or kv_bytes_per_token < 1:
        raise ValueError(
            f"max_model_len ({max_model_len}) and kv_bytes_per_token ({kv_bytes_per_token}) "
            "must be >= 1"
        )
    free = memory_bytes - param_bytes  # the KV cache's bytes, as memory.stage_blocks
    if free <= 0:
        raise ValueError(
            f"the parameters need M_S = {param_bytes} bytes ({param_bytes / 2**30:.2f} GiB) but "
            f"the stage may use only M_G = {memory_bytes} bytes ({memory_bytes / 2**30:.2f} GiB); "
            "raise cpu_memory_budget / gpu_memory_utilization or use more pipeline stages"
        )
    per_seq = max_model_len * kv_bytes_per_token  # L x m_kv
    batch = free // per_seq
    if batch < 1:
        raise ValueError(
            f"not one sequence fits: B = (M_G - M_S) / (L x m_kv) = ({memory_bytes} - "
            f"{param_bytes}) / ({max_model_len} x {kv_bytes_per_token}) = {free / per_seq:.3f}; "
            "lower max_model_len or raise the memory budget"
        )
    return batch


def kv_cache_batch(kv_cache_memory: int, max_model_len: int, kv_bytes_per_token: int) -> int:
    """B when ``cache.kv_cache_memory`` fixes the KV bytes per stage (the engine then
    ignores M_G - M_S): ``floor(kv_cache_memory / (L x m_kv))``."""
    return max_decode_batch(kv_cache_memory, 0, max_model_len, kv_bytes_per_token)


def spec_stage_memory(
    spec: ModelSpec, num_stages: int, dtype: str, memory_bytes: int
) -> list[StageMemory]:
    """Each stage's M_S, m_kv and M_G from the checkpoint's config alone: the layers
    ``partition_layers`` gives it (as the executors split them), the embedding on the first
    stage, final norm and lm_head on the last (``stage_params``). Equals what the workers
    report once loaded (``LLMEngine.stage_memory``)."""
    nbytes = dtype_bytes(dtype)
    ranges = partition_layers(spec, num_stages)
    params = stage_params(spec, ranges)
    return [
        StageMemory(
            stage_idx=i,
            param_bytes=p * nbytes,
            kv_bytes_per_token=spec.kv_bytes_per_token(end - start, dtype),
            memory_bytes=memory_bytes,
        )
        for i, ((start, end), p) in enumerate(zip(ranges, params, strict=True))
    ]


@dataclass(frozen=True, slots=True)
class StageBound:
    """One stage's B with the figures behind it."""

    memory: StageMemory
    max_model_len: int  # L
    max_decode_batch: int  # B of this stage
    kv_cache_memory: int | None = None  # set: the KV bytes are fixed, not M_G - M_S

    @property
    def kv_cache_bytes(self) -> int:
        m = self.memory
        return self.kv_cache_memory or m.memory_bytes - m.param_bytes

    def formula(self) -> str:
        m, per_seq = self.memory, self.max_model_len * self.memory.kv_bytes_per_token
        kv = (
            f"kv_cache_memory {self.kv_cache_memory}"
            if self.kv_cache_memory is not None
            else f"(M_G {m.memory_bytes} - M_S {m.param_bytes})"
        )
        return (
            f"B = floor({kv} / (L {self.max_model_len} x m_kv {m.kv_bytes_per_token})) "
            f"= floor({self.kv_cache_bytes} / {per_seq}) = {self.max_decode_batch}"
        )


def stage_bounds(
    stages: list[StageMemory], max_model_len: int, kv_cache_memory: int | None = None
) -> list[StageBound]:
    """B of every stage (``kv_cache_memory`` as in ``CacheConfig``: fixed KV bytes)."""
    out = []
    for s in stages:
        try:
            if kv_cache_memory is not None:
                b = kv_cache_batch(kv_cache_memory, max_model_len, s.kv_bytes_per_token)
            else:
                b = max_decode_batch(
                    s.memory_bytes, s.param_bytes, max_model_len, s.kv_bytes_per_token
                )
        except ValueError as e:
            raise ValueError(f"stage {s.stage_idx}: {e}") from None
        out.append(StageBound(s, max_model_len, b, kv_cache_memory))
    return out


@dataclass(frozen=True, slots=True)
class BatchBound:
    """The binding stage's B, and the effective bound: the scheduler never runs more than
    ``max_num_seqs``. (When ``max_model_len`` is not a multiple of the block size, each
    sequence takes ``ceil(L / block_size)`` whole blocks and the engine's cache holds fewer
    full-length sequences than B; the CLI reports it. ``chunk_size: auto`` plans with this
    same bound: ``scheduler.chunk_tuner.engine_decode_batch``.)"""

    binding: StageBound  # the stage with the smallest B
    max_num_seqs: int

    @property
    def memory_bound(self) -> int:
        return self.binding.max_decode_batch

    @property
    def effective(self) -> int:
        return min(self.memory_bound, self.max_num_seqs)

    @property
    def binds(self) -> str:
        """``"memory"`` or ``"max_num_seqs"`` (memory on a tie)."""
        return "memory" if self.memory_bound <= self.max_num_seqs else "max_num_seqs"


def batch_bound(bounds: list[StageBound], max_num_seqs: int) -> BatchBound:
    if not bounds:
        raise ValueError("no stages to plan")
    # on a tie in B, the stage with the least KV memory (the first of those)
    binding = min(bounds, key=lambda b: (b.max_decode_batch, b.kv_cache_bytes))
    return BatchBound(binding, max_num_seqs)


# --- 2. + 3. the chunk ----------------------------------------------------------------------
def decodes_per_microbatch(max_decode_batch: int, num_microbatches_in_flight: int) -> int:
    """Decodes one micro-batch carries: ``ceil((B - 1) / n)``.

    ``B - 1``: one of the B running sequences is the one being prefilled. Rounded up, as the
    scheduler's ``_decode_share`` (ceil of running / in flight): the budget then has room
    for the largest share a micro-batch takes, and no decode eats into the prefill rows.
    """
    if max_decode_batch < 1:
        raise ValueError(f"max_decode_batch must be >= 1, got {max_decode_batch}")
    if num_microbatches_in_flight < 1:
        raise ValueError(
            f"num_microbatches_in_flight must be >= 1, got {num_microbatches_in_flight}"
        )
    return -(-(max_decode_batch - 1) // num_microbatches_in_flight)  # ceil division


def round_to_tile(num_tokens: int, tile_size: int) -> int:
    """``num_tokens`` rounded down to a multiple of ``tile_size``, never below one tile."""
    if tile_size < 1:
        raise ValueError(f"tile_size must be >= 1, got {tile_size}")
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    return max(tile_size, num_tokens // tile_size * tile_size)


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """The planned chunk: C before and after the clamp, the decodes, the token budget."""

    pd_ratio: float
    raw_prefill_chunk: int  # P/D x num_decodes, before the clamp
    prefill_chunk: int  # C, clamped to [min_chunk_size, max_chunk_size]
    num_decodes: int  # decodes per micro-batch
    chunk_size: int  # the token budget (prefill + decode rows), a multiple of tile_size
    tile_size: int
    min_chunk_size: int
    max_chunk_size: int
    clamped: str | None = None  # "min" or "max" when the clamp moved C
    rounded_up: bool = False  # the budget went up a tile to keep a prefill row

    @property
    def prefill_rows(self) -> int:
        """Prefill rows a hybrid micro-batch really gets: the budget less the decodes
        (differs from C by the tile rounding)."""
        return self.chunk_size - self.num_decodes

    def reason(self) -> str:
        d, c_raw, c = self.num_decodes, self.raw_prefill_chunk, self.prefill_chunk
        lines = [f"C = P:D {self.pd_ratio:.3f} x {d} decodes per micro-batch = {c_raw}"]
        if self.clamped == "min":
            lines.append(f"clamped up to min_chunk_size {self.min_chunk_size}: C = {c}")
        elif self.clamped == "max":
            lines.append(f"clamped down to max_chunk_size {self.max_chunk_size}: C = {c}")
        else:
            lines.append(f"within [{self.min_chunk_size}, {self.max_chunk_size}]: C = {c}")
        how = "up (to keep a prefill row)" if self.rounded_up else "down"
        lines.append(
            f"budget C + decodes = {c} + {d} = {c + d}, rounded {how} to a multiple of the "
            f"tile {self.tile_size}: chunk_size = {self.chunk_size} "
            f"({self.prefill_rows} prefill rows + {d} decodes)"
        )
        return "; ".join(lines)


def planned_chunk_size(
    pd_ratio: float,
    max_decode_batch: int,
    num_microbatches_in_flight: int,
    min_chunk_size: int,
    max_chunk_size: int,
    tile_size: int,
) -> ChunkPlan:
    """C = P/D x decodes per micro-batch (nearest integer), clamped; budget C + decodes,
    rounded down to the tile (up to the next tile if rounding down left no prefill row)."""
    check_pd_ratio(pd_ratio)
    if not 1 <= min_chunk_size <= max_chunk_size:
        raise ValueError(
            f"need 1 <= min_chunk_size <= max_chunk_size, got {min_chunk_size} and {max_chunk_size}"
        )
    d = decodes_per_microbatch(max_decode_batch, num_microbatches_in_flight)
    raw = math.floor(pd_ratio * d + 0.5)  # nearest, halves up
    c = min(max(raw, min_chunk_size), max_chunk_size)
    clamped = "min" if raw < min_chunk_size else "max" if raw > max_chunk_size else None
    budget = round_to_tile(c + d, tile_size)
    rounded_up = budget <= d
    if rounded_up:
        budget = (d // tile_size + 1) * tile_size  # the first multiple above d
    return ChunkPlan(
        pd_ratio, raw, c, d, budget, tile_size, min_chunk_size, max_chunk_size, clamped, rounded_up
    )


# --- the workload ---------------------------------------------------------------------------
def check_pd_ratio(pd_ratio: float) -> None:
    if isinstance(pd_ratio, bool) or not isinstance(pd_ratio, (int, float)):
        raise ValueError(f"the P:D ratio must be a number, got {pd_ratio!r}")
    if not (pd_ratio > 0 and math.isfinite(pd_ratio)):
        raise ValueError(f"the P:D ratio must be a finite number > 0, got {pd_ratio}")


def pd_ratio_of(prompt_tokens: float, output_tokens: float) -> float:
    """P/D; ``ValueError`` for zero output tokens (no decode to piggyback) or prompt."""
    if output_tokens <= 0:
        raise ValueError(
            f"the workload has {output_tokens} output tokens per request: a P:D ratio needs "
            "at least one output token"
        )
    if prompt_tokens <= 0:
        raise ValueError(f"the workload has {prompt_tokens} prompt tokens per request")
    return prompt_tokens / output_tokens


@dataclass(frozen=True, slots=True)
class DecodeCoverage:
    """How many of a workload's decode steps ride along prefill chunks.

    ``num_decode_steps`` = sum over requests of (output_tokens - 1): the first output token
    comes from the last prefill chunk. ``num_prefill_chunks`` = sum of ceil(P_i / rows), with
    ``rows`` the prefill rows of a hybrid micro-batch. Each chunk carries up to
    ``num_decodes`` decodes: the planned share, but no more than the other requests can
    supply (with ``num_concurrent`` requests at once, the other ones spread over the n
    micro-batches in flight: ceil((num_concurrent - 1) / n); ``None``: a steady stream with
    enough of them).
    So ``carried`` = chunks x decodes (at most all steps) and the rest, ``missed``, run in
    decode-only micro-batches. An estimate: it assumes the decodes are there whenever a
    chunk runs (all-at-once workloads come close; sparse arrivals carry fewer).
    """

    num_requests: int
    num_decode_steps: int
    num_prefill_chunks: int
    num_decodes: int
    carried: int
    missed: int

    @property
    def missed_fraction(self) -> float:
        return self.missed / self.num_decode_steps if self.num_decode_steps else 0.0


def decode_coverage(
    requests: Iterable[tuple[int, int]],
    prefill_rows: int,
    num_decodes: int,
    num_microbatches_in_flight: int = 1,
    num_concurrent: int | None = None,
) -> DecodeCoverage:
    """``requests``: (prompt_tokens, output_tokens) pairs; see ``DecodeCoverage``."""
    if prefill_rows < 1:
        raise ValueError(f"prefill_rows must be >= 1, got {prefill_rows}")
    reqs = list(requests)
    for i, (p, d) in enumerate(reqs):
        if p < 1 or d < 1:
            raise ValueError(f"request {i} has {p} prompt and {d} output tokens; both must be >= 1")
    steps = sum(d - 1 for _, d in reqs)  # the first token comes from the last prefill chunk
    chunks = sum(-(-p // prefill_rows) for p, _ in reqs)  # ceil(P_i / rows)
    # Beside one request's chunk only the others decode, spread over the micro-batches.
    per_chunk = num_decodes
    if num_concurrent is not None:
        per_chunk = min(per_chunk, -(-(num_concurrent - 1) // num_microbatches_in_flight))
    carried = min(steps, chunks * per_chunk)
    return DecodeCoverage(len(reqs), steps, chunks, per_chunk, carried, steps - carried)
