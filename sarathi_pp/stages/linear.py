"""``y = x W^T (+ b)`` for the decoder's weights. On CPU float32 the weight is prepacked once at
load time for one of two kernels, else ``F.linear``:

- ``panel_gemm`` (x86 with AVX2 + FMA; torch on libgomp): our small C kernel
  (``cpu_kernels``), the weight packed in panels of 16 output columns (``[N/16, K, 16]``),
  each panel streamed once per call while a block of rows accumulates in registers over the
  whole of K, panels split over torch's OpenMP threads. Two micro-kernels, chosen at build
  time (``-march=native``): with AVX2, 6 rows at a time (2 x 6 accumulators, a broadcast of x
  and two loads of W per k); with AVX-512, 16 rows at a time (16 zmm accumulators, one load
  of W per k) from a copy of x packed by blocks of 16 rows (see Note [the AVX-512 panel
  kernel]), and from 16 rows groups of 4 panels 6 rows at a time (Note [the AVX-512 panel
  kernel's groups]).
- ``onednn``: oneDNN with the weight reordered into its blocked layout
  (``mkldnn._linear_pointwise``); where the kernel does not load, or with
  ``SARATHI_PP_CPU_GEMM=0``.
- ``f_linear``: other dtypes and devices, small weights, ``SARATHI_PP_ONEDNN_LINEAR=0``.

Only the packed weight is kept (no second copy).

Why (see Note [small-row matmuls on CPU]): decode-only steps multiply few rows
(``[num_decodes, hidden]``) by every weight. ``F.linear``'s MKL path handles few rows poorly
on this class of CPU (AMD), oneDNN prepacked is 2-8x faster from 4 to 64 rows; the panel
kernel is 1.1-1.3x faster than oneDNN again from 1 to 64 rows with the weights coming from
memory (as in a step), and on par or faster at 128 to 2048 rows (prefill chunks, whole
prompts), on an AVX2 EPYC; on an AVX-512 one, see Note [the AVX-512 panel kernel].

Note [small-row matmuls on CPU]: tiny-llama's gate/up weight (5632 x 1024, float32) on a
2-core AMD EPYC VM, torch 2.13, best of 12: 1 thread, ms for 1 / 8 / 32 / 256 rows: MKL
2.1 / 8.4 / 12.7 / 58.7, oneDNN prepacked 2.6 / 4.3 / 8.2 / 48.0; 2 threads (busy machine,
load ~3): MKL 2.0 / 23.2 / 31.9 / 70.8, oneDNN 4.8 / 2.9 / 9.6 / 48.1. The batch-size hint
of the reorder changed little; none is given. Panel kernel vs oneDNN, 2 threads, a quieter
machine (load ~1.5), the same weight called again and again (so the small ones stay in the
32 MB L3: this flatters the panel kernel at few rows), ms for 1 / 4 / 16 / 32 / 64 / 256 / 1024 rows: gate/up 0.75 / 0.99 /
2.05 / 2.87 / 5.03 / 21.6 / 82.5 vs 0.90 / 1.40 / 2.58 / 3.92 / 6.06 / 22.9 / 111.5; down
(1024 x 2816) 0.16 / 0.20 / 0.78 / 1.23 / 2.61 / 10.9 / 37.3 vs 0.27 / 0.31 / 1.17 / 1.75 /
2.92 / 11.8 / 40.6 (gate/up at 32 rows: 129 GFLOP/s, the machine's matmul rate). With the
kinds interleaved (``benchmarks/linear_rows.py``: each call finds its weight evicted), gate/up
at 1 / 4 / 16 / 32 / 64 / 256 rows: 1.56 / 1.79 / 3.20 / 4.14 / 7.25 / 23.0 vs 1.90 / 2.36 /
3.57 / 4.47 / 7.56 / 23.3; at 1 thread 2.11 / 2.48 / 5.18 / 6.84 / 13.0 / 37.9 vs 2.26 / 3.27
/ 5.94 / 8.11 / 13.8 / 42.7 (MKL's gemv is faster at 1 row on one thread: 1.82). Prefetching
the panel 2 KB ahead gained 5-13% at 4-32 rows.

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
import os
from functools import cache

import torch
import torch.nn.functional as F

from sarathi_pp.stages.cpu_kernels import KernelUnavailable, build, cpu_flags
from sarathi_pp.stages.host_pages import empty_huge

log = logging.getLogger(__name__)

# Smaller weights stay on F.linear: MKL runs them on one thread, oneDNN always opens a
# parallel region, whose fixed cost dominates tiny matmuls (and on a busy machine a thread may
# wait a whole time slice for a core: a 2-layer hidden-64 test model stepped 8x slower).
MIN_PACKED_ELEMENTS = 1 << 18
PANEL = 16  # output columns per panel of the packed weight
KINDS = ("panel_gemm", "onednn", "f_linear")

_GEMM_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#if !(defined(__AVX2__) && defined(__FMA__))
#error "the panel kernel needs AVX2 and FMA"
#endif
#include <immintrin.h>
#define NR 16   /* output columns per panel */
#define BIG_X (1 << 20)  /* floats of x above which rows go in chunks of MC, K in slices of KC_BIG */
#define MC 128           /* a multiple of 16: the AVX-512 kernel's packed row blocks start at chunks */
#define KC_BIG 512
#define GROUP 4          /* panels per group (AVX-512, from GROUP_ROWS rows) */

#if defined(__AVX512F__)
/* AVX-512: 16 rows x 16 columns (one zmm accumulator per row, 16 of the 32 registers) per
   load of the panel, from x packed by blocks of 16 rows as [K][mr] (see Note [the AVX-512
   panel kernel]). */
#define MR_MAX 16
static inline __attribute__((always_inline)) void micro(const float *xp, const float *wp,
                                                        int64_t kc, float *y, int64_t ldy,
                                                        const int MR, int accumulate) {
    __m512 acc[MR_MAX];
    for (int r = 0; r < MR; r++) acc[r] = accumulate ? _mm512_loadu_ps(y + r * ldy) : _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        __builtin_prefetch(wp + (k + 32) * NR);  /* a panel row is one line: 2 KB ahead */
        __builtin_prefetch(wp + (k + 256) * NR, 0, 1);  /* and 16 KB ahead into L2 (Note [the panel's prefetch]) */
        const __m512 w = _mm512_loadu_ps(wp + k * NR);
        for (int r = 0; r < MR; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xp[k * MR + r]), w, acc[r]);
    }
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

/* One panel for all M rows, K from k0 to k0 + kc; xp: x packed (block r at xp + r * K). */
static void panel(const float *xp, int64_t M, int64_t K, const float *wp, float *y, int64_t N,
                  int64_t k0, int64_t kc) {
    const int acc = k0 > 0;
    int64_t r = 0;
    wp += k0 * NR;
    for (; r + MR_MAX <= M; r += MR_MAX) micro(xp + r * K + k0 * MR_MAX, wp, kc, y + r * N, N, MR_MAX, acc);
#define TAIL(n) case n: micro(xp + r * K + k0 * n, wp, kc, y + r * N, N, n, acc); break;
    switch (M - r) {
        TAIL(15) TAIL(14) TAIL(13) TAIL(12) TAIL(11) TAIL(10) TAIL(9) TAIL(8)
        TAIL(7) TAIL(6) TAIL(5) TAIL(4) TAIL(3) TAIL(2) TAIL(1)
    }
#undef TAIL
}

/* From GROUP_ROWS rows: 4 panels (64 columns) x up to 6 rows per call, 24 accumulators, per k
   4 loads of W and 6 broadcasts of x for 24 FMAs, against 1 + 16 for 16 in micro() (see Note
   [the AVX-512 panel kernel's groups]). xp: a packed block ([K][ldx]) at this call's first
   row and at k = 0; wp: the first panel at k = 0, the others pstride floats apart. */
#define GROUP_MR 6
#define GROUP_ROWS 16
static inline __attribute__((always_inline)) void micro4(const float *xp, int64_t ldx,
                                                         const float *wp, int64_t pstride,
                                                         int64_t kc, float *y, int64_t ldy,
                                                         const int MR, int accumulate) {
    __m512 a[GROUP_MR][GROUP];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < GROUP; j++)
            a[r][j] = accumulate ? _mm512_loadu_ps(y + r * ldy + NR * j) : _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        const __m512 w0 = _mm512_loadu_ps(wp + k * NR), w1 = _mm512_loadu_ps(wp + pstride + k * NR);
        const __m512 w2 = _mm512_loadu_ps(wp + 2 * pstride + k * NR);
        const __m512 w3 = _mm512_loadu_ps(wp + 3 * pstride + k * NR);
        for (int r = 0; r < MR; r++) {
            const __m512 xb = _mm512_set1_ps(xp[k * ldx + r]);
            a[r][0] = _mm512_fmadd_ps(xb, w0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(xb, w1, a[r][1]);
            a[r][2] = _mm512_fmadd_ps(xb, w2, a[r][2]);
            a[r][3] = _mm512_fmadd_ps(xb, w3, a[r][3]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < GROUP; j++) _mm512_storeu_ps(y + r * ldy + NR * j, a[r][j]);
}
/* GROUP panels (starting at wp, K * NR floats apart) for all M rows, K from k0 to k0 + kc;
   xp packed as for panel(). */
static void group(const float *xp, int64_t M, int64_t K, const float *wp, float *y, int64_t N,
                  int64_t k0, int64_t kc) {
    const int acc = k0 > 0;
    for (int64_t r0 = 0; r0 < M; r0 += MR_MAX) {
        const int64_t mr = M - r0 < MR_MAX ? M - r0 : MR_MAX;
        const float *b = xp + r0 * K + k0 * mr;
        for (int64_t h = 0; h < mr; h += GROUP_MR) {
            const int n = mr - h < GROUP_MR ? (int)(mr - h) : GROUP_MR;
#define G(c) case c: micro4(b + h, mr, wp + k0 * NR, K * NR, kc, y + (r0 + h) * N, N, c, acc); break;
            switch (n) { G(6) G(5) G(4) G(3) G(2) G(1) }
#undef G
        }
    }
}
/* x [M, K] -> xp: each block of up to 16 rows r0.. as [K][mr] at xp + r0 * K. */
static void pack_x(const float *x, int64_t M, int64_t K, float *xp, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if(num_threads > 1 && M * K > 65536)
    for (int64_t r0 = 0; r0 < M; r0 += MR_MAX) {
        const int64_t mr = M - r0 < MR_MAX ? M - r0 : MR_MAX;
        float *d = xp + r0 * K;
        for (int64_t k = 0; k < K; k++)
            for (int64_t r = 0; r < mr; r++) d[k * mr + r] = x[(r0 + r) * K + k];
    }
}
#else
/* AVX2: y[MR rows, NR] (+)= x[MR rows, kc] . wp[kc, NR]: 2 x MR accumulators in registers. */
static inline __attribute__((always_inline)) void micro(const float *x, int64_t ldx,
                                                        const float *wp, int64_t kc, float *y,
                                                        int64_t ldy, const int MR, int accumulate) {
    __m256 acc[6][2];
    for (int r = 0; r < MR; r++) {
        acc[r][0] = accumulate ? _mm256_loadu_ps(y + r * ldy) : _mm256_setzero_ps();
        acc[r][1] = accumulate ? _mm256_loadu_ps(y + r * ldy + 8) : _mm256_setzero_ps();
    }
    for (int64_t k = 0; k < kc; k++) {
        __builtin_prefetch(wp + (k + 32) * NR);  /* a panel row is one line: 2 KB ahead */
        __builtin_prefetch(wp + (k + 256) * NR, 0, 1);  /* and 16 KB ahead into L2 (Note [the panel's prefetch]) */
        const __m256 w0 = _mm256_loadu_ps(wp + k * NR), w1 = _mm256_loadu_ps(wp + k * NR + 8);
        for (int r = 0; r < MR; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
            acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < MR; r++) {
        _mm256_storeu_ps(y + r * ldy, acc[r][0]);
        _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
    }
}

/* One panel (NR output columns) for all M rows, K from k0 to k0 + kc. */
static void panel(const float *x, int64_t M, int64_t K, const float *wp, float *y, int64_t N,
                  int64_t k0, int64_t kc) {
    const int acc = k0 > 0;
    int64_t r = 0;
    x += k0;
    wp += k0 * NR;
    for (; r + 6 <= M; r += 6) micro(x + r * K, K, wp, kc, y + r * N, N, 6, acc);
    switch (M - r) {
        case 5: micro(x + r * K, K, wp, kc, y + r * N, N, 5, acc); break;
        case 4: micro(x + r * K, K, wp, kc, y + r * N, N, 4, acc); break;
        case 3: micro(x + r * K, K, wp, kc, y + r * N, N, 3, acc); break;
        case 2: micro(x + r * K, K, wp, kc, y + r * N, N, 2, acc); break;
        case 1: micro(x + r * K, K, wp, kc, y + r * N, N, 1, acc); break;
    }
}
#endif

/* Work unit u of a call: a group of GROUP panels (u < groups, AVX-512 only) or one of the
   panels after the last whole group (every panel when groups = 0). */
static inline void unit(const float *xp, int64_t M, int64_t K, const float *wp, float *y,
                        int64_t N, int64_t groups, int64_t u, int64_t k0, int64_t kc) {
#if defined(__AVX512F__)
    if (u < groups) {
        group(xp, M, K, wp + u * GROUP * K * NR, y + u * GROUP * NR, N, k0, kc);
        return;
    }
#endif
    const int64_t p = groups * GROUP + (u - groups);
    panel(xp, M, K, wp + p * K * NR, y + p * NR, N, k0, kc);
}

/* y [M, N] = x [M, K] . W^T, W packed as wp [N / NR, K, NR]; N a multiple of NR. Returns 0, or
   1 when the packed copy of x could not be allocated (AVX-512). */
int panel_gemm_f32(const float *x, int64_t M, int64_t K, const float *wp, int64_t N, float *y,
                   int num_threads) {
    const int64_t panels = N / NR;
    if (M == 0) return 0;  /* (malloc(0) may return NULL) */
#if defined(__AVX512F__)
    float *xp = malloc(sizeof(float) * (size_t)(M * K));
    if (xp == NULL) return 1;
    pack_x(x, M, K, xp, num_threads);
    /* from GROUP_ROWS rows, groups of panels (Note [the AVX-512 panel kernel's groups]) */
    const int64_t groups = M >= GROUP_ROWS ? panels / GROUP : 0;
#else
    const float *xp = x;
    const int64_t groups = 0;
#endif
    const int64_t units = groups + (panels - groups * GROUP);
    if (M * K <= BIG_X) {
        #pragma omp parallel for schedule(static) num_threads(num_threads) if(num_threads > 1)
        for (int64_t u = 0; u < units; u++)  /* all of K at once (Note [the panel's K slices]) */
            unit(xp, M, K, wp, y, N, groups, u, 0, K);
    } else {
        /* Many rows (x above 4 MB): every panel reading all of x would stream it from L3 or
           memory once per panel (down at 2048 rows: 0.5-0.66x oneDNN). Instead rows in
           chunks of MC and K in slices of KC_BIG: the chunk's slice of x (256 KB) stays in
           L2 while every panel's slice passes over it (see Note [the AVX-512 panel
           kernel]). */
        #pragma omp parallel num_threads(num_threads) if(num_threads > 1)
        for (int64_t r0 = 0; r0 < M; r0 += MC)
            for (int64_t k0 = 0; k0 < K; k0 += KC_BIG) {
                const int64_t mc = M - r0 < MC ? M - r0 : MC, kcb = K - k0 < KC_BIG ? K - k0 : KC_BIG;
                #pragma omp for schedule(static)
                for (int64_t u = 0; u < units; u++)
                    unit(xp + r0 * K, mc, K, wp, y + r0 * N, N, groups, u, k0, kcb);
            }
    }
#if defined(__AVX512F__)
    free(xp);
#endif
    return 0;
}
"""


@cache
def load_gemm(extra_flags: tuple[str, ...] = ()) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
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
        lib, _ = build("panel_gemm", _GEMM_SOURCE, need_openmp=True, extra_flags=extra_flags)
    except KernelUnavailable as e:
        log.warning("panel GEMM kernel unavailable, using oneDNN: %s", e)
        return None
    fn = lib.panel_gemm_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _packable(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.numel() >= MIN_PACKED_ELEMENTS
    )


def onednn_usable(weight: torch.Tensor) -> bool:
    """Prepack ``weight`` for oneDNN? CPU, float32, at least ``MIN_PACKED_ELEMENTS``, a torch
    built with oneDNN, not turned off."""
    return (
        _packable(weight)
        and torch.backends.mkldnn.is_available()
        and os.environ.get("SARATHI_PP_ONEDNN_LINEAR", "1") != "0"
    )


def available_kinds() -> list[str]:
    """The kinds that can run here (for some weight), in ``KINDS``' order."""
    usable = {
        "panel_gemm": load_gemm() is not None,
        "onednn": torch.backends.mkldnn.is_available(),
        "f_linear": True,
    }
    return [kind for kind in KINDS if usable[kind]]


def panel_gemm_applies(weight: torch.Tensor) -> bool:
    """Can ``panel_gemm`` apply ``weight``? Packable, its rows fill whole panels, and the
    kernel loads here."""
    return _packable(weight) and weight.shape[0] % PANEL == 0 and load_gemm() is not None


def choose_kind(weight: torch.Tensor) -> str:
    """``panel_gemm`` where it applies (unless ``SARATHI_PP_CPU_GEMM=0``), else ``onednn``
    where usable, else ``f_linear``."""
    if os.environ.get("SARATHI_PP_CPU_GEMM", "1") != "0" and panel_gemm_applies(weight):
        return "panel_gemm"
    return "onednn" if onednn_usable(weight) else "f_linear"


class Linear:
    """One weight ``[out, in]`` (and optional bias ``[out]``), applied to ``x [rows, in]``.
    ``kind`` (one of ``KINDS``) is chosen by ``choose_kind`` unless given."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, kind: str | None = None
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.nbytes = weight.numel() * weight.element_size()
        self.kind = kind or choose_kind(weight)
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        self._gemm: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]
        if self.kind == "panel_gemm":
            if not panel_gemm_applies(weight):
                raise ValueError(f"panel_gemm cannot apply a {tuple(weight.shape)} weight here")
            self._gemm = load_gemm()
            n, k = weight.shape
            self.packed = empty_huge((n // PANEL, k, PANEL), weight.dtype)  # Note [huge pages]
            self.packed.copy_(weight.reshape(n // PANEL, PANEL, k).transpose(1, 2))
        elif self.kind == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        elif self.kind == "f_linear":
            self.weight = weight
        else:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")

    @property
    def is_packed(self) -> bool:
        return self.packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if self.kind == "panel_gemm":
            assert self._gemm is not None and self.packed is not None
            assert x.dtype == torch.float32, x.dtype
            rows = x.reshape(-1, self.in_features).contiguous()
            y = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
            failed = self._gemm(
                rows.data_ptr(), rows.shape[0], self.in_features, self.packed.data_ptr(),
                self.out_features, y.data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
            if failed:
                raise MemoryError(
                    f"panel_gemm: no memory for a packed copy of {tuple(rows.shape)} rows"
                )
            if self.bias is not None:
                y.add_(self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.packed, self.bias, "none", [], ""
            )
        return F.linear(x, self.weight, self.bias)
