/* exp(x) in C that vectorises: libm's expf does not without -ffast-math, which the kernels must not
 * use (they rely on -INFINITY). Shared by the kernels in this directory. */
#ifndef TANDEM_EXP_APPROX_H
#define TANDEM_EXP_APPROX_H
#include <math.h>
#include <stdint.h>

/* exp(x) for x in [-87, 88] (clamped): Cephes' expf polynomial after a range reduction by ln 2. */
static inline float exp_approx(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.f;
    union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
    return y * two_n.f;
}

#endif
