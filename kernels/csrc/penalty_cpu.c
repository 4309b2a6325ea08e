/* The repetition, frequency and presence penalties on a step's logits, touching only the entries of the
 * tokens each request has seen: tandem/engine/logits_processors.py's torch pass, in one call.
 *
 * Why: the shipped model's generation config asks for repetition_penalty 1.2, so every request served
 * with its defaults pays this pass on every step. In torch it is ~15 small ops: ~100 us a step at
 * batch 1 (a tenth of the step), ~0.9 ms at 64 requests; here a few microseconds.
 *
 * Same values, bit for bit, as the torch pass: repetition first (each seen token's logit scaled once,
 * from its value before the pass), then, per distinct output token with count c, (x - f * c) - p, each
 * operation rounded to float (the product is kept out of an FMA on purpose). */
#include <stdint.h>

/* rows: logits, `stride` floats apart; n penalized entries, entry i owning row row_of[i] and the tokens
 * toks[starts[i] .. starts[i] + lens[i]), of which the first prompt_lens[i] are its prompt's; rep / freq /
 * pres: its three penalties. marks: `vocab` zeroed int32 of scratch, zeroed again on return.
 * Returns 0, or -1 (nothing written) if a token lies outside [0, vocab). */
int tandem_penalize_f32(float *rows, int64_t stride, int64_t vocab, int64_t n, const int64_t *row_of,
                        const int64_t *toks, const int64_t *starts, const int64_t *lens, const int64_t *prompt_lens,
                        const float *rep, const float *freq, const float *pres, int32_t *marks) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = starts[i]; j < starts[i] + lens[i]; j++)
            if (toks[j] < 0 || toks[j] >= vocab) return -1;
    for (int64_t i = 0; i < n; i++) {
        float *row = rows + row_of[i] * stride;
        const int64_t *seq = toks + starts[i], len = lens[i];
        if (rep[i] != 1.0f) {
            const float p = rep[i];
            for (int64_t j = 0; j < len; j++) {
                const int64_t t = seq[j];
                if (marks[t]) continue;
                marks[t] = 1;
                row[t] = row[t] > 0 ? row[t] / p : row[t] * p;
            }
            for (int64_t j = 0; j < len; j++) marks[seq[j]] = 0;
        }
        if (freq[i] == 0.0f && pres[i] == 0.0f) continue;
        const int64_t first = prompt_lens[i] < len ? prompt_lens[i] : len;
        for (int64_t j = first; j < len; j++) marks[seq[j]]++;
        for (int64_t j = first; j < len; j++) {
            const int64_t t = seq[j];
            if (!marks[t]) continue;  /* done at its first occurrence */
            volatile float by_count = freq[i] * (float)marks[t];  /* volatile: no fused multiply-subtract */
            const float x = row[t] - by_count;
            row[t] = x - pres[i];
            marks[t] = 0;
        }
    }
    return 0;
}
