"""How many KV blocks and how many sequences the stages hold (pure arithmetic, no torch).

Per stage: ``M_G`` = memory the stage may use (the placement's ``memory_bytes``: CPU
``cpu_memory_budget``; CUDA device memory x ``gpu_memory_utilization``), ``M_S`` = its
parameter bytes, ``m_kv`` = bytes of one token's K and V in its layers, and on CUDA ``M_A``
= its peak activation memory (``activation_bytes``, set by ``with_activations``: what vLLM
measures with a profiling forward pass). Its KV cache gets ``M_G - M_S - M_A`` bytes, or
``kv_cache_memory`` when given (``kv_cache_bytes``: the one place that decides, with the
one error when the parameters and activations leave nothing).

From those bytes:
- **blocks** (``num_kv_blocks``): ``kv_bytes // (block_size x m_kv)`` per stage; all stages
  share one block table, so the engine uses the smallest count, capped at what
  ``max_num_seqs`` sequences of ``max_model_len`` tokens can ever use.
- **sequences** (``max_decode_batch``, the paper's ``B = (M_G - M_S) / (L x m_kv)``): how many
  sequences of ``L = max_model_len`` tokens fit. The stage with the smallest B binds
  (``batch_bound``); ``engine_decode_batch`` is the figure ``chunk_size: auto`` plans with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sarathi_pp.config import CacheConfig, EngineConfig, SchedulerConfig
from sarathi_pp.model_spec import DTYPE_BYTES, ModelSpec
from sarathi_pp.placement import Placement
from sarathi_pp.placement.partition import partition_layers, stage_params
from sarathi_pp.scheduler.block_manager import blocks_for
from sarathi_pp.stage_memory import PROMPT_LOGITS_ROWS, StageMemory

# float32 copies of a row's logits alive at once on the last stage: the logits, the
# processed copy sampled from (temperature, penalties, bias) and its probabilities or
# log-probabilities.
LOGIT_COPIES = 3


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of ``dtype``; ``ValueError`` naming the known ones."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


# --- the KV cache's bytes -------------------------------------------------------------------
def free_bytes(memory_bytes: int, param_bytes: int, activation_bytes: int = 0) -> int:
    """``M_G - M_S - M_A``; ``ValueError`` with the figures when they leave nothing."""
    free = memory_bytes - param_bytes - activation_bytes
    if free <= 0:
        need = f"the parameters need M_S = {param_bytes} bytes ({param_bytes / 2**30:.2f} GiB)"
        if activation_bytes:
            need += (
                f" and the activations M_A = {activation_bytes} bytes "
                f"({activation_bytes / 2**30:.2f} GiB; a smaller chunk_size, "
                "max_num_batched_tokens or max_num_seqs lowers it)"
            )
        raise ValueError(
            f"{need} but the stage may use only M_G = {memory_bytes} bytes "
            f"({memory_bytes / 2**30:.2f} GiB); "
            "raise cpu_memory_budget / gpu_memory_utilization or use more pipeline stages"
        )
    return free


def kv_cache_bytes(stage: StageMemory, kv_cache_memory: int | None = None) -> int:
    """The stage's KV cache bytes: ``kv_cache_memory`` if given, else ``M_G - M_S``;
    errors name the stage."""
    if kv_cache_memory is not None:
        return kv_cache_memory
    try:
        return free_bytes(stage.memory_bytes, stage.param_bytes, stage.activation_bytes)
    except ValueError as e:
        raise ValueError(f"stage {stage.stage_idx}: {e}") from None


# --- how many sequences fit: B ----------------------------------------------------------------
def max_decode_batch(
    memory_bytes: int,
    param_bytes: int,
    max_model_len: int,
    kv_bytes_per_token: int,
    activation_bytes: int = 0,
) -> int:
    """``B = floor((M_G - M_S) / (L x m_kv))``: sequences of ``max_model_len`` tokens whose
    K and V fit next to the parameters (and, on CUDA, the activations ``M_A``: ``M_G - M_S -
    M_A``). ``ValueError`` with the numbers when not one fits."""
    if max_model_len < 1 or kv_bytes_per_token < 1:
        raise ValueError(
            f"max_model_len ({max_model_len}) and kv_bytes_per_token ({kv_bytes_per_token}) "
            "must be >= 1"
        )
    free = free_bytes(memory_bytes, param_bytes, activation_bytes)
    per_seq = max_model_len * kv_bytes_per_token  # L x m_kv
    batch = free // per_seq
    if batch < 1:
        m_a, a = (" - M_A", f" - {activation_bytes}") if activation_bytes else ("", "")
        raise ValueError(
            f"not one sequence fits: B = (M_G - M_S{m_a}) / (L x m_kv) = ({memory_bytes} - "
            f"{param_bytes}{a}) / ({max_model_len} x {kv_bytes_per_token}) = "
            f"{free / per_seq:.3f}; lower max_model_len or raise the memory budget"
        )
    return batch


def kv_cache_batch(kv_cache_memory: int, max_model_len: int, kv_bytes_per_token: int) -> int:
    """B when ``cache.kv_cache_memory`` fixes the KV bytes per stage (the engine then
    ignores M_G - M_S): ``floor(kv_cache_memory / (L x m_kv))``."""
    return max_decode_batch(kv_cache_memory, 0, max_model_len, kv_bytes_per_token)


def kv_decode_batch(num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int) -> int:
    """B from a number of KV blocks: sequences of ``max_model_len`` tokens they hold at
    once (at least 1), at most ``max_num_seqs``."""
    return max(1, min(num_blocks * block_size // max_model_len, max_num_seqs))


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
        return kv_cache_bytes(self.memory, self.kv_cache_memory)

    def formula(self) -> str:
        m, per_seq = self.memory, self.max_model_len * self.memory.kv_bytes_per_token
        kv = (
            f"kv_cache_memory {self.kv_cache_memory}"
            if self.kv_cache_memory is not None
            else f"(M_G {m.memory_bytes} - M_S {m.param_bytes}"
            + (f" - M_A {m.activation_bytes})" if m.activation_bytes else ")")
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
                    s.memory_bytes, s.param_bytes, max_model_len, s.kv_bytes_per_token,
                    s.activation_bytes,
                )  # fmt: skip
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
    same bound: ``engine_decode_batch``.)"""

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


def engine_decode_batch(
    cache: CacheConfig,
    stages: list[StageMemory],
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
) -> int:
    """B for the engine's ``chunk_size: auto``.

    The KV cache sized from memory (or ``kv_cache_memory``): the binding stage's
    ``floor((M_G - M_S) / (L x m_kv))`` capped at ``max_num_seqs``, the figure
    ``sarathi-pp plan`` prints (the blocks may hold a sequence less: rounding to whole
    blocks). ``num_kv_blocks`` given: the stages' memory says nothing of the cache, so B is
    what those blocks hold (``kv_decode_batch``).
    """
    if cache.num_kv_blocks is not None:
        return kv_decode_batch(num_blocks, block_size, max_model_len, max_num_seqs)
    bounds = stage_bounds(stages, max_model_len, cache.kv_cache_memory)
    return batch_bound(bounds, max_num_seqs).effective


# --- blocks -----------------------------------------------------------------------------------
def stage_blocks(cache: CacheConfig, stage: StageMemory, block_size: int) -> int:
    """KV blocks of ``block_size`` tokens that one stage's cache holds."""
    return kv_cache_bytes(stage, cache.kv_cache_memory) // (block_size * stage.kv_bytes_per_token)


def num_kv_blocks(
    cache: CacheConfig,
    stages: list[StageMemory],
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
) -> int:
    """The shared block count; ``ValueError`` if one ``max_model_len`` sequence won't fit."""
    needed = blocks_for(max_model_len, block_size)
    if cache.num_kv_blocks is not None:
        blocks, how = cache.num_kv_blocks, f"num_kv_blocks={cache.num_kv_blocks}"
    else:
        per_stage = [stage_blocks(cache, s, block_size) for s in stages]
        blocks = min(per_stage)
        binding = stages[per_stage.index(blocks)]
        how = (
            f"stage {binding.stage_idx}: {kv_cache_bytes(binding, cache.kv_cache_memory)} "
            f"bytes // ({block_size} tokens x {binding.kv_bytes_per_token} bytes/token) "
            f"= {blocks} blocks"
        )
        blocks = min(blocks, max_num_seqs * needed)
    if blocks < needed:
        raise ValueError(
            f"the KV cache cannot hold one sequence of max_model_len={max_model_len} tokens: "
            f"it needs {needed} blocks of {block_size} tokens, {how}"
        )
    return blocks


# --- the activations' bytes: M_A ---------------------------------------------------------------
@dataclass(frozen=True)
class LayerShape:
    """One GPU's share of a layer under tensor parallelism ``tp``."""

    hidden: int
    q_dim: int  # this GPU's query heads x head_dim
    kv_dim: int  # this GPU's KV heads x head_dim (replicated when fewer heads than GPUs)
    inter: int  # this GPU's MLP intermediate columns
    num_heads: int  # this GPU's query heads
    head_dim: int
    vocab: int  # this GPU's lm_head columns
    dtype_bytes: int

    @classmethod
    def of(cls, spec: ModelSpec, tp: int, dtype: str) -> LayerShape:
        if tp < 1 or spec.num_heads % tp:
            raise ValueError(
                f"tensor parallelism tp={tp} must divide the model's {spec.num_heads} "
                "attention heads"
            )
        kv_heads = max(1, spec.num_kv_heads // tp)
        d = spec.head_dim
        return cls(
            hidden=spec.hidden_size, q_dim=spec.num_heads // tp * d, kv_dim=kv_heads * d,
            inter=-(-spec.intermediate_size // tp), num_heads=spec.num_heads // tp,
            head_dim=d, vocab=-(-spec.vocab_size // tp), dtype_bytes=DTYPE_BYTES[dtype],
        )  # fmt: skip


def activation_bytes(
    shape: LayerShape, rows: int, in_flight: int, last: bool, sampled: int = 0
) -> int:
    """A stage's peak activation memory on one GPU for micro-batches of ``rows`` rows, which
    its KV cache cannot use (vLLM measures the same figure with a profiling forward pass).

    Inference frees a layer's intermediates before the next layer, so the peak is one
    layer's working set, the larger of its two halves: attention (the residual stream, the
    normed input, Q/K/V, the attention output) and the MLP (residual, normed input,
    gate/up, the activated product). On top: the hidden states of the other micro-batches
    in flight waiting at the stage (``rows x hidden`` each) and, on the last stage,
    ``LOGIT_COPIES`` float32 copies of the logits (this GPU's vocab share) of the larger of
    the rows it samples (its lm_head runs on those only, at most one per sequence:
    ``sampled``) and the prompt rows it scores at once for ``prompt_logprobs``
    (``PROMPT_LOGITS_ROWS``); the two are not alive together."""
    s, h = shape, shape.hidden
    attention = 2 * h + (s.q_dim + 2 * s.kv_dim) + s.q_dim
    mlp = 2 * h + 3 * s.inter
    per_row = max(attention, mlp) + (in_flight - 1) * h
    total = rows * per_row * s.dtype_bytes
    if last:
        logit_rows = max(min(rows, sampled), min(rows, PROMPT_LOGITS_ROWS))
        total += logit_rows * s.vocab * 4 * LOGIT_COPIES
    return total


def max_rows(config: SchedulerConfig, max_model_len: int) -> int:
    """The most rows one micro-batch can have: a chunking policy's token budget (with
    ``chunk_size: auto``, the largest chunk plus every running decode), else the prefill cap
    (``max_num_batched_tokens``, default ``max_model_len``) plus every running decode (orca
    batches both)."""
    if config.chunks_prompts:
        if config.chunk_size == "auto":
            return config.max_chunk_size + config.max_num_seqs
        return int(config.chunk_size)
    return (config.max_num_batched_tokens or max_model_len) + config.max_num_seqs


def with_activations(
    stages: list[StageMemory],
    config: EngineConfig,
    spec: ModelSpec,
    placement: Placement,
    max_model_len: int,
    tp: int = 1,
    schedule_ahead: bool = False,
) -> list[StageMemory]:
    """``stages`` with ``M_A`` set: on CUDA, each stage's ``activation_bytes`` for the
    largest micro-batch the policy can issue (``max_rows``) with the others in flight
    waiting (``microbatches_in_flight``, one more when ``schedule_ahead``), on one GPU of
    ``tp``. Every executor's ``load_model`` returns these figures, so the real engine, the
    simulator and ``sarathi-pp plan`` plan the same KV cache. On CPU ``M_A`` stays 0: the
    activations come out of the host's memory beside ``cpu_memory_budget``, which sizes the
    parameters and the KV cache alone."""
    if not placement.device.startswith("cuda"):
        return stages
    shape = LayerShape.of(spec, tp, placement.dtype)
    rows = max_rows(config.scheduler, max_model_len)
    in_flight = config.parallel.in_flight_limit(schedule_ahead) + int(schedule_ahead)
    last = placement.num_stages - 1
    sampled = config.scheduler.max_num_seqs
    return [
        replace(s, activation_bytes=activation_bytes(
            shape, rows, in_flight, s.stage_idx == last, sampled))
        for s in stages
    ]  # fmt: skip
