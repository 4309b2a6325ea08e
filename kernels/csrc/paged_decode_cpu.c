/* Paged decode attention on the CPU, fp32, reading K/V straight from the paged cache.
 *
 * The torch reference (kernels/reference.py) gathers each sequence's blocks into a padded buffer and
 * calls SDPA: on a CPU that copy, the padding and ~10 small ops per layer cost more than the
 * attention itself. Here one pass per (sequence, KV head) streams its blocks once with an online
 * softmax, for all the query rows that share that KV head (G query heads x Q query tokens).
 *
 * Layouts (contiguous, as the engine keeps them):
 *   query, out   [B, Q, H, D]
 *   cache        [num_blocks, 2, BS, Hkv, D]   (index 1: 0 = K, 1 = V)
 *   block_tables [B, M] int32; seq_lens [B] int32 (the Q query tokens included)
 * Query token q of sequence b sits at position p = seq_lens[b] - Q + q and sees keys j <= p, and with
 * a sliding window (window > 0) only keys j > p - window.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_approx.h"

#define MAX_ROWS 1024 /* H * Q; the Python side falls back to the reference above this */
#define MAX_BS 256

typedef float vec8 __attribute__((vector_size(32))); /* GCC/Clang vector extension: AVX2 on x86, 2x NEON on Arm */

static inline vec8 load8(const float *p) {
    vec8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum8(vec8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* One sequence's KV heads [g_lo, g_hi): the G query heads x Q tokens of each attend over the
 * sequence's blocks. Blocks are the outer loop so that a block's K (then V) rows of all those heads are
 * read front to back while they are hot; the G rows of one query token see the same keys, so each key
 * and value row is loaded once for all of them. acc [(g_hi - g_lo) * Q * G * D], s [G * BS]. */
static void attend(const float *query, const float *cache, const int32_t *table, int32_t seq_len, float *out,
                   int Q, int H, int Hkv, int D, int BS, float scale, int window, int g_lo, int g_hi,
                   float *acc, float *s, float *blockbuf) {
    const int G = H / Hkv, chunks = D / 8, rows = (g_hi - g_lo) * Q * G;
    float m[MAX_ROWS], l[MAX_ROWS]; /* row (g - g_lo, qi, h) */
    memset(acc, 0, sizeof(float) * rows * D);
    for (int r = 0; r < rows; r++) m[r] = -INFINITY, l[r] = 0.f;
    int lo = window > 0 ? seq_len - Q - window + 1 : 0; /* the earliest key any row sees */
    if (lo < 0) lo = 0;
    const int64_t kv_stride = (int64_t)BS * Hkv * D; /* a block's K -> its V */
    const int64_t key_stride = (int64_t)Hkv * D;     /* token t -> t + 1 within a block */
    for (int blk = lo / BS; blk * BS < seq_len; blk++) {
        const int j0 = blk * BS;
        /* One bulk copy of the block into a buffer that stays in L1/L2: a memcpy keeps many cache
         * misses in flight, where the arithmetic below, reading memory directly, waits on each
         * (measured: 1.9x faster on blocks scattered as the engine allocates them). */
        memcpy(blockbuf, cache + (int64_t)table[blk] * 2 * kv_stride, sizeof(float) * 2 * kv_stride);
        if ((blk + 1) * BS < seq_len) { /* and the next block's lines on their way while this one computes */
            const char *next = (const char *)(cache + (int64_t)table[blk + 1] * 2 * kv_stride);
            for (int64_t c = 0; c < (int64_t)sizeof(float) * 2 * kv_stride; c += 64) __builtin_prefetch(next + c, 0, 2);
        }
        for (int g = g_lo; g < g_hi; g++) {
            const float *kb = blockbuf + (int64_t)g * D, *vb = kb + kv_stride;
            for (int qi = 0; qi < Q; qi++) {
                const int pos = seq_len - Q + qi; /* this token's position: it sees keys [a, b) of the block */
                int a = window > 0 ? pos - window + 1 - j0 : 0, b = pos + 1 - j0;
                if (a < 0) a = 0;
                if (b > BS) b = BS;
                if (a >= b) continue;
                const float *q0 = query + ((int64_t)qi * H + g * G) * D; /* the G heads' rows, adjacent */
                const int r0 = ((g - g_lo) * Q + qi) * G;
                float *acc0 = acc + (int64_t)r0 * D;
                for (int t = a; t < b; t++) {
                    const float *k = kb + t * key_stride;
                    for (int h = 0; h < G; h++) { /* two accumulators: half the FMA latency chain */
                        const float *qh = q0 + h * D;
                        vec8 s0 = load8(qh) * load8(k), s1 = {0};
                        for (int c = 1; c + 1 < chunks; c += 2) {
                            s1 += load8(qh + 8 * c) * load8(k + 8 * c);
                            s0 += load8(qh + 8 * c + 8) * load8(k + 8 * c + 8);
                        }
                        if (chunks % 2 == 0) s1 += load8(qh + 8 * (chunks - 1)) * load8(k + 8 * (chunks - 1));
                        s[h * BS + t] = hsum8(s0 + s1) * scale;
                    }
                }
                for (int h = 0; h < G; h++) { /* online softmax: rescale what was summed under an older max */
                    float *sh = s + h * BS, mx = m[r0 + h], sum = 0.f;
                    for (int t = a; t < b; t++) mx = sh[t] > mx ? sh[t] : mx;
#pragma omp simd reduction(+ : sum)
                    for (int t = a; t < b; t++) {
                        sh[t] = exp_approx(sh[t] - mx);
                        sum += sh[t];
                    }
                    const int r = r0 + h;
                    if (mx != m[r]) {
                        float corr = m[r] == -INFINITY ? 0.f : exp_approx(m[r] - mx);
                        float *ar = acc0 + h * D;
#pragma omp simd
                        for (int d = 0; d < D; d++) ar[d] *= corr;
                        l[r] *= corr;
                        m[r] = mx;
                    }
                    l[r] += sum;
                }
                /* acc[h] += sum_t p[h][t] v[t], one 8-wide slice at a time held in registers (acc in
                 * memory inside the t loop would chain every update through a store and a load) */
                for (int c = 0; c < chunks; c++)
                    for (int h = 0; h < G; h++) {
                        const float *ph = s + h * BS, *v = vb + 8 * c;
                        vec8 a0 = load8(acc0 + h * D + 8 * c), a1 = {0};
                        int t = a;
                        for (; t + 1 < b; t += 2) {
                            a0 += ph[t] * load8(v + t * key_stride);
                            a1 += ph[t + 1] * load8(v + (t + 1) * key_stride);
                        }
                        if (t < b) a0 += ph[t] * load8(v + t * key_stride);
                        a0 += a1;
                        memcpy(acc0 + h * D + 8 * c, &a0, sizeof a0);
                    }
            }
        }
    }
    for (int g = g_lo; g < g_hi; g++)
        for (int qi = 0; qi < Q; qi++)
            for (int h = 0; h < G; h++) {
                const int r = ((g - g_lo) * Q + qi) * G + h;
                float *o = out + ((int64_t)qi * H + g * G + h) * D, inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
                for (int d = 0; d < D; d++) o[d] = acc[(int64_t)r * D + d] * inv;
            }
}

/* Returns 0, or -1 when the shape is beyond the static limits (the caller then uses the reference). */
int tandem_paged_decode_f32(const float *query, const float *cache, const int32_t *block_tables,
                            int64_t table_stride, const int32_t *seq_lens, float *out, int B, int Q, int H,
                            int Hkv, int D, int BS, float scale, int window, int num_threads) {
    if (H % Hkv || D % 8 || H * Q > MAX_ROWS || BS > MAX_BS) return -1;
    const int64_t seq_stride = (int64_t)Q * H * D;
    /* A unit of work is a whole sequence (its blocks read once, front to back); with fewer sequences
     * than threads, one KV head of a sequence, so a batch of one still uses every thread. */
    const int per_head = B < num_threads, units = per_head ? B * Hkv : B;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && units > 1)
    {
        /* per-thread scratch: the rows' accumulators and one block's scores */
        float *acc = malloc(sizeof(float) * (H * Q * D + (H / Hkv) * BS + 2 * BS * Hkv * D));
        float *s = acc + H * Q * D, *blockbuf = s + (H / Hkv) * BS;
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < units; i++) {
            const int b = per_head ? i / Hkv : i, g = per_head ? i % Hkv : 0;
            attend(query + b * seq_stride, cache, block_tables + b * table_stride, seq_lens[b],
                   out + b * seq_stride, Q, H, Hkv, D, BS, scale, window, g, per_head ? g + 1 : Hkv, acc, s, blockbuf);
        }
        free(acc);
    }
    return 0;
}
