/* K/V rows of a step into the paged cache, fp32: the torch reference's index_copy_ pair as memcpys.
 *
 * Why: a small store (a decode step outside the fused layer, an EAGLE step's target hidden states kept
 * as one more cache layer) costs the reference ~35 us of torch ops alone and ~95 us inside a step, for
 * a few KB (docs/PERFORMANCE.md "Session 19"). */
#include <stdint.h>
#include <string.h>

/* key/value: T rows of `row` floats, `key_stride` / `value_stride` floats apart; slots [T] (-1: skipped);
 * cache [num_slots / BS, 2, BS, row] as rows: block b's K rows at 2b * BS, its V rows at (2b + 1) * BS.
 * Returns 0, or -2 (nothing written) if a slot lies outside the cache. */
int tandem_store_kv_f32(const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                        float *cache, int64_t num_slots, int32_t BS, const int64_t *slots, int64_t T, int64_t row) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= num_slots) return -2;
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        const int64_t k_row = slots[t] / BS * 2 * BS + slots[t] % BS;
        memcpy(cache + k_row * row, key + t * key_stride, sizeof(float) * row);
        memcpy(cache + (k_row + BS) * row, value + t * value_stride, sizeof(float) * row);
    }
    return 0;
}
