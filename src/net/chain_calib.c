/* chain_calib.c - the attention's rate against the weight products' (see
 * chain_calib.h, docs/layer-split.md "Planning a chain"). */
#include "net/chain_calib.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/xorshift.h"
#include "engine/gguf.h"
#include "engine/kvcache.h"
#include "engine/model.h"
#include "net/chain_plan.h"

/* Timed passes: pairs until they add up to a quarter second (the clock
 * and a loaded machine's noise are milliseconds), at most 16 pairs. */
#define CHAIN_CALIB_MIN_S 0.25
#define CHAIN_CALIB_MAX_PAIRS 16

/* ==== Setup ==== */

static double chain_calib_cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int chain_calib_check(const model_hparams *h, int tokens, int rows, char *err, size_t errlen) {
    if (rows < CHAIN_CALIB_MIN_ROWS || rows > CHAIN_CALIB_MAX_ROWS || tokens < 2 * rows) {
        snprintf(err, errlen, "%d rows a pass for %d tokens: must be %d..%d, at most half the tokens", rows, tokens,
                 CHAIN_CALIB_MIN_ROWS, CHAIN_CALIB_MAX_ROWS);
        return -1;
    }
    /* layer 0's K and V rows, f16: every one is written (random) and read */
    double kv = 2.0 * 2.0 * h->n_head_kv * (double)h->head_dim_k * tokens;
    if (kv > (double)CHAIN_CALIB_MAX_KV_BYTES) {
        snprintf(err, errlen, "a cache of %.0f MiB for %d tokens of %d K/V heads of %d is over %llu MiB", kv / 1048576,
                 tokens, h->n_head_kv, h->head_dim_k, CHAIN_CALIB_MAX_KV_BYTES >> 20);
        return -1;
    }
    return 0;
}

/* Writes random K/V rows of layer 0 at positions [0, n) in passes of rows
 * (buf: rows * kv_dim floats, twice). */
static void chain_calib_fill(kvcache *kv, int n, int rows, float *buf, uint64_t *rng) {
    size_t dim = (size_t)kv_dim(kv);
    float *k = buf, *v = buf + (size_t)rows * dim;
    for (size_t i = 0; i < 2 * (size_t)rows * dim; i++) buf[i] = (float)xorshift64_u32(rng) / 4294967296.0f * 2 - 1;
    for (int p = 0; p < n; p += rows) kv_store_f32(kv, 0, p, n - p < rows ? n - p : rows, k, v);
}

/* ==== Timing ==== */

/* CPU seconds of one pass of rows at position pos0; -1 on a failure. */
static double chain_calib_pass(model *m, session *s, int pos0, const int32_t *ids, int rows, float *x_out, char *err,
                               size_t errlen) {
    session_reset(s, pos0);
    kv_set_used(session_kv(s), pos0);
    session_rows_written(s, pos0);
    double t0 = chain_calib_cpu_s();
    if (model_eval_slice(m, s, ids, NULL, rows, x_out, NULL, NULL, err, errlen)) return -1;
    return chain_calib_cpu_s() - t0;
}

/* The rates from the two passes' least times. */
static int chain_calib_solve(chain_calib *c, char *err, size_t errlen) {
    double dt = c->t_late - c->t_early;
    /* under 5% of the late pass: the clock's and the load's noise */
    if (!(dt > 0.05 * c->t_late)) {
        snprintf(err, errlen, "attention's time did not rise with its span (%.3f s early, %.3f s late at %d tokens): "
                 "too small a share to measure; measure at a longer prompt", c->t_early, c->t_late, c->tokens);
        return -1;
    }
    c->attn_rate = (c->attn_late - c->attn_early) / dt;
    double t_mat = c->t_early - c->attn_early / c->attn_rate;
    if (!(t_mat > 0.05 * c->t_early)) {
        snprintf(err, errlen, "the weight products' time left is %.4f s of %.3f s: no rate", t_mat, c->t_early);
        return -1;
    }
    c->mat_rate = c->mat_flops / t_mat;
    c->ratio = c->attn_rate / c->mat_rate;
    if (!(c->ratio >= CHAIN_PLAN_ATTN_RATE_MIN && c->ratio <= CHAIN_PLAN_ATTN_RATE_MAX)) {
        snprintf(err, errlen, "measured attention rate %g of the weight products' is out of range", c->ratio);
        return -1;
    }
    return 0;
}

int chain_calib_measure(const char *path, int tokens, int rows, chain_calib *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    model_hparams h;
    if (model_peek_hparams(path, &h, err, errlen)) return -1;
    if (tokens > CHAIN_CALIB_MAX_TOKENS) tokens = CHAIN_CALIB_MAX_TOKENS;
    if (chain_calib_check(&h, tokens, rows, err, errlen)) return -1;
    model_opts mo = { .n_threads = 1, .n_batch = rows, .fingerprint_later = 1, .layer_lo = 0,
                      .layer_hi = h.n_layer > 1 ? 1 : 0 };
    model *m = NULL;
    session *s = NULL;
    if (model_load(&m, path, &mo, err, errlen) || session_new(&s, m, tokens, GGML_TYPE_F16, err, errlen)) {
        model_free(m);
        return -1;
    }
    size_t dim = (size_t)h.n_head_kv * (size_t)h.head_dim_k;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)rows);
    float *buf = malloc(sizeof(float) * 2 * (size_t)rows * (dim > (size_t)h.n_embd ? dim : (size_t)h.n_embd));
    int rc = -1;
    if (!ids || !buf) { snprintf(err, errlen, "out of memory"); goto done; }
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    for (int i = 0; i < rows; i++) ids[i] = (int32_t)(xorshift64_u32(&rng) % (uint32_t)h.n_vocab);
    chain_calib_fill(session_kv(s), tokens - rows, rows, buf, &rng);
    out->tokens = tokens;
    out->rows = rows;
    out->mat_flops = rows * chain_plan_row_mat(&h);
    out->attn_early = chain_plan_attn_span(&h, 0, rows);
    out->attn_late = chain_plan_attn_span(&h, tokens - rows, rows);
    out->t_early = out->t_late = INFINITY;
    /* a first pass untimed (the pages of the weights and the scratch
     * touched), then early, late, early, late ...: two pairs, more while
     * they add up to under CHAIN_CALIB_MIN_S (a small model's passes take
     * milliseconds), at most CHAIN_CALIB_MAX_PAIRS */
    if (chain_calib_pass(m, s, 0, ids, rows, buf, err, errlen) < 0) goto done;
    double sum = 0;
    for (int r = 0; r < 2 * CHAIN_CALIB_MAX_PAIRS && (r < 4 || sum < CHAIN_CALIB_MIN_S); r++) {
        double t = chain_calib_pass(m, s, r % 2 ? tokens - rows : 0, ids, rows, buf, err, errlen);
        if (t < 0) goto done;
        double *best = r % 2 ? &out->t_late : &out->t_early;
        if (t < *best) *best = t;
        sum += t;
    }
    rc = chain_calib_solve(out, err, errlen);
done:
    free(ids);
    free(buf);
    session_free(s);
    model_free(m);
    return rc;
}
