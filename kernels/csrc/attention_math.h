/* The arithmetic of paged decode attention (kernels/csrc/paged_decode_cpu.c) over one tile of keys: dot
 * products, the online softmax's max / exp / sum, and P·V with the accumulators in registers. Static inline,
 * for that one file; kept apart so the kernel's own file is the tiling, the reads and the threads. */
#ifndef TANDEM_ATTENTION_MATH_H
#define TANDEM_ATTENTION_MATH_H
#include <stdint.h>
#include <string.h>

#include "exp_approx.h"

#if defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>
#endif

typedef float vec8 __attribute__((vector_size(32))); /* GCC/Clang vector extension: AVX2 on x86, 2x NEON on Arm */

static inline vec8 load8(const float *p) {
    vec8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum8(vec8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

static inline float dot(const float *q, const float *k, const int D) {
    vec8 s0 = load8(q) * load8(k), s1 = {0}; /* two accumulators: half the FMA latency chain */
    int c = 8;
    for (; c + 16 <= D; c += 16) {
        s1 += load8(q + c) * load8(k + c);
        s0 += load8(q + c + 8) * load8(k + c + 8);
    }
    if (c < D) s1 += load8(q + c) * load8(k + c);
    return hsum8(s0 + s1);
}

/* max(init, x[a..b)) and the sum of x[a..b), 8 lanes at a time: as plain loops GCC keeps them one serial
 * chain of scalar max / add instructions (the sum's `omp simd reduction` included), which was a quarter of
 * this kernel's time (perf, 5 query rows). */
static inline float max_from(const float *x, int a, int b, float init) {
    float mx = init;
    int t = a;
#if defined(__AVX__)
    if (b - a >= 8) {
        __m256 v = _mm256_loadu_ps(x + a);
        for (t = a + 8; t + 8 <= b; t += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + t));
        __m128 w = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        w = _mm_max_ps(w, _mm_movehl_ps(w, w));
        w = _mm_max_ss(w, _mm_movehdup_ps(w));
        const float lanes = _mm_cvtss_f32(w);
        mx = lanes > mx ? lanes : mx;
    }
#endif
    for (; t < b; t++) mx = x[t] > mx ? x[t] : mx;
    return mx;
}

/* x[a..b) = exp(x - mx), 8 lanes at a time: exp_approx's polynomial in AVX2. Without -fno-trapping-math GCC
 * left that loop scalar, the largest part of this kernel's time; with it, its own vectorisation of the loop
 * still took 1.2-1.3x as long as this (5 and 1 query rows over 600 keys, 6 layers: 666 / 310 us vs 548 / 240). */
static inline void exp_shifted(float *x, int a, int b, float mx) {
    int t = a;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 lo = _mm256_set1_ps(-87.f), hi = _mm256_set1_ps(88.f), m = _mm256_set1_ps(mx);
    for (; t + 8 <= b; t += 8) {
        __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(x + t), m), lo), hi);
        const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f),
                                         _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v));
        __m256 y = _mm256_set1_ps(1.9875691500e-4f);
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
        y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(y, r), r, r), _mm256_set1_ps(1.f));
        const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        _mm256_storeu_ps(x + t, _mm256_mul_ps(y, _mm256_castsi256_ps(two_n)));
    }
#endif
    for (; t < b; t++) x[t] = exp_approx(x[t] - mx);
}

static inline float sum_of(const float *x, int a, int b) {
    vec8 v = {0};
    int t = a;
    for (; t + 8 <= b; t += 8) v += load8(x + t);
    float sum = hsum8(v);
    for (; t < b; t++) sum += x[t];
    return sum;
}

/* acc [G, CH * 8] (rows `as` apart) += sum over keys t in [a, b) of p[h][t] * v[t] (p rows BS apart, v rows ks
 * apart), with the G x CH accumulators held in registers for the whole key loop: per key, G broadcasts and CH
 * value loads feed G x CH FMAs, where a slice at a time loads the key's value slice again for every head. */
static inline __attribute__((always_inline)) void pv_tile(float *acc, int64_t as, const float *p, const float *v,
                                                          int64_t ks, int a, int b, int BS, const int G, const int CH) {
    vec8 r[16];
    for (int h = 0; h < G; h++)
        for (int c = 0; c < CH; c++) r[h * CH + c] = load8(acc + h * as + 8 * c);
    for (int t = a; t < b; t++) {
        const float *vt = v + t * ks;
        for (int h = 0; h < G; h++) {
            const float w = p[h * BS + t];
            for (int c = 0; c < CH; c++) r[h * CH + c] += w * load8(vt + 8 * c);
        }
    }
    for (int h = 0; h < G; h++)
        for (int c = 0; c < CH; c++) memcpy(acc + h * as + 8 * c, &r[h * CH + c], sizeof r[0]);
}

/* pv_tile over the whole head (CH = head_dim / 8 slices) for G query heads per KV head: in one pass where the
 * G x CH accumulators fit the registers, else in passes of 8 / G slices (8 accumulators: enough independent
 * FMA chains, where one slice of one head at a time was bound by the FMA latency — 4 heads of 64 over 512
 * keys, 64 sequences, one thread: 3.2 ms of the kernel's 9.3). 0 for a G this does not cover (the caller
 * then works a slice at a time). Each accumulator sums its keys in order, whichever way it is split. */
static inline __attribute__((always_inline)) int pv_in_registers(float *acc, const float *p, const float *v,
                                                                 int64_t ks, int a, int b, int BS, int G, const int CH) {
#define PV(g)                                                                                                 \
    case g:                                                                                                   \
        if ((g) * CH <= 16) {                                                                                 \
            pv_tile(acc, 8 * CH, p, v, ks, a, b, BS, g, CH);                                                  \
        } else {                                                                                              \
            int c = 0;                                                                                        \
            for (; c + 8 / (g) <= CH; c += 8 / (g)) pv_tile(acc + 8 * c, 8 * CH, p, v + 8 * c, ks, a, b, BS, g, 8 / (g)); \
            for (; c < CH; c++) pv_tile(acc + 8 * c, 8 * CH, p, v + 8 * c, ks, a, b, BS, g, 1);              \
        }                                                                                                     \
        return 1;
    switch (G) {
    PV(1) PV(2) PV(4) PV(8)
    default: return 0;
    }
#undef PV
}

/* out[t] = scale * (q . k_t) for the 8 keys k_t = k0 + t * stride: eight vector accumulators reduced
 * together, a transpose by pairwise adds, instead of eight horizontal sums. */
static inline void dots8(const float *q, const float *k0, int64_t stride, const int D, float scale, float *out) {
#if defined(__AVX__) && defined(__FMA__)
    __m256 a[8];
    for (int t = 0; t < 8; t++) a[t] = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k0 + t * stride));
    for (int c = 8; c < D; c += 8) {
        const __m256 qc = _mm256_loadu_ps(q + c);
        for (int t = 0; t < 8; t++) a[t] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k0 + t * stride + c), a[t]);
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    _mm256_storeu_ps(out, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
#else
    for (int t = 0; t < 8; t++) out[t] = dot(q, k0 + t * stride, D) * scale;
#endif
}

#endif
