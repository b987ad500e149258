"""Small C kernels for attention on CPU that read K/V from the paged cache in place: decode
rows (below) and, on AVX-512 or AVX2 CPUs, prefill chunks (Note [paged prefill on CPU]).

Why (see Note [paged decode on CPU]): the portable path copies every decode's whole context
out of the paged cache into a contiguous buffer and then runs SDPA over it, so a decode step
reads the context twice and writes it once. This kernel walks each sequence's block table
and reads every K and V row once, where it lies, in one pass: for each sequence (one per
thread at a time, taken from a shared counter, so mixed context lengths balance) and each
block, the scores of every head over the block's keys, an online softmax (a running maximum
and sum per head, the partial output rescaled when the maximum grows, as flash-decoding
does), and the block's V weighted into the output; the next block is prefetched meanwhile.
With fewer sequences than threads, each sequence's blocks are cut into ranges, one per work
item, whose partial outputs are merged by their maxima and sums (flash-decoding's split), so
a lone long decode keeps every thread busy.

Built and loaded by ``build.build`` (the system ``cc`` on first use, cached; on
torch's OpenMP threads where torch runs on libgomp, see Note [the kernels' threads] there,
else threads of its own). float32 only; with AVX-512 (``-march=native``) and a head_dim that
is a multiple of 64, 16 keys at a time per head in one register (``block16``); with AVX2 +
FMA the scores of 8 keys are computed at once; elsewhere the compiler vectorises plain
loops. Where nothing builds, or ``SARATHI_PP_CPU_KERNEL=0``, ``load_kernel`` returns None
and attention keeps the portable gather + SDPA path.

Note [paged decode on CPU]: the kernel took its shape step by step, each step measured on 32
decodes x 1k context, one layer of the embedded model (16 heads, 4 KV heads, head_dim 64), 2
threads: gather + SDPA; gathering in groups of 4 sequences (kept in cache) + SDPA, less than
half of that; the first kernel (two passes: every score, an exact softmax, then V head by head;
one horizontal sum per (key, head)), less than half again; scores 8 keys at once, V block by
block for all heads and the next block's prefetch spread over the heads, a little each at most;
one pass with the online softmax, a large step again. A loop that only reads the same blocks (no
arithmetic) is not much faster: the kernel comes close to reading the cache once. Prefetching 2
or 4 blocks ahead instead of 1 did not help. On an AVX-512 EPYC (8 layers' blocks per call,
interleaved in one process), the next block prefetched into L2 instead of L1 was a good deal
faster at every shape; into L1 the prefetch evicted the block being worked on (its K and V fill
L1 by themselves), non-temporal did nothing, 2 blocks ahead no better than 1. Then each block's
V weighed for up to 4 query heads of one KV head at once (each V row loaded once for them, not
once per head; `weigh_v`): faster at 16 x 600 and 4 x 600, on par at 32 x 1k.

With AVX-512 (head_dim a multiple of 64; ``block16``) a block is taken 16 keys at a time per KV
head: each query head's 16 scores in one register (``dot16``: the keys' partial sums reduced
across lanes together, then a permute), the online softmax on that register (one max, one exp,
one sum per head and 16 keys where the loop above did them key by key), then V for up to 4 heads
at once in 16 zmm accumulators. K is read for all heads before V, as above: weighing V per KV
head right after its scores (K and V stripes alternating) was slower from memory than the kernel
above. With 8 layers' caches cycled from memory (the caches larger than L3) it is a little
faster than the 8-keys kernel, both near a loop that only reads the same blocks; with the blocks
in cache it is much faster. Where memory is the limit (a 2-core VM) it changes little; with more
bandwidth per core it is the arithmetic that counts. (The figures: the lab notebook's "Figures
moved out of the code", Note [paged decode on CPU].)

Note [paged prefill on CPU]: a prefill chunk's attention (``paged_prefill_f32``; AVX-512 or
AVX2 + FMA builds) was gather + SDPA: the chunk's context copied out of the cache, then SDPA's
fused CPU kernel with a boolean causal mask, well below the machine's matmul rate (counting
the causal half: 4 x n x (start + n / 2) x heads x head_dim). It is a GEMM-shaped problem
(scores Q K^T, then P V, head_dim 64 deep), so the kernel is the panel GEMM's micro-kernel
turned to it: a tile is 16 query rows of one KV head (row i = token i / G, query head i % G
of the G sharing the KV head, so GQA reads each key once for all G), on the 16 lanes of a
register, Q packed transposed and pre-scaled (AVX2: 8 rows and 8 keys, as 16 ymm registers
allow). Per 16 keys (one block of 16, read in place; block sizes that are no multiple of 16
copy the 16 rows out first): 16 accumulators of scores (each key row broadcast from the
cache against Q's packed column), the causal mask as lane masks where a key passes a row's
position, an online softmax in registers (the maximum and sum per lane, exp on 16 lanes with
``exp_f``'s polynomial), and the output, transposed in L1, rescaled and updated by 16
broadcast V rows. Tiles go to threads longest first (the chunk's last rows see the most
keys). Against gather + SDPA it is about twice as fast at every start of a 256-row chunk, still
well ahead with block sizes that are no multiple of 16 (copied out), and the AVX2 build sits
between SDPA and the AVX-512 build; in ``benchmarks/vs_hf.py`` it halved the chunks' attention
time. Used as a decode (one row per KV head and 12 padding lanes) it is slower than the decode
kernel: decodes keep theirs. (The figures: the lab notebook's "Figures moved out of the code",
Note [paged prefill on CPU].)
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import TYPE_CHECKING

import torch

from sarathi_pp.stages.kernels.cpu.build import KERNEL_DIR, build, build_unless_off

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

_SOURCE = KERNEL_DIR / "paged_attention.c"

_threads = "not loaded"
_prefill: CFuncPtr | None = None


@cache
def load_kernel() -> CFuncPtr | None:
    """The compiled ``paged_decode_f32``, or None (no compiler, or disabled by
    ``SARATHI_PP_CPU_KERNEL=0``); the reason is logged once. Loads ``load_prefill``'s
    kernel with it (one library)."""
    global _threads, _prefill
    _prefill = None
    lib, _threads = build_unless_off(
        "paged_decode", _SOURCE, "SARATHI_PP_CPU_KERNEL", "CPU paged attention kernel",
        "using gather + SDPA",
    )  # fmt: skip
    if lib is None:
        return None
    _prefill = _prefill_of(lib)
    return _decode_of(lib)


def _decode_of(lib: ctypes.CDLL) -> CFuncPtr:
    """``lib``'s ``paged_decode_f32`` with its signature."""
    fn = lib.paged_decode_f32
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, i32, i32, i32, i32, i32, ctypes.c_float, i32]
    fn.restype = i32
    return fn


def _prefill_of(lib: ctypes.CDLL) -> CFuncPtr | None:
    """``lib``'s ``paged_prefill_f32`` with its signature, or None where it was built
    without AVX-512 or AVX2 + FMA."""
    if not lib.paged_prefill_supported():
        return None
    fn = lib.paged_prefill_f32
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i32, i32, i32, i32, i32, i32]
    fn.argtypes += [ctypes.c_float, i32]
    fn.restype = i32
    return fn


def load_prefill() -> CFuncPtr | None:
    """The compiled ``paged_prefill_f32``, or None: no kernel (``load_kernel``) or a CPU
    with neither AVX-512 nor AVX2 + FMA (chunks then keep gather + SDPA)."""
    load_kernel()
    return _prefill


def build_prefill(extra_flags: tuple[str, ...]) -> CFuncPtr | None:
    """The prefill kernel built with ``extra_flags`` after the usual ones (``-mno-avx512f``:
    its AVX2 path on an AVX-512 CPU, for tests and benchmarks); None where that build has
    no vector path. Raises ``build.KernelUnavailable`` when nothing builds."""
    lib, _ = build("paged_decode", _SOURCE, extra_flags=extra_flags)
    return _prefill_of(lib)


def build_decode(extra_flags: tuple[str, ...]) -> CFuncPtr:
    """The decode kernel built with ``extra_flags`` after the usual ones, as
    ``build_prefill`` (``-mno-avx512f`` on an AVX-512 CPU: its AVX2 path)."""
    lib, _ = build("paged_decode", _SOURCE, extra_flags=extra_flags)
    return _decode_of(lib)


def kernel_threads() -> str:
    """How the kernel runs its threads (``build.OPENMP`` or ``pthreads``), or why it is
    unavailable: for benchmarks' headers."""
    load_kernel()
    return _threads


def kernel_supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32


def _check_cache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[int, int, int, int]:
    """``q``'s rows, heads and head_dim, and the KV heads, after checking what both kernels
    assume: K and V caches contiguous, alike, of ``q``'s head_dim, heads a multiple of them."""
    rows, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == head_dim
    assert heads % kv_heads == 0
    return rows, heads, head_dim, kv_heads


def paged_decode(
    q: torch.Tensor,  # [num_seqs, heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    context_lens: torch.Tensor,  # [num_seqs] int64: keys each query attends to (its pos + 1)
    block_size: int,
    scale: float,
    kernel: CFuncPtr | None = None,
) -> torch.Tensor:  # [num_seqs, heads, head_dim]
    """Attention of one query row per sequence over its paged context, read in place.
    ``kernel``: a build of ``build_decode`` instead of ``load_kernel()``'s."""
    fn = kernel or load_kernel()
    assert fn is not None, "paged_decode needs the compiled kernel (load_kernel())"
    num_seqs, heads, head_dim, kv_heads = _check_cache(q, k_cache, v_cache)
    assert block_tables.dtype == context_lens.dtype == torch.int64
    q = q.contiguous()
    tables = block_tables.contiguous()
    lens = context_lens.contiguous()
    out = torch.empty_like(q)
    failed = fn(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        tables.stride(0), lens.data_ptr(), out.data_ptr(), num_seqs, heads, kv_heads,
        head_dim, block_size, scale, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("paged_decode: could not allocate the kernel's score buffers")
    return out


def paged_prefill(
    q: torch.Tensor,  # [n, heads, head_dim]: the chunk's queries, rows at any stride
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    context_blocks: torch.Tensor,  # [>= ceil((start + n) / block_size)] int64
    start: int,  # position of the chunk's first token (tokens cached before it)
    block_size: int,
    scale: float,
    kernel: CFuncPtr | None = None,
) -> torch.Tensor:  # [n, heads, head_dim]
    """Causal attention of one prefill chunk over its context (earlier chunks' K/V and its
    own, already written to the cache), read from the blocks where they lie. ``kernel``: a
    build of ``build_prefill`` instead of ``load_prefill()``'s."""
    fn = kernel or load_prefill()
    assert fn is not None, "paged_prefill needs the compiled kernel (load_prefill())"
    n, heads, head_dim, kv_heads = _check_cache(q, k_cache, v_cache)
    assert context_blocks.dtype == torch.int64
    assert context_blocks.numel() * block_size >= start + n
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    blocks = context_blocks.contiguous()
    out = torch.empty(n, heads, head_dim, dtype=q.dtype, device=q.device)
    failed = fn(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), blocks.data_ptr(),
        out.data_ptr(), out.stride(0), n, start, heads, kv_heads, head_dim, block_size, scale,
        torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("paged_prefill: could not allocate the kernel's tile buffers")
    return out
