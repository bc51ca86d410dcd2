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
 * One pass carries up to n_batch rows: a prompt chunk, one decode token of
 * each of several sessions, or any mix (continuous batching). Row-wise work
 * (norms, matrix products, the FFN) treats the rows as one matrix, so the
 * weights are read once per pass; RoPE, the KV store and attention follow
 * each row's (session, position) through the be_batch mapping. A single
 * sequence, prompt or decode, is the same code with one sequence in the pass.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model_internal.h"

/* ==== Buffers ==== */

static int forward_alloc(model *m, char *err, size_t errlen) {
    const model_hparams *h = &m->hp;
    backend *be = m->be;
    fwd_bufs *b = &m->b;
    if (b->x) return 0;
    size_t cap = (size_t)m->n_batch;
    size_t E = (size_t)h->n_embd, qd = (size_t)h->n_head * h->head_dim_k;
    size_t kvd = (size_t)h->n_head_kv * h->head_dim_k, ff = (size_t)(h->n_ff > h->n_ff_exp ? h->n_ff : h->n_ff_exp);
    b->cap = (int)cap;
    b->x = be->ops->alloc(be, cap * E);
    b->h = be->ops->alloc(be, cap * E);
    b->q = be->ops->alloc(be, cap * qd);
    b->k = be->ops->alloc(be, cap * kvd);
    b->v = be->ops->alloc(be, cap * kvd);
    b->att = be->ops->alloc(be, cap * qd);
    b->o = be->ops->alloc(be, cap * E);
    b->g = be->ops->alloc(be, cap * (ff ? ff : 1));
    b->u = be->ops->alloc(be, cap * (ff ? ff : 1));
    b->pos = malloc(sizeof(int32_t) * cap);
    b->seq = malloc(sizeof(be_seq) * cap);
    if (!b->x || !b->h || !b->q || !b->k || !b->v || !b->att || !b->o || !b->g || !b->u || !b->pos || !b->seq) {
        forward_release(m);
        snprintf(err, errlen, "out of memory for activation buffers (%zu tokens)", cap);
        return -1;
    }
    return 0;
}

/* Room for n rows of logits. */
static int forward_logits_room(model *m, int n, char *err, size_t errlen) {
    fwd_bufs *b = &m->b;
    if (b->logits_cap >= n) return 0;
    backend *be = m->be;
    if (b->logits) be->ops->release(be, b->logits);
    b->logits = be->ops->alloc(be, (size_t)n * (size_t)m->hp.n_vocab);
    b->logits_cap = b->logits ? n : 0;
    if (!b->logits) { snprintf(err, errlen, "out of memory for %d rows of logits", n); return -1; }
    return 0;
}

void forward_release(model *m) {
    backend *be = m->be;
    fwd_bufs *b = &m->b;
    float *bufs[] = { b->x, b->h, b->q, b->k, b->v, b->att, b->o, b->g, b->u, b->logits };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->ops->release(be, bufs[i]);
    free(b->pos);
    free(b->seq);
    memset(b, 0, sizeof *b);
}

/* ==== One pass ==== */

/* What one pass carries beyond the be_batch: which item each sequence is,
 * and which sequences want logits from their last row. */
typedef struct {
    be_batch bt;
    model_batch_item *items;
    int *item_of;            /* [n_seq] */
    int *want_logits;        /* [n_seq] rows wanting logits: the sequence's last ones in the pass */
    int *out_row;            /* [n_seq] the first of them is this row of the item's logits */
    int n_out;               /* rows wanting logits */
    const float *x_in;       /* slice: hidden states entering layer_lo (else the embedding of ids) */
    float *x_out;            /* slice: receives the hidden states leaving layer_hi - 1 */
} fwd_pass;

/* ==== One layer ==== */

/* Layer il's K/V rows are in the host caches: each item's hook may stream them. */
static int forward_hooks(model *m, const fwd_pass *p, int il, char *err, size_t errlen) {
    if (m->be->ops->sync_kv) m->be->ops->sync_kv(m->be, &p->bt, il);
    for (int s = 0; s < p->bt.n_seq; s++) {
        const model_batch_item *it = &p->items[p->item_of[s]];
        const be_seq *sq = &p->bt.seq[s];
        if (it->hook && m->be->ops->kv_to_host) m->be->ops->kv_to_host(m->be, sq->kv, il, sq->pos0 + sq->n);
        if (it->hook && it->hook(it->hook_ud, il, sq->pos0, sq->n)) {
            snprintf(err, errlen, "evaluation cancelled at layer %d", il);
            return -1;
        }
    }
    return 0;
}

/* y[i] = W_i x for n weights of one input: one backend job where the
 * backend has one (mul_mat_n), else one product each. */
static void forward_mul_mats(backend *be, const be_weight *const *w, int n, const float *x, int n_tok,
                             float *const *y) {
    if (be->ops->mul_mat_n) { be->ops->mul_mat_n(be, w, n, x, n_tok, y); return; }
    for (int i = 0; i < n; i++) be->ops->mul_mat(be, w[i], 0, x, n_tok, y[i]);
}

/* Hint that the product after the next one reads a (and b, c): the
 * backend's threads can fetch their first rows while they would otherwise
 * wait. Measured on a 2-core Zen 5, Qwen3-0.6B Q4_K_M, passes alternated
 * with and without hints in one process: 1 row 1.3%, 4 rows 4.4%, 32 rows
 * 4.9%, 512 rows 1.1-2.4% faster per pass (Q5_K_M 1.6%, 5.7% at 1 and 4). */
static void forward_warm(const model *m, const be_weight *a, const be_weight *b, const be_weight *c) {
    if (!m->be->ops->warm_next) return;
    const be_weight *w[3] = { a, b, c };
    m->be->ops->warm_next(m->be, w, c ? 3 : b ? 2 : 1);
}

static int forward_attention(model *m, const fwd_pass *p, int il, char *err, size_t errlen) {
    const model_hparams *hp = &m->hp;
    const model_layer *L = &m->layers[il];
    backend *be = m->be;
    const backend_ops *op = be->ops;
    fwd_bufs *b = &m->b;
    int hd = hp->head_dim_k, n = p->bt.n_tok;

    op->rms_norm(be, b->x, &L->attn_norm, b->h, n, hp->n_embd, hp->rms_eps);
    const be_weight *qkv[3] = { &L->wq, &L->wk, &L->wv };
    float *const qkv_out[3] = { b->q, b->k, b->v };
    forward_warm(m, &L->wo, NULL, NULL);
    forward_mul_mats(be, qkv, 3, b->h, n, qkv_out);
    if (L->bq.data) op->add_bias(be, b->q, &L->bq, n);
    if (L->bk.data) op->add_bias(be, b->k, &L->bk, n);
    if (L->bv.data) op->add_bias(be, b->v, &L->bv, n);
    if (L->q_norm.data) op->rms_norm(be, b->q, &L->q_norm, b->q, n * hp->n_head, hd, hp->rms_eps);
    if (L->k_norm.data) op->rms_norm(be, b->k, &L->k_norm, b->k, n * hp->n_head_kv, hd, hp->rms_eps);
    op->rope(be, b->q, n, hp->n_head, hd, p->bt.pos, &hp->rope);
    op->rope(be, b->k, n, hp->n_head_kv, hd, p->bt.pos, &hp->rope);
    op->kv_store(be, &p->bt, il, b->k, b->v);
    return op->sync_kv ? 0 : forward_hooks(m, p, il, err, errlen);
}

/* x += Wo attention(q, cache): the rest of the block's attention half. */
static int forward_attend(model *m, const fwd_pass *p, int il, int ffn, char *err, size_t errlen) {
    const model_hparams *hp = &m->hp;
    const model_layer *L = &m->layers[il];
    backend *be = m->be;
    const backend_ops *op = be->ops;
    fwd_bufs *b = &m->b;
    int hd = hp->head_dim_k, n = p->bt.n_tok;

    if (op->attention(be, b->q, &p->bt, il, hp->n_head, hp->n_head_kv, hd, 1.0f / sqrtf((float)hd), b->att)) {
        snprintf(err, errlen, "out of memory in attention");
        return -1;
    }
    if (!hp->n_expert && ffn) forward_warm(m, &L->ffn_gate, &L->ffn_up, NULL);
    op->mul_mat(be, &L->wo, 0, b->att, n, b->o);
    op->add(be, b->x, b->o, n * (size_t)hp->n_embd);
    return 0;
}

/* x += FFN(rms_norm(x)): the block's feed-forward half. */
static int forward_ffn(model *m, const fwd_pass *p, int il, char *err, size_t errlen) {
    const model_hparams *hp = &m->hp;
    const model_layer *L = &m->layers[il];
    backend *be = m->be;
    const backend_ops *op = be->ops;
    fwd_bufs *b = &m->b;
    int n = p->bt.n_tok;
    size_t E = (size_t)hp->n_embd;

    op->rms_norm(be, b->x, &L->ffn_norm, b->h, n, hp->n_embd, hp->rms_eps);
    if (hp->n_expert) {
        if (op->moe_ffn(be, &L->moe, b->h, n, b->o)) {
            snprintf(err, errlen, "MoE feed-forward failed in layer %d (out of memory)", il);
            return -1;
        }
    } else {
        const be_weight *gu[2] = { &L->ffn_gate, &L->ffn_up };
        float *const gu_out[2] = { b->g, b->u };
        forward_warm(m, &L->ffn_down, NULL, NULL);
        forward_mul_mats(be, gu, 2, b->h, n, gu_out);
        op->swiglu(be, b->g, b->u, b->g, (size_t)n * hp->n_ff);
        if (il + 1 < m->layer_hi) {
            const model_layer *N = &m->layers[il + 1];
            forward_warm(m, &N->wq, &N->wk, &N->wv);
        } else if (p->n_out) {
            forward_warm(m, &m->output, NULL, NULL);
        }
        op->mul_mat(be, &L->ffn_down, 0, b->g, n, b->o);
    }
    op->add(be, b->x, b->o, n * E);
    return 0;
}

/* Logits of the rows that want them (each sequence's last row, or its last
 * few when verifying drafts): those rows are normed into h (in sequence
 * order), multiplied by the output matrix together, and read back to each
 * item's buffer. */
static int forward_logits(model *m, const fwd_pass *p, char *err, size_t errlen) {
    const model_hparams *hp = &m->hp;
    backend *be = m->be;
    const backend_ops *op = be->ops;
    fwd_bufs *b = &m->b;
    size_t E = (size_t)hp->n_embd, V = (size_t)hp->n_vocab;
    if (forward_logits_room(m, p->n_out, err, errlen)) return -1;
    int r = 0;
    for (int s = 0; s < p->bt.n_seq; s++) {
        if (!p->want_logits[s]) continue;
        const be_seq *sq = &p->bt.seq[s];
        const int w = p->want_logits[s];
        const float *first = b->x + (size_t)(sq->t0 + sq->n - w) * E;
        op->rms_norm(be, first, &m->output_norm, b->h + (size_t)r * E, w, hp->n_embd, hp->rms_eps);
        r += w;
    }
    op->mul_mat(be, &m->output, 0, b->h, p->n_out, b->logits);
    r = 0;
    for (int s = 0; s < p->bt.n_seq; s++) {
        if (!p->want_logits[s]) continue;
        const int w = p->want_logits[s];
        float *dst = p->items[p->item_of[s]].logits + (size_t)p->out_row[s] * V;
        op->read(be, b->logits + (size_t)r * V, dst, (size_t)w * V);
        r += w;
    }
    return 0;
}

static int forward_pass(model *m, const fwd_pass *p, const int32_t *ids, char *err, size_t errlen) {
    const model_hparams *hp = &m->hp;
    backend *be = m->be;
    fwd_bufs *b = &m->b;

    if (p->x_in) {
        be->ops->write(be, b->x, p->x_in, (size_t)p->bt.n_tok * (size_t)hp->n_embd);
    } else if (be->ops->get_rows(be, &m->tok_embd, ids, p->bt.n_tok, b->x)) {
        snprintf(err, errlen, "token id out of range");
        return -1;
    }
    /* A backend with device caches (sync_kv) copies each layer's new K/V
     * rows to the host while it computes: its hooks run once the rest of
     * the layer has been queued, so the copy overlaps that work. */
    if (be->ops->warm_next) be->ops->warm_next(be, NULL, 0);   /* no hint left from an earlier pass */
    int late = be->ops->sync_kv != NULL;
    for (int il = m->layer_lo; il < m->layer_hi; il++) {
        /* a block shared with the slice before (after) computes only its
         * feed-forward (attention) half here */
        int attn = !(il == m->layer_lo && m->ffn_first), ffn = !(il == m->layer_hi - 1 && m->attn_last);
        if (attn && forward_attention(m, p, il, err, errlen)) return -1;
        /* A pass whose logits nobody reads needs the last layer's K/V
         * only: the rest of that layer cannot change any cache. */
        if (il == hp->n_layer - 1 && !p->n_out && !p->x_out) return late ? forward_hooks(m, p, il, err, errlen) : 0;
        if (attn && forward_attend(m, p, il, ffn, err, errlen)) return -1;
        if (ffn && forward_ffn(m, p, il, err, errlen)) return -1;
        if (late && attn && forward_hooks(m, p, il, err, errlen)) return -1;
    }
    if (p->x_out) be->ops->read(be, b->x, p->x_out, (size_t)p->bt.n_tok * (size_t)hp->n_embd);
    return p->n_out ? forward_logits(m, p, err, errlen) : 0;
}

/* ==== Entry ==== */

static int forward_check_items(model *m, const model_batch_item *items, int n_items, char *err, size_t errlen) {
    if (n_items <= 0) { snprintf(err, errlen, "nothing to evaluate"); return -1; }
    for (int i = 0; i < n_items; i++) {
        const model_batch_item *it = &items[i];
        if (!it->s || it->n <= 0 || !it->ids) { snprintf(err, errlen, "nothing to evaluate"); return -1; }
        for (int k = 0; k < i; k++)
            if (items[k].s == it->s) { snprintf(err, errlen, "a session appears twice in one batch"); return -1; }
        for (int t = 0; t < it->n; t++) {
            if (it->ids[t] < 0 || it->ids[t] >= m->hp.n_vocab) {
                snprintf(err, errlen, "token id %d at index %d is outside the vocabulary (%d)", it->ids[t], t,
                         m->hp.n_vocab);
                return -1;
            }
        }
        if (it->n_logits < 0 || it->n_logits > it->n) {
            snprintf(err, errlen, "%d rows of logits asked of an item of %d tokens", it->n_logits, it->n);
            return -1;
        }
        if (kv_check_range(it->s->kv, 0, kv_used(it->s->kv), it->n, err, errlen)) return -1;
    }
    return 0;
}

/* Fills the next pass from the items' remaining tokens (done[i] of item i
 * are evaluated): whole items while they fit, the last one possibly cut. */
static void forward_fill_pass(model *m, model_batch_item *items, int n_items, const int *done, fwd_pass *p,
                              int32_t *ids) {
    fwd_bufs *b = &m->b;
    int rows = 0, ns = 0;
    p->n_out = 0;
    for (int i = 0; i < n_items && rows < b->cap; i++) {
        int left = items[i].n - done[i];
        if (left <= 0) continue;
        int k = left < b->cap - rows ? left : b->cap - rows;
        be_seq *sq = &b->seq[ns];
        sq->kv = items[i].s->kv;
        sq->t0 = rows;
        sq->n = k;
        sq->pos0 = kv_used(sq->kv);
        for (int t = 0; t < k; t++) { b->pos[rows + t] = sq->pos0 + t; ids[rows + t] = items[i].ids[done[i] + t]; }
        p->item_of[ns] = i;
        /* the item's last nl tokens want logits: those of them in this pass */
        int nl = !items[i].logits ? 0 : items[i].n_logits > 0 ? items[i].n_logits : 1;
        int from = items[i].n - nl > done[i] ? items[i].n - nl : done[i];
        p->want_logits[ns] = nl && done[i] + k > from ? done[i] + k - from : 0;
        p->out_row[ns] = from - (items[i].n - nl);
        p->n_out += p->want_logits[ns];
        rows += k;
        ns++;
    }
    p->bt.n_tok = rows;
    p->bt.pos = b->pos;
    p->bt.n_seq = ns;
    p->bt.seq = b->seq;
    p->items = items;
}

static int forward_run_items(model *m, model_batch_item *items, int n_items, char *err, size_t errlen) {
    if (forward_alloc(m, err, errlen)) return -1;
    int cap = m->b.cap;
    int *done = calloc((size_t)n_items, sizeof(int));
    int *item_of = malloc(sizeof(int) * (size_t)cap * 3);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)cap);
    int rc = 0;
    if (!done || !item_of || !ids) { snprintf(err, errlen, "out of memory"); rc = -1; goto out; }
    fwd_pass p = { .item_of = item_of, .want_logits = item_of + cap, .out_row = item_of + 2 * (size_t)cap };
    for (;;) {
        forward_fill_pass(m, items, n_items, done, &p, ids);
        if (p.bt.n_tok == 0) break;
        if (forward_pass(m, &p, ids, err, errlen)) {
            /* what was complete before this pass stays valid; a backend
             * that holds rows of its own forgets the pass's */
            for (int s = 0; s < p.bt.n_seq; s++) {
                kv_set_used(p.bt.seq[s].kv, p.bt.seq[s].pos0);
                session_rows_written(items[p.item_of[s]].s, p.bt.seq[s].pos0);
            }
            rc = -1;
            break;
        }
        for (int s = 0; s < p.bt.n_seq; s++) {
            kv_set_used(p.bt.seq[s].kv, p.bt.seq[s].pos0 + p.bt.seq[s].n);
            done[p.item_of[s]] += p.bt.seq[s].n;
        }
    }
out:
    free(done);
    free(item_of);
    free(ids);
    return rc;
}

int model_eval_batch(model *m, model_batch_item *items, int n_items, char *err, size_t errlen) {
    if (m->sliced) {
        snprintf(err, errlen, "this model holds layers %d:%d only (a prefill slice): use model_eval_slice",
                 m->layer_lo, m->layer_hi);
        return -1;
    }
    if (forward_check_items(m, items, n_items, err, errlen)) return -1;
    pthread_mutex_lock(&m->eval_mu);
    int rc = forward_run_items(m, items, n_items, err, errlen);
    pthread_mutex_unlock(&m->eval_mu);
    return rc;
}

int model_eval(model *m, session *s, const int32_t *ids, int n, float *logits,
               layer_hook hook, void *hook_ud, char *err, size_t errlen) {
    model_batch_item it = { .s = s, .ids = ids, .n = n, .logits = logits, .hook = hook, .hook_ud = hook_ud };
    return model_eval_batch(m, &it, 1, err, errlen);
}

/* ==== Slices ==== */

int model_eval_slice(model *m, session *s, const int32_t *ids, const float *x_in, int n, float *x_out,
                     layer_hook hook, void *hook_ud, char *err, size_t errlen) {
    if (n <= 0 || n > m->n_batch) {
        snprintf(err, errlen, "a slice pass takes 1..%d positions, not %d", m->n_batch, n);
        return -1;
    }
    int first = m->layer_lo == 0 && !m->ffn_first;   /* the chain's first slice: it embeds the ids */
    if (first != (x_in == NULL) || (!x_in && !ids)) {
        snprintf(err, errlen, "blocks %d:%d take %s", m->layer_lo, m->layer_hi, first ? "token ids" : "hidden states");
        return -1;
    }
    /* hidden states carry no ids: a placeholder 0 passes the range check */
    int32_t *zero = NULL;
    if (!ids && !(ids = zero = calloc((size_t)n, sizeof *zero))) { snprintf(err, errlen, "out of memory"); return -1; }
    model_batch_item it = { .s = s, .ids = ids, .n = n, .hook = hook, .hook_ud = hook_ud };
    int rc = forward_check_items(m, &it, 1, err, errlen);
    if (rc == 0) {
        pthread_mutex_lock(&m->eval_mu);
        rc = forward_alloc(m, err, errlen);
        if (rc == 0) {
            int item_of[3];   /* one sequence: its item, whether it wants logits, its logits row */
            fwd_pass p = { .item_of = item_of, .want_logits = item_of + 1, .out_row = item_of + 2,
                           .x_in = x_in, .x_out = x_out };
            int done = 0;
            int32_t *pids = malloc(sizeof(int32_t) * (size_t)n);
            if (!pids) { snprintf(err, errlen, "out of memory"); rc = -1; }
            else {
                forward_fill_pass(m, &it, 1, &done, &p, pids);
                p.x_in = x_in;
                p.x_out = x_out;
                rc = forward_pass(m, &p, pids, err, errlen);
                kv_set_used(s->kv, p.bt.seq[0].pos0 + (rc == 0 ? n : 0));
                if (rc) session_rows_written(s, p.bt.seq[0].pos0);
                free(pids);
            }
        }
        pthread_mutex_unlock(&m->eval_mu);
    }
    free(zero);
    return rc;
}
