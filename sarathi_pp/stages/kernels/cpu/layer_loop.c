/* layer_loop.c: see layer_loop.py (how it is built, loaded and called, and its Notes). */
#include <stdint.h>
#include <string.h>

typedef int (*gemm_fn)(const float *, int64_t, int64_t, const float *, int64_t, float *, int);
typedef void (*rms_fn)(const float *, int64_t, const float *, float *, const float *, float *,
                       int64_t, int64_t, float, int);
typedef int (*rot_fn)(float *, int64_t, int64_t, int, int, const float *, const float *,
                      const int64_t *, int64_t, int);
typedef void (*silu_fn)(const float *, float *, int64_t, int64_t, int);
typedef int (*decode_fn)(const float *, const float *, const float *, const int64_t *, int64_t,
                         const int64_t *, float *, int, int, int, int, int, float, int);
typedef int (*prefill_fn)(const float *, int64_t, const float *, const float *, const int64_t *,
                          float *, int64_t, int, int, int, int, int, int, float, int);

typedef struct {
    gemm_fn gemm; rms_fn rms; rot_fn rot; silu_fn silu; decode_fn decode; prefill_fn prefill;
} kernels_t;

typedef struct {  /* one decoder layer: its weights (linears packed for gemm) and K/V cache */
    const float *ln1, *ln2, *qkv, *qkv_bias, *o, *gate_up, *down;
    float *k_cache, *v_cache;
} layer_t;

typedef struct {
    int64_t hidden, inter;
    int heads, kv_heads, head_dim, block_size;
    float eps, scale;
    const float *cos, *sin;
    int64_t max_positions;
} dims_t;

typedef struct {  /* the micro-batch's rows: prefill chunks first, then one row per decode */
    int64_t rows;
    const int64_t *positions, *slots;
    int64_t num_prefills;
    const int64_t *prefill_row, *prefill_len, *prefill_start;
    const int64_t *const *prefill_blocks;
    int64_t num_decodes;
    const int64_t *decode_tables;
    int64_t decode_stride;
    const int64_t *decode_lens;
} batch_t;

/* x [rows, hidden] <- the layers applied to it, in place. ws: rows x ws_floats() floats of
   scratch (ws_floats in Python sums the buffers laid out below). Returns 0; 1 when a kernel
   could not allocate its scratch memory; 2 when a position is outside the rotary tables; 3
   when a kernel the rows need is missing. */
int layer_loop_f32(const kernels_t *kn, const layer_t *layers, int num_layers, const dims_t *d,
                   const batch_t *b, float *x, float *ws, int nt) {
    const int64_t R = b->rows, H = d->hidden, I = d->inter;
    const int64_t Q = (int64_t)d->heads * d->head_dim, KV = (int64_t)d->kv_heads * d->head_dim;
    const int64_t QKV = Q + 2 * KV;
    float *h = ws, *qkv = h + R * H, *qc = qkv + R * QKV, *att = qc + R * Q, *o = att + R * Q;
    float *gu = o + R * H, *act = gu + R * 2 * I, *dn = act + R * I;
    const int64_t dec0 = R - b->num_decodes;
    if (b->num_prefills && kn->prefill == NULL) return 3;
    if (b->num_decodes && kn->decode == NULL) return 3;
    for (int l = 0; l < num_layers; l++) {
        const layer_t *L = layers + l;
        kn->rms(x, H, NULL, NULL, L->ln1, h, R, H, d->eps, nt);
        if (kn->gemm(h, R, H, L->qkv, QKV, qkv, nt)) return 1;
        if (L->qkv_bias)
            for (int64_t r = 0; r < R; r++)
                for (int64_t c = 0; c < QKV; c++) qkv[r * QKV + c] += L->qkv_bias[c];
        if (kn->rot(qkv, QKV, R, d->heads, d->head_dim, d->cos, d->sin, b->positions,
                    d->max_positions, nt)) return 2;
        if (kn->rot(qkv + Q, QKV, R, d->kv_heads, d->head_dim, d->cos, d->sin, b->positions,
                    d->max_positions, nt)) return 2;
        for (int64_t r = 0; r < R; r++) {  /* this step's K/V into the cache */
            memcpy(L->k_cache + b->slots[r] * KV, qkv + r * QKV + Q, sizeof(float) * KV);
            memcpy(L->v_cache + b->slots[r] * KV, qkv + r * QKV + Q + KV, sizeof(float) * KV);
        }
        for (int64_t p = 0; p < b->num_prefills; p++) {
            const int64_t r0 = b->prefill_row[p];
            if (kn->prefill(qkv + r0 * QKV, QKV, L->k_cache, L->v_cache, b->prefill_blocks[p],
                            att + r0 * Q, Q, (int)b->prefill_len[p], (int)b->prefill_start[p],
                            d->heads, d->kv_heads, d->head_dim, d->block_size, d->scale, nt))
                return 1;
        }
        if (b->num_decodes) {  /* the decode kernel reads q contiguous */
            for (int64_t r = dec0; r < R; r++) memcpy(qc + (r - dec0) * Q, qkv + r * QKV, sizeof(float) * Q);
            if (kn->decode(qc, L->k_cache, L->v_cache, b->decode_tables, b->decode_stride,
                           b->decode_lens, att + dec0 * Q, (int)b->num_decodes, d->heads,
                           d->kv_heads, d->head_dim, d->block_size, d->scale, nt))
                return 1;
        }
        if (kn->gemm(att, R, Q, L->o, H, o, nt)) return 1;
        kn->rms(x, H, o, x, L->ln2, h, R, H, d->eps, nt);  /* x += o; h = norm(x) */
        if (kn->gemm(h, R, H, L->gate_up, 2 * I, gu, nt)) return 1;
        kn->silu(gu, act, R, I, nt);
        if (kn->gemm(act, R, I, L->down, H, dn, nt)) return 1;
        for (int64_t i = 0; i < R * H; i++) x[i] += dn[i];
    }
    return 0;
}
