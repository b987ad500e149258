"""The chunk size: from the decode batch bound B (``planner/memory.py``, step 1) and the
workload's P:D ratio to a tile-aligned token budget. Pure Python (no torch); ``sarathi-pp
plan`` prints each step with its numbers.

2. **Chunk from the P:D ratio.** A hybrid micro-batch holds one prefill chunk of C tokens
   and the decodes it piggybacks; the best P:D ratio is ``C / decodes``, so a workload of
   mean P prompt and D output tokens wants ``C = P/D x decodes``. With ``n`` micro-batches
   in flight the ``B - 1`` decoding sequences are spread over them: ``ceil((B - 1) / n)``
   each (see ``decodes_per_microbatch``). C is clamped to ``[min_chunk_size,
   max_chunk_size]``; the token budget ``chunk_size`` is C plus those decodes.
3. **Tile quantization.** The budget is rounded down to a multiple of the matmul tile
   (a few rows past a tile boundary cost a whole extra tile), never below one tile; where
   that would leave the prefill fewer than ``min_chunk_size`` rows, up to the first
   multiple that keeps them (the rows up to it cost no extra tile).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


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
    rounded_up: bool = False  # the budget went up to keep min_chunk_size prefill rows

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
        how = (
            f"up (to keep min_chunk_size {self.min_chunk_size} prefill rows)"
            if self.rounded_up
            else "down"
        )
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
    rounded down to the tile (up, to the first multiple of the tile with room for
    ``min_chunk_size`` prefill rows, where rounding down left fewer)."""
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
    rounded_up = budget - d < min_chunk_size
    if rounded_up:
        budget = -(-(d + min_chunk_size) // tile_size) * tile_size  # the first with room
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
