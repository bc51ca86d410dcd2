/* router_batch.c - a completions request with several prompts (one child
 * request a prompt, run on threads of their own, their output merged), and
 * the entry point of every generation request (rt_generate).
 *
 * The rule of every router file: the registry, the measured rates and the
 * metrics live under one mutex (router.mu); no lock is held across I/O.
 */
#include "router/router_internal.h"
#include "router/router_nodes.h"
#include "router/router_request.h"
#include "router/router_responses.h"
#include "router/router_stream.h"

/* ==== Several prompts (completions) ==== */

/* /v1/completions with a list of prompts: one child request (rt_req) per
 * prompt, each routed, retried and logged as a request of its own on a
 * thread of its own, so that their prefills and decodes run at once. The
 * client's reply numbers prompt k's choice i as k * n + i (as OpenAI does)
 * and its usage sums the prompts. Any prompt that cannot start fails the
 * whole request (the others stop); streamed, a prompt failing after its
 * first token ends the stream with an error event. */

/* Stream bytes the prompts may queue for a slow client before each waits
 * (a token's chunk is a few hundred bytes). */
#define RT_BATCH_QUEUE_MAX (1u << 20)

/* Prompt k's request, taking its parsed request (req). */
static rt_req *rt_kid_new(rt_batch *b, int k, api_request *req) {
    rt_req *p = b->parent;
    rt_req *q = calloc(1, sizeof *q);
    if (!q) return NULL;
    q->r = p->r;
    q->ep = p->ep;
    q->req = *req;
    memset(req, 0, sizeof *req);
    q->decode_idx = q->prefill_idx = -1;
    q->t_start = p->t_start;
    q->created = p->created;
    q->client_fd = p->client_fd;
    memcpy(q->id, p->id, sizeof q->id);
    memcpy(q->rid, p->rid, sizeof q->rid);
    memcpy(q->client, p->client, sizeof q->client);
    q->batch = b;
    q->index_base = k * p->req.n;
    return q;
}

static void rt_batch_free(rt_batch *b) {
    for (int k = 0; k < b->n; k++)
        if (b->kid[k]) rt_req_finish(b->kid[k]);
    while (b->head) {
        rt_piece *x = b->head;
        b->head = x->next;
        free(x->s);
        free(x);
    }
    pthread_cond_destroy(&b->cv);
    pthread_mutex_destroy(&b->mu);
    free(b);
}

static rt_batch *rt_batch_new(rt_req *p, const rt_conn *cc, api_error *e) {
    rt_batch *b = calloc(1, sizeof *b);
    if (!b) { api_error_set(e, 500, "server_error", NULL, NULL, "out of memory"); return NULL; }
    b->parent = p;
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv, NULL);
    atomic_init(&b->cancel, 0);
    api_request reqs[API_MAX_PROMPTS];
    int n = p->req.n_prompts;
    if (api_parse_prompt_children(p->req.kind, cc->body ? cc->body : "", cc->len, &p->r->cfg.lim, n, reqs, e)) {
        rt_batch_free(b);
        return NULL;
    }
    for (; b->n < n && (b->kid[b->n] = rt_kid_new(b, b->n, &reqs[b->n])); b->n++) {}
    if (b->n == n) return b;
    for (int k = b->n; k < n; k++) api_request_free(&reqs[k]);
    rt_batch_free(b);
    api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    return NULL;
}

/* Every prompt stops: their readers give up, waiting threads wake. */
static void rt_batch_stop(rt_batch *b) {
    pthread_mutex_lock(&b->mu);
    atomic_store(&b->cancel, 1);
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

/* One thread per prompt; a thread that cannot be made fails its prompt. */
static void rt_batch_spawn(rt_batch *b, void *(*fn)(void *)) {
    b->running = b->n;
    for (; b->n_threads < b->n; b->n_threads++) {
        if (pthread_create(&b->th[b->n_threads], NULL, fn, b->kid[b->n_threads]) == 0) continue;
        for (int k = b->n_threads; k < b->n; k++) {
            b->failed[k] = 1;
            api_error_set(&b->err[k], 500, "server_error", NULL, NULL, "could not start a thread for prompt %d", k);
        }
        pthread_mutex_lock(&b->mu);
        b->running -= b->n - b->n_threads;
        pthread_mutex_unlock(&b->mu);
        rt_batch_stop(b);
        break;
    }
}

static void rt_batch_join(rt_batch *b) {
    for (int k = 0; k < b->n_threads; k++) pthread_join(b->th[k], NULL);
    b->n_threads = 0;
}

/* The request's error once its threads ended: the first prompt that failed
 * on its own (the others were stopped), else 499 when the client left.
 * 0 when no prompt failed. Every failed prompt is logged. */
static int rt_batch_error(rt_batch *b, api_error *e) {
    int first = -1;
    for (int k = 0; k < b->n; k++)
        if (b->failed[k] && b->err[k].status != 499 && first < 0) first = k;
    for (int k = 0; k < b->n; k++) {
        rt_req *q = b->kid[k];
        if (q->logged || (!b->failed[k] && first < 0)) continue;
        int cancelled = !b->failed[k] || b->err[k].status == 499;
        q->status = cancelled ? 499 : b->err[k].status;
        if (cancelled && first >= 0) snprintf(q->error, sizeof q->error, "stopped: prompt %d failed", first);
        else if (!q->error[0]) snprintf(q->error, sizeof q->error, "%s", b->err[k].message);
        rt_log_done(q, cancelled ? "cancelled" : "failed");
    }
    if (first >= 0) {
        *e = b->err[first];
        snprintf(e->message, sizeof e->message, "Prompt %d: %.300s", first, b->err[first].message);
        return -1;
    }
    for (int k = 0; k < b->n; k++)
        if (b->failed[k]) { api_error_set(e, 499, "invalid_request_error", NULL, NULL, "client disconnected"); return -1; }
    return 0;
}

/* ---- Non-stream ---- */

static void *rt_kid_complete_main(void *arg) {
    rt_req *q = arg;
    rt_batch *b = q->batch;
    int k = rt_kid_index(q);
    if (rt_complete(q, &b->err[k])) {
        b->failed[k] = 1;
        if (b->err[k].status != 499) rt_batch_stop(b);   /* the request fails: the others stop */
    }
    return NULL;
}

/* Every prompt's choices in one reply, usage summed over the prompts. */
static char *rt_batch_reply(rt_batch *b) {
    int per = b->parent->req.n, total = b->n * per, prompt = 0, completion = 0, ok = 1;
    char *bodies[API_MAX_CHOICES] = {0};
    for (int k = 0; k < b->n; k++) {
        ok &= rt_render_choices(b->kid[k], bodies + k * per) == 0;
        prompt += b->kid[k]->fin.prompt_tokens;
        completion += b->kid[k]->fin.completion_tokens;
    }
    char *body = ok ? api_merge_responses(bodies, total, prompt, completion) : NULL;
    for (int i = 0; i < total; i++) free(bodies[i]);
    return body;
}

static enum MHD_Result rt_batch_fail(rt_batch *b, struct MHD_Connection *c, const api_error *e) {
    rt_req *p = b->parent;
    p->status = e->status;
    if (e->status != 499) return rt_send_error(p->r, c, p->ep, e);
    metrics_add(p->r->m.cancels, NULL, 1);
    return MHD_NO;
}

static enum MHD_Result rt_run_batch_blocking(rt_batch *b, struct MHD_Connection *c) {
    rt_req *p = b->parent;
    rt_batch_spawn(b, rt_kid_complete_main);
    rt_batch_join(b);
    api_error e;
    enum MHD_Result mr;
    if (rt_batch_error(b, &e)) {
        mr = rt_batch_fail(b, c, &e);
    } else {
        p->status = 200;
        rt_count_request(p->r, p->ep, 200);
        mr = rt_reply_json(c, NULL, RT_ECHO_ID(p), rt_batch_reply(b));
    }
    rt_batch_free(b);
    rt_req_finish(p);
    return mr;
}

/* ---- Stream ---- */

/* Queues one chunk of prompt q's stream (taking q->out); waits while the
 * client is RT_BATCH_QUEUE_MAX behind. 0, or -1 when the batch stopped. */
static int rt_kid_push(rt_req *q) {
    rt_batch *b = q->batch;
    rt_piece *x = malloc(sizeof *x);
    if (!x) return -1;
    *x = (rt_piece){.s = q->out, .len = q->out_len, .failed = q->phase == 1 && q->status != 200};
    q->out = NULL;
    q->out_len = q->out_off = 0;
    pthread_mutex_lock(&b->mu);
    if (b->tail) b->tail->next = x;
    else b->head = x;
    b->tail = x;
    b->queued += x->len;
    pthread_cond_broadcast(&b->cv);
    while (b->queued > RT_BATCH_QUEUE_MAX && !atomic_load(&b->cancel)) pthread_cond_wait(&b->cv, &b->mu);
    int stop = atomic_load(&b->cancel);
    pthread_mutex_unlock(&b->mu);
    return stop ? -1 : 0;
}

/* Starts prompt q on a node, waits for the batch's go (every prompt
 * started), then streams its chunks into the queue. */
static void *rt_kid_stream_main(void *arg) {
    rt_req *q = arg;
    rt_batch *b = q->batch;
    int k = rt_kid_index(q);
    api_error e;
    int rc = rt_start(q, &e);
    pthread_mutex_lock(&b->mu);
    if (rc) {
        b->failed[k] = 1;
        b->err[k] = e;
        if (e.status != 499) atomic_store(&b->cancel, 1);
    }
    b->started++;
    pthread_cond_broadcast(&b->cv);
    while (!rc && !b->go && !atomic_load(&b->cancel)) pthread_cond_wait(&b->cv, &b->mu);
    int go = !rc && b->go && !atomic_load(&b->cancel);
    pthread_mutex_unlock(&b->mu);
    if (go) {
        q->client_fd = -1;   /* from here the batch's cancel says the client left */
        while (rt_stream_produce(q) == 0 && q->out && rt_kid_push(q) == 0) {}
    }
    pthread_mutex_lock(&b->mu);
    b->running--;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

/* Every prompt's stream ended: the usage chunk and [DONE], or an error
 * event when a prompt stopped without finishing. */
static int rt_batch_stream_end(rt_batch *b) {
    rt_req *p = b->parent;
    int prompt = 0, completion = 0, cached = 0, bad = -1;
    for (int k = 0; k < b->n; k++) {
        if (b->kid[k]->status != 200 && bad < 0) bad = k;
        cached += b->kid[k]->fin.start_pos;
        prompt += b->kid[k]->fin.prompt_tokens;
        completion += b->kid[k]->fin.completion_tokens;
    }
    char *s = NULL;
    if (bad >= 0) {
        api_error e;
        api_error_set(&e, 502, "server_error", "upstream_failed", NULL, "Prompt %d stopped before it finished: %s", bad,
                      b->kid[bad]->error[0] ? b->kid[bad]->error : "no reason given");
        p->status = 502;
        s = api_concat(api_render_error_event(&e), strdup("data: [DONE]\n\n"));
    } else {
        api_resp_meta m;
        rt_meta(p, &m);
        m.cached_tokens = cached;
        /* api_concat takes no NULL: the usage chunk, or nothing */
        s = p->req.include_usage ? api_render_usage_chunk(p->req.kind, &m, prompt, completion) : strdup("");
        /* where each prompt was prefilled, in prompt order (rt_prefill_comment) */
        for (int k = 0; k < b->n; k++) s = api_concat(s, rt_prefill_comment(b->kid[k]));
        s = api_concat(s, strdup("data: [DONE]\n\n"));
        p->status = 200;
    }
    rt_count_request(p->r, p->ep, p->status);
    return rt_out_set(p, s);
}

/* The next bytes for the client: a queued chunk of any prompt (in the
 * order they came), or the end. 0, or -1 at the end of the stream. */
static int rt_batch_produce(rt_batch *b) {
    rt_req *p = b->parent;
    if (p->phase == 1) return -1;
    pthread_mutex_lock(&b->mu);
    while (!b->head && b->running > 0) pthread_cond_wait(&b->cv, &b->mu);
    rt_piece *x = b->head;
    if (x) {
        b->head = x->next;
        if (!b->head) b->tail = NULL;
        b->queued -= x->len;
        pthread_cond_broadcast(&b->cv);
    }
    pthread_mutex_unlock(&b->mu);
    p->phase = x ? 0 : 1;
    if (!x) return rt_batch_stream_end(b);
    char *s = x->s;
    if (x->failed) {   /* the error event is the stream's last word, then [DONE] */
        s = api_concat(s, strdup("data: [DONE]\n\n"));
        rt_batch_stop(b);
        p->phase = 1;
        p->status = 502;
        rt_count_request(p->r, p->ep, 502);
    }
    free(x);
    return rt_out_set(p, s);
}

static ssize_t rt_batch_stream_cb(void *cls, uint64_t pos, char *buf, size_t max) {
    rt_batch *b = cls;
    rt_req *p = b->parent;
    (void)pos;
    while (p->out_off >= p->out_len)
        if (rt_batch_produce(b)) return MHD_CONTENT_READER_END_OF_STREAM;
    return rt_out_take(p, buf, max);
}

/* The response is over (or the client went away mid-stream). */
static void rt_batch_stream_free(void *cls) {
    rt_batch *b = cls;
    rt_req *p = b->parent;
    if (p->phase != 1 || !p->status) {
        p->status = 499;
        metrics_add(p->r->m.cancels, NULL, 1);
    }
    rt_batch_stop(b);
    rt_batch_join(b);
    for (int k = 0; k < b->n; k++) {
        rt_req *q = b->kid[k];
        if (q->logged) continue;
        q->status = 499;
        snprintf(q->error, sizeof q->error, "%s", p->status == 499 ? "client disconnected" : "stopped: another prompt failed");
        rt_log_done(q, "cancelled");
    }
    rt_batch_free(b);
    rt_req_finish(p);
}

static enum MHD_Result rt_run_batch_stream(rt_batch *b, struct MHD_Connection *c) {
    rt_req *p = b->parent;
    rt_batch_spawn(b, rt_kid_stream_main);
    pthread_mutex_lock(&b->mu);
    while (b->started < b->n_threads) pthread_cond_wait(&b->cv, &b->mu);
    int failed = atomic_load(&b->cancel);
    for (int k = 0; k < b->n; k++) failed |= b->failed[k];
    if (!failed) b->go = 1;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    struct MHD_Response *resp = NULL;
    if (!failed) resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, rt_batch_stream_cb, b, rt_batch_stream_free);
    if (!resp) {
        api_error e;
        rt_batch_stop(b);
        rt_batch_join(b);
        if (!failed || !rt_batch_error(b, &e)) api_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
        enum MHD_Result mr = rt_batch_fail(b, c, &e);
        rt_batch_free(b);
        rt_req_finish(p);
        return mr;
    }
    rt_sse_headers(resp);
    MHD_add_response_header(resp, "X-Request-Id", RT_ECHO_ID(p));
    enum MHD_Result mr = MHD_queue_response(c, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    return mr;
}

/* A request with several prompts (p->req.n_prompts > 1). */
static enum MHD_Result rt_run_batch(rt_req *p, struct MHD_Connection *c, const rt_conn *cc) {
    api_error e;
    rt_batch *b = rt_batch_new(p, cc, &e);
    if (!b) {
        p->status = e.status;
        enum MHD_Result mr = rt_send_error(p->r, c, p->ep, &e);
        rt_req_finish(p);
        return mr;
    }
    return p->req.stream ? rt_run_batch_stream(b, c) : rt_run_batch_blocking(b, c);
}

/* The client's X-Request-Id: a log id (8 hex digits) becomes the request's
 * id in every node's log line; another short token is kept to be echoed
 * and named on the router's line. */
static void rt_client_request_id(struct MHD_Connection *c, char *rid, char *client) {
    const char *v = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Request-Id");
    uint32_t id;
    client[0] = 0;
    if (v && log_id_parse(v, &id) == 0) { log_id_format(id, rid); return; }
    log_id_format(log_id_new(), rid);
    size_t n = v ? strlen(v) : 0;
    if (n == 0 || n > RT_CLIENT_ID_MAX) return;
    for (size_t i = 0; i < n; i++) {
        char ch = v[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' ||
              ch == ':' || ch == '-'))
            return;
    }
    memcpy(client, v, n + 1);
}

/* A generation request refused before it was routed: its one log line
 * (with the client's id or one of its own), then the error, the id echoed. */
static enum MHD_Result rt_refuse(router *r, struct MHD_Connection *c, int ep, const api_error *e) {
    char rid[LOG_ID_CHARS + 1], client[RT_CLIENT_ID_MAX + 1];
    rt_client_request_id(c, rid, client);
    if (!r->cfg.quiet) log_refused(rid, e->status, e->message);
    rt_count_request(r, ep, e->status);
    struct MHD_Response *resp = rt_response_json(e->status, api_error_json(e));
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, "X-Request-Id", client[0] ? client : rid);
    enum MHD_Result mr = MHD_queue_response(c, (unsigned)e->status, resp);
    MHD_destroy_response(resp);
    return mr;
}

enum MHD_Result rt_generate(router *r, struct MHD_Connection *c, rt_conn *cc) {
    enum api_kind kind = cc->ep == RT_EP_COMPLETIONS ? API_COMPLETION : API_CHAT;   /* /v1/responses: as chat */
    api_error e;
    if (cc->too_big) {
        api_error_set(&e, 413, "invalid_request_error", "request_too_large", NULL,
                      "The request body exceeds %zu bytes.", r->cfg.max_body_bytes);
        return rt_refuse(r, c, cc->ep, &e);
    }
    if (cc->ep == RT_EP_RESPONSES && rt_responses_prepare(r, cc, &e)) return rt_refuse(r, c, cc->ep, &e);
    rt_req *q = calloc(1, sizeof *q);
    if (!q) { api_error_set(&e, 500, "server_error", NULL, NULL, "out of memory"); return rt_refuse(r, c, cc->ep, &e); }
    q->r = r;
    rt_client_addr(c, q->client, sizeof q->client);   /* whose share of a node's slots (X-Tandem-Client) */
    q->ep = cc->ep;
    q->decode_idx = q->prefill_idx = -1;
    q->t_start = rt_now_ms();
    q->created = (long long)time(NULL);
    q->client_fd = rt_client_fd(c);
    if (api_parse_request(kind, cc->body ? cc->body : "", cc->len, &r->cfg.lim, &q->req, &e)) {
        if (cc->responses) rt_responses_fix_error(&e);
        free(q);
        return rt_refuse(r, c, cc->ep, &e);
    }
    if (!rt_model_known(r, q->req.model)) {
        api_error_set(&e, 404, "invalid_request_error", "model_not_found", "model",
                      "The model '%s' does not exist or you do not have access to it.", q->req.model);
        api_request_free(&q->req);
        free(q);
        return rt_refuse(r, c, cc->ep, &e);
    }
    /* each prompt of several is a request of its own to a node */
    int want = q->req.n_prompts > 1 ? q->req.n_prompts : 1;
    pthread_mutex_lock(&r->mu);
    int over = r->active + want > r->cfg.max_concurrent;
    if (!over) r->active += want;
    unsigned long long seq = ++r->seq;
    pthread_mutex_unlock(&r->mu);
    if (over && want > r->cfg.max_concurrent) {
        api_error_set(&e, 400, "invalid_request_error", "invalid_value", "prompt",
                      "%d prompts exceed this router's %d concurrent requests; send fewer prompts per request.",
                      want, r->cfg.max_concurrent);
        api_request_free(&q->req);
        free(q);
        return rt_refuse(r, c, cc->ep, &e);
    }
    if (over) {
        api_error_set(&e, 429, "rate_limit_error", "too_many_requests", NULL,
                      "Too many concurrent requests (limit %d); retry later.", r->cfg.max_concurrent);
        api_request_free(&q->req);
        free(q);
        return rt_refuse(r, c, cc->ep, &e);
    }
    q->counted_active = want;
    uint8_t rnd[6] = {0};
    wire_random(rnd, sizeof rnd);
    snprintf(q->id, sizeof q->id, "%s-%llu%02x%02x%02x%02x%02x%02x", kind == API_CHAT ? "chatcmpl" : "cmpl", seq,
             rnd[0], rnd[1], rnd[2], rnd[3], rnd[4], rnd[5]);
    rt_client_request_id(c, q->rid, q->client_rid);
    if (cc->responses) return rt_responses_run(q, c, cc);
    if (q->req.n_prompts > 1) return rt_run_batch(q, c, cc);
    return q->req.stream ? rt_run_stream(q, c) : rt_run_blocking(q, c);
}
