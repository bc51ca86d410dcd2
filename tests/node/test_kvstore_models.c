/* test_kvstore_models.c - the KV prefix store (node/kvstore.h) on every
 * golden model: after a restart of the node, a prompt whose first 64-token
 * block is on disk gives the same greedy tokens as the cold run did.
 *
 * The models: the fixture set's F32 (stories260K) and F16 (stories260K-F16)
 * files, its quantized ones (qwen3-mini Q8_0 and Q4_K_M, qwen3moe-mini
 * Q4_K_M, qwen2-mini Q4_0) and the generated F16 minis of build/models
 * (qwen3, qwen3moe, qwen2). For each, real processes: `tandem serve --role
 * local --kv-cache-dir` answers a 70-token prompt cold (all 70 positions
 * computed), stops (SIGTERM writes the queued block), starts again on the
 * same directory and answers the prompt again: 64 positions from the disk
 * tier, 6 computed, and the same 8 greedy tokens. All nine nodes run at
 * once (each model's blocks in its own subdirectory of one store), so the
 * test costs about two model loads, not eighteen.
 */
#include "proc.h"

#define PROMPT_N 70        /* one full block (64 positions) + 6 */
#define N_PRED 8
#define N_MODELS 9

typedef struct {
    const char *file;      /* file name */
    int fixture;           /* in the fixture set's models/ (else build/models) */
    int vocab_small;       /* stories260K: 512 tokens */
    char path[1024];
    pid_t pid;
    int port;
    int32_t ref[N_PRED];
} tm_model;

static tm_model models[N_MODELS] = {
    { .file = "stories260K.gguf", .fixture = 1, .vocab_small = 1 },          /* F32 */
    { .file = "stories260K-F16.gguf", .fixture = 1, .vocab_small = 1 },
    { .file = "qwen3-mini-F16.gguf", .fixture = 0, .vocab_small = 0 },
    { .file = "qwen3moe-mini-F16.gguf", .fixture = 0, .vocab_small = 0 },
    { .file = "qwen2-mini-F16.gguf", .fixture = 0, .vocab_small = 0 },
    { .file = "qwen3-mini-Q8_0.gguf", .fixture = 1, .vocab_small = 0 },
    { .file = "qwen3-mini-Q4_K_M.gguf", .fixture = 1, .vocab_small = 0 },
    { .file = "qwen3moe-mini-Q4_K_M.gguf", .fixture = 1, .vocab_small = 0 },
    { .file = "qwen2-mini-Q4_0.gguf", .fixture = 1, .vocab_small = 0 },
};

static char dir[64], store[128];

/* Ordinary token ids (no control tokens) of the model's vocabulary. */
static void tm_prompt(const tm_model *m, int32_t *ids) {
    for (int i = 0; i < PROMPT_N; i++) ids[i] = m->vocab_small ? 3 + (i * 37) % 500 : 1000 + (i * 37) % 5000;
}

static void tm_start(tm_model *m, int i) {
    char name[32], pf[128];
    snprintf(name, sizeof name, "m%d", i);
    snprintf(pf, sizeof pf, "%s/%s.port", dir, name);
    char *argv[] = { (char *)bin(), "serve", "--role", "local", "-m", m->path, "--listen", "127.0.0.1:0", "--port-file", pf,
                     "--parallel", "1", "-c", "256", "-t", "1", "--kv-cache-dir", store, NULL };
    char log[128];
    snprintf(log, sizeof log, "%s/%s.log", dir, name);
    unlink(pf);
    m->pid = spawn_log(argv, log, 0);
    m->port = 0;
}

static int tm_wait(tm_model *m, int i) {
    char pf[128];
    snprintf(pf, sizeof pf, "%s/m%d.port", dir, i);
    m->port = wait_port(pf, m->pid, asan() ? 120000 : 60000);
    CHECK(m->port > 0, "%s: node started (%s/m%d.log)", m->file, dir, i);
    return m->port > 0;
}

typedef struct { int32_t out[N_PRED]; int n_out, cached, computed, status; char tier[16]; } tm_res;

static tm_res tm_gen(const tm_model *m) {
    int32_t ids[PROMPT_N];
    tm_prompt(m, ids);
    tm_res r;
    memset(&r, 0, sizeof r);
    json_t *o = post_json(m->port, gen_req(ids, PROMPT_N, N_PRED, 0, NULL), &r.status);
    json_t *toks = json_object_get(o, "tokens");
    for (size_t k = 0; k < json_array_size(toks) && k < N_PRED; k++)
        r.out[r.n_out++] = (int32_t)json_integer_value(json_array_get(toks, k));
    r.cached = (int)jint(json_object_get(o, "usage"), "prompt_tokens_details", "cached_tokens");
    r.computed = (int)jint(o, "prefill", "computed_local");
    snprintf(r.tier, sizeof r.tier, "%s", jstr(o, "prefill", "cache_tier"));
    json_decref(o);
    return r;
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    unsetenv("TANDEM_LOG_LEVEL");
    unsetenv("TANDEM_SECRET");
    const char *need[N_MODELS + 1];
    for (int i = 0; i < N_MODELS; i++) {
        char rel[128];
        snprintf(rel, sizeof rel, "models/%s", models[i].file);
        if (models[i].fixture) t_fixture_path(models[i].path, sizeof models[i].path, rel);
        else snprintf(models[i].path, sizeof models[i].path, "%s/%s", t_models(), models[i].file);
        need[i] = models[i].path;
    }
    need[N_MODELS] = NULL;
    if (!t_need_all(need)) return t_done("test_kvstore_models");
    snprintf(dir, sizeof dir, "/tmp/tandem-test-kvmodels-XXXXXX");
    CHECK(mkdtemp(dir) != NULL, "temp dir");
    snprintf(store, sizeof store, "%s/store", dir);
    double t0 = now_ms();

    /* cold: nothing stored yet */
    for (int i = 0; i < N_MODELS; i++) tm_start(&models[i], i);
    for (int i = 0; i < N_MODELS; i++) {
        tm_model *m = &models[i];
        if (!tm_wait(m, i)) continue;
        tm_res r = tm_gen(m);
        CHECK(r.status == 200 && r.n_out == N_PRED && r.cached == 0 && r.computed == PROMPT_N,
              "%s cold: status %d, %d tokens, cached %d, computed %d", m->file, r.status, r.n_out, r.cached, r.computed);
        memcpy(m->ref, r.out, sizeof m->ref);
    }
    for (int i = 0; i < N_MODELS; i++)
        CHECK(stop_proc(models[i].pid, 20000) == 0, "%s: clean exit (the queued block written)", models[i].file);
    if (t_fail) return t_done("test_kvstore_models");

    /* restart on the same store: block 0 from disk, the 6 others computed */
    for (int i = 0; i < N_MODELS; i++) tm_start(&models[i], i);
    for (int i = 0; i < N_MODELS; i++) {
        tm_model *m = &models[i];
        if (!tm_wait(m, i)) continue;
        tm_res r = tm_gen(m);
        CHECK(r.status == 200 && r.cached == 64 && r.computed == PROMPT_N - 64 && !strcmp(r.tier, "disk"),
              "%s after a restart: status %d, cached %d (want 64), computed %d (want %d), tier %s", m->file, r.status,
              r.cached, r.computed, PROMPT_N - 64, r.tier);
        int same = r.n_out == N_PRED && !memcmp(r.out, m->ref, sizeof m->ref);
        CHECK(same, "%s after a restart: the same %d greedy tokens as the cold run", m->file, N_PRED);
        if (!same)
            for (int k = 0; k < N_PRED; k++) fprintf(stderr, "  %d: cold %d, restart %d\n", k, m->ref[k], k < r.n_out ? r.out[k] : -1);
    }
    for (int i = 0; i < N_MODELS; i++) CHECK(stop_proc(models[i].pid, 20000) == 0, "%s: clean exit", models[i].file);
    fprintf(stderr, "test_kvstore_models: %.1f s (logs in %s)\n", (now_ms() - t0) / 1e3, dir);
    if (!t_fail) {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd)) {}
    }
    return t_done("test_kvstore_models");
}
