"""``panel_gemm.c``: ``y = x W^T`` with ``W`` prepacked in panels of ``PANEL`` output columns
(``[N/16, K, 16]``), the kernel of ``model/linear.py``'s ``panel_gemm`` kind (which packs the
weight and calls it; its module docstring says when it applies and why).

Note [the AVX-512 panel kernel]: oneDNN reaches a much lower rate at the few rows of a decode
step than at prefill sizes, and on an AVX-512 CPU the AVX2 kernel (6 rows) was slower than
oneDNN there. Sixteen rows at a time in zmm registers, x read in place, ran slow for every
weight with K = 1024, because x's rows are then 4 KB apart and sixteen of them fall in the same
L1 set (8 ways); the down weight (K = 2816) did not suffer it. So x is first copied into blocks
of 16 rows, ``[K][16]`` (one line per k; the copy is M x K floats against M x K x N
multiply-adds): with each weight streamed from memory as in a step, the kernel is then faster
than oneDNN at a few to a few tens of rows, the most at the fewest, and on par from about 64
rows. 24 or 28 rows at a time were no better at 16-64 rows and worse from 256 (spills). In the
engine, decode-only steps got faster, the more so the fewer the decodes, and prefill and hybrid
steps were unchanged within the noise.

Many rows: with every panel reading all of x, x is streamed from L3 or memory once per panel
once it outgrows L2, and the down weight (K = 2816) fell well behind oneDNN at 1024-2048 rows
(the AVX2 kernel has the same loop). Above 2^20 floats of x the rows go in chunks of 128 and
K in slices of 512 (the chunk's slice of x, 256 KB, stays in L2 while every panel's slice
passes over it; the panels of a slice split over the threads, a barrier per slice), which
brings it about level with oneDNN up to 1024 rows and a little behind at 2048; chunks of 256
rows, slices of 256, the slices outermost, or x packed per chunk instead of once: no better.
A 1024-token prefill chunk in the engine is a few percent slower than with oneDNN; the
default 256-token chunks are on par. (The figures: the lab notebook's "Figures moved out of
the code", Note [the AVX-512 panel kernel].)

Note [the AVX-512 panel kernel's groups]: on an AVX-512 Intel Xeon (Ice Lake class), on one
thread, the 16-row kernel above ran at about half of oneDNN's rate from 16 to 1024 rows
whatever the weight, so hybrid steps were much slower with it, while decode-only steps were
faster. Per k it issues 1 load of W and 16 broadcasts of x for 16 FMAs; the row chunks and K
slices of the many-rows path (64 or 128 rows, 256 or 512 of K, for any x) did not lift it,
two panels x 8 rows somewhat. From 16 rows the kernel now takes groups of 4 panels (64
columns) 6 rows at a time (24 accumulators; per k 4 loads of W and 6 broadcasts for 24 FMAs;
the x of a 16-row block packed as before, read in pieces of 6, 6 and 4), the panels after the
last whole group one by one as before; fewer rows keep the 16-row kernel and its prefetches
(decode steps, tuned on the EPYC above). On that Xeon the groups come close to oneDNN at 256 and
1024 rows (at most level with it), from a little slower to faster at 16-64 rows; hybrid steps
are still slower than with oneDNN, decode-only steps unchanged (faster than oneDNN's). K slices
of 64-256 in the groups' path: no gain beyond the machine's noise. Not re-measured on the
AVX-512 EPYC of the notes above: there the 16-row kernel was on par with oneDNN from 128 rows,
and the groups issue fewer loads per FMA than it. (The figures: the lab notebook's "Figures
moved out of the code", Note [the AVX-512 panel kernel's groups].)

Note [the panel's K slices]: the kernel once cut K into slices of 256 for fewer than 128
rows, so that a panel's 16 KB slice stayed in L1 while each block of 16 rows passed over it.
With the weights coming from memory, as in a decode step, all of K at once is faster at every
row count below 128 (slices of 128 or 64 were slower than 256, 512 in between), and on par
or slightly faster in the AVX2 build. A block of 16 rows' packed x is 64 KB at K = 1024
(L2), the panel slice read from memory once; slicing only added the y round trips and broke
the stream of each panel in four. (The figures: the lab notebook's "Figures moved out of the
code", Note [the panel's K slices].)

Note [the panel's prefetch]: each k of the micro-kernel prefetches the panel's line 32 k ahead
(2 KB) into L1 and the line 256 k ahead (16 KB) into L2. With few rows a line is consumed
every few cycles, and 2 KB ahead is about one memory latency: the stream stalled. With the
L2 prefetch the few-row calls read the weights at about the machine's copy rate: the calls
of 4 to 32 rows got markedly faster, the gain shrinking with the rows to little at 128 and
none at 256 to 512 rows; the AVX2 build alike. 128 lines ahead or 512 did as well as 256,
the L2 prefetch without the L1 one slightly worse. Prefetching only in each panel's first
block of rows (the one that reads it from memory) was no better. (An earlier try of the same
L2 prefetch showed a gain once and none in two reruns, and was dropped; measured again over
an hour it showed in every series, ``piggyback.py``'s decode steps included, and made no step
slower.) The figures: the lab notebook's "Figures moved out of the code",
Note [the panel's prefetch].
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from typing import TYPE_CHECKING

from sarathi_pp.stages.kernels.cpu.build import KERNEL_DIR, KernelUnavailable, build, cpu_flags

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

log = logging.getLogger(__name__)

PANEL = 16  # output columns per panel of the packed weight
_SOURCE = KERNEL_DIR / "panel_gemm.c"


@cache
def load_gemm(extra_flags: tuple[str, ...] = ()) -> CFuncPtr | None:
    """The compiled ``panel_gemm_f32``, or None (the reason logged once): a CPU without
    AVX2 + FMA, no compiler, or torch not on libgomp (the kernel runs on torch's OpenMP
    threads). With AVX-512 (``-march=native``) it is built with the AVX-512 micro-kernel;
    ``extra_flags`` go to the compiler after the usual ones (the tests build the AVX2
    micro-kernel on AVX-512 CPUs with ``-mno-avx512f``)."""
    flags = cpu_flags()
    if not {"avx2", "fma"} <= flags:
        log.info("panel GEMM not used: CPU flags avx2/fma = %s", ["avx2" in flags, "fma" in flags])
        return None
    try:
        lib, _ = build("panel_gemm", _SOURCE, need_openmp=True, extra_flags=extra_flags)
    except KernelUnavailable as e:
        log.warning("panel GEMM kernel unavailable, using oneDNN: %s", e)
        return None
    fn = lib.panel_gemm_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn
