/* test_model_load.c - model_load refuses hostile hyper-parameters and tensor
 * shapes before anything is sized from them.
 *
 * Every case is a real model file rewritten with one or two metadata keys or
 * one tensor changed: tiny models written by `tandem gen-model` for llama,
 * qwen2, qwen3 and qwen3moe (with the stories260K tokenizer), and the shipped
 * fixtures (stories260K, the qwen mini models). Each must be refused with a
 * message naming the bad key or tensor. The untouched files, and a rewrite
 * that changes nothing, load and run a token to finite logits.
 *
 * A slice (model_opts.layer_hi) keeps resident only pages of its own
 * layers' tensors once loaded, its fingerprint hashed at load or later.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fcntl.h>

#include "cmd/cli.h"
#include "engine/fingerprint.h"
#include "engine/gguf.h"
#include "engine/model.h"
#include "t.h"

/* ==== Helpers ==== */

static char g_dir[256];
static char g_stories[512];

/* A change to a source file. Keys may hold "%s" for the architecture. */
typedef struct {
    struct { const char *key; uint32_t vtype; int64_t i; float f; } kv[2];   /* vtype 0: delete */
    const char *tensor;       /* replaced (or added) with zeros of this shape and type */
    uint32_t n_dims, type;
    uint64_t ne[4];
    uint32_t align;           /* general.alignment patched into the saved bytes, 0: none */
    const char *f32_fill;     /* tensor data: NULL zeros, "one" 1.0f (for F32 tensors) */
} mutation;

static void key_of(char *buf, size_t len, const char *fmt, const char *arch) {
    snprintf(buf, len, fmt, arch);
}

static int mut_add_kv(gguf_writer *w, const char *key, uint32_t vtype, int64_t i, float f) {
    switch (vtype) {
    case GGUF_VT_U32: return gguf_writer_add_u32(w, key, (uint32_t)i);
    case GGUF_VT_I32: return gguf_writer_add_i32(w, key, (int32_t)i);
    case GGUF_VT_F32: return gguf_writer_add_f32(w, key, f);
    default: return 0;
    }
}

/* Overwrites the u32 value of general.alignment in the file at path. */
static int patch_alignment(const char *path, uint32_t a) {
    FILE *f = fopen(path, "r+b");
    if (!f) return -1;
    static uint8_t buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf, f);
    static const char k[] = "general.alignment";
    int rc = -1;
    for (size_t i = 0; i + sizeof k - 1 + 8 <= n; i++) {
        if (memcmp(buf + i, k, sizeof k - 1) || buf[i + sizeof k - 1] != GGUF_VT_U32) continue;
        uint8_t v[4] = { (uint8_t)a, (uint8_t)(a >> 8), (uint8_t)(a >> 16), (uint8_t)(a >> 24) };
        rc = fseek(f, (long)(i + sizeof k - 1 + 4), SEEK_SET) == 0 && fwrite(v, 1, 4, f) == 4 ? 0 : -1;
        break;
    }
    fclose(f);
    return rc;
}

static int mut_is_set(const mutation *mu, const char *key, const char *arch) {
    char k[160];
    for (int j = 0; j < 2; j++) {
        if (!mu->kv[j].key) continue;
        key_of(k, sizeof k, mu->kv[j].key, arch);
        if (!strcmp(k, key)) return 1;
    }
    return 0;
}

/* Writes src with the mutation applied to dst. 0 on success. */
static int rewrite(const char *src, const char *dst, const mutation *mu) {
    char err[256], arch[64] = "", name[GGUF_MAX_TENSOR_NAME + 1], key[GGUF_MAX_KEY_LEN + 1];
    gguf_file *f = NULL;
    if (gguf_open_file(&f, src, err, sizeof err)) { fprintf(stderr, "%s: %s\n", src, err); return -1; }
    gguf_str a;
    if (gguf_get_str(f, "general.architecture", &a) == 0 && a.len < sizeof arch) memcpy(arch, a.ptr, a.len);
    gguf_writer *w = gguf_writer_new(0);
    void *fresh = NULL;
    int rc = w ? 0 : -1;
    for (int64_t i = 0; !rc && i < gguf_count_kv(f); i++) {
        gguf_str k = gguf_kv_key(f, i);
        memcpy(key, k.ptr, k.len);
        key[k.len] = 0;
        if (!mut_is_set(mu, key, arch)) rc = gguf_writer_copy_kv(w, f, i);
    }
    for (int j = 0; !rc && j < 2; j++) {
        if (!mu->kv[j].key || !mu->kv[j].vtype) continue;
        key_of(key, sizeof key, mu->kv[j].key, arch);
        rc = mut_add_kv(w, key, mu->kv[j].vtype, mu->kv[j].i, mu->kv[j].f);
    }
    int replaced = 0;
    if (!rc && mu->tensor) {
        uint64_t rows = mu->ne[1] * mu->ne[2] * mu->ne[3];
        size_t bytes = (size_t)(gguf_row_bytes(mu->type, mu->ne[0]) * rows);
        fresh = calloc(bytes ? bytes : 1, 1);
        if (!fresh) rc = -1;
        if (fresh && mu->f32_fill && mu->type == GGML_TYPE_F32)
            for (size_t e = 0; e < bytes / 4; e++) ((float *)fresh)[e] = 1.0f;
    }
    for (int64_t i = 0; !rc && i < gguf_count_tensors(f); i++) {
        const gguf_tensor *t = gguf_get_tensor(f, i);
        memcpy(name, t->name.ptr, t->name.len);
        name[t->name.len] = 0;
        if (mu->tensor && !strcmp(name, mu->tensor)) {
            rc = gguf_writer_add_tensor(w, name, mu->type, mu->n_dims, mu->ne, fresh);
            replaced = 1;
        } else {
            rc = gguf_writer_add_tensor(w, name, t->type, t->n_dims, t->ne, t->data);
        }
    }
    if (!rc && mu->tensor && !replaced) rc = gguf_writer_add_tensor(w, mu->tensor, mu->type, mu->n_dims, mu->ne, fresh);
    if (!rc) rc = gguf_writer_save(w, dst, err, sizeof err);
    if (!rc && mu->align) rc = patch_alignment(dst, mu->align);
    gguf_writer_free(w);
    free(fresh);
    gguf_close(f);
    return rc;
}

/* Loads path, evaluates one token, checks the logits are finite. */
static void check_runs(const char *path, const char *what) {
    char err[256];
    model_opts o = { .n_threads = 1, .n_batch = 8 };
    model *m = NULL;
    int rc = model_load(&m, path, &o, err, sizeof err);
    CHECK(rc == 0, "%s: model_load: %s", what, err);
    if (rc) return;
    const model_hparams *hp = model_get_hparams(m);
    session *s = NULL;
    rc = session_new(&s, m, 16, GGML_TYPE_F16, err, sizeof err);
    CHECK(rc == 0, "%s: session_new: %s", what, err);
    float *lg = malloc(sizeof(float) * (size_t)hp->n_vocab);
    int32_t id = 1;
    if (!rc && lg) {
        rc = model_eval(m, s, &id, 1, lg, NULL, NULL, err, sizeof err);
        CHECK(rc == 0, "%s: model_eval: %s", what, err);
        int finite = 1;
        for (int i = 0; !rc && i < hp->n_vocab; i++) finite &= isfinite(lg[i]) != 0;
        CHECK(finite, "%s: non-finite logits", what);
    }
    free(lg);
    session_free(s);
    model_free(m);
}

/* Rewrites src with mu and expects model_load to refuse it with a message
 * containing want ("%s" in want is replaced by the architecture). */
static void expect_refused(const char *src, const char *arch, const mutation *mu, const char *want, const char *what) {
    char dst[512], err[512] = "", sub[256];
    snprintf(dst, sizeof dst, "%s/mut-%s.gguf", g_dir, arch);
    key_of(sub, sizeof sub, want, arch);
    int rc = rewrite(src, dst, mu);
    CHECK(rc == 0, "%s %s: rewrite failed", arch, what);
    if (rc) return;
    model_opts o = { .n_threads = 1, .n_batch = 8 };
    model *m = NULL;
    rc = model_load(&m, dst, &o, err, sizeof err);
    CHECK(rc != 0 && strstr(err, sub), "%s %s: want refusal naming '%s', got rc %d: %s", arch, what, sub, rc, err);
    model_free(m);
    unlink(dst);
}

/* Rewritten with nothing changed: still loads and runs (the rewriter is faithful). */
static void expect_same(const char *src, const char *arch) {
    char dst[512];
    mutation none = { 0 };
    snprintf(dst, sizeof dst, "%s/same-%s.gguf", g_dir, arch);
    CHECK(rewrite(src, dst, &none) == 0, "%s: identity rewrite", arch);
    check_runs(dst, arch);
    unlink(dst);
}

#define KV1(k, t, v) { .kv = { { k, t, v, 0 } } }
#define KVF(k, v) { .kv = { { k, GGUF_VT_F32, 0, v } } }

/* ==== Cases ==== */

/* Tiny model shape (the gen-model arguments below): n_embd 32, 1 layer,
 * 4 heads of 32, 2 KV heads, n_ff 64, qwen3moe 4 experts (2 used) of 32. */
static int gen_tiny(const char *arch, const char *path, const char *head_dim) {
    const char *argv[] = { "--arch", arch, "--vocab-from", g_stories, "--n-embd", "32", "--n-layer", "1",
                           "--n-head", "4", "--n-head-kv", "2", "--head-dim", head_dim, "--n-ff", "64",
                           "--ctx", "64", "-q", "-o", path, NULL, NULL, NULL, NULL, NULL, NULL, NULL };
    int argc = 0;
    while (argv[argc]) argc++;
    if (!strcmp(arch, "qwen3moe")) {
        const char *moe[] = { "--n-expert", "4", "--n-expert-used", "2", "--n-ff-exp", "32" };
        for (int i = 0; i < 6; i++) argv[argc++] = moe[i];
    }
    return cli_gen_model(argc, (char **)argv);
}

/* Hyper-parameter cases common to the four architectures. */
static void test_hparams(const char *src, const char *arch) {
    int moe = !strcmp(arch, "qwen3moe");
    mutation mu;
    mu = (mutation)KV1("%s.feed_forward_length", GGUF_VT_U32, 0);
    expect_refused(src, arch, &mu, "%s.feed_forward_length = 0", "n_ff 0");
    mu = (mutation)KV1("%s.feed_forward_length", 0, 0);
    if (!moe) expect_refused(src, arch, &mu, "missing metadata key %s.feed_forward_length", "n_ff absent");
    mu = (mutation)KV1("%s.feed_forward_length", GGUF_VT_U32, 1u << 21);
    expect_refused(src, arch, &mu, "%s.feed_forward_length = 2097152", "n_ff huge");
    mu = (mutation)KV1("%s.attention.head_count", GGUF_VT_U32, 0);
    expect_refused(src, arch, &mu, "%s.attention.head_count = 0", "n_head 0");
    mu = (mutation)KV1("%s.attention.head_count", GGUF_VT_U32, 100000);
    expect_refused(src, arch, &mu, "%s.attention.head_count = 100000", "n_head huge");
    mu = (mutation)KV1("%s.attention.head_count_kv", GGUF_VT_U32, 3);
    expect_refused(src, arch, &mu, "%s.attention.head_count_kv = 3 does not divide", "n_head_kv 3 of 4");
    mu = (mutation)KV1("%s.attention.head_count_kv", GGUF_VT_U32, 0);
    expect_refused(src, arch, &mu, "%s.attention.head_count_kv = 0", "n_head_kv 0");
    mu = (mutation)KV1("%s.attention.head_count_kv", GGUF_VT_U32, 8);
    expect_refused(src, arch, &mu, "%s.attention.head_count_kv = 8", "n_head_kv > n_head");
    mu = (mutation)KV1("%s.embedding_length", GGUF_VT_U32, 4000000000u);
    expect_refused(src, arch, &mu, "%s.embedding_length = 4000000000", "n_embd huge");
    mu = (mutation)KV1("%s.embedding_length", GGUF_VT_I32, -32);
    expect_refused(src, arch, &mu, "%s.embedding_length = -32", "n_embd negative");
    mu = (mutation)KV1("%s.embedding_length", 0, 0);
    expect_refused(src, arch, &mu, "missing metadata key %s.embedding_length", "n_embd absent");
    mu = (mutation)KV1("%s.embedding_length", GGUF_VT_U32, 64);
    expect_refused(src, arch, &mu, "token_embd.weight has shape", "n_embd disagrees with tensors");
    mu = (mutation)KV1("%s.block_count", GGUF_VT_I32, -1);
    expect_refused(src, arch, &mu, "%s.block_count = -1", "n_layer negative");
    mu = (mutation)KV1("%s.block_count", GGUF_VT_U32, 2);
    expect_refused(src, arch, &mu, "missing tensor blk.1.", "n_layer beyond the tensors");
    mu = (mutation)KVF("%s.block_count", 1.0f);
    expect_refused(src, arch, &mu, "%s.block_count is not an integer", "n_layer float");
    mu = (mutation)KV1("%s.context_length", GGUF_VT_U32, 0);
    expect_refused(src, arch, &mu, "%s.context_length = 0", "n_ctx 0");
    mu = (mutation)KV1("%s.context_length", GGUF_VT_U32, 3000000000u);
    expect_refused(src, arch, &mu, "%s.context_length = 3000000000", "n_ctx huge");
    /* head dims: metadata that agrees with itself but not with the tensors */
    mu = (mutation){ .kv = { { "%s.attention.key_length", GGUF_VT_U32, 64, 0 }, { "%s.attention.value_length", GGUF_VT_U32, 64, 0 } } };
    expect_refused(src, arch, &mu, "blk.0.attn_q.weight has shape", "head dim 64 vs tensors of 32");
    mu = (mutation)KV1("%s.attention.value_length", GGUF_VT_U32, 64);
    expect_refused(src, arch, &mu, "%s.attention.value_length = 64 differs", "value_length != key_length");
    mu = (mutation)KV1("%s.attention.key_length", GGUF_VT_U32, 0);
    expect_refused(src, arch, &mu, "%s.attention.key_length = 0", "key_length 0");
    mu = (mutation)KV1("%s.attention.key_length", GGUF_VT_U32, 4096);
    expect_refused(src, arch, &mu, "%s.attention.key_length = 4096", "key_length huge");
    mu = (mutation)KV1("%s.rope.dimension_count", GGUF_VT_U32, 31);
    expect_refused(src, arch, &mu, "%s.rope.dimension_count = 31 is odd", "n_rot odd");
    mu = (mutation)KV1("%s.rope.dimension_count", GGUF_VT_U32, 64);
    expect_refused(src, arch, &mu, "%s.rope.dimension_count = 64 is out of range", "n_rot > head dim");
    mu = (mutation)KV1("%s.rope.dimension_count", GGUF_VT_U32, 0);
    expect_refused(src, arch, &mu, "%s.rope.dimension_count = 0", "n_rot 0");
    mu = (mutation)KVF("%s.attention.layer_norm_rms_epsilon", 0.0f);
    expect_refused(src, arch, &mu, "%s.attention.layer_norm_rms_epsilon = 0", "rms eps 0");
    mu = (mutation)KVF("%s.attention.layer_norm_rms_epsilon", NAN);
    expect_refused(src, arch, &mu, "%s.attention.layer_norm_rms_epsilon = nan", "rms eps NaN");
    mu = (mutation)KVF("%s.rope.freq_base", -1.0f);
    expect_refused(src, arch, &mu, "%s.rope.freq_base = -1", "freq_base negative");
    mu = (mutation)KVF("%s.rope.freq_base", INFINITY);
    expect_refused(src, arch, &mu, "%s.rope.freq_base = inf", "freq_base inf");
    mu = (mutation)KVF("%s.rope.scaling.factor", 0.0f);
    expect_refused(src, arch, &mu, "%s.rope.scaling.factor = 0", "rope scaling 0");
    /* vocabulary: tokenizer, vocab_size and embedding rows must agree */
    mu = (mutation)KV1("%s.vocab_size", GGUF_VT_U32, 1000);
    expect_refused(src, arch, &mu, "%s.vocab_size = 1000 but tokenizer.ggml.tokens has 512", "vocab_size");
    mu = (mutation){ .tensor = "token_embd.weight", .n_dims = 2, .type = GGML_TYPE_F16, .ne = { 32, 500, 1, 1 } };
    expect_refused(src, arch, &mu, "token_embd.weight has shape [32, 500, 1, 1], expected [32, 512, 1, 1]", "embedding rows");
    /* alignment (refused by the GGUF reader, naming the key) */
    mu = (mutation){ .align = 1 };
    expect_refused(src, arch, &mu, "general.alignment = 1 is not a power of two >= 8", "alignment 1");
    mu = (mutation){ .align = 12 };
    expect_refused(src, arch, &mu, "general.alignment = 12", "alignment 12");
    mu = (mutation){ .align = 4 };
    expect_refused(src, arch, &mu, "general.alignment = 4", "alignment 4");
}

/* Tensor shape and type cases. */
static void test_tensors(const char *src, const char *arch) {
    int moe = !strcmp(arch, "qwen3moe");
    mutation mu;
    if (moe) {
        mu = (mutation){ .tensor = "blk.0.ffn_down_exps.weight", .n_dims = 3, .type = GGML_TYPE_F16, .ne = { 32, 64, 4, 1 } };
        expect_refused(src, arch, &mu, "blk.0.ffn_down_exps.weight has shape", "expert down shape");
        mu = (mutation){ .tensor = "blk.0.ffn_gate_exps.weight", .n_dims = 3, .type = GGML_TYPE_F16, .ne = { 32, 32, 3, 1 } };
        expect_refused(src, arch, &mu, "blk.0.ffn_gate_exps.weight has shape", "expert count in tensor");
    } else {
        mu = (mutation){ .tensor = "blk.0.ffn_down.weight", .n_dims = 2, .type = GGML_TYPE_F16, .ne = { 64, 64, 1, 1 } };
        expect_refused(src, arch, &mu, "blk.0.ffn_down.weight has shape [64, 64, 1, 1], expected [64, 32, 1, 1]", "ffn_down shape");
        mu = (mutation){ .tensor = "blk.0.ffn_up.weight", .n_dims = 3, .type = GGML_TYPE_F16, .ne = { 32, 64, 2, 1 } };
        expect_refused(src, arch, &mu, "blk.0.ffn_up.weight has shape [32, 64, 2, 1]", "ffn_up 3rd dim");
    }
    mu = (mutation){ .tensor = "blk.0.attn_k.weight", .n_dims = 4, .type = GGML_TYPE_F16, .ne = { 32, 64, 1, 2 } };
    expect_refused(src, arch, &mu, "blk.0.attn_k.weight has shape [32, 64, 1, 2]", "4th dim");
    mu = (mutation){ .tensor = "blk.0.attn_output.weight", .n_dims = 2, .type = GGML_TYPE_F16, .ne = { 64, 32, 1, 1 } };
    expect_refused(src, arch, &mu, "blk.0.attn_output.weight has shape", "wo shape");
    mu = (mutation){ .tensor = "output_norm.weight", .n_dims = 1, .type = GGML_TYPE_F16, .ne = { 32, 1, 1, 1 } };
    expect_refused(src, arch, &mu, "output_norm.weight must be F32", "norm type");
    mu = (mutation){ .tensor = "blk.0.attn_q.weight", .n_dims = 2, .type = GGML_TYPE_I32, .ne = { 32, 128, 1, 1 } };
    expect_refused(src, arch, &mu, "blk.0.attn_q.weight has unsupported type I32", "weight type");
    mu = (mutation){ .tensor = "blk.0.attn_norm.weight", .n_dims = 1, .type = GGML_TYPE_F32, .ne = { 33, 1, 1, 1 } };
    expect_refused(src, arch, &mu, "blk.0.attn_norm.weight has shape [33, 1, 1, 1], expected [32, 1, 1, 1]", "norm length");
    if (!strcmp(arch, "qwen3") || moe) {
        mu = (mutation){ .tensor = "blk.0.attn_k_norm.weight", .n_dims = 1, .type = GGML_TYPE_F32, .ne = { 64, 1, 1, 1 } };
        expect_refused(src, arch, &mu, "blk.0.attn_k_norm.weight has shape", "k_norm length");
    }
    if (!strcmp(arch, "qwen2")) {
        mu = (mutation){ .tensor = "blk.0.attn_v.bias", .n_dims = 1, .type = GGML_TYPE_F32, .ne = { 128, 1, 1, 1 } };
        expect_refused(src, arch, &mu, "blk.0.attn_v.bias has shape", "v bias length");
        mu = (mutation){ .tensor = "output.weight", .n_dims = 2, .type = GGML_TYPE_F16, .ne = { 32, 511, 1, 1 } };
        expect_refused(src, arch, &mu, "output.weight has shape [32, 511, 1, 1], expected [32, 512, 1, 1]", "output rows");
    }
    /* Llama 3 rope_freqs: one F32 factor per rotated pair (head dim 32: 16), each > 0 */
    mu = (mutation){ .tensor = "rope_freqs.weight", .n_dims = 1, .type = GGML_TYPE_F32, .ne = { 17, 1, 1, 1 }, .f32_fill = "one" };
    expect_refused(src, arch, &mu, "rope_freqs.weight has shape [17, 1, 1, 1], expected [16, 1, 1, 1]", "rope_freqs length");
    mu = (mutation){ .tensor = "rope_freqs.weight", .n_dims = 1, .type = GGML_TYPE_F32, .ne = { 16, 1, 1, 1 } };
    expect_refused(src, arch, &mu, "rope_freqs.weight[0] = 0", "rope_freqs zero");
}

static void test_experts(const char *src) {
    const char *arch = "qwen3moe";
    mutation mu;
    mu = (mutation)KV1("%s.expert_feed_forward_length", GGUF_VT_U32, 0);
    expect_refused(src, arch, &mu, "qwen3moe.expert_feed_forward_length = 0", "n_ff_exp 0");
    mu = (mutation)KV1("%s.expert_feed_forward_length", GGUF_VT_U32, 64);
    expect_refused(src, arch, &mu, "blk.0.ffn_gate_exps.weight has shape", "n_ff_exp vs tensors");
    /* absent: llama.cpp's fallback n_ff / n_expert_used = 64 / 2 = 32, the tensors' width */
    mu = (mutation)KV1("%s.expert_feed_forward_length", 0, 0);
    char dst[512];
    snprintf(dst, sizeof dst, "%s/moe-noffexp.gguf", g_dir);
    CHECK(rewrite(src, dst, &mu) == 0, "rewrite without expert_feed_forward_length");
    check_runs(dst, "qwen3moe without expert_feed_forward_length");
    unlink(dst);
    mu = (mutation){ .kv = { { "%s.expert_feed_forward_length", 0, 0, 0 }, { "%s.feed_forward_length", 0, 0, 0 } } };
    expect_refused(src, arch, &mu, "missing metadata key qwen3moe.expert_feed_forward_length", "no expert width at all");
    mu = (mutation)KV1("%s.expert_used_count", GGUF_VT_U32, 5);
    expect_refused(src, arch, &mu, "qwen3moe.expert_used_count = 5 is out of range (must be 1..4)", "used > experts");
    mu = (mutation)KV1("%s.expert_used_count", GGUF_VT_U32, 0);
    expect_refused(src, arch, &mu, "qwen3moe.expert_used_count = 0", "used 0");
    mu = (mutation)KV1("%s.expert_count", GGUF_VT_U32, 300);
    expect_refused(src, arch, &mu, "qwen3moe.expert_count = 300", "experts > 256");
    mu = (mutation)KV1("%s.expert_count", GGUF_VT_U32, 0);
    expect_refused(src, arch, &mu, "qwen3moe.expert_count = 0", "experts 0");
    mu = (mutation)KV1("%s.expert_count", GGUF_VT_U32, 8);
    expect_refused(src, arch, &mu, "blk.0.ffn_gate_inp.weight has shape", "experts vs router");
    mu = (mutation)KV1("%s.expert_count", 0, 0);
    expect_refused(src, arch, &mu, "missing metadata key qwen3moe.expert_count", "experts absent");
}

/* A head dim that is not a multiple of the Q8_0 block: a Q8_0 KV cache is
 * refused (attention addresses it per head), an F16 one works. */
static void test_kv_head_dim(const char *path) {
    char err[256];
    model_opts o = { .n_threads = 1, .n_batch = 8 };
    model *m = NULL;
    int rc = model_load(&m, path, &o, err, sizeof err);
    CHECK(rc == 0, "head dim 48 model loads: %s", err);
    if (rc) return;
    session *s = NULL;
    rc = session_new(&s, m, 16, GGML_TYPE_Q8_0, err, sizeof err);
    CHECK(rc != 0 && strstr(err, "head dim 48"), "Q8_0 cache with head dim 48: rc %d %s", rc, err);
    session_free(s);
    s = NULL;
    rc = session_new(&s, m, 1 << 25, GGML_TYPE_F16, err, sizeof err);
    CHECK(rc != 0 && strstr(err, "context of"), "context beyond the cap: rc %d %s", rc, err);
    session_free(s);
    model_free(m);
    check_runs(path, "head dim 48 (F16 cache)");
}

/* The shipped fixtures: unchanged they run; with the reported crash's
 * metadata (a zero FFN width) they are refused. */
static void test_fixtures(void) {
    static const struct { const char *file; const char *arch; const char *key; const char *want; } fx[] = {
        { "models/stories260K.gguf", "llama", "%s.feed_forward_length", "llama.feed_forward_length = 0" },
        { "models/stories260K-F16.gguf", "llama", "%s.attention.head_count", "llama.attention.head_count = 0" },
        { "models/qwen2-mini-Q4_0.gguf", "qwen2", "%s.feed_forward_length", "qwen2.feed_forward_length = 0" },
        { "models/qwen3-mini-Q4_K_M.gguf", "qwen3", "%s.feed_forward_length", "qwen3.feed_forward_length = 0" },
        { "models/qwen3-mini-Q8_0.gguf", "qwen3", NULL, NULL },
        { "models/qwen3moe-mini-Q4_K_M.gguf", "qwen3moe", "%s.expert_feed_forward_length",
          "qwen3moe.expert_feed_forward_length = 0" },
    };
    char path[512];
    for (size_t i = 0; i < sizeof fx / sizeof fx[0]; i++) {
        t_fixture_path(path, sizeof path, fx[i].file);
        if (!t_need(path)) continue;
        if (access(path, R_OK) != 0) { CHECK(0, "fixture %s missing", path); continue; }
        check_runs(path, fx[i].file);
        if (!fx[i].key) continue;
        mutation mu = KV1(fx[i].key, GGUF_VT_U32, 0);
        expect_refused(path, fx[i].arch, &mu, fx[i].want, fx[i].file);
    }
    mutation mu = { .align = 1 };
    t_fixture_path(path, sizeof path, "models/stories260K.gguf");
    expect_refused(path, "llama", &mu, "general.alignment = 1", "stories260K alignment 1");
    static const char *const gen[] = { "qwen2-mini-F16.gguf", "qwen3-mini-F16.gguf", "qwen3moe-mini-F16.gguf" };
    for (size_t i = 0; i < sizeof gen / sizeof gen[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", t_models(), gen[i]);
        if (!t_need(path)) continue;
        CHECK(access(path, R_OK) == 0, "%s not built (make models)", path);
        if (access(path, R_OK) == 0) check_runs(path, gen[i]);
    }
}

/* ==== Slice residency ==== */

/* Resident pages of the model file's mapping outside every page that holds
 * some of blocks [lo, hi)' tensors (/proc/self/pagemap's present bit); -1
 * where the system cannot say. *inside gets those inside. The tensors are
 * found in a second mapping of the file (path): reading their names in the
 * model's own would map those pages again. */
static long slice_foreign_pages(const model *m, const char *path, int lo, int hi, long *inside) {
    const gguf_file *f = model_get_gguf(m);
    gguf_file *g = NULL;
    char err[256];
    long pg = sysconf(_SC_PAGESIZE);
    if (pg <= 0 || gguf_open_file(&g, path, err, sizeof err)) return -1;
    int fd = open("/proc/self/pagemap", O_RDONLY);
    uintptr_t base = (uintptr_t)gguf_get_base(f);
    size_t npg = (size_t)((gguf_get_size(f) + (uint64_t)pg - 1) / (uint64_t)pg);
    uint8_t *own = fd >= 0 ? calloc(npg, 1) : NULL;
    for (int64_t i = 0; own && i < gguf_count_tensors(g); i++) {
        const gguf_tensor *t = gguf_get_tensor(g, i);
        int blk = -1;
        if (!t || sscanf(t->name.ptr, "blk.%d.", &blk) != 1 || blk < lo || blk >= hi || !t->nbytes) continue;
        uint64_t off = gguf_get_data_offset(g) + t->offset;
        for (uint64_t k = off / (uint64_t)pg; k <= (off + t->nbytes - 1) / (uint64_t)pg && k < npg; k++) own[k] = 1;
    }
    long foreign = own ? 0 : -1;
    *inside = 0;
    for (size_t k = 0; own && k < npg; k++) {
        uint64_t e = 0;
        if (pread(fd, &e, 8, (off_t)((base / (uintptr_t)pg + k) * 8)) != 8) { foreign = -1; break; }
        if (e >> 63) { if (own[k]) (*inside)++; else foreign++; }
    }
    if (fd >= 0) close(fd);
    free(own);
    gguf_close(g);
    return foreign;
}

/* A middle slice of the Q8_0 fixture (packed by the CPU backend), hashed at
 * load and, the second time, at its first fingerprint: no page of the
 * metadata or of another layer stays resident, nor a page another layer
 * shares with nothing of the slice. */
static void test_slice_residency(void) {
    char path[512];
    t_fixture_path(path, sizeof path, "models/qwen3-mini-Q8_0.gguf");
    if (!t_need(path)) return;
    for (int later = 0; later < 2; later++) {
        model_opts o = { .n_threads = 2, .layer_lo = 1, .layer_hi = 2, .fingerprint_later = later };
        model *m = NULL;
        char err[512] = "";
        CHECK(model_load(&m, path, &o, err, sizeof err) == 0, "slice 1:2 of %s: %s", path, err);
        if (!m) continue;
        uint8_t fp[32];
        if (later) CHECK(model_fingerprint(m, fp, NULL, 0) == 0, "slice fingerprint");
        long inside = 0, foreign = slice_foreign_pages(m, path, 1, 2, &inside);
        printf("slice 1:2 (fingerprint %s): %ld resident pages of the file outside its layer, %ld inside\n",
               later ? "later" : "at load", foreign, inside);
        if (foreign >= 0) CHECK(foreign == 0, "slice 1:2: %ld pages of the file outside its layer resident", foreign);
        model_free(m);
    }
}

/* Slices sharing block 1 of the Q8_0 fixture: 0:1.5 (block 1's attention)
 * then 1.5:3 (its feed-forward, then block 2) bind between them exactly the
 * weights of 0:3, and their hidden states equal 0:3's bit for bit (the same
 * operations in the same order); a slice of one feed-forward is refused. */
static void test_half_blocks(void) {
    char path[512], err[512] = "";
    t_fixture_path(path, sizeof path, "models/qwen3-mini-Q8_0.gguf");
    if (!t_need(path)) return;
    model_opts oa = { .n_threads = 1, .layer_lo = 0, .layer_hi = 2, .attn_last = 1 };
    model_opts ob = { .n_threads = 1, .layer_lo = 1, .layer_hi = 3, .ffn_first = 1 };
    model_opts ow = { .n_threads = 1, .layer_lo = 0, .layer_hi = 3 };
    model_opts of = { .n_threads = 1, .layer_lo = 1, .layer_hi = 2, .ffn_first = 1 };
    model *a = NULL, *b = NULL, *w = NULL, *f = NULL;
    CHECK(model_load(&a, path, &oa, err, sizeof err) == 0, "slice 0:1.5: %s", err);
    CHECK(model_load(&b, path, &ob, err, sizeof err) == 0, "slice 1.5:3: %s", err);
    CHECK(model_load(&w, path, &ow, err, sizeof err) == 0, "slice 0:3: %s", err);
    CHECK(model_load(&f, path, &of, err, sizeof err) != 0 && strstr(err, "no block's attention"),
          "slice 1.5:2 refused: %s", err);
    model_free(f);
    if (!a || !b || !w) { model_free(a); model_free(b); model_free(w); return; }
    int lo, hi;
    model_get_halves(a, &lo, &hi);
    CHECK(lo == 0 && hi == 3, "0:1.5 is half blocks 0:3 (%d:%d)", lo, hi);
    model_get_halves(b, &lo, &hi);
    CHECK(lo == 3 && hi == 6, "1.5:3 is half blocks 3:6 (%d:%d)", lo, hi);
    uint64_t ba = model_weight_bytes_per_token(a), bb = model_weight_bytes_per_token(b), bw = model_weight_bytes_per_token(w);
    CHECK(ba + bb == bw && ba > 0 && bb > 0, "the halves bind 0:3's weights once: %llu + %llu = %llu",
          (unsigned long long)ba, (unsigned long long)bb, (unsigned long long)bw);
    enum { N = 24 };
    int dim = model_get_hparams(w)->n_embd;
    int32_t ids[N];
    for (int i = 0; i < N; i++) ids[i] = 1 + (i * 37) % 200;
    float *xa = malloc(sizeof(float) * N * (size_t)dim), *xb = malloc(sizeof(float) * N * (size_t)dim),
          *xw = malloc(sizeof(float) * N * (size_t)dim);
    session *sa = NULL, *sb = NULL, *sw = NULL;
    int ok = xa && xb && xw && session_new(&sa, a, 64, GGML_TYPE_F16, err, sizeof err) == 0 &&
             session_new(&sb, b, 64, GGML_TYPE_F16, err, sizeof err) == 0 &&
             session_new(&sw, w, 64, GGML_TYPE_F16, err, sizeof err) == 0;
    CHECK(ok, "sessions: %s", err);
    if (ok) {
        CHECK(model_eval_slice(a, sa, ids, NULL, N, xa, NULL, NULL, err, sizeof err) == 0, "eval 0:1.5: %s", err);
        CHECK(model_eval_slice(b, sb, NULL, xa, N, xb, NULL, NULL, err, sizeof err) == 0, "eval 1.5:3: %s", err);
        CHECK(model_eval_slice(w, sw, ids, NULL, N, xw, NULL, NULL, err, sizeof err) == 0, "eval 0:3: %s", err);
        CHECK(!memcmp(xb, xw, sizeof(float) * N * (size_t)dim), "0:1.5 then 1.5:3 equals 0:3 bit for bit");
        CHECK(model_eval_slice(b, sb, ids, NULL, N, xb, NULL, NULL, err, sizeof err) != 0 && strstr(err, "hidden states"),
              "1.5:3 takes hidden states, not ids: %s", err);
    }
    session_free(sa); session_free(sb); session_free(sw);
    free(xa); free(xb); free(xw);
    model_free(a); model_free(b); model_free(w);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/tandem-test-model-load-%d", (int)getpid());
    char cmd[300];
    snprintf(cmd, sizeof cmd, "mkdir -p %s", g_dir);
    if (system(cmd) != 0) { fprintf(stderr, "cannot create %s\n", g_dir); return 1; }
    t_fixture_path(g_stories, sizeof g_stories, "models/stories260K.gguf");
    static const char *const arches[] = { "llama", "qwen2", "qwen3", "qwen3moe" };
    char path[512];
    for (size_t i = 0; i < sizeof arches / sizeof arches[0]; i++) {
        snprintf(path, sizeof path, "%s/tiny-%s.gguf", g_dir, arches[i]);
        int rc = gen_tiny(arches[i], path, "32");
        CHECK(rc == 0, "gen-model %s: exit %d", arches[i], rc);
        if (rc) continue;
        check_runs(path, path);
        expect_same(path, arches[i]);
        test_hparams(path, arches[i]);
        test_tensors(path, arches[i]);
        if (!strcmp(arches[i], "qwen3moe")) test_experts(path);
    }
    snprintf(path, sizeof path, "%s/tiny-qwen3-hd48.gguf", g_dir);
    CHECK(gen_tiny("qwen3", path, "48") == 0, "gen-model qwen3 head dim 48");
    test_kv_head_dim(path);
    test_fixtures();
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", g_dir);
    test_slice_residency();
    test_half_blocks();
    return t_done("test_model_load");
}
