/* sampler.c - see sampler.h. */
#include "sampler.h"

#include <math.h>
#include <stdlib.h>

typedef struct { float logit; int32_t id; } cand;

struct sampler {
    sampler_params p;
    int n_vocab;
    uint64_t state;       /* splitmix64 state */
    cand *c;
};

sampler_params sampler_defaults(void) {
    sampler_params p = { .temp = 0.0f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f, .seed = 0 };
    return p;
}

sampler *sampler_new(const sampler_params *p, int n_vocab) {
    sampler *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->p = *p;
    s->n_vocab = n_vocab;
    s->state = p->seed;
    s->c = malloc(sizeof(cand) * (size_t)n_vocab);
    if (!s->c) { free(s); return NULL; }
    return s;
}

void sampler_free(sampler *s) {
    if (!s) return;
    free(s->c);
    free(s);
}

int32_t sampler_argmax(const float *logits, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++) if (logits[i] > logits[best]) best = i;
    return best;
}

/* splitmix64: small, fast, and the same on every platform */
static uint64_t sampler_next_u64(sampler *s) {
    uint64_t z = (s->state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

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

int32_t sampler_sample(sampler *s, const float *logits) {
    const sampler_params *p = &s->p;
    if (p->temp <= 0.0f) return sampler_argmax(logits, s->n_vocab);
    int n = s->n_vocab;
    for (int i = 0; i < n; i++) { s->c[i].logit = logits[i]; s->c[i].id = i; }
    n = sampler_top_k(s->c, n, p->top_k);
    /* softmax over the survivors at temperature 1 for top-p / min-p */
    double sum = 0.0;
    float mx = s->c[0].logit;
    for (int i = 0; i < n; i++) sum += exp(s->c[i].logit - mx);
    if (p->top_p < 1.0f) {
        double cum = 0.0;
        int keep = n;
        for (int i = 0; i < n; i++) {
            cum += exp(s->c[i].logit - mx) / sum;
            if (cum >= p->top_p) { keep = i + 1; break; }
        }
        n = keep;
    }
    if (p->min_p > 0.0f) {
        /* keep tokens whose probability is at least min_p times the best's */
        float thr = mx + logf(p->min_p);
        int keep = 1;
        while (keep < n && s->c[keep].logit >= thr) keep++;
        n = keep;
    }
    sum = 0.0;
    for (int i = 0; i < n; i++) sum += exp((s->c[i].logit - mx) / p->temp);
    double r = (double)(sampler_next_u64(s) >> 11) * (1.0 / 9007199254740992.0) * sum;
    double acc = 0.0;
    for (int i = 0; i < n; i++) {
        acc += exp((s->c[i].logit - mx) / p->temp);
        if (r < acc) return s->c[i].id;
    }
    return s->c[n - 1].id;
}
