/* test_genmodel.c - `tandem gen-model`: the files it writes load (in our
 * loader), carry the requested shapes, types and tokenizer, run to finite and
 * varied logits, and are byte-for-byte deterministic. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>

#include "cmd/cli.h"
#include "engine/gguf.h"
#include "engine/model.h"
#include "t.h"

/* ==== Helpers ==== */

static char g_dir[256];

/* Runs `tandem gen-model` with the given arguments plus -q -o PATH. */
static int gen(const char *path, const char *const *args) {
    char *argv[48];
    int argc = 0;
    for (; args[argc] && argc < 44; argc++) argv[argc] = (char *)args[argc];
    argv[argc++] = "-q";
    argv[argc++] = "-o";
    argv[argc++] = (char *)path;
    argv[argc] = NULL;
    return cli_gen_model(argc, argv);
}

static void path_of(char *buf, size_t len, const char *name) { snprintf(buf, len, "%s/%s", g_dir, name); }

static uint8_t *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = n > 0 ? malloc((size_t)n) : NULL;
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) { free(b); b = NULL; }
    fclose(f);
    *len = b ? (size_t)n : 0;
    return b;
}

static uint32_t tensor_type(const gguf_file *f, const char *name) {
    const gguf_tensor *t = gguf_find_tensor(f, name);
    return t ? t->type : UINT32_MAX;
}

/* Evaluates a short prompt and then two single tokens; checks the logits. */
static void check_eval(model *m, const char *what) {
    const model_hparams *hp = model_get_hparams(m);
    char err[256];
    session *s = NULL;
    int rc = session_new(&s, m, 64, GGML_TYPE_F16, err, sizeof err);
    CHECK(rc == 0, "%s: session_new: %s", what, err);
    if (rc) return;
    float *lg = malloc(sizeof(float) * (size_t)hp->n_vocab);
    int32_t ids[5] = { 1, 17, 300, 4000 % hp->n_vocab, 25 };
    rc = model_eval(m, s, ids, 5, lg, NULL, NULL, err, sizeof err);
    CHECK(rc == 0, "%s: model_eval: %s", what, err);
    for (int step = 0; step < 2 && rc == 0; step++) {
        int finite = 1, varied = 0;
        for (int i = 0; i < hp->n_vocab; i++) {
            if (!isfinite(lg[i])) finite = 0;
            if (lg[i] != lg[0]) varied = 1;
        }
        CHECK(finite, "%s: non-finite logits at step %d", what, step);
        CHECK(varied, "%s: all logits equal at step %d", what, step);
        int32_t next = 42 + step;
        rc = model_eval(m, s, &next, 1, lg, NULL, NULL, err, sizeof err);
        CHECK(rc == 0, "%s: decode step: %s", what, err);
    }
    CHECK(session_pos(s) == 7, "%s: session at %d, want 7", what, session_pos(s));
    free(lg);
    session_free(s);
}

/* ==== One generated model ==== */

typedef struct {
    const char *file;
    const char *args[24];
    const char *arch;
    int n_embd, n_layer, n_head, n_head_kv, head_dim, n_vocab, n_expert;
    /* expected types: {tensor name, type} pairs, NULL-terminated */
    struct { const char *name; uint32_t type; } types[8];
    uint32_t ftype;
    const char *absent;      /* a tensor that must not exist, or NULL */
    float rope_base;         /* expected {arch}.rope.freq_base, or 0 */
} gm_case;

static void run_case(const gm_case *c) {
    char path[512], err[256];
    path_of(path, sizeof path, c->file);
    int rc = gen(path, c->args);
    CHECK(rc == 0, "%s: gen-model exit %d", c->file, rc);
    if (rc) return;
    gguf_file *f = NULL;
    rc = gguf_open_file(&f, path, err, sizeof err);
    CHECK(rc == 0, "%s: gguf_open: %s", c->file, err);
    if (rc) return;
    gguf_str arch;
    uint32_t ft = 0, align = 0;
    CHECK(gguf_get_str(f, "general.architecture", &arch) == 0 && gguf_str_eq(arch, c->arch), "%s: arch", c->file);
    CHECK(gguf_get_u32(f, "general.file_type", &ft) == 0 && ft == c->ftype, "%s: file_type %u want %u", c->file, ft, c->ftype);
    CHECK(gguf_get_u32(f, "general.alignment", &align) == 0 && align == 32, "%s: alignment", c->file);
    CHECK(gguf_find_kv(f, "tokenizer.ggml.merges") >= 0 || gguf_find_kv(f, "tokenizer.ggml.scores") >= 0,
          "%s: tokenizer keys copied", c->file);
    if (c->absent) CHECK(gguf_find_tensor(f, c->absent) == NULL, "%s: %s should be absent", c->file, c->absent);
    if (c->rope_base > 0) {
        char key[64];
        float rb = 0;
        snprintf(key, sizeof key, "%s.rope.freq_base", c->arch);
        CHECK(gguf_get_f32(f, key, &rb) == 0 && rb == c->rope_base, "%s: rope base %g", c->file, rb);
    }
    for (int i = 0; c->types[i].name; i++) {
        uint32_t t = tensor_type(f, c->types[i].name);
        CHECK(t == c->types[i].type, "%s: %s is %s, want %s", c->file, c->types[i].name,
              gguf_type_name(t), gguf_type_name(c->types[i].type));
    }
    gguf_close(f);

    model *m = NULL;
    model_opts mo = { .n_threads = 2, .n_batch = 512 };
    rc = model_load(&m, path, &mo, err, sizeof err);
    CHECK(rc == 0, "%s: model_load: %s", c->file, err);
    if (rc) return;
    const model_hparams *hp = model_get_hparams(m);
    CHECK(hp->n_embd == c->n_embd && hp->n_layer == c->n_layer && hp->n_head == c->n_head &&
          hp->n_head_kv == c->n_head_kv && hp->head_dim_k == c->head_dim && hp->n_vocab == c->n_vocab &&
          hp->n_expert == c->n_expert,
          "%s: hparams embd %d layer %d head %d/%d hd %d vocab %d experts %d", c->file, hp->n_embd,
          hp->n_layer, hp->n_head, hp->n_head_kv, hp->head_dim_k, hp->n_vocab, hp->n_expert);
    CHECK(model_weight_bytes_per_token(m) > 0, "%s: weight bytes", c->file);
    check_eval(m, c->file);
    model_free(m);
}

/* ==== Cases ==== */

static char g_spm[512], g_qwen[512];

static void test_models(void) {
    const uint32_t F32 = GGML_TYPE_F32, F16 = GGML_TYPE_F16, Q8 = GGML_TYPE_Q8_0, Q4K = GGML_TYPE_Q4_K,
                   Q6K = GGML_TYPE_Q6_K, Q50 = GGML_TYPE_Q5_0, Q5K = GGML_TYPE_Q5_K;
    /* qwen3, small width (64) against the real 151936-token vocabulary */
    gm_case q3f16 = { "gm-qwen3-f16.gguf",
        { "--arch", "qwen3", "--vocab-from", g_qwen, "--n-embd", "64", "--n-layer", "2", "--head-dim", "32", "--n-ff", "128",
          "--type", "f16", NULL },
        "qwen3", 64, 2, 4, 2, 32, 151936, 0,
        { { "token_embd.weight", F16 }, { "blk.0.attn_q_norm.weight", F32 }, { "blk.1.ffn_down.weight", F16 },
          { NULL, 0 } }, 1, "output.weight", 1e6f };
    /* qwen3 Q4_K_M at n_embd 256 (no fallback): tied embedding -> Q6_K,
     * use_more_bits picks layers 2 and 3 of 4 for attn_v / ffn_down */
    gm_case q3k = { "gm-qwen3-q4km.gguf",
        { "--arch", "qwen3", "--vocab-from", g_qwen, "--n-layer", "4", "--head-dim", "64", "--n-ff", "512", "--type", "q4_k_m", NULL },
        "qwen3", 256, 4, 4, 2, 64, 151936, 0,
        { { "token_embd.weight", Q6K }, { "blk.0.attn_v.weight", Q4K }, { "blk.2.attn_v.weight", Q6K },
          { "blk.1.ffn_down.weight", Q4K }, { "blk.3.ffn_down.weight", Q6K }, { "blk.0.attn_q.weight", Q4K },
          { "output_norm.weight", F32 }, { NULL, 0 } }, 15, "output.weight", 0 };
    /* qwen2: biases, untied output, Q8_0 */
    gm_case q2 = { "gm-qwen2-q8.gguf",
        { "--arch", "qwen2", "--vocab-from", g_qwen, "--n-embd", "64", "--n-layer", "2", "--head-dim", "16", "--n-ff", "128",
          "--type", "q8_0", NULL },
        "qwen2", 64, 2, 4, 2, 16, 151936, 0,
        { { "output.weight", Q8 }, { "token_embd.weight", Q8 }, { "blk.0.attn_q.bias", F32 },
          { "blk.1.attn_v.bias", F32 }, { NULL, 0 } }, 7, "blk.0.attn_q_norm.weight", 0 };
    /* qwen3moe with 8 experts, Q4_K_M, width 64: every K-quant falls back
     * (Q4_K -> Q5_0, Q6_K -> Q8_0); 8 experts pin attn_k/attn_v to Q8_0 and
     * lift attn_output to Q5_K, whose fallback is Q8_0 here (no Q5_1) */
    gm_case moe = { "gm-qwen3moe-q4km.gguf",
        { "--arch", "qwen3moe", "--vocab-from", g_qwen, "--n-embd", "64", "--n-layer", "2", "--head-dim", "32", "--n-ff-exp", "64",
          "--type", "q4_k_m", NULL },
        "qwen3moe", 64, 2, 4, 2, 32, 151936, 8,
        { { "blk.0.ffn_gate_inp.weight", F32 }, { "blk.0.ffn_gate_exps.weight", Q50 },
          { "blk.1.ffn_down_exps.weight", Q8 }, { "blk.0.attn_k.weight", Q8 }, { "blk.0.attn_v.weight", Q8 },
          { "blk.0.attn_output.weight", Q8 }, { "token_embd.weight", Q8 }, { NULL, 0 } }, 15, "blk.0.ffn_up.weight", 0 };
    /* llama with the 32000-token SentencePiece vocabulary, Q5_K_M at 256;
     * of 2 layers, use_more_bits picks layer 1 only */
    gm_case ll = { "gm-llama-q5km.gguf",
        { "--arch", "llama", "--vocab-from", g_spm, "--n-layer", "2", "--n-ff", "512", "--untied",
          "--type", "q5_k_m", NULL },
        "llama", 256, 2, 4, 2, 64, 32000, 0,
        { { "token_embd.weight", Q5K }, { "output.weight", Q6K }, { "blk.0.attn_v.weight", Q5K }, { "blk.1.attn_v.weight", Q6K },
          { "blk.1.ffn_down.weight", Q6K }, { "blk.0.ffn_up.weight", Q5K }, { NULL, 0 } }, 17,
        "blk.0.attn_q.bias", 10000.0f };
    /* presets keep their head layout under width/depth overrides */
    gm_case p06 = { "gm-preset-qwen3.gguf",
        { "--preset", "qwen3-0.6b", "--vocab-from", g_qwen, "--n-embd", "64", "--n-layer", "1", "--n-ff", "64", "--type", "bf16", NULL },
        "qwen3", 64, 1, 16, 8, 128, 151936, 0,
        { { "blk.0.attn_q.weight", GGML_TYPE_BF16 }, { "token_embd.weight", GGML_TYPE_BF16 }, { NULL, 0 } }, 32,
        "output.weight", 1e6f };
    gm_case pll = { "gm-preset-llama.gguf",
        { "--preset", "llama-3.2-1b", "--vocab-from", g_spm, "--n-embd", "64", "--n-layer", "1", "--n-ff", "64",
          "--type", "f32", NULL },
        "llama", 64, 1, 32, 8, 64, 32000, 0,
        { { "blk.0.ffn_down.weight", F32 }, { NULL, 0 } }, 0, "output.weight", 500000.0f };
    run_case(&p06);
    run_case(&pll);
    run_case(&q3f16);
    run_case(&q3k);
    run_case(&q2);
    run_case(&moe);
    run_case(&ll);
}

/* `tandem bench` on one of the generated models: a smoke test of the table
 * (speed numbers are not checked; bounds are skipped to stay fast). */
static void test_bench(void) {
    char p[512];
    path_of(p, sizeof p, "gm-qwen2-q8.gguf");
    char *ok[] = { "-m", p, "-r", "1", "-p", "8,16", "-n", "2", "-t", "1,2", "--no-bounds", NULL };
    char *bad_list[] = { "-m", p, "-p", "8,x", NULL };
    char *bad_kv[] = { "-m", p, "--kv-type", "q3", NULL };
    char *missing[] = { "-m", "/nonexistent/model.gguf", "-r", "1", "--no-bounds", NULL };
    CHECK(cli_bench(11, ok) == 0, "bench on a generated model failed");
    CHECK(cli_bench(4, bad_list) == 2, "bench accepted a bad -p list");
    CHECK(cli_bench(4, bad_kv) == 2, "bench accepted a bad KV type");
    CHECK(cli_bench(5, missing) == 1, "bench on a missing file did not fail");
}

/* The bounds table (stdout to a file): the bandwidth, and each generation
 * row also against the bandwidth read before and after each of its reps. */
static void test_bench_bounds(void) {
    char p[512], out[512];
    path_of(p, sizeof p, "gm-qwen2-q8.gguf");
    path_of(out, sizeof out, "gm-bench-bounds.txt");
    char *args[] = { "-m", p, "-r", "2", "-p", "8", "-n", "2", "-t", "1", "--bw-mib", "16", NULL };
    fflush(stdout);
    int saved = dup(1), fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    CHECK(saved >= 0 && fd >= 0, "bench bounds: redirect stdout");
    if (saved < 0 || fd < 0) return;
    dup2(fd, 1);
    close(fd);
    int rc = cli_bench(12, args);
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    size_t n = 0;
    char *t = (char *)slurp(out, &n);
    CHECK(rc == 0 && t, "bench with bounds failed (%d)", rc);
    if (!t) return;
    t = realloc(t, n + 1);
    if (!t) return;
    t[n] = 0;
    CHECK(strstr(t, "| memory read bandwidth | ") && strstr(t, "| tg2 measured | ") &&
              strstr(t, "| tg2 against its own bandwidth | ") && strstr(t, "rep's t/s against the bound at the mean of "
                                                                            "the readings just before and after it (readings "),
          "bench bounds: rows missing:\n%s", t);
    free(t);
}

/* Same arguments and seed -> the same bytes; another seed -> other bytes. */
static void test_determinism(void) {
    char a[512], b[512], c[512];
    path_of(a, sizeof a, "gm-det-a.gguf");
    path_of(b, sizeof b, "gm-det-b.gguf");
    path_of(c, sizeof c, "gm-det-c.gguf");
    const char *args[] = { "--arch", "llama", "--vocab-from", g_spm, "--n-embd", "64", "--n-layer", "1",
                           "--head-dim", "16", "--n-ff", "96", "--type", "q4_0", "--seed", "7", "-t", "2", NULL };
    const char *args1[] = { "--arch", "llama", "--vocab-from", g_spm, "--n-embd", "64", "--n-layer", "1",
                            "--head-dim", "16", "--n-ff", "96", "--type", "q4_0", "--seed", "7", "-t", "1", NULL };
    const char *args8[] = { "--arch", "llama", "--vocab-from", g_spm, "--n-embd", "64", "--n-layer", "1",
                            "--head-dim", "16", "--n-ff", "96", "--type", "q4_0", "--seed", "8", NULL };
    CHECK(gen(a, args) == 0 && gen(b, args1) == 0 && gen(c, args8) == 0, "determinism: gen-model failed");
    size_t la, lb, lc;
    uint8_t *da = slurp(a, &la), *db = slurp(b, &lb), *dc = slurp(c, &lc);
    CHECK(da && db && la == lb && memcmp(da, db, la) == 0, "same seed, 2 vs 1 threads: files differ");
    CHECK(dc && lc == la && memcmp(da, dc, la) != 0, "different seeds gave identical files");
    free(da); free(db); free(dc);
    remove(a); remove(b); remove(c);
}

/* The values: norms are exactly 1, weights are N(0, 1.28 / sqrt(fan-in))
 * (token_embd 3.2 / sqrt(n_embd)), so the sample moments must be close. */
static void tensor_moments(const gguf_file *f, const char *name, double *mean, double *sd, double *mx) {
    const gguf_tensor *t = gguf_find_tensor(f, name);
    *mean = *sd = *mx = -1;
    if (!t || t->type != GGML_TYPE_F32) return;
    uint64_t n = t->ne[0] * t->ne[1] * t->ne[2];
    const float *v = t->data;
    double s = 0, q = 0, m = 0;
    for (uint64_t i = 0; i < n; i++) { s += v[i]; q += (double)v[i] * v[i]; if (fabs(v[i]) > m) m = fabs(v[i]); }
    *mean = s / n;
    *sd = sqrt(q / n - *mean * *mean);
    *mx = m;
}

static void test_values(void) {
    char p[512], err[256];
    path_of(p, sizeof p, "gm-values.gguf");
    const char *args[] = { "--arch", "llama", "--vocab-from", g_spm, "--n-embd", "64", "--n-layer", "1",
                           "--head-dim", "16", "--n-ff", "256", "--type", "f32", NULL };
    CHECK(gen(p, args) == 0, "values: gen-model failed");
    gguf_file *f = NULL;
    if (gguf_open_file(&f, p, err, sizeof err)) { CHECK(0, "values: %s", err); return; }
    double mean, sd, mx;
    tensor_moments(f, "blk.0.ffn_up.weight", &mean, &sd, &mx);   /* 16384 values */
    CHECK(fabs(mean) < 0.01 && fabs(sd - 0.16) < 0.005 && mx < 0.16 * 4.5,
          "ffn_up: mean %g sd %g max %g (want 0, 0.16, < 4.5 sd)", mean, sd, mx);
    tensor_moments(f, "token_embd.weight", &mean, &sd, &mx);     /* 2M values */
    CHECK(fabs(mean) < 0.001 && fabs(sd - 0.4) < 0.004, "token_embd: mean %g sd %g (want 0, 0.4)", mean, sd);
    tensor_moments(f, "blk.0.attn_norm.weight", &mean, &sd, &mx);
    CHECK(mean == 1.0 && sd == 0.0, "attn_norm: mean %g sd %g (want all 1)", mean, sd);
    gguf_close(f);
    remove(p);
}

/* Bad options are refused with a usage error, and write nothing. */
static void test_errors(void) {
    char p[512];
    path_of(p, sizeof p, "gm-bad.gguf");
    const char *no_vocab[] = { "--arch", "llama", NULL };
    const char *bad_heads[] = { "--arch", "qwen3", "--n-head", "5", "--n-head-kv", "2", NULL };
    const char *bad_type[] = { "--arch", "qwen3", "--type", "q3_k", NULL };
    const char *bad_preset[] = { "--preset", "gpt-5", NULL };
    CHECK(gen(p, no_vocab) != 0, "llama without --vocab-from accepted");
    /* qwen's default vocabulary comes from $TANDEM_FIXTURES only, never from a guessed path */
    const char *qwen_no_vocab[] = { "--arch", "qwen3", NULL };
    char *fx = getenv("TANDEM_FIXTURES") ? strdup(getenv("TANDEM_FIXTURES")) : NULL;
    unsetenv("TANDEM_FIXTURES");
    CHECK(gen(p, qwen_no_vocab) != 0, "qwen3 without --vocab-from or TANDEM_FIXTURES accepted");
    if (fx) { setenv("TANDEM_FIXTURES", fx, 1); free(fx); }
    CHECK(gen(p, bad_heads) != 0, "n_head not a multiple of n_head_kv accepted");
    CHECK(gen(p, bad_type) != 0, "unknown type accepted");
    CHECK(gen(p, bad_preset) != 0, "unknown preset accepted");
    CHECK(access(p, F_OK) != 0, "a refused run left a file behind");
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/tandem-test-genmodel-%d", (int)getpid());
    char cmd[300];
    snprintf(cmd, sizeof cmd, "mkdir -p %s", g_dir);
    if (system(cmd) != 0) { fprintf(stderr, "cannot create %s\n", g_dir); return 1; }
    snprintf(g_spm, sizeof g_spm, "%s/vocab/ggml-vocab-llama-spm.gguf", t_fixtures());
    snprintf(g_qwen, sizeof g_qwen, "%s/models/qwen3-mini-Q8_0.gguf", t_fixtures());
    test_errors();
    if (t_need(g_spm) && t_need(g_qwen)) {
        test_determinism();
        test_values();
        test_models();
        test_bench();
        test_bench_bounds();
    }
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", g_dir);
    return t_done("test_genmodel");
}
