/* moe_trace.c - tandem's side of moe_ties.py (not built by the Makefile):
 * teacher-forces one prompt of a golden file through the engine, as
 * test_golden does (the whole prompt in one pass, then one token a step),
 * prints each step's top-10 |dlogit| against the golden (and a second
 * golden while its tokens agree), and writes the logits of every step.
 * With moe_trace.patch applied to src/backend/cpu/backend_cpu.c (never
 * committed into it: it is a print in the router), MOE_TRACE=FILE also
 * writes every (position, layer)'s chosen experts, k-th minus (k+1)-th
 * router logit and router logits, and MOE_FORCE="POS:LAYER:E1,E2;..."
 * overrides the choice there (weights renormalised from the router's
 * probabilities). Layer = call count modulo MOE_NLAYER (default 4): the
 * pass must run every layer's FFN, so n_batch here holds a whole prompt.
 *
 *   git apply tests/data/oracle/moe_trace.patch && make build/libtandem.a
 *   cc -std=c11 -D_GNU_SOURCE -O2 -Isrc tests/data/oracle/moe_trace.c build/libtandem.a \
 *      -o build/moe_trace -lm -pthread -ljansson -lutf8proc -lzstd -lmicrohttpd -lcrypto -lxxhash -lcurl
 *   MOE_TRACE=DIR/tr_NAME.txt build/moe_trace MODEL GOLDEN NAME [GOLDEN2|-] DIR/lg_NAME.f32
 *   git apply -R tests/data/oracle/moe_trace.patch && make build/libtandem.a
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "engine/generate.h"
#include "engine/model.h"
#include "engine/quant.h"

static json_t *find(const char *path, const char *name) {
    FILE *f = fopen(path, "r"); char *line = NULL; size_t cap = 0; json_t *r = NULL;
    while (getline(&line, &cap, f) > 0) {
        json_t *j = json_loads(line, 0, NULL);
        const char *n = json_string_value(json_object_get(j, "name"));
        if (n && !strcmp(n, name)) { r = j; break; }
        json_decref(j);
    }
    free(line); fclose(f); return r;
}
static double dist(json_t *st, const float *lg) {
    json_t *top = json_object_get(st, "top10"); size_t i; json_t *v; double w = 0;
    json_array_foreach(top, i, v) {
        int id = (int)json_integer_value(json_array_get(v, 0));
        double d = fabs(lg[id] - json_real_value(json_array_get(v, 1)));
        if (d > w) w = d;
    }
    return w;
}
int main(int argc, char **argv) {
    if (argc < 4) { fprintf(stderr, "gtrace MODEL GOLDEN NAME [GOLDEN2] [LOGITS_OUT]\n"); return 2; }
    json_t *p = find(argv[2], argv[3]), *p2 = argc > 4 && strcmp(argv[4], "-") ? find(argv[4], argv[3]) : NULL;
    char err[512]; model *m = NULL;
    model_opts mo = { .n_threads = 1, .n_batch = 2048 };
    if (model_load(&m, argv[1], &mo, err, sizeof err)) { fprintf(stderr, "%s\n", err); return 1; }
    const model_hparams *hp = model_get_hparams(m);
    json_t *pi = json_object_get(p, "prompt_ids"), *gi = json_object_get(p, "generated_ids"), *steps = json_object_get(p, "steps");
    int nw = (int)json_array_size(pi), ng = (int)json_array_size(gi);
    int32_t want[4096], gen[64];
    for (int i = 0; i < nw; i++) want[i] = (int32_t)json_integer_value(json_array_get(pi, i));
    for (int i = 0; i < ng; i++) gen[i] = (int32_t)json_integer_value(json_array_get(gi, i));
    session *s = NULL; float *lg = malloc(sizeof(float) * hp->n_vocab);
    session_new(&s, m, 4096, GGML_TYPE_F16, err, sizeof err);
    FILE *lo = argc > 5 ? fopen(argv[5], "wb") : NULL;
    model_eval(m, s, want, nw, lg, NULL, NULL, err, sizeof err);
    int same2 = 1;
    for (int k = 0; k < ng; k++) {
        double d = dist(json_array_get(steps, k), lg);
        printf("step %2d |dlogit| %.4f", k, d);
        if (p2) {
            json_t *g2 = json_object_get(p2, "generated_ids");
            if (same2) printf(" golden2 %.4f", dist(json_array_get(json_object_get(p2, "steps"), k), lg));
            if (json_integer_value(json_array_get(g2, k)) != gen[k]) same2 = 0;
        }
        printf("\n");
        if (lo) fwrite(lg, sizeof(float), hp->n_vocab, lo);
        if (k + 1 < ng) model_eval(m, s, &gen[k], 1, lg, NULL, NULL, err, sizeof err);
    }
    if (lo) fclose(lo);
    return 0;
}
