/* The plans of a linear and of a decoder layer, as tandem/layers/fused_decode.py fills them, and the C
 * functions that run them: shared by the fused layer (decode_layer_cpu.c) and the EAGLE draft loop
 * (eagle_draft_cpu.c). */
#ifndef TANDEM_DECODE_LAYER_H
#define TANDEM_DECODE_LAYER_H
#include <stdint.h>

int tandem_linear_bf16w_f32(const float *x, const uint16_t *w, const float *bias, float *y, int64_t M, int64_t N,
                            int64_t K, int num_threads);
int tandem_linear_f32w_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                           int64_t K, int num_threads);

/* A linear's plan, as tandem.layers.linear.Linear makes it for its own small-batch calls. */
typedef struct {
    const void *weight; /* [out, in]: bf16 bits when bf16 != 0, else fp32 */
    const float *bias;  /* NULL: none */
    int64_t out_features, in_features;
    int64_t bf16;
} tandem_linear_t;

typedef struct {
    tandem_linear_t qkv, o, gate_up, down;
    const float *input_norm; /* NULL: no input norm (an EAGLE head's first layer) */
    const float *post_norm;
    float input_eps, post_eps, scale;
    int32_t heads, kv_heads, head_dim, window; /* window 0: full attention */
} tandem_layer_t;

static inline int tandem_run_linear(const tandem_linear_t *l, const float *x, float *y, int64_t rows,
                                    int num_threads) {
    return l->bf16 ? tandem_linear_bf16w_f32(x, l->weight, l->bias, y, rows, l->out_features, l->in_features,
                                             num_threads)
                   : tandem_linear_f32w_f32(x, l->weight, l->bias, y, rows, l->out_features, l->in_features,
                                            num_threads);
}

int64_t tandem_decode_layer_scratch(const tandem_layer_t *L, int64_t T);
int tandem_decode_layer_f32(const tandem_layer_t *L, const float *x_in, float *x_out, int64_t T, const float *cos,
                            const float *sin, float *cache, int64_t num_slots, int32_t BS, const int64_t *slots,
                            const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, int32_t B,
                            int32_t Q, float *scratch, int num_threads);
void tandem_argmax_f32(const float *x, int64_t rows, int64_t cols, int64_t *out, int num_threads);
void tandem_argmax_masked_rows_f32(const float *x, int64_t rows, int64_t cols, const int32_t *const *row_masks,
                                   int64_t n_words, int64_t *best, int num_threads);

#endif
