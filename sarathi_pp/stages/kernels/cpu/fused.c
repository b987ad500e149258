/* fused.c: see fused.py (how it is built, loaded and called, and its Notes). */
#include "exp_f.h"
#include <math.h>
#include <stdint.h>

/* Below this many elements one thread does the loop (a fork-join costs more). */
#define PARALLEL_MIN (1 << 16)

/* out[r] = w * (v * rsqrt(mean(v^2) + eps)) with v = x[r] (+ delta[r], stored to sum[r] when
   delta is given): RMSNorm, optionally after the residual add. Rows of `cols` floats;
   x_stride, out and sum rows contiguous. */
void rms_norm_f32(const float *x, int64_t x_stride, const float *delta, float *sum,
                  const float *w, float *out, int64_t rows, int64_t cols, float eps,
                  int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if(rows * cols >= PARALLEL_MIN && num_threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * cols;
        const float *v = xr;
        if (delta) {
            const float *d = delta + r * cols;
            float *s = sum + r * cols;
            #pragma omp simd
            for (int64_t c = 0; c < cols; c++) s[c] = xr[c] + d[c];
            v = s;
        }
        float ss = 0.0f;
        #pragma omp simd reduction(+:ss)
        for (int64_t c = 0; c < cols; c++) ss += v[c] * v[c];
        const float inv = 1.0f / sqrtf(ss / (float)cols + eps);
        #pragma omp simd
        for (int64_t c = 0; c < cols; c++) o[c] = w[c] * (v[c] * inv);
    }
}

/* In place on x [rows, heads, head_dim] (heads and head_dim contiguous, rows x_stride apart):
   x * cos + rotate_half(x) * sin, cos/sin rows [head_dim] of the tables at each row's position.
   Returns 0, or 1 when a position is outside [0, max_positions). */
int rotary_f32(float *x, int64_t x_stride, int64_t rows, int heads, int head_dim,
               const float *cos_t, const float *sin_t, const int64_t *positions,
               int64_t max_positions, int num_threads) {
    for (int64_t r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= max_positions) return 1;
    const int half = head_dim / 2;
    #pragma omp parallel for num_threads(num_threads) if(rows * heads * head_dim >= PARALLEL_MIN && num_threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_t + positions[r] * head_dim, *s = sin_t + positions[r] * head_dim;
        for (int h = 0; h < heads; h++) {
            float *a = x + r * x_stride + (int64_t)h * head_dim, *b = a + half;
            #pragma omp simd
            for (int j = 0; j < half; j++) {
                const float x1 = a[j], x2 = b[j];
                a[j] = x1 * c[j] + (-x2) * s[j];
                b[j] = x2 * c[j + half] + x1 * s[j + half];
            }
        }
    }
    return 0;
}

/* out [rows, inter] = silu(gate) * up, gate_up [rows, 2 * inter] = [gate | up] per row. */
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter,
                  int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if(rows * inter >= PARALLEL_MIN && num_threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        #pragma omp simd
        for (int64_t c = 0; c < inter; c++) o[c] = g[c] / (1.0f + exp_f(-g[c])) * u[c];
    }
}
