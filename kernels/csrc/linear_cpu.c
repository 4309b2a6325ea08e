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
 * Rows of W are split over OpenMP threads (torch's runtime: kernels/native_cpu.py). */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

static inline f32x8 widen8(const uint16_t *p) { /* 8 bf16 -> 8 fp32: the bits moved to the high half */
#if defined(__AVX2__)
    /* One zero-extending load (vpmovzxwd ymm, m128): GCC 12 lowers the generic conversion below to two
     * 128-bit extensions, a byte shift and an insert, four shuffle-port instructions for 8 weights. */
    return (f32x8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    u16x8 h;
    memcpy(&h, p, sizeof h);
    const u32x8 w = __builtin_convertvector(h, u32x8) << 16;
    f32x8 f;
    memcpy(&f, &w, sizeof f);
    return f;
#endif
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

/* One weight row at a time against all M input rows: each thread walks its contiguous share of W as one
 * stream, prefetching PREFETCH_AHEAD bytes ahead into L2 one cache line per line consumed. The previous
 * layout (R = 1-4 rows together, the next group's bytes prefetched in one burst into L1) streamed the 55M
 * Llama's weights at 16-19 GB/s where a read-only sum reaches 26-29; this one reaches 23-27 (1-3 rows, 2
 * threads, weights evicted; docs/PERFORMANCE.md "Session 14"). Only AVX2 builds use it, for 7-8 rows with U = 1
 * accumulator (in pairs their 14-16 accumulators would spill AVX2's 16 vector registers); one row runs in four
 * streams (FOUR_STREAMS, below; AVX-512: FOUR_STREAMS16, above), every other case in pairs of weight rows (PAIR_ROWS).
 * Prefetching gains 1.2-1.7x at 2-8 rows; one row streams faster on the hardware's own prefetchers (sessions 29,
 * 43). */
/* Past one input row a vector's lanes are summed as a tree of halves (lanes i and i + L/2 first), not one
 * after another: the serial lane-order sum of the 2M accumulators cost ~14% of a 5-row product at K = 256 (the
 * shipped model's four layer linears, 2 threads: 5 rows 90.9 -> 78.2 us, 8 rows 119.1 -> 100.0); one row keeps
 * the serial sum in AVX2 builds (FOUR_STREAMS; the tree made batch-1 decode ~4% slower there), AVX-512's
 * FOUR_STREAMS16 sums as a tree. One fixed order per output either way, whatever the thread count. */
typedef float f32x4 __attribute__((vector_size(16)));

#define LANE_SUM(L)                                                                                           \
    static inline float lsum##L(const f32x##L v) {                                                            \
        float s = 0.f;                                                                                        \
        for (int i = 0; i < L; i++) s += v[i];                                                                \
        return s;                                                                                             \
    }
LANE_SUM(8)

static inline float hsum4(f32x4 v) { return (v[0] + v[2]) + (v[1] + v[3]); }

static inline float hsum8(f32x8 v) {
    f32x4 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    return hsum4(lo + hi);
}

#define PREFETCH_AHEAD 4096
#define PREFETCH_LOCALITY 2 /* prefetcht1 (L2): beat 0 (nta, 1.4x slower) and 3 (t0) at 1-3 rows */

#define STREAM_ROWS(NAME, T, WIDEN8, WIDEN1, M, U)                                                            \
    static void NAME##_rows_##M(const float *x, const T *w, int64_t K, float *y, int64_t N, int64_t n0,       \
                                int64_t n1, const float *bias) {                                              \
        const int64_t ahead = PREFETCH_AHEAD / (int64_t)sizeof(T), step = 8 * U;                              \
        for (int64_t n = n0; n < n1; n++) {                                                                   \
            const T *row = w + n * K;                                                                         \
            f32x8 acc[M][U];                                                                                  \
            for (int m = 0; m < M; m++)                                                                       \
                for (int u = 0; u < U; u++) acc[m][u] = (f32x8){0};                                          \
            int64_t k = 0;                                                                                    \
            for (; k + step <= K; k += step) {                                                                \
                for (int64_t b = 0; b < step * (int64_t)sizeof(T); b += 64)                                   \
                    __builtin_prefetch((const char *)(row + k + ahead) + b, 0, PREFETCH_LOCALITY);            \
                for (int u = 0; u < U; u++) {                                                                 \
                    const f32x8 wv = WIDEN8(row + k + 8 * u);                                                 \
                    for (int m = 0; m < M; m++) acc[m][u] += wv * load8f(x + m * K + k + 8 * u);             \
                }                                                                                             \
            }                                                                                                 \
            const int64_t tail8 = k + (K - k) / 8 * 8;                                                        \
            for (int m = 0; m < M; m++) {                                                                     \
                f32x8 a = acc[m][0];                                                                          \
                for (int u = 1; u < U; u++) a += acc[m][u];                                                   \
                for (int64_t j = k; j < tail8; j += 8) a += WIDEN8(row + j) * load8f(x + m * K + j);         \
                float s = 0.f;                                                                                \
                for (int i = 0; i < 8; i++) s += a[i];                                                        \
                for (int64_t j = tail8; j < K; j++) s += x[m * K + j] * WIDEN1(row[j]);                       \
                y[m * N + n] = s + (bias ? bias[n] : 0.f);                                                    \
            }                                                                                                 \
        }                                                                                                     \
    }
/* Two weight rows at a time against all M input rows, in vectors of L lanes (8: AVX2; 16: AVX-512): each
 * input vector loaded once feeds both rows' FMAs, and the 2M accumulators are enough independent chains to
 * hide the FMA latency that one row's M left exposed. 8 lanes against one row at a time, the shipped
 * model's four layer linears, bf16 weights, 2 threads, six layers' weights rotating (docs/PERFORMANCE.md
 * "Session 19"): 4 rows 99 -> 80 us, 5 rows 110 -> 88, 6 rows 121 -> 96, 8 rows 140 -> 118; 16 lanes against
 * 8 ("Session 24"): 1 row 50.4 -> 45.3 us, 5 rows 91.0 -> 80.8, the model's batch-1 decode 1088-1105 ->
 * 1143-1165 tok/s. The two rows of a pair come from the two halves of the thread's share, two read streams
 * (adjacent rows were one): weights past L3 (the 55M Llama's linears, 2 threads, session 39) fp32 2 rows
 * 1.27x, 3 rows 1.53x, bf16 1.22x; the shipped model's, in L3, unchanged (0.99-1.00x). An odd last weight row
 * is paired with itself (computed twice, stored once), so every (m, n) sum runs in one order — L lanes along K,
 * their sum as a tree (hsum), then the tail — whichever rows a thread's share pairs: a different thread count
 * (ThreadBackoff) never changes a bit. */
#define PAIR_ROWS(NAME, T, V, L, WIDENV, LOADV, WIDEN1, M)                                                    \
    static void NAME##_pairs##L##_##M(const float *x, const T *w, int64_t K, float *y, int64_t N, int64_t n0, \
                                      int64_t n1, const float *bias) {                                        \
        const int64_t ahead = PREFETCH_AHEAD / (int64_t)sizeof(T), kv = K / L * L;                            \
        const int64_t half = (n1 - n0 + 1) / 2;                                                              \
        for (int64_t i = 0; i < half; i++) {                                                                  \
            const int64_t n = n0 + i, nb = n0 + half + i;                                                     \
            const int two = nb < n1;                                                                          \
            const T *r0 = w + n * K, *r1 = two ? w + nb * K : r0;                                             \
            V a0[M], a1[M];                                                                                   \
            for (int m = 0; m < M; m++) a0[m] = a1[m] = (V){0};                                              \
            for (int64_t k = 0; k < kv; k += L) {                                                             \
                if ((k * (int64_t)sizeof(T)) % 64 == 0) {                                                     \
                    __builtin_prefetch((const char *)(r0 + k + ahead), 0, PREFETCH_LOCALITY);                 \
                    __builtin_prefetch((const char *)(r1 + k + ahead), 0, PREFETCH_LOCALITY);                 \
                }                                                                                             \
                const V w0 = WIDENV(r0 + k), w1 = WIDENV(r1 + k);                                             \
                for (int m = 0; m < M; m++) {                                                                 \
                    const V xv = LOADV(x + m * K + k);                                                        \
                    a0[m] += w0 * xv;                                                                         \
                    a1[m] += w1 * xv;                                                                         \
                }                                                                                             \
            }                                                                                                 \
            for (int m = 0; m < M; m++) {                                                                     \
                float s0 = hsum##L(a0[m]), s1 = hsum##L(a1[m]); /* M >= 2: one row is FOUR_STREAMS(16)'s */     \
                for (int64_t j = kv; j < K; j++) s0 += x[m * K + j] * WIDEN1(r0[j]), s1 += x[m * K + j] * WIDEN1(r1[j]); \
                y[m * N + n] = s0 + (bias ? bias[n] : 0.f);                                                   \
                if (two) y[m * N + nb] = s1 + (bias ? bias[nb] : 0.f);                                        \
            }                                                                                                 \
        }                                                                                                     \
    }
#if defined(__AVX512F__)
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));


static inline float hsum16(f32x16 v) {
    f32x8 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    return hsum8(lo + hi);
}

static inline f32x16 widen16(const uint16_t *p) {
    u16x16 h;
    memcpy(&h, p, sizeof h);
    const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    f32x16 f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline f32x16 load16f(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

#define PAIRS16(NAME, T, WIDEN16, WIDEN1)                                                                     \
    PAIR_ROWS(NAME, T, f32x16, 16, WIDEN16, load16f, WIDEN1, 2)                                              \
    PAIR_ROWS(NAME, T, f32x16, 16, WIDEN16, load16f, WIDEN1, 3)                                              \
    PAIR_ROWS(NAME, T, f32x16, 16, WIDEN16, load16f, WIDEN1, 4)                                              \
    PAIR_ROWS(NAME, T, f32x16, 16, WIDEN16, load16f, WIDEN1, 5)                                              \
    PAIR_ROWS(NAME, T, f32x16, 16, WIDEN16, load16f, WIDEN1, 6)                                              \
    PAIR_ROWS(NAME, T, f32x16, 16, WIDEN16, load16f, WIDEN1, 7)                                              \
    PAIR_ROWS(NAME, T, f32x16, 16, WIDEN16, load16f, WIDEN1, 8)
PAIRS16(bf16w, uint16_t, widen16, widen1)
PAIRS16(f32w, float, load16f, load1w)
#undef PAIRS16
/* One input row in 16 lanes against four weight rows at a time, one from each quarter of the thread's share (four
 * read streams), without software prefetch: the AVX2 build's FOUR_STREAMS (below) in 16 lanes. The two-row pairs
 * above, which prefetch ahead, read the 55M Llama's fp32 weights (156 MB, one row, 2 threads, AVX-512 EPYC,
 * 150 alternations with torch's own sum over the same bytes; docs/PERFORMANCE.md, session 43) at 30.2 GB/s
 * median where torch's sum read 33.3 and four streams read 33.8. Each row sums in one order (16 lanes along K,
 * their tree sum, the scalar tail), in a group of four or alone, so no thread count changes a bit. */
#define FOUR_STREAMS16(NAME, T, WIDEN16, WIDEN1)                                                              \
    static inline float NAME##_finish16(f32x16 a, const float *x, const T *r, int64_t k16, int64_t K) {       \
        float s = hsum16(a);                                                                                  \
        for (int64_t k = k16; k < K; k++) s += x[k] * WIDEN1(r[k]);                                          \
        return s;                                                                                             \
    }                                                                                                         \
    static void NAME##_streams4_16(const float *x, const T *w, int64_t K, float *y, int64_t N, int64_t n0,   \
                                   int64_t n1, const float *bias) {                                           \
        (void)N;                                                                                              \
        const int64_t q = (n1 - n0) / 4, k16 = K / 16 * 16;                                                   \
        for (int64_t i = 0; i < q; i++) {                                                                     \
            const T *r[4];                                                                                    \
            f32x16 a[4];                                                                                      \
            for (int j = 0; j < 4; j++) r[j] = w + (n0 + j * q + i) * K, a[j] = (f32x16){0};                 \
            for (int64_t k = 0; k < k16; k += 16) {                                                           \
                const f32x16 xv = load16f(x + k);                                                             \
                for (int j = 0; j < 4; j++) a[j] += WIDEN16(r[j] + k) * xv;                                   \
            }                                                                                                 \
            for (int j = 0; j < 4; j++)                                                                       \
                y[n0 + j * q + i] = NAME##_finish16(a[j], x, r[j], k16, K) + (bias ? bias[n0 + j * q + i] : 0.f); \
        }                                                                                                     \
        for (int64_t n = n0 + 4 * q; n < n1; n++) { /* the rows left over, one at a time, in the same order */  \
            const T *row = w + n * K;                                                                         \
            f32x16 a = {0};                                                                                   \
            for (int64_t k = 0; k < k16; k += 16) a += WIDEN16(row + k) * load16f(x + k);                     \
            y[n] = NAME##_finish16(a, x, row, k16, K) + (bias ? bias[n] : 0.f);                               \
        }                                                                                                     \
    }
FOUR_STREAMS16(bf16w, uint16_t, widen16, widen1)
FOUR_STREAMS16(f32w, float, load16f, load1w)
#undef FOUR_STREAMS16
#else
#define STREAMS(NAME, T, WIDEN8, WIDEN1)                                                                      \
    STREAM_ROWS(NAME, T, WIDEN8, WIDEN1, 7, 1) STREAM_ROWS(NAME, T, WIDEN8, WIDEN1, 8, 1)
/* One input row against four weight rows at a time, one from each quarter of the thread's share of W: four
 * sequential read streams in flight where one row at a time kept one, so more of the memory's parallelism is
 * used. The 55M Llama's 33 linears + lm_head, one row, 2 threads, weights in 2 MiB pages (docs/PERFORMANCE.md,
 * session 39): fp32 24.6-27.5 -> 28.8-38.6 GB/s (1.17-1.36x; torch's own sum over the same bytes, the read
 * limit bench.peer_vllm divides by, 27-31), the same shapes in bf16 1.38-1.41x; the shipped model's bf16
 * weights, which sit in L3, neither gain nor lose (0.98-1.02x). Every row is summed in one order (two 8-lane
 * accumulators along K in 16s, their sum, the 8-wide tail, the lanes in turn, the scalar tail), in a group of
 * four or alone (the rows a share leaves over), so no thread count changes a bit. */
#define FOUR_STREAMS(NAME, T, WIDEN8, WIDEN1)                                                                 \
    static inline float NAME##_finish1(f32x8 a, const float *x, const T *r, int64_t k16, int64_t K) {         \
        const int64_t k8 = K / 8 * 8;                                                                         \
        for (int64_t k = k16; k < k8; k += 8) a += WIDEN8(r + k) * load8f(x + k);                            \
        float s = lsum8(a);                                                                                   \
        for (int64_t k = k8; k < K; k++) s += x[k] * WIDEN1(r[k]);                                           \
        return s;                                                                                             \
    }                                                                                                         \
    static void NAME##_streams4(const float *x, const T *w, int64_t K, float *y, int64_t N, int64_t n0,      \
                                int64_t n1, const float *bias) {                                              \
        (void)N;                                                                                              \
        const int64_t q = (n1 - n0) / 4, k16 = K / 16 * 16;                                                   \
        for (int64_t i = 0; i < q; i++) {                                                                     \
            const T *r[4];                                                                                    \
            f32x8 a0[4], a1[4];                                                                               \
            for (int j = 0; j < 4; j++) r[j] = w + (n0 + j * q + i) * K, a0[j] = a1[j] = (f32x8){0};          \
            for (int64_t k = 0; k < k16; k += 16) {                                                           \
                const f32x8 x0 = load8f(x + k), x1 = load8f(x + k + 8);                                       \
                for (int j = 0; j < 4; j++) a0[j] += WIDEN8(r[j] + k) * x0, a1[j] += WIDEN8(r[j] + k + 8) * x1; \
            }                                                                                                 \
            for (int j = 0; j < 4; j++)                                                                       \
                y[n0 + j * q + i] = NAME##_finish1(a0[j] + a1[j], x, r[j], k16, K) + (bias ? bias[n0 + j * q + i] : 0.f); \
        }                                                                                                     \
        for (int64_t n = n0 + 4 * q; n < n1; n++) { /* the rows left over, one at a time, in the same order */  \
            const T *row = w + n * K;                                                                         \
            f32x8 a0 = {0}, a1 = {0};                                                                         \
            for (int64_t k = 0; k < k16; k += 16) {                                                           \
                a0 += WIDEN8(row + k) * load8f(x + k);                                                        \
                a1 += WIDEN8(row + k + 8) * load8f(x + k + 8);                                                \
            }                                                                                                 \
            y[n] = NAME##_finish1(a0 + a1, x, row, k16, K) + (bias ? bias[n] : 0.f);                          \
        }                                                                                                     \
    }
#define PAIRS8(NAME, T, WIDEN8, WIDEN1)                                                                       \
    PAIR_ROWS(NAME, T, f32x8, 8, WIDEN8, load8f, WIDEN1, 2) PAIR_ROWS(NAME, T, f32x8, 8, WIDEN8, load8f, WIDEN1, 3) \
    PAIR_ROWS(NAME, T, f32x8, 8, WIDEN8, load8f, WIDEN1, 4) PAIR_ROWS(NAME, T, f32x8, 8, WIDEN8, load8f, WIDEN1, 5) \
    PAIR_ROWS(NAME, T, f32x8, 8, WIDEN8, load8f, WIDEN1, 6)
STREAMS(bf16w, uint16_t, widen8, widen1)
STREAMS(f32w, float, load8w, load1w)
FOUR_STREAMS(bf16w, uint16_t, widen8, widen1)
FOUR_STREAMS(f32w, float, load8w, load1w)
PAIRS8(bf16w, uint16_t, widen8, widen1)
PAIRS8(f32w, float, load8w, load1w)
#undef STREAMS
#undef PAIRS8
#endif
#undef STREAM_ROWS

int omp_get_thread_num(void);
int omp_get_num_threads(void);

/* Threads only for a weight big enough to pay for waking them (64k elements); each takes one contiguous
 * share of W's rows. */
#define RUN_ROWS(FN, M)                                                                                       \
    case M:                                                                                                   \
        if (num_threads > 1 && N * K >= 65536) {                                                              \
            _Pragma("omp parallel num_threads(num_threads)") {                                               \
                const int64_t share = (N + omp_get_num_threads() - 1) / omp_get_num_threads();               \
                const int64_t a = omp_get_thread_num() * share, b = a + share < N ? a + share : N;            \
                if (a < b) FN(x, w, K, y, N, a, b, bias);                                                     \
            }                                                                                                 \
        } else {                                                                                              \
            FN(x, w, K, y, N, 0, N, bias);                                                                    \
        }                                                                                                     \
        return 0;
#if defined(__AVX512F__)
#define DISPATCH(NAME)                                                                                        \
    switch (M) {                                                                                              \
        RUN_ROWS(NAME##_streams4_16, 1) RUN_ROWS(NAME##_pairs16_2, 2) RUN_ROWS(NAME##_pairs16_3, 3)            \
        RUN_ROWS(NAME##_pairs16_4, 4) RUN_ROWS(NAME##_pairs16_5, 5) RUN_ROWS(NAME##_pairs16_6, 6)            \
        RUN_ROWS(NAME##_pairs16_7, 7) RUN_ROWS(NAME##_pairs16_8, 8)                                          \
    }                                                                                                         \
    return -1;
#else
#define DISPATCH(NAME)                                                                                        \
    switch (M) {                                                                                              \
        RUN_ROWS(NAME##_streams4, 1) RUN_ROWS(NAME##_pairs8_2, 2) RUN_ROWS(NAME##_pairs8_3, 3)                 \
        RUN_ROWS(NAME##_pairs8_4, 4) RUN_ROWS(NAME##_pairs8_5, 5) RUN_ROWS(NAME##_pairs8_6, 6)               \
        RUN_ROWS(NAME##_rows_7, 7) RUN_ROWS(NAME##_rows_8, 8)                                                \
    }                                                                                                         \
    return -1;
#endif

static int rows_bf16w(const float *x, const uint16_t *w, const float *bias, float *y, int64_t M, int64_t N,
                      int64_t K, int num_threads) {
    DISPATCH(bf16w)
}

static int rows_f32w(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                     int num_threads) {
    DISPATCH(f32w)
}

/* Both return 0, or -1 for M < 1 (the caller then uses oneDNN). Up to 8 rows in one pass over the weights
 * (their accumulators fit the vector registers, see PAIR_ROWS): a batch-1 speculative
 * verification reads each weight once for its k + 1 rows. Shipped model's 25 linears,
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
