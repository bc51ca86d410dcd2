/* router_responses.c - POST /v1/responses, the OpenAI Responses API
 * (docs/router.md, "/v1/responses"), as a translation onto the chat
 * completions path: the I/O around api/responses_api.c.
 *
 * rt_generate (router_batch.c) calls rt_responses_prepare, which swaps the
 * connection's Responses body for the equivalent chat completions body;
 * that body goes through api_parse_request and the router's ordinary
 * request life (routing, retries, the decode node). rt_responses_run then
 * answers: the chat completion rendered as usual and rewritten as a
 * Response object, or the chat SSE stream rewritten event by event as the
 * Responses event stream.
 *
 * The rule of every router file: the registry, the measured rates and the
 * metrics live under one mutex (router.mu); no lock is held across I/O.
 */
#include "router/router_responses.h"
#include "router/router_request.h"
#include "router/router_stream.h"

struct rt_responses {
    api_responses *api;
    rt_req *q;
    size_t off;                  /* bytes of the events already sent */
    int ended;
};

/* ==== The request ==== */

int rt_responses_prepare(router *r, rt_conn *cc, api_error *e) {
    (void)r;
    char *chat = NULL;
    api_responses *api = NULL;
    if (api_responses_parse(cc->body ? cc->body : "", cc->len, &chat, &api, e)) return -1;
    rt_responses *rs = calloc(1, sizeof *rs);
    if (!rs) {
        free(chat);
        api_responses_free(api);
        api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        return -1;
    }
    rs->api = api;
    free(cc->body);
    cc->body = chat;
    cc->len = cc->cap = strlen(chat);
    cc->responses = rs;
    return 0;
}

void rt_responses_fix_error(api_error *e) { api_responses_fix_error(e); }

void rt_responses_free(rt_responses *rs) {
    if (!rs) return;
    api_responses_free(rs->api);
    free(rs);
}

/* The prompt tokens the decode node already held (usage's cached_tokens). */
static void rs_cached(rt_responses *rs) {
    const rt_req *q = rs->q;
    api_responses_set_cached(rs->api, q->have_fin && q->fin.start_pos > 0 ? q->fin.start_pos : 0);
}

/* ==== The stream ==== */

static ssize_t rs_stream_cb(void *cls, uint64_t pos, char *buf, size_t max) {
    rt_responses *rs = cls;
    rt_req *q = rs->q;
    strbuf *out = api_responses_out(rs->api);
    (void)pos;
    while (rs->off >= out->len) {
        if (rs->ended || out->oom) return MHD_CONTENT_READER_END_OF_STREAM;
        strbuf_reset(out);
        rs->off = 0;
        if (rt_stream_produce(q)) {   /* the chat stream ended */
            rs_cached(rs);
            api_responses_finish(rs->api, q->status == 200);
            rs->ended = 1;
            continue;
        }
        api_responses_feed(rs->api, q->out, q->out_len);
        q->out_off = q->out_len;
    }
    size_t n = out->len - rs->off;
    if (n > max) n = max;
    memcpy(buf, out->p + rs->off, n);
    rs->off += n;
    return (ssize_t)n;
}

static void rs_stream_free(void *cls) {
    rt_responses *rs = cls;
    rt_req *q = rs->q;
    if (!q->logged) {   /* the client went away mid-stream (as rt_stream_free) */
        metrics_add(q->r->m.cancels, NULL, 1);
        if (!q->error[0]) snprintf(q->error, sizeof q->error, "client disconnected");
        q->status = 499;
        rt_log_done(q, "cancelled");
    }
    rt_req_finish(q);
    rt_responses_free(rs);
}

/* ==== Running it ==== */

/* A request that failed before its reply (as router_stream.c's rt_fail). */
static enum MHD_Result rs_fail(rt_req *q, struct MHD_Connection *c, const api_error *e) {
    q->status = e->status;
    if (e->status == 499) {
        metrics_add(q->r->m.cancels, NULL, 1);
        rt_log_done(q, "cancelled");
        return MHD_NO;
    }
    if (!q->error[0]) snprintf(q->error, sizeof q->error, "%s", e->message);
    rt_log_done(q, "failed");
    return rt_send_error(q->r, c, q->ep, e);
}

enum MHD_Result rt_responses_run(rt_req *q, struct MHD_Connection *c, rt_conn *cc) {
    rt_responses *rs = cc->responses;
    cc->responses = NULL;
    rs->q = q;
    char id[64];
    const char *tail = strchr(q->id, '-');   /* chatcmpl-<seq><random>: the same digits */
    snprintf(id, sizeof id, "resp_%s", tail ? tail + 1 : q->id);
    api_responses_start(rs->api, id, q->created, q->req.model);
    api_error e;
    enum MHD_Result mr;
    if (!q->req.stream) {
        if (rt_complete(q, &e)) {
            mr = rs_fail(q, c, &e);
        } else {
            char *bodies[API_MAX_N] = {0};
            rs_cached(rs);
            char *body = rt_render_choices(q, bodies) == 0 ? api_responses_reply(rs->api, bodies[0]) : NULL;
            for (int i = 0; i < q->req.n; i++) free(bodies[i]);
            rt_count_request(q->r, q->ep, body ? 200 : 500);
            mr = body ? rt_reply_json(c, q, q->rid, body) : rt_send(c, 500, "application/json", NULL);
        }
        rt_req_finish(q);
        rt_responses_free(rs);
        return mr;
    }
    if (rt_start(q, &e)) {
        mr = rs_fail(q, c, &e);
        rt_req_finish(q);
        rt_responses_free(rs);
        return mr;
    }
    q->client_fd = -1;   /* MHD notices a closed client when it writes */
    api_responses_begin_stream(rs->api);
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, rs_stream_cb, rs, rs_stream_free);
    if (!resp) { rs_stream_free(rs); return MHD_NO; }
    rt_sse_headers(resp);
    MHD_add_response_header(resp, "X-Request-Id", q->rid);
    mr = MHD_queue_response(c, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    return mr;
}
