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

/* Structured outputs, greedy rows: out[r] = the argmax of x's row row_ids[r] among the tokens whose bit is
 * set in words row r (llguidance's mask: bit b of int32 word w is token 32 w + b; tokens >= vocab or
 * >= cols never count) -- what masking the row (apply_bitmask) and taking its argmax gives, in one pass
 * that reads the allowed tokens only and writes nothing: the first maximum, a NaN among the allowed tokens
 * winning as argmax's does. Two corners differ from the masked row's argmax, both toward the grammar:
 * allowed tokens that are all -inf give the first allowed one (the masked row's argmax would be token 0,
 * allowed or not), and a mask allowing nothing gives -1. Whole words go through a vector max; others
 * visit their set bits only (under a narrow grammar state almost every word is 0: skipped). */
void tandem_masked_argmax_f32(const float *x, int64_t row_stride, int64_t cols, const int64_t *row_ids, int64_t n,
                              const int32_t *words, int64_t n_words, int64_t vocab, int64_t *out) {
    int64_t limit = vocab < cols ? vocab : cols;
    if (limit > n_words * 32) limit = n_words * 32;
    for (int64_t r = 0; r < n; r++) {
        const float *row = x + row_ids[r] * row_stride;
        const int32_t *w = words + r * n_words;
        int64_t best = -1;
        float mx = -INFINITY;
        for (int64_t i = 0; i * 32 < limit && !(best >= 0 && mx != mx); i++) {
            uint32_t bits = (uint32_t)w[i];
            const int64_t base = i * 32, end = base + 32 < limit ? base + 32 : limit;
            if (bits == 0) continue;
            if (bits == 0xFFFFFFFFu && end - base == 32 && best >= 0) {
                float cm = -INFINITY;
                int nan = 0;
#pragma omp simd reduction(max : cm) reduction(| : nan)
                for (int64_t t = base; t < end; t++) {
                    cm = row[t] > cm ? row[t] : cm;
                    nan |= row[t] != row[t];
                }
                if (!nan && !(cm > mx)) continue; /* nothing here beats the best so far */
            }
            for (; bits; bits &= bits - 1) { /* in index order: the first maximum (or NaN) wins */
                const int64_t t = base + __builtin_ctz(bits);
                if (t >= end) break;
                const float v = row[t];
                if (v != v) { best = t; mx = v; break; } /* mx = NaN ends the row */
                if (best < 0 || v > mx) { best = t; mx = v; }
            }
        }
        out[r] = best;
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
