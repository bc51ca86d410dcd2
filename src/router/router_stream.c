/* router_stream.c - reading the decode node and answering the client: the
 * upstream reader (one streamed POST /v1/generate through a curl multi
 * handle), tool-call parsing and rendering, the non-streaming reply and the
 * SSE stream.
 *
 * The rule of every router file: the registry, the measured rates and the
 * metrics live under one mutex (router.mu); no lock is held across I/O.
 */
#include "router/router_internal.h"
#include "router/router_cache.h"
#include "router/router_request.h"

/* ==== Upstream: one streamed POST /v1/generate through a curl multi handle ==== */

static size_t rt_up_write(char *p, size_t sz, size_t nm, void *ud) {
    rt_up *u = ud;
    size_t n = sz * nm;
    if (u->off > 0 && u->off == u->len) u->off = u->len = 0;
    if (u->len + n > RT_UP_MAX_BUF) { u->overflow = 1; return 0; }
    if (u->len + n + 1 > u->cap) {
        if (u->off > 0) { memmove(u->buf, u->buf + u->off, u->len - u->off); u->len -= u->off; u->off = 0; }
        size_t cap = u->cap ? u->cap : 4096;
        while (cap < u->len + n + 1) cap *= 2;
        char *b = realloc(u->buf, cap);
        if (!b) return 0;
        u->buf = b;
        u->cap = cap;
    }
    memcpy(u->buf + u->len, p, n);
    u->len += n;
    u->buf[u->len] = 0;
    return n;
}

void rt_up_close(rt_up *u) {
    if (u->multi && u->easy) curl_multi_remove_handle(u->multi, u->easy);
    if (u->easy) curl_easy_cleanup(u->easy);
    if (u->multi) curl_multi_cleanup(u->multi);
    curl_slist_free_all(u->hdrs);
    free(u->body);
    free(u->buf);
    memset(u, 0, sizeof *u);
}

/* key: signs the request for a decode node that authenticates (NULL: unsigned).
 * rid: the request id (log.h), sent as X-Request-Id for the node's log.
 * client: who asked (the client's address; "" none), sent as
 * X-Tandem-Client, which a node with a secret reads on signed requests to
 * hold one client to its --client-share of the slots. */
int rt_up_open(rt_up *u, const char *addr, char *body, int connect_ms, const node_auth_key *key, const char *rid,
               const char *client) {
    memset(u, 0, sizeof *u);
    u->body = body;
    char url[192];
    snprintf(url, sizeof url, "http://%s/v1/generate", addr);
    u->easy = curl_easy_init();
    u->multi = curl_multi_init();
    char xid[32];
    snprintf(xid, sizeof xid, "X-Request-Id: %s", rid);
    u->hdrs = curl_slist_append(NULL, "Content-Type: application/json");
    if (u->hdrs) u->hdrs = curl_slist_append(u->hdrs, xid);
    char xc[96];
    snprintf(xc, sizeof xc, "X-Tandem-Client: %.64s", client ? client : "");
    if (u->hdrs && client && *client) u->hdrs = curl_slist_append(u->hdrs, xc);
    if (!u->easy || !u->multi || !u->hdrs) return -1;
    node_auth_sig sig;
    if (key && (node_auth_sign(key, "POST", "/v1/generate", body, strlen(body), node_auth_now_ms(), &sig) ||
                !(u->hdrs = node_auth_curl_headers(u->hdrs, &sig))))
        return -1;
    curl_easy_setopt(u->easy, CURLOPT_URL, url);
    curl_easy_setopt(u->easy, CURLOPT_POSTFIELDS, u->body);
    curl_easy_setopt(u->easy, CURLOPT_POSTFIELDSIZE, (long)strlen(u->body));
    curl_easy_setopt(u->easy, CURLOPT_HTTPHEADER, u->hdrs);
    curl_easy_setopt(u->easy, CURLOPT_WRITEFUNCTION, rt_up_write);
    curl_easy_setopt(u->easy, CURLOPT_WRITEDATA, u);
    curl_easy_setopt(u->easy, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(u->easy, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(u->easy, CURLOPT_CONNECTTIMEOUT_MS, (long)connect_ms);
    curl_easy_setopt(u->easy, CURLOPT_ERRORBUFFER, u->errbuf);
    curl_easy_setopt(u->easy, CURLOPT_PROXY, "");   /* nodes are reached directly, never through $http_proxy */
    return curl_multi_add_handle(u->multi, u->easy) == CURLM_OK ? 0 : -1;
}

long rt_up_status(rt_up *u) {
    long code = 0;
    curl_easy_getinfo(u->easy, CURLINFO_RESPONSE_CODE, &code);
    return code;
}

/* A client that shut down only its sending side (it has sent the whole
 * request and waits for the answer) looks like POLLRDHUP, exactly as one
 * that closed: only a reset or a fully shut socket counts as gone. A closed
 * streaming client is noticed by the failed write instead. */
static int rt_client_gone(int fd) {
    if (fd < 0) return 0;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLERR));
}

static void rt_up_pump(rt_up *u, int wait_ms) {
    curl_multi_poll(u->multi, NULL, 0, wait_ms, NULL);
    int running = 0, left;
    curl_multi_perform(u->multi, &running);
    CURLMsg *msg;
    while ((msg = curl_multi_info_read(u->multi, &left)))
        if (msg->msg == CURLMSG_DONE) { u->done = 1; u->result = msg->data.result; }
}

/* Next complete line of the reply into *line (NUL-terminated, valid until the
 * next call). Blocks until a line, the end, deadline_ms (monotonic) or the
 * client hanging up (client_fd, -1 = do not watch). A reply with a status
 * other than 200 is read whole and left in the buffer: RT_EOF. */
int rt_up_line(rt_up *u, double deadline_ms, int client_fd, char **line, size_t *len) {
    for (;;) {
        long status = rt_up_status(u);
        int plain = status == 0 || status == 200;
        char *start = u->buf ? u->buf + u->off : NULL;
        char *nl = plain && start ? memchr(start, '\n', u->len - u->off) : NULL;
        if (nl) {
            *nl = 0;
            *line = start;
            *len = (size_t)(nl - start);
            u->off += *len + 1;
            if (*len == 0 || (*len == 1 && start[0] == '\r')) continue;   /* blank keep-alive lines */
            return RT_LINE;
        }
        if (u->done) {
            if (u->result != CURLE_OK || u->overflow) return RT_FAIL;
            if (plain && start && u->len > u->off) {   /* last line without a newline */
                *line = start;
                *len = u->len - u->off;
                u->off = u->len;
                return RT_LINE;
            }
            return RT_EOF;
        }
        double now = rt_now_ms();
        if (now >= deadline_ms) return RT_TIMEOUT;
        if (rt_client_gone(client_fd) || (u->cancel && atomic_load(u->cancel))) return RT_GONE;
        if (u->cut && atomic_load(u->cut)) return RT_CUT;
        int wait = (int)(deadline_ms - now);
        rt_up_pump(u, wait < 100 ? wait : 100);
    }
}

/* ==== Tool calls ==== */

/* Per attempt: the chosen node's template decides the forced-call prefix
 * (tool_choice "required" or named) and how its output is parsed.
 * 0, or -1 with e filled. */
int rt_tools_prepare(rt_req *q, api_error *e) {
    if (!api_tools_active(&q->req)) return 0;
    char name[16];
    pthread_mutex_lock(&q->r->mu);
    snprintf(name, sizeof name, "%s", q->r->nodes[q->decode_idx].chat_format);
    pthread_mutex_unlock(&q->r->mu);
    enum chat_format fmt = tools_format_from_name(name);
    if (fmt == CHAT_NONE) {
        api_error_set(e, 400, "invalid_request_error", "unsupported_parameter", "tools",
                      "Model '%s' has a chat template without tool calls (%s).", q->req.model, name[0] ? name : "unknown");
        return -1;
    }
    api_request *r = &q->req;
    int forced = r->tool_choice == API_TOOLS_REQUIRED || r->tool_choice == API_TOOLS_NAMED;
    free(r->assistant_prefix);
    r->assistant_prefix = forced ? tools_prefix(fmt, r->tool_name, r->tool_name && r->tool_args_fixed) : NULL;
    r->prefix_complete = forced && r->tool_name && r->tool_args_fixed;
    /* one call: a named function, or parallel_tool_calls false; ChatML's
     * closing tag then ends the generation */
    int one = (forced && r->tool_name) || !r->parallel_tool_calls;
    r->call_stop = one && fmt == CHAT_CHATML ? "</tool_call>" : NULL;
    /* a named call's arguments are constrained on the node, which stops
     * once they are complete: the call's closing is ours to add */
    r->call_suffix = forced && r->tool_name && r->tool_args_format && !r->prefix_complete
                   ? (fmt == CHAT_CHATML ? "}\n</tool_call>" : "}") : NULL;
    int ok = 1;
    for (int i = 0; i < r->n; i++) {
        tool_parser_free(q->ch[i].tp);
        q->ch[i].tp = tool_parser_new(fmt, one ? 1 : 0);
        q->ch[i].tp_prefix_fed = 0;
        ok &= q->ch[i].tp != NULL;
    }
    if (!ok || (forced && !r->assistant_prefix)) {
        api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        return -1;
    }
    return 0;
}

/* Parses output text (the prefix first: it is the start of the assistant's
 * message); end flushes. Events into ev; 0 or -1. */
static int rt_tools_feed(rt_req *q, rt_choice *c, const char *text, int end, tool_evs *ev) {
    int bad = 0;
    if (!c->tp_prefix_fed) {
        c->tp_prefix_fed = 1;
        if (q->req.assistant_prefix) bad |= tool_parser_feed(c->tp, q->req.assistant_prefix, strlen(q->req.assistant_prefix), ev);
    }
    if (text) bad |= tool_parser_feed(c->tp, text, strlen(text), ev);
    if (end) bad |= tool_parser_end(c->tp, ev);
    return bad ? -1 : 0;
}

/* A constrained call's arguments ended the generation ("stop"): its
 * closing follows them (not when cut by max_tokens). */
static int rt_tools_close(rt_req *q, rt_choice *c, const char *reason, tool_evs *ev) {
    if (!q->req.call_suffix || strcmp(reason, "stop")) return 0;
    return rt_tools_feed(q, c, q->req.call_suffix, 0, ev);
}

/* OpenAI's finish_reason once calls were made: "tool_calls" unless the
 * generation was cut inside one. Call before the parser's end. */
static const char *rt_tools_finish(rt_choice *c, const char *reason) {
    if (!c->tp || tool_parser_calls(c->tp) == 0) return reason;
    return !strcmp(reason, "stop") || tool_parser_done(c->tp) ? "tool_calls" : reason;
}

static char *rt_tools_chunks(rt_req *q, rt_choice *c, const api_resp_meta *m, const char *text, int end) {
    tool_evs ev = {0};
    char *s = rt_tools_feed(q, c, text, end, &ev) ? NULL : api_render_tool_chunks(m, &ev);
    tool_evs_clear(&ev);
    return s;
}

static char *rt_tools_response(rt_req *q, rt_choice *c, const api_resp_meta *m) {
    tool_evs ev = {0};
    char *s = NULL;
    if (rt_tools_feed(q, c, c->text ? c->text : "", 0, &ev) == 0 && rt_tools_close(q, c, c->finish_reason, &ev) == 0) {
        const char *finish = rt_tools_finish(c, c->finish_reason);
        if (tool_parser_end(c->tp, &ev) == 0)
            s = api_render_tool_response(m, &ev, finish, q->fin.prompt_tokens, q->fin.completion_tokens);
    }
    tool_evs_clear(&ev);
    return s;
}

/* One attempt: open the stream to the chosen node and wait for its first
 * line. 0 = streaming (q->pending holds the first line); 1 = retry on another
 * node; -1 = give up with e filled. */
/* ==== Generation endpoints ==== */

void rt_req_finish(rt_req *q) {
    router *r = q->r;
    if (q->counted_active && q->req.model) {
        const char *outcome = q->status == 200 ? "ok" : q->status == 499 ? "cancelled" : "error";
        metrics_observe(r->m.e2e, (const char *[]){q->req.model, outcome}, (rt_now_ms() - q->t_start) / 1e3);
    }
    if (q->have_fin) api_upstream_line_free(&q->fin);
    if (q->have_pending) api_upstream_line_free(&q->pending);
    rt_release_node(q, 0, 0);
    for (int i = 0; i < API_MAX_N; i++) {
        tool_parser_free(q->ch[i].tp);
        free(q->ch[i].text);
        rt_lp_clear(&q->ch[i]);
        free(q->ch[i].lps);
    }
    rc_prompt_free(q);
    api_request_free(&q->req);
    free(q->out);
    if (q->counted_active) {
        pthread_mutex_lock(&r->mu);
        r->active -= q->counted_active;
        pthread_mutex_unlock(&r->mu);
    }
    free(q);
}

void rt_meta(const rt_req *q, api_resp_meta *m) {
    memset(m, 0, sizeof *m);
    m->id = q->id;
    m->created = q->created;
    m->model = q->req.model;
    m->cached_tokens = q->fin.start_pos;
}

/* Which nodes serve the request, for clients that report it (tandem grade):
 * the decode node, the plan (split = a prefill node computes the prompt) and
 * that prefill node. A non-stream reply also says where the prompt was
 * actually prefilled (a split can fall back to local). */
static void rt_node_headers(struct MHD_Response *resp, const rt_req *q) {
    MHD_add_response_header(resp, "X-Request-Id", RT_ECHO_ID(q));
    char v[32];
    MHD_add_response_header(resp, "X-Tandem-Decode-Node", q->decode_addr);
    MHD_add_response_header(resp, "X-Tandem-Prefill-Plan", q->dec.split ? "split" : "local");
    if (q->dec.split) MHD_add_response_header(resp, "X-Tandem-Prefill-Node", q->prefill_addr);
    /* the decision's reason key (as in the metrics), the prompt length it
     * used and how it was counted, and the plan's estimated prefill time */
    MHD_add_response_header(resp, "X-Tandem-Prefill-Reason", q->dec.key ? q->dec.key : "-");
    snprintf(v, sizeof v, "%d", q->n_prompt);
    MHD_add_response_header(resp, "X-Tandem-Prompt-Tokens", v);
    MHD_add_response_header(resp, "X-Tandem-Token-Count", q->count_exact ? "exact" : "estimate");
    snprintf(v, sizeof v, "%.1f", q->dec.split ? q->dec.est_split_ms : q->dec.est_local_ms);
    MHD_add_response_header(resp, "X-Tandem-Prefill-Estimate-Ms", v);
    if (q->have_fin && q->fin.prefill_mode[0]) {
        MHD_add_response_header(resp, "X-Tandem-Prefill", strcmp(q->fin.prefill_mode, "remote") ? "local" : "split");
        MHD_add_response_header(resp, "X-Tandem-Prefill-Outcome", q->fin.fallback_reason[0] ? "fallback"
                                : rt_pf_names[rt_prefill_outcome(&q->fin)]);
        snprintf(v, sizeof v, "%.1f", q->fin.prefill_ms);
        MHD_add_response_header(resp, "X-Tandem-Prefill-Ms", v);
        if (!strcmp(q->fin.prefill_mode, "remote")) {
            snprintf(v, sizeof v, "%.1f", q->fin.remote_prefill_ms);
            MHD_add_response_header(resp, "X-Tandem-Remote-Prefill-Ms", v);
        }
    }
}

/* Takes one line of a non-stream attempt (freeing it): 1 read on, 0 every
 * choice is done, -1 the attempt failed (q->error says why when it can). */
static int rt_collect(rt_req *q, api_upstream_line *u) {
    rt_choice *c = rt_choice_of(q, u);
    int rc = 1;
    if (!c) {
        rc = -1;
    } else if (u->is_token) {
        if (u->index == 0) rt_on_token(q, u);
        c->n_tokens++;
        rt_text_add(c, u->text);
        if (u->logprob) rt_lp_add(c, u);
    } else if (!strcmp(u->finish_reason, "error")) {
        rc = -1;
        if (!q->have_fin) { q->fin = *u; q->have_fin = 1; memset(u, 0, sizeof *u); }   /* its figures for the log */
    } else {
        /* the final line releases text held back while it could have
         * started a stop string, and the detokenizer's last bytes */
        rt_text_add(c, u->text);
        rt_choice_end(q, c, u);
        rc = q->n_done < q->req.n;
    }
    api_upstream_line_free(u);
    return rc;
}

/* One choice of the non-stream reply (its meta's index set by the caller). */
static char *rt_render_choice(rt_req *q, rt_choice *c, api_resp_meta *m) {
    if (q->req.echo) {
        char *t = c->text;
        c->text = NULL; c->text_len = c->text_cap = 0;
        rt_text_add(c, q->req.prompt);
        rt_text_add(c, t);
        free(t);
    }
    char *lp = c->n_lps ? api_render_logprobs(q->req.kind, c->lps, c->n_lps,
                                              q->req.echo && q->req.prompt ? strlen(q->req.prompt) : 0) : NULL;
    m->logprobs = lp;
    char *body = c->tp ? rt_tools_response(q, c, m)
               : api_render_response(q->req.kind, m, c->text ? c->text : "", c->finish_reason,
                                     q->fin.prompt_tokens, q->fin.completion_tokens);
    free(lp);
    m->logprobs = NULL;
    return body;
}

/* q's choices rendered one by one into bodies[0..n) (their indices from
 * q->index_base); 0, or -1 when one could not be rendered. */
int rt_render_choices(rt_req *q, char **bodies) {
    api_resp_meta m;
    rt_meta(q, &m);
    int ok = 1;
    for (int i = 0; i < q->req.n; i++) {
        m.index = q->index_base + i;
        m.cached_tokens = i == 0 ? q->fin.start_pos : 0;   /* merged replies sum them: once per prompt */
        ok &= (bodies[i] = rt_render_choice(q, &q->ch[i], &m)) != NULL;
    }
    return ok ? 0 : -1;
}

/* The whole non-stream reply: n choices rendered one by one, then merged. */
static char *rt_render_reply(rt_req *q) {
    char *bodies[API_MAX_N] = {0};
    int ok = rt_render_choices(q, bodies) == 0;
    if (q->req.n == 1) return bodies[0];
    char *body = ok ? api_merge_responses(bodies, q->req.n, q->fin.prompt_tokens, q->fin.completion_tokens) : NULL;
    for (int i = 0; i < q->req.n; i++) free(bodies[i]);
    return body;
}

/* Non-stream: reads every choice; a node failing mid-way is retried from
 * scratch (the client has seen nothing yet). 0 (learnt from and logged), or
 * -1 with e filled. */
int rt_complete(rt_req *q, api_error *e) {
    router *r = q->r;
    for (;;) {
        if (rt_start(q, e)) return -1;
        api_upstream_line u;
        int rc = 1, more = 1;
        while (more > 0 && (rc = rt_next(q, &u)) == 1) more = rt_collect(q, &u);
        if (more == 0) {
            rt_learn(q);
            q->status = 200;
            rt_log_done(q, "done");
            return 0;
        }
        if (rc < 0) {
            snprintf(q->error, sizeof q->error, "client disconnected");
            api_error_set(e, 499, "invalid_request_error", NULL, NULL, "client disconnected");
            return -1;
        }
        if (q->cut) { rt_ops_cut_error(e, 0); return -1; }   /* the drain's deadline: no retry */
        /* failed mid-way: drop what we have and retry */
        if (q->have_fin) { api_upstream_line_free(&q->fin); q->have_fin = 0; memset(&q->fin, 0, sizeof q->fin); }
        rt_choices_reset(q);
        q->n_tokens = 0;
        q->t_first = 0;
        rt_check_dead(q);
        rt_release_node(q, 1, 0);
        log_warn(q->rid, "%s; retrying", q->error);
        metrics_add(r->m.retries, NULL, 1);
    }
}

/* A request that failed before its reply: logged and counted; the error
 * goes to the client unless it went away (499: the connection is closed). */
static enum MHD_Result rt_fail(rt_req *q, struct MHD_Connection *c, const api_error *e) {
    router *r = q->r;
    q->status = e->status;
    enum MHD_Result mr;
    if (e->status == 499) {
        metrics_add(r->m.cancels, NULL, 1);
        rt_log_done(q, "cancelled");
        mr = MHD_NO;   /* nobody to answer: close the connection */
    } else {
        if (!q->error[0]) snprintf(q->error, sizeof q->error, "%s", e->message);
        rt_log_done(q, "failed");
        mr = rt_send_error(r, c, q->ep, e);
    }
    return mr;
}

/* A JSON reply (taken: body is freed) with the routing headers of q, or of
 * none when q is NULL (several prompts: each went its own way). */
enum MHD_Result rt_reply_json(struct MHD_Connection *c, const rt_req *q, const char *rid, char *body) {
    struct MHD_Response *resp = body ? MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE) : NULL;
    if (!resp) { free(body); return MHD_NO; }
    MHD_add_response_header(resp, "Content-Type", "application/json");
    if (q) rt_node_headers(resp, q);
    else MHD_add_response_header(resp, "X-Request-Id", rid);
    enum MHD_Result mr = MHD_queue_response(c, 200, resp);
    MHD_destroy_response(resp);
    return mr;
}

enum MHD_Result rt_run_blocking(rt_req *q, struct MHD_Connection *c) {
    api_error e;
    enum MHD_Result mr;
    if (rt_complete(q, &e)) {
        mr = rt_fail(q, c, &e);
    } else {
        rt_count_request(q->r, q->ep, 200);
        mr = rt_reply_json(c, q, q->rid, rt_render_reply(q));
    }
    rt_req_finish(q);
    return mr;
}

int rt_out_set(rt_req *q, char *s) {
    if (!s) return -1;
    free(q->out);
    q->out = s;
    q->out_len = strlen(s);
    q->out_off = 0;
    return 0;
}


/* A streamed token of choice c: its chunk (the role delta first for chat,
 * the echoed prompt first for completions). */
static char *rt_stream_token(rt_req *q, rt_choice *c, const api_resp_meta *m, api_upstream_line *u) {
    int first = c->n_tokens == 0;
    if (u->index == 0) rt_on_token(q, u);
    c->n_tokens++;
    char *lp = u->logprob && !c->tp ? api_render_logprobs(q->req.kind, &u->logprob, 1, c->lp_offset) : NULL;
    api_resp_meta ml = *m;
    ml.logprobs = lp;
    char *s = c->tp ? rt_tools_chunks(q, c, m, u->text, 0) : api_render_chunk(q->req.kind, &ml, u->text ? u->text : "", NULL, 0);
    free(lp);
    c->lp_offset += u->text ? strlen(u->text) : 0;
    if (first && q->req.kind == API_CHAT) s = api_concat(api_render_chunk(API_CHAT, m, "", NULL, 1), s);
    if (first && q->req.echo) s = api_concat(api_render_chunk(API_COMPLETION, m, q->req.prompt, NULL, 0), s);
    return s;
}

/* Choice c's final line: the text it released, then its finish chunk. */
static char *rt_stream_choice_end(rt_req *q, rt_choice *c, const api_resp_meta *m, api_upstream_line *u) {
    char *s;
    if (c->tp) {
        /* as in rt_tools_response: the finish reason is decided once the
         * last text and the call's closing are fed, before the parser's end
         * flushes (a call forced whole has no token: its text comes on this
         * line, and deciding before it said "length" where the same request
         * not streamed says "tool_calls") */
        char *feed = rt_tools_chunks(q, c, m, u->text, 0);
        tool_evs ev = {0};
        int bad = rt_tools_close(q, c, u->finish_reason, &ev);
        const char *finish = rt_tools_finish(c, u->finish_reason);
        char *close = bad || tool_parser_end(c->tp, &ev) ? NULL : api_render_tool_chunks(m, &ev);
        tool_evs_clear(&ev);
        feed = api_concat(feed, close);
        s = api_concat(feed, api_render_chunk(q->req.kind, m, NULL, finish, 0));
    } else {
        s = api_render_chunk(q->req.kind, m, NULL, u->finish_reason, 0);
        /* text released by the final line (held back while it could have
         * started a stop string) goes out before the finish chunk */
        if (u->text && *u->text) s = api_concat(api_render_chunk(q->req.kind, m, u->text, NULL, 0), s);
    }
    if (c->n_tokens == 0 && q->req.kind == API_CHAT) s = api_concat(api_render_chunk(API_CHAT, m, "", NULL, 1), s);
    rt_choice_end(q, c, u);
    return s;
}

/* Where the prompt was prefilled, as a final SSE comment (clients skip
 * comments; docs/router.md): a stream's headers go out with its first token
 * and can only name the plan, while the outcome (a split that fell back to
 * the decode node, its reason) is known from the final line:
 *   : tandem prefill=fallback plan=split decode=H:P prefill_node=H:P reason="..."
 * One prompt of several (a prompt array) says which: prompt_index=k after
 * prefill=. NULL when out of memory. */
char *rt_prefill_comment(const rt_req *q) {
    const api_upstream_line *f = &q->fin;
    const char *pf = !q->have_fin || !f->prefill_mode[0] ? "-" : f->fallback_reason[0] ? "fallback"
                   : rt_pf_names[rt_prefill_outcome(f)];
    char why[300] = "";
    /* one line: no CR/LF (they would end the comment), no quote */
    snprintf(why, sizeof why, "%s", q->have_fin ? f->fallback_reason : "");
    for (char *c = why; *c; c++)
        if (*c == '\r' || *c == '\n' || *c == '"') *c = ' ';
    char *s = malloc(800);
    if (!s) return NULL;
    char part[32] = "";
    if (q->batch) snprintf(part, sizeof part, " prompt_index=%d", rt_kid_index(q));
    snprintf(s, 800, ": tandem prefill=%s%s plan=%s decode=%s%s%s%s%s%s\n\n", pf, part, q->dec.split ? "split" : "local",
             q->decode_addr, q->dec.split ? " prefill_node=" : "", q->dec.split ? q->prefill_addr : "",
             why[0] ? " reason=\"" : "", why, why[0] ? "\"" : "");
    return s;
}

/* Produces the next SSE bytes into q->out; 0, or -1 at the end of stream. */
int rt_stream_produce(rt_req *q) {
    if (q->phase == 1) return -1;
    api_resp_meta m;
    rt_meta(q, &m);
    api_upstream_line u;
    int rc = rt_next(q, &u);
    rt_choice *c = NULL;
    if (rc == 1 && !(c = rt_choice_of(q, &u))) { api_upstream_line_free(&u); rc = 0; }
    if (c) m.index = q->index_base + u.index;
    if (rc == 1 && u.is_token) {
        char *s = rt_stream_token(q, c, &m, &u);
        api_upstream_line_free(&u);
        return rt_out_set(q, s) ? -1 : 0;
    }
    router *r = q->r;
    if (rc == 1 && strcmp(u.finish_reason, "error")) {
        char *s = rt_stream_choice_end(q, c, &m, &u);
        api_upstream_line_free(&u);
        if (q->n_done < q->req.n) return rt_out_set(q, s) ? -1 : 0;
        q->phase = 1;
        rt_learn(q);
        q->status = 200;
        if (!q->batch) {   /* a batch ends the stream once every prompt is done */
            m.cached_tokens = q->fin.start_pos;
            if (q->req.include_usage)
                s = api_concat(s, api_render_usage_chunk(q->req.kind, &m, q->fin.prompt_tokens, q->fin.completion_tokens));
            s = api_concat(s, rt_prefill_comment(q));
            s = api_concat(s, strdup("data: [DONE]\n\n"));
            rt_count_request(r, q->ep, 200);
        }
        rt_log_done(q, "done");
        return rt_out_set(q, s) ? -1 : 0;
    }
    q->phase = 1;
    if (rc == 1) {
        if (!q->have_fin) { q->fin = u; q->have_fin = 1; }   /* its figures for the log */
        else api_upstream_line_free(&u);
    }
    if (rc < 0) {
        snprintf(q->error, sizeof q->error, "client disconnected");
        return -1;
    }
    /* After tokens went out, a failure can only be reported in the stream:
     * an error event, then [DONE], so that no client takes a cut answer
     * for a whole one (a batch's stream ends in router_batch.c). */
    api_error e;
    if (q->cut) rt_ops_cut_error(&e, q->n_tokens);
    else api_error_set(&e, 502, "server_error", "upstream_failed", NULL,
                       "The decode node failed after %d tokens were streamed: %s", q->n_tokens, q->error);
    q->status = e.status;
    rt_check_dead(q);
    metrics_add(r->m.stream_errors, NULL, 1);
    if (!q->batch) rt_count_request(r, q->ep, e.status);
    rt_log_done(q, q->cut ? "cut by shutdown" : "stream error");
    char *s = api_render_error_event(&e);
    if (!q->batch) s = api_concat(s, strdup("data: [DONE]\n\n"));
    return rt_out_set(q, s) ? -1 : 0;
}

/* Up to max bytes of q's pending stream output into buf. */
ssize_t rt_out_take(rt_req *q, char *buf, size_t max) {
    size_t n = q->out_len - q->out_off;
    if (n > max) n = max;
    memcpy(buf, q->out + q->out_off, n);
    q->out_off += n;
    return (ssize_t)n;
}

static ssize_t rt_stream_cb(void *cls, uint64_t pos, char *buf, size_t max) {
    rt_req *q = cls;
    while (q->out_off >= q->out_len) {
        if (rt_stream_produce(q)) return MHD_CONTENT_READER_END_OF_STREAM;
    }
    return rt_out_take(q, buf, max);
}

static void rt_stream_free(void *cls) {
    rt_req *q = cls;
    if (!q->logged) {
        /* The client went away mid-stream (MHD could not write): closing the
         * upstream connection tells the decode node to stop. */
        metrics_add(q->r->m.cancels, NULL, 1);
        if (!q->error[0]) snprintf(q->error, sizeof q->error, "client disconnected");
        q->status = 499;
        rt_log_done(q, "cancelled");
    }
    rt_req_finish(q);
}

/* A server-sent event stream, not to be cached or buffered by a proxy. */
void rt_sse_headers(struct MHD_Response *resp) {
    MHD_add_response_header(resp, "Content-Type", "text/event-stream");
    MHD_add_response_header(resp, "Cache-Control", "no-cache");
    MHD_add_response_header(resp, "X-Accel-Buffering", "no");
}

enum MHD_Result rt_run_stream(rt_req *q, struct MHD_Connection *c) {
    api_error e;
    if (rt_start(q, &e)) {
        enum MHD_Result mr = rt_fail(q, c, &e);
        rt_req_finish(q);
        return mr;
    }
    /* The status line goes out now: from here errors travel as SSE events. */
    q->client_fd = -1;   /* MHD notices a closed client when it writes */
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, rt_stream_cb, q, rt_stream_free);
    if (!resp) { rt_req_finish(q); return MHD_NO; }
    rt_sse_headers(resp);
    rt_node_headers(resp, q);
    enum MHD_Result mr = MHD_queue_response(c, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    return mr;
}
