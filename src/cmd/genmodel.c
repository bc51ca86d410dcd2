/* genmodel.c - `tandem gen-model`: writes a GGUF v3 model with deterministic
 * random weights at a real model's shape, so that speed can be measured (and
 * llama.cpp compared) without downloading real weights.
 *
 * Weights are N(0, std) quantised to 65536 levels (a table of the inverse
 * normal CDF indexed by 16 random bits). Every weight row has its own random
 * stream, derived from (seed, tensor name, row), so the file is the same
 * whatever the thread count. Rows are generated a few at a time and quantised
 * straight into the tensor's final buffer: the only large allocations are the
 * finished (quantised) tensors, which gguf_writer_save() needs all at once.
 *
 * The type mix follows llama-quantize's rules (llama_tensor_get_type) for the
 * mixes offered; see gm_pick_type.
 */
#include "cmd/cli.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/cliopt.h"
#include "engine/gguf.h"
#include "engine/model.h"
#include "engine/quant.h"
#include "base/threadpool.h"

/* ==== Shapes and presets ==== */

typedef struct {
    const char *preset;       /* NULL for a hand-made shape */
    const char *arch;         /* llama | qwen2 | qwen3 | qwen3moe */
    int n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff;
    int n_expert, n_expert_used, n_ff_exp;
    int n_ctx, tied;
    float rope_base, rms_eps;
} gm_shape;

/* Real shapes, from the models' config.json files. The qwen3moe "mini" keeps
 * Qwen3-30B-A3B's routing (128 experts, 8 used), head_dim 128 and 8:1 GQA, but
 * halves the width (n_embd 2048 -> 1024, 32 -> 16 query heads, 4 -> 2 KV
 * heads), uses 512-wide experts (a multiple of 256 like the real 768, so the
 * K-quants need no fallback) and 6 of the 48 layers: 1.55 B parameters, about
 * 1.6 GiB in Q8_0 and 0.95 GiB in Q4_K_M. */
static const gm_shape gm_presets[] = {
    { "qwen3-0.6b", "qwen3", 1024, 28, 16, 8, 128, 3072, 0, 0, 0, 40960, 1, 1e6f, 1e-6f },
    { "qwen3-1.7b", "qwen3", 2048, 28, 16, 8, 128, 6144, 0, 0, 0, 40960, 1, 1e6f, 1e-6f },
    /* Qwen2-0.5B ties its embeddings; this preset keeps a separate
     * output.weight (as asked) so the untied path is measured too. */
    { "qwen2-0.5b", "qwen2", 896, 24, 14, 2, 64, 4864, 0, 0, 0, 32768, 0, 1e6f, 1e-6f },
    { "qwen3moe-30b-a3b-mini", "qwen3moe", 1024, 6, 16, 2, 128, 3072, 128, 8, 512, 40960, 0, 1e6f, 1e-6f },
    /* Llama 3.2's rope_freqs (llama3 frequency scaling) tensor is left out:
     * it only matters beyond the original 8k context. */
    { "llama-3.2-1b", "llama", 2048, 16, 32, 8, 64, 8192, 0, 0, 0, 131072, 1, 500000.0f, 1e-5f },
};

/* The default shape of each architecture: the fixtures' "mini" models. */
static gm_shape gm_default_shape(const char *arch) {
    gm_shape s = { NULL, arch, 256, 4, 4, 2, 128, 768, 0, 0, 0, 4096, 1, 1e6f, 1e-6f };
    if (!strcmp(arch, "qwen2")) { s.head_dim = 64; s.tied = 0; }
    if (!strcmp(arch, "qwen3moe")) { s.n_expert = 8; s.n_expert_used = 2; s.n_ff_exp = 128; }
    if (!strcmp(arch, "llama")) { s.head_dim = 64; s.rope_base = 10000.0f; s.rms_eps = 1e-5f; }
    return s;
}

static int gm_arch_known(const char *a) {
    return a && (!strcmp(a, "llama") || !strcmp(a, "qwen2") || !strcmp(a, "qwen3") || !strcmp(a, "qwen3moe"));
}

/* ==== Type mixes ==== */

typedef struct {
    const char *name;
    uint32_t base;            /* the type most weights get */
    uint32_t ftype;           /* llama_ftype number for general.file_type */
    int more_bits;            /* the _M mixes: Q6_K for some attn_v / ffn_down */
} gm_mix;

/* llama_ftype: ALL_F32 0, MOSTLY_F16 1, Q4_0 2, Q4_1 3, Q8_0 7, Q5_1 9,
 * Q4_K_M 15, Q5_K_M 17, Q6_K 18, BF16 32. */
static const gm_mix gm_mixes[] = {
    { "f32", GGML_TYPE_F32, 0, 0 },       { "f16", GGML_TYPE_F16, 1, 0 },
    { "bf16", GGML_TYPE_BF16, 32, 0 },    { "q8_0", GGML_TYPE_Q8_0, 7, 0 },
    { "q4_0", GGML_TYPE_Q4_0, 2, 0 },     { "q4_k_m", GGML_TYPE_Q4_K, 15, 1 },
    { "q5_k_m", GGML_TYPE_Q5_K, 17, 1 },  { "q6_k", GGML_TYPE_Q6_K, 18, 0 },
    { "q4_1", GGML_TYPE_Q4_1, 3, 0 },     { "q5_1", GGML_TYPE_Q5_1, 9, 0 },
};

enum gm_role {
    GM_NORM, GM_BIAS, GM_ROUTER, GM_EMBD, GM_OUTPUT, GM_Q, GM_K, GM_V, GM_O,
    GM_GATE, GM_UP, GM_DOWN, GM_GATE_EXP, GM_UP_EXP, GM_DOWN_EXP
};

static int gm_is_kquant(uint32_t t) {
    return t == GGML_TYPE_Q4_K || t == GGML_TYPE_Q5_K || t == GGML_TYPE_Q6_K;
}

static int gm_is_float(uint32_t t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16;
}

/* llama-quantize's "use_more_bits": the first and last eighth of the layers
 * and every third layer in between. */
static int gm_use_more_bits(int i, int n) {
    return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
}

/* Rows whose length is not a multiple of the block size cannot hold that
 * type. llama-quantize then falls back: Q4_K -> Q5_0, Q5_K -> Q5_1,
 * Q6_K -> Q8_0, and to F16 when even 32 does not divide the row. This engine
 * has no Q5_1, so Q5_K falls back to Q8_0 here (a documented deviation). */
static uint32_t gm_fallback(uint32_t t, uint64_t ne0) {
    if (gm_is_kquant(t) && ne0 % QK_K)
        t = t == GGML_TYPE_Q4_K ? GGML_TYPE_Q5_0 : GGML_TYPE_Q8_0;
    if (!gm_is_float(t) && ne0 % 32) t = GGML_TYPE_F16;
    return t;
}

/* The storage type of one tensor under a mix, as llama-quantize picks it. */
static uint32_t gm_pick_type(const gm_mix *mx, enum gm_role role, int layer, const gm_shape *s, uint64_t ne0) {
    if (role == GM_NORM || role == GM_BIAS || role == GM_ROUTER) return GGML_TYPE_F32;
    if (gm_is_float(mx->base)) return mx->base;
    uint32_t t = mx->base;
    int is_output = role == GM_OUTPUT || (role == GM_EMBD && s->tied);
    if (is_output) {
        /* output.weight (or the tied embedding that serves as it) gets Q6_K,
         * or Q8_0 when the row is not a multiple of 256 */
        t = ne0 % QK_K ? GGML_TYPE_Q8_0 : (mx->base == GGML_TYPE_Q8_0 ? GGML_TYPE_Q8_0 : GGML_TYPE_Q6_K);
    } else if (role == GM_V) {
        if (mx->more_bits && gm_use_more_bits(layer, s->n_layer)) t = GGML_TYPE_Q6_K;
        if (s->n_expert == 8) t = GGML_TYPE_Q8_0;   /* llama.cpp's rule for 8-expert models */
    } else if (role == GM_K) {
        if (s->n_expert == 8) t = GGML_TYPE_Q8_0;
    } else if (role == GM_O) {
        if (s->n_expert == 8 && mx->ftype == 15) t = GGML_TYPE_Q5_K;
    } else if (role == GM_DOWN || role == GM_DOWN_EXP) {
        if (mx->more_bits && gm_use_more_bits(layer, s->n_layer)) t = GGML_TYPE_Q6_K;
    }
    return gm_fallback(t, ne0);
}

/* ==== Tensor list ==== */

typedef struct {
    char name[64];
    enum gm_role role;
    int layer;
    uint32_t n_dims, type;
    uint64_t ne[3];
    float std;                /* 0 for norms (all ones) */
    void *data;
    uint64_t nbytes;
} gm_tensor;

typedef struct {
    gm_tensor *t;
    int n, cap;
} gm_list;

/* Standard deviations. The embedding (and output) std makes logits of about
 * 3.2 standard deviations for a unit-RMS hidden state; projections get
 * 1.28 / sqrt(fan-in), experts 2.24 / sqrt(fan-in), biases 0.5. At n_embd 256
 * these are the fixtures' values (0.2, 0.08, 0.14), which give varied text. */
static float gm_std(enum gm_role role, const gm_shape *s, uint64_t ne0) {
    switch (role) {
    case GM_NORM: return 0.0f;
    case GM_BIAS: return 0.5f;
    case GM_EMBD: case GM_OUTPUT: return 3.2f / sqrtf((float)s->n_embd);
    case GM_GATE_EXP: case GM_UP_EXP: case GM_DOWN_EXP: return 2.24f / sqrtf((float)ne0);
    default: return 1.28f / sqrtf((float)ne0);
    }
}

static int gm_push(gm_list *l, const gm_shape *s, const gm_mix *mx, const char *name, enum gm_role role,
                   int layer, uint64_t ne0, uint64_t ne1, uint64_t ne2) {
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 64;
        gm_tensor *t = realloc(l->t, (size_t)cap * sizeof *t);
        if (!t) return -1;
        l->t = t;
        l->cap = cap;
    }
    gm_tensor *t = &l->t[l->n++];
    memset(t, 0, sizeof *t);
    if (layer >= 0) snprintf(t->name, sizeof t->name, "blk.%d.%s", layer, name);
    else snprintf(t->name, sizeof t->name, "%s", name);
    t->role = role;
    t->layer = layer;
    t->ne[0] = ne0; t->ne[1] = ne1; t->ne[2] = ne2;
    t->n_dims = ne2 > 1 ? 3 : ne1 > 1 ? 2 : 1;
    t->type = gm_pick_type(mx, role, layer, s, ne0);
    t->std = gm_std(role, s, ne0);
    t->nbytes = gguf_row_bytes(t->type, ne0) * ne1 * ne2;
    return t->nbytes ? 0 : -1;
}

/* All tensors of the model, with the names and shapes llama.cpp expects
 * (ggml order: ne[0] is the row length). */
static int gm_build_list(gm_list *l, const gm_shape *s, const gm_mix *mx, int n_vocab) {
    uint64_t E = (uint64_t)s->n_embd, qd = (uint64_t)s->n_head * s->head_dim;
    uint64_t kvd = (uint64_t)s->n_head_kv * s->head_dim, hd = (uint64_t)s->head_dim;
    int qwen2 = !strcmp(s->arch, "qwen2"), qknorm = !strncmp(s->arch, "qwen3", 5);
    int moe = !strcmp(s->arch, "qwen3moe");
    int rc = gm_push(l, s, mx, "token_embd.weight", GM_EMBD, -1, E, (uint64_t)n_vocab, 1);
    for (int il = 0; il < s->n_layer && !rc; il++) {
        rc |= gm_push(l, s, mx, "attn_norm.weight", GM_NORM, il, E, 1, 1);
        rc |= gm_push(l, s, mx, "attn_q.weight", GM_Q, il, E, qd, 1);
        rc |= gm_push(l, s, mx, "attn_k.weight", GM_K, il, E, kvd, 1);
        rc |= gm_push(l, s, mx, "attn_v.weight", GM_V, il, E, kvd, 1);
        if (qwen2) {
            rc |= gm_push(l, s, mx, "attn_q.bias", GM_BIAS, il, qd, 1, 1);
            rc |= gm_push(l, s, mx, "attn_k.bias", GM_BIAS, il, kvd, 1, 1);
            rc |= gm_push(l, s, mx, "attn_v.bias", GM_BIAS, il, kvd, 1, 1);
        }
        rc |= gm_push(l, s, mx, "attn_output.weight", GM_O, il, qd, E, 1);
        if (qknorm) {
            rc |= gm_push(l, s, mx, "attn_q_norm.weight", GM_NORM, il, hd, 1, 1);
            rc |= gm_push(l, s, mx, "attn_k_norm.weight", GM_NORM, il, hd, 1, 1);
        }
        rc |= gm_push(l, s, mx, "ffn_norm.weight", GM_NORM, il, E, 1, 1);
        if (moe) {
            uint64_t X = (uint64_t)s->n_expert, F = (uint64_t)s->n_ff_exp;
            rc |= gm_push(l, s, mx, "ffn_gate_inp.weight", GM_ROUTER, il, E, X, 1);
            rc |= gm_push(l, s, mx, "ffn_gate_exps.weight", GM_GATE_EXP, il, E, F, X);
            rc |= gm_push(l, s, mx, "ffn_up_exps.weight", GM_UP_EXP, il, E, F, X);
            rc |= gm_push(l, s, mx, "ffn_down_exps.weight", GM_DOWN_EXP, il, F, E, X);
        } else {
            uint64_t F = (uint64_t)s->n_ff;
            rc |= gm_push(l, s, mx, "ffn_gate.weight", GM_GATE, il, E, F, 1);
            rc |= gm_push(l, s, mx, "ffn_up.weight", GM_UP, il, E, F, 1);
            rc |= gm_push(l, s, mx, "ffn_down.weight", GM_DOWN, il, F, E, 1);
        }
    }
    if (!rc) rc = gm_push(l, s, mx, "output_norm.weight", GM_NORM, -1, E, 1, 1);
    if (!rc && !s->tied) rc = gm_push(l, s, mx, "output.weight", GM_OUTPUT, -1, E, (uint64_t)n_vocab, 1);
    return rc;
}

static void gm_list_free(gm_list *l) {
    for (int i = 0; i < l->n; i++) free(l->t[i].data);
    free(l->t);
    l->t = NULL;
    l->n = l->cap = 0;
}

/* ==== Random numbers ==== */

/* splitmix64's finaliser: a bijective 64-bit mixer. */
static uint64_t gm_mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* FNV-1a of the tensor name, mixed with the seed: one stream per tensor. */
static uint64_t gm_tensor_seed(uint64_t seed, const char *name) {
    uint64_t h = 0xCBF29CE484222325ull;
    for (const unsigned char *p = (const unsigned char *)name; *p; p++) h = (h ^ *p) * 0x100000001B3ull;
    return gm_mix64(h ^ gm_mix64(seed));
}

/* Inverse of the standard normal CDF by bisection on erfc (table build only). */
static double gm_inv_phi(double p) {
    double lo = -12.0, hi = 12.0;
    for (int i = 0; i < 80; i++) {
        double mid = 0.5 * (lo + hi);
        if (0.5 * erfc(-mid / sqrt(2.0)) < p) lo = mid; else hi = mid;
    }
    return 0.5 * (lo + hi);
}

/* table[k] = Phi^-1((k + 0.5) / 65536): a unit normal at 16-bit resolution. */
static float *gm_normal_table(void) {
    float *t = malloc(65536 * sizeof *t);
    if (!t) return NULL;
    for (int k = 0; k < 32768; k++) {
        float v = (float)gm_inv_phi((k + 0.5) / 65536.0);
        t[k] = v;
        t[65535 - k] = -v;     /* the distribution is symmetric */
    }
    return t;
}

/* ==== Generation ==== */

/* Rows generated (as f32) and quantised per step: bounds the scratch to
 * GM_ROWS * row length floats per thread. */
#define GM_ROWS 16

typedef struct {
    const gm_tensor *t;
    const float *table;
    uint64_t tseed;
    int failed;
} gm_job;

static void gm_fill_row(const gm_job *j, uint64_t row, float *x) {
    const gm_tensor *t = j->t;
    uint64_t n = t->ne[0];
    if (t->std == 0.0f) {
        for (uint64_t i = 0; i < n; i++) x[i] = 1.0f;
        return;
    }
    uint64_t st = gm_mix64(j->tseed ^ gm_mix64(row));
    for (uint64_t i = 0; i < n; i += 4) {
        uint64_t r = gm_mix64(st++);
        for (int k = 0; k < 4 && i + k < n; k++)
            x[i + k] = j->table[(r >> (16 * k)) & 0xFFFF] * t->std;
    }
}

static void gm_fill_job(void *ctx, int ith, int nth) {
    gm_job *j = ctx;
    const gm_tensor *t = j->t;
    long rows = (long)(t->ne[1] * t->ne[2]), lo, hi;
    tpool_split(rows, ith, nth, &lo, &hi);
    if (lo >= hi) return;
    float *x = malloc((size_t)t->ne[0] * GM_ROWS * sizeof *x);
    if (!x) { j->failed = 1; return; }
    uint64_t rb = gguf_row_bytes(t->type, t->ne[0]);
    for (long r0 = lo; r0 < hi; r0 += GM_ROWS) {
        long nr = hi - r0 < GM_ROWS ? hi - r0 : GM_ROWS;
        for (long r = 0; r < nr; r++) gm_fill_row(j, (uint64_t)(r0 + r), x + (size_t)r * t->ne[0]);
        if (quant_quantize_weight_rows(t->type, x, (uint8_t *)t->data + (size_t)r0 * rb, nr, (int64_t)t->ne[0])) {
            j->failed = 1;
            break;
        }
    }
    free(x);
}

static int gm_generate(gm_tensor *t, tpool *pool, const float *table, uint64_t seed) {
    t->data = malloc((size_t)t->nbytes);
    if (!t->data) return -1;
    gm_job j = { t, table, gm_tensor_seed(seed, t->name), 0 };
    tpool_run(pool, gm_fill_job, &j);
    return j.failed ? -1 : 0;
}

/* ==== Metadata ==== */

static int gm_add_hparams(gguf_writer *w, const gm_shape *s, const gm_mix *mx, const char *name, int n_vocab) {
    char k[128];
    const char *a = s->arch;
    int rc = gguf_writer_add_str(w, "general.architecture", a);
    rc |= gguf_writer_add_str(w, "general.name", name);
    rc |= gguf_writer_add_u32(w, "general.file_type", mx->ftype);
    rc |= gguf_writer_add_u32(w, "general.quantization_version", 2);
    rc |= gguf_writer_add_u32(w, "general.alignment", 32);
#define GM_U32(suffix, v) (snprintf(k, sizeof k, "%s." suffix, a), gguf_writer_add_u32(w, k, (uint32_t)(v)))
#define GM_F32(suffix, v) (snprintf(k, sizeof k, "%s." suffix, a), gguf_writer_add_f32(w, k, (v)))
    rc |= GM_U32("context_length", s->n_ctx);
    rc |= GM_U32("embedding_length", s->n_embd);
    rc |= GM_U32("block_count", s->n_layer);
    rc |= GM_U32("feed_forward_length", s->n_ff);
    rc |= GM_U32("attention.head_count", s->n_head);
    rc |= GM_U32("attention.head_count_kv", s->n_head_kv);
    rc |= GM_U32("attention.key_length", s->head_dim);
    rc |= GM_U32("attention.value_length", s->head_dim);
    rc |= GM_F32("rope.freq_base", s->rope_base);
    rc |= GM_F32("attention.layer_norm_rms_epsilon", s->rms_eps);
    if (!strcmp(a, "llama")) {
        rc |= GM_U32("rope.dimension_count", s->head_dim);
        rc |= GM_U32("vocab_size", n_vocab);
    }
    if (!strcmp(a, "qwen3moe")) {
        rc |= GM_U32("expert_count", s->n_expert);
        rc |= GM_U32("expert_used_count", s->n_expert_used);
        rc |= GM_U32("expert_feed_forward_length", s->n_ff_exp);
    }
#undef GM_U32
#undef GM_F32
    return rc ? -1 : 0;
}

/* The vocabulary size of a tokenizer source, or -1. */
static int gm_vocab_size(const gguf_file *src, char *err, size_t errlen) {
    gguf_arr toks;
    /* 2^24 tokens is far beyond any real vocabulary: refuse rather than
     * allocate an absurd embedding */
    if (gguf_get_arr(src, "tokenizer.ggml.tokens", &toks) || toks.elem_type != GGUF_VT_STR ||
        toks.n == 0 || toks.n > (1u << 24)) {
        snprintf(err, errlen, "the vocabulary source has no usable tokenizer.ggml.tokens");
        return -1;
    }
    return (int)toks.n;
}

/* Copies every tokenizer.* key of src. */
static int gm_copy_tokenizer(gguf_writer *w, const gguf_file *src, char *err, size_t errlen) {
    for (int64_t i = 0; i < gguf_count_kv(src); i++) {
        gguf_str key = gguf_kv_key(src, i);
        if (key.len < 10 || memcmp(key.ptr, "tokenizer.", 10)) continue;
        if (gguf_writer_copy_kv(w, src, i)) {
            snprintf(err, errlen, "cannot copy metadata key %.*s", (int)(key.len > 200 ? 200 : key.len), key.ptr);
            return -1;
        }
    }
    return 0;
}

/* ==== Options ==== */

typedef struct {
    gm_shape s;
    const gm_mix *mix;
    const char *out, *vocab_from, *name;
    uint64_t seed;
    int n_threads, quiet;
} gm_opts;

#define GM "tandem gen-model"

static void gm_usage(FILE *f) {
    fprintf(f,
        "usage: tandem gen-model (--preset NAME | --arch ARCH) -o OUT.gguf [options]\n"
        "  --preset NAME      qwen3-0.6b, qwen3-1.7b, qwen2-0.5b, qwen3moe-30b-a3b-mini, llama-3.2-1b\n"
        "  --arch ARCH        llama | qwen2 | qwen3 | qwen3moe (default shape: the fixtures' mini)\n"
        "  --type T           f32 f16 bf16 q8_0 q4_0 q4_1 q5_1 q4_k_m q5_k_m q6_k (default q8_0)\n"
        "  --vocab-from FILE  copy tokenizer.* from this GGUF (any model of the family: a Qwen\n"
        "                     GGUF for qwen2/qwen3/qwen3moe, a Llama one for llama); for qwen\n"
        "                     the default is $TANDEM_FIXTURES/models/qwen3-mini-Q8_0.gguf when\n"
        "                     TANDEM_FIXTURES is set\n"
        "  --n-embd --n-layer --n-head --n-head-kv --head-dim --n-ff --n-expert\n"
        "  --n-expert-used --n-ff-exp --ctx N   shape overrides\n"
        "  --rope-base F --rms-eps F --tied --untied --name NAME\n"
        "  --seed N (default 1)  -t N threads (default 2)  -q quiet (no progress, no summary)\n");
}

/* Shape values: gm_check_shape then checks how they fit together. */
static int gm_int(const char *opt, const char *v, int *out) { return cliopt_int(GM, opt, v, 0, 100000000, out); }

static const gm_mix *gm_find_mix(const char *name) {
    for (size_t i = 0; name && i < sizeof gm_mixes / sizeof gm_mixes[0]; i++)
        if (!strcmp(gm_mixes[i].name, name)) return &gm_mixes[i];
    return NULL;
}

/* First pass: the preset or arch, which the overrides then modify. */
static int gm_parse_base(int argc, char **argv, gm_shape *s) {
    const char *preset = NULL, *arch = NULL;
    for (int i = 0; i + 1 < argc; i++) {
        if (!strcmp(argv[i], "--preset")) preset = argv[i + 1];
        else if (!strcmp(argv[i], "--arch")) arch = argv[i + 1];
    }
    if (preset) {
        for (size_t i = 0; i < sizeof gm_presets / sizeof gm_presets[0]; i++)
            if (!strcmp(gm_presets[i].preset, preset)) {
                *s = gm_presets[i];
                if (arch && strcmp(arch, s->arch)) { fprintf(stderr, "tandem gen-model: --arch %s contradicts preset %s\n", arch, preset); return -1; }
                return 0;
            }
        fprintf(stderr, "tandem gen-model: unknown preset %s\n", preset);
        return -1;
    }
    if (!gm_arch_known(arch)) { fprintf(stderr, "tandem gen-model: need --preset or --arch llama|qwen2|qwen3|qwen3moe\n"); return -1; }
    *s = gm_default_shape(arch);
    return 0;
}

static int gm_parse(int argc, char **argv, gm_opts *o) {
    memset(o, 0, sizeof *o);
    o->seed = 1;
    o->n_threads = 2;
    o->mix = gm_find_mix("q8_0");
    if (gm_parse_base(argc, argv, &o->s)) return -1;
    gm_shape *s = &o->s;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0, takes = 1;
        const char *base;   /* read by gm_parse_base */
        if (!strcmp(a, "--preset") || !strcmp(a, "--arch")) bad = cliopt_str(GM, a, v, &base);
        else if (!strcmp(a, "-o")) bad = cliopt_str(GM, a, v, &o->out);
        else if (!strcmp(a, "--vocab-from")) bad = cliopt_str(GM, a, v, &o->vocab_from);
        else if (!strcmp(a, "--name")) bad = cliopt_str(GM, a, v, &o->name);
        else if (!strcmp(a, "--type")) {
            if ((bad = !(o->mix = gm_find_mix(v))))
                fprintf(stderr, GM ": --type: '%s' is not one of f32 f16 bf16 q8_0 q4_0 q4_1 q5_1 q4_k_m q5_k_m q6_k\n", v ? v : "");
        }
        else if (!strcmp(a, "--seed")) bad = cliopt_u64(GM, a, v, 0, UINT64_MAX, &o->seed);
        else if (!strcmp(a, "-t")) bad = cliopt_int(GM, a, v, 1, 256, &o->n_threads);
        else if (!strcmp(a, "--n-embd")) bad = gm_int(a, v, &s->n_embd);
        else if (!strcmp(a, "--n-layer")) bad = gm_int(a, v, &s->n_layer);
        else if (!strcmp(a, "--n-head")) bad = gm_int(a, v, &s->n_head);
        else if (!strcmp(a, "--n-head-kv")) bad = gm_int(a, v, &s->n_head_kv);
        else if (!strcmp(a, "--head-dim")) bad = gm_int(a, v, &s->head_dim);
        else if (!strcmp(a, "--n-ff")) bad = gm_int(a, v, &s->n_ff);
        else if (!strcmp(a, "--n-expert")) bad = gm_int(a, v, &s->n_expert);
        else if (!strcmp(a, "--n-expert-used")) bad = gm_int(a, v, &s->n_expert_used);
        else if (!strcmp(a, "--n-ff-exp")) bad = gm_int(a, v, &s->n_ff_exp);
        else if (!strcmp(a, "--ctx")) bad = gm_int(a, v, &s->n_ctx);
        else if (!strcmp(a, "--rope-base")) bad = cliopt_float(GM, a, v, 1, 1e9, &s->rope_base);
        else if (!strcmp(a, "--rms-eps")) bad = cliopt_float(GM, a, v, 1e-12, 1, &s->rms_eps);
        else {
            takes = 0;
            if (!strcmp(a, "--tied")) s->tied = 1;
            else if (!strcmp(a, "--untied")) s->tied = 0;
            else if (!strcmp(a, "-q")) o->quiet = 1;
            else { fprintf(stderr, GM ": unknown option %s (see tandem gen-model --help)\n", a); return -1; }
        }
        if (bad) return -1;   /* the message is out */
        i += takes;
    }
    if (!o->out) { fprintf(stderr, GM ": give -o OUT.gguf\n"); gm_usage(stderr); return -1; }
    return 0;
}

/* Shape sanity: what the loaders (ours and llama.cpp's) require. */
static int gm_check_shape(const gm_shape *s, char *err, size_t errlen) {
    int moe = !strcmp(s->arch, "qwen3moe");
    /* Caps far above any real model that keep every size computation
     * (row bytes x rows x experts) well inside 64 bits. */
    const int max_dim = 1 << 20, max_count = 4096;
    if (s->n_embd > max_dim || s->n_ff > max_dim || s->n_ff_exp > max_dim || s->head_dim > max_dim ||
        s->n_head > max_count || s->n_head_kv > max_count || s->n_layer > max_count || s->n_expert > max_count ||
        (int64_t)s->n_head * s->head_dim > max_dim)
        snprintf(err, errlen, "a dimension is beyond this tool's limits (%d per width, %d per count)", max_dim, max_count);
    else if (s->n_embd < 1 || s->n_layer < 1 || s->n_head < 1 || s->n_head_kv < 1 || s->head_dim < 2 ||
        s->n_ctx < 1 || (!moe && s->n_ff < 1))
        snprintf(err, errlen, "every dimension must be positive");
    else if (s->n_head % s->n_head_kv)
        snprintf(err, errlen, "n_head (%d) must be a multiple of n_head_kv (%d)", s->n_head, s->n_head_kv);
    else if (s->head_dim % 2)
        snprintf(err, errlen, "head_dim must be even (RoPE rotates pairs)");
    else if (moe && (s->n_expert < 1 || s->n_expert_used < 1 || s->n_expert_used > s->n_expert || s->n_ff_exp < 1))
        snprintf(err, errlen, "qwen3moe needs 1 <= n_expert_used <= n_expert and n_ff_exp > 0");
    else if (!moe && (s->n_expert || s->n_expert_used))
        snprintf(err, errlen, "experts are only supported by qwen3moe");
    else
        return 0;
    return -1;
}

/* ==== The command ==== */

static double gm_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The vocabulary when --vocab-from is not given: the fixture set's Qwen3
 * model, only where TANDEM_FIXTURES names the set (no guessed path). */
static const char *gm_default_vocab(const gm_shape *s, char *buf, size_t len) {
    const char *fx = getenv("TANDEM_FIXTURES");
    if (strncmp(s->arch, "qwen", 4) || !fx || !*fx) return NULL;
    snprintf(buf, len, "%s/models/qwen3-mini-Q8_0.gguf", fx);
    return buf;
}

/* Generates every tensor and hands it to the writer. */
static int gm_make_tensors(gguf_writer *w, gm_list *l, const gm_opts *o, char *err, size_t errlen) {
    float *table = gm_normal_table();
    tpool *pool = tpool_create(o->n_threads);
    int rc = table && pool ? 0 : -1;
    if (rc) snprintf(err, errlen, "out of memory");
    uint64_t total = 0, done = 0;
    for (int i = 0; i < l->n; i++) total += l->t[i].nbytes;
    cliopt_progress pg;
    cliopt_progress_begin(&pg, GM ": generating tensors", total, o->quiet);
    for (int i = 0; i < l->n && !rc; i++) {
        gm_tensor *t = &l->t[i];
        cliopt_progress_update(&pg, done);
        done += t->nbytes;
        if (gm_generate(t, pool, table, o->seed)) {
            snprintf(err, errlen, "cannot generate %s (%s, %.1f MiB): out of memory?", t->name,
                     gguf_type_name(t->type), t->nbytes / 1048576.0);
            rc = -1;
        } else if (gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, t->data)) {
            snprintf(err, errlen, "cannot add tensor %s", t->name);
            rc = -1;
        }
    }
    if (!rc) cliopt_progress_end(&pg);
    else if (pg.drawn && pg.tty) fputc('\n', stderr);
    if (pool) tpool_destroy(pool);
    free(table);
    return rc;
}

static int gm_write_model(const gm_opts *o, char *err, size_t errlen) {
    char vbuf[1024];
    const char *vpath = o->vocab_from ? o->vocab_from : gm_default_vocab(&o->s, vbuf, sizeof vbuf);
    if (!vpath) {
        snprintf(err, errlen, "arch %s needs --vocab-from FILE.gguf (a GGUF %s model whose tokenizer to copy%s)",
                 o->s.arch, strncmp(o->s.arch, "qwen", 4) ? "Llama" : "Qwen",
                 strncmp(o->s.arch, "qwen", 4) ? "" : ", or TANDEM_FIXTURES set to the test fixture set");
        return -1;
    }
    if (gm_check_shape(&o->s, err, errlen)) return -1;
    gguf_file *src = NULL;
    gguf_writer *w = gguf_writer_new(32);
    gm_list l = { 0 };
    int rc = -1, n_vocab;
    double t0 = gm_now();
    char name[128];
    snprintf(name, sizeof name, "%s", o->name ? o->name : o->s.preset ? o->s.preset : o->s.arch);
    if (!w) { snprintf(err, errlen, "out of memory"); goto out; }
    if (gguf_open_file(&src, vpath, err, errlen)) goto out;
    if ((n_vocab = gm_vocab_size(src, err, errlen)) < 0) goto out;
    if (gm_add_hparams(w, &o->s, o->mix, name, n_vocab)) { snprintf(err, errlen, "cannot write metadata"); goto out; }
    if (gm_copy_tokenizer(w, src, err, errlen)) goto out;
    if (gm_build_list(&l, &o->s, o->mix, n_vocab)) { snprintf(err, errlen, "a tensor shape does not fit its type"); goto out; }
    if (gm_make_tensors(w, &l, o, err, errlen)) goto out;
    cliopt_progress pg;
    cliopt_progress_begin(&pg, GM ": writing the file", 1, o->quiet);
    if (gguf_writer_save(w, o->out, err, errlen)) goto out;
    cliopt_progress_end(&pg);
    if (!o->quiet) {
        uint64_t params = 0, bytes = 0;
        for (int i = 0; i < l.n; i++) { params += l.t[i].ne[0] * l.t[i].ne[1] * l.t[i].ne[2]; bytes += l.t[i].nbytes; }
        fprintf(stderr, "wrote %s: %s, %d layers, n_embd %d, vocab %d, %.2f M params, %s (ftype %u), "
                "%.2f MiB of tensors, %.1f s\n", o->out, o->s.arch, o->s.n_layer, o->s.n_embd, n_vocab,
                params / 1e6, o->mix->name, o->mix->ftype, bytes / 1048576.0, gm_now() - t0);
    }
    rc = 0;
out:
    gm_list_free(&l);
    gguf_writer_free(w);
    gguf_close(src);
    return rc;
}

int cli_gen_model(int argc, char **argv) {
    gm_opts o;
    if (argc == 0) { gm_usage(stderr); return CLI_EXIT_USAGE; }
    if (cliopt_wants_help(argc, argv)) { gm_usage(stdout); return CLI_EXIT_OK; }
    if (gm_parse(argc, argv, &o)) return CLI_EXIT_USAGE;
    char err[512];
    if (gm_write_model(&o, err, sizeof err)) {
        fprintf(stderr, GM ": %s\n", err);
        return CLI_EXIT_FAIL;
    }
    return CLI_EXIT_OK;
}
