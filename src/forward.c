/* forward.c - the transformer forward pass, written only against backend.h.
 *
 * One function, read top to bottom, serves llama, qwen2, qwen3 and qwen3moe:
 *
 *   x = token_embd[ids]                                   [n, n_embd]
 *   per layer:
 *     h = rms_norm(x) * attn_norm
 *     q, k, v = Wq h (+bq), Wk h (+bk), Wv h (+bv)         qwen2: biases
 *     q, k = rms_norm_per_head(q) * q_norm, ... k          qwen3: q/k norm
 *     q, k = rope(q), rope(k)                              NORM or NEOX pairs
 *     cache[layer][pos..] = k, v                           -> layer hook
 *     x += Wo attention(q, cache)                          causal, GQA
 *     h = rms_norm(x) * ffn_norm
 *     x += Wdown (silu(Wgate h) * Wup h)                   or the MoE block
 *   logits = Woutput (rms_norm(x_last) * output_norm)
 *
 * Prompts are processed in chunks of n_batch tokens (matrix-matrix); a
 * single token is the same code with n = 1 (matrix-vector).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model_internal.h"

/* ==== Buffers ==== */

int forward_alloc(model *m, session *s, char *err, size_t errlen) {
    const model_hparams *h = &m->hp;
    backend *be = m->be;
    fwd_bufs *b = &s->b;
    int cap = m->n_batch < kv_n_ctx(s->kv) ? m->n_batch : kv_n_ctx(s->kv);
    size_t E = (size_t)h->n_embd, qd = (size_t)h->n_head * h->head_dim_k;
    size_t kvd = (size_t)h->n_head_kv * h->head_dim_k, ff = (size_t)(h->n_ff > h->n_ff_exp ? h->n_ff : h->n_ff_exp);
    b->cap = cap;
    b->x = be->ops->alloc(be, cap * E);
    b->h = be->ops->alloc(be, cap * E);
    b->q = be->ops->alloc(be, cap * qd);
    b->k = be->ops->alloc(be, cap * kvd);
    b->v = be->ops->alloc(be, cap * kvd);
    b->att = be->ops->alloc(be, cap * qd);
    b->o = be->ops->alloc(be, cap * E);
    b->g = be->ops->alloc(be, cap * (ff ? ff : 1));
    b->u = be->ops->alloc(be, cap * (ff ? ff : 1));
    b->logits = be->ops->alloc(be, (size_t)h->n_vocab);
    if (!b->x || !b->h || !b->q || !b->k || !b->v || !b->att || !b->o || !b->g || !b->u || !b->logits) {
        snprintf(err, errlen, "out of memory for activation buffers (%d tokens)", cap);
        return -1;
    }
    return 0;
}

void forward_release(model *m, session *s) {
    backend *be = m->be;
    fwd_bufs *b = &s->b;
    float *bufs[] = { b->x, b->h, b->q, b->k, b->v, b->att, b->o, b->g, b->u, b->logits };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->ops->release(be, bufs[i]);
    memset(b, 0, sizeof *b);
}

/* ==== One layer ==== */

static int forward_attention(model *m, session *s, int il, int pos0, int n,
                             layer_hook hook, void *ud, char *err, size_t errlen) {
    const model_hparams *hp = &m->hp;
    const model_layer *L = &m->layers[il];
    backend *be = m->be;
    const backend_ops *op = be->ops;
    fwd_bufs *b = &s->b;
    int hd = hp->head_dim_k;

    op->rms_norm(be, b->x, &L->attn_norm, b->h, n, hp->n_embd, hp->rms_eps);
    op->mul_mat(be, &L->wq, 0, b->h, n, b->q);
    op->mul_mat(be, &L->wk, 0, b->h, n, b->k);
    op->mul_mat(be, &L->wv, 0, b->h, n, b->v);
    if (L->bq.data) op->add_bias(be, b->q, &L->bq, n);
    if (L->bk.data) op->add_bias(be, b->k, &L->bk, n);
    if (L->bv.data) op->add_bias(be, b->v, &L->bv, n);
    if (L->q_norm.data) op->rms_norm(be, b->q, &L->q_norm, b->q, n * hp->n_head, hd, hp->rms_eps);
    if (L->k_norm.data) op->rms_norm(be, b->k, &L->k_norm, b->k, n * hp->n_head_kv, hd, hp->rms_eps);
    op->rope(be, b->q, n, hp->n_head, hd, pos0, &hp->rope);
    op->rope(be, b->k, n, hp->n_head_kv, hd, pos0, &hp->rope);
    op->kv_store(be, s->kv, il, pos0, n, b->k, b->v);
    if (hook && hook(ud, il, pos0, n)) {
        snprintf(err, errlen, "evaluation cancelled at layer %d", il);
        return -1;
    }
    return 0;
}

static int forward_mix(model *m, session *s, int il, int pos0, int n, char *err, size_t errlen) {
    const model_hparams *hp = &m->hp;
    const model_layer *L = &m->layers[il];
    backend *be = m->be;
    const backend_ops *op = be->ops;
    fwd_bufs *b = &s->b;
    int hd = hp->head_dim_k;
    size_t E = (size_t)hp->n_embd;

    if (op->attention(be, b->q, s->kv, il, pos0, n, hp->n_head, hp->n_head_kv, hd, 1.0f / sqrtf((float)hd), b->att)) {
        snprintf(err, errlen, "out of memory in attention");
        return -1;
    }
    op->mul_mat(be, &L->wo, 0, b->att, n, b->o);
    op->add(be, b->x, b->o, n * E);

    op->rms_norm(be, b->x, &L->ffn_norm, b->h, n, hp->n_embd, hp->rms_eps);
    if (hp->n_expert) {
        if (op->moe_ffn(be, &L->moe, b->h, n, b->o)) {
            snprintf(err, errlen, "MoE feed-forward failed in layer %d (out of memory)", il);
            return -1;
        }
    } else {
        op->mul_mat(be, &L->ffn_gate, 0, b->h, n, b->g);
        op->mul_mat(be, &L->ffn_up, 0, b->h, n, b->u);
        op->swiglu(be, b->g, b->u, b->g, (size_t)n * hp->n_ff);
        op->mul_mat(be, &L->ffn_down, 0, b->g, n, b->o);
    }
    op->add(be, b->x, b->o, n * E);
    return 0;
}

/* ==== One chunk ==== */

static int forward_chunk(model *m, session *s, const int32_t *ids, int n, int pos0, float *logits,
                         layer_hook hook, void *ud, char *err, size_t errlen) {
    const model_hparams *hp = &m->hp;
    backend *be = m->be;
    const backend_ops *op = be->ops;
    fwd_bufs *b = &s->b;

    if (op->get_rows(be, &m->tok_embd, ids, n, b->x)) {
        snprintf(err, errlen, "token id out of range");
        return -1;
    }
    for (int il = 0; il < hp->n_layer; il++) {
        if (forward_attention(m, s, il, pos0, n, hook, ud, err, errlen)) return -1;
        /* A chunk whose logits nobody reads needs the last layer's K/V
         * only: the rest of that layer cannot change the cache. */
        if (il == hp->n_layer - 1 && !logits) break;
        if (forward_mix(m, s, il, pos0, n, err, errlen)) return -1;
    }
    if (logits) {
        const float *last = b->x + (size_t)(n - 1) * hp->n_embd;
        op->rms_norm(be, last, &m->output_norm, b->h, 1, hp->n_embd, hp->rms_eps);
        op->mul_mat(be, &m->output, 0, b->h, 1, b->logits);
        op->read(be, b->logits, logits, (size_t)hp->n_vocab);
    }
    return 0;
}

/* ==== Entry ==== */

int model_eval(model *m, session *s, const int32_t *ids, int n, float *logits,
               layer_hook hook, void *hook_ud, char *err, size_t errlen) {
    if (n <= 0) { snprintf(err, errlen, "nothing to evaluate"); return -1; }
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= m->hp.n_vocab) {
            snprintf(err, errlen, "token id %d at index %d is outside the vocabulary (%d)", ids[i], i, m->hp.n_vocab);
            return -1;
        }
    }
    int pos = kv_used(s->kv);
    if (kv_check_range(s->kv, 0, pos, n, err, errlen)) return -1;
    for (int off = 0; off < n; off += s->b.cap) {
        int nc = n - off < s->b.cap ? n - off : s->b.cap;
        int last = off + nc == n;
        if (forward_chunk(m, s, ids + off, nc, pos + off, last ? logits : NULL, hook, hook_ud, err, errlen)) {
            kv_set_used(s->kv, pos + off);   /* what was complete before the failure stays valid */
            return -1;
        }
        kv_set_used(s->kv, pos + off + nc);
    }
    return 0;
}
