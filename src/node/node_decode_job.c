/* node_decode_job.c - one generation on the decode node: a dn_job submitted
 * to the scheduler (with its sibling choices), the remote prefill it may
 * run, the wait for tokens, the result JSON and the streamed NDJSON lines. */

#include "node/node_decode.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include <jansson.h>
#include <microhttpd.h>

#include "engine/generate.h"

#include "node/node_decode_internal.h"

/* ==== Generation jobs ==== */

double dn_now(void) { return gen_now_ms(); }

/* The model's vocabulary index for grammars (built once: ~0.2 s on a
 * 151,936-token vocabulary). NULL with a message. */
static const grammar_vocab *dn_grammar_vocab(dnode *n, char *err, size_t errlen) {
    pthread_mutex_lock(&n->gmu);
    if (!n->gvocab) n->gvocab = grammar_vocab_new(n->tok, err, errlen);
    const grammar_vocab *v = n->gvocab;
    pthread_mutex_unlock(&n->gmu);
    return v;
}

/* Which prefill node this request uses, or NULL for local prefill. */
static const char *dn_pick_node(dnode *n, const dn_req *r) {
    if (n->o->local_only || r->mode == DN_PF_LOCAL) return NULL;
    if (r->node[0]) return r->node;
    if (n->o->n_prefill_nodes == 0) return NULL;
    if (r->mode == DN_PF_AUTO && r->n_prompt < n->min_split) return NULL;
    pthread_mutex_lock(&n->pmu);
    const char *a = n->o->prefill_nodes[n->rr++ % (unsigned)n->o->n_prefill_nodes];
    pthread_mutex_unlock(&n->pmu);
    return a;
}

/* Positions [start_pos, n-1) from a prefill node into the job's slot; on
 * failure the session is back at start_pos. One retry when a reused
 * connection fails at once (the prefill node drops idle connections). */
static int dn_remote_prefill(dn_job *j, session *s, const int32_t *prompt, char *err, size_t errlen) {
    dnode *n = j->n;
    if (chain_spec_is(j->addr)) {   /* a layer-split chain: HOST:PORT/A:B,... (net/chain_spec.h) */
        handoff_opts ho = { .wire_dtype = n->wire_dtype, .zstd = n->o->zstd, .timeout_ms = n->timeout_ms,
                            .deadline_ms = n->o->handoff_deadline_ms, .secret = n->o->secret, .secret_len = n->o->secret_len,
                            .node_id = n->o->node_id ? n->o->node_id : "decode" };
        chain_opts co = { .act_dtype = n->o->act_dtype };
        memset(&j->hs, 0, sizeof j->hs);
        return chain_pool_prefill(n->chains, j->addr, n->m, n->kv_dtype, &ho, &co, j->rid_num, s, prompt, j->n_prompt,
                                  j->v->start_pos, &j->hs, err, errlen);
    }
    prefix_held want = prefix_held_make(prompt, j->n_prompt - 1, n->prefix_seed);
    dn_peer *p = dn_peer_take(n, j->addr, &want);
    if (!p) { prefix_held_clear(&want); snprintf(err, errlen, "every prefill-node connection is in use"); return -1; }
    handoff_opts ho = { .wire_dtype = n->wire_dtype, .zstd = n->o->zstd, .timeout_ms = n->timeout_ms,
                        .deadline_ms = n->o->handoff_deadline_ms, .secret = n->o->secret, .secret_len = n->o->secret_len,
                        .node_id = n->o->node_id ? n->o->node_id : "decode" };
    int rc = -1, start = j->v->start_pos;
    for (int attempt = 0; attempt < 2; attempt++) {
        int fresh = 0;
        if (!p->c) {
            if (handoff_connect(&p->c, j->addr, n->m, n->kv_dtype, &ho, err, errlen)) { p->c = NULL; break; }
            fresh = 1;
        }
        double t0 = dn_now();
        memset(&j->hs, 0, sizeof j->hs);
        handoff_set_log_id(p->c, j->rid_num);
        if (!handoff_prefill(p->c, s, prompt, j->n_prompt, start, &j->hs, err, errlen)) { rc = 0; break; }
        handoff_close(p->c);
        p->c = NULL;
        session_reset(s, start);
        if (fresh || dn_now() - t0 > DN_STALE_RETRY_MS || n->stopping) break;
        log_warn(j->rid, "connection to prefill node %s failed at once (%s); reconnecting", j->addr, err);
    }
    dn_peer_give(n, p, &want);   /* on success its session holds positions [0, n - 1) */
    return rc;
}

/* The scheduler lent us the slot: fill it from the prefill node, or give it
 * back for local prefill with the reason. */
static void dn_job_remote(dn_job *j) {
    dnode *n = j->n;
    char herr[512];
    snprintf(j->node, sizeof j->node, "%s", j->addr);
    if (!dn_remote_prefill(j, sched_remote_session(j->sj), sched_job_prompt(j->sj), herr, sizeof herr)) {
        j->remote = 1;
    } else {
        snprintf(j->fallback, sizeof j->fallback, "%s", herr);
        log_warn(j->rid, "remote prefill on %s failed, prefilling locally: %s", j->addr, herr);
    }
    sched_remote_done(n->sc, j->sj, j->remote);
}

/* Waits for more than `have` tokens or the end, running a remote prefill
 * when the scheduler asks for one; gives up waiting when the node stops. */
const sched_view *dn_job_wait(dn_job *j, int have) {
    for (;;) {
        j->v = sched_wait(j->n->sc, j->sj, have, 100);
        if (j->v->state == SJ_REMOTE) { dn_job_remote(j); continue; }
        if (j->v->state == SJ_DONE || j->v->n_gen > have || j->n->stopping) return j->v;
    }
}

/* Counts the outcome, hands the job back to the scheduler (cancelling it
 * if it still runs: the client went away), frees the request. */

void dn_job_free(dn_job *j) {
    if (!j) return;
    if (j->client) dn_client_put(j->n, j->client);
    for (int i = 0; i < j->n_sib; i++) dn_job_free(j->sib[i]);
    if (j->sj) {
        j->v = sched_wait(j->n->sc, j->sj, INT32_MAX, 0);
        dn_count_job(j);
        dn_log_job(j);
        sched_release(j->n->sc, j->sj);
    }
    free(j->out.p);
    free(j);
}

/* ==== Result JSON ==== */

static json_t *dn_prefill_json(dn_job *j) {
    const sched_view *v = j->v;
    double prefill_ms = v->t_prompt_done > 0 ? v->t_prompt_done - v->t_admit : 0.0;
    json_t *p = json_object();
    json_object_set_new(p, "mode", json_string(j->remote ? "remote" : "local"));
    if (j->node[0]) json_object_set_new(p, "node", json_string(j->node));
    if (j->fallback[0]) json_object_set_new(p, "fallback_reason", dn_json_text(j->fallback, strlen(j->fallback)));
    json_object_set_new(p, "start_pos", json_integer(v->start_pos));
    json_object_set_new(p, "reused_from_other_session", json_boolean(v->reused_from_other));
    json_object_set_new(p, "cache_tier", json_string(dn_cache_tier(v)));
    json_object_set_new(p, "store_ram_tokens", json_integer(v->store_ram_tokens));
    json_object_set_new(p, "store_disk_tokens", json_integer(v->store_disk_tokens));
    json_object_set_new(p, "store_ms", json_real(v->store_ms));
    json_object_set_new(p, "positions_received", json_integer(j->remote ? j->hs.n_sent : 0));
    json_object_set_new(p, "computed_remote", json_integer(j->remote ? j->hs.n_computed_remote : 0));
    json_object_set_new(p, "computed_local", json_integer(v->computed_local));
    json_object_set_new(p, "kv_bytes", json_integer(j->remote ? (json_int_t)j->hs.kv_bytes : 0));
    json_object_set_new(p, "wire_bytes", json_integer(j->remote ? (json_int_t)j->hs.wire_bytes : 0));
    json_object_set_new(p, "prefill_ms", json_real(prefill_ms));
    if (j->remote) {
        json_object_set_new(p, "remote_prefill_ms", json_real(j->hs.prefill_ms_remote));
        json_object_set_new(p, "handoff_ms", json_real(j->hs.total_ms));
        json_object_set_new(p, "transfer_tail_ms", json_real(j->hs.transfer_tail_ms));
    }
    json_object_set_new(p, "queue_ms", json_real(v->t_admit > 0 ? v->t_admit - j->t_arrive : 0.0));
    json_object_set_new(p, "ttft_ms", json_real(v->n_gen > 0 ? v->t_first - j->t_arrive : 0.0));
    return p;
}

/* Fields shared by the final stream line and the non-stream body. */
static void dn_result_fields(dn_job *j, json_t *o) {
    const sched_view *v = j->v;
    json_object_set_new(o, "finish_reason", json_string(v->finish && strcmp(v->finish, "cancelled") ? v->finish : "stop"));
    json_t *u = json_object();
    json_object_set_new(u, "prompt_tokens", json_integer(j->n_prompt));
    json_object_set_new(u, "completion_tokens", json_integer(v->n_gen));
    json_object_set_new(u, "prompt_tokens_details", json_pack("{s:i}", "cached_tokens", v->start_pos));
    json_object_set_new(o, "usage", u);
    json_object_set_new(o, "prefill", dn_prefill_json(j));
    spec_result_json(o, draft_kind(j->n->draft), v);
    if (v->n_gen > 1) {
        double ms = dn_now() - v->t_first;
        json_object_set_new(o, "decode_tps", json_real(ms > 0 ? (v->n_gen - 1) * 1e3 / ms : 0.0));
    }
    if (v->error) json_object_set_new(o, "error", dn_json_text(v->error, strlen(v->error)));
}

char *dn_dump(json_t *o, size_t *len) {
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (s && len) *len = strlen(s);
    return s;
}

static void dn_emit_line(strbuf *out, json_t *o) {
    size_t len = 0;
    char *s = dn_dump(o, &len);
    if (s) { strbuf_put(out, s, len); strbuf_put(out, "\n", 1); }
    free(s);
}

/* A token's text for a logprob entry (raw token bytes, invalid UTF-8 replaced). */
static json_t *dn_token_text(dnode *n, int32_t id) {
    char buf[512];
    int w = tokenizer_token_bytes(n->tok, id, 1, buf, sizeof buf);
    return dn_json_text(buf, w > 0 ? (size_t)w : 0);
}

/* {"logprob", "top_logprobs": [{"id","text","logprob"}...]} members of token k. */
static void dn_logprob_fields(dnode *n, const sched_view *v, int k, json_t *o) {
    const sched_logprob *lp = &v->lp[k];
    json_object_set_new(o, "logprob", json_real(lp->logprob));
    json_object_set_new(o, "token_text", dn_token_text(n, v->gen[k]));
    json_t *a = json_array();
    for (int t = 0; t < lp->n_top; t++) {
        json_t *e = json_object();
        json_object_set_new(e, "id", json_integer(lp->top_id[t]));
        json_object_set_new(e, "text", dn_token_text(n, lp->top_id[t]));
        json_object_set_new(e, "logprob", json_real(lp->top_logprob[t]));
        json_array_append_new(a, e);
    }
    json_object_set_new(o, "top_logprobs", a);
}

/* Lines (into out) for the tokens of choice j published since the last
 * call (its snapshot j->v), then its final line once it is done. */
static void dn_stream_emit(dn_job *j, strbuf *out) {
    const sched_view *v = j->v;
    /* each token line carries the text that became final with it (text that
     * may still start a stop string waits; a stop string is never sent) */
    for (; j->sent < v->n_gen; j->sent++) {
        size_t a = j->sent ? v->stable_end[j->sent - 1] : 0, b = v->stable_end[j->sent];
        json_t *o = json_object();
        if (j->index >= 0) json_object_set_new(o, "index", json_integer(j->index));
        json_object_set_new(o, "token", json_integer(v->gen[j->sent]));
        json_object_set_new(o, "text", dn_json_text(v->text + a, b - a));
        if (v->lp) dn_logprob_fields(j->n, v, j->sent, o);
        dn_emit_line(out, o);
    }
    if (v->state != SJ_DONE && !j->n->stopping) return;
    size_t end = v->n_gen ? v->stable_end[v->n_gen - 1] : 0;
    json_t *o = json_object();
    if (j->index >= 0) json_object_set_new(o, "index", json_integer(j->index));
    json_object_set_new(o, "done", json_true());
    if (v->text_keep > end) json_object_set_new(o, "text", dn_json_text(v->text + end, v->text_keep - end));
    if (v->state != SJ_DONE) {
        static const sched_view stopping = { .state = SJ_DONE, .finish = "error", .error = "the server is shutting down" };
        sched_view cp = *v;
        cp.finish = stopping.finish;
        cp.error = stopping.error;
        j->v = &cp;
        dn_result_fields(j, o);
        j->v = v;
    } else {
        dn_result_fields(j, o);
    }
    dn_emit_line(out, o);
    j->fin_sent = 1;
}

/* Lines for what the scheduler published since the last call: one choice,
 * or all of them (n > 1: they decode in the same steps, so waiting for the
 * first unfinished one and then taking every choice's news loses nothing). */
static void dn_stream_fill(dn_job *j) {
    if (!j->n_sib) {
        dn_job_wait(j, j->sent);
        dn_stream_emit(j, &j->out);
        j->done_sent = j->fin_sent;
        return;
    }
    dn_job *w = NULL;
    for (int i = -1; i < j->n_sib && !w; i++) {
        dn_job *c = i < 0 ? j : j->sib[i];
        if (!c->fin_sent) w = c;
    }
    dn_job_wait(w, w->sent);
    int all = 1;
    for (int i = -1; i < j->n_sib; i++) {
        dn_job *c = i < 0 ? j : j->sib[i];
        if (c->fin_sent) continue;
        if (c != w) c->v = sched_wait(j->n->sc, c->sj, INT32_MAX, 0);
        dn_stream_emit(c, &j->out);
        all &= c->fin_sent;
    }
    j->done_sent = all;
}

/* MHD's content reader: blocks (thread per connection) until there is
 * something to send. */
ssize_t dn_stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    dn_job *j = cls;
    while (j->out_off == j->out.len) {
        j->out.len = j->out_off = 0;
        if (j->done_sent) return MHD_CONTENT_READER_END_OF_STREAM;
        dn_stream_fill(j);
    }
    size_t k = j->out.len - j->out_off;
    if (k > max) k = max;
    memcpy(buf, j->out.p + j->out_off, k);
    j->out_off += k;
    return (ssize_t)k;
}

void dn_stream_free(void *cls) { dn_job_free(cls); }

enum MHD_Result dn_generate_full(dn_job *j, struct MHD_Connection *c) {
    const sched_view *v = j->v;
    while (v->state != SJ_DONE && !j->n->stopping) v = dn_job_wait(j, v->n_gen);
    json_t *o = json_object();
    json_t *toks = json_array();
    for (int i = 0; i < v->n_gen; i++) json_array_append_new(toks, json_integer(v->gen[i]));
    json_object_set_new(o, "tokens", toks);
    json_object_set_new(o, "text", dn_json_text(v->text ? v->text : "", v->text_keep));
    if (v->lp) {
        json_t *lps = json_array();
        for (int i = 0; i < v->n_gen; i++) {
            json_t *e = json_object();
            json_object_set_new(e, "token", json_integer(v->gen[i]));
            dn_logprob_fields(j->n, v, i, e);
            json_array_append_new(lps, e);
        }
        json_object_set_new(o, "logprobs", lps);
    }
    dn_result_fields(j, o);
    unsigned status = v->finish && !strcmp(v->finish, "error") ? 500 : 200;
    dn_job_free(j);
    return dn_send_json(c, status, o);
}

/* Choice i (> 0) of a request: the body parsed again (the prompt, stop
 * strings and grammar are each job's own), sampled with seed0 + i (a given
 * seed replays every choice; temperature > 0 makes them differ), never
 * prefilled remotely: the scheduler holds it until choice 0 has computed
 * the prompt, then copies those KV rows. 0, or the HTTP status with err. */
static unsigned dn_sibling_submit(dnode *n, dn_job *j, const char *body, size_t len, int i, uint64_t seed0,
                                  char *err, size_t errlen, const char **type) {
    dn_req r;
    if (dn_parse_request(n, body, len, &r, err, errlen)) { *type = "invalid_request_error"; return 400; }
    dn_job *c = calloc(1, sizeof *c);
    const grammar_vocab *gv = r.grammar ? dn_grammar_vocab(n, err, errlen) : NULL;
    if (!c || (r.grammar && !gv)) {
        free(c);
        dn_req_free(&r);
        *type = "server_error";
        if (!gv) snprintf(err, errlen, "out of memory");
        return 500;
    }
    c->n = n;
    c->t_arrive = j->t_arrive;
    c->n_prompt = r.n_prompt;
    c->stream = r.stream;
    c->max_tokens = r.max_tokens;
    c->index = i;
    r.sp.seed = (seed0 + (uint64_t)i) & (uint64_t)INT64_MAX;
    sched_req sr = { .prompt = r.prompt, .n_prompt = r.n_prompt, .max_tokens = r.max_tokens,
                     .ignore_eos = r.ignore_eos, .min_tokens = r.min_tokens, .n_stop_ids = r.n_stop_ids, .sp = r.sp, .n_stop = r.n_stop, .logprobs = r.logprobs,
                     .grammar = r.grammar, .gvocab = gv, .sibling = 1 };
    for (int k = 0; k < r.n_stop; k++) sr.stop[k] = r.stop[k];
    memcpy(sr.stop_ids, r.stop_ids, sizeof sr.stop_ids);
    sampler_bias *bias = r.bias;
    memset(&r, 0, sizeof r);
    int a = sched_submit(n->sc, &sr, &c->sj);
    free(bias);
    if (a) {
        free(c);
        *type = a == -1 ? "busy" : "unavailable";
        if (a == -1) snprintf(err, errlen, "too many requests waiting to queue choice %d; try again later", i);
        else snprintf(err, errlen, "the server is shutting down");
        return 503;
    }
    j->sib[j->n_sib++] = c;
    return 0;
}

/* Parses the request and hands it to the scheduler; *out receives the job.
 * Returns 0, or the HTTP status of the error already described in err. */
unsigned dn_job_submit(dnode *n, const char *body, size_t len, double t_arrive, uint64_t client, dn_job **out,
                       const char **type, char *err, size_t errlen) {
    dn_req r;
    *out = NULL;
    if (dn_parse_request(n, body, len, &r, err, errlen)) { *type = "invalid_request_error"; return 400; }
    dn_job *j = calloc(1, sizeof *j);
    if (!j) { dn_req_free(&r); *type = "server_error"; snprintf(err, errlen, "out of memory"); return 500; }
    j->n = n;
    j->t_arrive = t_arrive;
    j->n_prompt = r.n_prompt;
    j->stream = r.stream;
    j->max_tokens = r.max_tokens;
    const char *addr = dn_pick_node(n, &r);
    if (addr) snprintf(j->addr, sizeof j->addr, "%s", addr);
    const grammar_vocab *gv = NULL;
    if (r.grammar && !(gv = dn_grammar_vocab(n, err, errlen))) {
        dn_req_free(&r);
        free(j);
        *type = "server_error";
        return 500;
    }
    sched_req sr = { .prompt = r.prompt, .n_prompt = r.n_prompt, .max_tokens = r.max_tokens,
                     .ignore_eos = r.ignore_eos, .min_tokens = r.min_tokens, .n_stop_ids = r.n_stop_ids, .sp = r.sp, .n_stop = r.n_stop, .want_remote = addr != NULL,
                     .logprobs = r.logprobs, .grammar = r.grammar, .gvocab = gv, .client = client };
    for (int i = 0; i < r.n_stop; i++) sr.stop[i] = r.stop[i];
    memcpy(sr.stop_ids, r.stop_ids, sizeof sr.stop_ids);
    sampler_bias *bias = r.bias;      /* copied by the job's sampler */
    int r_choices = r.n_choices;
    uint64_t seed0 = r.sp.seed;
    memset(&r, 0, sizeof r);          /* the scheduler owns the prompt, stop strings and grammar now */
    int a = sched_submit(n->sc, &sr, &j->sj);
    free(bias);
    if (a) {
        free(j);
        *type = a == -1 ? "busy" : "unavailable";
        snprintf(err, errlen, a == -1 ? "too many requests waiting; try again later" : "the server is shutting down");
        return 503;
    }
    j->index = r_choices > 1 ? 0 : -1;
    for (int i = 1; i < r_choices; i++) {
        unsigned st = dn_sibling_submit(n, j, body, len, i, seed0, err, errlen, type);
        if (st) { dn_job_free(j); return st; }
    }
    *out = j;
    return 0;
}
