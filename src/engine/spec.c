/* spec.c - see spec.h. */
#include "engine/spec.h"

#include <math.h>
#include <string.h>

/* ==== Prompt lookup ==== */

int spec_lookup(const int32_t *hist, int n, int k, int32_t *out) {
    if (k <= 0) return 0;
    if (k > SPEC_MAX_DRAFT) k = SPEC_MAX_DRAFT;
    for (int g = SPEC_NGRAM_MAX; g >= SPEC_NGRAM_MIN; g--) {
        if (n <= g) continue;
        const int32_t *key = hist + n - g;
        /* the most recent earlier start i (i + g <= n - 1: something follows it) */
        for (int i = n - g - 1; i >= 0; i--) {
            if (hist[i] != key[0] || memcmp(hist + i, key, sizeof(int32_t) * (size_t)g)) continue;
            int avail = n - (i + g), m = avail < k ? avail : k;
            memcpy(out, hist + i + g, sizeof(int32_t) * (size_t)m);
            return m;
        }
    }
    return 0;
}

/* ==== Adaptive draft length ==== */

/* Weight kept by the counts at each step: about the last 16 steps decide
 * (a text moves between quoting and writing on that scale). */
#define SPEC_DECAY 0.94
/* The prior, as accepted and rejected drafts: an unknown sequence starts at
 * alpha = 0.5, which pays for a few drafts at the costs seen (c ~ 0.05-0.2). */
#define SPEC_PRIOR_ACC 1.0
#define SPEC_PRIOR_REJ 1.0
/* With k at 0, one draft every SPEC_PROBE_EVERY steps where a draft costs
 * SPEC_PROBE_COST of a step or less, proportionally less often where it
 * costs more (a draft model's pass, its catch-up on the text since the last
 * probe): about 1% of the steps' time spent on finding out that drafts pay
 * again. */
#define SPEC_PROBE_EVERY 8
#define SPEC_PROBE_COST 0.08

void spec_adapt_init(spec_adapt *a) {
    memset(a, 0, sizeof *a);
    a->acc = SPEC_PRIOR_ACC;
    a->rej = SPEC_PRIOR_REJ;
}

int spec_adapt_k(spec_adapt *a, int k_max, double cost) {
    if (k_max <= 0) return 0;
    if (k_max > SPEC_MAX_DRAFT) k_max = SPEC_MAX_DRAFT;
    if (cost <= 0) return k_max;
    double alpha = a->acc / (a->acc + a->rej);
    if (alpha > 0.999) alpha = 0.999;
    double best = 1.0, pw = alpha;   /* k = 0: one token for a step's cost */
    int best_k = 0;
    for (int k = 1; k <= k_max; k++) {
        pw *= alpha;                 /* alpha^(k+1) */
        double gain = (1.0 - pw) / (1.0 - alpha) / (1.0 + cost * k);
        if (gain > best * 1.0001) { best = gain; best_k = k; }
    }
    if (best_k == 0) {
        double every = SPEC_PROBE_EVERY * (cost > SPEC_PROBE_COST ? cost / SPEC_PROBE_COST : 1.0);
        if (++a->idle >= every) { a->idle = 0; return 1; }
        return 0;
    }
    a->idle = 0;
    return best_k;
}

void spec_adapt_update(spec_adapt *a, int drafted, int accepted, int tokens) {
    a->steps++;
    a->step_tokens += (uint64_t)tokens;
    if (drafted <= 0) return;
    a->drafted += (uint64_t)drafted;
    a->accepted += (uint64_t)accepted;
    a->acc = a->acc * SPEC_DECAY + accepted;
    /* the first rejected draft ends the step: the ones after it were not tried */
    a->rej = a->rej * SPEC_DECAY + (accepted < drafted ? 1 : 0);
}

/* ==== What a verified row costs ==== */

/* Weight kept per pass: about the last 64 passes decide. */
#define SPEC_COST_DECAY 0.984
/* Rows must vary this much (variance, in rows^2) before a slope is fitted. */
#define SPEC_COST_MIN_VAR 0.5
/* Bounds of c: a row is never free (timer noise), nor dearer than two steps. */
#define SPEC_COST_MIN 0.005
#define SPEC_COST_MAX 1.0
/* The least share of a mean decode pass its fixed part (a) is taken to be. */
#define SPEC_COST_MIN_FIXED 0.25

void spec_cost_init(spec_cost *c) { memset(c, 0, sizeof *c); }

void spec_cost_add(spec_cost *c, int rows, double ms) {
    if (rows <= 0 || !(ms > 0) || !isfinite(ms)) return;
    double r = rows;
    c->w = c->w * SPEC_COST_DECAY + 1;
    c->r = c->r * SPEC_COST_DECAY + r;
    c->t = c->t * SPEC_COST_DECAY + ms;
    c->rr = c->rr * SPEC_COST_DECAY + r * r;
    c->rt = c->rt * SPEC_COST_DECAY + r * ms;
}

double spec_cost_row(const spec_cost *c, int n_seq, double prior) {
    if (c->w < 8) return prior;
    double mr = c->r / c->w, mt = c->t / c->w;
    double var = c->rr / c->w - mr * mr;
    if (var < SPEC_COST_MIN_VAR) return prior;
    double b = (c->rt / c->w - mr * mt) / var, a = mt - b * mr;
    if (!(b > 0)) return SPEC_COST_MIN;
    /* reading the weights is most of a decode pass: a fit that puts its
     * fixed part under a quarter of the mean pass is noise (a loaded
     * machine's preempted passes), measured: a = 0, c = 1, no drafts */
    if (a < SPEC_COST_MIN_FIXED * mt) a = SPEC_COST_MIN_FIXED * mt;
    double k = b / (a / (n_seq > 0 ? n_seq : 1) + b);
    return k < SPEC_COST_MIN ? SPEC_COST_MIN : k > SPEC_COST_MAX ? SPEC_COST_MAX : k;
}
