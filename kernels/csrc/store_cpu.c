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

/* nbytes from src to dst, the destination written with streaming (non-temporal) stores: a KV block copy
 * into another process's cache (the shm connector), whose bytes this core never reads again. Why: a plain
 * memcpy of that size first reads every destination line into this core's cache (the read for ownership),
 * then evicts the prefill worker's weights with them; glibc switches to streaming stores only above ~3/4
 * of the L3 (195 MB on a 260 MB L3). Head and tail up to 64-byte alignment go through memcpy. */
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif
void tandem_copy_stream(void *dst, const void *src, int64_t nbytes) {
#if defined(__AVX512F__) || defined(__AVX__)
    char *d = dst;
    const char *s = src;
    int64_t head = (int64_t)((64 - ((uintptr_t)d & 63)) & 63);
    if (head > nbytes) head = nbytes;
    memcpy(d, s, head);
    d += head, s += head, nbytes -= head;
    const int64_t body = nbytes & ~(int64_t)63;
    for (int64_t i = 0; i < body; i += 64) {
#if defined(__AVX512F__)
        _mm512_stream_si512((void *)(d + i), _mm512_loadu_si512((const void *)(s + i)));
#else
        _mm256_stream_si256((__m256i *)(d + i), _mm256_loadu_si256((const __m256i *)(s + i)));
        _mm256_stream_si256((__m256i *)(d + i + 32), _mm256_loadu_si256((const __m256i *)(s + i + 32)));
#endif
    }
    _mm_sfence(); /* the stores are visible before the notification that follows */
    memcpy(d + body, s + body, nbytes - body);
#else
    memcpy(dst, src, nbytes);
#endif
}
