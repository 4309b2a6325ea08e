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

#include "attention_math.h"

#define MAX_ROWS 1024 /* H * Q; the Python side falls back to the reference above this */
#define MAX_BS 256

/* Keys per tile at most: the blocks of one tile are copied together, then every query row works the tile's keys in
 * one online-softmax step. Why tiles and not blocks: at a block of 16 keys and a head of 32, a row's
 * per-step work (max, exp, sum, rescale, accumulators loaded and stored) was most of its time (5 query
 * rows cost 3x one row over the same keys). */
#define TILE 128
#define TILE_BYTES (128 << 10) /* and at most this much K and V (one block where one is more): with 8 KV heads of
                                * 128, 128 keys made 1 MiB, past L2, and ran 7-17% slower than one block */

static inline int tile_keys(int BS, int Hkv, int D) { /* whole blocks, at least one */
    int keys = TILE_BYTES / (2 * Hkv * D * (int)sizeof(float));
    keys = (keys < TILE ? keys : TILE) / BS * BS;
    return keys < BS ? BS : keys;
}

/* The blocks of the next tile, requested 64 bytes at a time as this tile computes: `step` lines before each
 * 8-key dot product (all of them by the tile's end). A cursor (block, offset), not a division per line. */
typedef struct {
    const char *blocks[TILE];
    int nblocks, b;
    int64_t block_bytes, offset, step; /* block_bytes: a multiple of 64 (D % 8 == 0) */
} spread_t;

static inline void spread_some(spread_t *pf, int64_t lines) {
    for (; lines > 0 && pf->b < pf->nblocks; lines--) {
        __builtin_prefetch(pf->blocks[pf->b] + pf->offset, 0, 2);
        if ((pf->offset += 64) == pf->block_bytes) pf->offset = 0, pf->b++;
    }
}

/* Copy the K and V rows of heads [g_lo, g_lo + nh) of `n` keys of one block into kbuf / vbuf (rows ks apart). */
static inline __attribute__((always_inline)) void copy_block(float *kbuf, float *vbuf, const float *src, int n,
                                                             int64_t kv_stride, int64_t key_stride, int g_lo,
                                                             int nh, const int D, int Hkv) {
    const int64_t ks = (int64_t)nh * D;
    if (nh == Hkv) {
        memcpy(kbuf, src, sizeof(float) * n * ks);
        memcpy(vbuf, src + kv_stride, sizeof(float) * n * ks);
        return;
    }
    for (int t = 0; t < n; t++) /* a unit of some KV heads (a batch of one split over threads): their rows */
        for (int64_t c = 0; c < ks; c += 8) {
            vec8 k = load8(src + t * key_stride + g_lo * D + c), v = load8(src + kv_stride + t * key_stride + g_lo * D + c);
            memcpy(kbuf + t * ks + c, &k, sizeof k);
            memcpy(vbuf + t * ks + c, &v, sizeof v);
        }
}

/* One sequence's KV heads [g_lo, g_hi): the G query heads x Q tokens of each attend over the
 * sequence's keys, a tile of TILE at a time. The G rows of one query token see the same keys, so each
 * key and value row is loaded once for all of them. acc [(g_hi - g_lo) * Q * G * D], s [G * TILE],
 * blockbuf [2 * TILE * (g_hi - g_lo) * D]. `direct`: the arithmetic reads K and V in the blocks themselves
 * instead of a tile's copy (see tandem_paged_decode_f32 for when); the same operations in the same order
 * either way, so the same bits. */
static inline __attribute__((always_inline)) void attend(
        const float *query, const float *cache, const int32_t *table, int32_t seq_len, float *out, int Q, int H,
        int Hkv, const int D, int BS, float scale, int window, int g_lo, int g_hi, float *acc, float *s,
        float *blockbuf, const int direct) {
    const int G = H / Hkv, chunks = D / 8, rows = (g_hi - g_lo) * Q * G;
    float m[MAX_ROWS], l[MAX_ROWS]; /* row (g - g_lo, qi, h) */
    memset(acc, 0, sizeof(float) * rows * D);
    for (int r = 0; r < rows; r++) m[r] = -INFINITY, l[r] = 0.f;
    int lo = window > 0 ? seq_len - Q - window + 1 : 0; /* the earliest key any row sees */
    if (lo < 0) lo = 0;
    const int64_t kv_stride = (int64_t)BS * Hkv * D; /* a block's K -> its V */
    const int64_t key_stride = (int64_t)Hkv * D;     /* token t -> t + 1 within a block */
    const int nh = g_hi - g_lo;                        /* blockbuf holds these heads' rows only */
    const int64_t ks = (int64_t)nh * D;                /* ... token stride */
    const int tile = tile_keys(BS, Hkv, D);
    float *kbuf = blockbuf, *vbuf = blockbuf + (int64_t)tile * ks;
    for (int j0 = lo / BS * BS; j0 < seq_len; j0 += tile) {
        const int n = seq_len - j0 < tile ? seq_len - j0 : tile; /* keys in this tile */
        const float *blk[TILE]; /* direct: the tile's blocks */
        for (int j = 0; direct && j < n; j += BS) blk[j / BS] = cache + (int64_t)table[(j0 + j) / BS] * 2 * kv_stride;
#define KROW(t) (blk[(t) / BS] + (int64_t)((t) % BS) * key_stride + (int64_t)g * D) /* direct: key t's K row */
        /* One bulk copy per block into a buffer that stays in L1/L2: a memcpy keeps many cache misses in
         * flight, where the arithmetic below, reading memory directly, waits on each (measured: 1.9x
         * faster on blocks scattered as the engine allocates them). */
        for (int j = 0; !direct && j < n; j += BS) {
            const float *src = cache + (int64_t)table[(j0 + j) / BS] * 2 * kv_stride;
            copy_block(kbuf + j * ks, vbuf + j * ks, src, n - j < BS ? n - j : BS, kv_stride, key_stride, g_lo, nh, D, Hkv);
        }
        /* The next tile's lines on their way. A unit of whole sequences (nh == Hkv) requests its next tile's blocks
         * a few lines before each 8-key dot product of this tile (spread_some), so the misses overlap the
         * arithmetic: requested all at once before it, most of them waited (a core tracks a few dozen misses). A
         * unit of one KV head that copies requests its rows of the next tile now, as before. */
        spread_t pf = {.nblocks = 0};
        if (nh == Hkv) {
            pf.block_bytes = (int64_t)sizeof(float) * 2 * kv_stride;
            for (int j = n; j0 + j < seq_len && j < 2 * tile; j += BS)
                pf.blocks[pf.nblocks++] = (const char *)(cache + (int64_t)table[(j0 + j) / BS] * 2 * kv_stride);
            const int64_t dots = (int64_t)nh * Q * G * (n < 8 ? 1 : n / 8);
            pf.step = (pf.nblocks * pf.block_bytes / 64 + dots - 1) / dots;
        }
        for (int j = n; !direct && nh < Hkv && j0 + j < seq_len && j < 2 * tile; j += BS) {
            const char *next = (const char *)(cache + (int64_t)table[(j0 + j) / BS] * 2 * kv_stride + g_lo * D);
            for (int t = 0; t < 2 * BS; t++)
                for (int64_t c = 0; c < (int64_t)sizeof(float) * ks; c += 64)
                    __builtin_prefetch(next + t * sizeof(float) * key_stride + c, 0, 2);
        }
        for (int g = g_lo; g < g_hi; g++) {
            const float *kb = kbuf + (int64_t)(g - g_lo) * D, *vb = vbuf + (int64_t)(g - g_lo) * D;
            for (int qi = 0; qi < Q; qi++) {
                const int pos = seq_len - Q + qi; /* this token's position: it sees keys [a, b) of the tile */
                int a = window > 0 ? pos - window + 1 - j0 : 0, b = pos + 1 - j0;
                if (a < 0) a = 0;
                if (b > n) b = n;
                if (a >= b) continue;
                const float *q0 = query + ((int64_t)qi * H + g * G) * D; /* the G heads' rows, adjacent */
                const int r0 = ((g - g_lo) * Q + qi) * G;
                float *acc0 = acc + (int64_t)r0 * D;
                for (int h = 0; h < G; h++) {
                    const float *qh = q0 + h * D;
                    int t = a;
                    for (; t + 8 <= b; t += 8) {
                        spread_some(&pf, pf.step);
                        if (!direct) {
                            dots8(qh, kb + t * ks, ks, D, scale, s + h * tile + t);
                        } else if (t % BS + 8 <= BS) {
                            dots8(qh, KROW(t), key_stride, D, scale, s + h * tile + t);
                        } else { /* eight keys across two blocks: gathered, so they are summed as eight */
                            for (int u = 0; u < 8; u++) memcpy(blockbuf + u * D, KROW(t + u), sizeof(float) * D);
                            dots8(qh, blockbuf, D, D, scale, s + h * tile + t);
                        }
                    }
                    for (; t < b; t++) s[h * tile + t] = dot(qh, direct ? KROW(t) : kb + t * ks, D) * scale;
                }
                for (int h = 0; h < G; h++) { /* online softmax: rescale what was summed under an older max */
                    float *sh = s + h * tile, mx = max_from(sh, a, b, m[r0 + h]);
                    exp_shifted(sh, a, b, mx);
                    const float sum = sum_of(sh, a, b);
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
                /* acc[h] += sum_t p[h][t] v[t]: all G heads' accumulators in registers where they fit, so each
                 * value row is loaded once for the G heads (else one 8-wide slice at a time) */
                if (direct) /* a block's keys at a time (the accumulators stored and reloaded: the same sums) */
                    for (int t0 = a; t0 < b;) {
                        const int t1 = (t0 / BS + 1) * BS < b ? (t0 / BS + 1) * BS : b;
                        pv_in_registers(acc0, s + t0, KROW(t0) + kv_stride, key_stride, 0, t1 - t0, tile, G, D / 8);
                        t0 = t1;
                    }
                else if (!pv_in_registers(acc0, s, vb, ks, a, b, tile, G, D / 8))
                    for (int c = 0; c < chunks; c++)
                        for (int h = 0; h < G; h++) {
                            const float *ph = s + h * tile, *v = vb + 8 * c;
                            vec8 a0 = load8(acc0 + h * D + 8 * c), a1 = {0};
                            int t = a;
                            for (; t + 1 < b; t += 2) {
                                a0 += ph[t] * load8(v + t * ks);
                                a1 += ph[t + 1] * load8(v + (t + 1) * ks);
                            }
                            if (t < b) a0 += ph[t] * load8(v + t * ks);
                            a0 += a1;
                            memcpy(acc0 + h * D + 8 * c, &a0, sizeof a0);
                        }
            }
        }
#undef KROW
        spread_some(&pf, INT64_MAX); /* what this tile's dot products left */
    }
    for (int g = g_lo; g < g_hi; g++)
        for (int qi = 0; qi < Q; qi++)
            for (int h = 0; h < G; h++) {
                const int r = ((g - g_lo) * Q + qi) * G + h;
                float *o = out + ((int64_t)qi * H + g * G + h) * D, inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
                for (int d = 0; d < D; d++) o[d] = acc[(int64_t)r * D + d] * inv;
            }
}

/* `attend` with the head size as a compile-time constant for the common ones: the chunk loops unroll
 * and their accumulators stay in registers (measured: ~1.6x less compute at head_dim 32). */
static void attend_any(const float *query, const float *cache, const int32_t *table, int32_t seq_len, float *out,
                       int Q, int H, int Hkv, int D, int BS, float scale, int window, int g_lo, int g_hi,
                       float *acc, float *s, float *blockbuf, int direct) {
#define ATTEND(DIM, DIRECT) attend(query, cache, table, seq_len, out, Q, H, Hkv, DIM, BS, scale, window, g_lo, g_hi, \
                                   acc, s, blockbuf, DIRECT)
#define BOTH(DIM) if (direct) ATTEND(DIM, 1); else ATTEND(DIM, 0)
    switch (D) {
    case 32: BOTH(32); break;
    case 64: BOTH(64); break;
    case 128: BOTH(128); break;
    default: BOTH(D);
    }
#undef BOTH
#undef ATTEND
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
    /* Key rows of at most 1 KiB (Hkv * D <= 256 floats) are read where they lie, no tile copy (a unit of one KV head
     * reads a strided quarter or half of each row, which the copy gathered 8 floats at a time). Batch-1 decode,
     * both libraries swapped in one process (docs/PERFORMANCE.md, session 30): the shipped model (4 x 32) at 800
     * tokens 1.09-1.15x, with EAGLE 1.09x; the 55M (2 x 64) at 1900 tokens 0.98-1.02x. Units of whole sequences
     * read in place too since their next tile is requested while this one computes (spread_t; docs/PERFORMANCE.md,
     * session 43, eight layers' caches rotating, 2 threads, against copying and requesting the tile at once: 16 x
     * 2000 tokens of the 55M's heads 1.37x, of the shipped model's 1.39x, 64 x 400 1.17x, 2-4 sequences 1.30-1.36x;
     * in place without the spread requests 0.86-0.96x). 8 x 128 heads copy (rows of 4 KiB), with the same spread
     * requests (1.21x). Units of one of several KV heads get none: with the cache in L3 they cost 8-32% there. */
    const int G = H / Hkv, direct = Hkv * D <= 256 && (G == 1 || G == 2 || G == 4 || G == 8);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && units > 1)
    {
        /* per-thread scratch: the rows' accumulators, one tile's scores and its keys and values */
        const int tile = tile_keys(BS, Hkv, D);
        float *acc = malloc(sizeof(float) * (H * Q * D + (H / Hkv) * tile + 2 * tile * Hkv * D));
        float *s = acc + H * Q * D, *blockbuf = s + (H / Hkv) * tile;
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < units; i++) {
            const int b = per_head ? i / Hkv : i, g = per_head ? i % Hkv : 0;
            attend_any(query + b * seq_stride, cache, block_tables + b * table_stride, seq_lens[b],
                   out + b * seq_stride, Q, H, Hkv, D, BS, scale, window, g, per_head ? g + 1 : Hkv, acc, s, blockbuf,
                   direct);
        }
        free(acc);
    }
    return 0;
}
