/* exp_f.h: shared by the CPU kernels that need exp (see build.py). */
/* exp(x) for the kernels' C sources (#include "exp_f.h"): Cephes' expf polynomial, ~1 ulp, and
   unlike libm's expf it vectorises (with -fno-trapping-math: two plain selects for the clamps;
   a nested one stays a branch). Clamped to [-87, 88], where float's exp neither overflows nor
   goes subnormal. */
#pragma once
#include <stdint.h>
static inline float exp_f(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    union { int32_t i; float f; } u = {.i = ((int32_t)n + 127) << 23};
    return y * u.f;
}
