/* draft.c - the decode node's draft sources (see draft.h). */
#include "node/draft.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "engine/sampler.h"
#include "engine/spec.h"
#include "node/draft_remote.h"
#include "engine/spec_sample.h"

/* ==== Constants ==== */

/* Default drafts per step from a draft model: with a draft that matches the
 * target 70% of the time, 8 drafts give 3.2 of the 3.33 tokens per step an
 * unbounded run would (spec_adapt cuts it where acceptance is lower). */
#define DRAFT_DEFAULT_MAX 8
/* A verified row beside a decode step's, as a fraction of the step, until
 * the scheduler's timed passes give it (spec_cost): the weights are read
 * once for all rows, so a row adds its share of compute; a guess on the
 * expensive side, so that drafts must show acceptance before they grow. */
#define DRAFT_ROW_COST 0.15
/* A draft model's step beyond its share of weight bytes: its own pass's
 * fixed costs (norms, attention, threads waking) relative to the target's. */
#define DRAFT_MODEL_OVERHEAD 0.02
/* A draft node's drafts, as a fraction of a decode step, until the
 * exchanges are timed (draft_remote_cost): no compute here, the round trip
 * (tens of microseconds on a LAN) beside a step of milliseconds. */
#define DRAFT_NODE_COST 0.02
/* A slot's catch-up (the draft session behind its history: a new prompt, a
 * probe after a long stretch without drafts) is fed in chunks: per step, the
 * caller's room for prompt work in target rows (the scheduler's prefill
 * budget less its own prompt rows that step: draft_propose), draft rows
 * scaled by the draft's relative cost, so the draft catches up about as
 * fast as the target prefilled and a step never carries more prompt work
 * than the target alone would. The slot drafts once it has caught up. When
 * the caller gives no room (a draft node answering exchanges), this many
 * target rows: the scheduler's default prefill budget. */
#define DRAFT_CATCHUP_DEFAULT_ROWS 256
/* Rows a slot may need per step without being behind: the accepted drafts,
 * the bonus token and the next one (never held back). */
#define DRAFT_STEADY_ROWS (SPEC_MAX_DRAFT + 2)

/* ==== State ==== */

typedef struct {
    session *s;
    int32_t *tokens;         /* what s holds: tokens[0, session_pos) */
} draft_slot;

struct draft_src {
    int lookup, draft_max, n_slots, n_ctx, n_vocab;
    model *dm;
    struct draft_remote *remote;   /* --draft-node (draft_remote.h) */
    double model_cost;       /* a draft model's step, as a fraction of the target's */
    int max_fed;             /* the most rows one slot was fed in one step (a report) */
    int fixed;
    draft_slot *slots;
    float *logits;           /* [n_slots][n_vocab] */
    model_batch_item *items;
    int *item_ask;           /* [n_slots] the ask each item serves */
    int32_t *next;           /* [n_slots] the token each item feeds */
    char kind[16];
};

/* ==== Set-up ==== */

void draft_free(draft_src *d);

/* --draft-node: the client, started (it connects in the background);
 * frees d on failure. */
static int draft_node_create(draft_src *d, model *target, const draft_opts *o, char *err, size_t errlen) {
    draft_remote_opts ro = { .hostport = o->node, .secret = o->secret, .secret_len = o->secret_len,
                             .node_id = o->node_id, .kv_dtype = o->kv_dtype, .n_slots = o->n_slots,
                             .timeout_ms = o->node_timeout_ms };
    d->model_cost = DRAFT_NODE_COST;
    if (draft_remote_create(&d->remote, target, &ro, err, errlen) == 0) return 0;
    draft_free(d);
    return -1;
}

/* 0 when the two tokenizers have the same tokens (bytes and types) and the
 * same end-of-generation ids; else -1 naming the first difference. */
static int draft_same_vocab(const tokenizer *a, const tokenizer *b, char *err, size_t errlen) {
    int32_t n = tokenizer_n_vocab(a);
    if (n != tokenizer_n_vocab(b)) {
        snprintf(err, errlen, "the draft model has %d tokens, the model %d", tokenizer_n_vocab(b), n);
        return -1;
    }
    for (int32_t i = 0; i < n; i++) {
        size_t la, lb;
        const char *sa = tokenizer_token_str(a, i, &la), *sb = tokenizer_token_str(b, i, &lb);
        if (!sa || !sb || la != lb || memcmp(sa, sb, la) || tokenizer_token_type(a, i) != tokenizer_token_type(b, i) ||
            tokenizer_is_eog(a, i) != tokenizer_is_eog(b, i)) {
            snprintf(err, errlen, "the draft model's token %d differs from the model's (not the same tokenizer)", i);
            return -1;
        }
    }
    return 0;
}

int draft_create(draft_src **out, model *target, const draft_opts *o, char *err, size_t errlen) {
    *out = NULL;
    if (o->lookup <= 0 && !o->dm && !o->node) return 0;
    if (o->dm && draft_same_vocab(model_get_tokenizer(target), model_get_tokenizer(o->dm), err, errlen)) return -1;
    draft_src *d = calloc(1, sizeof *d);
    if (!d) goto oom;
    d->lookup = o->lookup > SPEC_MAX_DRAFT ? SPEC_MAX_DRAFT : o->lookup;
    d->dm = o->dm;
    d->draft_max = o->draft_max > 0 ? o->draft_max : DRAFT_DEFAULT_MAX;
    if (d->draft_max > SPEC_MAX_DRAFT) d->draft_max = SPEC_MAX_DRAFT;
    d->n_slots = o->n_slots;
    d->n_ctx = o->n_ctx;
    d->n_vocab = model_get_hparams(target)->n_vocab;
    d->fixed = o->fixed;
    snprintf(d->kind, sizeof d->kind, "%s%s%s", d->lookup ? "lookup" : "", d->lookup && (d->dm || o->node) ? "+" : "",
             d->dm ? "model" : o->node ? "node" : "");
    if (o->node && !d->dm && draft_node_create(d, target, o, err, errlen)) return -1;
    if (d->dm) {
        uint64_t tb = model_weight_bytes_per_token(target), db = model_weight_bytes_per_token(d->dm);
        d->model_cost = (tb ? (double)db / (double)tb : 1.0) + DRAFT_MODEL_OVERHEAD;
        d->slots = calloc((size_t)d->n_slots, sizeof *d->slots);
        d->logits = malloc(sizeof(float) * (size_t)d->n_slots * (size_t)d->n_vocab);
        d->items = calloc((size_t)d->n_slots, sizeof *d->items);
        d->item_ask = calloc((size_t)d->n_slots, sizeof *d->item_ask);
        d->next = calloc((size_t)d->n_slots, sizeof *d->next);
        if (!d->slots || !d->logits || !d->items || !d->item_ask || !d->next) goto oom;
        for (int i = 0; i < d->n_slots; i++) {
            if (session_new(&d->slots[i].s, d->dm, d->n_ctx, o->kv_dtype, err, errlen)) { draft_free(d); return -1; }
            if (!(d->slots[i].tokens = malloc(sizeof(int32_t) * (size_t)d->n_ctx))) goto oom;
        }
    }
    *out = d;
    return 0;
oom:
    draft_free(d);
    snprintf(err, errlen, "out of memory for the draft sessions");
    return -1;
}

void draft_free(draft_src *d) {
    if (!d) return;
    draft_remote_free(d->remote);
    for (int i = 0; d->slots && i < d->n_slots; i++) {
        session_free(d->slots[i].s);
        free(d->slots[i].tokens);
    }
    free(d->slots);
    free(d->logits);
    free(d->items);
    free(d->item_ask);
    free(d->next);
    free(d);
}

const char *draft_kind(const draft_src *d) { return d ? d->kind : "none"; }
int draft_has_model(const draft_src *d) { return d && d->dm; }
int draft_max_fed(const draft_src *d) { return d ? d->max_fed : 0; }
int draft_k_max(const draft_src *d) {
    if (!d) return 0;
    return (d->dm || d->remote) && d->draft_max > d->lookup ? d->draft_max : d->lookup;
}
double draft_cost(const draft_src *d, double row_cost) {
    if (!d) return 1.0;
    if (d->fixed) return 0.0;
    return row_cost + (d->remote ? draft_remote_cost(d->remote, DRAFT_NODE_COST) : d->model_cost);
}
double draft_row_prior(void) { return DRAFT_ROW_COST; }

/* ==== The draft model ==== */

/* Draft rows of catch-up this step, all slots together, for target_rows of
 * room (<= 0: the default): never fewer than one steady step's rows. */
static int draft_catchup_rows(const draft_src *d, int target_rows) {
    double t = target_rows > 0 ? target_rows : DRAFT_CATCHUP_DEFAULT_ROWS;
    double rows = t / (d->model_cost > 0 ? d->model_cost : 1.0);
    if (rows > d->n_ctx) rows = d->n_ctx;
    return rows < DRAFT_STEADY_ROWS ? DRAFT_STEADY_ROWS : (int)rows;
}

/* Every ask's slot session made to hold its history but the last token
 * (the longest prefix it already holds is kept), and the item that feeds
 * the rest; returns the item count. */
static int draft_model_sync(draft_src *d, draft_ask *asks, int n_asks, int target_rows) {
    int ni = 0, budget = draft_catchup_rows(d, target_rows);
    for (int a = 0; a < n_asks; a++) {
        draft_ask *q = &asks[a];
        if (q->n_out > 0 || q->k <= 0 || q->n < 1 || q->n + q->k > d->n_ctx + 1 || q->slot < 0 ||
            q->slot >= d->n_slots)
            continue;
        draft_slot *sl = &d->slots[q->slot];
        int have = session_pos(sl->s), c = 0;
        while (c < have && c < q->n - 1 && sl->tokens[c] == q->hist[c]) c++;
        int need = q->n - c, feed = need;
        if (need > DRAFT_STEADY_ROWS) {         /* catching up: a chunk, no drafts yet */
            feed = need < budget ? need : budget;
            budget -= feed;
            if (feed <= 0) continue;
        }
        session_reset(sl->s, c);
        memcpy(sl->tokens + c, q->hist + c, sizeof(int32_t) * (size_t)feed);
        d->items[ni] = (model_batch_item){ .s = sl->s, .ids = sl->tokens + c, .n = feed,
                                           .logits = feed == need ? d->logits + (size_t)ni * d->n_vocab : NULL };
        d->item_ask[ni++] = feed == need ? a : -1;
        if (feed > d->max_fed) d->max_fed = feed;
    }
    return ni;
}

/* Greedy drafts: the first from the synced histories' logits, then one
 * batched pass per further draft over the asks that want more. */
static void draft_model_propose(draft_src *d, draft_ask *asks, int n_asks, int target_rows) {
    char err[256];
    int ni = draft_model_sync(d, asks, n_asks, target_rows);
    while (ni > 0) {
        if (model_eval_batch(d->dm, d->items, ni, err, sizeof err)) {
            log_warn(NULL, "draft model: %s (this step goes without drafts)", err);
            for (int i = 0; i < ni; i++) {
                session_reset(d->items[i].s, 0);
                if (d->item_ask[i] >= 0) asks[d->item_ask[i]].n_out = 0;
            }
            return;
        }
        int nn = 0;
        for (int i = 0; i < ni; i++) {
            if (d->item_ask[i] < 0) continue;   /* a catch-up chunk */
            draft_ask *q = &asks[d->item_ask[i]];
            const float *lg = d->logits + (size_t)i * d->n_vocab;
            int32_t t = q->smp ? spec_draft_sample(q->smp, lg, q->q + (size_t)q->n_out * d->n_vocab)
                               : sampler_argmax(lg, d->n_vocab);
            q->sampled = q->smp != NULL;
            q->out[q->n_out++] = t;
            if (q->n_out >= q->k) continue;
            /* the draft is fed next: its row joins the session's tokens */
            draft_slot *sl = &d->slots[q->slot];
            int pos = session_pos(sl->s);
            sl->tokens[pos] = t;
            d->items[nn] = (model_batch_item){ .s = sl->s, .ids = sl->tokens + pos, .n = 1,
                                               .logits = d->logits + (size_t)nn * d->n_vocab };
            d->item_ask[nn++] = d->item_ask[i];
        }
        ni = nn;
    }
}

/* ==== Asking ==== */

void draft_propose(draft_src *d, draft_ask *asks, int n_asks, int target_rows) {
    for (int a = 0; a < n_asks; a++) {
        draft_ask *q = &asks[a];
        q->n_out = 0;
        q->sampled = 0;
        int k = q->k < d->lookup ? q->k : d->lookup;
        if (k > 0) q->n_out = spec_lookup(q->hist, q->n, k, q->out);
    }
    if (d->dm) {
        for (int a = 0; a < n_asks; a++)
            if (asks[a].k > d->draft_max) asks[a].k = d->draft_max;
        draft_model_propose(d, asks, n_asks, target_rows);
    }
    if (d->remote) {
        for (int a = 0; a < n_asks; a++)
            if (asks[a].k > d->draft_max) asks[a].k = d->draft_max;
        draft_remote_propose(d->remote, asks, n_asks);
    }
}

struct draft_remote *draft_get_remote(const draft_src *d) { return d ? d->remote : NULL; }
