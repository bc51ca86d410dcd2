/* sampler.h - choosing the next token from logits.
 *
 * Greedy when temp <= 0 (ties -> lowest id, as the golden files were made).
 * Otherwise, in llama.cpp's order: top-k, top-p, min-p, temperature, then a
 * draw from the softmax with a seeded generator (same seed, same tokens).
 */
#ifndef TANDEM_SAMPLER_H
#define TANDEM_SAMPLER_H

#include <stdint.h>

typedef struct {
    float temp;        /* <= 0: greedy */
    int top_k;         /* <= 0: off */
    float top_p;       /* >= 1: off */
    float min_p;       /* <= 0: off */
    uint64_t seed;
} sampler_params;

typedef struct sampler sampler;

sampler_params sampler_defaults(void);   /* greedy */
sampler *sampler_new(const sampler_params *p, int n_vocab);
void sampler_free(sampler *s);
int32_t sampler_sample(sampler *s, const float *logits);
int32_t sampler_argmax(const float *logits, int n);

#endif
