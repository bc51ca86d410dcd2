/* model.c - GGUF -> model: architecture table, hyper-parameters, weight
 * binding with shape and type checks, sessions. The forward pass itself is
 * in forward.c. */
#include "engine/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/platform.h"
#include "engine/fingerprint.h"
#include "engine/model_internal.h"
#include "engine/quant.h"
#include <unistd.h>

/* ==== Architectures ==== */

static const struct { const char *name; enum arch_id id; int rope_mode; } ARCHES[] = {
    { "llama", ARCH_LLAMA, ROPE_NORM },
    { "qwen2", ARCH_QWEN2, ROPE_NEOX },
    { "qwen3", ARCH_QWEN3, ROPE_NEOX },
    { "qwen3moe", ARCH_QWEN3MOE, ROPE_NEOX },
};

/* ==== Limits ==== */
/* Every hyper-parameter is bounded before anything is sized from it. The caps
 * are far beyond any released model of the supported families, and small
 * enough that the products the engine forms (activations: n_batch x width
 * floats; KV cache: n_layer x n_ctx x kv width; per-head scratch) fit in
 * size_t with room to spare, so a file that claims more is refused instead
 * of overflowing an allocation size or asking for terabytes. */
#define MODEL_MAX_EMBD      65536      /* Llama 3.1 405B: 16384 */
#define MODEL_MAX_LAYER     1024       /* Llama 3.1 405B: 126 */
#define MODEL_MAX_HEAD      1024       /* Llama 3.1 405B: 128 query heads */
#define MODEL_MAX_HEAD_DIM  512        /* the widest heads in these families are 256 */
#define MODEL_MAX_ROT       1024       /* backend_cpu.c's rope keeps n_rot/2 cos/sin pairs on the stack */
#define MODEL_MAX_FF        (1 << 20)  /* Llama 3.1 405B: 53248 */
#define MODEL_MAX_EXPERT    256        /* the MoE router's top-k keeps at most 256 probabilities */
#define MODEL_MAX_VOCAB     (1 << 24)  /* Gemma 3: 262144 */
#define MODEL_MAX_CTX       (1 << 24)  /* Qwen2.5-1M: 1010000 */

/* ==== Metadata helpers ==== */

/* Integer key "<arch>.<suffix>" into *out, which must end in lo..hi. Absent:
 * an error when required, else def (a constant or a value derived from keys
 * already read; it is range-checked too). Present: any integer type, either
 * sign. Errors name the key and the value, e.g.
 * "qwen3.feed_forward_length = 0 is out of range (must be 1..1048576)". */
static int meta_int(const gguf_file *f, const char *arch, const char *suffix, int required, int64_t def,
                    int64_t lo, int64_t hi, int *out, char *err, size_t errlen) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int64_t v = def;
    int rc = gguf_get_i64(f, key, &v);
    if (rc == -1 && required) { snprintf(err, errlen, "missing metadata key %s", key); return -1; }
    if (rc == -2) { snprintf(err, errlen, "metadata key %s is not an integer that fits in 64 bits", key); return -1; }
    if (v < lo || v > hi) {
        snprintf(err, errlen, "%s = %lld%s is out of range (must be %lld..%lld)", key, (long long)v,
                 rc == -1 ? " (absent: the default)" : "", (long long)lo, (long long)hi);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* Float key "<arch>.<suffix>": absent -> def; present -> finite and > 0
 * (every float hyper-parameter here is a scale, a base or an epsilon). */
static int meta_pos_float(const gguf_file *f, const char *arch, const char *suffix, float def, float *out,
                          char *err, size_t errlen) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int rc = gguf_get_f32(f, key, out);
    if (rc == -1) { *out = def; return 0; }
    if (rc != 0) { snprintf(err, errlen, "metadata key %s is not a float", key); return -1; }
    if (!isfinite(*out) || *out <= 0.0f) {
        snprintf(err, errlen, "%s = %g is out of range (must be finite and > 0)", key, (double)*out);
        return -1;
    }
    return 0;
}

static int model_read_arch(model *m, char *err, size_t errlen) {
    gguf_str a;
    if (gguf_get_str(m->gf, "general.architecture", &a) != 0) {
        snprintf(err, errlen, "missing general.architecture");
        return -1;
    }
    for (size_t i = 0; i < sizeof ARCHES / sizeof ARCHES[0]; i++) {
        if (!gguf_str_eq(a, ARCHES[i].name)) continue;
        m->hp.arch = ARCHES[i].id;
        m->hp.arch_name = ARCHES[i].name;
        m->hp.rope.mode = ARCHES[i].rope_mode;
        return 0;
    }
    snprintf(err, errlen, "unsupported architecture '%.*s' (supported: llama, qwen2, qwen3, qwen3moe)",
             (int)(a.len > 64 ? 64 : a.len), a.ptr);
    return -1;
}

/* Widths: embedding, layers, heads and head dims. */
static int model_read_shape(model *m, char *err, size_t errlen) {
    model_hparams *h = &m->hp;
    const gguf_file *f = m->gf;
    const char *an = h->arch_name;
    if (meta_int(f, an, "context_length", 0, 4096, 1, MODEL_MAX_CTX, &h->n_ctx_train, err, errlen) ||
        meta_int(f, an, "embedding_length", 1, 0, 1, MODEL_MAX_EMBD, &h->n_embd, err, errlen) ||
        meta_int(f, an, "block_count", 1, 0, 1, MODEL_MAX_LAYER, &h->n_layer, err, errlen) ||
        meta_int(f, an, "attention.head_count", 1, 0, 1, MODEL_MAX_HEAD, &h->n_head, err, errlen) ||
        meta_int(f, an, "attention.head_count_kv", 0, h->n_head, 1, h->n_head, &h->n_head_kv, err, errlen))
        return -1;
    if (h->n_head % h->n_head_kv) {
        snprintf(err, errlen, "%s.attention.head_count_kv = %d does not divide %s.attention.head_count = %d",
                 an, h->n_head_kv, an, h->n_head);
        return -1;
    }
    char key[160];
    snprintf(key, sizeof key, "%s.attention.key_length", an);
    if (gguf_find_kv(f, key) < 0 && h->n_embd % h->n_head) {
        /* the default head size is n_embd / n_head, which must then be exact */
        snprintf(err, errlen, "%s is absent and %s.embedding_length = %d is not a multiple of %s.attention.head_count = %d",
                 key, an, h->n_embd, an, h->n_head);
        return -1;
    }
    if (meta_int(f, an, "attention.key_length", 0, h->n_embd / h->n_head, 1, MODEL_MAX_HEAD_DIM,
                 &h->head_dim_k, err, errlen) ||
        meta_int(f, an, "attention.value_length", 0, h->head_dim_k, 1, MODEL_MAX_HEAD_DIM,
                 &h->head_dim_v, err, errlen))
        return -1;
    if (h->head_dim_v != h->head_dim_k) {
        /* the attention output buffer and Wo are sized with one head dim */
        snprintf(err, errlen, "%s.attention.value_length = %d differs from %s.attention.key_length = %d (unsupported)",
                 an, h->head_dim_v, an, h->head_dim_k);
        return -1;
    }
    return 0;
}

/* RoPE and normalisation constants. */
static int model_read_rope(model *m, char *err, size_t errlen) {
    model_hparams *h = &m->hp;
    const gguf_file *f = m->gf;
    const char *an = h->arch_name;
    int rot_max = h->head_dim_k < MODEL_MAX_ROT ? h->head_dim_k : MODEL_MAX_ROT;
    if (meta_int(f, an, "rope.dimension_count", 0, h->head_dim_k, 2, rot_max, &h->rope.n_rot, err, errlen) ||
        meta_pos_float(f, an, "attention.layer_norm_rms_epsilon", 1e-5f, &h->rms_eps, err, errlen) ||
        meta_pos_float(f, an, "rope.freq_base", 10000.0f, &h->rope.freq_base, err, errlen))
        return -1;
    if (h->rope.n_rot % 2) {
        snprintf(err, errlen, "%s.rope.dimension_count = %d is odd (RoPE rotates pairs)", an, h->rope.n_rot);
        return -1;
    }
    float scale = 1.0f;
    if (meta_pos_float(f, an, "rope.scaling.factor", 1.0f, &scale, err, errlen)) return -1;
    gguf_str st;
    h->rope.freq_scale = 1.0f;
    if (gguf_get_str(f, "llama.rope.scaling.type", &st) == 0 && gguf_str_eq(st, "linear"))
        h->rope.freq_scale = 1.0f / scale;
    return 0;
}

/* Feed-forward widths and, for qwen3moe, the experts. */
static int model_read_ffn(model *m, char *err, size_t errlen) {
    model_hparams *h = &m->hp;
    const gguf_file *f = m->gf;
    const char *an = h->arch_name;
    int moe = h->arch == ARCH_QWEN3MOE;
    char key[160];
    snprintf(key, sizeof key, "%s.feed_forward_length", an);
    /* qwen3moe has no dense FFN: the key is optional there, but never 0 */
    h->n_ff = 0;
    if ((!moe || gguf_find_kv(f, key) >= 0) &&
        meta_int(f, an, "feed_forward_length", 1, 0, 1, MODEL_MAX_FF, &h->n_ff, err, errlen))
        return -1;
    if (!moe) return 0;
    if (meta_int(f, an, "expert_count", 1, 0, 1, MODEL_MAX_EXPERT, &h->n_expert, err, errlen) ||
        meta_int(f, an, "expert_used_count", 1, 0, 1, h->n_expert, &h->n_expert_used, err, errlen))
        return -1;
    /* llama.cpp's fallback when the expert width is absent: n_ff / n_expert_used */
    int def_ff = h->n_ff / h->n_expert_used;
    if (meta_int(f, an, "expert_feed_forward_length", def_ff < 1, def_ff, 1, MODEL_MAX_FF, &h->n_ff_exp,
                 err, errlen))
        return -1;
    int norm = 1;   /* qwen3moe renormalises the top-k weights unless the file says otherwise */
    snprintf(key, sizeof key, "%s.expert_weights_norm", an);
    if (gguf_get_bool(f, key, &norm) == -2) { snprintf(err, errlen, "metadata key %s is not a bool", key); return -1; }
    h->expert_norm = norm;
    return 0;
}

static int model_read_hparams(model *m, char *err, size_t errlen) {
    return model_read_arch(m, err, errlen) || model_read_shape(m, err, errlen) ||
           model_read_rope(m, err, errlen) || model_read_ffn(m, err, errlen) ? -1 : 0;
}

/* The vocabulary size is the tokenizer's; {arch}.vocab_size, when present,
 * must agree (token_embd and output rows are checked against it at binding). */
static int model_check_vocab(model *m, char *err, size_t errlen) {
    model_hparams *h = &m->hp;
    gguf_arr toks;
    int nv = m->tok ? tokenizer_n_vocab(m->tok)
             : gguf_get_arr(m->gf, "tokenizer.ggml.tokens", &toks) || toks.elem_type != GGUF_VT_STR ? 0
             : toks.n > (uint64_t)MODEL_MAX_VOCAB ? MODEL_MAX_VOCAB + 1 : (int)toks.n;
    if (nv < 1 || nv > MODEL_MAX_VOCAB) {
        snprintf(err, errlen, "tokenizer.ggml.tokens has %d entries (must be 1..%d)", nv, MODEL_MAX_VOCAB);
        return -1;
    }
    int vs;
    if (meta_int(m->gf, h->arch_name, "vocab_size", 0, nv, 1, MODEL_MAX_VOCAB, &vs, err, errlen)) return -1;
    if (vs != nv) {
        snprintf(err, errlen, "%s.vocab_size = %d but tokenizer.ggml.tokens has %d entries", h->arch_name, vs, nv);
        return -1;
    }
    h->n_vocab = nv;
    return 0;
}

/* ==== Weights ==== */

/* What a tensor is used as: a weight matrix (matrix products, embedding
 * rows: any supported type) or a plain f32 vector (norms, biases, rope
 * frequency factors). */
enum { W_MAT, W_F32 };

/* Bind tensor `name`, checking its type and all four dimensions against
 * `want` (from the hyper-parameters; every entry >= 1, nothing is "any"). */
static int model_bind(model *m, be_weight *w, const char *name, int required, int kind,
                      const int64_t want[4], char *err, size_t errlen) {
    const gguf_tensor *t = gguf_find_tensor(m->gf, name);
    memset(w, 0, sizeof *w);
    if (!t) {
        if (!required) return 0;
        snprintf(err, errlen, "missing tensor %s", name);
        return -1;
    }
    int shape_ok = 1;
    for (int d = 0; d < 4; d++)
        if (want[d] < 1 || t->ne[d] != (uint64_t)want[d]) shape_ok = 0;
    if (!shape_ok) {
        snprintf(err, errlen, "tensor %s has shape [%llu, %llu, %llu, %llu], expected [%lld, %lld, %lld, %lld]", name,
                 (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], (unsigned long long)t->ne[2],
                 (unsigned long long)t->ne[3], (long long)want[0], (long long)want[1], (long long)want[2],
                 (long long)want[3]);
        return -1;
    }
    if (kind == W_F32 && (t->type != GGML_TYPE_F32 || (uintptr_t)t->data % sizeof(float))) {
        snprintf(err, errlen, "tensor %s must be F32 (and 4-byte aligned), is %s", name, gguf_type_name(t->type));
        return -1;
    }
    /* activations are quantised per row to the weight's vec_dot type, whose
     * block must divide the row too */
    if (kind == W_MAT && (!quant_is_supported(t->type) ||
                          gguf_row_bytes(quant_vec_dot_type(t->type), t->ne[0]) == 0)) {
        snprintf(err, errlen, "tensor %s has unsupported type %s (supported: F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, Q4_K, Q5_K, Q6_K)",
                 name, gguf_type_name(t->type));
        return -1;
    }
    w->name = m->names[m->n_names++] = strdup(name);
    if (!w->name) { snprintf(err, errlen, "out of memory"); return -1; }
    w->type = t->type;
    for (int d = 0; d < 4; d++) w->ne[d] = (int64_t)t->ne[d];
    w->row_bytes = gguf_row_bytes(t->type, t->ne[0]);
    w->data = t->data;
    w->file_mapped = 1;   /* model_load opens the file with gguf_open_file: a PROT_READ mapping */
    m->n_bound++;
    return 0;
}

#define SHAPE(a, b, c) ((const int64_t[4]){ (a), (b), (c), 1 })

/* Layer tensor blk.<il>.<suffix> into L->field (n: a name buffer in scope). */
#define BIND(field, suffix, req, kind, shape) \
    (snprintf(n, sizeof n, "blk.%d.%s", il, suffix), model_bind(m, &L->field, n, req, kind, shape, err, errlen))

static int model_bind_attn(model *m, int il, char *err, size_t errlen) {
    const model_hparams *h = &m->hp;
    model_layer *L = &m->layers[il];
    char n[96];
    int64_t E = h->n_embd, D = h->head_dim_k;
    int64_t qd = (int64_t)h->n_head * D, kvd = (int64_t)h->n_head_kv * D;
    int bias = h->arch == ARCH_QWEN2, qk_norm = h->arch == ARCH_QWEN3 || h->arch == ARCH_QWEN3MOE;
    if (BIND(attn_norm, "attn_norm.weight", 1, W_F32, SHAPE(E, 1, 1)) ||
        BIND(wq, "attn_q.weight", 1, W_MAT, SHAPE(E, qd, 1)) ||
        BIND(wk, "attn_k.weight", 1, W_MAT, SHAPE(E, kvd, 1)) ||
        BIND(wv, "attn_v.weight", 1, W_MAT, SHAPE(E, kvd, 1)) ||
        BIND(wo, "attn_output.weight", 1, W_MAT, SHAPE(qd, E, 1)) ||
        BIND(bq, "attn_q.bias", bias, W_F32, SHAPE(qd, 1, 1)) ||
        BIND(bk, "attn_k.bias", bias, W_F32, SHAPE(kvd, 1, 1)) ||
        BIND(bv, "attn_v.bias", bias, W_F32, SHAPE(kvd, 1, 1)) ||
        BIND(q_norm, "attn_q_norm.weight", qk_norm, W_F32, SHAPE(D, 1, 1)) ||
        BIND(k_norm, "attn_k_norm.weight", qk_norm, W_F32, SHAPE(D, 1, 1)))
        return -1;
    return 0;
}

static int model_bind_ffn(model *m, int il, char *err, size_t errlen) {
    const model_hparams *h = &m->hp;
    model_layer *L = &m->layers[il];
    char n[96];
    int64_t E = h->n_embd;
    if (BIND(ffn_norm, "ffn_norm.weight", 1, W_F32, SHAPE(E, 1, 1))) return -1;
    if (h->arch == ARCH_QWEN3MOE) {
        int64_t F = h->n_ff_exp, X = h->n_expert;
        if (BIND(gate_inp, "ffn_gate_inp.weight", 1, W_MAT, SHAPE(E, X, 1)) ||
            BIND(gate_exps, "ffn_gate_exps.weight", 1, W_MAT, SHAPE(E, F, X)) ||
            BIND(up_exps, "ffn_up_exps.weight", 1, W_MAT, SHAPE(E, F, X)) ||
            BIND(down_exps, "ffn_down_exps.weight", 1, W_MAT, SHAPE(F, E, X)))
            return -1;
        L->moe = (be_moe){ &L->gate_inp, &L->gate_exps, &L->up_exps, &L->down_exps,
                           h->n_expert, h->n_expert_used, h->expert_norm };
        return 0;
    }
    int64_t F = h->n_ff;
    if (BIND(ffn_gate, "ffn_gate.weight", 1, W_MAT, SHAPE(E, F, 1)) ||
        BIND(ffn_up, "ffn_up.weight", 1, W_MAT, SHAPE(E, F, 1)) ||
        BIND(ffn_down, "ffn_down.weight", 1, W_MAT, SHAPE(F, E, 1)))
        return -1;
    return 0;
}
#undef BIND

/* Llama 3.x rope_freqs: one divisor per rotated pair, each finite and > 0. */
static int model_bind_rope_freqs(model *m, char *err, size_t errlen) {
    model_hparams *h = &m->hp;
    if (model_bind(m, &m->rope_freqs, "rope_freqs.weight", 0, W_F32, SHAPE(h->rope.n_rot / 2, 1, 1), err, errlen))
        return -1;
    if (!m->rope_freqs.data) return 0;
    const float *ff = (const float *)m->rope_freqs.data;
    for (int i = 0; i < h->rope.n_rot / 2; i++) {
        if (!isfinite(ff[i]) || ff[i] <= 0.0f) {
            snprintf(err, errlen, "tensor rope_freqs.weight[%d] = %g is out of range (must be finite and > 0)",
                     i, (double)ff[i]);
            return -1;
        }
    }
    h->rope.freq_factors = ff;
    return 0;
}

static int model_bind_weights(model *m, char *err, size_t errlen) {
    const model_hparams *h = &m->hp;
    int64_t nt = gguf_count_tensors(m->gf);
    m->names = calloc((size_t)nt + 8, sizeof *m->names);
    m->layers = calloc((size_t)h->n_layer, sizeof *m->layers);
    if (!m->names || !m->layers) { snprintf(err, errlen, "out of memory"); return -1; }
    int64_t E = h->n_embd, V = h->n_vocab;
    /* a slice binds the embedding only when it starts the chain, and never
     * the output head: the decode node computes the logits */
    if ((m->layer_lo == 0 && !m->ffn_first &&
         model_bind(m, &m->tok_embd, "token_embd.weight", 1, W_MAT, SHAPE(E, V, 1), err, errlen)) ||
        (!m->sliced &&
         (model_bind(m, &m->output_norm, "output_norm.weight", 1, W_F32, SHAPE(E, 1, 1), err, errlen) ||
          model_bind(m, &m->output, "output.weight", 0, W_MAT, SHAPE(E, V, 1), err, errlen))) ||
        model_bind_rope_freqs(m, err, errlen))
        return -1;
    if (!m->sliced && !m->output.data) m->output = m->tok_embd;     /* tied embeddings */
    m->tok_embd.rows_only = 1;
    /* a block shared with a neighbouring slice: only its own half */
    for (int il = m->layer_lo; il < m->layer_hi; il++)
        if ((!(il == m->layer_lo && m->ffn_first) && model_bind_attn(m, il, err, errlen)) ||
            (!(il == m->layer_hi - 1 && m->attn_last) && model_bind_ffn(m, il, err, errlen)))
            return -1;
    return 0;
}

int model_tensor_bound(const model *m, const char *name, size_t len) {
    for (int i = 0; i < m->n_names; i++)
        if (strlen(m->names[i]) == len && !memcmp(m->names[i], name, len)) return 1;
    return 0;
}

/* --layers A:B against the file's block count. */
static int model_set_slice(model *m, const model_opts *o, char *err, size_t errlen) {
    int n = m->hp.n_layer;
    m->layer_lo = 0;
    m->layer_hi = n;
    if (!o || o->layer_hi <= 0) return 0;
    if (o->layer_lo < 0 || o->layer_lo >= o->layer_hi || o->layer_hi > n) {
        snprintf(err, errlen, "layers %d:%d are not a slice of this %d-layer model (need 0 <= A < B <= %d)",
                 o->layer_lo, o->layer_hi, n, n);
        return -1;
    }
    /* a slice computes at least one block's attention (it owns that K/V) */
    if (o->layer_hi - o->layer_lo - !!o->ffn_first < 1) {
        snprintf(err, errlen, "layers %d.5:%d compute no block's attention (a slice owns the K/V of at least one)",
                 o->layer_lo, o->layer_hi);
        return -1;
    }
    m->layer_lo = o->layer_lo;
    m->layer_hi = o->layer_hi;
    m->ffn_first = !!o->ffn_first;
    m->attn_last = !!o->attn_last;
    m->sliced = 1;
    return 0;
}

/* ==== Backend ==== */

static backend *model_create_backend(const model_opts *o, int nth, char *err, size_t errlen) {
    const char *name = o && o->backend ? o->backend : "cpu";
    if (!strcmp(name, "cpu")) {
        backend *be = backend_cpu_create(nth);
        if (!be) snprintf(err, errlen, "cannot create CPU backend with %d threads", nth);
        return be;
    }
    /* linked or not, decided at link time (backend_mlx_absent.c) */
    if (!strcmp(name, "mlx")) return backend_mlx_create(nth, err, errlen);
    if (strcmp(name, "cuda")) {
        snprintf(err, errlen, "unknown backend '%.32s' (cpu, cuda or mlx)", name);
        return NULL;
    }
#ifdef TANDEM_CUDA
    return backend_cuda_create(o->device, nth, err, errlen);
#else
    snprintf(err, errlen, "this build has no CUDA backend (rebuild with make CUDA=1)");
    return NULL;
#endif
}

/* The weight slots of one layer, bound or not (data NULL where not). */
#define MODEL_LAYER_SLOTS 18
static void model_layer_slots(model_layer *L, be_weight *ws[MODEL_LAYER_SLOTS]) {
    be_weight *all[MODEL_LAYER_SLOTS] = { &L->attn_norm, &L->wq, &L->wk, &L->wv, &L->wo, &L->bq, &L->bk, &L->bv,
                                          &L->q_norm, &L->k_norm, &L->ffn_norm, &L->ffn_gate, &L->ffn_up,
                                          &L->ffn_down, &L->gate_inp, &L->gate_exps, &L->up_exps, &L->down_exps };
    memcpy(ws, all, sizeof all);
}

/* Hands every bound weight to a backend that keeps its own copies. */
static int model_load_weights(model *m, const model_opts *o, char *err, size_t errlen) {
    backend *be = m->be;
    if (!be->ops->load_weight) return 0;
    int n_layer = m->hp.n_layer;
    if (o && o->on_load) o->on_load(o->on_load_ud, 0, n_layer);
    be_weight *top[] = { &m->tok_embd, &m->output_norm, &m->output };
    for (size_t i = 0; i < sizeof top / sizeof top[0]; i++)
        if (top[i]->data && be->ops->load_weight(be, top[i], err, errlen)) return -1;
    for (int il = 0; il < m->hp.n_layer; il++) {
        be_weight *ws[MODEL_LAYER_SLOTS];   /* a slice's other layers are unbound: data NULL */
        model_layer_slots(&m->layers[il], ws);
        for (size_t i = 0; i < MODEL_LAYER_SLOTS; i++)
            if (ws[i]->data && be->ops->load_weight(be, ws[i], err, errlen)) return -1;
        if (o && o->on_load) o->on_load(o->on_load_ud, il + 1, n_layer);
    }
    return 0;
}

/* ==== Slice residency ==== */

typedef struct { uintptr_t lo, hi; } model_span;

static int model_span_cmp(const void *a, const void *b) {
    const model_span *x = a, *y = b;
    return (x->lo > y->lo) - (x->lo < y->lo);
}

/* w's bytes in the file mapping, rounded out to whole pages, when the
 * slice still reads them there: bound, and not copied by the backend (a
 * packed or uploaded weight's plain rows are not read again). */
static void model_add_span(const be_weight *w, uintptr_t pg, model_span *s, size_t *n) {
    if (!w->data || w->dev) return;
    uint64_t rows = (uint64_t)w->ne[1] * (uint64_t)(w->ne[2] > 0 ? w->ne[2] : 1) * (uint64_t)(w->ne[3] > 0 ? w->ne[3] : 1);
    uintptr_t lo = (uintptr_t)w->data, hi = lo + (uintptr_t)(rows * w->row_bytes);
    s[(*n)++] = (model_span){ lo & ~(pg - 1), (hi + pg - 1) & ~(pg - 1) };
}

/* A slice maps the whole file but reads only its weights. Whatever else is
 * resident (the metadata section, hashed by the fingerprint and read for
 * the hyper-parameters; other layers' pages mapped again by a neighbour's
 * fault: the kernel maps a large folio of the page cache whole; the pages
 * shared by two tensors that the per-tensor drops keep) leaves the resident
 * set here, in one pass over the file's pages once no thread reads them:
 * about 5 MiB for a 7-layer slice of Qwen3-0.6B Q8_0. Only a read-only
 * file mapping is dropped (plat_map_drop): a later read faults it back. */
void model_drop_unused_pages(const model *m) {
    long pgl = sysconf(_SC_PAGESIZE);
    if (!m || !m->sliced || !m->gf || pgl <= 0) return;
    uintptr_t pg = (uintptr_t)pgl;
    size_t n = 0, cap = 4 + (size_t)m->hp.n_layer * MODEL_LAYER_SLOTS;
    model_span *s = malloc(cap * sizeof *s);
    if (!s) return;   /* a hint lost, nothing wrong */
    const be_weight *top[] = { &m->tok_embd, &m->output_norm, &m->output, &m->rope_freqs };
    for (size_t i = 0; i < sizeof top / sizeof top[0]; i++) model_add_span(top[i], pg, s, &n);
    for (int il = m->layer_lo; il < m->layer_hi; il++) {
        be_weight *ws[MODEL_LAYER_SLOTS];
        model_layer_slots(&m->layers[il], ws);
        for (size_t i = 0; i < MODEL_LAYER_SLOTS; i++) model_add_span(ws[i], pg, s, &n);
    }
    qsort(s, n, sizeof *s, model_span_cmp);
    uintptr_t at = (uintptr_t)gguf_get_base(m->gf);
    uintptr_t end = (at + (uintptr_t)gguf_get_size(m->gf) + pg - 1) & ~(pg - 1);
    for (size_t i = 0; i < n; i++) {
        if (s[i].lo > at) plat_map_drop((const void *)at, s[i].lo - at);
        if (s[i].hi > at) at = s[i].hi;
    }
    if (end > at) plat_map_drop((const void *)at, end - at);
    free(s);
}

/* ==== Load / free ==== */

/* Every load error names the file once: gguf_open_file's already do. */
static void model_name_error(const char *path, char *err, size_t errlen) {
    size_t pl = strlen(path);
    if (!err || !errlen || (!strncmp(err, path, pl) && err[pl] == ':')) return;
    char tmp[512];
    snprintf(tmp, sizeof tmp, "%s", err);
    snprintf(err, errlen, "%s: %s", path, tmp);
}

int model_load(model **out, const char *path, const model_opts *o, char *err, size_t errlen) {
    *out = NULL;
    model *m = calloc(1, sizeof *m);
    if (!m) { snprintf(err, errlen, "out of memory"); return -1; }
    pthread_mutex_init(&m->eval_mu, NULL);
    if (!(m->fp = calloc(1, sizeof *m->fp))) { free(m); snprintf(err, errlen, "out of memory"); return -1; }
    pthread_mutex_init(&m->fp->mu, NULL);
    int nth = o && o->n_threads > 0 ? o->n_threads : 1;
    m->fp->n_threads = nth;
    if (gguf_open_file(&m->gf, path, err, errlen)) goto fail;
    if (model_read_hparams(m, err, errlen)) goto fail;
    /* A slice never tokenizes (the decode node sends token ids; later
     * slices get hidden states): it counts the vocabulary and skips the
     * tokenizer's tables (about 8 MiB for Qwen's 151,936 tokens). */
    if (!(o && o->layer_hi > 0) && tokenizer_load(&m->tok, m->gf, err, errlen)) goto fail;
    if (model_check_vocab(m, err, errlen)) goto fail;
    if (model_set_slice(m, o, err, errlen)) goto fail;
    if (model_bind_weights(m, err, errlen)) goto fail;
    if (!(m->be = model_create_backend(o, nth, err, errlen))) goto fail;
    /* rows per pass: the caller's, else the backend's, else the CPU's 512 */
    m->n_batch = o && o->n_batch > 0 ? o->n_batch : m->be->ops->pass_rows > 0 ? m->be->ops->pass_rows : 512;
    /* A backend that copies the weights (CUDA uploads them, the CPU packs
     * them and gives the file's pages back): hash them now, while they are
     * read anyway, not later from the disk at a node's first handshake. */
    if ((m->be->ops->load_weight || m->sliced) && !(o && o->fingerprint_later)) {
        uint8_t fp[32];
        char d[200];
        (void)model_fingerprint(m, fp, d, sizeof d);   /* a failure is retried at first use */
    }
    if (model_load_weights(m, o, err, errlen)) goto fail;
    if (m->be->ops->load_done) m->be->ops->load_done(m->be);
    model_drop_unused_pages(m);
    *out = m;
    return 0;
fail:
    model_name_error(path, err, errlen);
    model_free(m);
    return -1;
}

int model_peek_hparams(const char *path, model_hparams *out, char *err, size_t errlen) {
    model *m = calloc(1, sizeof *m);
    if (!m) { snprintf(err, errlen, "out of memory"); return -1; }
    /* the loader's own checks, on the metadata only: no tokenizer tables,
     * no weights bound (the mapping's pages are read where the metadata is) */
    int rc = gguf_open_file(&m->gf, path, err, errlen) || model_read_hparams(m, err, errlen) ||
             model_check_vocab(m, err, errlen) ? -1 : 0;
    if (rc) model_name_error(path, err, errlen);
    else *out = m->hp;
    gguf_close(m->gf);
    free(m);
    return rc;
}

void model_free(model *m) {
    if (!m) return;
    if (m->be) { forward_release(m); m->be->ops->destroy(m->be); }
    pthread_mutex_destroy(&m->eval_mu);
    pthread_mutex_destroy(&m->fp->mu);
    free(m->fp);
    tokenizer_free(m->tok);
    for (int i = 0; i < m->n_names; i++) free(m->names[i]);
    free(m->names);
    free(m->layers);
    gguf_close(m->gf);
    free(m);
}

const model_hparams *model_get_hparams(const model *m) { return &m->hp; }
const tokenizer *model_get_tokenizer(const model *m) { return m->tok; }
const gguf_file *model_get_gguf(const model *m) { return m->gf; }
backend *model_get_backend(model *m) { return m->be; }
int model_get_n_batch(const model *m) { return m->n_batch; }
int model_get_layers(const model *m, int *lo, int *hi) {
    if (lo) *lo = m->layer_lo;
    if (hi) *hi = m->layer_hi;
    return m->sliced;
}
void model_get_halves(const model *m, int *lo, int *hi) {
    *lo = 2 * m->layer_lo + m->ffn_first;
    *hi = 2 * m->layer_hi - m->attn_last;
}
uint64_t model_file_bytes(const model *m) { return gguf_get_size(m->gf); }

static uint64_t weight_bytes(const be_weight *w) {
    return w->data ? (uint64_t)w->row_bytes * (uint64_t)w->ne[1] * (uint64_t)w->ne[2] : 0;
}

uint64_t model_weight_bytes_per_token(const model *m) {
    const model_hparams *h = &m->hp;
    uint64_t b = weight_bytes(&m->output_norm) + weight_bytes(&m->output) + m->tok_embd.row_bytes;
    for (int il = m->layer_lo; il < m->layer_hi; il++) {
        const model_layer *L = &m->layers[il];
        const be_weight *ws[] = { &L->attn_norm, &L->wq, &L->wk, &L->wv, &L->wo, &L->bq, &L->bk, &L->bv,
                                  &L->q_norm, &L->k_norm, &L->ffn_norm, &L->ffn_gate, &L->ffn_up,
                                  &L->ffn_down, &L->gate_inp };
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) b += weight_bytes(ws[i]);
        if (h->n_expert) {
            uint64_t ex = weight_bytes(&L->gate_exps) + weight_bytes(&L->up_exps) + weight_bytes(&L->down_exps);
            b += ex / (uint64_t)h->n_expert * (uint64_t)h->n_expert_used;
        }
    }
    return b;
}

const char *model_type_summary(const model *m) {
    /* the type of the first FFN weight names the file's flavour well enough */
    const model_layer *L = &m->layers[m->layer_lo];
    const be_weight *w = L->ffn_up.data ? &L->ffn_up : L->up_exps.data ? &L->up_exps : &L->wq;   /* wq: a slice of one block's attention */
    return gguf_type_name(w->type);
}

/* ==== Sessions ==== */

int session_new(session **out, model *m, int n_ctx, uint32_t kv_dtype, char *err, size_t errlen) {
    *out = NULL;
    const model_hparams *h = &m->hp;
    if (n_ctx <= 0) n_ctx = h->n_ctx_train;
    if (n_ctx > MODEL_MAX_CTX) {
        snprintf(err, errlen, "context of %d positions is beyond the supported %d", n_ctx, MODEL_MAX_CTX);
        return -1;
    }
    session *s = calloc(1, sizeof *s);
    if (!s) { snprintf(err, errlen, "out of memory"); return -1; }
    s->m = m;
    if (kv_create(&s->kv, h->n_layer, n_ctx, h->n_head_kv, h->head_dim_k, kv_dtype, err, errlen)) {
        free(s);
        return -1;
    }
    *out = s;
    return 0;
}

void session_free(session *s) {
    if (!s) return;
    backend *be = s->m->be;
    if (be->ops->kv_forget) be->ops->kv_forget(be, s->kv, -1);
    kv_free(s->kv);
    free(s);
}

kvcache *session_kv(session *s) { return s->kv; }
model *session_model(session *s) { return s->m; }
int session_pos(const session *s) { return kv_used(s->kv); }
void session_rows_written(session *s, int pos) {
    backend *be = s->m->be;
    if (be->ops->kv_forget) be->ops->kv_forget(be, s->kv, pos < 0 ? 0 : pos);
}

void session_rows_read(session *s) {
    backend *be = s->m->be;
    if (be->ops->kv_to_host) be->ops->kv_to_host(be, s->kv, -1, kv_used(s->kv));
}

void session_reset(session *s, int pos) {
    if (pos >= kv_used(s->kv)) return;
    kv_set_used(s->kv, pos);
    backend *be = s->m->be;
    if (be->ops->kv_forget) be->ops->kv_forget(be, s->kv, pos < 0 ? 0 : pos);
}
