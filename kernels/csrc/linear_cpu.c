/* Small-batch linear layers, fp32 arithmetic: y [M, N] = x [M, K] W^T (+ bias), W [N, K] row-major
 * (nn.Linear's layout), M <= 8 in one pass over W (more: in chunks of 8), W either bf16 bits or fp32.
 *
 * Why: a decode step of a few sequences reads every weight once and does ~M multiply-adds with each, so
 * its time is the bytes of the weights, and what matters is streaming them at the memory's speed.
 * - bf16 weights: most checkpoints are stored in bf16; served in fp32 on a CPU, each of their weights is a
 *   bf16 value widened, so keeping the bf16 bits and widening in registers (a shift) gives the very same
 *   products from half the bytes. Shipped model's 25 linears, one row, weights evicted between runs:
 *   oneDNN fp32 (packed) 2.80 -> 1.16 ms at 1 thread, 2.23 -> 0.68 ms at 2.
 * - fp32 weights: oneDNN's packed kernel streams a 1-3 row product at 11-19 GB/s here; rows blocked in
 *   registers and prefetched ahead stream at 16-26 GB/s (the 55M Llama's 33 linears, one row: 11.9 ->
 *   9.5 ms at 1 thread, 8.5 -> 6.5 ms at 2; at 4 rows oneDNN is as fast, so callers stop at 3).
 * Accumulation is fp32, as in fp32 oneDNN (only the summation order differs). docs/PERFORMANCE.md.
 *
 * R weight rows x M input rows are done together, their R*M 8-wide accumulators in registers; rows of W
 * are split over OpenMP threads (torch's runtime: kernels/native_cpu.py). */
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

static inline f32x8 load8w(const float *p) { return load8f(p); }
static inline float load1w(float v) { return v; }

/* R weight rows times M input rows: R*M 8-wide accumulators in registers. T is the weight's type (uint16_t:
 * bf16 bits, widened; float: as is), WIDEN8/WIDEN1 how its values become fp32. */
#define ROWS_BLOCK(NAME, T, WIDEN8, WIDEN1, M, R)                                                             \
    static inline __attribute__((always_inline)) void NAME##_##M##_##R(const float *x, const T *w, int64_t K, \
                                                                        float *y, int64_t N, const float *bias) { \
        f32x8 acc[R][M];                                                                                       \
        for (int r = 0; r < R; r++)                                                                            \
            for (int m = 0; m < M; m++) acc[r][m] = (f32x8){0};                                                \
        int64_t k = 0;                                                                                         \
        for (; k + 8 <= K; k += 8) {                                                                           \
            f32x8 wv[R];                                                                                       \
            for (int r = 0; r < R; r++) wv[r] = WIDEN8(w + r * K + k);                                         \
            for (int m = 0; m < M; m++) {                                                                      \
                const f32x8 xv = load8f(x + m * K + k);                                                        \
                for (int r = 0; r < R; r++) acc[r][m] += wv[r] * xv;                                          \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < R; r++)                                                                            \
            for (int m = 0; m < M; m++) {                                                                      \
                float s = 0.f;                                                                                 \
                for (int i = 0; i < 8; i++) s += acc[r][m][i];                                                 \
                for (int64_t t = k; t < K; t++) s += x[m * K + t] * WIDEN1(w[r * K + t]);                      \
                y[m * N + r] = s + (bias ? bias[r] : 0.f);                                                     \
            }                                                                                                  \
    }
#define ROWS_BLOCKS(NAME, T, WIDEN8, WIDEN1)                                                                  \
    ROWS_BLOCK(NAME, T, WIDEN8, WIDEN1, 1, 4) ROWS_BLOCK(NAME, T, WIDEN8, WIDEN1, 1, 1)                      \
    ROWS_BLOCK(NAME, T, WIDEN8, WIDEN1, 2, 4) ROWS_BLOCK(NAME, T, WIDEN8, WIDEN1, 2, 1)                      \
    ROWS_BLOCK(NAME, T, WIDEN8, WIDEN1, 3, 2) ROWS_BLOCK(NAME, T, WIDEN8, WIDEN1, 3, 1)                      \
    ROWS_BLOCK(NAME, T, WIDEN8, WIDEN1, 4, 2) ROWS_BLOCK(NAME, T, WIDEN8, WIDEN1, 4, 1)                      \
    ROWS_BLOCK(NAME, T, WIDEN8, WIDEN1, 5, 2) ROWS_BLOCK(NAME, T, WIDEN8, WIDEN1, 5, 1)                      \
    ROWS_BLOCK(NAME, T, WIDEN8, WIDEN1, 6, 2) ROWS_BLOCK(NAME, T, WIDEN8, WIDEN1, 6, 1)                      \
    ROWS_BLOCK(NAME, T, WIDEN8, WIDEN1, 7, 1) ROWS_BLOCK(NAME, T, WIDEN8, WIDEN1, 8, 1)
ROWS_BLOCKS(bf16w, uint16_t, widen8, widen1)
ROWS_BLOCKS(f32w, float, load8w, load1w)
#undef ROWS_BLOCKS
#undef ROWS_BLOCK

/* The rows 4 KB ahead on their way, at least the next group (best of 4-32 KB measured at M = 1..4): short rows (256 bf16 = 8
 * cache lines for the shipped model) give the hardware prefetcher little to learn from, and one thread
 * streamed them at ~5 GB/s without. */
#define PREFETCH_BYTES 4096
static inline void prefetch_bytes(const void *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64) __builtin_prefetch((const char *)p + i, 0, 0);
}

/* Threads only for a weight big enough to pay for waking them (64k elements). */
#define RUN_ROWS(NAME, M, R)                                                                                  \
    {                                                                                                         \
        const int64_t groups = N / R, ahead = 1 + PREFETCH_BYTES / (R * K * (int64_t)sizeof *w);             \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && N * K >= 65536)") \
        for (int64_t g = 0; g < groups; g++) {                                                                \
            if (g + ahead < groups) prefetch_bytes(w + (g + ahead) * R * K, R * K * (int64_t)sizeof *w);     \
            NAME##_##M##_##R(x, w + g * R * K, K, y + g * R, N, bias ? bias + g * R : 0);                    \
        }                                                                                                     \
        for (int64_t n = groups * R; n < N; n++) NAME##_##M##_1(x, w + n * K, K, y + n, N, bias ? bias + n : 0); \
        return 0;                                                                                             \
    }
#define DISPATCH(NAME)                                                                                        \
    switch (M) {                                                                                              \
    case 1: RUN_ROWS(NAME, 1, 4)                                                                              \
    case 2: RUN_ROWS(NAME, 2, 4)                                                                              \
    case 3: RUN_ROWS(NAME, 3, 2)                                                                              \
    case 4: RUN_ROWS(NAME, 4, 2)                                                                              \
    case 5: RUN_ROWS(NAME, 5, 2)                                                                              \
    case 6: RUN_ROWS(NAME, 6, 2)                                                                              \
    case 7: RUN_ROWS(NAME, 7, 1)                                                                              \
    case 8: RUN_ROWS(NAME, 8, 1)                                                                              \
    }                                                                                                         \
    return -1;

static int rows_bf16w(const float *x, const uint16_t *w, const float *bias, float *y, int64_t M, int64_t N,
                      int64_t K, int num_threads) {
    DISPATCH(bf16w)
}

static int rows_f32w(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                     int num_threads) {
    DISPATCH(f32w)
}

/* Both return 0, or -1 for M < 1 (the caller then uses oneDNN). Up to 8 rows in one pass over the weights
 * (R*M accumulators + R weight vectors + 1 input vector fit AVX2's 16 registers up to M = 8, R = 1): a
 * batch-1 speculative verification reads each weight once for its k + 1 rows. Shipped model's 25 linears,
 * 2 threads, weights evicted: 5 rows 1.12-1.13 -> 0.90-0.98 ms, 6 rows 1.14-1.38 -> 0.96-1.00 ms against
 * groups of 4 and the rest (two passes); 9+ rows go 8 at a time. */
#define CHUNKED(FN)                                                                                           \
    if (M < 1) return -1;                                                                                     \
    for (int64_t r = 0; r < M; r += 8)                                                                        \
        if (FN(x + r * K, w, bias, y + r * N, M - r < 8 ? M - r : 8, N, K, num_threads)) return -1;         \
    return 0;

int tandem_linear_bf16w_f32(const float *x, const uint16_t *w, const float *bias, float *y, int64_t M, int64_t N,
                            int64_t K, int num_threads) {
    CHUNKED(rows_bf16w)
}

int tandem_linear_f32w_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                           int64_t K, int num_threads) {
    CHUNKED(rows_f32w)
}
