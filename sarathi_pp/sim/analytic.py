"""The analytic cost model: a roofline per operator of a decoder layer.

For one micro-batch (``N`` rows: the prefill chunks' tokens, then one row per decode) on
one GPU of a tensor-parallel group of ``tp`` GPUs, every operator of a Llama-shaped layer
has FLOPs ``F`` and bytes ``B`` (weights + activations read and written, in the model's
dtype), and takes ``max(F / flops_per_s, B / bytes_per_s)`` (``Hardware``'s achievable
ceilings). The operators (``layer_ops``):

- ``qkv``, ``o``, ``gate_up``, ``down``: GEMMs ``[N, k] x [k, n]``, ``F = 2 x N_pad x k x n``
  with ``N_pad`` = ``N`` rounded up to the matmul tile (``Hardware.matmul_tile``): a tile
  is computed whole (below one tile, to 16 rows: ``pad_rows``). Megatron's split: qkv and gate_up by columns, o and down by rows, so
  each GPU holds ``1/tp`` of every weight (KV heads replicated when fewer than ``tp``).
- ``attn_prefill``: each prefill chunk of ``c`` tokens after ``k`` cached ones: ``QK^T`` and
  ``PV`` over ``k`` + the causal half of the chunk, ``F = 4 x d x H x c x (k + (c + 1) / 2)``;
  reads Q, the cached and new K/V, writes the new K/V and the output.
- ``attn_decode``: each decode at context ``k`` attends to ``k + 1`` tokens,
  ``F = 4 x d x H x (k + 1)``, and reads its whole K/V (paged decode: memory-bound).
- ``norms`` (two RMSNorms), ``act`` (SiLU x up), ``residual`` (two adds): bytes only.
- ``all_reduce`` (``tp > 1``): two per layer (after ``o`` and ``down``) of ``N x hidden``
  values over the intra-node link, ring: ``2 (tp - 1) / tp x bytes / bandwidth + latency``.

Stage extras: the first stage's embedding gather, the last stage's final norm and
``lm_head`` on the sampled rows only (as the runtime does; vocab split over ``tp``).
Pipeline sends carry ``N x hidden`` values to the next stage; with ``tp`` GPUs each sends
its ``1/tp`` share over its own link (Megatron's scatter/gather), ``bytes / tp /
bandwidth + latency``.

Left out (the simulator's design page lists it): kernel launch and framework overheads, rotary
embeddings, sampling, attention's softmax FLOPs, overlap of compute and communication,
and any efficiency that depends on the shape beyond the tile padding.
"""

from __future__ import annotations

from dataclasses import dataclass

from sarathi_pp.microbatch import MicroBatch
from sarathi_pp.planner.memory import LayerShape
from sarathi_pp.sim.hardware import Hardware


@dataclass(frozen=True, slots=True)
class Op:
    """One operator's work on one GPU: FLOPs and bytes moved (or, for a transfer,
    ``seconds`` fixed by the link)."""

    name: str
    flops: float = 0.0
    bytes: float = 0.0
    seconds: float | None = None  # communication: time given by the link


@dataclass(frozen=True, slots=True)
class Rows:
    """What the cost of a micro-batch depends on: its chunks' shapes.

    ``prefills``: ``(context_len, num_tokens)`` per prefill chunk; ``decodes``: the context
    length of each decode; ``num_sampled``: rows the last stage samples."""

    prefills: tuple[tuple[int, int], ...]
    decodes: tuple[int, ...]
    num_sampled: int

    @property
    def num_rows(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decodes)

    @classmethod
    def of(cls, mb: MicroBatch) -> Rows:
        prefills = tuple((c.start, c.num_tokens) for c in mb.chunks if c.is_prefill)
        decodes = tuple(c.start for c in mb.chunks if not c.is_prefill)
        return cls(prefills, decodes, sum(1 for c in mb.chunks if c.do_sample))


MIN_TILE = 16  # rows of the smallest tensor-core MMA: GEMMs of a few rows pad to it


def pad_rows(n: int, tile: int) -> int:
    """``n`` rounded up to a multiple of ``tile`` (0 stays 0); below one tile, to a multiple
    of ``MIN_TILE`` instead (libraries pick small-M kernels there: a decode-only batch of
    8 rows does not cost a 128-row GEMM)."""
    step = tile if n >= tile else min(tile, MIN_TILE)
    return -(-n // step) * step


def _gemm(name: str, rows: int, padded: int, k: int, n: int, b: int) -> Op:
    """``[rows, k] x [k, n]``: FLOPs on the padded rows; bytes of the weight, input, output."""
    return Op(name, 2.0 * padded * k * n, float(b * (k * n + rows * k + rows * n)))


def layer_ops(shape: LayerShape, rows: Rows, tile: int, tp: int, hw: Hardware) -> list[Op]:
    """The operators of one decoder layer on one GPU (see the module docstring)."""
    s, b = shape, shape.dtype_bytes
    n = rows.num_rows
    npad = pad_rows(n, tile)
    h = s.hidden
    ops = [
        _gemm("qkv", n, npad, h, s.q_dim + 2 * s.kv_dim, b),
        _gemm("o", n, npad, s.q_dim, h, b),
        _gemm("gate_up", n, npad, h, 2 * s.inter, b),
        _gemm("down", n, npad, s.inter, h, b),
        attn_prefill(s, rows),
        attn_decode(s, rows),
        Op("norms", 2 * 5.0 * n * h, float(2 * 2 * n * h * b)),  # 2 norms: read + write
        Op("act", 3.0 * n * s.inter, float(3 * n * s.inter * b)),  # read gate, up; write
        Op("residual", 2.0 * n * h, float(2 * 3 * n * h * b)),  # 2 adds: 2 reads + 1 write
    ]
    if tp > 1:
        t = all_reduce_seconds(n * h * b, tp, hw)
        ops += [Op("all_reduce", seconds=t), Op("all_reduce", seconds=t)]
    return ops


def attn_prefill(s: LayerShape, rows: Rows) -> Op:
    flops = 0.0
    nbytes = 0
    for k, c in rows.prefills:
        flops += 4.0 * s.head_dim * s.num_heads * c * (k + (c + 1) / 2)  # QK^T + PV, causal
        # Q in, O out; K/V of the k cached + c new tokens read; the c new ones written
        nbytes += 2 * c * s.q_dim + (k + c) * 2 * s.kv_dim + c * 2 * s.kv_dim
    return Op("attn_prefill", flops, float(nbytes * s.dtype_bytes))


def attn_decode(s: LayerShape, rows: Rows) -> Op:
    ctx = sum(rows.decodes) + len(rows.decodes)  # each decode attends to k + 1 tokens
    flops = 4.0 * s.head_dim * s.num_heads * ctx
    nbytes = ctx * 2 * s.kv_dim + len(rows.decodes) * (2 * s.q_dim + 2 * s.kv_dim)
    return Op("attn_decode", flops, float(nbytes * s.dtype_bytes))


def head_ops(shape: LayerShape, rows: Rows, tile: int, tp: int, hw: Hardware) -> list[Op]:
    """The last stage's final norm and vocab-parallel lm_head on the sampled rows."""
    m = rows.num_sampled
    if m == 0:
        return []
    b, h = shape.dtype_bytes, shape.hidden
    ops = [
        Op("final_norm", 5.0 * m * h, float(2 * m * h * b)),
        _gemm("lm_head", m, pad_rows(m, tile), h, shape.vocab, b),
    ]
    if tp > 1:  # the logits' max/argmax across the vocab shards: a small all-gather
        ops.append(Op("vocab_gather", seconds=hw.nvlink_latency_us * 1e-6))
    return ops


def embed_ops(shape: LayerShape, rows: Rows) -> list[Op]:
    """The first stage's embedding gather: read and write ``N x hidden``."""
    n = rows.num_rows
    return [Op("embedding", 0.0, float(2 * n * shape.hidden * shape.dtype_bytes))]


def op_seconds(op: Op, hw: Hardware) -> float:
    """The roofline: compute-bound or memory-bound, whichever is slower."""
    if op.seconds is not None:
        return op.seconds
    return max(op.flops / hw.flops_per_s, op.bytes / hw.bytes_per_s)


def all_reduce_seconds(nbytes: float, tp: int, hw: Hardware) -> float:
    """A ring all-reduce of ``nbytes`` over ``tp`` GPUs on the intra-node link."""
    return 2 * (tp - 1) / tp * nbytes / hw.nvlink_bytes_per_s + hw.nvlink_latency_us * 1e-6
