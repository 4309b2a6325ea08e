/* One Llama decoder layer for a decode step of a few tokens (up to 8 rows), in one call from Python.
 *
 * Why: at one token a layer's arithmetic is small (the shipped model's four linears are ~1.5 MB of bf16
 * weights, ~30 us from cache), but the unfused layer is ~10 calls into C through ctypes plus the torch
 * and module plumbing around them: ~190 us a layer measured, of which ~100 us is that plumbing
 * (docs/PERFORMANCE.md "Session 14"). Here the same C functions run back to back: RMSNorm, the q/k/v
 * projection, RoPE on q and k, K/V into the paged cache, paged decode attention, the output projection,
 * the residual add + RMSNorm, gate/up, SiLU*mul, down, the residual add. Every step is the very kernel
 * the unfused path calls, in the same order, so the result is bitwise the same (tested).
 *
 * The caller (tandem/layers/fused_decode.py) checks that the layer and the step qualify (fp32 cache
 * without scales, no q/k norms, no per-layer hook, block tables already checked) and falls back to the
 * module path otherwise. */
#include <string.h>

#include "decode_layer.h"

void tandem_add_rms_norm_f32(const float *x, const float *delta, float *residual_out, const float *weight,
                             float *out, int64_t rows, int64_t hidden, float eps, int num_threads);
void tandem_silu_and_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads);
void tandem_rope_f32(float *x, int64_t row_stride, const float *cos, const float *sin, int64_t rows, int heads,
                     int D, int num_threads);
int tandem_paged_decode_f32(const float *query, const float *cache, const int32_t *block_tables,
                            int64_t table_stride, const int32_t *seq_lens, float *out, int B, int Q, int H,
                            int Hkv, int D, int BS, float scale, int window, int num_threads);

/* Floats of scratch a call with T rows needs. */
int64_t tandem_decode_layer_scratch(const tandem_layer_t *L, int64_t T) {
    const int64_t hidden = L->o.out_features, qs = (int64_t)L->heads * L->head_dim;
    return T * (2 * hidden + L->qkv.out_features + 2 * qs + L->gate_up.out_features + L->down.in_features);
}

/* x_out [T, hidden] = the layer applied to x_in [T, hidden] (not modified), for T = B * Q decode rows (B
 * sequences of Q query tokens each, as paged decode attention takes them); cos/sin [T, D] the rows'
 * rotary tables; slots [T] the cache slots their K/V go to (-1: none); cache [num_slots / BS, 2, BS, Hkv, D].
 * Returns 0; -1 if a linear refused (M < 1), -2 for a slot outside the cache, -3 if attention refused the
 * shape (the caller then runs the module path, nothing in the cache having been read yet for -1/-2; a -3
 * comes after K/V were stored, which the module path stores again, identically). */
int tandem_decode_layer_f32(const tandem_layer_t *L, const float *x_in, float *x_out, int64_t T, const float *cos,
                            const float *sin, float *cache, int64_t num_slots, int32_t BS, const int64_t *slots,
                            const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, int32_t B,
                            int32_t Q, float *scratch, int num_threads) {
    const int H = L->heads, Hkv = L->kv_heads, D = L->head_dim;
    const int64_t hidden = L->o.out_features, qs = (int64_t)H * D, kvs = (int64_t)Hkv * D;
    const int64_t qkv_n = L->qkv.out_features, inter = L->down.in_features;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= num_slots) return -2;
    float *h = scratch, *o = h + T * hidden, *qkv = o + T * hidden, *q = qkv + T * qkv_n, *att = q + T * qs;
    float *gate_up = att + T * qs, *act = gate_up + T * 2 * inter;

    const float *normed = x_in;
    if (L->input_norm) { /* without a delta the residual is x itself: never written */
        tandem_add_rms_norm_f32(x_in, 0, (float *)x_in, L->input_norm, h, T, hidden, L->input_eps, num_threads);
        normed = h;
    }
    if (tandem_run_linear(&L->qkv, normed, qkv, T, num_threads)) return -1;
    tandem_rope_f32(qkv, qkv_n, cos, sin, T, H + Hkv, D, num_threads);
    for (int64_t t = 0; t < T; t++) {
        const float *row = qkv + t * qkv_n;
        memcpy(q + t * qs, row, sizeof(float) * qs); /* attention takes its queries back to back */
        if (slots[t] < 0) continue;
        /* the cache as rows of [Hkv, D]: block b's K rows at 2b * BS, its V rows at (2b + 1) * BS */
        const int64_t k_row = slots[t] / BS * 2 * BS + slots[t] % BS;
        memcpy(cache + k_row * kvs, row + qs, sizeof(float) * kvs);
        memcpy(cache + (k_row + BS) * kvs, row + qs + kvs, sizeof(float) * kvs);
    }
    if (tandem_paged_decode_f32(q, cache, tables, table_stride, seq_lens, att, B, Q, H, Hkv, D, BS, L->scale,
                                L->window, num_threads))
        return -3;
    if (tandem_run_linear(&L->o, att, o, T, num_threads)) return -1;
    tandem_add_rms_norm_f32(x_in, o, x_out, L->post_norm, h, T, hidden, L->post_eps, num_threads);
    if (tandem_run_linear(&L->gate_up, h, gate_up, T, num_threads)) return -1;
    tandem_silu_and_mul_f32(gate_up, act, T, inter, num_threads);
    if (tandem_run_linear(&L->down, act, o, T, num_threads)) return -1;
    for (int64_t i = 0; i < T * hidden; i++) x_out[i] += o[i];
    return 0;
}

/* A decode step's decoder layers in one call: layer i of n_layers applies layers[i] with caches[i] and
 * scratch[i]; the layers' outputs alternate between x_tmp and x_out so the last one lands in x_out (x_in is
 * not modified; x_tmp may be NULL for one layer). Why: between per-layer calls from Python, the ctypes
 * marshalling and the checks ran once a layer with caches the weight streams had just evicted (~65 us a
 * layer inside a step against ~15 us alone; docs/PERFORMANCE.md, session 28). Returns 0, or the first
 * layer's refusal (tandem_decode_layer_f32's codes): the caller then runs the module path from the first
 * layer, which stores the K/V rows already stored again, identically. */
int tandem_decode_layers_f32(const tandem_layer_t *layers, int32_t n_layers, float *const *caches,
                             float *const *scratch, const float *x_in, float *x_out, float *x_tmp, int64_t T,
                             const float *cos, const float *sin, int64_t num_slots, int32_t BS, const int64_t *slots,
                             const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, int32_t B,
                             int32_t Q, int num_threads) {
    const float *cur = x_in;
    for (int32_t i = 0; i < n_layers; i++) {
        float *dst = (n_layers - 1 - i) % 2 == 0 ? x_out : x_tmp;
        const int rc = tandem_decode_layer_f32(&layers[i], cur, dst, T, cos, sin, caches[i], num_slots, BS, slots,
                                               tables, table_stride, seq_lens, B, Q, scratch[i], num_threads);
        if (rc) return rc;
        cur = dst;
    }
    return 0;
}

/* Each row's state [hidden] into its slot of the hidden-state layers (rows of kvs floats: block b's K rows at
 * 2b * BS, its V rows at (2b + 1) * BS): layer i's K row takes floats [2 i kvs, (2 i + 1) kvs), its V row the next
 * kvs, zeros past the state. The slots were checked by the layers (-2 before any was written). */
static void store_hidden_rows(const float *states, int64_t T, int64_t hidden, float *const *caches, int32_t n,
                              int64_t kvs, int32_t BS, const int64_t *slots) {
    for (int32_t i = 0; i < n; i++)
        for (int64_t t = 0; t < T; t++) {
            if (slots[t] < 0) continue;
            const int64_t k_row = slots[t] / BS * 2 * BS + slots[t] % BS;
            for (int half = 0; half < 2; half++) {
                float *dst = caches[i] + (k_row + half * BS) * kvs;
                const int64_t from = (2 * i + half) * kvs, left = hidden - from;
                const int64_t n_copy = left < 0 ? 0 : left < kvs ? left : kvs;
                if (n_copy) memcpy(dst, states + t * hidden + from, sizeof(float) * n_copy);
                memset(dst + n_copy, 0, sizeof(float) * (kvs - n_copy));
            }
        }
}

/* A small decode step's whole model body in one call: each row's embedding (ids into embed [vocab, hidden]) and
 * rotary rows (positions into cos_tab / sin_tab [max_pos, D]) gathered into work [MAX_ROWS * (hidden + 2 D)],
 * the decoder layers (tandem_decode_layers_f32, into x_out via x_tmp), the final RMSNorm of x_out into normed
 * and, given a head (the lm_head's plan; NULL: none), every row's logits from normed and their argmax into best
 * (tandem_argmax_f32's, while the logits are in cache: the greedy sampler's pass over them cost ~80 us from Python
 * after the step, ~10 here; NULL: not taken; a row with a grammar mask in row_masks (NULL, or one per row, each
 * NULL or mask_words int32 words) gets its masked argmax, see tandem_argmax_masked_rows_f32). The block tables are
 * checked here, not in Python: every block a layer reads (window 0: every block below the length; else the
 * largest window of the layers) must be in the cache.
 * Why: after the layers' weight streams have evicted the interpreter's code and data, the embedding lookup, the
 * rotary rows, the final norm, the lm_head's call and the table check cost ~20-150 us each from Python (the
 * 55M Llama's batch-1 step ~0.5 ms of ~10; the shipped model's ~0.2 of ~1.1; docs/PERFORMANCE.md, session 33)
 * where here they are copies, a loop and one norm. The same copies and kernels as the module path: bitwise
 * its result. The arguments up to check_window are the model's (fused_decode keeps them), the rest the step's.
 * With n_hidden > 0 the final hidden states (normed) also go to the token's slots of hidden_caches[0..n_hidden)
 * (tandem/engine/hidden_cache.py: each layer's K and V rows hold the next 2 Hkv D floats of a state, zero-padded),
 * as store_hidden writes them from Python: there that cost ~0.1 ms of an EAGLE step, here T row copies.
 * Returns -4 for an id, a position, a length or a block outside its table (before anything is written), else
 * tandem_decode_layers_f32's code. */
int tandem_decode_model_f32(const tandem_layer_t *layers, int32_t n_layers, float *const *caches,
                            float *const *scratch, const float *embed, int64_t vocab, const float *cos_tab,
                            const float *sin_tab, int64_t max_pos, const float *norm, float eps,
                            const tandem_linear_t *head, float *work, float *x_out, float *x_tmp, int64_t num_blocks,
                            int32_t BS, int32_t check_window, const int64_t *ids, const int64_t *positions,
                            int64_t T, const int64_t *slots, const int32_t *tables, int64_t table_stride,
                            int64_t table_width, const int32_t *seq_lens, int32_t B, int32_t Q, float *normed,
                            float *logits, int64_t *best, const int32_t *const *row_masks, int64_t mask_words,
                            float *const *hidden_caches, int32_t n_hidden, int num_threads) {
    const int64_t hidden = layers[0].o.out_features, D = layers[0].head_dim;
    for (int32_t b = 0; b < B; b++) {
        const int64_t len = seq_lens[b], behind = check_window > 0 ? len - Q - check_window + 1 : 0;
        if (len < Q || len > table_width * BS) return -4;
        for (int64_t j = 0; j * BS < len; j++) {
            const int32_t id = tables[b * table_stride + j];
            if ((j + 1) * BS > behind && (id < 0 || id >= num_blocks)) return -4; /* read, and not in the cache */
        }
    }
    float *x = work, *cos = x + T * hidden, *sin = cos + T * D;
    for (int64_t t = 0; t < T; t++) {
        if (ids[t] < 0 || ids[t] >= vocab || positions[t] < 0 || positions[t] >= max_pos) return -4;
        memcpy(x + t * hidden, embed + ids[t] * hidden, sizeof(float) * hidden);
        memcpy(cos + t * D, cos_tab + positions[t] * D, sizeof(float) * D);
        memcpy(sin + t * D, sin_tab + positions[t] * D, sizeof(float) * D);
    }
    const int rc = tandem_decode_layers_f32(layers, n_layers, caches, scratch, x, x_out, x_tmp, T, cos, sin,
                                            num_blocks * BS, BS, slots, tables, table_stride, seq_lens, B, Q,
                                            num_threads);
    if (rc) return rc;
    tandem_add_rms_norm_f32(x_out, 0, x_out, norm, normed, T, hidden, eps, num_threads);
    store_hidden_rows(normed, T, hidden, hidden_caches, n_hidden, (int64_t)layers[0].kv_heads * D, BS, slots);
    if (!head) return 0;
    if (tandem_run_linear(head, normed, logits, T, num_threads)) return -1;
    if (best) tandem_argmax_masked_rows_f32(logits, T, head->out_features, row_masks, mask_words, best, num_threads);
    return 0;
}
