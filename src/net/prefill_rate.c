/* prefill_rate.c - see prefill_rate.h. */
#include "net/prefill_rate.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/generate.h"

int prefill_rate_calibrate(model *m, int n_tokens, uint32_t kv_dtype, double *tps, char *err, size_t errlen) {
    const model_hparams *hp = model_get_hparams(m);
    *tps = 0;
    if (n_tokens < 1 || hp->n_vocab < 2) { snprintf(err, errlen, "nothing to calibrate"); return -1; }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n_tokens);
    session *s = NULL;
    if (!ids) { snprintf(err, errlen, "out of memory"); return -1; }
    /* Arbitrary ids spread over the vocabulary: the cost of a pass does not
     * depend on which tokens it holds. */
    for (int i = 0; i < n_tokens; i++) ids[i] = (int32_t)(((int64_t)i * 7919 + 11) % hp->n_vocab);
    int rc = session_new(&s, m, n_tokens, kv_dtype, err, errlen);
    int chunk = model_get_n_batch(m) > 0 ? model_get_n_batch(m) : n_tokens;
    double t0 = gen_now_ms();
    for (int p = 0; p < n_tokens && rc == 0; p += chunk)
        rc = model_eval(m, s, ids + p, n_tokens - p < chunk ? n_tokens - p : chunk, NULL, NULL, NULL, err, errlen);
    double ms = gen_now_ms() - t0;
    session_free(s);
    free(ids);
    if (rc) return -1;
    *tps = ms > 0 ? n_tokens * 1e3 / ms : 0;
    return *tps > 0 ? 0 : -1;
}

void prefill_rate_update(double *avg, int n, double ms) {
    if (n < PREFILL_RATE_MIN_TOKENS || !(ms > 0)) return;
    double x = n * 1e3 / ms;
    if (!isfinite(x)) return;
    *avg = *avg > 0 ? (1 - PREFILL_RATE_ALPHA) * *avg + PREFILL_RATE_ALPHA * x : x;
}

void prefill_rate_format(char *out, size_t outlen, const char *base, double tps) {
    if (tps > 0 && tps < 1e9) snprintf(out, outlen, "%s" PREFILL_RATE_TAG "%.0f t/s", base, tps);
    else snprintf(out, outlen, "%s", base);
}

double prefill_rate_parse(const char *desc) {
    const char *p = desc ? strstr(desc, PREFILL_RATE_TAG) : NULL, *last = NULL;
    while (p) { last = p; p = strstr(p + 1, PREFILL_RATE_TAG); }   /* the tag is the last clause */
    if (!last) return -1;
    char *end = NULL;
    double v = strtod(last + strlen(PREFILL_RATE_TAG), &end);
    if (!end || strcmp(end, " t/s") || !(v > 0) || !(v < 1e9)) return -1;
    return v;
}

void prefill_ctx_format(char *out, size_t outlen, const char *base, int n_ctx) {
    if (n_ctx > 0 && n_ctx <= PREFILL_CTX_MAX) snprintf(out, outlen, "%s" PREFILL_CTX_TAG "%d", base, n_ctx);
    else snprintf(out, outlen, "%s", base);
}

int prefill_ctx_parse(const char *desc) {
    const char *p = desc ? strstr(desc, PREFILL_CTX_TAG) : NULL, *last = NULL;
    while (p) { last = p; p = strstr(p + 1, PREFILL_CTX_TAG); }
    if (!last) return 0;
    const char *d = last + strlen(PREFILL_CTX_TAG);
    if (*d < '1' || *d > '9') return 0;
    char *end = NULL;
    long v = strtol(d, &end, 10);
    if (!end || (*end && *end != ';') || v < 1 || v > PREFILL_CTX_MAX) return 0;
    return (int)v;
}
