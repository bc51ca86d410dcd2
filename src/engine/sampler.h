/* sampler.h - choosing the next token from logits.
 *
 * One sampler per generated sequence: it owns the sequence's random state
 * and its scratch buffers, so sequences decoded side by side never share
 * state. Greedy when temp <= 0 (ties -> lowest id, as the golden files were
 * made). Otherwise, in llama.cpp's order: top-k, top-p, min-p, temperature,
 * then a draw from the softmax with a seeded generator (same seed, same
 * tokens).
 *
 * Cost: no path sorts the whole vocabulary.
 *  - No filter (top_k <= 0 or >= n_vocab, top_p >= 1, min_p <= 0; what the
 *    router sends for OpenAI's defaults): the draw is made straight from the
 *    softmax, in vocabulary order (a vectorised pass for the max, one for the
 *    weights and their sum, a two-level scan for the draw).
 *  - top-k: the k best are picked with a bounded heap (small k) or a
 *    quickselect, then only those k are sorted.
 *  - top-p / min-p without top-k: only a prefix of the ranking is selected
 *    and sorted, growing 8x at a time until it holds the nucleus (or the
 *    min-p set).
 * The filtered paths return exactly the tokens of sampler_ref_sample (the
 * former full-sort implementation) for the same seed: a top-p cut that falls
 * within rounding distance of top_p is recomputed by the reference. The
 * unfiltered path draws from the same distribution, but scans the
 * vocabulary in id order rather than by rank, so a given seed yields other
 * tokens than the reference would.
 *
 * Extending: fields added to sampler_params mean "off" when zero. Logit bias
 * and penalties (which need the sequence's history, fed by sampler_accept)
 * live in this per-sequence object and rewrite a private copy of the logits
 * before the filters.
 */
#ifndef TANDEM_SAMPLER_H
#define TANDEM_SAMPLER_H

#include <stdint.h>

/* A logit bias: added to the token's logit before anything else
 * (-INFINITY bans it). */
typedef struct { int32_t id; float bias; } sampler_bias;

typedef struct {
    float temp;        /* <= 0: greedy */
    int top_k;         /* <= 0: off */
    float top_p;       /* >= 1: off */
    float min_p;       /* <= 0: off */
    uint64_t seed;
    /* Penalties, applied (after the logit bias) to a private copy of the
     * logits, so they act in every mode including greedy:
     *  presence/frequency (OpenAI): logit -= presence * (count > 0) +
     *    frequency * count, count = times the token was generated so far;
     *  repeat (llama.cpp's repetition penalty): a token among the last
     *    repeat_last_n tokens seen (prompt included) has a positive logit
     *    divided by repeat_penalty, a negative one multiplied by it. */
    float presence_penalty, frequency_penalty;   /* 0: off */
    float repeat_penalty;                        /* 0 or 1: off */
    int repeat_last_n;                           /* <= 0: 64 */
    const sampler_bias *bias;                    /* copied by sampler_new */
    int n_bias;
} sampler_params;

typedef struct sampler sampler;

sampler_params sampler_defaults(void);   /* greedy */
sampler *sampler_new(const sampler_params *p, int n_vocab);
void sampler_free(sampler *s);
int32_t sampler_sample(sampler *s, const float *logits);
/* Records a token of the sequence for the penalties: generated = 0 for
 * prompt tokens (only the repetition window sees them). */
void sampler_accept(sampler *s, int32_t id, int generated);
int32_t sampler_argmax(const float *logits, int n);

/* Speculative sampling (engine/spec_sample.h): the distribution
 * sampler_sample draws from, for these logits in this state (bias,
 * penalties, top-k, top-p, min-p, temperature; a point mass on the argmax
 * when greedy), written to probs[n_vocab] (0 outside the kept set); the
 * state is not advanced. top-p or min-p without top-k sorts the whole
 * vocabulary. */
void sampler_probs(sampler *s, const float *logits, float *probs);
int sampler_n_vocab(const sampler *s);
/* One uniform in [0, 1) from the sequence's generator. */
double sampler_unit(sampler *s);
/* A draw from probs[n_vocab] (any non-negative weights, normalised here)
 * with one uniform from the generator. */
int32_t sampler_draw(sampler *s, const float *probs);

/* A fresh seed from the kernel's generator (getrandom), in [0, 2^63) so that
 * it can be given back as a JSON integer or a --seed to replay the output. */
uint64_t sampler_fresh_seed(void);

/* The former implementation (sort every candidate), kept as the oracle for
 * the filtered paths and as their fallback near a rounding boundary. It uses
 * and advances s's random state exactly as sampler_sample does. */
int32_t sampler_ref_sample(sampler *s, const float *logits);

#endif
