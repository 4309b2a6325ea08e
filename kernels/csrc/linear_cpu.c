/* Small-batch linear layers over bf16-stored weights, fp32 arithmetic: y [M, N] = x [M, K] W^T (+ bias),
 * W [N, K] row-major (nn.Linear's layout) in bfloat16, M <= 4.
 *
 * Why: a decode step of a few sequences reads every weight once and does ~M multiply-adds with each, so
 * its time is the bytes of the weights. Most checkpoints are stored in bf16; served in fp32 on a CPU,
 * each of their weights is a bf16 value widened, so keeping the bf16 bits and widening in registers
 * (a shift) gives the very same products from half the bytes. Accumulation is fp32, as in fp32 oneDNN
 * (only the summation order differs). Measured on the shipped model's 25 linears, one row, weights
 * evicted between runs: oneDNN fp32 3.04 ms -> 2.20 ms at 1 thread, 2.10 -> 1.18 ms at 2
 * (docs/PERFORMANCE.md).
 *
 * R weight rows x M input rows are done together, their R*M 8-wide accumulators in registers; rows of W
 * are split over OpenMP threads (torch's runtime: kernels/native_cpu.py).
 */
#include <stdint.h>
#include <string.h>

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

static inline f32x8 widen8(const uint16_t *p) { /* 8 bf16 -> 8 fp32: the bits moved to the high half */
    u16x8 h;
    memcpy(&h, p, sizeof h);
    const u32x8 w = __builtin_convertvector(h, u32x8) << 16;
    f32x8 f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline float widen1(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline f32x8 load8f(const float *p) {
    f32x8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

#define ROWS_BLOCK(M, R)                                                                                      \
    static inline __attribute__((always_inline)) void rows_##M##_##R(const float *x, const uint16_t *w,       \
                                                                      int64_t K, float *y, int64_t N,          \
                                                                      const float *bias) {                     \
        f32x8 acc[R][M];                                                                                       \
        for (int r = 0; r < R; r++)                                                                            \
            for (int m = 0; m < M; m++) acc[r][m] = (f32x8){0};                                                \
        int64_t k = 0;                                                                                         \
        for (; k + 8 <= K; k += 8) {                                                                           \
            f32x8 wv[R];                                                                                       \
            for (int r = 0; r < R; r++) wv[r] = widen8(w + r * K + k);                                         \
            for (int m = 0; m < M; m++) {                                                                      \
                const f32x8 xv = load8f(x + m * K + k);                                                        \
                for (int r = 0; r < R; r++) acc[r][m] += wv[r] * xv;                                          \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < R; r++)                                                                            \
            for (int m = 0; m < M; m++) {                                                                      \
                float s = 0.f;                                                                                 \
                for (int i = 0; i < 8; i++) s += acc[r][m][i];                                                 \
                for (int64_t t = k; t < K; t++) s += x[m * K + t] * widen1(w[r * K + t]);                      \
                y[m * N + r] = s + (bias ? bias[r] : 0.f);                                                     \
            }                                                                                                  \
    }
ROWS_BLOCK(1, 4) ROWS_BLOCK(1, 1)
ROWS_BLOCK(2, 4) ROWS_BLOCK(2, 1)
ROWS_BLOCK(3, 2) ROWS_BLOCK(3, 1)
ROWS_BLOCK(4, 2) ROWS_BLOCK(4, 1)
#undef ROWS_BLOCK

/* The rows a few groups ahead on their way: short rows (256 bf16 = 8 cache lines for the shipped model)
 * give the hardware prefetcher little to learn from, and one thread streamed them at ~5 GB/s without. */
#define PREFETCH_GROUPS 4
static inline void prefetch_rows(const uint16_t *w, int64_t n) {
    for (int64_t i = 0; i < n; i += 32) __builtin_prefetch(w + i, 0, 0);
}

/* Threads only for a weight big enough to pay for waking them (64k elements: 128 KB). */
#define RUN_ROWS(M, R)                                                                                        \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && N * K >= 65536)") \
    for (int64_t g = 0; g < N / R; g++) {                                                                     \
        if (g + PREFETCH_GROUPS < N / R) prefetch_rows(w + (g + PREFETCH_GROUPS) * R * K, R * K);            \
        rows_##M##_##R(x, w + g * R * K, K, y + g * R, N, bias ? bias + g * R : 0);                          \
    }                                                                                                         \
    for (int64_t n = N / R * R; n < N; n++) rows_##M##_1(x, w + n * K, K, y + n, N, bias ? bias + n : 0);

/* Returns 0, or -1 for M outside 1..4 (the caller then uses oneDNN). */
int tandem_linear_bf16w_f32(const float *x, const uint16_t *w, const float *bias, float *y, int64_t M, int64_t N,
                            int64_t K, int num_threads) {
    switch (M) {
    case 1: { RUN_ROWS(1, 4) return 0; }
    case 2: { RUN_ROWS(2, 4) return 0; }
    case 3: { RUN_ROWS(3, 2) return 0; }
    case 4: { RUN_ROWS(4, 2) return 0; }
    }
    return -1;
}
