/* paged_attention.c: see paged_attention.py (how it is built, loaded and called, and its Notes). */
#include "exp_f.h"
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

/* Below this many multiply-adds per thread a thread costs more than it saves (and on a busy
   machine a started thread may wait a whole time slice for a core). */
#define MIN_WORK_PER_THREAD (1 << 20)

typedef struct {
    const float *q, *k, *v;
    const int64_t *tables, *lens;
    int64_t table_stride;
    float *out;
    int num_seqs, heads, kv_heads, head_dim, block_size, next;
    float scale;
    /* parts > 1 (fewer sequences than threads): each sequence's blocks in `parts` ranges, one
       work item each, written unnormalised to part_o [item, H, D] with their running maximum
       and sum in part_ms [item, H, 2], and merged after (flash-decoding's split). */
    int parts;
    float *part_o, *part_ms;
} job_t;


/* Vector helpers shared by both kernels: PF_L float lanes (16 with AVX-512, 8 with AVX2 +
   FMA) and exp_f's arithmetic on every lane. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <string.h>
#if defined(__AVX512F__)
#define PF_L 16
typedef __m512 vf;
typedef __mmask16 vmask;
#define V_SET1 _mm512_set1_ps
#define V_ZERO _mm512_setzero_ps
#define V_LOAD _mm512_load_ps
#define V_LOADU _mm512_loadu_ps
#define V_STORE _mm512_store_ps
#define V_STOREU _mm512_storeu_ps
#define V_FMA _mm512_fmadd_ps
#define V_FNMA _mm512_fnmadd_ps
#define V_MUL _mm512_mul_ps
#define V_ADD _mm512_add_ps
#define V_SUB _mm512_sub_ps
#define V_MAX _mm512_max_ps
#define V_MIN _mm512_min_ps
#define V_DIV _mm512_div_ps
static inline vf v_round(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf v_pow2i(vf n) {  /* 2^n for integral n in [-126, 127] */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
static inline vmask v_all(void) { return (vmask)0xFFFF; }
static inline vmask v_le(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
static inline vf v_mask_max(vf a, vmask k, vf b) { return _mm512_mask_max_ps(a, k, a, b); }
static inline vf v_maskz(vmask k, vf a) { return _mm512_maskz_mov_ps(k, a); }
#else
#define PF_L 8
typedef __m256 vf;
typedef __m256 vmask;
#define V_SET1 _mm256_set1_ps
#define V_ZERO _mm256_setzero_ps
#define V_LOAD _mm256_load_ps
#define V_LOADU _mm256_loadu_ps
#define V_STORE _mm256_store_ps
#define V_STOREU _mm256_storeu_ps
#define V_FMA _mm256_fmadd_ps
#define V_FNMA _mm256_fnmadd_ps
#define V_MUL _mm256_mul_ps
#define V_ADD _mm256_add_ps
#define V_SUB _mm256_sub_ps
#define V_MAX _mm256_max_ps
#define V_MIN _mm256_min_ps
#define V_DIV _mm256_div_ps
static inline vf v_round(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf v_pow2i(vf n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vmask v_all(void) { return _mm256_castsi256_ps(_mm256_set1_epi32(-1)); }
static inline vmask v_le(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
static inline vf v_mask_max(vf a, vmask k, vf b) { return _mm256_max_ps(a, _mm256_blendv_ps(a, b, k)); }
static inline vf v_maskz(vmask k, vf a) { return _mm256_and_ps(k, a); }
#endif

/* exp_f's arithmetic on every lane: the same clamp, reduction and polynomial. */
static inline vf v_exp(vf x) {
    x = V_MIN(V_MAX(x, V_SET1(-87.0f)), V_SET1(88.0f));
    const vf n = v_round(V_MUL(x, V_SET1(1.44269504088896341f)));
    const vf r = V_ADD(V_FNMA(n, V_SET1(0.693359375f), x), V_MUL(n, V_SET1(2.12194440e-4f)));
    vf p = V_SET1(1.9875691500e-4f);
    p = V_FMA(p, r, V_SET1(1.3981999507e-3f));
    p = V_FMA(p, r, V_SET1(8.3334519073e-3f));
    p = V_FMA(p, r, V_SET1(4.1665795894e-2f));
    p = V_FMA(p, r, V_SET1(1.6666665459e-1f));
    p = V_FMA(p, r, V_SET1(5.0000001201e-1f));
    return V_MUL(V_ADD(V_FMA(V_MUL(p, r), r, r), V_SET1(1.0f)), v_pow2i(n));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* Dot products of q [D] with 8 K rows (k, k + row, ...) at once: eight accumulators, then one
   transposing reduction instead of a horizontal sum per row. */
static inline __attribute__((always_inline)) __m256 dot8(const float *q, const float *k,
                                                         int64_t row, const int D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int x = 0; x < D; x += 8) {
        const __m256 qx = _mm256_loadu_ps(q + x);
        a0 = _mm256_fmadd_ps(qx, _mm256_loadu_ps(k + x), a0);
        a1 = _mm256_fmadd_ps(qx, _mm256_loadu_ps(k + row + x), a1);
        a2 = _mm256_fmadd_ps(qx, _mm256_loadu_ps(k + 2 * row + x), a2);
        a3 = _mm256_fmadd_ps(qx, _mm256_loadu_ps(k + 3 * row + x), a3);
        a4 = _mm256_fmadd_ps(qx, _mm256_loadu_ps(k + 4 * row + x), a4);
        a5 = _mm256_fmadd_ps(qx, _mm256_loadu_ps(k + 5 * row + x), a5);
        a6 = _mm256_fmadd_ps(qx, _mm256_loadu_ps(k + 6 * row + x), a6);
        a7 = _mm256_fmadd_ps(qx, _mm256_loadu_ps(k + 7 * row + x), a7);
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* o[u] = o[u] * c[u] + sum_i p[u][i] V[i] for NH <= 4 query heads u that share one KV head:
   each V row is loaded once for all of them, where a loop per head loaded it NH times (see
   Note [paged decode on CPU]). Eight AVX2 accumulators per pass over the block's rows: NH
   heads x 8 / NH vectors of 8 columns (one head: 64 columns a pass, four heads: 16). */
static inline __attribute__((always_inline)) void weigh_v(const float *v, int64_t row, const float *p,
                                                         int64_t pstride, int64_t m, float *o,
                                                         const float *c, const int D, const int NH) {
#if defined(__AVX2__) && defined(__FMA__)
    const int CW = NH == 1 ? 8 : NH == 2 ? 4 : 2;  /* vectors of 8 columns per head per pass */
    if (D % (8 * CW) == 0) {
        for (int x = 0; x < D; x += 8 * CW) {
            __m256 a[4][8];
            for (int u = 0; u < NH; u++) {
                const __m256 cu = _mm256_set1_ps(c[u]);
                for (int w = 0; w < CW; w++)
                    a[u][w] = _mm256_mul_ps(_mm256_loadu_ps(o + u * D + x + 8 * w), cu);
            }
            for (int64_t i = 0; i < m; i++) {
                __m256 vr[8];
                for (int w = 0; w < CW; w++) vr[w] = _mm256_loadu_ps(v + i * row + x + 8 * w);
                for (int u = 0; u < NH; u++) {
                    const __m256 pu = _mm256_broadcast_ss(p + u * pstride + i);
                    for (int w = 0; w < CW; w++) a[u][w] = _mm256_fmadd_ps(pu, vr[w], a[u][w]);
                }
            }
            for (int u = 0; u < NH; u++)
                for (int w = 0; w < CW; w++) _mm256_storeu_ps(o + u * D + x + 8 * w, a[u][w]);
        }
        return;
    }
#endif
    for (int u = 0; u < NH; u++) {
        float *ou = o + u * D;
        for (int x = 0; x < D; x++) ou[x] *= c[u];
        for (int64_t i = 0; i < m; i++) {
            const float pi = p[u * pstride + i];
            #pragma omp simd
            for (int x = 0; x < D; x++) ou[x] += pi * v[i * row + x];
        }
    }
}

/* The next block into L2, not L1 (locality 1: prefetcht2 on x86): one block's K and V
   (2 x 16 KB at block size 16 with 4 KV heads of 64) fill a 32 KB L1 by themselves, so a
   prefetch into L1 evicted the block being computed on (see Note [paged decode on CPU]). */
static inline void prefetch(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 1);  /* 16 floats: a line */
}

#if defined(__AVX512F__)
/* Where dot16's transposing sum leaves each key: lane p holds key KEY_LANE[p] (an involution,
   so the same table, given to a permute, puts key i in lane i). */
static const int32_t KEY_LANE[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

/* Scores of q [D] against m <= 16 keys k, k + row, ... (D a multiple of 16), key i's in lane
   i (lanes from m on hold key 0's again: the caller masks them). Each key's D / 16 products
   go to one register a[i]; the sixteen registers are then summed across their lanes together,
   halving the lanes per register at each level (15 shuffle-and-add steps, where a horizontal
   sum per key would take 4 each). See Note [paged decode on CPU]. */
static inline __attribute__((always_inline)) __m512 dot16(const float *q, const float *k,
                                                          int64_t row, int m, const int D) {
    __m512 a[16], b[8], c[4], d[2];
    for (int i = 0; i < 16; i++) {
        const float *ki = k + (i < m ? i : 0) * row;
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(ki));
        for (int x = 16; x < D; x += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + x), _mm512_loadu_ps(ki + x), acc);
        a[i] = acc;
    }
    /* b[i]: key i's 8 partial sums in the low half, key i + 8's in the high half; c[i]: four
       keys' 4 partial sums in its four quarters; d, then e: whole sums. */
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[i], c[i + 2]), _mm512_unpackhi_ps(c[i], c[i + 2]));
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x44), _mm512_shuffle_ps(d[0], d[1], 0xEE));
    return _mm512_permutexvar_ps(_mm512_loadu_si512(KEY_LANE), e);
}

/* o[u] = o[u] * c[u] + sum_i p[u * 16 + i] V[i] for NH <= 4 query heads u of one KV head, 64
   columns a pass (4 registers per head): each V row loaded once for all of them. */
static inline __attribute__((always_inline)) void weigh_v16(const float *v, int64_t row,
                                                            const float *p, int m, float *o,
                                                            const float *c, const int D,
                                                            const int NH) {
    for (int x = 0; x < D; x += 64) {
        __m512 a[4][4];
        for (int u = 0; u < NH; u++) {
            const __m512 cu = _mm512_set1_ps(c[u]);
            for (int w = 0; w < 4; w++) a[u][w] = _mm512_mul_ps(_mm512_loadu_ps(o + u * D + x + 16 * w), cu);
        }
        for (int i = 0; i < m; i++) {
            __m512 vr[4];
            for (int w = 0; w < 4; w++) vr[w] = _mm512_loadu_ps(v + i * row + x + 16 * w);
            for (int u = 0; u < NH; u++) {
                const __m512 pu = _mm512_set1_ps(p[u * 16 + i]);
                for (int w = 0; w < 4; w++) a[u][w] = _mm512_fmadd_ps(pu, vr[w], a[u][w]);
            }
        }
        for (int u = 0; u < NH; u++)
            for (int w = 0; w < 4; w++) _mm512_storeu_ps(o + u * D + x + 16 * w, a[u][w]);
    }
}

/* One cached block of m keys at kb / vb for every head (D a multiple of 64), 16 keys at a
   time: per KV head, its query heads' scores (one register each), their online-softmax
   update, then the keys' V weighed into their outputs. The next block (nk / nv, or NULL) is
   prefetched a 1/H part per head, as one_seq does. s: [H, 16] scratch. */
static inline __attribute__((always_inline)) void block16(const job_t *j, const float *q,
                                                          const float *kb, const float *vb,
                                                          int64_t m, float *o, float *mx,
                                                          float *sum, float *cf, float *s,
                                                          const float *nk, const float *nv,
                                                          int64_t pf, const int D) {
    const int H = j->heads, KVH = j->kv_heads, G = H / KVH;
    const int64_t row = (int64_t)KVH * D;
    const __m512 scale = _mm512_set1_ps(j->scale), neg_inf = _mm512_set1_ps(-INFINITY);
    for (int64_t i0 = 0; i0 < m; i0 += 16) {
        const int mt = m - i0 < 16 ? (int)(m - i0) : 16;
        const __mmask16 valid = (__mmask16)((1u << mt) - 1);
        for (int g = 0; g < KVH; g++) {
            const float *kg = kb + i0 * row + g * D;
            for (int h = g * G; h < (g + 1) * G; h++) {
                if (nk != NULL && i0 == 0) prefetch(nk + h * pf, pf), prefetch(nv + h * pf, pf);
                const __m512 sc = _mm512_mask_mov_ps(neg_inf, valid,
                                                     _mm512_mul_ps(dot16(q + h * D, kg, row, mt, D), scale));
                const float bm = _mm512_reduce_max_ps(sc);
                cf[h] = 1.f;
                if (bm > mx[h]) {  /* a new maximum: rescale what was summed so far */
                    cf[h] = exp_f(mx[h] - bm);
                    sum[h] *= cf[h];
                    mx[h] = bm;
                }
                const __m512 p = _mm512_maskz_mov_ps(valid, v_exp(_mm512_sub_ps(sc, _mm512_set1_ps(mx[h]))));
                sum[h] += _mm512_reduce_add_ps(p);
                _mm512_storeu_ps(s + h * 16, p);
            }
        }
        for (int g = 0; g < KVH; g++) {
            const float *vg = vb + i0 * row + g * D;
            for (int h0 = g * G; h0 < (g + 1) * G; h0 += 4) {
                const int nh = (g + 1) * G - h0 < 4 ? (g + 1) * G - h0 : 4;
                switch (nh) {
                    case 4: weigh_v16(vg, row, s + h0 * 16, mt, o + h0 * D, cf + h0, D, 4); break;
                    case 3: weigh_v16(vg, row, s + h0 * 16, mt, o + h0 * D, cf + h0, D, 3); break;
                    case 2: weigh_v16(vg, row, s + h0 * 16, mt, o + h0 * D, cf + h0, D, 2); break;
                    default: weigh_v16(vg, row, s + h0 * 16, mt, o + h0 * D, cf + h0, D, 1);
                }
            }
        }
    }
}
#endif

/* One work item: sequence item / parts, q [H, D], against its cached tokens in block range
   item % parts of parts (all of them when parts is 1), in one pass over those blocks with an
   online softmax (each block's K and V read once, while the blocks PF_DIST ahead are
   prefetched). s: [H, max(BS, 16)] scratch for a block's scores. The output accumulates in the
   sequence's row of out, normalised at the end; with parts > 1 in the item's part_o, left
   unnormalised with its maxima and sums in part_ms for merge_parts. */
#define PF_DIST 1
static inline __attribute__((always_inline)) void one_seq(const job_t *j, int item, float *s,
                                                          const int D) {
    const int H = j->heads, G = j->heads / j->kv_heads, BS = j->block_size;
    const int b = item / j->parts, part = item % j->parts;
    const int64_t n = j->lens[b], row = (int64_t)j->kv_heads * D;  /* floats per slot */
    const int64_t *table = j->tables + b * j->table_stride, pf = BS * row / H;
    const int64_t blocks = (n + BS - 1) / BS, t_begin = part * blocks / j->parts * BS;
    const int64_t t_end = (part + 1) * blocks / j->parts * BS < n ? (part + 1) * blocks / j->parts * BS : n;
    const float *q = j->q + (int64_t)b * H * D;
    float *o = j->parts > 1 ? j->part_o + (int64_t)item * H * D : j->out + (int64_t)b * H * D;
    float mx[H], sum[H], cf[H];  /* cf: each head's rescale factor for this block */
    for (int h = 0; h < H; h++) mx[h] = -INFINITY, sum[h] = 0.f;
    for (int64_t x = 0; x < (int64_t)H * D; x++) o[x] = 0.f;
    for (int64_t t0 = t_begin; t0 < t_end; t0 += BS) {
        const int64_t blk = table[t0 / BS] * BS * row, m = n - t0 < BS ? n - t0 : BS;
        const float *kb = j->k + blk, *vb = j->v + blk;
        const int64_t nxt = t0 + PF_DIST * BS < t_end ? table[t0 / BS + PF_DIST] * BS * row : -1;
#if defined(__AVX512F__)
        if (D % 64 == 0) {
            block16(j, q, kb, vb, m, o, mx, sum, cf, s, nxt >= 0 ? j->k + nxt : NULL,
                    nxt >= 0 ? j->v + nxt : NULL, pf, D);
            continue;
        }
#endif
        for (int h = 0; h < H; h++) {
            const float *qh = q + h * D, *kh = kb + (h / G) * D;
            float *sh = s + h * BS;
            if (nxt >= 0) prefetch(j->k + nxt + h * pf, pf), prefetch(j->v + nxt + h * pf, pf);
            int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
            if (D % 8 == 0)
                for (; i + 8 <= m; i += 8)
                    _mm256_storeu_ps(sh + i, _mm256_mul_ps(dot8(qh, kh + i * row, row, D),
                                                           _mm256_set1_ps(j->scale)));
#endif
            for (; i < m; i++) {
                float acc = 0.f;
                #pragma omp simd reduction(+:acc)
                for (int x = 0; x < D; x++) acc += qh[x] * kh[i * row + x];
                sh[i] = acc * j->scale;
            }
            float bm = mx[h];
            for (i = 0; i < m; i++) bm = sh[i] > bm ? sh[i] : bm;
            float part = 0.f;
            cf[h] = 1.f;
            if (bm > mx[h]) {  /* a new maximum: rescale what was summed so far */
                cf[h] = exp_f(mx[h] - bm);
                sum[h] *= cf[h];
                mx[h] = bm;
            }
            #pragma omp simd reduction(+:part)
            for (i = 0; i < m; i++) { sh[i] = exp_f(sh[i] - bm); part += sh[i]; }
            sum[h] += part;
        }
        /* The block's V weighted into the output, the heads of one KV head together: each V
           row loaded once for up to 4 heads. */
        for (int g = 0; g < j->kv_heads; g++)
            for (int h0 = g * G; h0 < (g + 1) * G; h0 += 4) {
                const int nh = (g + 1) * G - h0 < 4 ? (g + 1) * G - h0 : 4;
                const float *vg = vb + g * D;
                switch (nh) {
                    case 4: weigh_v(vg, row, s + h0 * BS, BS, m, o + h0 * D, cf + h0, D, 4); break;
                    case 3: weigh_v(vg, row, s + h0 * BS, BS, m, o + h0 * D, cf + h0, D, 3); break;
                    case 2: weigh_v(vg, row, s + h0 * BS, BS, m, o + h0 * D, cf + h0, D, 2); break;
                    default: weigh_v(vg, row, s + h0 * BS, BS, m, o + h0 * D, cf + h0, D, 1);
                }
            }
    }
    if (j->parts > 1) {  /* merged by merge_parts */
        for (int h = 0; h < H; h++)
            j->part_ms[((int64_t)item * H + h) * 2] = mx[h], j->part_ms[((int64_t)item * H + h) * 2 + 1] = sum[h];
        return;
    }
    for (int h = 0; h < H; h++) {
        const float inv = 1.f / sum[h];
        for (int x = 0; x < D; x++) o[h * D + x] *= inv;
    }
}

/* out[b] from its parts: each part's output and sum scaled by exp(its max - the max). */
static void merge_parts(const job_t *j) {
    const int H = j->heads, D = j->head_dim, P = j->parts;
    for (int b = 0; b < j->num_seqs; b++)
        for (int h = 0; h < H; h++) {
            float m = -INFINITY, total = 0.f;
            for (int p = 0; p < P; p++) {
                const float mp = j->part_ms[(((int64_t)b * P + p) * H + h) * 2];
                m = mp > m ? mp : m;
            }
            float *o = j->out + ((int64_t)b * H + h) * D;
            for (int x = 0; x < D; x++) o[x] = 0.f;
            for (int p = 0; p < P; p++) {
                const int64_t at = ((int64_t)b * P + p) * H + h;
                const float c = exp_f(j->part_ms[at * 2] - m);
                total += j->part_ms[at * 2 + 1] * c;
                for (int x = 0; x < D; x++) o[x] += j->part_o[at * D + x] * c;
            }
            const float inv = 1.f / total;
            for (int x = 0; x < D; x++) o[x] *= inv;
        }
}

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    /* a block's scores: [H, BS], or [H, 16] for block16 */
    float *s = malloc(sizeof(float) * (size_t)j->heads * (size_t)(j->block_size > 16 ? j->block_size : 16));
    if (s == NULL) return (void *)1;
    for (;;) {
        int b = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (b >= j->num_seqs * j->parts) break;
        if (j->head_dim == 64) one_seq(j, b, s, 64);
        else if (j->head_dim == 128) one_seq(j, b, s, 128);
        else one_seq(j, b, s, j->head_dim);
    }
    free(s);
    return NULL;
}

/* fn(arg) on num_threads threads; nonzero when any of them returned non-NULL (out of memory). */
static int run_threads(void *(*fn)(void *), void *arg, int num_threads) {
#ifdef _OPENMP
    /* Built with -fopenmp only where torch's OpenMP runtime is libgomp, which this library
       then shares: its threads are torch's, already awake, instead of new threads competing
       with torch's spinning ones for the cores (see Note [the kernels' threads] in build.py). */
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) if(num_threads > 1) reduction(|:failed)
    failed |= fn(arg) != NULL;
    return failed;
#else
    pthread_t threads[64];
    int started = 1, failed = 0;
    for (; started < num_threads; started++)
        if (pthread_create(&threads[started], NULL, fn, arg) != 0) break;
    failed |= fn(arg) != NULL;
    for (int i = 1; i < started; i++) {
        void *r;
        pthread_join(threads[i], &r);
        failed |= r != NULL;
    }
    return failed;
#endif
}

/* num_threads cut to what `work` multiply-adds are worth (MIN_WORK_PER_THREAD each), 1-64. */
static int threads_for(int num_threads, int64_t work) {
    if (num_threads > 1 + work / MIN_WORK_PER_THREAD) num_threads = 1 + work / MIN_WORK_PER_THREAD;
    if (num_threads > 64) num_threads = 64;
    return num_threads < 1 ? 1 : num_threads;
}

/* Returns 0, or 1 when scratch memory could not be allocated. */
int paged_decode_f32(const float *q, const float *k, const float *v, const int64_t *tables,
                     int64_t table_stride, const int64_t *lens, float *out, int num_seqs,
                     int heads, int kv_heads, int head_dim, int block_size, float scale,
                     int num_threads) {
    job_t j = {q, k, v, tables, lens, table_stride, out, num_seqs, heads, kv_heads, head_dim,
               block_size, 0, scale, 1, NULL, NULL};
    int64_t work = 0;  /* multiply-adds of the scores: split only work worth a thread */
    for (int b = 0; b < num_seqs; b++) work += lens[b] * heads * head_dim;
    num_threads = threads_for(num_threads, work);
    if (num_threads <= num_seqs) return run_threads(worker, &j, num_threads);
    /* Fewer sequences than threads: split each sequence's blocks over the threads. */
    j.parts = (num_threads + num_seqs - 1) / num_seqs;
    const size_t items = (size_t)num_seqs * (size_t)j.parts;
    j.part_o = malloc(sizeof(float) * items * (size_t)heads * (size_t)head_dim);
    j.part_ms = malloc(sizeof(float) * items * (size_t)heads * 2);
    int failed = j.part_o == NULL || j.part_ms == NULL;
    if (!failed) failed = run_threads(worker, &j, num_threads);
    if (!failed) merge_parts(&j);
    free(j.part_o);
    free(j.part_ms);
    return failed;
}

/* ---- prefill chunks: causal attention over the whole context, read in place ----------------
   See Note [paged prefill on CPU]. A tile is PF_L query rows on the lanes of one register
   against PF_L keys in PF_L accumulators: 16 with AVX-512, 8 with AVX2 + FMA (16 ymm
   registers). Elsewhere paged_prefill_supported() says 0 and chunks take gather + SDPA. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
typedef struct {
    const float *q, *k, *v;
    const int64_t *blocks;
    float *out;
    int64_t q_row, out_row;
    int n, start, heads, kv_heads, head_dim, block_size, tiles, next;
    float scale;
} pf_job_t;

/* One tile: query rows i0 .. i0 + PF_L - 1 of KV head g, where row i is the chunk's token
   i / G and query head g * G + i % G (G = heads / kv_heads: a KV head's query heads share its
   keys). Q is packed transposed and scaled, qt[d][lane]; the output accumulates transposed in
   ot[d][lane] (both in L1) with a running maximum m and sum l per lane (online softmax). */
static void pf_tile(const pf_job_t *j, int g, int i0, float *qt, float *ot, float *kbuf,
                    float *vbuf) {
    const int D = j->head_dim, G = j->heads / j->kv_heads, bs = j->block_size;
    const int rows = j->n * G;
    float posf[PF_L];
    for (int l = 0; l < PF_L; l++) {
        const int i = i0 + l < rows ? i0 + l : rows - 1;  /* padding lanes repeat the last row */
        posf[l] = (float)(j->start + i / G);
        const float *qr = j->q + (int64_t)(i / G) * j->q_row + (int64_t)(g * G + i % G) * D;
        for (int d = 0; d < D; d++) qt[d * PF_L + l] = qr[d] * j->scale;
    }
    memset(ot, 0, sizeof(float) * (size_t)D * PF_L);
    const vf pos = V_LOADU(posf);
    const int first = (int)posf[0], last = (int)posf[PF_L - 1];  /* rows ascend */
    const int64_t row = (int64_t)j->kv_heads * D;  /* floats between consecutive slots */
    vf m = V_SET1(-INFINITY), l = V_ZERO();
    for (int p0 = 0; p0 <= last; p0 += PF_L) {
        const float *kb, *vb;
        int64_t stride;
        if (bs % PF_L == 0) {  /* the PF_L keys lie in one block, one slot apart */
            const int64_t slot = j->blocks[p0 / bs] * bs + p0 % bs;
            kb = j->k + slot * row + (int64_t)g * D;
            vb = j->v + slot * row + (int64_t)g * D;
            stride = row;
        } else {  /* other block sizes: copy them out (a key past `last` reads key 0, masked) */
            for (int t = 0; t < PF_L; t++) {
                const int p = p0 + t <= last ? p0 + t : 0;
                const int64_t slot = j->blocks[p / bs] * bs + p % bs;
                memcpy(kbuf + t * D, j->k + slot * row + (int64_t)g * D, sizeof(float) * D);
                memcpy(vbuf + t * D, j->v + slot * row + (int64_t)g * D, sizeof(float) * D);
            }
            kb = kbuf, vb = vbuf, stride = D;
        }
        vf s[PF_L];  /* s[t][lane] = q(lane) . k(p0 + t) */
        for (int t = 0; t < PF_L; t++) s[t] = V_ZERO();
        for (int d = 0; d < D; d++) {
            const vf qd = V_LOAD(qt + d * PF_L);
            for (int t = 0; t < PF_L; t++) s[t] = V_FMA(qd, V_SET1(kb[t * stride + d]), s[t]);
        }
        const int causal = p0 + PF_L - 1 > first;  /* some key after some row's position */
        vmask keep[PF_L];
        vf bm = V_SET1(-INFINITY);
        for (int t = 0; t < PF_L; t++) {
            keep[t] = causal ? v_le(V_SET1((float)(p0 + t)), pos) : v_all();
            bm = v_mask_max(bm, keep[t], s[t]);
        }
        const vf mn = V_MAX(m, bm);  /* finite: key 0 is in every row's context */
        const vf alpha = v_exp(V_SUB(m, mn));
        vf sum = V_ZERO();
        for (int t = 0; t < PF_L; t++) {
            s[t] = v_maskz(keep[t], v_exp(V_SUB(s[t], mn)));
            sum = V_ADD(sum, s[t]);
        }
        l = V_FMA(l, alpha, sum);
        m = mn;
        for (int d = 0; d < D; d++) {
            vf o = V_MUL(V_LOAD(ot + d * PF_L), alpha);
            for (int t = 0; t < PF_L; t++) o = V_FMA(s[t], V_SET1(vb[t * stride + d]), o);
            V_STORE(ot + d * PF_L, o);
        }
    }
    float inv[PF_L];
    V_STOREU(inv, V_DIV(V_SET1(1.0f), l));
    for (int r = 0; r < PF_L && i0 + r < rows; r++) {
        const int i = i0 + r;
        float *o = j->out + (int64_t)(i / G) * j->out_row + (int64_t)(g * G + i % G) * D;
        for (int d = 0; d < D; d++) o[d] = ot[d * PF_L + r] * inv[r];
    }
}

static void *pf_worker(void *arg) {
    pf_job_t *j = (pf_job_t *)arg;
    const size_t D = (size_t)j->head_dim;
    float *buf = aligned_alloc(64, sizeof(float) * D * 4 * PF_L);
    if (buf == NULL) return (void *)1;
    for (;;) {
        const int it = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (it >= j->tiles * j->kv_heads) break;
        const int tile = j->tiles - 1 - it / j->kv_heads;  /* the longest (last rows') first */
        pf_tile(j, it % j->kv_heads, tile * PF_L, buf, buf + D * PF_L, buf + 2 * D * PF_L,
                buf + 3 * D * PF_L);
    }
    free(buf);
    return NULL;
}

/* Query rows per tile: 16 (AVX-512), 8 (AVX2); 0 where the kernel is not built. */
int paged_prefill_supported(void) { return PF_L; }

/* Causal attention of one prefill chunk, tokens at positions start .. start + n - 1, over keys
   0 .. start + n - 1 read from the paged cache where they lie (the chunk's own K/V already
   written there). q: [n, heads, head_dim], rows q_row floats apart; out likewise (out_row).
   Returns 0, 1 when scratch memory could not be allocated, 2 where unsupported. */
int paged_prefill_f32(const float *q, int64_t q_row, const float *k, const float *v,
                      const int64_t *blocks, float *out, int64_t out_row, int n, int start,
                      int heads, int kv_heads, int head_dim, int block_size, float scale,
                      int num_threads) {
    const int tiles = (n * (heads / kv_heads) + PF_L - 1) / PF_L;
    pf_job_t j = {q, k, v, blocks, out, q_row, out_row, n, start, heads, kv_heads, head_dim,
                  block_size, tiles, 0, scale};
    const int64_t work = (int64_t)n * heads * head_dim * (start + n);  /* multiply-adds, x2 */
    const int items = tiles * kv_heads;  /* no more threads than tiles */
    return run_threads(pf_worker, &j, threads_for(num_threads < items ? num_threads : items, work));
}
#else
int paged_prefill_supported(void) { return 0; }
int paged_prefill_f32(const float *q, int64_t q_row, const float *k, const float *v,
                      const int64_t *blocks, float *out, int64_t out_row, int n, int start,
                      int heads, int kv_heads, int head_dim, int block_size, float scale,
                      int num_threads) {
    return 2;
}
#endif
