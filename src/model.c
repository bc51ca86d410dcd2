/* model.c - GGUF -> model: architecture table, hyper-parameters, weight
 * binding with shape and type checks, sessions. The forward pass itself is
 * in forward.c. */
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model_internal.h"
#include "quant.h"
#ifdef TANDEM_CUDA
#include "backend/cuda/backend_cuda.h"
#endif

/* ==== Architectures ==== */

static const struct { const char *name; enum arch_id id; int rope_mode; } ARCHES[] = {
    { "llama", ARCH_LLAMA, ROPE_NORM },
    { "qwen2", ARCH_QWEN2, ROPE_NEOX },
    { "qwen3", ARCH_QWEN3, ROPE_NEOX },
    { "qwen3moe", ARCH_QWEN3MOE, ROPE_NEOX },
};

/* ==== Metadata helpers ==== */

static int meta_u32(const gguf_file *f, const char *arch, const char *suffix, int required,
                    uint32_t def, int *out, char *err, size_t errlen) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    uint32_t v;
    int rc = gguf_get_u32(f, key, &v);
    if (rc == -1 && !required) { *out = (int)def; return 0; }
    if (rc == -1) { snprintf(err, errlen, "missing metadata key %s", key); return -1; }
    if (rc != 0 || v > (1u << 30)) { snprintf(err, errlen, "metadata key %s has a bad type or value", key); return -1; }
    *out = (int)v;
    return 0;
}

static int meta_f32(const gguf_file *f, const char *arch, const char *suffix, float def, float *out,
                    char *err, size_t errlen) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int rc = gguf_get_f32(f, key, out);
    if (rc == -1) { *out = def; return 0; }
    if (rc != 0 || !isfinite(*out)) { snprintf(err, errlen, "metadata key %s has a bad type or value", key); return -1; }
    return 0;
}

static int model_read_hparams(model *m, char *err, size_t errlen) {
    model_hparams *h = &m->hp;
    gguf_str a;
    if (gguf_get_str(m->gf, "general.architecture", &a) != 0) {
        snprintf(err, errlen, "missing general.architecture");
        return -1;
    }
    int found = -1;
    for (size_t i = 0; i < sizeof ARCHES / sizeof ARCHES[0]; i++)
        if (gguf_str_eq(a, ARCHES[i].name)) found = (int)i;
    if (found < 0) {
        snprintf(err, errlen, "unsupported architecture '%.*s' (supported: llama, qwen2, qwen3, qwen3moe)",
                 (int)(a.len > 64 ? 64 : a.len), a.ptr);
        return -1;
    }
    h->arch = ARCHES[found].id;
    h->arch_name = ARCHES[found].name;
    const char *an = h->arch_name;
    const gguf_file *f = m->gf;
    if (meta_u32(f, an, "context_length", 0, 4096, &h->n_ctx_train, err, errlen) ||
        meta_u32(f, an, "embedding_length", 1, 0, &h->n_embd, err, errlen) ||
        meta_u32(f, an, "block_count", 1, 0, &h->n_layer, err, errlen) ||
        meta_u32(f, an, "attention.head_count", 1, 0, &h->n_head, err, errlen) ||
        meta_u32(f, an, "attention.head_count_kv", 0, (uint32_t)h->n_head, &h->n_head_kv, err, errlen))
        return -1;
    if (h->n_embd < 1 || h->n_layer < 1 || h->n_head < 1 || h->n_head_kv < 1 || h->n_head % h->n_head_kv) {
        snprintf(err, errlen, "bad shape: n_embd %d, %d layers, %d heads, %d KV heads",
                 h->n_embd, h->n_layer, h->n_head, h->n_head_kv);
        return -1;
    }
    int hd = h->n_embd / h->n_head;
    if (meta_u32(f, an, "attention.key_length", 0, (uint32_t)hd, &h->head_dim_k, err, errlen) ||
        meta_u32(f, an, "attention.value_length", 0, (uint32_t)h->head_dim_k, &h->head_dim_v, err, errlen) ||
        meta_u32(f, an, "rope.dimension_count", 0, (uint32_t)h->head_dim_k, &h->rope.n_rot, err, errlen) ||
        meta_u32(f, an, "feed_forward_length", h->arch != ARCH_QWEN3MOE, 0, &h->n_ff, err, errlen) ||
        meta_f32(f, an, "attention.layer_norm_rms_epsilon", 1e-5f, &h->rms_eps, err, errlen) ||
        meta_f32(f, an, "rope.freq_base", 10000.0f, &h->rope.freq_base, err, errlen))
        return -1;
    if (h->head_dim_k != h->head_dim_v || h->head_dim_k < 2 || h->head_dim_k > 512 ||
        h->rope.n_rot < 2 || h->rope.n_rot > h->head_dim_k || h->rope.n_rot % 2) {
        snprintf(err, errlen, "unsupported head shape: key_length %d, value_length %d, rope dims %d",
                 h->head_dim_k, h->head_dim_v, h->rope.n_rot);
        return -1;
    }
    float scale = 1.0f;
    if (meta_f32(f, an, "rope.scaling.factor", 1.0f, &scale, err, errlen)) return -1;
    gguf_str st;
    h->rope.freq_scale = 1.0f;
    if (gguf_get_str(f, "llama.rope.scaling.type", &st) == 0 && gguf_str_eq(st, "linear") && scale > 0)
        h->rope.freq_scale = 1.0f / scale;
    h->rope.mode = ARCHES[found].rope_mode;
    if (h->arch == ARCH_QWEN3MOE) {
        if (meta_u32(f, an, "expert_count", 1, 0, &h->n_expert, err, errlen) ||
            meta_u32(f, an, "expert_used_count", 1, 0, &h->n_expert_used, err, errlen) ||
            meta_u32(f, an, "expert_feed_forward_length", 0, 0, &h->n_ff_exp, err, errlen))
            return -1;
        if (h->n_expert < 1 || h->n_expert > 256 || h->n_expert_used < 1 || h->n_expert_used > h->n_expert) {
            snprintf(err, errlen, "bad expert counts: %d experts, %d used", h->n_expert, h->n_expert_used);
            return -1;
        }
        char key[160];
        int norm = 1;   /* qwen3moe renormalises the top-k weights unless the file says otherwise */
        snprintf(key, sizeof key, "%s.expert_weights_norm", an);
        if (gguf_get_bool(f, key, &norm) == -2) { snprintf(err, errlen, "bad %s", key); return -1; }
        h->expert_norm = norm;
    }
    return 0;
}

/* ==== Weights ==== */

/* Bind tensor `name` and check its type and shape (ne0, ne1, ne2; 0 = any). */
static int model_bind(model *m, be_weight *w, const char *name, int required,
                      int64_t ne0, int64_t ne1, int64_t ne2, char *err, size_t errlen) {
    const gguf_tensor *t = gguf_find_tensor(m->gf, name);
    memset(w, 0, sizeof *w);
    if (!t) {
        if (!required) return 0;
        snprintf(err, errlen, "missing tensor %s", name);
        return -1;
    }
    if (!quant_is_supported(t->type)) {
        snprintf(err, errlen, "tensor %s has unsupported type %s (supported: F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K)",
                 name, gguf_type_name(t->type));
        return -1;
    }
    int64_t want[3] = { ne0, ne1, ne2 };
    for (int d = 0; d < 3; d++) {
        if (want[d] && (int64_t)t->ne[d] != want[d]) {
            snprintf(err, errlen, "tensor %s has shape [%llu, %llu, %llu], expected [%lld, %lld, %lld]", name,
                     (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], (unsigned long long)t->ne[2],
                     (long long)ne0, (long long)ne1, (long long)ne2);
            return -1;
        }
    }
    if (t->ne[3] != 1) { snprintf(err, errlen, "tensor %s has 4 dimensions", name); return -1; }
    w->name = m->names[m->n_names++] = strdup(name);
    w->type = t->type;
    for (int d = 0; d < 4; d++) w->ne[d] = (int64_t)t->ne[d];
    w->row_bytes = gguf_row_bytes(t->type, t->ne[0]);
    w->data = t->data;
    m->n_bound++;
    return 0;
}

/* Norms and biases are used as plain f32 vectors. */
static int model_need_f32(const be_weight *w, char *err, size_t errlen) {
    if (w->data && w->type != GGML_TYPE_F32) {
        snprintf(err, errlen, "tensor %s must be F32, is %s", w->name, gguf_type_name(w->type));
        return -1;
    }
    return 0;
}

static int model_bind_layer(model *m, int il, char *err, size_t errlen) {
    const model_hparams *h = &m->hp;
    model_layer *L = &m->layers[il];
    char n[96];
    int64_t E = h->n_embd, qd = (int64_t)h->n_head * h->head_dim_k, kvd = (int64_t)h->n_head_kv * h->head_dim_k;
    int bias = h->arch == ARCH_QWEN2, qk_norm = h->arch == ARCH_QWEN3 || h->arch == ARCH_QWEN3MOE;
#define BIND(field, suffix, req, a, b, c) \
    (snprintf(n, sizeof n, "blk.%d.%s", il, suffix), model_bind(m, &L->field, n, req, a, b, c, err, errlen))
    if (BIND(attn_norm, "attn_norm.weight", 1, E, 1, 1) ||
        BIND(wq, "attn_q.weight", 1, E, qd, 1) ||
        BIND(wk, "attn_k.weight", 1, E, kvd, 1) ||
        BIND(wv, "attn_v.weight", 1, E, kvd, 1) ||
        BIND(wo, "attn_output.weight", 1, qd, E, 1) ||
        BIND(bq, "attn_q.bias", bias, qd, 1, 1) ||
        BIND(bk, "attn_k.bias", bias, kvd, 1, 1) ||
        BIND(bv, "attn_v.bias", bias, kvd, 1, 1) ||
        BIND(q_norm, "attn_q_norm.weight", qk_norm, h->head_dim_k, 1, 1) ||
        BIND(k_norm, "attn_k_norm.weight", qk_norm, h->head_dim_k, 1, 1) ||
        BIND(ffn_norm, "ffn_norm.weight", 1, E, 1, 1))
        return -1;
    if (h->arch == ARCH_QWEN3MOE) {
        int64_t F = h->n_ff_exp ? h->n_ff_exp : 0, X = h->n_expert;
        if (BIND(gate_inp, "ffn_gate_inp.weight", 1, E, X, 1) ||
            BIND(gate_exps, "ffn_gate_exps.weight", 1, E, F, X) ||
            BIND(up_exps, "ffn_up_exps.weight", 1, E, L->gate_exps.ne[1], X) ||
            BIND(down_exps, "ffn_down_exps.weight", 1, L->gate_exps.ne[1], E, X))
            return -1;
        L->moe = (be_moe){ &L->gate_inp, &L->gate_exps, &L->up_exps, &L->down_exps,
                           h->n_expert, h->n_expert_used, h->expert_norm };
    } else {
        if (BIND(ffn_gate, "ffn_gate.weight", 1, E, h->n_ff, 1) ||
            BIND(ffn_up, "ffn_up.weight", 1, E, h->n_ff, 1) ||
            BIND(ffn_down, "ffn_down.weight", 1, h->n_ff, E, 1))
            return -1;
    }
#undef BIND
    const be_weight *vecs[] = { &L->attn_norm, &L->ffn_norm, &L->bq, &L->bk, &L->bv, &L->q_norm, &L->k_norm };
    for (size_t i = 0; i < sizeof vecs / sizeof vecs[0]; i++)
        if (model_need_f32(vecs[i], err, errlen)) return -1;
    return 0;
}

static int model_bind_weights(model *m, char *err, size_t errlen) {
    const model_hparams *h = &m->hp;
    int64_t nt = gguf_count_tensors(m->gf);
    m->names = calloc((size_t)nt + 8, sizeof *m->names);
    m->layers = calloc((size_t)h->n_layer, sizeof *m->layers);
    if (!m->names || !m->layers) { snprintf(err, errlen, "out of memory"); return -1; }
    if (model_bind(m, &m->tok_embd, "token_embd.weight", 1, h->n_embd, 0, 1, err, errlen)) return -1;
    m->hp.n_vocab = (int)m->tok_embd.ne[1];
    if (model_bind(m, &m->output_norm, "output_norm.weight", 1, h->n_embd, 1, 1, err, errlen) ||
        model_need_f32(&m->output_norm, err, errlen) ||
        model_bind(m, &m->output, "output.weight", 0, h->n_embd, h->n_vocab, 1, err, errlen) ||
        model_bind(m, &m->rope_freqs, "rope_freqs.weight", 0, h->rope.n_rot / 2, 1, 1, err, errlen) ||
        model_need_f32(&m->rope_freqs, err, errlen))
        return -1;
    if (!m->output.data) m->output = m->tok_embd;     /* tied embeddings */
    if (m->rope_freqs.data) m->hp.rope.freq_factors = (const float *)m->rope_freqs.data;
    for (int il = 0; il < h->n_layer; il++)
        if (model_bind_layer(m, il, err, errlen)) return -1;
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
    if (strcmp(name, "cuda")) {
        snprintf(err, errlen, "unknown backend '%.32s' (cpu or cuda)", name);
        return NULL;
    }
#ifdef TANDEM_CUDA
    return backend_cuda_create(o->device, nth, err, errlen);
#else
    snprintf(err, errlen, "this build has no CUDA backend (rebuild with make CUDA=1)");
    return NULL;
#endif
}

/* Hands every bound weight to a backend that keeps its own copies. */
static int model_load_weights(model *m, char *err, size_t errlen) {
    backend *be = m->be;
    if (!be->ops->load_weight) return 0;
    be_weight *top[] = { &m->tok_embd, &m->output_norm, &m->output };
    for (size_t i = 0; i < sizeof top / sizeof top[0]; i++)
        if (top[i]->data && be->ops->load_weight(be, top[i], err, errlen)) return -1;
    for (int il = 0; il < m->hp.n_layer; il++) {
        model_layer *L = &m->layers[il];
        be_weight *ws[] = { &L->attn_norm, &L->wq, &L->wk, &L->wv, &L->wo, &L->bq, &L->bk, &L->bv,
                            &L->q_norm, &L->k_norm, &L->ffn_norm, &L->ffn_gate, &L->ffn_up, &L->ffn_down,
                            &L->gate_inp, &L->gate_exps, &L->up_exps, &L->down_exps };
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++)
            if (ws[i]->data && be->ops->load_weight(be, ws[i], err, errlen)) return -1;
    }
    return 0;
}

/* ==== Load / free ==== */

int model_load(model **out, const char *path, const model_opts *o, char *err, size_t errlen) {
    *out = NULL;
    model *m = calloc(1, sizeof *m);
    if (!m) { snprintf(err, errlen, "out of memory"); return -1; }
    m->n_batch = o && o->n_batch > 0 ? o->n_batch : 512;
    pthread_mutex_init(&m->eval_mu, NULL);
    int nth = o && o->n_threads > 0 ? o->n_threads : 1;
    if (gguf_open_file(&m->gf, path, err, errlen)) goto fail;
    if (model_read_hparams(m, err, errlen)) goto fail;
    if (model_bind_weights(m, err, errlen)) goto fail;
    if (tokenizer_load(&m->tok, m->gf, err, errlen)) goto fail;
    if (tokenizer_n_vocab(m->tok) > m->hp.n_vocab) {
        snprintf(err, errlen, "tokenizer has %d tokens but token_embd has %d rows", tokenizer_n_vocab(m->tok), m->hp.n_vocab);
        goto fail;
    }
    if (!(m->be = model_create_backend(o, nth, err, errlen))) goto fail;
    if (model_load_weights(m, err, errlen)) goto fail;
    *out = m;
    return 0;
fail:
    model_free(m);
    return -1;
}

void model_free(model *m) {
    if (!m) return;
    if (m->be) { forward_release(m); m->be->ops->destroy(m->be); }
    pthread_mutex_destroy(&m->eval_mu);
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
uint64_t model_file_bytes(const model *m) { return gguf_get_size(m->gf); }

static uint64_t weight_bytes(const be_weight *w) {
    return w->data ? (uint64_t)w->row_bytes * (uint64_t)w->ne[1] * (uint64_t)w->ne[2] : 0;
}

uint64_t model_weight_bytes_per_token(const model *m) {
    const model_hparams *h = &m->hp;
    uint64_t b = weight_bytes(&m->output_norm) + weight_bytes(&m->output) + m->tok_embd.row_bytes;
    for (int il = 0; il < h->n_layer; il++) {
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
    const model_layer *L = &m->layers[0];
    const be_weight *w = L->ffn_up.data ? &L->ffn_up : &L->up_exps;
    return gguf_type_name(w->type);
}

/* ==== Sessions ==== */

int session_new(session **out, model *m, int n_ctx, uint32_t kv_dtype, char *err, size_t errlen) {
    *out = NULL;
    const model_hparams *h = &m->hp;
    if (n_ctx <= 0) n_ctx = h->n_ctx_train;
    session *s = calloc(1, sizeof *s);
    if (!s) { snprintf(err, errlen, "out of memory"); return -1; }
    s->m = m;
    if (kv_create(&s->kv, h->n_layer, n_ctx, h->n_head_kv * h->head_dim_k, kv_dtype, err, errlen)) {
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
int session_pos(const session *s) { return kv_used(s->kv); }
void session_reset(session *s, int pos) {
    if (pos >= kv_used(s->kv)) return;
    kv_set_used(s->kv, pos);
    backend *be = s->m->be;
    if (be->ops->kv_forget) be->ops->kv_forget(be, s->kv, pos < 0 ? 0 : pos);
}
