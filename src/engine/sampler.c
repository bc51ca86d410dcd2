/* sampler.c - see sampler.h. */
#include "engine/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/platform.h"

/* Weights are computed and summed in blocks of this many logits: a constant
 * trip count lets the compiler vectorise the inner loops at -O2, and the
 * per-block sums turn the draw into a scan over n/64 sums plus one block. */
#define SAMPLER_BLOCK 64

/* Top-p without top-k needs the mass of the whole vocabulary. It is first
 * summed with the fast exp (within 1.2e-7 of exp(), checked on every float
 * in [-87, 0]); a cut whose neighbouring masses lie within this margin of
 * top_p is redone with libm's exp summed in vocabulary order (off the
 * reference's rank-order sum by rounding only), and one within the second
 * margin of that by the reference itself. */
#define SAMPLER_TOP_P_MARGIN 5e-7
#define SAMPLER_TOP_P_MARGIN_EXACT 1e-10

typedef struct { float logit; int32_t id; } cand;

/* Default repetition window, as llama.cpp's penalty_last_n. */
#define SAMPLER_REPEAT_LAST_N 64

struct sampler {
    sampler_params p;
    int n_vocab;
    uint64_t state;       /* splitmix64 state */
    cand *c;              /* candidates, n_vocab */
    float *w;             /* softmax weights, n_vocab */
    double *bsum;         /* per-block weight sums */
    /* logit adjustments (bias, penalties): NULL when none is asked for */
    float *adj;           /* n_vocab: the adjusted copy */
    sampler_bias *bias;   /* own copy of p.bias */
    uint32_t *count;      /* n_vocab: times generated (presence/frequency) */
    int32_t *recent;      /* ring of the last repeat_last_n tokens seen */
    int n_recent, recent_at;
};

static int sampler_adjusts(const sampler_params *p) {
    return p->n_bias > 0 || p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f ||
           (p->repeat_penalty != 0.0f && p->repeat_penalty != 1.0f);
}

sampler_params sampler_defaults(void) {
    sampler_params p = { .temp = 0.0f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f, .seed = 0 };
    return p;
}

sampler *sampler_new(const sampler_params *p, int n_vocab) {
    if (n_vocab < 1) return NULL;
    sampler *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->p = *p;
    s->n_vocab = n_vocab;
    s->state = p->seed;
    s->c = malloc(sizeof(cand) * (size_t)n_vocab);
    s->w = malloc(sizeof(float) * (size_t)n_vocab);
    s->bsum = malloc(sizeof(double) * ((size_t)n_vocab / SAMPLER_BLOCK + 1));
    if (!s->c || !s->w || !s->bsum) { sampler_free(s); return NULL; }
    if (sampler_adjusts(p)) {
        if (s->p.repeat_last_n <= 0) s->p.repeat_last_n = SAMPLER_REPEAT_LAST_N;
        s->adj = malloc(sizeof(float) * (size_t)n_vocab);
        s->count = calloc((size_t)n_vocab, sizeof(uint32_t));
        s->recent = malloc(sizeof(int32_t) * (size_t)s->p.repeat_last_n);
        s->bias = p->n_bias > 0 ? malloc(sizeof(sampler_bias) * (size_t)p->n_bias) : NULL;
        if (!s->adj || !s->count || !s->recent || (p->n_bias > 0 && !s->bias)) { sampler_free(s); return NULL; }
        if (p->n_bias > 0) memcpy(s->bias, p->bias, sizeof(sampler_bias) * (size_t)p->n_bias);
        s->p.bias = s->bias;
    } else {
        s->p.bias = NULL;
        s->p.n_bias = 0;
    }
    return s;
}

void sampler_accept(sampler *s, int32_t id, int generated) {
    if (!s->adj || id < 0 || id >= s->n_vocab) return;
    if (generated) s->count[id]++;
    s->recent[s->recent_at] = id;
    s->recent_at = (s->recent_at + 1) % s->p.repeat_last_n;
    if (s->n_recent < s->p.repeat_last_n) s->n_recent++;
}

/* The adjusted copy: bias, then the repetition penalty over the distinct
 * recent tokens, then presence/frequency over the generated ones. */
static const float *sampler_adjust(sampler *s, const float *logits) {
    const sampler_params *p = &s->p;
    memcpy(s->adj, logits, sizeof(float) * (size_t)s->n_vocab);
    for (int i = 0; i < p->n_bias; i++)
        if (p->bias[i].id >= 0 && p->bias[i].id < s->n_vocab) s->adj[p->bias[i].id] += p->bias[i].bias;
    if (p->repeat_penalty != 0.0f && p->repeat_penalty != 1.0f) {
        for (int i = 0; i < s->n_recent; i++) {
            int32_t id = s->recent[i];
            int seen = 0;   /* each distinct token once, as llama.cpp */
            for (int k = 0; k < i && !seen; k++) seen = s->recent[k] == id;
            if (seen) continue;
            float *l = &s->adj[id];
            *l = *l > 0 ? *l / p->repeat_penalty : *l * p->repeat_penalty;
        }
    }
    if (p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f)
        for (int i = 0; i < s->n_vocab; i++)
            if (s->count[i]) s->adj[i] -= p->presence_penalty + p->frequency_penalty * (float)s->count[i];
    return s->adj;
}

void sampler_free(sampler *s) {
    if (!s) return;
    free(s->c);
    free(s->w);
    free(s->bsum);
    free(s->adj);
    free(s->bias);
    free(s->count);
    free(s->recent);
    free(s);
}


uint64_t sampler_fresh_seed(void) {
    uint64_t v = 0;
    if (plat_random(&v, sizeof v, 0)) {
        /* No kernel generator (very old kernel, seccomp): the clock still
         * makes two requests differ. */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        v = (uint64_t)ts.tv_sec * 1000000007ULL ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)(uintptr_t)&v << 17);
    }
    return v & (uint64_t)INT64_MAX;
}

/* ==== Random numbers ==== */

/* splitmix64: small, fast, and the same on every platform */
static uint64_t sampler_next_u64(sampler *s) {
    uint64_t z = (s->state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Uniform in [0, 1) from the top 53 bits: one per sampled token. */
static double sampler_next_unit(sampler *s) {
    return (double)(sampler_next_u64(s) >> 11) * (1.0 / 9007199254740992.0);
}

/* ==== Candidates in rank order ==== */

static int cand_cmp(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->logit != y->logit) return x->logit < y->logit ? 1 : -1;
    return x->id < y->id ? -1 : (x->id > y->id);
}

static int cand_better(const cand *x, const cand *y) {
    return x->logit > y->logit || (x->logit == y->logit && x->id < y->id);
}

/* Move the k best candidates to the front (quickselect), then sort them. */
static int sampler_top_k(cand *c, int n, int k) {
    if (k <= 0 || k > n) k = n;
    int lo = 0, hi = n - 1;
    while (k < n && lo < hi) {
        cand pivot = c[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (cand_better(&c[i], &pivot)) i++;
            while (cand_better(&pivot, &c[j])) j--;
            if (i <= j) { cand t = c[i]; c[i] = c[j]; c[j] = t; i++; j--; }
        }
        if (k - 1 <= j) hi = j; else if (k - 1 >= i) lo = i; else break;
    }
    qsort(c, (size_t)k, sizeof *c, cand_cmp);
    return k;
}

/* Min-heap on rank (the worst candidate at the root). */
static void sampler_heap_down(cand *h, int n, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, w = i;
        if (l < n && cand_better(&h[w], &h[l])) w = l;
        if (r < n && cand_better(&h[w], &h[r])) w = r;
        if (w == i) return;
        cand t = h[i]; h[i] = h[w]; h[w] = t;
        i = w;
    }
}

/* s->c[0..m) = the m best candidates, sorted by rank; returns m (<= n).
 * Small m: one pass with a bounded heap, whose root is rarely beaten once
 * warm (ids rise, so a tie never displaces it). Large m: quickselect. */
static int sampler_select(sampler *s, const float *logits, int m) {
    int n = s->n_vocab;
    cand *c = s->c;
    if (m >= n) m = n;
    if ((long long)m * 16 > n) {
        for (int i = 0; i < n; i++) { c[i].logit = logits[i]; c[i].id = i; }
        return sampler_top_k(c, n, m);
    }
    for (int i = 0; i < m; i++) { c[i].logit = logits[i]; c[i].id = i; }
    for (int i = m / 2 - 1; i >= 0; i--) sampler_heap_down(c, m, i);
    for (int i = m; i < n; i++) {
        if (!(logits[i] > c[0].logit)) continue;
        c[0].logit = logits[i];
        c[0].id = i;
        sampler_heap_down(c, m, 0);
    }
    qsort(c, (size_t)m, sizeof *c, cand_cmp);
    return m;
}

/* ==== The reference arithmetic on sorted candidates ==== */

/* Keep the shortest prefix whose mass (at temperature 1, over sum) reaches
 * top_p; n + 1 when no prefix of c[0..n) reaches it. *close: the masses on
 * either side of the cut lie within margin of top_p, so a sum that is off
 * by less than margin (relative) could move the cut. */
static int sampler_cut_top_p(const cand *c, int n, float mx, double sum, float top_p, double margin, int *close) {
    double cum = 0.0, prev = 0.0;
    for (int i = 0; i < n; i++) {
        cum += exp(c[i].logit - mx) / sum;
        if (cum >= top_p) {
            *close = cum - top_p < margin || top_p - prev < margin;
            return i + 1;
        }
        prev = cum;
    }
    *close = top_p - cum < margin;
    return n + 1;
}

/* Keep tokens whose probability is at least min_p times the best's. */
static int sampler_cut_min_p(const cand *c, int n, float mx, float min_p) {
    float thr = mx + logf(min_p);
    int keep = 1;
    while (keep < n && c[keep].logit >= thr) keep++;
    return keep;
}

/* Draw from the softmax at temperature temp over c[0..n), in rank order. */
static int32_t sampler_draw_sorted(const cand *c, int n, float mx, float temp, double u) {
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += exp((c[i].logit - mx) / temp);
    double r = u * sum;
    double acc = 0.0;
    for (int i = 0; i < n; i++) {
        acc += exp((c[i].logit - mx) / temp);
        if (r < acc) return c[i].id;
    }
    return c[n - 1].id;
}

/* top-p (mass over the n candidates' own sum), then min-p, over rank-sorted
 * candidates: how many of them are kept (the draw and the speculative
 * distributions cut the same way). */
static int sampler_cut_sorted(const sampler_params *p, const cand *c, int n) {
    float mx = c[0].logit;
    if (p->top_p < 1.0f) {
        double sum = 0.0;
        for (int i = 0; i < n; i++) sum += exp(c[i].logit - mx);
        int close = 0, keep = sampler_cut_top_p(c, n, mx, sum, p->top_p, 0.0, &close);
        if (keep <= n) n = keep;
    }
    if (p->min_p > 0.0f) n = sampler_cut_min_p(c, n, mx, p->min_p);
    return n;
}

/* top-p, min-p (sampler_cut_sorted), draw. */
static int32_t sampler_finish_sorted(const sampler_params *p, const cand *c, int n, double u) {
    float mx = c[0].logit;
    n = sampler_cut_sorted(p, c, n);
    return sampler_draw_sorted(c, n, mx, p->temp, u);
}

static int32_t sampler_ref_pick(sampler *s, const float *logits, double u) {
    int n = s->n_vocab;
    for (int i = 0; i < n; i++) { s->c[i].logit = logits[i]; s->c[i].id = i; }
    n = sampler_top_k(s->c, n, s->p.top_k);
    return sampler_finish_sorted(&s->p, s->c, n, u);
}

int32_t sampler_ref_sample(sampler *s, const float *logits) {
    if (s->p.temp <= 0.0f) return sampler_argmax(logits, s->n_vocab);
    return sampler_ref_pick(s, logits, sampler_next_unit(s));
}

/* ==== Vectorised softmax passes ==== */

/* a * b + c, fused where the target has FMA (half the polynomial's
 * instructions; results then differ from a non-FMA build by an ulp, so a
 * seed replays the same tokens on the same kind of build). */
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
#define SAMPLER_MADD(a, b, c) fmaf(a, b, c)
#else
#define SAMPLER_MADD(a, b, c) ((a) * (b) + (c))
#endif

/* exp(x) for -87 <= x <= 0 in float: x = k ln2 + r with |r| <= ln2/2, then
 * 2^k * p(r) with Cephes' expf polynomial. Relative error, checked on
 * every float in [-87, 0]: 8.2e-8 without FMA, 1.2e-7 with. */
static inline float sampler_exp_poly(float x) {
    int32_t ki = (int32_t)(x * 1.44269504088896341f - 0.5f);   /* round to nearest: x <= 0 */
    float k = (float)ki;
    float r = SAMPLER_MADD(k, 2.12194440e-4f, SAMPLER_MADD(k, -0.693359375f, x));
    float p = 1.9875691500e-4f;
    p = SAMPLER_MADD(p, r, 1.3981999507e-3f);
    p = SAMPLER_MADD(p, r, 8.3334519073e-3f);
    p = SAMPLER_MADD(p, r, 4.1665795894e-2f);
    p = SAMPLER_MADD(p, r, 1.6666665459e-1f);
    p = SAMPLER_MADD(p, r, 5.0000001201e-1f);
    p = SAMPLER_MADD(p, r * r, r + 1.0f);
    union { int32_t i; float f; } scale = { .i = (ki + 127) << 23 };
    return p * scale.f;
}

/* w[j] = exp((l[j] - mx) * inv_temp) for one block; 0 at or below -87
 * (2^-126, the last normal float; -inf from masked logits). Returns the
 * block's sum. Three branch-free loops: one loop with the clamp and the
 * polynomial gets split by the compiler into branches and is not
 * vectorised. */
static float sampler_exp_block(const float *l, float mx, float inv_temp, float *w) {
    float x[SAMPLER_BLOCK];
    for (int j = 0; j < SAMPLER_BLOCK; j++) {
        float v = (l[j] - mx) * inv_temp;
        v = v > -87.0f ? v : -87.0f;
        x[j] = v < 0.0f ? v : 0.0f;
    }
    for (int j = 0; j < SAMPLER_BLOCK; j++) w[j] = sampler_exp_poly(x[j]);
    for (int j = 0; j < SAMPLER_BLOCK; j++) w[j] = x[j] > -87.0f ? w[j] : 0.0f;
    /* float lanes: 8 terms of at most 1 each, exact enough for a block */
    float acc[8] = {0};
    for (int j = 0; j < SAMPLER_BLOCK; j += 8)
        for (int q = 0; q < 8; q++) acc[q] += w[j + q];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

static float sampler_max(const float *x, int n) {
    float lane[16];
    for (int j = 0; j < 16; j++) lane[j] = -INFINITY;
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) lane[j] = x[i + j] > lane[j] ? x[i + j] : lane[j];
    float m = -INFINITY;
    for (int j = 0; j < 16; j++) m = lane[j] > m ? lane[j] : m;
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* w[i] = exp((l[i] - mx) / temp) (w may be NULL: the draw recomputes one
 * block), bsum[b] = sum of block b; returns the total. Multiplying by 1/temp moves the argument by an ulp at most from
 * the reference's division; the top-p sums (temp 1) are unaffected. The
 * last, partial block is padded with masked logits. */
static double sampler_weights(const float *l, int n, float mx, float temp, float *w, double *bsum) {
    double total = 0.0;
    float inv = 1.0f / temp;
    int i = 0, b = 0;
    float wb[SAMPLER_BLOCK];
    for (; i + SAMPLER_BLOCK <= n; i += SAMPLER_BLOCK, b++) total += bsum[b] = sampler_exp_block(l + i, mx, inv, w ? w + i : wb);
    if (i < n) {
        float pad[SAMPLER_BLOCK];
        for (int j = 0; j < SAMPLER_BLOCK; j++) pad[j] = i + j < n ? l[i + j] : -INFINITY;
        total += bsum[b] = sampler_exp_block(pad, mx, inv, wb);
        if (w) memcpy(w + i, wb, sizeof(float) * (size_t)(n - i));
    }
    return total;
}

/* The first (lowest) id holding the largest logit: a vectorised max, then
 * a scan that stops at it. */
int32_t sampler_argmax(const float *logits, int n) {
    float mx = sampler_max(logits, n);
    for (int i = 0; i < n; i++) if (logits[i] == mx) return i;
    return 0;   /* all NaN */
}

/* ==== Sampling paths ==== */

/* No filter: draw from the softmax in vocabulary order: find the block by
 * its sum, then recompute that block's weights (the same arithmetic) and
 * scan them. */
static int32_t sampler_pick_softmax(sampler *s, const float *logits, double u) {
    int n = s->n_vocab;
    float mx = sampler_max(logits, n), inv = 1.0f / s->p.temp;
    double total = sampler_weights(logits, n, mx, s->p.temp, NULL, s->bsum);
    double r = u * total, acc = 0.0;
    int nb = (n + SAMPLER_BLOCK - 1) / SAMPLER_BLOCK, last = -1;
    for (int b = 0; b < nb; b++) {
        if (s->bsum[b] <= 0.0) continue;
        if (r >= acc + s->bsum[b]) { acc += s->bsum[b]; last = b; continue; }
        float pad[SAMPLER_BLOCK], w[SAMPLER_BLOCK];
        int i0 = b * SAMPLER_BLOCK;
        for (int j = 0; j < SAMPLER_BLOCK; j++) pad[j] = i0 + j < n ? logits[i0 + j] : -INFINITY;
        sampler_exp_block(pad, mx, inv, w);
        for (int j = 0; j < SAMPLER_BLOCK; j++) {
            acc += w[j];
            if (w[j] > 0.0f && r < acc) return i0 + j;
        }
        last = b;   /* rounding left r just past the block's own running sum: go on */
    }
    if (last < 0) return sampler_argmax(logits, n);   /* no weight at all (NaN logits) */
    float pad[SAMPLER_BLOCK], w[SAMPLER_BLOCK];
    int i0 = last * SAMPLER_BLOCK;
    for (int j = 0; j < SAMPLER_BLOCK; j++) pad[j] = i0 + j < n ? logits[i0 + j] : -INFINITY;
    sampler_exp_block(pad, mx, inv, w);
    for (int j = SAMPLER_BLOCK - 1; j > 0; j--) if (w[j] > 0.0f) return i0 + j;
    return i0;
}

/* Rank buckets for top-p: a quarter of a nat of logit each (weights within
 * a factor 1.28), 40 nats in all; everything further down shares the last. */
#define SAMPLER_BUCKETS_PER_NAT 4.0f
#define SAMPLER_NBUCKETS 160

static int sampler_bucket(float l, float mx) {
    float d = (mx - l) * SAMPLER_BUCKETS_PER_NAT;
    return d < (float)(SAMPLER_NBUCKETS - 1) ? (int)d : SAMPLER_NBUCKETS - 1;
}

/* Last bucket of the shortest run of top buckets whose (approximate) mass
 * at temperature 1 surely reaches top_p; *sum = the whole mass. */
static int sampler_top_p_bucket(sampler *s, const float *logits, float mx, float top_p, double *sum) {
    int n = s->n_vocab;
    *sum = sampler_weights(logits, n, mx, 1.0f, s->w, s->bsum);
    double mass[SAMPLER_NBUCKETS] = {0};
    for (int i = 0; i < n; i++) mass[sampler_bucket(logits[i], mx)] += s->w[i];
    double target = (top_p + 2 * SAMPLER_TOP_P_MARGIN) * *sum, cum = 0.0;
    for (int b = 0; b < SAMPLER_NBUCKETS - 1; b++) {
        cum += mass[b];
        if (cum >= target) return b;
    }
    return SAMPLER_NBUCKETS - 1;
}

/* top-p and/or min-p over the whole vocabulary. Both keep a prefix of the
 * ranking: gather the tokens of the top-p buckets that pass min-p (a rank
 * prefix too), sort only those, and cut them as the reference does. */
static int32_t sampler_pick_prefix(sampler *s, const float *logits, double u) {
    const sampler_params *p = &s->p;
    int n = s->n_vocab;
    float mx = sampler_max(logits, n);
    double sum = 0.0;
    int last = SAMPLER_NBUCKETS - 1;
    if (p->top_p < 1.0f) last = sampler_top_p_bucket(s, logits, mx, p->top_p, &sum);
    int use_min_p = p->min_p > 0.0f;
    float thr = use_min_p ? mx + logf(p->min_p) : -INFINITY;
    int g = 0, in_buckets = 0;
    for (int i = 0; i < n; i++) {
        if (last < SAMPLER_NBUCKETS - 1 && sampler_bucket(logits[i], mx) > last) continue;
        in_buckets++;
        if (use_min_p && !(logits[i] >= thr)) continue;
        s->c[g].logit = logits[i];
        s->c[g].id = i;
        g++;
    }
    if (g == 0) { s->c[0].logit = mx; s->c[0].id = sampler_argmax(logits, n); g = 1; }   /* min_p > 1 */
    qsort(s->c, (size_t)g, sizeof *s->c, cand_cmp);
    int keep = g;
    if (p->top_p < 1.0f) {
        int close = 0, cut = sampler_cut_top_p(s->c, g, mx, sum, p->top_p, SAMPLER_TOP_P_MARGIN, &close);
        if (close) {
            sum = 0.0;
            for (int i = 0; i < n; i++) sum += exp(logits[i] - mx);
            cut = sampler_cut_top_p(s->c, g, mx, sum, p->top_p, SAMPLER_TOP_P_MARGIN_EXACT, &close);
            if (close) return sampler_ref_pick(s, logits, u);
        }
        if (cut <= g) keep = cut;
        else if (g == in_buckets && last < SAMPLER_NBUCKETS - 1) return sampler_ref_pick(s, logits, u);
    }
    if (use_min_p) keep = sampler_cut_min_p(s->c, keep, mx, p->min_p);
    return sampler_draw_sorted(s->c, keep, mx, p->temp, u);
}

int32_t sampler_sample(sampler *s, const float *logits) {
    const sampler_params *p = &s->p;
    if (s->adj) logits = sampler_adjust(s, logits);
    if (p->temp <= 0.0f) return sampler_argmax(logits, s->n_vocab);
    double u = sampler_next_unit(s);
    if (p->top_k > 0 && p->top_k < s->n_vocab) {
        int k = sampler_select(s, logits, p->top_k);
        return sampler_finish_sorted(p, s->c, k, u);
    }
    if (p->top_p >= 1.0f && p->min_p <= 0.0f) return sampler_pick_softmax(s, logits, u);
    return sampler_pick_prefix(s, logits, u);
}

/* ==== Distributions (speculative sampling) ==== */

double sampler_unit(sampler *s) { return sampler_next_unit(s); }

/* probs over rank-sorted candidates c[0..n): the reference's cuts, then the
 * softmax at temperature; the rest of the vocabulary stays 0. */
static void sampler_probs_sorted(const sampler_params *p, const cand *c, int n, float *probs) {
    float mx = c[0].logit;
    n = sampler_cut_sorted(p, c, n);
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += exp((c[i].logit - mx) / p->temp);
    for (int i = 0; i < n; i++) probs[c[i].id] = (float)(exp((c[i].logit - mx) / p->temp) / sum);
}

void sampler_probs(sampler *s, const float *logits, float *probs) {
    const sampler_params *p = &s->p;
    int n = s->n_vocab;
    if (s->adj) logits = sampler_adjust(s, logits);
    memset(probs, 0, sizeof(float) * (size_t)n);
    if (p->temp <= 0.0f) { probs[sampler_argmax(logits, n)] = 1.0f; return; }
    float mx = sampler_max(logits, n);
    if (!(mx > -INFINITY)) { probs[sampler_argmax(logits, n)] = 1.0f; return; }   /* all masked or NaN */
    if (p->top_k <= 0 && p->top_p >= 1.0f && p->min_p <= 0.0f) {
        double sum = 0.0;
        for (int i = 0; i < n; i++) sum += exp((logits[i] - mx) / p->temp);
        for (int i = 0; i < n; i++) probs[i] = (float)(exp((logits[i] - mx) / p->temp) / sum);
        return;
    }
    /* top-k selects its k; top-p / min-p alone sort the vocabulary (the
     * reference's arithmetic: a draft model's rows only) */
    int k = sampler_select(s, logits, p->top_k > 0 && p->top_k < n ? p->top_k : n);
    sampler_probs_sorted(p, s->c, k, probs);
}

int32_t sampler_draw(sampler *s, const float *probs) {
    double r = sampler_next_unit(s), sum = 0.0, acc = 0.0;
    int n = s->n_vocab, last = -1;
    for (int i = 0; i < n; i++) sum += probs[i];
    r *= sum;
    for (int i = 0; i < n; i++) {
        if (!(probs[i] > 0.0f)) continue;
        acc += probs[i];
        last = i;
        if (r < acc) return i;
    }
    return last >= 0 ? last : 0;   /* rounding past the end: the last token with mass */
}

int sampler_n_vocab(const sampler *s) { return s->n_vocab; }
