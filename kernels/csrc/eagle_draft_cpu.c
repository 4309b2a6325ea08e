/* EAGLE's greedy chain drafting, every pass of a proposal in one call from Python.
 *
 * Why: an EAGLE head pass at batch 1 is one small decoder layer, yet through Python it cost ~400 us on
 * the shipped model (the fused layer ~120 us; the rest is building attention metadata, the embedding
 * lookup, the concatenation, fc, the rotary lookup, the lm_head and the argmax, each a torch or ctypes
 * call): with four drafts a proposal cost more than a target step (docs/PERFORMANCE.md, "Session 16").
 * Greedy drafts need no Python between passes: each pass feeds the previous pass's token and output
 * state, so the first pass (the catch-up) and the k - 1 after it run here back to back, through the
 * kernels the Python path calls (fc and lm_head by their Linear plans, the layer by
 * tandem_decode_layer_f32, the argmax by tandem_argmax_f32), in the same order: the drafts and the head
 * cache's K/V are bitwise the same (tested).
 *
 * The caller (plugins/eagle_fused.py) checks what the fused layer checks (fp32, contiguous, native ops)
 * and hands every request's head block table; this file checks each block a pass reads or writes. */
#include <stdint.h>
#include <string.h>

#include "decode_layer.h"

#define MAX_ROWS 16 /* rows of one pass: B sequences x Q tokens (the fused layer's limit) */

/* Floats of scratch a call of up to MAX_ROWS rows needs. */
int64_t tandem_eagle_draft_scratch(const tandem_layer_t *layers, int32_t num_layers, int64_t vocab) {
    const int64_t hidden = layers[0].o.out_features, D = layers[0].head_dim;
    int64_t layer = 0;
    for (int32_t l = 0; l < num_layers; l++) {
        const int64_t need = tandem_decode_layer_scratch(&layers[l], MAX_ROWS);
        layer = need > layer ? need : layer;
    }
    return MAX_ROWS * (4 * hidden + 2 * D) + MAX_ROWS * (hidden + vocab) + layer;
}

/* Drafts for B sequences: a first pass over Q rows per sequence — row (b, q) feeds token in_tokens[b * Q + q]
 * with state in_states[b * Q + q] at position start_pos[b] + q — then steps - 1 single-token passes, each
 * feeding the previous pass's draft token and its output state at the next position. A pass is
 * fc(concat(embed[token], state)) -> the layers (K/V into the head's paged caches) -> lm_head on each
 * sequence's last row, whose first maximum over the logits' first `vocab` columns is the pass's draft:
 * drafts [B, steps] int64. With a draft vocabulary (lm_head's rows are a subset of the target's
 * vocabulary) `to_target` [vocab] maps a column to its target token id, which is what is drafted and fed
 * to the next pass; NULL: columns are target ids. With `rep_penalty` [B] (NULL: none) sequence b's logits of
 * the columns marked in seen [B, cols] (its prompt and output tokens) are divided by rep_penalty[b] where
 * positive, else multiplied by it, as the target's repetition penalty treats them when it verifies; each
 * pass marks its draft, which the next passes then see too. tables [B, table_stride] int32; caches[l] as the fused layer takes them;
 * cos/sin [max_pos, D]. Returns 0, or before the failing pass writes anything: -1 for a bad shape (B * Q
 * outside 1..MAX_ROWS, a linear refused), -2 for a position, block or token out of range, -3 if attention
 * refused. With `pads` [B] (NULL: none) the first pads[b] rows of sequence b's first pass are padding: positions
 * its head already computed, which attend like the rest but write no K/V (slot -1), so catch-ups of unequal
 * lengths run as one pass of Q rows each (the target's decode group pads its short queries the same way). */
int tandem_eagle_draft_f32(const tandem_layer_t *layers, int32_t num_layers, const tandem_linear_t *fc,
                           const tandem_linear_t *lm_head, int64_t vocab, const float *embed, int64_t embed_rows,
                           const float *cos, const float *sin, int64_t max_pos, float *const *caches,
                           int64_t num_blocks, int32_t BS, const int32_t *tables, int64_t table_stride, int32_t B,
                           int32_t Q, const int64_t *in_tokens, const float *in_states, const int64_t *start_pos,
                           const int32_t *pads, int32_t steps, const int64_t *to_target, const float *rep_penalty,
                           uint8_t *seen, int64_t *drafts, float *scratch, int num_threads) {
    if (B < 1 || Q < 1 || (int64_t)B * Q > MAX_ROWS || num_layers < 1) return -1;
    const int64_t hidden = layers[0].o.out_features, D = layers[0].head_dim, V = lm_head->out_features;
    const int64_t cols = vocab < V ? vocab : V;
    float *cat = scratch, *x = cat + MAX_ROWS * 2 * hidden, *y = x + MAX_ROWS * hidden;
    float *cs = y + MAX_ROWS * hidden, *sn = cs + MAX_ROWS * D, *last = sn + MAX_ROWS * D;
    float *logits = last + MAX_ROWS * hidden, *layer_scratch = logits + MAX_ROWS * V;
    int64_t slots[MAX_ROWS], best[MAX_ROWS];
    int32_t lens[MAX_ROWS];
    for (int32_t s = 0, q_len = Q; s < steps; s++, q_len = 1) {
        for (int32_t b = 0; b < B; b++) {
            const int32_t *row = tables + b * table_stride;
            const int64_t first = s ? start_pos[b] + Q - 1 + s : start_pos[b];
            for (int32_t q = 0; q < q_len; q++) {
                const int64_t r = (int64_t)b * q_len + q, p = first + q;
                const int64_t tok = s ? drafts[b * steps + s - 1] : in_tokens[r];
                if (p < 0 || p >= max_pos || p / BS >= table_stride || tok < 0 || tok >= embed_rows) return -2;
                slots[r] = !s && pads && q < pads[b] ? -1 : (int64_t)row[p / BS] * BS + p % BS;
                memcpy(cs + r * D, cos + p * D, sizeof(float) * D);
                memcpy(sn + r * D, sin + p * D, sizeof(float) * D);
                memcpy(cat + r * 2 * hidden, embed + tok * hidden, sizeof(float) * hidden);
                memcpy(cat + r * 2 * hidden + hidden, s ? last + b * hidden : in_states + r * hidden,
                       sizeof(float) * hidden);
            }
            lens[b] = (int32_t)(first + q_len);
            for (int64_t j = 0; j <= (first + q_len - 1) / BS; j++) /* every block attention reads or writes */
                if (row[j] < 0 || row[j] >= num_blocks) return -2;
        }
        const int64_t T = (int64_t)B * q_len;
        if (tandem_run_linear(fc, cat, x, T, num_threads)) return -1;
        for (int32_t l = 0; l < num_layers; l++) {
            const int rc = tandem_decode_layer_f32(&layers[l], x, y, T, cs, sn, caches[l], num_blocks * BS, BS, slots,
                                                   tables, table_stride, lens, B, q_len, layer_scratch, num_threads);
            if (rc) return rc;
            if (l + 1 < num_layers) memcpy(x, y, sizeof(float) * T * hidden);
        }
        for (int32_t b = 0; b < B; b++) /* each sequence's last row: its next state and its logits */
            memcpy(last + b * hidden, y + ((int64_t)b * q_len + q_len - 1) * hidden, sizeof(float) * hidden);
        if (tandem_run_linear(lm_head, last, logits, B, num_threads)) return -1;
        for (int32_t b = 0; rep_penalty && b < B; b++) {
            const float p = rep_penalty[b];
            float *row = logits + b * V;
            const uint8_t *mark = seen + b * cols;
            if (p != 1.f)
                for (int64_t j = 0; j < cols; j++)
                    if (mark[j]) row[j] = row[j] > 0.f ? row[j] / p : row[j] * p;
        }
        if (cols == V) {
            tandem_argmax_f32(logits, B, V, best, num_threads);
        } else {
            for (int32_t b = 0; b < B; b++) tandem_argmax_f32(logits + b * V, 1, cols, best + b, num_threads);
        }
        for (int32_t b = 0; b < B; b++) {
            drafts[b * steps + s] = to_target ? to_target[best[b]] : best[b];
            if (rep_penalty) seen[b * cols + best[b]] = 1;
        }
    }
    return 0;
}
