/* spec_sample.h - speculative sampling for drafts SAMPLED from a draft
 * model's own distribution (Leviathan et al. 2023, Chen et al. 2023).
 *
 * A draft model with a temperature > 0 draws each draft x from q, its own
 * next-token distribution after the sequence's sampler transforms (the
 * draft's sampler: the same parameters, its own seed; spec_draft_sample).
 * The target verifies row by row with the sequence's sampler: p = the
 * distribution plain decoding would draw from (sampler_probs, after the
 * grammar and min_tokens masks the caller applied to the logits); x is
 * accepted with probability min(1, p(x) / q(x)); on the first rejection
 * the token is drawn from norm(max(0, p - q)), which is 0 at x, and the
 * step ends; when every draft is accepted the last row is drawn from p
 * (plain sampling). Each token then has exactly p's law: P(t) =
 * q(t) min(1, p(t)/q(t)) + P(reject) (p(t) - q(t))+ / sum (p - q)+ = p(t).
 *
 * Randomness: the draft's draws use the draft sampler's generator, the
 * acceptance and residual draws the sequence's, so a seeded run replays
 * the same tokens as long as the same drafts are asked for at the same
 * steps (fixed draft length; the adaptive length follows timings, so under
 * it a seed fixes the distribution, not the tokens). Greedy sequences never
 * come here (drafts are the draft model's argmax, a point mass: spec.h).
 */
#ifndef TANDEM_SPEC_SAMPLE_H
#define TANDEM_SPEC_SAMPLE_H

#include <stdint.h>

#include "engine/sampler.h"

/* Draws a draft from the draft model's logits with the draft sampler ds;
 * q[n_vocab] receives the distribution it was drawn from. */
int32_t spec_draft_sample(sampler *ds, const float *logits, float *q);

/* The target's token for a row whose draft x was drawn from q: x when
 * accepted, else a draw from the residual (never x). p: scratch [n_vocab].
 * Consumes one uniform of s (two on rejection). */
int32_t spec_verify_sample(sampler *s, const float *logits, int32_t x, const float *q, float *p);

#endif
