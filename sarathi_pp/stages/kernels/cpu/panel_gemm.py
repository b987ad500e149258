"""``panel_gemm.c``: ``y = x W^T`` with ``W`` prepacked in panels of ``PANEL`` output columns
(``[N/16, K, 16]``), the kernel of ``model/linear.py``'s ``panel_gemm`` kind (which packs the
weight and calls it; its module docstring says when it applies and why).

Note [the AVX-512 panel kernel]: on a 2-core AVX-512 EPYC (2026-12-02, torch 2.13) oneDNN
reaches 210-220 GFLOP/s from 256 rows but 120-155 at 16 rows, the rows of a decode step. The
AVX2 kernel (6 rows) was 1.0-1.2x slower than oneDNN there from 4 to 256 rows. Sixteen rows
at a time in zmm registers, x read in place: ~95 GFLOP/s for every weight with K = 1024 at
16 rows and up, because x's rows are 4 KB apart and sixteen of them fall in the same L1 set
(8 ways), against 145-195 for the down weight (K = 2816). With x first copied into blocks of
16 rows, ``[K][16]`` (one line per k; the copy is M x K floats against M x K x N multiply-adds),
each weight streamed from memory as in a step (six copies, cycled), 2 threads, GFLOP/s
against oneDNN in the same run: at 2 rows 1.5-1.9x, 16 rows 1.14-1.25x (gate/up 194 vs 155),
32 rows 1.06-1.13x, 64 rows 0.96-1.03x, 128 to 1024 rows 0.95-1.06x. 24 or 28 rows at a time
were no better at 16-64 rows and worse from 256 (spills). In the engine
(``benchmarks/piggyback.py --decodes 8,16,32 --decode-context 1024``, the kinds alternated
twice): decode-only steps of 8 / 16 / 32 decodes 1.15-1.24x / 1.12x / 1.07-1.10x faster,
prefill and hybrid steps unchanged within the noise.

Many rows: with every panel reading all of x, x is streamed from L3 or memory once per panel
once it outgrows L2, and the down weight (K = 2816) ran at 0.5-0.66x oneDNN at 2048 rows,
0.79-0.96x at 1024 (the AVX2 kernel has the same loop). Above 2^20 floats of x the rows go
in chunks of 128 and K in slices of 512 (the chunk's slice of x, 256 KB, stays in L2 while
every panel's slice passes over it; the panels of a slice split over the threads, a barrier
per slice). Then, against oneDNN in the same run: 128-256 rows 1.01-1.07x, 512-1024 rows
0.98-1.00x (down 0.88x), 2048 rows 0.93x (down 0.89x); chunks of 256 rows, slices of 256,
the slices outermost, or x packed per chunk instead of once: no better. A 1024-token prefill
chunk in the engine (``piggyback.py --chunk-size 1024``, oneDNN / panel alternated): 1412 /
1542 ms vs 1456 / 1608 ms (3-4% slower); the default 256-token chunks are on par.

Note [the AVX-512 panel kernel's groups]: on a 2-core AVX-512 Intel Xeon @ 2.80 GHz (Ice Lake
class: avx512_vnni, vbmi2, bitalg; 2026-12-03, torch 2.13, 1 thread) the 16-row kernel above
ran at 50-68 GFLOP/s from 16 to 1024 rows whatever the weight, against oneDNN's 108-150: 0.45-
0.54x at 256 rows (``benchmarks/linear_rows.py``), so a 256-token hybrid step of the embedded
model took 869-901 ms against 504-624 ms with oneDNN (``benchmarks/piggyback.py --threads 1``),
while the decode-only steps were 1.2-1.7x faster with it. Per k it issues 1 load of W and 16
broadcasts of x for 16 FMAs; the row chunks and K slices of the many-rows path (64 or 128
rows, 256 or 512 of K, for any x) left it at 54-64 GFLOP/s, and two panels x 8 rows reached
83-93. From 16 rows the kernel now takes groups of 4 panels (64 columns) 6 rows at a time
(24 accumulators; per k 4 loads of W and 6 broadcasts for 24 FMAs; the x of a 16-row block
packed as before, read in pieces of 6, 6 and 4), the panels after the last whole group one by
one as before; fewer rows keep the 16-row kernel and its prefetches (decode steps, tuned on the
EPYC above). Same machine, the kinds interleaved, two runs: at 256 rows 0.78-1.00x oneDNN
(gate/up 27.6 against 25.4 ms), 0.81-0.97x at 1024, 0.88-1.28x at 16-64 rows; the 256-token
hybrid step 602-605 ms (oneDNN 504-529 ms, in the same run), decode-only steps unchanged (45-48
ms for 8 decodes against oneDNN's 56-71). K slices of 64-256 in the groups' path: no gain beyond the
machine's noise. Not re-measured on the AVX-512 EPYC of the notes above (not this session's
machine): there the 16-row kernel was on par with oneDNN from 128 rows, and the groups issue
fewer loads per FMA than it.

Note [the panel's K slices]: up to 2026-12-02 the kernel cut K into slices of 256 for fewer
than 128 rows, so that a panel's 16 KB slice stayed in L1 while each block of 16 rows passed
over it. On the AVX-512 EPYC, 8 layers of the embedded model's weights cycled (360 MB, each
call finds its weight in memory, as in a decode step), 2 threads, variants alternated 7 times
in one process, ms for the 8 layers' linears at 12 / 16 / 20 / 24 / 32 / 64 / 100 rows: slices
of 256: 19.1 / 20.4 / 24.9 / 28.0 / 34.3 / 65.8 / 95.9; all of K at once: 18.0 / 19.0 / 21.8 /
26.5 / 32.6 / 63.0 / 91.8 (1.04-1.14x; slices of 128 or 64 were 2-12% slower than 256, 512 in
between). The AVX2 build on the same CPU: at 1 / 8 / 16 / 24 / 32 / 64 rows 13.96 / 23.2 /
34.9 / 38.7 / 48.3 / 89.6 vs 13.5 / 22.0 / 33.5 / 38.8 / 46.5 / 88.4 (on par or 2-5% faster).
A block of 16 rows' packed x is 64 KB at K = 1024 (L2), the panel slice read from memory
once; slicing only added the y round trips and broke the stream of each panel in four.

Note [the panel's prefetch]: each k of the micro-kernel prefetches the panel's line 32 k ahead
(2 KB) into L1 and, since 2026-12-02, the line 256 k ahead (16 KB) into L2. With few rows a
line is consumed every few cycles, and 2 KB ahead is about one memory latency: the stream
stalled. The same setting as Note [the panel's K slices] (8 layers cycled from memory, 2
threads, main's kernel and this one alternated in one process, then the order reversed),
ms for the 8 layers' linears (both changes against main): at 4 / 8 / 12 / 16 / 20 / 24 / 32 /
64 / 128 rows 16.6 / 17.2 / 18.5 / 20.7 / 24.1 / 27.5 / 34.6 / 65.1 / 115.7 -> 12.9 / 12.6 /
13.6 / 16.4 / 20.2 / 23.3 / 30.3 / 60.3 / 112.9 (1.29 / 1.36 / 1.36 / 1.26 / 1.19 / 1.18 / 1.14 /
1.08 / 1.02x; reversed: 1.28 / 1.30 / 1.41 / 1.28 / 1.25 / 1.18 / 1.10 / 1.06 / 1.03x): 8 rows
now read the 360 MB of weights at 28-35 GB/s, the machine's copy rate. 128 lines ahead or 512
did as well as 256, the L2 prefetch without the L1 one 0-8% worse; 256 to 512 rows unchanged
(223-232 ms either way). Prefetching only in each panel's first block of rows (the one that
reads it from memory) was no better. The AVX2 build, old vs new: 1.08-1.27x at 4 to 24 rows.
Half an hour later (the machine slower), at 4 / 8 / 12 / 16 / 24 / 32 rows: 1.20 / 1.40 / 1.38
/ 1.13 / 1.23 / 1.02x and reversed 1.56 / 1.74 / 1.38 / 1.17 / 1.14 / 1.10x. (The session
before tried the same L2 prefetch, saw 1.11-1.33x once and no difference in two reruns with
the machine in a faster state, and dropped it; this time it showed in every series over an
hour, `piggyback.py`'s decode steps included, and made no step slower.)
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
