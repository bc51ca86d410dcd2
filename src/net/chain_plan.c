/* chain_plan.c - half-block costs and the bounds of a chain (see
 * chain_plan.h, docs/layer-split.md "Planning a chain"). */
#include "net/chain_plan.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/wire_act.h"

/* ==== Costs ==== */

static int chain_plan_check_shape(const model_hparams *h, int tokens, int logit_rows, char *err, size_t errlen) {
    if (!h || h->n_layer < 1 || h->n_layer > WIRE_LAYERS_MAX || h->n_embd < 1 || h->n_head < 1 || h->n_head_kv < 1 ||
        h->head_dim_k < 1 || h->n_vocab < 1 || (h->n_expert ? h->n_expert_used < 1 || h->n_ff_exp < 1 : h->n_ff < 1)) {
        snprintf(err, errlen, "model shape out of range (%d blocks: 1..%d; widths, heads, vocabulary >= 1)",
                 h ? h->n_layer : 0, WIRE_LAYERS_MAX);
        return -1;
    }
    if (tokens < 1 || tokens > CHAIN_PLAN_MAX_TOKENS || logit_rows < 0 || logit_rows > tokens) {
        snprintf(err, errlen, "%d prompt tokens, %d of them wanting logits: must be 1..%d, 0..tokens", tokens,
                 logit_rows, CHAIN_PLAN_MAX_TOKENS);
        return -1;
    }
    return 0;
}

/* Per row: the Q/K/V projections, the output projection, the feed-forward. */
static double chain_plan_row_qkv(const model_hparams *h) {
    double E = h->n_embd, hd = h->head_dim_k;
    return 2 * E * (h->n_head * hd + 2 * h->n_head_kv * hd);
}
static double chain_plan_row_wo(const model_hparams *h) { return 2.0 * h->n_head * h->head_dim_k * h->n_embd; }
static double chain_plan_row_ffn(const model_hparams *h) {
    double E = h->n_embd;
    return h->n_expert ? 2 * E * h->n_expert + 6.0 * E * h->n_ff_exp * h->n_expert_used : 6 * E * h->n_ff;
}

double chain_plan_row_mat(const model_hparams *h) {
    return chain_plan_row_qkv(h) + chain_plan_row_wo(h) + chain_plan_row_ffn(h);
}

double chain_plan_attn_span(const model_hparams *h, double pos0, double n) {
    /* scores and weighted sum: 2 x 2 n_head hd FLOPs per position read,
     * rows pos0 .. pos0 + n - 1 reading pos0 + 1 .. pos0 + n of them */
    return 4.0 * h->n_head * h->head_dim_k * (n * pos0 + n * (n + 1) / 2);
}

int chain_plan_kinds(const model_hparams *h, int tokens, int logit_rows, double *out, char *err, size_t errlen) {
    if (chain_plan_check_shape(h, tokens, logit_rows, err, errlen)) return -1;
    double T = tokens, E = h->n_embd;
    double qkv = T * chain_plan_row_qkv(h), wo = T * chain_plan_row_wo(h), ffn = T * chain_plan_row_ffn(h);
    double attend = chain_plan_attn_span(h, 0, T);
    int L = h->n_layer;
    for (int l = 0; l < L; l++) {
        out[2 * l * CHAIN_KINDS + CHAIN_KIND_MAT] = qkv + wo;
        out[2 * l * CHAIN_KINDS + CHAIN_KIND_ATTN] = attend;
        out[(2 * l + 1) * CHAIN_KINDS + CHAIN_KIND_MAT] = ffn;
        out[(2 * l + 1) * CHAIN_KINDS + CHAIN_KIND_ATTN] = 0;
    }
    double *last = out + (2 * L - 2) * CHAIN_KINDS;
    if (!logit_rows) {   /* nothing reads the last block's output: its K/V only */
        last[CHAIN_KIND_MAT] = qkv;
        last[CHAIN_KIND_ATTN] = 0;
        last[CHAIN_KINDS + CHAIN_KIND_MAT] = 0;
    } else {
        last[CHAIN_KINDS + CHAIN_KIND_MAT] += 2.0 * logit_rows * E * h->n_vocab;
    }
    out[CHAIN_KIND_MAT] += T * E;   /* the embedding rows, one copy per token */
    return 0;
}

int chain_plan_weigh(const double *kinds, int n_half, double attn_rate, double *out, char *err, size_t errlen) {
    if (!(attn_rate >= CHAIN_PLAN_ATTN_RATE_MIN && attn_rate <= CHAIN_PLAN_ATTN_RATE_MAX)) {
        snprintf(err, errlen, "attention rate %g is out of range (%g..%g of the weight products')", attn_rate,
                 CHAIN_PLAN_ATTN_RATE_MIN, CHAIN_PLAN_ATTN_RATE_MAX);
        return -1;
    }
    for (int k = 0; k < n_half; k++)
        out[k] = kinds[k * CHAIN_KINDS + CHAIN_KIND_MAT] + kinds[k * CHAIN_KINDS + CHAIN_KIND_ATTN] / attn_rate;
    return 0;
}

int chain_plan_costs(const model_hparams *h, int tokens, int logit_rows, double *out, char *err, size_t errlen) {
    if (chain_plan_check_shape(h, tokens, logit_rows, err, errlen)) return -1;
    double *kinds = malloc(sizeof(double) * CHAIN_KINDS * 2 * (size_t)h->n_layer);
    if (!kinds) { snprintf(err, errlen, "out of memory"); return -1; }
    int rc = chain_plan_kinds(h, tokens, logit_rows, kinds, err, errlen);
    if (!rc) rc = chain_plan_weigh(kinds, 2 * h->n_layer, 1.0, out, err, errlen);
    free(kinds);
    return rc;
}

/* ==== Bounds ==== */

void chain_plan_price(chain_plan *p, const double *cost, const double *rates) {
    p->slowest = p->total = 0;
    for (int i = 0; i < p->n; i++) {
        double f = 0;
        for (int k = p->lo[i]; k < p->hi[i]; k++) f += cost[k];
        p->flops[i] = f;
        p->time[i] = f / (rates ? rates[i] : 1.0);
        p->total += f;
        if (p->time[i] > p->slowest) p->slowest = p->time[i];
    }
}

static int chain_plan_check(const double *cost, int n_half, int n, const double *rates, char *err, size_t errlen) {
    int most = n_half / 2 < CHAIN_SPEC_MAX ? n_half / 2 : CHAIN_SPEC_MAX;
    if (n_half < 2 || n_half % 2 || n_half > 2 * WIRE_LAYERS_MAX) {
        snprintf(err, errlen, "%d half blocks (must be even, 2..%d)", n_half, 2 * WIRE_LAYERS_MAX);
        return -1;
    }
    if (n < 1 || n > most) {
        snprintf(err, errlen, "%d nodes for %d blocks: must be 1..%d (each node computes at least one block's "
                 "attention; a chain has at most %d nodes)", n, n_half / 2, most, CHAIN_SPEC_MAX);
        return -1;
    }
    for (int i = 0; rates && i < n; i++)
        if (!(rates[i] >= CHAIN_PLAN_RATE_MIN && rates[i] <= CHAIN_PLAN_RATE_MAX)) {
            snprintf(err, errlen, "node %d's rate %g is out of range (%g..%g)", i + 1, rates[i], CHAIN_PLAN_RATE_MIN,
                     CHAIN_PLAN_RATE_MAX);
            return -1;
        }
    for (int k = 0; k < n_half; k++)
        if (!(cost[k] >= 0 && isfinite(cost[k]))) {
            snprintf(err, errlen, "half block %d's cost %g is not a finite number >= 0", k, cost[k]);
            return -1;
        }
    return 0;
}

int chain_plan_solve(const double *cost, int n_half, int n, const double *rates, chain_plan *out, char *err,
                     size_t errlen) {
    memset(out, 0, sizeof *out);
    if (chain_plan_check(cost, n_half, n, rates, err, errlen)) return -1;
    size_t H1 = (size_t)n_half + 1;
    double *pre = malloc(sizeof(double) * H1), *best = malloc(sizeof(double) * H1 * (size_t)(n + 1));
    int *from = malloc(sizeof(int) * H1 * (size_t)(n + 1));
    if (!pre || !best || !from) {
        free(pre); free(best); free(from);
        snprintf(err, errlen, "out of memory for a plan of %d half blocks", n_half);
        return -1;
    }
    pre[0] = 0;
    for (int k = 0; k < n_half; k++) pre[k + 1] = pre[k] + cost[k];
    /* best[j][i]: the least slowest time of nodes 0..j-1 covering half
     * blocks [0, i), the last of them starting at from[j][i]. A slice
     * [a, i) computes an attention when it holds an even half block:
     * (a + 1) / 2 < (i + 1) / 2 (wire_layers_kv). */
    for (size_t i = 0; i < H1 * (size_t)(n + 1); i++) { best[i] = INFINITY; from[i] = -1; }
    best[0] = 0;
    for (int j = 1; j <= n; j++) {
        double r = rates ? rates[j - 1] : 1.0;
        for (int i = 1; i <= n_half; i++) {
            double *b = &best[(size_t)j * H1 + (size_t)i];
            for (int a = 0; wire_layers_kv(a) < wire_layers_kv(i); a++) {
                double prev = best[(size_t)(j - 1) * H1 + (size_t)a];
                if (prev == INFINITY) continue;
                double t = (pre[i] - pre[a]) / r, m = t > prev ? t : prev;
                if (m < *b) { *b = m; from[(size_t)j * H1 + (size_t)i] = a; }
            }
        }
    }
    out->n = n;
    for (int j = n, i = n_half; j >= 1; j--) {
        int a = from[(size_t)j * H1 + (size_t)i];
        out->lo[j - 1] = a;
        out->hi[j - 1] = i;
        i = a;
    }
    free(pre); free(best); free(from);
    chain_plan_price(out, cost, rates);
    return 0;
}

int chain_plan_count(const double *cost, int n_layer, int n, const double *rates, chain_plan *out) {
    char err[160];
    memset(out, 0, sizeof *out);
    if (n_layer < 1 || n_layer > WIRE_LAYERS_MAX || chain_plan_check(cost, 2 * n_layer, n, rates, err, sizeof err))
        return -1;
    out->n = n;
    for (int k = 0; k < n; k++) {
        out->lo[k] = 2 * (int)((long)k * n_layer / n);
        out->hi[k] = 2 * (int)((long)(k + 1) * n_layer / n);
    }
    chain_plan_price(out, cost, rates);
    return 0;
}

size_t chain_plan_spec(const chain_plan *p, const char *const *hosts, char *buf, size_t len) {
    size_t o = 0;
    if (len) buf[0] = 0;
    for (int i = 0; i < p->n; i++) {
        char t[40], ph[32];
        wire_layers_format(t, sizeof t, p->lo[i], p->hi[i]);
        snprintf(ph, sizeof ph, "HOST%d:PORT", i + 1);
        const char *h = hosts && hosts[i] ? hosts[i] : ph;
        int k = snprintf(buf + (o < len ? o : len ? len - 1 : 0), o < len ? len - o : 0, "%s%s/%s", i ? "," : "", h, t);
        if (k > 0) o += (size_t)k;
    }
    return o;
}
