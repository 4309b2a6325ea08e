/* Fused elementwise ops of a decoder layer on the CPU, fp32: each is one pass over memory where torch
 * makes several (RMSNorm: pow, mean, add, rsqrt, mul, mul; SiLU*mul: silu, mul; RoPE: two muls, a
 * neg, a cat, an add), and one call where torch makes up to ten. Rows are split over OpenMP threads
 * (torch's runtime, see kernels/native_cpu.py) when there are enough of them to pay for it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exp_approx.h"

#define PAR_ROWS 64 /* fewer rows than this run on the calling thread: a parallel region costs more */

/* residual_out = x + delta (when delta is given, else x is the residual); out = RMSNorm(residual_out) *
 * weight, the variance in fp32 as Hugging Face's Llama computes it. */
void tandem_add_rms_norm_f32(const float *x, const float *delta, float *residual_out, const float *weight,
                             float *out, int64_t rows, int64_t hidden, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows >= PAR_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * hidden;
        float *res = residual_out + r * hidden, *o = out + r * hidden;
        float ss = 0.f;
        if (delta) {
            const float *dr = delta + r * hidden;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < hidden; i++) {
                float v = xr[i] + dr[i];
                res[i] = v;
                ss += v * v;
            }
        } else {
            res = (float *)xr;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < hidden; i++) ss += xr[i] * xr[i];
        }
        const float inv = 1.f / sqrtf(ss / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) o[i] = weight[i] * (res[i] * inv);
    }
}

/* out [rows, inter] = silu(gate) * up, gate_up [rows, 2 * inter] as the fused projection writes it. */
void tandem_silu_and_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows >= PAR_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
    }
}

/* Rotary embedding in place, rotate-half (GPT-NeoX) style, on `heads` heads of head_dim D in each of
 * `rows` rows (row stride `row_stride` floats: the fused q/k/v projection's output); cos/sin [rows, D].
 * Same roundings as torch's x * cos + rotate_half(x) * sin: no fused multiply-adds. */
__attribute__((optimize("fp-contract=off")))
void tandem_rope_f32(float *x, int64_t row_stride, const float *cos, const float *sin, int64_t rows, int heads,
                     int D, int num_threads) {
    const int half = D / 2;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows >= PAR_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * D, *s = sin + r * D;
        for (int h = 0; h < heads; h++) {
            float *a = x + r * row_stride + (int64_t)h * D, *b = a + half;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] + -x2 * s[i];
                b[i] = x2 * c[half + i] + x1 * s[half + i];
            }
        }
    }
}

/* The index of the first maximum of row[0, limit) among the tokens whose bit is set in `words` (bit b of
 * int32 word w is token 32 w + b; NULL: every token), a NaN counting as the maximum (the first NaN wins),
 * as torch.argmax finds it; -1 where no token is allowed or every allowed one is -inf, and then *first =
 * the first allowed token (-1: none). One pass: the 32 tokens of a word are 4 vectors of 8, and each of
 * the 32 positions keeps its own maximum and the first word it came from (4 independent chains: one
 * accumulator, then a scan for the maximum's index, took ~3.5 us a row of 4096 tokens; a horizontal max
 * per word as long); the first maximum is the lowest token index among the positions holding the row's
 * maximum. */
typedef float mf32x8 __attribute__((vector_size(32)));
typedef int32_t mi32x8 __attribute__((vector_size(32)));
static const mi32x8 MASK_LANES = {0, 1, 2, 3, 4, 5, 6, 7};
static const mf32x8 MASK_NINF = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};

static inline __attribute__((always_inline)) int64_t first_max(const float *row, const int32_t *words, int64_t limit,
                                                                int64_t *first) {
    const int64_t whole = limit / 32; /* words whose 32 tokens are all below the limit */
    const mi32x8 none = {-1, -1, -1, -1, -1, -1, -1, -1};
    mf32x8 acc[4] = {MASK_NINF, MASK_NINF, MASK_NINF, MASK_NINF};
    mi32x8 at[4] = {none, none, none, none}, nan = {0};
    *first = -1;
    for (int64_t i = 0; i < whole; i++) {
        const int32_t bits = words ? words[i] : -1;
        if (!bits) continue;
        if (*first < 0) *first = i * 32 + __builtin_ctz((uint32_t)bits);
        const mi32x8 b = {bits, bits, bits, bits, bits, bits, bits, bits};
        const int32_t word = (int32_t)i;
        const mi32x8 here = {word, word, word, word, word, word, word, word};
        for (int g = 0; g < 4; g++) {
            mf32x8 v;
            memcpy(&v, row + i * 32 + 8 * g, sizeof v);
            const mi32x8 keep = ((b >> (MASK_LANES + 8 * g)) & 1) != 0; /* -1 where allowed */
            v = (mf32x8)(((mi32x8)v & keep) | ((mi32x8)MASK_NINF & ~keep));
            nan |= v != v;
            const mi32x8 gt = v > acc[g]; /* strictly: each position keeps its first maximum */
            acc[g] = (mf32x8)(((mi32x8)v & gt) | ((mi32x8)acc[g] & ~gt));
            at[g] = (here & gt) | (at[g] & ~gt);
        }
    }
    int has_nan = 0;
    float mx = -INFINITY;
    int64_t best = -1;
    for (int g = 0; g < 4; g++)
        for (int j = 0; j < 8; j++) {
            has_nan |= nan[j] != 0;
            if (at[g][j] < 0) continue;
            const int64_t t = (int64_t)at[g][j] * 32 + 8 * g + j;
            if (acc[g][j] > mx || (acc[g][j] == mx && t < best)) { mx = acc[g][j]; best = t; }
        }
    for (int64_t t = whole * 32; t < limit; t++) /* the last, partial word: after every other token */
        if (!words || ((uint32_t)words[t / 32] >> (t % 32) & 1u)) {
            if (*first < 0) *first = t;
            if (row[t] != row[t]) has_nan = 1;
            else if (row[t] > mx) { mx = row[t]; best = t; }
        }
    if (has_nan) /* rare: the first allowed NaN */
        for (int64_t t = *first; t >= 0 && t < limit; t++)
            if ((!words || ((uint32_t)words[t / 32] >> (t % 32) & 1u)) && row[t] != row[t]) return t;
    return best;
}

/* out[r] = the index of the first maximum of row r of x [rows, cols] — torch.argmax(x, -1): NaN counted as
 * the maximum, a row of -inf giving 0 — rows split over threads (first_max). Greedy sampling: torch's argmax
 * reads a 32000-token row at ~8 GB/s on one thread. */
void tandem_argmax_f32(const float *x, int64_t rows, int64_t cols, int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        int64_t first;
        const int64_t best = first_max(x + r * cols, 0, cols, &first);
        out[r] = best >= 0 ? best : 0;
    }
}

/* Structured outputs, greedy rows: out[r] = the argmax of x's row row_ids[r] among the tokens whose bit is
 * set in words row r (llguidance's mask: bit b of int32 word w is token 32 w + b; tokens >= vocab or
 * >= cols never count) -- what masking the row (apply_bitmask) and taking its argmax gives, without
 * writing the row (first_max), except in two corners, both toward the grammar: allowed tokens that are all
 * -inf give the first allowed one (the masked row's argmax would be token 0, allowed or not), and a mask
 * allowing nothing gives -1. Words that are 0 (most of them under a narrow grammar state) are skipped. */
void tandem_masked_argmax_f32(const float *x, int64_t row_stride, int64_t cols, const int64_t *row_ids, int64_t n,
                              const int32_t *words, int64_t n_words, int64_t vocab, int64_t *out) {
    int64_t limit = vocab < cols ? vocab : cols;
    if (limit > n_words * 32) limit = n_words * 32;
    for (int64_t r = 0; r < n; r++) {
        int64_t first;
        const int64_t best = first_max(x + row_ids[r] * row_stride, words + r * n_words, limit, &first);
        out[r] = best >= 0 ? best : first;
    }
}

/* best[r] = row r's argmax as tandem_argmax_f32 gives it, or where row_masks[r] is not NULL, its masked argmax
 * under those n_words words as tandem_masked_argmax_f32 gives it (a mask allowing nothing: 0). A small decode
 * step's C call takes it while the logits are in cache; the masks were made before the forward
 * (tandem/engine/grammar_rows.py: after it, every llguidance and ctypes call ran with its data evicted). */
void tandem_argmax_masked_rows_f32(const float *x, int64_t rows, int64_t cols, const int32_t *const *row_masks,
                                   int64_t n_words, int64_t *best, int num_threads) {
    if (!row_masks) {
        tandem_argmax_f32(x, rows, cols, best, num_threads);
        return;
    }
    const int64_t limit = n_words * 32 < cols ? n_words * 32 : cols;
    for (int64_t r = 0; r < rows; r++) {
        int64_t first;
        const int64_t b = first_max(x + r * cols, row_masks[r], row_masks[r] ? limit : cols, &first);
        best[r] = b >= 0 ? b : (row_masks[r] && first >= 0 ? first : 0);
    }
}

/* Structured outputs: x[r, t] = -inf for every token t whose bit is clear in row r's llguidance mask
 * (bit b of int32 word w is token 32 w + b) and for the columns past the mask's vocabulary (`vocab`:
 * padded logits rows). In place; `row_ids` (or NULL: 0, 1, ...) names the row of x each mask row is for.
 * torch needs ~6 passes over [rows, vocab] for this (unpack the bits, a bool tensor, masked_fill), and its
 * bool masked_fill alone took 1.2 ms for 16 x 32000 here. A word with some tokens allowed is 4 vector
 * blends (a branch per token made 16 rows of 4096 under a regex allowing ~2/3 of them ~30 us). */
void tandem_apply_bitmask_f32(float *x, int64_t rows, int64_t cols, int64_t row_stride, const int32_t *words,
                              int64_t n_words, int64_t vocab, const int64_t *row_ids) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = x + (row_ids ? row_ids[r] : r) * row_stride;  /* words row r masks x row row_ids[r] */
        const int32_t *w = words + r * n_words;
        int64_t limit = vocab < cols ? vocab : cols;
        for (int64_t i = 0; i * 32 < limit; i++) {
            uint32_t bits = (uint32_t)w[i];
            if (bits == 0xFFFFFFFFu) continue;
            int64_t base = i * 32, end = base + 32 < limit ? base + 32 : limit;
            if (bits == 0) {  /* the usual word under a grammar: nothing allowed */
                for (int64_t t = base; t < end; t++) row[t] = -INFINITY;
                continue;
            }
            if (end - base == 32) { /* a mixed word: its 32 tokens as 4 vectors of 8, blended with -inf */
                const mi32x8 b = {(int32_t)bits, (int32_t)bits, (int32_t)bits, (int32_t)bits, (int32_t)bits,
                                  (int32_t)bits, (int32_t)bits, (int32_t)bits};
                for (int g = 0; g < 4; g++) {
                    mf32x8 v;
                    memcpy(&v, row + base + 8 * g, sizeof v);
                    const mi32x8 keep = ((b >> (MASK_LANES + 8 * g)) & 1) != 0;
                    v = (mf32x8)(((mi32x8)v & keep) | ((mi32x8)MASK_NINF & ~keep));
                    memcpy(row + base + 8 * g, &v, sizeof v);
                }
                continue;
            }
            for (int64_t t = base; t < end; t++)
                if (!((bits >> (t - base)) & 1u)) row[t] = -INFINITY;
        }
        for (int64_t t = limit; t < cols; t++) row[t] = -INFINITY;
    }
}
