/* draft_serve.c - a draft node answering DRAFT frames (see draft_serve.h). */
#include "node/draft_serve.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/wire_draft.h"
#include "node/draft.h"

/* ==== State ==== */

typedef struct {
    int used;
    unsigned conn;
    uint32_t seq;
    uint64_t last;            /* exchange stamp of its last question (eviction order) */
    int n;                    /* tokens of the history held */
    int32_t *tokens;          /* [n_ctx] */
} ds_slot;

struct draft_server {
    pthread_mutex_t mu;
    draft_src *src;           /* the draft model, one session per slot */
    int n_slots, n_ctx;
    uint32_t n_vocab;
    ds_slot *slots;
    uint64_t stamp, exchanges, drafts;
    wire_draft_ask asks[WIRE_DRAFT_MAX_SEQ];
    draft_ask dq[WIRE_DRAFT_MAX_SEQ];
    int32_t out[WIRE_DRAFT_MAX_SEQ][WIRE_DRAFT_MAX_K];
    uint32_t status[WIRE_DRAFT_MAX_SEQ];
    wire_buf fb;
};

/* ==== Set-up ==== */

int draft_server_create(draft_server **out, model *target, model *dm, int n_slots, int n_ctx, uint32_t kv_dtype,
                        char *err, size_t errlen) {
    *out = NULL;
    if (n_slots < 1 || n_slots > (int)WIRE_DRAFT_MAX_SEQ) {
        snprintf(err, errlen, "--draft-slots %d is out of 1..%u", n_slots, WIRE_DRAFT_MAX_SEQ);
        return -1;
    }
    draft_server *ds = calloc(1, sizeof *ds);
    if (!ds) { snprintf(err, errlen, "out of memory for the draft server"); return -1; }
    pthread_mutex_init(&ds->mu, NULL);
    ds->n_slots = n_slots;
    ds->n_ctx = n_ctx;
    ds->n_vocab = (uint32_t)model_get_hparams(target)->n_vocab;
    draft_opts o = { .dm = dm, .draft_max = (int)WIRE_DRAFT_MAX_K, .n_slots = n_slots, .n_ctx = n_ctx,
                     .kv_dtype = kv_dtype, .fixed = 1 };
    if (draft_create(&ds->src, target, &o, err, errlen)) { draft_server_free(ds); return -1; }
    ds->slots = calloc((size_t)n_slots, sizeof *ds->slots);
    for (int i = 0; ds->slots && i < n_slots; i++)
        if (!(ds->slots[i].tokens = malloc(sizeof(int32_t) * (size_t)n_ctx))) break;
    if (!ds->slots || !ds->slots[n_slots - 1].tokens) {
        draft_server_free(ds);
        snprintf(err, errlen, "out of memory for the draft server's histories");
        return -1;
    }
    *out = ds;
    return 0;
}

void draft_server_free(draft_server *ds) {
    if (!ds) return;
    for (int i = 0; ds->slots && i < ds->n_slots; i++) free(ds->slots[i].tokens);
    free(ds->slots);
    draft_free(ds->src);
    wire_buf_free(&ds->fb);
    pthread_mutex_destroy(&ds->mu);
    free(ds);
}

void draft_server_conn_gone(draft_server *ds, unsigned conn_id) {
    if (!ds) return;
    pthread_mutex_lock(&ds->mu);
    for (int i = 0; i < ds->n_slots; i++)
        if (ds->slots[i].used && ds->slots[i].conn == conn_id) ds->slots[i].used = 0;
    pthread_mutex_unlock(&ds->mu);
}

void draft_server_counts(draft_server *ds, uint64_t *exchanges, uint64_t *drafts) {
    pthread_mutex_lock(&ds->mu);
    *exchanges = ds->exchanges;
    *drafts = ds->drafts;
    pthread_mutex_unlock(&ds->mu);
}

/* ==== Slots ==== */

static ds_slot *ds_find(draft_server *ds, unsigned conn, uint32_t seq) {
    for (int i = 0; i < ds->n_slots; i++)
        if (ds->slots[i].used && ds->slots[i].conn == conn && ds->slots[i].seq == seq) return &ds->slots[i];
    return NULL;
}

/* A free slot, else the least recently asked one not asked in this
 * exchange (stamp); NULL when every slot serves this exchange. */
static ds_slot *ds_take(draft_server *ds, unsigned conn, uint32_t seq) {
    ds_slot *best = NULL;
    for (int i = 0; i < ds->n_slots; i++) {
        ds_slot *s = &ds->slots[i];
        if (!s->used) { best = s; break; }
        if (s->last != ds->stamp && (!best || s->last < best->last)) best = s;
    }
    if (best) *best = (ds_slot){ .used = 1, .conn = conn, .seq = seq, .tokens = best->tokens };
    return best;
}

/* One entry: its slot brought to keep + n tokens, and the question for the
 * draft model; returns the status. */
static uint32_t ds_apply(draft_server *ds, unsigned conn, const wire_draft_ask *a, draft_ask *q, int32_t *out) {
    ds_slot *s = ds_find(ds, conn, a->seq);
    if (a->keep == 0 && !s) s = ds_take(ds, conn, a->seq);
    if (!s) return a->keep ? WIRE_DRAFT_UNKNOWN : WIRE_DRAFT_FULL;
    if ((int64_t)a->keep > s->n) return WIRE_DRAFT_UNKNOWN;
    s->last = ds->stamp;
    if ((uint64_t)a->keep + a->n + a->k > (uint64_t)ds->n_ctx) {
        s->n = (int)a->keep;
        return WIRE_DRAFT_FULL;
    }
    for (uint32_t i = 0; i < a->n; i++) s->tokens[a->keep + i] = (int32_t)wire_draft_token(a->tokens, i);
    s->n = (int)(a->keep + a->n);
    *q = (draft_ask){ .slot = (int)(s - ds->slots), .hist = s->tokens, .n = s->n, .k = (int)a->k, .out = out };
    return WIRE_DRAFT_OK;
}

/* ==== Answering ==== */

static int ds_reply(draft_server *ds, uint32_t n_seq, int *ask_of) {
    wire_buf_reset(&ds->fb);
    if (wire_draft_begin(&ds->fb, n_seq)) return -1;
    for (uint32_t i = 0; i < n_seq; i++) {
        int a = ask_of[i];
        uint32_t n = a >= 0 ? (uint32_t)ds->dq[a].n_out : 0;
        if (wire_draft_add_reply(&ds->fb, ds->asks[i].seq, ds->status[i], n, ds->out[i])) return -1;
        ds->drafts += n;
    }
    return 0;
}

int draft_server_answer(draft_server *ds, unsigned conn_id, wire_conn *c, const wire_header *h, char *err,
                        size_t errlen) {
    uint32_t n_seq = 0;
    int ask_of[WIRE_DRAFT_MAX_SEQ];
    pthread_mutex_lock(&ds->mu);
    if (h->req_id == 0 ||
        wire_draft_decode_ask(c->rx.data, c->rx.len, ds->n_vocab, ds->asks, &n_seq, err, errlen)) {
        if (h->req_id == 0) snprintf(err, errlen, "DRAFT frame without an exchange number");
        pthread_mutex_unlock(&ds->mu);
        wire_send_error(c, h->req_id, WERR_RANGE, err);
        return -1;
    }
    ds->stamp++;
    int na = 0;
    for (uint32_t i = 0; i < n_seq; i++) {
        ds->status[i] = ds_apply(ds, conn_id, &ds->asks[i], &ds->dq[na], ds->out[i]);
        ask_of[i] = ds->status[i] == WIRE_DRAFT_OK ? na++ : -1;
    }
    if (na) draft_propose(ds->src, ds->dq, na, 0);   /* catch-up at draft.c's default budget */
    ds->exchanges++;
    int rc = ds_reply(ds, n_seq, ask_of);
    if (rc) snprintf(err, errlen, "out of memory for a DRAFTS frame");
    else rc = wire_send(c, WIRE_DRAFTS, h->req_id, 0, ds->fb.data, ds->fb.len, err, errlen);
    pthread_mutex_unlock(&ds->mu);
    return rc;
}
