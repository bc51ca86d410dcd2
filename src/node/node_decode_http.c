/* node_decode_http.c - the decode node's HTTP side: JSON answers and errors,
 * the endpoints (/health, /v1/generate, /v1/cache/save and load,
 * /v1/tokenize), the per-client share of requests in flight, signed
 * endpoints and body caps, and the libmicrohttpd request callbacks. */

#include "node/node_decode.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>
#include <microhttpd.h>

#include "net/httpd.h"
#include "api/tok_api.h"
#include "api/tools.h"

#include "node/node_decode_internal.h"

/* ==== HTTP responses ==== */

enum MHD_Result dn_send_body(struct MHD_Connection *c, unsigned status, char *body, size_t len,
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

enum MHD_Result dn_send_json(struct MHD_Connection *c, unsigned status, json_t *o) {
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
    chat_style cs;
    char cerr[128];
    json_object_set_new(o, "chat_format", json_string(tools_style_detect(model_get_gguf(n->m), &cs, cerr, sizeof cerr)
                                                      ? "none" : tools_style_name(&cs)));
    json_object_set_new(o, "chat_template", json_string(n->o->chat_source ? n->o->chat_source : "model"));
    json_t *a = json_array();
    for (int i = 0; i < n->o->n_prefill_nodes; i++) json_array_append_new(a, json_string(n->o->prefill_nodes[i]));
    json_object_set_new(o, "prefill_nodes", a);
    return dn_send_json(c, 200, o);
}

/* The request id (log.h): the router's X-Request-Id when it is one, else
 * a fresh one (a client calling the node directly). */
static uint32_t dn_request_id(struct MHD_Connection *c, char *out) {
    uint32_t id;
    if (log_id_parse(MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Request-Id"), &id)) id = log_id_new();
    log_id_format(id, out);
    return id;
}

/* A generation request refused before it became a job: its one log line. */
static enum MHD_Result dn_refuse(dnode *n, struct MHD_Connection *c, unsigned status, const char *type,
                                 const char *msg) {
    char rid[LOG_ID_CHARS + 1];
    dn_request_id(c, rid);
    log_refused(rid, (int)status, msg);
    dn_metrics_refused(&n->mt, status);
    return dn_send_error(n, c, status, type, msg);
}

/* ==== Client shares ==== */

/* Who asked, for the per-client share: on a node with a secret the
 * router's X-Tandem-Client header (the request is signed, so only the
 * router can set it; without it the share does not apply: the router
 * alone is no one client); on a node without one, the peer's address when
 * --client-share was given (by default not: a node used directly is
 * mostly one application on one address). 0 = unknown. */
static uint64_t dn_client_id(dnode *n, struct MHD_Connection *c) {
    uint64_t h = 1469598103934665603ull;   /* FNV-1a */
    const unsigned char *p;
    size_t len;
    httpd_addr a;
    if (n->auth) {
        const char *v = MHD_lookup_connection_value(c, MHD_HEADER_KIND, DN_CLIENT_HDR);
        if (!v || !*v || (len = strlen(v)) > DN_CLIENT_MAX_LEN) return 0;
        p = (const unsigned char *)v;
        h = (h ^ 'k') * 1099511628211ull;
    } else {
        if (!n->o->client_share) return 0;   /* by address only when asked: one local app is one address */
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
        if (!ci || httpd_addr_of(ci->client_addr, &a)) return 0;
        p = (const unsigned char *)&a;
        len = sizeof a;
        h = (h ^ 'a') * 1099511628211ull;
    }
    for (size_t i = 0; i < len; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h ? h : 1;
}

/* Takes one of id's share: 0, or -1 when it holds client_cap requests. */
static int dn_client_take(dnode *n, uint64_t id) {
    pthread_mutex_lock(&n->cmu);
    int free_ = -1, rc = 0, i;
    for (i = 0; i < DN_MAX_CLIENTS; i++) {
        if (n->clients[i].n && n->clients[i].id == id) break;
        if (!n->clients[i].n && free_ < 0) free_ = i;
    }
    if (i < DN_MAX_CLIENTS) rc = n->clients[i].n >= n->client_cap ? -1 : (n->clients[i].n++, 0);
    else if (free_ >= 0) n->clients[free_].id = id, n->clients[free_].n = 1;
    pthread_mutex_unlock(&n->cmu);
    return rc;   /* a full table (impossible past slots + queue) tracks nothing */
}

void dn_client_put(dnode *n, uint64_t id) {
    pthread_mutex_lock(&n->cmu);
    for (int i = 0; i < DN_MAX_CLIENTS; i++)
        if (n->clients[i].n && n->clients[i].id == id) { n->clients[i].n--; break; }
    pthread_mutex_unlock(&n->cmu);
}

static enum MHD_Result dn_handle_generate(dnode *n, struct MHD_Connection *c, const char *body, size_t len) {
    double t_arrive = dn_now();
    char err[512];
    const char *type = "";
    dn_job *j;
    pthread_mutex_lock(&n->smu);
    n->st.requests++;
    pthread_mutex_unlock(&n->smu);
    uint64_t cid = n->client_cap ? dn_client_id(n, c) : 0;
    if (cid && dn_client_take(n, cid)) {
        snprintf(err, sizeof err, "this client already has %d requests running or waiting here, its share "
                 "(--client-share); try again later", n->client_cap);
        return dn_refuse(n, c, 429, "rate_limit_error", err);
    }
    unsigned status = dn_job_submit(n, body, len, t_arrive, cid, &j, &type, err, sizeof err);
    if (status) {
        if (cid) dn_client_put(n, cid);
        return dn_refuse(n, c, status, type, err);
    }
    j->client = cid;
    j->rid_num = dn_request_id(c, j->rid);
    /* Until the first token (or the end) nothing is sent, so a failure
     * before then is an HTTP error the router can retry elsewhere. */
    const sched_view *v = dn_job_wait(j, 0);
    if (v->state == SJ_DONE && v->n_gen == 0 && v->finish && !strcmp(v->finish, "error")) {
        snprintf(err, sizeof err, "%s", v->error ? v->error : "generation failed");
        log_warn(j->rid, "prefill failed: %s", err);
        dn_job_free(j);
        return dn_send_error(n, c, 500, "server_error", err);
    }
    if (!j->stream) return dn_generate_full(j, c);
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, DN_STREAM_BLOCK,
                                                                  dn_stream_read, j, dn_stream_free);
    if (!resp) { dn_job_free(j); return MHD_NO; }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/x-ndjson");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    enum MHD_Result rc = MHD_queue_response(c, 200, resp);
    MHD_destroy_response(resp);   /* MHD holds its own reference; dn_stream_free runs when it lets go */
    return rc;
}

/* POST /v1/cache/save and /v1/cache/load: a generation body names the
 * prefix (a rubric). save computes it if the store lacks it (one greedy
 * token, through a prefill node when the body asks for one), then writes
 * its blocks to disk and answers when they are there; load reads them from
 * disk into memory ahead of the requests that will use them. */
static enum MHD_Result dn_handle_cache(dnode *n, struct MHD_Connection *c, int save, const char *body, size_t len) {
    char err[512];
    if (!n->store) return dn_send_error(n, c, 400, "invalid_request_error", "this node has no KV store (--kv-cache-ram, --kv-cache-dir)");
    dn_req r;
    if (dn_parse_request(n, body, len, &r, err, sizeof err)) return dn_send_error(n, c, 400, "invalid_request_error", err);
    int n_prompt = r.n_prompt, have = kvstore_probe(n->store, r.prompt, n_prompt), done;
    if (!save) done = kvstore_warm(n->store, r.prompt, n_prompt);
    else {
        if (have < n_prompt / 64 * 64) {   /* compute it: the finished job puts its blocks in the store */
            json_t *o = json_loadb(body, len, 0, NULL);
            json_object_set_new(o, "max_tokens", json_integer(1));
            json_object_del(o, "stream");
            json_object_del(o, "n");
            size_t bl = 0;
            char *b = dn_dump(o, &bl);
            dn_job *j = NULL;
            const char *type = "";
            unsigned st = b ? dn_job_submit(n, b, bl, dn_now(), 0, &j, &type, err, sizeof err) : 500;
            free(b);
            if (st) { dn_req_free(&r); return dn_send_error(n, c, st, type, st == 500 && !j ? "out of memory" : err); }
            j->rid_num = dn_request_id(c, j->rid);
            dn_job_wait(j, INT32_MAX);
            dn_job_free(j);
        }
        done = kvstore_save(n->store, r.prompt, n_prompt);
    }
    dn_req_free(&r);
    if (done < 0) return dn_send_error(n, c, 400, "invalid_request_error", "this node's KV store has no disk tier (--kv-cache-dir)");
    log_info(NULL, "kv store: %s a prefix of %d tokens: %d positions %s", save ? "saved" : "loaded", n_prompt, done,
             save ? "on disk" : "in memory");
    return dn_send_json(c, 200, json_pack("{s:i, s:i, s:s}", "prompt_tokens", n_prompt, "stored_tokens", done,
                                          "tier", save ? "disk" : "ram"));
}

/* POST /v1/tokenize with a generation request's prompt ("prompt" and
 * "chat", "messages" with "tools" and "assistant_prefix", or "tokens") in
 * place of "content": the ids /v1/generate would evaluate, template
 * included (the router counts a prompt's tokens this way). 1 = not such a
 * body (tok_api.c answers), else the status sent. */
static int dn_tokenize_prompt(dnode *n, struct MHD_Connection *c, const char *body, size_t len, enum MHD_Result *mr) {
    json_t *o = json_loadb(body ? body : "", len, JSON_REJECT_DUPLICATES, NULL);
    int mine = json_is_object(o) && !json_object_get(o, "content") &&
               (json_object_get(o, "prompt") || json_object_get(o, "messages") || json_object_get(o, "tokens"));
    if (!mine) { json_decref(o); return 1; }
    dn_req r;
    char err[512];
    memset(&r, 0, sizeof r);
    if (dn_parse_prompt(n, o, &r, err, sizeof err)) {
        json_decref(o);
        dn_req_free(&r);
        *mr = dn_send_error(n, c, 400, "invalid_request_error", err);
        return 400;
    }
    json_decref(o);
    json_t *ids = json_array();
    for (int i = 0; i < r.n_prompt; i++) json_array_append_new(ids, json_integer(r.prompt[i]));
    dn_req_free(&r);
    *mr = dn_send_json(c, 200, json_pack("{s:o}", "tokens", ids));
    return 200;
}

/* POST /v1/tokenize and /v1/detokenize (tok_api.c). */
static enum MHD_Result dn_handle_tokens(dnode *n, struct MHD_Connection *c, int detok, const char *body, size_t len) {
    char err[256], *out = NULL;
    enum MHD_Result mr;
    if (!detok && dn_tokenize_prompt(n, c, body, len, &mr) != 1) return mr;
    int st = detok ? tokapi_detokenize(n->tok, body, len, &out, err, sizeof err)
                   : tokapi_tokenize(n->tok, body, len, &out, err, sizeof err);
    if (st != 200) return dn_send_error(n, c, (unsigned)st, st == 400 ? "invalid_request_error" : "server_error", err);
    return dn_send_body(c, 200, out, strlen(out), "application/json");
}

/* ==== Signed endpoints and token-request bounds ==== */

/* Body bytes a POST /v1/tokenize may carry per context token. English
 * text averages about 4 bytes a token; the costliest realistic text,
 * non-Latin script sent JSON-escaped, is 6 body bytes ("\uXXXX") for a
 * character of about one token, and a whitespace run or a code token
 * rarely passes 16. 24 leaves room above all of them, while a body past
 * n_ctx x 24 bytes cannot fit the context: it is refused unread (413),
 * since tokenizing costs about 53 bytes of memory per input byte (an 8 MB
 * body took 423 MB). */
#define DN_TOK_BODY_PER_TOKEN 24
/* Added to that bound: the JSON around a prompt (keys, "messages"
 * framing, "tools" of a small context) in a model with a tiny n_ctx. */
#define DN_TOK_BODY_SLACK (64 << 10)

/* Endpoints that do work for the router, signed when the node has a
 * secret: all but /health and /metrics (counts and timings, open like
 * the liveness answer). */
static int dn_needs_signature(const char *url) {
    return !strcmp(url, "/v1/generate") || !strcmp(url, "/v1/tokenize") || !strcmp(url, "/v1/detokenize") ||
           !strcmp(url, "/v1/stats") || !strcmp(url, "/v1/cache/save") || !strcmp(url, "/v1/cache/load");
}

/* The body limit of one request: /v1/tokenize's bound by the context,
 * else --max-body-bytes. */
static size_t dn_body_cap(const dnode *n, const char *url) {
    size_t all = (size_t)n->o->max_body_bytes;
    if (strcmp(url, "/v1/tokenize")) return all;
    size_t cap = (size_t)n->n_ctx * DN_TOK_BODY_PER_TOKEN + DN_TOK_BODY_SLACK;
    return cap < all ? cap : all;
}

/* A refused generation request is logged and counted (dn_refuse); the
 * others are only answered. */
typedef enum MHD_Result (*dn_refuse_fn)(dnode *, struct MHD_Connection *, unsigned, const char *, const char *);
static dn_refuse_fn dn_refuser(const char *url) { return strcmp(url, "/v1/generate") ? dn_send_error : dn_refuse; }

/* Per-connection request state: the uploaded body. */
typedef struct {
    strbuf body;
    size_t cap;                  /* dn_body_cap of this request */
    int too_big;
} dn_conn;

enum MHD_Result dn_on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                              const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    dnode *n = cls;
    dn_conn *cc = *con_cls;
    char aerr[256];
    if (!cc) {
        if (!(cc = calloc(1, sizeof *cc))) return MHD_NO;
        *con_cls = cc;
        cc->cap = dn_body_cap(n, url);
        /* headers in: refuse an unsigned request, or one announcing a body
         * past its bound, before reading its body */
        if (n->auth && dn_needs_signature(url) &&
            node_auth_check_request(c, &n->key, n->replay, method, url, NULL, 0, aerr, sizeof aerr))
            return dn_refuser(url)(n, c, 401, "authentication_error", aerr);
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        char *end = NULL;
        unsigned long long want = cl ? strtoull(cl, &end, 10) : 0;
        if (cl && end != cl && want > cc->cap) {
            snprintf(aerr, sizeof aerr, "request body of %llu bytes: more than %zu (%s)", want, cc->cap,
                     strcmp(url, "/v1/tokenize") ? "--max-body-bytes" : "what the context can hold");
            return dn_refuser(url)(n, c, 413, "invalid_request_error", aerr);
        }
        return MHD_YES;
    }
    if (*upload_size) {
        if (cc->body.len + *upload_size > cc->cap) cc->too_big = 1;
        else if (strbuf_put(&cc->body, upload, *upload_size)) cc->too_big = 1;
        *upload_size = 0;
        return MHD_YES;
    }
    int get = !strcmp(method, "GET") || !strcmp(method, "HEAD"), post = !strcmp(method, "POST");
    if (!strcmp(url, "/health")) return get ? dn_handle_health(n, c) : dn_send_error(n, c, 405, "invalid_request_error", "use GET");
    if (!strcmp(url, "/metrics")) return get ? dn_handle_metrics(n, c) : dn_send_error(n, c, 405, "invalid_request_error", "use GET");
    if (!dn_needs_signature(url))
        return dn_send_error(n, c, 404, "not_found", "no such endpoint (try POST /v1/generate, GET /health, GET /v1/stats, GET /metrics)");
    dn_refuse_fn refuse = dn_refuser(url);
    int want_post = strcmp(url, "/v1/stats") != 0;
    if (want_post ? !post : !get) return refuse(n, c, 405, "invalid_request_error", want_post ? "use POST" : "use GET");
    if (cc->too_big) return refuse(n, c, 413, "invalid_request_error", "request body too large");
    if (n->auth) {
        if (node_auth_check_request(c, &n->key, n->replay, method, url, cc->body.p ? cc->body.p : "", cc->body.len,
                                    aerr, sizeof aerr))
            return refuse(n, c, 401, "authentication_error", aerr);
        httpd_trust_peer(c);   /* the router: its address gets the reserved connections (httpd.h) */
    }
    if (!strcmp(url, "/v1/stats")) return dn_handle_stats(n, c);
    if (!strcmp(url, "/v1/generate")) return dn_handle_generate(n, c, cc->body.p, cc->body.len);
    if (!strncmp(url, "/v1/cache/", 10)) return dn_handle_cache(n, c, url[10] == 's', cc->body.p, cc->body.len);
    return dn_handle_tokens(n, c, url[4] == 'd', cc->body.p, cc->body.len);   /* /v1/tokenize, /v1/detokenize */
}

void dn_on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    dn_conn *cc = *con_cls;
    if (!cc) return;
    free(cc->body.p);
    free(cc);
    *con_cls = NULL;
}
