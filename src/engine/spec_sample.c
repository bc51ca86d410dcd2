/* spec_sample.c - see spec_sample.h. */
#include "engine/spec_sample.h"

/* ==== Drafting ==== */

int32_t spec_draft_sample(sampler *ds, const float *logits, float *q) {
    sampler_probs(ds, logits, q);
    return sampler_draw(ds, q);
}

/* ==== Verifying ==== */

int32_t spec_verify_sample(sampler *s, const float *logits, int32_t x, const float *q, float *p) {
    sampler_probs(s, logits, p);
    double u = sampler_unit(s);
    /* accept with probability min(1, p(x) / q(x)): u q(x) < p(x) */
    if (x >= 0 && q[x] > 0.0f && u * (double)q[x] < (double)p[x]) return x;
    int n = sampler_n_vocab(s);
    double rest = 0.0;
    for (int i = 0; i < n; i++) {
        float d = p[i] - q[i];
        rest += d > 0.0f ? d : 0.0f;
    }
    /* p == q up to rounding: a rejection came from rounding alone, and p
     * itself is the law to draw from (x kept out as the residual would) */
    if (!(rest > 1e-12)) {
        if (x >= 0 && x < n) p[x] = 0.0f;
        return sampler_draw(s, p);
    }
    for (int i = 0; i < n; i++) {
        float d = p[i] - q[i];
        p[i] = d > 0.0f ? d : 0.0f;
    }
    return sampler_draw(s, p);
}
