/* test_batch.c - continuous batching changes no result.
 *
 * For every golden model: N sequences (N = 1..8) with prompts of different
 * lengths join a shared batch at different steps, decode greedily for
 * different numbers of tokens and leave. Every logit vector each sequence
 * gets from the batched evaluation must be bit-for-bit the one it gets when
 * it runs alone, so every greedy token is the same too. The model is loaded
 * with a small pass size so that prompts are cut across passes and share
 * passes with other sequences' decode tokens.
 */
#include <stdint.h>

#include "engine/model.h"
#include "engine/sampler.h"
#include "t.h"

#define MAX_SEQ 8
#define MAX_PROMPT 80
#define MAX_GEN 12
#define PASS_ROWS 24         /* small, so prompts span several passes */

typedef struct {
    int32_t prompt[MAX_PROMPT];
    int n_prompt, n_gen, join;          /* join: the batch step at which it arrives */
    int32_t tok[MAX_GEN];               /* greedy tokens, alone */
    float *logits;                      /* [n_gen][n_vocab], alone */
} seq_ref;

static uint32_t rng_next(uint32_t *s) { *s = *s * 1664525u + 1013904223u; return *s >> 8; }

/* Alone: prompt, then n_gen - 1 single-token steps; logits of every step. */
static int run_alone(model *m, seq_ref *r, int n_vocab, char *err, size_t errlen) {
    session *s;
    if (session_new(&s, m, 256, GGML_TYPE_F16, err, errlen)) return -1;
    int rc = model_eval(m, s, r->prompt, r->n_prompt, r->logits, NULL, NULL, err, errlen);
    for (int k = 0; !rc && k < r->n_gen; k++) {
        r->tok[k] = sampler_argmax(r->logits + (size_t)k * n_vocab, n_vocab);
        if (k + 1 < r->n_gen)
            rc = model_eval(m, s, &r->tok[k], 1, r->logits + (size_t)(k + 1) * n_vocab, NULL, NULL, err, errlen);
    }
    session_free(s);
    return rc;
}

/* Together: at each step, arriving sequences bring their prompt and running
 * ones their last token; all go through one model_eval_batch call. */
static void run_batched(model *m, seq_ref *r, int n, int n_vocab, const char *what) {
    char err[256];
    session *s[MAX_SEQ] = { 0 };
    int got[MAX_SEQ] = { 0 }, same_logits = 0, same_tok = 0, total = 0;
    int32_t last[MAX_SEQ];
    float *lg = malloc(sizeof(float) * (size_t)n_vocab * MAX_SEQ);
    for (int i = 0; i < n; i++) CHECK(session_new(&s[i], m, 256, GGML_TYPE_F16, err, sizeof err) == 0, "%s", err);
    for (int step = 0;; step++) {
        model_batch_item it[MAX_SEQ];
        int who[MAX_SEQ], ni = 0, running = 0;
        for (int i = 0; i < n; i++) {
            if (step < r[i].join || got[i] >= r[i].n_gen) { running += step < r[i].join; continue; }
            running++;
            it[ni] = (model_batch_item){ .s = s[i], .logits = lg + (size_t)ni * n_vocab };
            if (step == r[i].join) { it[ni].ids = r[i].prompt; it[ni].n = r[i].n_prompt; }
            else { it[ni].ids = &last[i]; it[ni].n = 1; }
            who[ni++] = i;
        }
        if (!running) break;
        if (!ni) continue;
        int rc = model_eval_batch(m, it, ni, err, sizeof err);
        CHECK(rc == 0, "%s step %d: %s", what, step, err);
        if (rc) break;
        for (int k = 0; k < ni; k++) {
            int i = who[k];
            const float *want = r[i].logits + (size_t)got[i] * n_vocab;
            same_logits += !memcmp(want, it[k].logits, sizeof(float) * (size_t)n_vocab);
            last[i] = sampler_argmax(it[k].logits, n_vocab);
            same_tok += last[i] == r[i].tok[got[i]];
            total++;
            got[i]++;
        }
    }
    CHECK(same_logits == total, "%s: %d of %d logit vectors differ from the sequence alone", what,
          total - same_logits, total);
    CHECK(same_tok == total, "%s: %d of %d greedy tokens differ", what, total - same_tok, total);
    for (int i = 0; i < n; i++) session_free(s[i]);
    free(lg);
}

/* A failing item (context full) leaves the other sessions where they were. */
static void check_failure(model *m, const char *what) {
    char err[256];
    session *a, *b;
    session_new(&a, m, 256, GGML_TYPE_F16, err, sizeof err);
    session_new(&b, m, 8, GGML_TYPE_F16, err, sizeof err);
    int32_t ids[16] = { 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16 };
    model_batch_item it[2] = { { .s = a, .ids = ids, .n = 4 }, { .s = b, .ids = ids, .n = 16 } };
    CHECK(model_eval_batch(m, it, 2, err, sizeof err) != 0, "%s: over-long item accepted", what);
    CHECK(session_pos(a) == 0 && session_pos(b) == 0, "%s: a refused batch moved a session", what);
    it[1].s = a;
    CHECK(model_eval_batch(m, it, 2, err, sizeof err) != 0 && strstr(err, "twice"), "%s: duplicate session accepted", what);
    session_free(a);
    session_free(b);
}

static void test_model(const char *path, uint32_t seed) {
    char err[512];
    model *m;
    model_opts mo = { .n_threads = 2, .n_batch = PASS_ROWS };
    if (!t_need(path)) return;
    if (model_load(&m, path, &mo, err, sizeof err)) {
        CHECK(0, "load %s: %s", path, err);
        return;
    }
    int n_vocab = model_get_hparams(m)->n_vocab;
    seq_ref r[MAX_SEQ];
    for (int i = 0; i < MAX_SEQ; i++) {
        r[i].n_prompt = 1 + (int)(rng_next(&seed) % (i == 3 ? MAX_PROMPT : 30));
        for (int t = 0; t < r[i].n_prompt; t++) r[i].prompt[t] = (int32_t)(rng_next(&seed) % (uint32_t)n_vocab);
        r[i].n_gen = 1 + (int)(rng_next(&seed) % MAX_GEN);
        r[i].join = (int)(rng_next(&seed) % 6);
        r[i].logits = malloc(sizeof(float) * (size_t)n_vocab * MAX_GEN);
        CHECK(run_alone(m, &r[i], n_vocab, err, sizeof err) == 0, "%s alone: %s", path, err);
    }
    static const int NS[] = { 1, 2, 3, 5, 8 };
    for (size_t k = 0; k < sizeof NS / sizeof NS[0]; k++) {
        char what[600];
        snprintf(what, sizeof what, "%s N=%d", path, NS[k]);
        run_batched(m, r, NS[k], n_vocab, what);
    }
    check_failure(m, path);
    for (int i = 0; i < MAX_SEQ; i++) free(r[i].logits);
    model_free(m);
}

int main(void) {
    const char *gm = t_models();
    const char *fixture_models[] = { "models/stories260K.gguf", "models/stories260K-F16.gguf", "models/qwen3-mini-Q8_0.gguf",
                                     "models/qwen3-mini-Q4_K_M.gguf", "models/qwen3moe-mini-Q4_K_M.gguf", "models/qwen2-mini-Q4_0.gguf" };
    const char *generated[] = { "qwen3-mini-F16.gguf", "qwen2-mini-F16.gguf", "qwen3moe-mini-F16.gguf" };
    char path[1024];
    uint32_t seed = 7;
    for (size_t i = 0; i < sizeof generated / sizeof generated[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", gm, generated[i]);
        test_model(path, seed++);
    }
    for (size_t i = 0; i < sizeof fixture_models / sizeof fixture_models[0]; i++) {
        test_model(t_fixture_path(path, sizeof path, fixture_models[i]), seed++);
    }
    return t_done("test_batch");
}
