/* Fused elementwise ops of a decoder layer on the CPU, fp32: each is one pass over memory where torch
 * makes several (RMSNorm: pow, mean, add, rsqrt, mul, mul; SiLU*mul: silu, mul; RoPE: two muls, a
 * neg, a cat, an add), and one call where torch makes up to ten. Rows are split over OpenMP threads
 * (torch's runtime, see kernels/native_cpu.py) when there are enough of them to pay for it.
 */
#include <math.h>
#include <stdint.h>

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

/* out[r] = the index of the first maximum of row r of x [rows, cols] — torch.argmax(x, -1), NaN counted
 * as the maximum. Greedy sampling over a 32000-token vocabulary: torch's argmax reads a row at ~8 GB/s
 * on one thread; here a vectorised max pass, then a scan for its first index (the row is in L2 by then),
 * rows split over threads. */
void tandem_argmax_f32(const float *x, int64_t rows, int64_t cols, int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        float mx = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
        for (int64_t i = 0; i < cols; i++) {
            mx = row[i] > mx ? row[i] : mx;
            nan |= row[i] != row[i];
        }
        int64_t at = 0;
        if (nan) {
            while (row[at] == row[at]) at++;
        } else {
            while (at < cols - 1 && row[at] != mx) at++;
        }
        out[r] = at;
    }
}

/* Structured outputs: the k best tokens of rows row_ids[0..n) of x, best first, ordered by (value desc,
 * index asc): the order in which the greedy sampler's argmax (first maximum) would pick them were the
 * ones before masked out, ties included, so the first one a grammar allows is the masked argmax. One
 * pass a row with a k-entry insertion list (most values lose to the k-th at one compare); torch's topk
 * took ~5 us a row here and leaves the order among equal values unspecified. A row holding a NaN gets
 * out[0] = -1 (its argmax is the first NaN: the caller masks that row instead). */
void tandem_topk_rows_f32(const float *x, int64_t row_stride, int64_t cols, const int64_t *row_ids, int64_t n,
                          int64_t k, int64_t *out, int num_threads) {
    enum { CHUNK = 16 };
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && n >= 4)
    for (int64_t r = 0; r < n; r++) {
        float vals[64];
        const float *row = x + row_ids[r] * row_stride;
        int64_t *idx = out + r * k, filled = 0;
        int nan = 0;
        for (int64_t c = 0; c < cols && !nan; c += CHUNK) {
            int64_t end = c + CHUNK < cols ? c + CHUNK : cols;
            if (filled == k) {  /* a vector pass: most chunks hold nothing better than the k-th */
                float mx = -INFINITY;
                int bad = 0;
#pragma omp simd reduction(max : mx) reduction(| : bad)
                for (int64_t i = c; i < end; i++) {
                    mx = row[i] > mx ? row[i] : mx;
                    bad |= row[i] != row[i];
                }
                if (!bad && !(mx > vals[k - 1])) continue;
            }
            for (int64_t i = c; i < end; i++) {
                float v = row[i];
                if (v != v) { nan = 1; break; }
                if (filled == k && !(v > vals[k - 1])) continue;  /* equal to the k-th: a later index loses */
                int64_t j = filled < k ? filled++ : k - 1;
                while (j > 0 && vals[j - 1] < v) {  /* after every equal value: lower indices come first */
                    vals[j] = vals[j - 1];
                    idx[j] = idx[j - 1];
                    j--;
                }
                vals[j] = v;
                idx[j] = i;
            }
        }
        if (nan) idx[0] = -1;
    }
}

/* Structured outputs: x[r, t] = -inf for every token t whose bit is clear in row r's llguidance mask
 * (bit b of int32 word w is token 32 w + b) and for the columns past the mask's vocabulary (`vocab`:
 * padded logits rows). In place; `row_ids` (or NULL: 0, 1, ...) names the row of x each mask row is for. torch needs ~6 passes over [rows, vocab] for this (unpack the bits,
 * a bool tensor, masked_fill), and its bool masked_fill alone took 1.2 ms for 16 x 32000 here. */
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
            for (int64_t t = base; t < end; t++)
                if (!((bits >> (t - base)) & 1u)) row[t] = -INFINITY;
        }
        for (int64_t t = limit; t < cols; t++) row[t] = -INFINITY;
    }
}
