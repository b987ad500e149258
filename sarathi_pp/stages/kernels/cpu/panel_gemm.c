/* panel_gemm.c: see panel_gemm.py (how it is built, loaded and called, and its Notes). */
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
