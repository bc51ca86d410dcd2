/* draft_remote.c - drafts from a draft node (see draft_remote.h). */
#include "node/draft_remote.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "engine/generate.h"
#include "net/wire.h"
#include "net/wire_draft.h"
#include "node/handoff.h"

/* ==== Constants ==== */

/* An answer still missing this long after its deadline means the draft node
 * is gone (a host that died sends no reset): the connection is dropped. */
#define DRAFT_REMOTE_DEAD_MS 5000
/* Reconnection backoff: the first retry soon (a restarted node is back in a
 * second), then doubling up to the cap so that a node down for good costs a
 * connect attempt every 10 s, each in the background thread. */
#define DRAFT_REMOTE_BACKOFF_MIN_MS 200
#define DRAFT_REMOTE_BACKOFF_MAX_MS 10000
/* connect + handshake deadline (the connector thread's; never the scheduler's) */
#define DRAFT_REMOTE_CONNECT_MS 2000
/* The cost estimate's moving averages: weight of a new step; a step that
 * took more than this many times the average is the scheduler waking from
 * idle, not a step, and is left out. */
#define DRAFT_REMOTE_EWMA 0.05
#define DRAFT_REMOTE_IDLE_X 4.0
/* the connector's idle wake-up, to notice stop */
#define DRAFT_REMOTE_TICK_MS 200

/* ==== State ==== */

/* DRAFTs sent and not yet answered at most: one. A step reads the
 * look-ahead's answer before it sends a fresh DRAFT (it decides which
 * sequences need one), and sends the next look-ahead after the fresh
 * answer; the queue keeps the order checks in one place should that
 * change. */
#define DRAFT_REMOTE_QUEUE 1

typedef struct {
    int32_t *tok;             /* the history the draft node holds of this sequence (as far as we know) */
    int n, cap;
    int full_at;              /* history length the draft node found too long (0: none) */
    /* the look-ahead (dr_send_ahead): its exchange (0: none), the history
     * it continued (ahead_len tokens: up to the last draft), and once
     * answered, the guess of the target's next token and the drafts after */
    uint64_t ahead_ex;
    int ahead_len, ahead_in, n_ahead;
    int32_t ahead[WIRE_DRAFT_MAX_K];
} dr_seq;

/* One DRAFT sent, not yet answered. */
typedef struct {
    uint64_t ex;              /* its exchange number */
    int ahead;                /* 1: a look-ahead (drafts go to the seqs' ahead buffers) */
    uint64_t step;            /* the dr_exchange call that sent it */
    double sent_ms;
    uint32_t n;               /* entries */
    int ask_of[WIRE_DRAFT_MAX_SEQ];   /* each entry's draft_ask (a fresh exchange) */
    uint32_t seq[WIRE_DRAFT_MAX_SEQ], k[WIRE_DRAFT_MAX_SEQ], keep[WIRE_DRAFT_MAX_SEQ], len[WIRE_DRAFT_MAX_SEQ];
} dr_out;

struct draft_remote {
    char *hostport;
    uint8_t *secret;
    size_t secret_len;
    wire_hello hello;
    uint32_t n_vocab;
    int n_slots, timeout_ms;
    pthread_t th;
    int th_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop;                 /* (mu) */
    wire_conn *ready;         /* (mu) a connection made, not yet taken */
    int need;                 /* (mu) the scheduler has none */
    double next_try;          /* (mu) gen_now_ms() of the next attempt */
    int backoff_ms;           /* (mu) */
    draft_remote_stats st;    /* (mu) */
    /* the scheduler thread's */
    wire_conn *conn;
    uint64_t exchange;        /* number of the last DRAFT sent */
    int late;                 /* an answer is overdue */
    uint64_t steps;           /* dr_exchange calls */
    dr_seq *seqs;             /* [n_slots] */
    wire_buf fb;
    dr_out q[DRAFT_REMOTE_QUEUE];         /* sent, unanswered, oldest first */
    int nq;
    wire_draft_reply rep[WIRE_DRAFT_MAX_SEQ];
    /* what a draft costs (draft_remote_cost): steps timed by the calls */
    double last_step, ex_ms, plain_ms, per_draft_ms;
    int ex_drafts;
};

/* ==== Connector thread ==== */

static void dr_wait(draft_remote *r, int ms) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
    pthread_cond_timedwait(&r->cv, &r->mu, &ts);
}

/* connect, handshake, and check that the peer drafts. */
static wire_conn *dr_connect(draft_remote *r, char *err, size_t errlen) {
    int fd = wire_connect(r->hostport, DRAFT_REMOTE_CONNECT_MS, err, errlen);
    if (fd < 0) return NULL;
    wire_conn *c = calloc(1, sizeof *c);
    if (!c) { close(fd); snprintf(err, errlen, "out of memory"); return NULL; }
    wire_conn_init(c, fd, DRAFT_REMOTE_CONNECT_MS);
    wire_hello mine = r->hello, peer;
    memset(&peer, 0, sizeof peer);
    char e2[512];
    if (wire_handshake(c, &mine, r->secret, r->secret_len, &peer, e2, sizeof e2)) {
        snprintf(err, errlen, "handshake failed: %s", e2);
    } else if (peer.role != WIRE_ROLE_PREFILL || !(peer.caps & WIRE_CAP_DRAFT)) {
        snprintf(err, errlen, "%s (role %s) has no DRAFT capability (start it with --role prefill --draft-model FILE)",
                 peer.node_id, wire_role_name(peer.role));
    } else {
        c->timeout_ms = r->timeout_ms;
        return c;
    }
    wire_conn_close(c);
    free(c);
    return NULL;
}

static void dr_attempt(draft_remote *r) {
    char err[600];
    pthread_mutex_unlock(&r->mu);
    wire_conn *c = dr_connect(r, err, sizeof err);
    pthread_mutex_lock(&r->mu);
    if (c && !r->stop) {
        r->ready = c;
        r->st.connects++;
        r->backoff_ms = DRAFT_REMOTE_BACKOFF_MIN_MS;
        log_info(NULL, "draft node %s connected", r->hostport);
        return;
    }
    if (c) { wire_conn_close(c); free(c); return; }
    /* one line per outage, not per attempt */
    if (r->backoff_ms == DRAFT_REMOTE_BACKOFF_MIN_MS)
        log_warn(NULL, "draft node %s: %s (decoding without its drafts; retrying with backoff)", r->hostport, err);
    r->next_try = gen_now_ms() + r->backoff_ms;
    r->backoff_ms = r->backoff_ms * 2 > DRAFT_REMOTE_BACKOFF_MAX_MS ? DRAFT_REMOTE_BACKOFF_MAX_MS : r->backoff_ms * 2;
}

static void *dr_main(void *arg) {
    draft_remote *r = arg;
    pthread_mutex_lock(&r->mu);
    while (!r->stop) {
        double wait = r->next_try - gen_now_ms();
        if (!r->need || r->ready) dr_wait(r, DRAFT_REMOTE_TICK_MS);
        else if (wait > 0) dr_wait(r, wait < DRAFT_REMOTE_TICK_MS ? (int)wait + 1 : DRAFT_REMOTE_TICK_MS);
        else dr_attempt(r);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

/* ==== Set-up ==== */

int draft_remote_create(draft_remote **out, model *target, const draft_remote_opts *o, char *err, size_t errlen) {
    *out = NULL;
    if (!o->secret || o->secret_len < 32) {
        snprintf(err, errlen, "--draft-node needs the nodes' shared secret (--secret-file, at least 32 bytes)");
        return -1;
    }
    draft_remote *r = calloc(1, sizeof *r);
    if (!r) { snprintf(err, errlen, "out of memory"); return -1; }
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->n_slots = o->n_slots;
    r->n_vocab = (uint32_t)model_get_hparams(target)->n_vocab;
    r->timeout_ms = o->timeout_ms > 0 ? o->timeout_ms : DRAFT_REMOTE_TIMEOUT_MS;
    r->need = 1;
    r->backoff_ms = DRAFT_REMOTE_BACKOFF_MIN_MS;
    r->hostport = strdup(o->hostport);
    r->secret = malloc(o->secret_len);
    r->secret_len = o->secret_len;
    r->seqs = calloc((size_t)(o->n_slots > 0 ? o->n_slots : 1), sizeof *r->seqs);
    if (!r->hostport || !r->secret || !r->seqs) { draft_remote_free(r); snprintf(err, errlen, "out of memory"); return -1; }
    memcpy(r->secret, o->secret, o->secret_len);
    if (handoff_hello_init(&r->hello, target, o->kv_dtype, WIRE_ROLE_DECODE, o->node_id, err, errlen)) {
        draft_remote_free(r);
        return -1;
    }
    r->hello.caps |= WIRE_CAP_DRAFT;
    if (pthread_create(&r->th, NULL, dr_main, r)) {
        draft_remote_free(r);
        snprintf(err, errlen, "cannot start the draft node's connector thread");
        return -1;
    }
    r->th_started = 1;
    *out = r;
    return 0;
}

void draft_remote_free(draft_remote *r) {
    if (!r) return;
    if (r->th_started) {
        pthread_mutex_lock(&r->mu);
        r->stop = 1;
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
        pthread_join(r->th, NULL);
    }
    wire_conn *cs[2] = { r->conn, r->ready };
    for (int i = 0; i < 2; i++)
        if (cs[i]) { wire_conn_close(cs[i]); free(cs[i]); }
    for (int i = 0; r->seqs && i < r->n_slots; i++) free(r->seqs[i].tok);
    free(r->seqs);
    free(r->hostport);
    if (r->secret) memset(r->secret, 0, r->secret_len);
    free(r->secret);
    wire_buf_free(&r->fb);
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

void draft_remote_get_stats(draft_remote *r, draft_remote_stats *st) {
    pthread_mutex_lock(&r->mu);
    *st = r->st;
    pthread_mutex_unlock(&r->mu);
}

void draft_remote_stats_json(json_t *o, draft_remote *r) {
    if (!r) return;
    draft_remote_stats st;
    draft_remote_get_stats(r, &st);
    json_t *d = json_object();
    json_object_set_new(d, "address", json_string(r->hostport));
    json_object_set_new(d, "connected", json_boolean(st.connected));
    json_object_set_new(d, "connects", json_integer((json_int_t)st.connects));
    json_object_set_new(d, "exchanges", json_integer((json_int_t)st.exchanges));
    json_object_set_new(d, "late", json_integer((json_int_t)st.late));
    json_object_set_new(d, "failures", json_integer((json_int_t)st.failures));
    json_object_set_new(d, "ahead_sent", json_integer((json_int_t)st.ahead_sent));
    json_object_set_new(d, "ahead_used", json_integer((json_int_t)st.ahead_used));
    json_object_set_new(d, "ahead_missed", json_integer((json_int_t)st.ahead_missed));
    json_object_set_new(o, "draft_node", d);
}

/* ==== Connection, as the scheduler sees it ==== */

static void dr_drop(draft_remote *r, const char *why) {
    log_warn(NULL, "draft node %s: %s (decoding without its drafts; reconnecting)", r->hostport, why);
    wire_conn_close(r->conn);
    free(r->conn);
    r->conn = NULL;
    r->late = 0;
    r->nq = 0;
    pthread_mutex_lock(&r->mu);
    r->need = 1;
    r->st.failures++;
    r->st.connected = 0;
    r->next_try = gen_now_ms() + r->backoff_ms;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

/* 1 with a connection to use (a fresh one starts every sequence afresh). */
static int dr_take(draft_remote *r) {
    if (r->conn) return 1;
    pthread_mutex_lock(&r->mu);
    if (r->ready) {
        r->conn = r->ready;
        r->ready = NULL;
        r->need = 0;
        r->st.connected = 1;
    }
    pthread_mutex_unlock(&r->mu);
    if (!r->conn) return 0;
    for (int i = 0; i < r->n_slots; i++) {
        r->seqs[i].n = r->seqs[i].full_at = 0;
        r->seqs[i].ahead_ex = 0;
    }
    r->late = 0;
    r->nq = 0;
    return 1;
}

/* A frame within ms: 1 (in *h), 0 none yet, -1 failed (err). */
static int dr_recv(draft_remote *r, int ms, wire_header *h, char *err, size_t errlen) {
    struct pollfd p = { .fd = r->conn->fd, .events = POLLIN };
    double until = gen_now_ms() + ms;
    for (;;) {
        int left = (int)(until - gen_now_ms());
        int pr = poll(&p, 1, left > 0 ? left : 0);
        if (pr > 0) break;
        if (pr == 0) return 0;
        if (errno != EINTR) { snprintf(err, errlen, "poll: %s", strerror(errno)); return -1; }
    }
    return wire_recv(r->conn, h, err, errlen) ? -1 : 1;
}

/* An answer past its deadline: this step goes without drafts, and no DRAFT
 * is sent until it has come. */
static void dr_count_late(draft_remote *r) {
    r->late = 1;
    pthread_mutex_lock(&r->mu);
    r->st.late++;
    pthread_mutex_unlock(&r->mu);
}

/* ==== Exchanges ==== */

static int dr_seq_room(dr_seq *s, int n) {
    if (n <= s->cap) return 0;
    int cap = s->cap ? s->cap : 256;
    while (cap < n) cap *= 2;
    int32_t *p = realloc(s->tok, sizeof(int32_t) * (size_t)cap);
    if (!p) return -1;
    s->tok = p;
    s->cap = cap;
    return 0;
}

/* What the draft node will hold of s: hist[0, n) (hist[0, c) held already). */
static int dr_seq_hold(dr_seq *s, const int32_t *hist, int c, int n) {
    if (dr_seq_room(s, n)) return -1;
    memcpy(s->tok + c, hist + c, sizeof(int32_t) * (size_t)(n - c));
    s->n = n;
    return 0;
}

static int dr_common(const dr_seq *s, const int32_t *hist, int n) {
    int c = 0;
    while (c < s->n && c < n && s->tok[c] == hist[c]) c++;
    return c;
}

/* One entry of the DRAFT being built (x, the last of the queue): seq holds
 * s->tok[0, s->n) after it, of which c are kept. */
static int dr_entry(draft_remote *r, dr_out *x, int slot, int c, uint32_t k, int a) {
    dr_seq *s = &r->seqs[slot];
    if (wire_draft_add_ask(&r->fb, (uint32_t)slot, (uint32_t)c, k, (uint32_t)(s->n - c), s->tok + c)) return -1;
    uint32_t i = x->n++;
    x->ask_of[i] = a;
    x->seq[i] = (uint32_t)slot;
    x->k[i] = k;
    x->keep[i] = (uint32_t)c;
    x->len[i] = (uint32_t)s->n;
    return 0;
}

/* One ask's entry in a fresh DRAFT (0, 1 added, -1 out of memory). */
static int dr_add(draft_remote *r, dr_out *x, draft_ask *q, int a) {
    if (q->n_out > 0 || q->k <= 0 || q->n < 1 || q->slot < 0 || q->slot >= r->n_slots) return 0;
    dr_seq *s = &r->seqs[q->slot];
    int c = dr_common(s, q->hist, q->n);
    if (c < s->n) s->full_at = 0;                 /* another request on the slot, or rejected drafts */
    if (s->full_at && q->n >= s->full_at) return 0;
    uint32_t k = q->k > (int)WIRE_DRAFT_MAX_K ? WIRE_DRAFT_MAX_K : (uint32_t)q->k;
    if (dr_seq_hold(s, q->hist, c, q->n)) return -1;
    s->ahead_ex = 0;
    return dr_entry(r, x, q->slot, c, k, a) ? -1 : 1;
}

/* Starts a DRAFT: the frame's count is patched by dr_send. */
static dr_out *dr_begin(draft_remote *r, int ahead) {
    wire_buf_reset(&r->fb);
    if (r->nq >= DRAFT_REMOTE_QUEUE || wire_draft_begin(&r->fb, 1)) return NULL;
    dr_out *x = &r->q[r->nq];
    memset(x, 0, offsetof(dr_out, ask_of));
    x->ahead = ahead;
    x->step = r->steps;
    return x;
}

/* Sends the DRAFT built in r->fb as the queue's next exchange; 0 also when
 * it has no entry (nothing sent); -1: the connection was dropped. */
static int dr_send(draft_remote *r, dr_out *x) {
    char err[600];
    if (!x->n) return 0;
    for (int i = 0; i < 4; i++) r->fb.data[i] = (uint8_t)(x->n >> (8 * i));
    x->ex = ++r->exchange;
    x->sent_ms = gen_now_ms();
    if (wire_send(r->conn, WIRE_DRAFT, x->ex, 0, r->fb.data, r->fb.len, err, sizeof err)) {
        dr_drop(r, err);
        return -1;
    }
    r->nq++;
    return 0;
}

/* Checks the DRAFTS in conn->rx against the queue's oldest exchange and
 * applies it: statuses to the histories held; a fresh exchange's drafts to
 * asks when it is this step's (else they are dropped), a look-ahead's to
 * its sequences' ahead buffers. 0, or -1 with why. */
static int dr_apply(draft_remote *r, const wire_header *h, draft_ask *asks, char *err, size_t errlen) {
    const dr_out *x = &r->q[0];
    if (h->type == WIRE_ERROR) {
        wire_error we = { 0 };
        if (wire_decode_error(r->conn->rx.data, r->conn->rx.len, &we, err, errlen) == 0)
            snprintf(err, errlen, "it sent ERROR %s: %s", wire_err_name(we.code), we.message);
        return -1;
    }
    uint32_t n_seq = 0;
    if (h->type != WIRE_DRAFTS || h->req_id != x->ex) {
        snprintf(err, errlen, "unexpected %s frame for exchange %llu (waiting for DRAFTS of %llu)",
                 wire_type_name(h->type), (unsigned long long)h->req_id, (unsigned long long)x->ex);
        return -1;
    }
    if (wire_draft_decode_reply(r->conn->rx.data, r->conn->rx.len, r->n_vocab, r->rep, &n_seq, err, errlen)) return -1;
    if (n_seq != x->n) { snprintf(err, errlen, "DRAFTS for %u sequences, %u asked", n_seq, x->n); return -1; }
    for (uint32_t i = 0; i < n_seq; i++)
        if (r->rep[i].seq != x->seq[i] || r->rep[i].n > x->k[i]) {
            snprintf(err, errlen, "DRAFTS entry %u: sequence %u with %u drafts (asked: sequence %u, at most %u)", i,
                     r->rep[i].seq, r->rep[i].n, x->seq[i], x->k[i]);
            return -1;
        }
    int mine = asks && !x->ahead && x->step == r->steps;
    for (uint32_t i = 0; i < n_seq; i++) {
        dr_seq *s = &r->seqs[x->seq[i]];
        const wire_draft_reply *p = &r->rep[i];
        if (p->status == WIRE_DRAFT_UNKNOWN) s->n = 0;
        if (p->status == WIRE_DRAFT_FULL) {
            if (s->n > (int)x->keep[i]) s->n = (int)x->keep[i];
            s->full_at = (int)x->len[i];
        }
        if (x->ahead && s->ahead_ex == x->ex) {
            for (uint32_t t = 0; t < p->n; t++) s->ahead[t] = (int32_t)wire_draft_token(p->tokens, t);
            s->n_ahead = (int)p->n;
            s->ahead_in = 1;
        }
        if (!mine) continue;
        draft_ask *q = &asks[x->ask_of[i]];
        for (uint32_t t = 0; t < p->n; t++) q->out[t] = (int32_t)wire_draft_token(p->tokens, t);
        q->n_out = (int)p->n;
    }
    return 0;
}

/* Reads answers until the queue is empty or `until` (gen_now_ms) passes:
 * 0 empty, 1 still waiting, -1 the connection was dropped (a failure, a bad
 * answer, or an answer missing DRAFT_REMOTE_DEAD_MS past its deadline). */
static int dr_drain(draft_remote *r, double until, draft_ask *asks) {
    char err[600];
    while (r->nq) {
        wire_header h;
        int left = (int)(until - gen_now_ms());
        int rc = dr_recv(r, left > 0 ? left : 0, &h, err, sizeof err);
        if (rc == 0) {
            if (gen_now_ms() - r->q[0].sent_ms < r->timeout_ms + DRAFT_REMOTE_DEAD_MS) return 1;
            snprintf(err, sizeof err, "no answer for %d ms", r->timeout_ms + DRAFT_REMOTE_DEAD_MS);
        }
        if (rc <= 0 || dr_apply(r, &h, asks, err, sizeof err)) { dr_drop(r, err); return -1; }
        memmove(&r->q[0], &r->q[1], sizeof r->q[0] * (size_t)(--r->nq));
    }
    r->late = 0;
    return 0;
}

/* Asks the look-ahead answered for: the history sent with it (the step's
 * drafts included) and then the draft node's guess of the target's token
 * after them; its drafts after the guess are this step's. */
static void dr_use_ahead(draft_remote *r, draft_ask *asks, int n_asks) {
    uint64_t used = 0, missed = 0;
    for (int a = 0; a < n_asks; a++) {
        draft_ask *q = &asks[a];
        if (q->n_out > 0 || q->k <= 0 || q->slot < 0 || q->slot >= r->n_slots) continue;
        dr_seq *s = &r->seqs[q->slot];
        if (!s->ahead_ex) continue;
        int hit = s->ahead_in && s->n_ahead > 1 && s->n == s->ahead_len && q->n == s->ahead_len + 1 &&
                  q->hist[s->ahead_len] == s->ahead[0] && dr_common(s, q->hist, q->n) == s->ahead_len;
        s->ahead_ex = 0;
        if (!hit) { missed++; continue; }
        int m = s->n_ahead - 1 < q->k ? s->n_ahead - 1 : q->k;
        memcpy(q->out, s->ahead + 1, sizeof(int32_t) * (size_t)m);
        q->n_out = m;
        used++;
        r->ex_drafts += m;
    }
    pthread_mutex_lock(&r->mu);
    r->st.ahead_used += used;
    r->st.ahead_missed += missed;
    pthread_mutex_unlock(&r->mu);
}

/* After the step's drafts are in: one DRAFT asking, for every sequence that
 * got drafts from the draft node, the drafts after them as if all are
 * accepted: its history and drafts, and one more draft (the guess of the
 * target's own token after the last draft). The draft node computes while
 * the target verifies; the next step uses the answer when the guess was
 * right. */
static void dr_send_ahead(draft_remote *r, draft_ask *asks, int n_asks, const uint8_t *mine) {
    dr_out *x = dr_begin(r, 1);
    if (!x) return;
    for (int a = 0; a < n_asks && x->n < WIRE_DRAFT_MAX_SEQ; a++) {
        draft_ask *q = &asks[a];
        if (!mine[a] || q->n_out <= 0 || q->slot < 0 || q->slot >= r->n_slots) continue;
        dr_seq *s = &r->seqs[q->slot];
        int len = q->n + q->n_out;
        if (s->full_at || len >= (1 << 20)) continue;
        int c = dr_common(s, q->hist, q->n);
        if (dr_seq_hold(s, q->hist, c, q->n) || dr_seq_room(s, len)) { dr_drop(r, "out of memory for a DRAFT frame"); return; }
        memcpy(s->tok + q->n, q->out, sizeof(int32_t) * (size_t)q->n_out);
        s->n = len;
        uint32_t k = q->k + 1 > (int)WIRE_DRAFT_MAX_K ? WIRE_DRAFT_MAX_K : (uint32_t)q->k + 1;
        if (dr_entry(r, x, q->slot, c, k, a)) { dr_drop(r, "out of memory for a DRAFT frame"); return; }
        s->ahead_ex = r->exchange + 1;
        s->ahead_len = len;
        s->ahead_in = 0;
        s->n_ahead = 0;
    }
    if (dr_send(r, x) || !x->n) return;
    pthread_mutex_lock(&r->mu);
    r->st.ahead_sent++;
    pthread_mutex_unlock(&r->mu);
}

static void dr_exchange(draft_remote *r, draft_ask *asks, int n_asks) {
    if (!dr_take(r)) return;
    r->steps++;
    /* an answer past its deadline: read it if it came, else no drafts yet */
    if (r->late && dr_drain(r, gen_now_ms(), NULL)) return;
    double until = gen_now_ms() + r->timeout_ms;
    int rc = dr_drain(r, until, NULL);       /* the look-ahead sent last step */
    if (rc < 0) return;
    if (rc > 0) { dr_count_late(r); return; }
    uint8_t mine[WIRE_DRAFT_MAX_SEQ + 1];
    memset(mine, 0, sizeof mine);
    for (int a = 0; a < n_asks && a < (int)WIRE_DRAFT_MAX_SEQ; a++) mine[a] = asks[a].n_out == 0;
    dr_use_ahead(r, asks, n_asks);
    dr_out *x = dr_begin(r, 0);
    if (!x) { dr_drop(r, "out of memory for a DRAFT frame"); return; }
    for (int a = 0; a < n_asks && a < (int)WIRE_DRAFT_MAX_SEQ && x->n < WIRE_DRAFT_MAX_SEQ; a++)
        if (dr_add(r, x, &asks[a], a) < 0) { dr_drop(r, "out of memory for a DRAFT frame"); return; }
    for (uint32_t i = 0; i < x->n; i++) r->ex_drafts += (int)x->k[i];
    int fresh = x->n > 0;
    if (dr_send(r, x)) return;
    if (fresh) {
        pthread_mutex_lock(&r->mu);
        r->st.exchanges++;
        pthread_mutex_unlock(&r->mu);
        rc = dr_drain(r, until, asks);
        if (rc < 0) return;
        if (rc > 0) { dr_count_late(r); return; }
    }
    dr_send_ahead(r, asks, n_asks < (int)WIRE_DRAFT_MAX_SEQ ? n_asks : (int)WIRE_DRAFT_MAX_SEQ, mine);
}

/* ==== What a draft costs ==== */

double draft_remote_cost(draft_remote *r, double prior) {
    double now = gen_now_ms(), dt = r->last_step > 0 ? now - r->last_step : -1;
    r->last_step = now;
    double plain = dt - r->ex_ms;
    if (dt > 0 && plain > 0 && (r->plain_ms <= 0 || plain < DRAFT_REMOTE_IDLE_X * r->plain_ms))
        r->plain_ms = r->plain_ms > 0 ? r->plain_ms + DRAFT_REMOTE_EWMA * (plain - r->plain_ms) : plain;
    if (r->ex_drafts > 0) {
        double pd = r->ex_ms / r->ex_drafts;
        r->per_draft_ms = r->per_draft_ms > 0 ? r->per_draft_ms + DRAFT_REMOTE_EWMA * (pd - r->per_draft_ms) : pd;
    }
    r->ex_ms = 0;
    r->ex_drafts = 0;
    return r->plain_ms > 0 && r->per_draft_ms > 0 ? r->per_draft_ms / r->plain_ms : prior;
}

void draft_remote_propose(draft_remote *r, draft_ask *asks, int n_asks) {
    double t0 = gen_now_ms();
    dr_exchange(r, asks, n_asks);
    r->ex_ms += gen_now_ms() - t0;
}
