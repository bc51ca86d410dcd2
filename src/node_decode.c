/* node_decode.c - the decode node's HTTP server (see node_decode.h).
 *
 * Threading: libmicrohttpd runs one thread per connection. Requests are
 * parsed and tokenized on their own thread, then wait for the generation
 * slot (one generation at a time: the model's scratch and thread pool are
 * shared). Whoever holds the slot owns the sessions, the prefill-node
 * connections and the logits buffer. A streamed response keeps the slot
 * until MHD destroys the response (end of stream or client gone): the
 * content reader produces one token per call, so a client that disconnects
 * stops its generation at the next token.
 */
#include "node_decode.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>
#include <microhttpd.h>

#include "cli.h"
#include "generate.h"
#include "gguf.h"
#include "handoff.h"
#include "sampler.h"
#include "tokenizer.h"

/* ==== Constants ==== */

#define DN_MAX_STOP 8              /* stop strings per request */
#define DN_MAX_STOP_LEN 256        /* bytes per stop string */
#define DN_MAX_PEERS 16            /* cached prefill-node connections (configured + overrides) */
#define DN_EMA_ALPHA 0.25          /* moving averages: recent requests dominate, one outlier fades in ~8 */
#define DN_STALE_RETRY_MS 1000.0   /* a reused connection failing faster than this was probably closed idle */
#define DN_MAX_TOKENS_LIMIT 1000000
#define DN_STREAM_BLOCK 4096       /* MHD's buffer for streamed responses */
#define DN_MAX_MESSAGES 1024      /* chat messages per request */
#define DN_MIN_REUSE 32            /* shared tokens worth truncating another session's cache for */

enum { DN_PF_AUTO = 0, DN_PF_REMOTE, DN_PF_LOCAL };

/* ==== Small helpers ==== */

typedef struct { char *p; size_t len, cap; } dn_str;

static int dn_str_add(dn_str *s, const void *d, size_t n) {
    if (s->len + n + 1 > s->cap) {
        size_t cap = s->cap ? s->cap : 256;
        while (cap < s->len + n + 1) cap *= 2;
        char *np = realloc(s->p, cap);
        if (!np) return -1;
        s->p = np; s->cap = cap;
    }
    if (n) memcpy(s->p + s->len, d, n);
    s->len += n;
    s->p[s->len] = 0;
    return 0;
}

static void dn_log(const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "tandem decode: %s\n", buf);
}

/* Length of a valid UTF-8 sequence at s (n bytes left), or 0 if invalid. */
static size_t dn_utf8_seq(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    size_t len;
    unsigned cp;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) { len = 2; cp = c & 0x1F; }
    else if (c >= 0xE0 && c <= 0xEF) { len = 3; cp = c & 0x0F; }
    else if (c >= 0xF0 && c <= 0xF4) { len = 4; cp = c & 0x07; }
    else return 0;
    if (n < len) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if ((len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
        return 0;
    return len;
}

/* A JSON string of arbitrary bytes: invalid UTF-8 becomes U+FFFD (a token
 * can end in the middle of a character; JSON cannot carry raw bytes). */
static json_t *dn_json_text(const char *s, size_t n) {
    json_t *j = json_stringn(s, n);
    if (j) return j;
    dn_str t = { 0 };
    for (size_t i = 0; i < n;) {
        size_t l = dn_utf8_seq((const unsigned char *)s + i, n - i);
        if (l) { dn_str_add(&t, s + i, l); i += l; }
        else { dn_str_add(&t, "\xEF\xBF\xBD", 3); i++; }
    }
    j = json_stringn(t.p ? t.p : "", t.len);
    free(t.p);
    return j;
}

/* ==== Node state ==== */

typedef struct {
    session *s;
    int32_t *tokens;             /* ids whose K/V are in the cache: tokens[0..n), n == session_pos */
    int n;
    uint64_t last_used;
} dn_slot;

typedef struct {
    char addr[256];
    handoff_client *c;
    uint64_t last_used;
} dn_peer;

typedef struct {
    uint64_t requests, ok, bad, busy, failed, cancelled;
    uint64_t prompt_tokens, completion_tokens, reused_positions;
    uint64_t remote_prefills, local_prefills, fallbacks;
    uint64_t positions_received, kv_bytes, wire_bytes;
    double prefill_tps_local, prefill_tps_remote, decode_tps, ttft_ms, handoff_gbps;
} dn_stats;

typedef struct {
    model *m;
    const decode_node_opts *o;
    const tokenizer *tok;
    int n_ctx, n_vocab, n_slots, queue_max, min_split, timeout_ms;
    uint32_t kv_dtype, wire_dtype;
    const char *role;
    char desc[512];
    /* generation slot */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int busy, waiting;
    volatile int stopping;
    /* owned by the holder of the generation slot */
    dn_slot *slots;
    uint64_t tick;
    dn_peer peers[DN_MAX_PEERS];
    unsigned rr;
    float *logits;
    /* counters */
    pthread_mutex_t smu;
    dn_stats st;
    int sessions_used;
} dnode;

static void dn_ema(double *avg, double x) {
    if (!(x > 0) || !isfinite(x)) return;
    *avg = *avg > 0 ? (1 - DN_EMA_ALPHA) * *avg + DN_EMA_ALPHA * x : x;
}

/* ==== Generation slot (one generation at a time, bounded queue) ==== */

/* 0: acquired; -1: queue full (503); -2: shutting down. */
static int dn_gen_acquire(dnode *n) {
    pthread_mutex_lock(&n->mu);
    if (n->busy && n->waiting >= n->queue_max) { pthread_mutex_unlock(&n->mu); return -1; }
    n->waiting++;
    while (n->busy && !n->stopping) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 200 * 1000000L;   /* wake now and then to notice shutdown */
        if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
        pthread_cond_timedwait(&n->cv, &n->mu, &ts);
    }
    n->waiting--;
    if (n->stopping) { pthread_mutex_unlock(&n->mu); return -2; }
    n->busy = 1;
    pthread_mutex_unlock(&n->mu);
    return 0;
}

static void dn_gen_release(dnode *n) {
    pthread_mutex_lock(&n->mu);
    n->busy = 0;
    pthread_cond_signal(&n->cv);
    pthread_mutex_unlock(&n->mu);
}

/* ==== Sessions ==== */

static int dn_common_prefix(const int32_t *a, int na, const int32_t *b, int nb) {
    int i = 0;
    while (i < na && i < nb && a[i] == b[i]) i++;
    return i;
}

/* Which session a prompt continues: the one sharing the longest prefix when
 * it shares a useful amount (all of that session's tokens, or at least
 * DN_MIN_REUSE); otherwise an unused slot, else the least recently used
 * one, so that a few shared tokens (a BOS, a chat header) do not cost
 * another conversation its cache. *lcp receives the shared length. */
static dn_slot *dn_slot_pick(dnode *n, const int32_t *ids, int n_ids, int *lcp) {
    dn_slot *best = NULL, *empty = NULL, *lru = NULL;
    int best_l = 0;
    for (int i = 0; i < n->n_slots; i++) {
        dn_slot *sl = &n->slots[i];
        if (!sl->s) { if (!empty) empty = sl; continue; }
        int l = dn_common_prefix(sl->tokens, sl->n, ids, n_ids);
        if (l > best_l) { best_l = l; best = sl; }
        if (!lru || sl->last_used < lru->last_used) lru = sl;
    }
    if (best && (best_l == best->n || best_l >= DN_MIN_REUSE)) { *lcp = best_l; return best; }
    dn_slot *sl = empty ? empty : lru;
    *lcp = sl->s ? dn_common_prefix(sl->tokens, sl->n, ids, n_ids) : 0;
    return sl;
}

static int dn_slot_prepare(dnode *n, dn_slot *sl, char *err, size_t errlen) {
    if (sl->s) return 0;
    if (session_new(&sl->s, n->m, n->n_ctx, n->kv_dtype, err, errlen)) return -1;
    sl->tokens = malloc(sizeof(int32_t) * (size_t)n->n_ctx);
    if (!sl->tokens) { session_free(sl->s); sl->s = NULL; snprintf(err, errlen, "out of memory"); return -1; }
    sl->n = 0;
    pthread_mutex_lock(&n->smu);
    n->sessions_used++;
    pthread_mutex_unlock(&n->smu);
    return 0;
}

/* Keep the token list equal to what the cache holds. */
static void dn_slot_sync(dn_slot *sl, const int32_t *ids, int n_ids) {
    int pos = session_pos(sl->s);
    if (pos > sl->n) {
        int add = pos - sl->n;
        if (add > n_ids) add = n_ids;
        memcpy(sl->tokens + sl->n, ids, sizeof(int32_t) * (size_t)add);
        sl->n += add;
    }
    if (sl->n > pos) sl->n = pos;
}

/* ==== Prefill-node connections ==== */

static dn_peer *dn_peer_get(dnode *n, const char *addr) {
    dn_peer *empty = NULL, *lru = NULL;
    for (int i = 0; i < DN_MAX_PEERS; i++) {
        dn_peer *p = &n->peers[i];
        if (p->addr[0] && !strcmp(p->addr, addr)) return p;
        if (!p->addr[0]) { if (!empty) empty = p; }
        else if (!lru || p->last_used < lru->last_used) lru = p;
    }
    dn_peer *p = empty ? empty : lru;
    handoff_close(p->c);
    memset(p, 0, sizeof *p);
    snprintf(p->addr, sizeof p->addr, "%s", addr);
    return p;
}

static void dn_peers_close(dnode *n) {
    for (int i = 0; i < DN_MAX_PEERS; i++) { handoff_close(n->peers[i].c); n->peers[i].c = NULL; }
}

/* ==== Requests ==== */

typedef struct {
    int32_t *prompt;
    int n_prompt;
    int max_tokens, ignore_eos, stream, mode;
    sampler_params sp;
    char *stop[DN_MAX_STOP];
    int n_stop;
    char node[256];
} dn_req;

static void dn_req_free(dn_req *r) {
    free(r->prompt);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    memset(r, 0, sizeof *r);
}

static int dn_get_bool(json_t *o, const char *k, int *out, char *err, size_t errlen) {
    json_t *v = json_object_get(o, k);
    if (!v) return 0;
    if (!json_is_boolean(v)) { snprintf(err, errlen, "'%s' must be a boolean", k); return -1; }
    *out = json_is_true(v);
    return 0;
}

static int dn_get_int(json_t *o, const char *k, long long lo, long long hi, long long *out, char *err, size_t errlen) {
    json_t *v = json_object_get(o, k);
    if (!v) return 0;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi) {
        snprintf(err, errlen, "'%s' must be an integer in [%lld, %lld]", k, lo, hi);
        return -1;
    }
    *out = json_integer_value(v);
    return 0;
}

static int dn_get_num(json_t *o, const char *k, double lo, double hi, float *out, char *err, size_t errlen) {
    json_t *v = json_object_get(o, k);
    if (!v) return 0;
    double d = json_is_number(v) ? json_number_value(v) : NAN;
    if (!(d >= lo && d <= hi)) { snprintf(err, errlen, "'%s' must be a number in [%g, %g]", k, lo, hi); return -1; }
    *out = (float)d;
    return 0;
}

static int dn_parse_stop(json_t *o, dn_req *r, char *err, size_t errlen) {
    json_t *v = json_object_get(o, "stop");
    if (!v || json_is_null(v)) return 0;
    json_t *one = json_is_string(v) ? v : NULL;
    size_t cnt = one ? 1 : json_is_array(v) ? json_array_size(v) : 0;
    if (!one && !json_is_array(v)) { snprintf(err, errlen, "'stop' must be a string or an array of strings"); return -1; }
    if (cnt > DN_MAX_STOP) { snprintf(err, errlen, "'stop' has more than %d strings", DN_MAX_STOP); return -1; }
    for (size_t i = 0; i < cnt; i++) {
        json_t *s = one ? one : json_array_get(v, i);
        size_t len = json_is_string(s) ? json_string_length(s) : 0;
        if (!json_is_string(s) || len == 0 || len > DN_MAX_STOP_LEN || strlen(json_string_value(s)) != len) {
            snprintf(err, errlen, "'stop' entries must be non-empty strings of at most %d bytes, without NUL", DN_MAX_STOP_LEN);
            return -1;
        }
        if (!(r->stop[r->n_stop] = strndup(json_string_value(s), len))) { snprintf(err, errlen, "out of memory"); return -1; }
        r->n_stop++;
    }
    return 0;
}

/* "messages": [{"role", "content"}...] rendered with the model's chat
 * template (generation prompt appended), then tokenized like a prompt. */
static int dn_parse_messages(dnode *n, json_t *a, dn_req *r, char *err, size_t errlen) {
    size_t cnt = json_is_array(a) ? json_array_size(a) : 0;
    if (cnt == 0 || cnt > DN_MAX_MESSAGES) {
        snprintf(err, errlen, "'messages' must be an array of 1 to %d {\"role\", \"content\"} objects", DN_MAX_MESSAGES);
        return -1;
    }
    chat_msg *msgs = calloc(cnt, sizeof *msgs);
    if (!msgs) { snprintf(err, errlen, "out of memory"); return -1; }
    int rc = -1;
    for (size_t i = 0; i < cnt; i++) {
        json_t *m = json_array_get(a, i), *role = json_object_get(m, "role"), *content = json_object_get(m, "content");
        if (!json_is_string(role) || !json_is_string(content) ||
            strlen(json_string_value(content)) != json_string_length(content)) {
            snprintf(err, errlen, "'messages'[%zu] needs string 'role' and 'content' (no NUL characters)", i);
            goto out;
        }
        msgs[i].role = json_string_value(role);
        msgs[i].content = json_string_value(content);
    }
    enum chat_format fmt = chat_detect(model_get_gguf(n->m), err, errlen);
    if (fmt == CHAT_NONE) goto out;
    char *text = chat_render(fmt, msgs, (int)cnt, 1);
    if (!text) { snprintf(err, errlen, "chat template rendering failed"); goto out; }
    size_t len = strlen(text);
    const tokenizer *tok = n->tok;
    int64_t need = tokenizer_encode(tok, text, len, 1, 1, NULL, 0);
    if (need <= 0 || need > n->n_ctx) {
        snprintf(err, errlen, need <= 0 ? "the messages render to an empty prompt"
                 : "the prompt has %lld tokens but the context holds %d", (long long)need, n->n_ctx);
    } else if (!(r->prompt = malloc(sizeof(int32_t) * (size_t)need)) ||
               tokenizer_encode(tok, text, len, 1, 1, r->prompt, need) != need) {
        snprintf(err, errlen, "tokenization failed");
    } else {
        r->n_prompt = (int)need;
        rc = 0;
    }
    free(text);
out:
    free(msgs);
    return rc;
}

static int dn_parse_prompt(dnode *n, json_t *o, dn_req *r, char *err, size_t errlen) {
    json_t *p = json_object_get(o, "prompt"), *t = json_object_get(o, "tokens"), *ms = json_object_get(o, "messages");
    int chat = 0;
    if (dn_get_bool(o, "chat", &chat, err, errlen)) return -1;
    if (!!p + !!t + !!ms != 1) { snprintf(err, errlen, "give exactly one of 'prompt', 'tokens' and 'messages'"); return -1; }
    if (ms) {
        if (dn_parse_messages(n, ms, r, err, errlen)) return -1;
    } else if (p) {
        if (!json_is_string(p)) { snprintf(err, errlen, "'prompt' must be a string"); return -1; }
        const char *text = json_string_value(p);
        if (strlen(text) != json_string_length(p)) { snprintf(err, errlen, "'prompt' contains a NUL character"); return -1; }
        if (!*text) { snprintf(err, errlen, "'prompt' is empty"); return -1; }
        if (!(r->prompt = cli_tokenize_prompt(n->m, text, chat, &r->n_prompt, err, errlen))) return -1;
    } else {
        size_t cnt = json_is_array(t) ? json_array_size(t) : 0;
        if (!json_is_array(t)) { snprintf(err, errlen, "'tokens' must be an array of token ids"); return -1; }
        if (cnt == 0) { snprintf(err, errlen, "'tokens' is empty"); return -1; }
        if (cnt > (size_t)n->n_ctx) {
            snprintf(err, errlen, "the prompt has %zu tokens but the context holds %d", cnt, n->n_ctx);
            return -1;
        }
        if (!(r->prompt = malloc(sizeof(int32_t) * cnt))) { snprintf(err, errlen, "out of memory"); return -1; }
        for (size_t i = 0; i < cnt; i++) {
            json_t *e = json_array_get(t, i);
            if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) >= n->n_vocab) {
                snprintf(err, errlen, "'tokens'[%zu] must be a token id in [0, %d)", i, n->n_vocab);
                return -1;
            }
            r->prompt[i] = (int32_t)json_integer_value(e);
        }
        r->n_prompt = (int)cnt;
    }
    if (r->n_prompt > n->n_ctx) {
        snprintf(err, errlen, "the prompt has %d tokens but the context holds %d", r->n_prompt, n->n_ctx);
        return -1;
    }
    return 0;
}

static int dn_parse_prefill(dnode *n, json_t *o, dn_req *r, char *err, size_t errlen) {
    json_t *v = json_object_get(o, "prefill"), *nd = json_object_get(o, "prefill_node");
    r->mode = DN_PF_AUTO;
    if (v) {
        const char *s = json_is_string(v) ? json_string_value(v) : "";
        if (!strcmp(s, "auto")) r->mode = DN_PF_AUTO;
        else if (!strcmp(s, "remote")) r->mode = DN_PF_REMOTE;
        else if (!strcmp(s, "local")) r->mode = DN_PF_LOCAL;
        else { snprintf(err, errlen, "'prefill' must be \"auto\", \"remote\" or \"local\""); return -1; }
    }
    if (nd && !json_is_null(nd)) {
        size_t len = json_is_string(nd) ? json_string_length(nd) : 0;
        if (!json_is_string(nd) || len == 0 || len >= sizeof r->node || !strchr(json_string_value(nd), ':')) {
            snprintf(err, errlen, "'prefill_node' must be a \"host:port\" string");
            return -1;
        }
        snprintf(r->node, sizeof r->node, "%s", json_string_value(nd));
    }
    int have_node = r->node[0] || n->o->n_prefill_nodes > 0;
    if (n->o->local_only && (r->mode == DN_PF_REMOTE || r->node[0])) {
        snprintf(err, errlen, "this node runs with --role local and uses no prefill node");
        return -1;
    }
    if (r->mode == DN_PF_REMOTE && !have_node) {
        snprintf(err, errlen, "'prefill' is \"remote\" but no prefill node is configured or given");
        return -1;
    }
    return 0;
}

static int dn_parse_sampling(json_t *o, dn_req *r, char *err, size_t errlen) {
    long long v;
    r->sp = sampler_defaults();
    v = 128;
    if (dn_get_int(o, "max_tokens", 0, DN_MAX_TOKENS_LIMIT, &v, err, errlen)) return -1;
    r->max_tokens = (int)v;
    if (dn_get_num(o, "temperature", 0, 1e6, &r->sp.temp, err, errlen)) return -1;
    v = r->sp.top_k;
    if (dn_get_int(o, "top_k", -1, 1000000000, &v, err, errlen)) return -1;
    r->sp.top_k = (int)v;
    if (dn_get_num(o, "top_p", 0, 1, &r->sp.top_p, err, errlen)) return -1;
    if (dn_get_num(o, "min_p", 0, 1, &r->sp.min_p, err, errlen)) return -1;
    v = 0;
    if (dn_get_int(o, "seed", 0, INT64_MAX, &v, err, errlen)) return -1;
    /* No seed: a fresh one per request, so that unseeded calls differ. */
    r->sp.seed = json_object_get(o, "seed") ? (uint64_t)v : sampler_fresh_seed();
    if (dn_get_bool(o, "ignore_eos", &r->ignore_eos, err, errlen)) return -1;
    if (dn_get_bool(o, "stream", &r->stream, err, errlen)) return -1;
    return 0;
}

/* 0, or -1 with a message for a 400 response. */
static int dn_parse_request(dnode *n, const char *body, size_t len, dn_req *r, char *err, size_t errlen) {
    memset(r, 0, sizeof *r);
    json_error_t je;
    json_t *o = json_loadb(body ? body : "", len, JSON_REJECT_DUPLICATES, &je);
    if (!o) { snprintf(err, errlen, "invalid JSON: %s (line %d, column %d)", je.text, je.line, je.column); return -1; }
    int rc = -1;
    if (!json_is_object(o)) { snprintf(err, errlen, "the request body must be a JSON object"); goto out; }
    if (dn_parse_sampling(o, r, err, errlen) || dn_parse_stop(o, r, err, errlen) ||
        dn_parse_prefill(n, o, r, err, errlen) || dn_parse_prompt(n, o, r, err, errlen))
        goto out;
    rc = 0;
out:
    json_decref(o);
    if (rc) dn_req_free(r);
    return rc;
}

/* ==== Generation jobs ==== */

typedef struct {
    dnode *n;
    dn_req r;
    dn_slot *slot;
    sampler *smp;
    tok_stream ts;
    char *piece;                 /* one token's text */
    size_t piece_cap;
    int32_t *gen;
    int n_gen;
    dn_str text;                 /* everything generated (stop strings, non-stream "text") */
    size_t text_keep;            /* reported text length (cut before a stop string) */
    int need_eval;               /* the last token is not in the cache yet */
    int finished, holds_slot;
    const char *finish;
    char error[512];
    /* prefill report */
    int remote, start_pos, computed_local;
    char node[256], fallback[512];
    handoff_stats hs;
    double t_arrive, t_start, t_first, prefill_ms, queue_ms;
    /* streaming */
    dn_str out;
    size_t out_off;
    int done_sent;
} dn_job;

static double dn_now(void) { return gen_now_ms(); }

static void dn_job_finish(dn_job *j, const char *reason, const char *error) {
    if (j->finished) return;
    j->finished = 1;
    j->finish = reason;
    if (error) snprintf(j->error, sizeof j->error, "%s", error);
}

/* Which prefill node this request uses, or NULL for local prefill. */
static const char *dn_pick_node(dn_job *j) {
    dnode *n = j->n;
    if (n->o->local_only || j->r.mode == DN_PF_LOCAL) return NULL;
    if (j->r.node[0]) return j->r.node;
    if (n->o->n_prefill_nodes == 0) return NULL;
    if (j->r.mode == DN_PF_AUTO && j->r.n_prompt < n->min_split) return NULL;
    return n->o->prefill_nodes[n->rr++ % (unsigned)n->o->n_prefill_nodes];
}

/* Positions [start_pos, n-1) from a prefill node; on failure the session is
 * back at start_pos. One retry when a reused connection fails at once (the
 * prefill node drops idle connections). */
static int dn_remote_prefill(dn_job *j, const char *addr, char *err, size_t errlen) {
    dnode *n = j->n;
    dn_peer *p = dn_peer_get(n, addr);
    p->last_used = ++n->tick;
    handoff_opts ho = { .wire_dtype = n->wire_dtype, .zstd = n->o->zstd, .timeout_ms = n->timeout_ms,
                        .secret = n->o->secret, .secret_len = n->o->secret_len,
                        .node_id = n->o->node_id ? n->o->node_id : "decode" };
    for (int attempt = 0; attempt < 2; attempt++) {
        int fresh = 0;
        if (!p->c) {
            if (handoff_connect(&p->c, addr, n->m, n->kv_dtype, &ho, err, errlen)) { p->c = NULL; return -1; }
            fresh = 1;
        }
        double t0 = dn_now();
        memset(&j->hs, 0, sizeof j->hs);
        if (!handoff_prefill(p->c, j->slot->s, j->r.prompt, j->r.n_prompt, j->start_pos, &j->hs, err, errlen))
            return 0;
        handoff_close(p->c);
        p->c = NULL;
        session_reset(j->slot->s, j->start_pos);
        if (fresh || dn_now() - t0 > DN_STALE_RETRY_MS || n->stopping) return -1;
        dn_log("connection to %s failed at once (%s); reconnecting", addr, err);
    }
    return -1;
}

static void dn_count_prefill(dn_job *j) {
    dnode *n = j->n;
    pthread_mutex_lock(&n->smu);
    n->st.prompt_tokens += (uint64_t)j->r.n_prompt;
    n->st.reused_positions += (uint64_t)j->start_pos;
    if (j->remote) {
        n->st.remote_prefills++;
        n->st.positions_received += (uint64_t)j->hs.n_sent;
        n->st.kv_bytes += j->hs.kv_bytes;
        n->st.wire_bytes += j->hs.wire_bytes;
        if (j->hs.prefill_ms_remote > 0)
            dn_ema(&n->st.prefill_tps_remote, j->hs.n_computed_remote * 1e3 / j->hs.prefill_ms_remote);
        if (j->hs.total_ms > 0) dn_ema(&n->st.handoff_gbps, j->hs.wire_bytes / (j->hs.total_ms * 1e6));
    } else {
        n->st.local_prefills++;
        /* a one-token "prefill" measures decode speed, not prefill speed */
        if (j->computed_local >= 8 && j->prefill_ms > 0)
            dn_ema(&n->st.prefill_tps_local, j->computed_local * 1e3 / j->prefill_ms);
    }
    if (j->fallback[0]) n->st.fallbacks++;
    pthread_mutex_unlock(&n->smu);
}

/* Picks the session, prefills the prompt (remote if chosen, falling back to
 * local), and leaves the last prompt position's logits in n->logits. */
static int dn_job_prefill(dn_job *j, char *err, size_t errlen) {
    dnode *n = j->n;
    int lcp;
    j->slot = dn_slot_pick(n, j->r.prompt, j->r.n_prompt, &lcp);
    if (dn_slot_prepare(n, j->slot, err, errlen)) return -1;
    j->slot->last_used = ++n->tick;
    session *s = j->slot->s;
    /* the last prompt token is always evaluated here: its logits pick token 1 */
    j->start_pos = lcp < j->r.n_prompt - 1 ? lcp : j->r.n_prompt - 1;
    session_reset(s, j->start_pos);
    j->slot->n = j->start_pos;
    j->t_start = dn_now();
    const char *addr = dn_pick_node(j);
    if (addr && j->start_pos < j->r.n_prompt - 1) {
        snprintf(j->node, sizeof j->node, "%s", addr);
        char herr[512];
        if (!dn_remote_prefill(j, addr, herr, sizeof herr)) {
            j->remote = 1;
        } else {
            snprintf(j->fallback, sizeof j->fallback, "%s", herr);
            dn_log("remote prefill on %s failed, prefilling locally: %s", addr, herr);
            session_reset(s, j->start_pos);
        }
        dn_slot_sync(j->slot, j->r.prompt + j->slot->n, j->r.n_prompt - j->slot->n);
    }
    int pos = session_pos(s);
    j->computed_local = j->r.n_prompt - pos;
    if (model_eval(n->m, s, j->r.prompt + pos, j->r.n_prompt - pos, n->logits, NULL, NULL, err, errlen)) {
        session_reset(s, j->slot->n);
        return -1;
    }
    dn_slot_sync(j->slot, j->r.prompt + j->slot->n, j->r.n_prompt - j->slot->n);
    j->prefill_ms = dn_now() - j->t_start;
    dn_count_prefill(j);
    return 0;
}

/* Appends the token's text and checks the stop strings. */
static void dn_job_text(dn_job *j, int32_t id, size_t *piece_len) {
    int w = tok_stream_push(&j->ts, id, j->piece, j->piece_cap);
    *piece_len = w > 0 ? (size_t)w : 0;
    size_t old = j->text.len;
    dn_str_add(&j->text, j->piece, *piece_len);
    j->text_keep = j->text.len;
    for (int i = 0; i < j->r.n_stop; i++) {
        size_t sl = strlen(j->r.stop[i]);
        size_t from = old + 1 > sl ? old + 1 - sl : 0;   /* a match must end in the new bytes */
        char *hit = j->text.len >= sl ? memmem(j->text.p + from, j->text.len - from, j->r.stop[i], sl) : NULL;
        if (hit && (size_t)(hit - j->text.p) < j->text_keep) {
            j->text_keep = (size_t)(hit - j->text.p);
            dn_job_finish(j, "stop", NULL);
        }
    }
}

/* One token: evaluates the previous one if needed, samples the next.
 * Returns 1 with j->gen[j->n_gen - 1] new (j->finished may be set too), or
 * 0 when generation is over. Mirrors generate_run's order exactly. */
static int dn_job_step(dn_job *j, size_t *piece_len) {
    dnode *n = j->n;
    if (j->finished) return 0;
    if (n->stopping) { dn_job_finish(j, "error", "the server is shutting down"); return 0; }
    dn_slot *sl = j->slot;
    if (j->need_eval) {
        int32_t id = j->gen[j->n_gen - 1];
        char err[512];
        if (session_pos(sl->s) >= n->n_ctx) { dn_job_finish(j, "length", NULL); return 0; }
        if (model_eval(n->m, sl->s, &id, 1, n->logits, NULL, NULL, err, sizeof err)) {
            session_reset(sl->s, sl->n);
            dn_job_finish(j, "error", err);
            return 0;
        }
        dn_slot_sync(sl, &id, 1);
        j->need_eval = 0;
    }
    if (j->n_gen >= j->r.max_tokens) { dn_job_finish(j, "length", NULL); return 0; }
    int32_t id = sampler_sample(j->smp, n->logits);
    if (!j->r.ignore_eos && tokenizer_is_eog(n->tok, id)) { dn_job_finish(j, "stop", NULL); return 0; }
    j->gen[j->n_gen++] = id;
    if (j->n_gen == 1) j->t_first = dn_now();
    j->need_eval = 1;
    dn_job_text(j, id, piece_len);
    if (j->n_gen >= j->r.max_tokens) dn_job_finish(j, "length", NULL);
    return 1;
}

static dn_job *dn_job_new(dnode *n, dn_req *r, double t_arrive) {
    dn_job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->n = n;
    j->r = *r;
    memset(r, 0, sizeof *r);
    j->t_arrive = t_arrive;
    j->piece_cap = tokenizer_max_token_bytes(n->tok) + 16;
    int cap = j->r.max_tokens < n->n_ctx ? j->r.max_tokens : n->n_ctx;
    j->piece = malloc(j->piece_cap);
    j->gen = malloc(sizeof(int32_t) * (size_t)(cap + 1));
    j->smp = sampler_new(&j->r.sp, n->n_vocab);
    if (!j->piece || !j->gen || !j->smp) {
        free(j->piece); free(j->gen); sampler_free(j->smp); dn_req_free(&j->r); free(j);
        return NULL;
    }
    if (j->r.max_tokens > cap) j->r.max_tokens = cap;   /* the context ends generation anyway */
    tok_stream_init_prompt(&j->ts, n->tok, j->r.prompt, j->r.n_prompt);
    return j;
}

/* Releases the generation slot, counts the outcome, frees the job. */
static void dn_job_free(dn_job *j) {
    if (!j) return;
    dnode *n = j->n;
    if (j->holds_slot) {
        int cancelled = !j->finished;
        if (cancelled) dn_log("client went away after %d tokens; generation stopped", j->n_gen);
        double gen_ms = j->n_gen > 1 ? dn_now() - j->t_first : 0;
        pthread_mutex_lock(&n->smu);
        n->st.completion_tokens += (uint64_t)j->n_gen;
        if (cancelled) n->st.cancelled++;
        else if (j->finish && !strcmp(j->finish, "error")) n->st.failed++;
        else n->st.ok++;
        if (j->n_gen > 1 && gen_ms > 0) dn_ema(&n->st.decode_tps, (j->n_gen - 1) * 1e3 / gen_ms);
        if (j->n_gen > 0) dn_ema(&n->st.ttft_ms, j->t_first - j->t_arrive);
        pthread_mutex_unlock(&n->smu);
        dn_gen_release(n);
    }
    sampler_free(j->smp);
    free(j->piece);
    free(j->gen);
    free(j->text.p);
    free(j->out.p);
    dn_req_free(&j->r);
    free(j);
}

/* ==== Result JSON ==== */

static json_t *dn_prefill_json(dn_job *j) {
    json_t *p = json_object();
    json_object_set_new(p, "mode", json_string(j->remote ? "remote" : "local"));
    if (j->node[0]) json_object_set_new(p, "node", json_string(j->node));
    if (j->fallback[0]) json_object_set_new(p, "fallback_reason", dn_json_text(j->fallback, strlen(j->fallback)));
    json_object_set_new(p, "start_pos", json_integer(j->start_pos));
    json_object_set_new(p, "positions_received", json_integer(j->remote ? j->hs.n_sent : 0));
    json_object_set_new(p, "computed_remote", json_integer(j->remote ? j->hs.n_computed_remote : 0));
    json_object_set_new(p, "computed_local", json_integer(j->computed_local));
    json_object_set_new(p, "kv_bytes", json_integer(j->remote ? (json_int_t)j->hs.kv_bytes : 0));
    json_object_set_new(p, "wire_bytes", json_integer(j->remote ? (json_int_t)j->hs.wire_bytes : 0));
    json_object_set_new(p, "prefill_ms", json_real(j->prefill_ms));
    if (j->remote) {
        json_object_set_new(p, "remote_prefill_ms", json_real(j->hs.prefill_ms_remote));
        json_object_set_new(p, "handoff_ms", json_real(j->hs.total_ms));
        json_object_set_new(p, "transfer_tail_ms", json_real(j->hs.transfer_tail_ms));
    }
    json_object_set_new(p, "queue_ms", json_real(j->queue_ms));
    json_object_set_new(p, "ttft_ms", json_real(j->n_gen > 0 ? j->t_first - j->t_arrive : 0.0));
    return p;
}

/* Fields shared by the final stream line and the non-stream body. */
static void dn_result_fields(dn_job *j, json_t *o) {
    json_object_set_new(o, "finish_reason", json_string(j->finish ? j->finish : "stop"));
    json_t *u = json_object();
    json_object_set_new(u, "prompt_tokens", json_integer(j->r.n_prompt));
    json_object_set_new(u, "completion_tokens", json_integer(j->n_gen));
    json_object_set_new(o, "usage", u);
    json_object_set_new(o, "prefill", dn_prefill_json(j));
    if (j->n_gen > 1) {
        double ms = dn_now() - j->t_first;
        json_object_set_new(o, "decode_tps", json_real(ms > 0 ? (j->n_gen - 1) * 1e3 / ms : 0.0));
    }
    if (j->error[0]) json_object_set_new(o, "error", dn_json_text(j->error, strlen(j->error)));
}

static void dn_flush_text(dn_job *j, dn_str *tail) {
    char buf[32];
    int w = tok_stream_flush(&j->ts, buf, sizeof buf);
    if (w > 0) {
        if (j->text_keep == j->text.len) { dn_str_add(&j->text, buf, (size_t)w); j->text_keep = j->text.len; }
        if (tail) dn_str_add(tail, buf, (size_t)w);
    }
}

static char *dn_dump(json_t *o, size_t *len) {
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (s && len) *len = strlen(s);
    return s;
}

/* ==== HTTP responses ==== */

static enum MHD_Result dn_send_body(struct MHD_Connection *c, unsigned status, char *body, size_t len,
                                    const char *ctype) {
    if (!body) {
        static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\"}}";
        struct MHD_Response *r = MHD_create_response_from_buffer(sizeof oom - 1, (void *)oom, MHD_RESPMEM_PERSISTENT);
        if (!r) return MHD_NO;
        MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
        enum MHD_Result rc = MHD_queue_response(c, MHD_HTTP_INTERNAL_SERVER_ERROR, r);
        MHD_destroy_response(r);
        return rc;
    }
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (!r) { free(body); return MHD_NO; }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    enum MHD_Result rc = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return rc;
}

static enum MHD_Result dn_send_json(struct MHD_Connection *c, unsigned status, json_t *o) {
    size_t len = 0;
    char *s = dn_dump(o, &len);
    return dn_send_body(c, status, s, len, "application/json");
}

static enum MHD_Result dn_send_error(dnode *n, struct MHD_Connection *c, unsigned status, const char *type,
                                     const char *msg) {
    pthread_mutex_lock(&n->smu);
    if (status == 503) n->st.busy++;
    else if (status >= 400 && status < 500) n->st.bad++;
    else n->st.failed++;
    pthread_mutex_unlock(&n->smu);
    json_t *e = json_object();
    json_object_set_new(e, "message", dn_json_text(msg, strlen(msg)));
    json_object_set_new(e, "type", json_string(type));
    json_t *o = json_object();
    json_object_set_new(o, "error", e);
    return dn_send_json(c, status, o);
}

/* ==== Endpoints ==== */

static enum MHD_Result dn_handle_health(dnode *n, struct MHD_Connection *c) {
    json_t *o = json_object();
    json_object_set_new(o, "status", json_string(n->stopping ? "stopping" : "ok"));
    json_object_set_new(o, "model", dn_json_text(n->desc, strlen(n->desc)));
    json_object_set_new(o, "role", json_string(n->role));
    json_object_set_new(o, "n_ctx", json_integer(n->n_ctx));
    json_t *a = json_array();
    for (int i = 0; i < n->o->n_prefill_nodes; i++) json_array_append_new(a, json_string(n->o->prefill_nodes[i]));
    json_object_set_new(o, "prefill_nodes", a);
    return dn_send_json(c, 200, o);
}

static enum MHD_Result dn_handle_stats(dnode *n, struct MHD_Connection *c) {
    dn_stats s;
    int busy, waiting, used;
    pthread_mutex_lock(&n->smu);
    s = n->st;
    used = n->sessions_used;
    pthread_mutex_unlock(&n->smu);
    pthread_mutex_lock(&n->mu);
    busy = n->busy;
    waiting = n->waiting;
    pthread_mutex_unlock(&n->mu);
    json_t *o = json_object();
    json_object_set_new(o, "role", json_string(n->role));
    json_object_set_new(o, "model", dn_json_text(n->desc, strlen(n->desc)));
    struct { const char *k; uint64_t v; } cnt[] = {
        { "requests", s.requests }, { "requests_ok", s.ok }, { "requests_bad", s.bad },
        { "requests_busy", s.busy }, { "requests_failed", s.failed }, { "requests_cancelled", s.cancelled },
        { "prompt_tokens", s.prompt_tokens }, { "completion_tokens", s.completion_tokens },
        { "reused_positions", s.reused_positions }, { "remote_prefills", s.remote_prefills },
        { "local_prefills", s.local_prefills }, { "fallbacks", s.fallbacks },
        { "positions_received", s.positions_received }, { "kv_bytes", s.kv_bytes }, { "wire_bytes", s.wire_bytes },
    };
    for (size_t i = 0; i < sizeof cnt / sizeof cnt[0]; i++)
        json_object_set_new(o, cnt[i].k, json_integer((json_int_t)cnt[i].v));
    json_object_set_new(o, "prefill_tps_local", json_real(s.prefill_tps_local));
    json_object_set_new(o, "prefill_tps_remote", json_real(s.prefill_tps_remote));
    json_object_set_new(o, "decode_tps", json_real(s.decode_tps));
    json_object_set_new(o, "ttft_ms", json_real(s.ttft_ms));
    json_object_set_new(o, "handoff_gbps", json_real(s.handoff_gbps));
    json_object_set_new(o, "busy", json_integer(busy));
    json_object_set_new(o, "queued", json_integer(waiting));
    json_object_set_new(o, "queue_max", json_integer(n->queue_max));
    json_object_set_new(o, "sessions", json_integer(n->n_slots));
    json_object_set_new(o, "sessions_used", json_integer(used));
    json_object_set_new(o, "n_ctx", json_integer(n->n_ctx));
    return dn_send_json(c, 200, o);
}

static void dn_emit_line(dn_job *j, json_t *o) {
    size_t len = 0;
    char *s = dn_dump(o, &len);
    if (s) { dn_str_add(&j->out, s, len); dn_str_add(&j->out, "\n", 1); }
    free(s);
}

static ssize_t dn_stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    dn_job *j = cls;
    while (j->out_off == j->out.len) {
        j->out.len = j->out_off = 0;
        if (j->done_sent) return MHD_CONTENT_READER_END_OF_STREAM;
        size_t pl = 0;
        if (dn_job_step(j, &pl)) {
            json_t *o = json_object();
            json_object_set_new(o, "token", json_integer(j->gen[j->n_gen - 1]));
            json_object_set_new(o, "text", dn_json_text(j->piece, pl));
            dn_emit_line(j, o);
        } else {
            dn_str tail = { 0 };
            dn_flush_text(j, &tail);
            json_t *o = json_object();
            json_object_set_new(o, "done", json_true());
            if (tail.len) json_object_set_new(o, "text", dn_json_text(tail.p, tail.len));
            free(tail.p);
            dn_result_fields(j, o);
            dn_emit_line(j, o);
            j->done_sent = 1;
        }
    }
    size_t k = j->out.len - j->out_off;
    if (k > max) k = max;
    memcpy(buf, j->out.p + j->out_off, k);
    j->out_off += k;
    return (ssize_t)k;
}

static void dn_stream_free(void *cls) { dn_job_free(cls); }

static enum MHD_Result dn_generate_full(dn_job *j, struct MHD_Connection *c) {
    size_t pl;
    while (dn_job_step(j, &pl)) {}
    dn_flush_text(j, NULL);
    json_t *o = json_object();
    json_t *toks = json_array();
    for (int i = 0; i < j->n_gen; i++) json_array_append_new(toks, json_integer(j->gen[i]));
    json_object_set_new(o, "tokens", toks);
    json_object_set_new(o, "text", dn_json_text(j->text.p ? j->text.p : "", j->text_keep));
    dn_result_fields(j, o);
    unsigned status = j->finish && !strcmp(j->finish, "error") ? 500 : 200;
    dn_job_free(j);
    return dn_send_json(c, status, o);
}

static enum MHD_Result dn_handle_generate(dnode *n, struct MHD_Connection *c, const char *body, size_t len) {
    double t_arrive = dn_now();
    char err[512];
    dn_req r;
    pthread_mutex_lock(&n->smu);
    n->st.requests++;
    pthread_mutex_unlock(&n->smu);
    if (dn_parse_request(n, body, len, &r, err, sizeof err))
        return dn_send_error(n, c, 400, "invalid_request_error", err);
    dn_job *j = dn_job_new(n, &r, t_arrive);
    if (!j) { dn_req_free(&r); return dn_send_error(n, c, 500, "server_error", "out of memory"); }
    int a = dn_gen_acquire(n);
    if (a) {
        dn_job_free(j);
        return dn_send_error(n, c, 503, a == -1 ? "busy" : "unavailable",
                             a == -1 ? "too many requests waiting; try again later" : "the server is shutting down");
    }
    j->holds_slot = 1;
    j->queue_ms = dn_now() - t_arrive;
    if (dn_job_prefill(j, err, sizeof err)) {
        dn_job_finish(j, "error", err);
        dn_log("prefill failed: %s", err);
        dn_job_free(j);
        return dn_send_error(n, c, 500, "server_error", err);
    }
    if (!j->r.stream) return dn_generate_full(j, c);
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, DN_STREAM_BLOCK,
                                                                  dn_stream_read, j, dn_stream_free);
    if (!resp) { dn_job_free(j); return MHD_NO; }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/x-ndjson");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    enum MHD_Result rc = MHD_queue_response(c, 200, resp);
    MHD_destroy_response(resp);   /* MHD holds its own reference; dn_stream_free runs when it lets go */
    return rc;
}

/* Per-connection request state: the uploaded body. */
typedef struct {
    dn_str body;
    int too_big;
} dn_conn;

static enum MHD_Result dn_on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                     const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    dnode *n = cls;
    dn_conn *cc = *con_cls;
    if (!cc) {
        if (!(cc = calloc(1, sizeof *cc))) return MHD_NO;
        *con_cls = cc;
        return MHD_YES;
    }
    if (*upload_size) {
        if (cc->body.len + *upload_size > (size_t)n->o->max_body_bytes) cc->too_big = 1;
        else if (dn_str_add(&cc->body, upload, *upload_size)) cc->too_big = 1;
        *upload_size = 0;
        return MHD_YES;
    }
    int get = !strcmp(method, "GET") || !strcmp(method, "HEAD"), post = !strcmp(method, "POST");
    if (!strcmp(url, "/health")) return get ? dn_handle_health(n, c) : dn_send_error(n, c, 405, "invalid_request_error", "use GET");
    if (!strcmp(url, "/v1/stats")) return get ? dn_handle_stats(n, c) : dn_send_error(n, c, 405, "invalid_request_error", "use GET");
    if (!strcmp(url, "/v1/generate")) {
        if (!post) return dn_send_error(n, c, 405, "invalid_request_error", "use POST");
        if (cc->too_big) return dn_send_error(n, c, 413, "invalid_request_error", "request body too large");
        return dn_handle_generate(n, c, cc->body.p, cc->body.len);
    }
    return dn_send_error(n, c, 404, "not_found", "no such endpoint (try POST /v1/generate, GET /health, GET /v1/stats)");
}

static void dn_on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    dn_conn *cc = *con_cls;
    if (!cc) return;
    free(cc->body.p);
    free(cc);
    *con_cls = NULL;
}

/* ==== Listening ==== */

/* Splits "host:port" ("[v6]:port", ":port", "port"); host defaults to 127.0.0.1. */
static int dn_split_hostport(const char *hp, char *host, size_t hl, char *port, size_t pl) {
    const char *colon = strrchr(hp, ':');
    const char *h = hp, *p = colon ? colon + 1 : hp;
    size_t n = colon ? (size_t)(colon - hp) : 0;
    if (n >= 2 && h[0] == '[' && h[n - 1] == ']') { h++; n -= 2; }
    if (n >= hl || strlen(p) >= pl || !*p) return -1;
    if (n == 0) snprintf(host, hl, "127.0.0.1");
    else { memcpy(host, h, n); host[n] = 0; }
    snprintf(port, pl, "%s", p);
    return 0;
}

static int dn_listen(const char *hp, int *port_out, int *family, char *err, size_t errlen) {
    char host[256], port[32];
    if (dn_split_hostport(hp, host, sizeof host, port, sizeof port)) {
        snprintf(err, errlen, "bad listen address '%s' (want host:port)", hp);
        return -1;
    }
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE }, *ai = NULL;
    int g = getaddrinfo(host, port, &hints, &ai);
    if (g) { snprintf(err, errlen, "cannot resolve %s: %s", hp, gai_strerror(g)); return -1; }
    int fd = -1;
    for (struct addrinfo *a = ai; a; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (!bind(fd, a->ai_addr, a->ai_addrlen) && !listen(fd, 64)) { *family = a->ai_family; break; }
        snprintf(err, errlen, "cannot listen on %s: %s", hp, strerror(errno));
        close(fd);
        fd = -1;
    }
    freeaddrinfo(ai);
    if (fd < 0) return -1;
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(fd, (struct sockaddr *)&ss, &sl);
    *port_out = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                         : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    return fd;
}

/* Written to a temporary name and renamed, so a reader never sees half a number. */
static int dn_write_port_file(const char *path, int port, char *err, size_t errlen) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f || fprintf(f, "%d\n", port) < 0 || fclose(f) || rename(tmp, path)) {
        snprintf(err, errlen, "cannot write port file %s: %s", path, strerror(errno));
        if (f) unlink(tmp);
        return -1;
    }
    return 0;
}

/* ==== Run ==== */

static int dn_init(dnode *n, model *m, const decode_node_opts *o, char *err, size_t errlen) {
    const model_hparams *hp = model_get_hparams(m);
    n->m = m;
    n->o = o;
    n->tok = model_get_tokenizer(m);
    n->n_vocab = hp->n_vocab;
    n->n_ctx = o->n_ctx > 0 ? o->n_ctx : (hp->n_ctx_train > 0 && hp->n_ctx_train < 4096 ? hp->n_ctx_train : 4096);
    n->n_slots = o->n_sessions > 0 ? o->n_sessions : 4;
    n->queue_max = o->queue_max > 0 ? o->queue_max : 16;
    n->min_split = o->min_split_tokens > 0 ? o->min_split_tokens : 32;
    n->timeout_ms = o->timeout_ms > 0 ? o->timeout_ms : 10000;
    n->kv_dtype = o->kv_dtype ? o->kv_dtype : GGML_TYPE_F16;
    n->wire_dtype = o->wire_dtype ? o->wire_dtype : n->kv_dtype;
    n->role = o->local_only ? "local" : "decode";
    const char *path = o->model_path ? o->model_path : "model";
    const char *base = strrchr(path, '/');
    snprintf(n->desc, sizeof n->desc, "%s (%s, %d layers, n_embd %d, %s)", base ? base + 1 : path,
             hp->arch_name ? hp->arch_name : "?", hp->n_layer, hp->n_embd, model_type_summary(m));
    pthread_mutex_init(&n->mu, NULL);
    pthread_cond_init(&n->cv, NULL);
    pthread_mutex_init(&n->smu, NULL);
    n->slots = calloc((size_t)n->n_slots, sizeof *n->slots);
    n->logits = malloc(sizeof(float) * (size_t)n->n_vocab);
    if (!n->slots || !n->logits) { snprintf(err, errlen, "out of memory"); return -1; }
    return 0;
}

static void dn_cleanup(dnode *n) {
    dn_peers_close(n);
    for (int i = 0; n->slots && i < n->n_slots; i++) { session_free(n->slots[i].s); free(n->slots[i].tokens); }
    free(n->slots);
    free(n->logits);
    pthread_mutex_destroy(&n->mu);
    pthread_cond_destroy(&n->cv);
    pthread_mutex_destroy(&n->smu);
}

int decode_node_check_request(model *m, const decode_node_opts *o, const char *body, size_t len,
                              char *err, size_t errlen) {
    dnode n;
    memset(&n, 0, sizeof n);
    if (dn_init(&n, m, o, err, errlen)) { dn_cleanup(&n); return -1; }
    dn_req r;
    int rc = dn_parse_request(&n, body, len, &r, err, errlen);
    if (rc == 0) dn_req_free(&r);
    dn_cleanup(&n);
    return rc;
}

int decode_node_run(model *m, const decode_node_opts *o, char *err, size_t errlen) {
    static volatile int never = 0;
    volatile int *stop = o->stop ? o->stop : &never;
    decode_node_opts def = *o;
    if (def.max_body_bytes <= 0) def.max_body_bytes = 8 << 20;   /* a 4096-token id list is ~40 KB; text prompts similar */
    dnode n;
    memset(&n, 0, sizeof n);
    int rc = -1, port = 0, family = AF_INET;
    if (dn_init(&n, m, &def, err, errlen)) { dn_cleanup(&n); return -1; }
    int fd = dn_listen(o->listen ? o->listen : "127.0.0.1:8080", &port, &family, err, errlen);
    if (fd < 0) { dn_cleanup(&n); return -1; }
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG;
    if (family == AF_INET6) flags |= MHD_USE_IPv6;
    struct MHD_Daemon *d = MHD_start_daemon(flags, 0, NULL, NULL, dn_on_request, &n,
        MHD_OPTION_LISTEN_SOCKET, fd,
        MHD_OPTION_NOTIFY_COMPLETED, dn_on_completed, &n,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned)(n.queue_max + 32),   /* queued + running + health/stats probes */
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)300,                  /* idle keep-alive connections */
        MHD_OPTION_END);
    if (!d) {
        snprintf(err, errlen, "cannot start the HTTP server on %s", o->listen);
        close(fd);
        dn_cleanup(&n);
        return -1;
    }
    dn_log("listening on %s (port %d), role %s, model %s, n_ctx %d, %d sessions, %d prefill node(s)",
           o->listen ? o->listen : "127.0.0.1:8080", port, n.role, n.desc, n.n_ctx, n.n_slots, o->n_prefill_nodes);
    if (o->port_file && dn_write_port_file(o->port_file, port, err, errlen)) goto stop;
    while (!*stop) {
        struct timespec ts = { 0, 50 * 1000000L };
        nanosleep(&ts, NULL);
    }
    dn_log("shutting down");
    rc = 0;
stop:
    pthread_mutex_lock(&n.mu);
    n.stopping = 1;
    pthread_cond_broadcast(&n.cv);
    pthread_mutex_unlock(&n.mu);
    MHD_stop_daemon(d);   /* joins every connection thread; closes the listening socket */
    dn_cleanup(&n);
    return rc;
}

/* ==== Command line ==== */

static volatile int dn_cli_stop;

static void dn_on_signal(int sig) { (void)sig; dn_cli_stop = 1; }

static void dn_usage(void) {
    fprintf(stderr,
        "usage: tandem serve --role decode|local -m MODEL.gguf [options]\n"
        "  --listen HOST:PORT        HTTP address (default 127.0.0.1:8080; port 0 = any free port)\n"
        "  --port-file F             write the bound port to F once listening\n"
        "  --prefill-node HOST:PORT  a prefill node (repeatable; decode role only)\n"
        "  --secret-file F           shared secret for the prefill nodes (or env TANDEM_SECRET)\n"
        "  -t N                      threads (default 2)\n"
        "  -c N                      context per session (default: the model's, at most 4096)\n"
        "  -b N                      prefill chunk (default 512)\n"
        "  --sessions N              KV caches kept for prefix reuse (default 4)\n"
        "  --queue N                 requests that may wait (default 16; more get 503)\n"
        "  --min-split-tokens N      \"auto\" prefills remotely from this prompt length (default 32)\n"
        "  --kv-type T               cache type: f16 (default), bf16, q8_0\n"
        "  --wire-dtype T            handoff dtype: the cache type (default) or q8_0\n"
        "  --zstd                    ask for zstd-compressed frames\n"
        "  --timeout-ms N            handoff stall timeout (default 10000)\n"
        "  --node-id NAME            our name towards prefill nodes\n");
}

static int dn_cli_int(const char *s, int lo, int hi, int *out) {
    char *end;
    errno = 0;
    long v = s ? strtol(s, &end, 10) : 0;
    if (!s || errno || *end || end == s || v < lo || v > hi) return -1;
    *out = (int)v;
    return 0;
}

typedef struct {
    decode_node_opts o;
    const char *model, *kv, *wire, *secret_file;
    int threads, batch;
} dn_cli;

static int dn_cli_parse(int argc, char **argv, dn_cli *c) {
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0, takes = 1;
        if (!strcmp(a, "--role")) {}
        else if (!strcmp(a, "-m")) c->model = v;
        else if (!strcmp(a, "--listen")) c->o.listen = v;
        else if (!strcmp(a, "--port-file")) c->o.port_file = v;
        else if (!strcmp(a, "--secret-file")) c->secret_file = v;
        else if (!strcmp(a, "--node-id")) c->o.node_id = v;
        else if (!strcmp(a, "--kv-type")) c->kv = v;
        else if (!strcmp(a, "--wire-dtype")) c->wire = v;
        else if (!strcmp(a, "--prefill-node")) {
            bad = !v || c->o.n_prefill_nodes == DECODE_MAX_PREFILL_NODES;
            if (!bad) c->o.prefill_nodes[c->o.n_prefill_nodes++] = v;
        }
        else if (!strcmp(a, "-t")) bad = dn_cli_int(v, 1, 256, &c->threads);
        else if (!strcmp(a, "-c")) bad = dn_cli_int(v, 1, 1 << 20, &c->o.n_ctx);
        else if (!strcmp(a, "-b")) bad = dn_cli_int(v, 1, 1 << 16, &c->batch);
        else if (!strcmp(a, "--sessions")) bad = dn_cli_int(v, 1, 256, &c->o.n_sessions);
        else if (!strcmp(a, "--queue")) bad = dn_cli_int(v, 1, 4096, &c->o.queue_max);
        else if (!strcmp(a, "--min-split-tokens")) bad = dn_cli_int(v, 1, 1 << 20, &c->o.min_split_tokens);
        else if (!strcmp(a, "--timeout-ms")) bad = dn_cli_int(v, 1, 3600000, &c->o.timeout_ms);
        else if (!strcmp(a, "--zstd")) { c->o.zstd = 1; takes = 0; }
        else { fprintf(stderr, "tandem serve: unknown option %s\n", a); dn_usage(); return -1; }
        if (takes && (!v || bad)) { fprintf(stderr, "tandem serve: option %s needs a valid value\n", a); return -1; }
        i += takes;
    }
    if (!c->model) { dn_usage(); return -1; }
    if (c->o.local_only && c->o.n_prefill_nodes) {
        fprintf(stderr, "tandem serve: --role local uses no prefill node\n");
        return -1;
    }
    return 0;
}

int decode_node_cli(int argc, char **argv, int local_only) {
    dn_cli c;
    memset(&c, 0, sizeof c);
    c.o.local_only = local_only;
    c.threads = 2;
    if (dn_cli_parse(argc, argv, &c)) return 2;
    char err[512];
    c.o.kv_dtype = cli_kv_type(c.kv ? c.kv : "f16");
    c.o.wire_dtype = c.wire ? cli_kv_type(c.wire) : c.o.kv_dtype;
    if (c.o.kv_dtype == UINT32_MAX || c.o.wire_dtype == UINT32_MAX) {
        fprintf(stderr, "tandem serve: unknown KV or wire type (use f16, bf16, q8_0)\n");
        return 2;
    }
    /* the secret authenticates us to prefill nodes: needed as soon as one can be used */
    char *secret = NULL;
    if (!local_only && (c.secret_file || getenv("TANDEM_SECRET") || c.o.n_prefill_nodes) &&
        cli_load_secret(c.secret_file, &secret, &c.o.secret_len, err, sizeof err)) {
        fprintf(stderr, "tandem serve: %s\n", err);
        return 2;
    }
    c.o.secret = secret;
    c.o.model_path = c.model;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = dn_on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    c.o.stop = &dn_cli_stop;
    model_opts mo = { .n_threads = c.threads, .n_batch = c.batch };
    model *m = NULL;
    int rc = 1;
    if (model_load(&m, c.model, &mo, err, sizeof err)) fprintf(stderr, "tandem: %s: %s\n", c.model, err);
    else if (decode_node_run(m, &c.o, err, sizeof err)) fprintf(stderr, "tandem serve: %s\n", err);
    else rc = 0;
    model_free(m);
    if (secret) { memset(secret, 0, c.o.secret_len); free(secret); }
    return rc;
}
