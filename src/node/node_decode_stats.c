/* node_decode_stats.c - what the decode node counts and reports: the moving
 * averages, the /metrics families and their updates per job, the job's log
 * line, GET /v1/stats and GET /metrics. */

#include "node/node_decode.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include <jansson.h>
#include <microhttpd.h>

#include "node/draft_remote.h"
#include "net/node_register.h"

#include "node/node_decode_internal.h"

static void dn_ema(double *avg, double x) {
    if (!(x > 0) || !isfinite(x)) return;
    *avg = *avg > 0 ? (1 - DN_EMA_ALPHA) * *avg + DN_EMA_ALPHA * x : x;
}

/* ==== Metrics ==== */

static int dn_metrics_counters(dn_metrics *m, char *err, size_t errlen) {
    static const char *const lm[] = {"model", NULL};
    metrics *g = m->reg;
    return !(m->requests = metrics_counter(g, "tandem_decode_requests_total",
                                           "POST /v1/generate requests by outcome: ok, error, cancelled (client went away), "
                                           "rejected (4xx), busy (503).", (const char *[]){"model", "outcome", NULL}, err, errlen)) ||
           !(m->prompt_tokens = metrics_counter(g, "tandem_decode_prompt_tokens_total", "Prompt tokens of admitted requests.",
                                                lm, err, errlen)) ||
           !(m->reused_tokens = metrics_counter(g, "tandem_decode_prompt_tokens_reused_total",
                                                "Prompt positions taken from a cached prefix instead of computed.", lm, err, errlen)) ||
           !(m->completion_tokens = metrics_counter(g, "tandem_decode_completion_tokens_total", "Generated tokens.",
                                                    lm, err, errlen)) ||
           !(m->prefills = metrics_counter(g, "tandem_decode_prefills_total", "Prompts prefilled, by where: local or remote.",
                                           (const char *[]){"model", "mode", NULL}, err, errlen)) ||
           !(m->fallbacks = metrics_counter(g, "tandem_decode_prefill_fallbacks_total",
                                            "Remote prefills that failed and were done locally.", lm, err, errlen)) ||
           !(m->kv_received = metrics_counter(g, "tandem_decode_kv_received_bytes_total",
                                              "KV cache bytes received from prefill nodes.", lm, err, errlen)) ||
           !(m->steps = metrics_counter(g, "tandem_decode_batch_steps_total", "Model passes of the batching scheduler.",
                                        lm, err, errlen)) ||
           !(m->batched = metrics_counter(g, "tandem_decode_batched_tokens_total", "Tokens those passes evaluated.",
                                          lm, err, errlen));
}

static int dn_metrics_histograms(dn_metrics *m, char *err, size_t errlen) {
    static const char *const lm[] = {"model", NULL};
    metrics *g = m->reg;
    return !(m->queue = metrics_histogram(g, "tandem_decode_queue_seconds", "Arrival to admission into a generation slot.",
                                          lm, metrics_buckets_latency, METRICS_N_LATENCY, err, errlen)) ||
           !(m->ttft = metrics_histogram(g, "tandem_decode_ttft_seconds", "Arrival to the first generated token.",
                                         lm, metrics_buckets_latency, METRICS_N_LATENCY, err, errlen)) ||
           !(m->e2e = metrics_histogram(g, "tandem_decode_request_duration_seconds",
                                        "Arrival to the end of the request (last byte queued), admitted requests.",
                                        lm, metrics_buckets_latency, METRICS_N_LATENCY, err, errlen)) ||
           !(m->prefill = metrics_histogram(g, "tandem_decode_prefill_seconds",
                                            "Admission to the whole prompt in the cache (local or remote).",
                                            lm, metrics_buckets_latency, METRICS_N_LATENCY, err, errlen)) ||
           !(m->tpot = metrics_histogram(g, "tandem_decode_tpot_seconds", "Time per output token after the first.",
                                         lm, metrics_buckets_fast, METRICS_N_FAST, err, errlen));
}

static int dn_metrics_gauges(dn_metrics *m, char *err, size_t errlen) {
    static const char *const lm[] = {"model", NULL};
    metrics *g = m->reg;
    return !(m->slots = metrics_gauge(g, "tandem_decode_slots", "Generation slots (sequences decoded together).",
                                      lm, err, errlen)) ||
           !(m->slots_busy = metrics_gauge(g, "tandem_decode_slots_busy", "Slots running a request now.", lm, err, errlen)) ||
           !(m->queued = metrics_gauge(g, "tandem_decode_queue_depth", "Requests waiting for a slot.", lm, err, errlen)) ||
           !(m->queue_cap = metrics_gauge(g, "tandem_decode_queue_capacity", "Requests that may wait before 503.",
                                          lm, err, errlen)) ||
           !(m->kv_tokens = metrics_gauge(g, "tandem_decode_kv_cache_tokens", "Positions held in the slots' KV caches.",
                                          lm, err, errlen)) ||
           !(m->kv_capacity = metrics_gauge(g, "tandem_decode_kv_cache_capacity_tokens",
                                            "Positions the KV caches can hold (slots x context).", lm, err, errlen)) ||
           !(m->kv_usage = metrics_gauge(g, "tandem_decode_kv_cache_usage_ratio",
                                         "kv_cache_tokens / kv_cache_capacity_tokens.", lm, err, errlen));
}

/* The families, and the series certain to occur created at zero. */
int dn_metrics_init(dn_metrics *m, const decode_node_opts *o, char *err, size_t errlen) {
    if (o->model_name && *o->model_name) snprintf(m->model, sizeof m->model, "%s", o->model_name);
    else node_register_default_model(o->model_path ? o->model_path : "model", m->model, sizeof m->model);
    if (!(m->reg = metrics_new())) { snprintf(err, errlen, "out of memory"); return -1; }
    if (dn_metrics_counters(m, err, errlen) || dn_metrics_histograms(m, err, errlen) || dn_metrics_gauges(m, err, errlen) ||
        spec_metrics_init(&m->spec, m->reg, err, errlen))
        return -1;
    const char *const lm[] = {m->model};
    metrics_family *one[] = {m->prompt_tokens, m->reused_tokens, m->completion_tokens, m->fallbacks, m->kv_received,
                             m->queue, m->ttft, m->e2e, m->prefill, m->tpot};
    for (size_t i = 0; i < sizeof one / sizeof one[0]; i++) metrics_touch(one[i], lm);
    metrics_touch(m->requests, (const char *[]){m->model, "ok"});
    metrics_touch(m->prefills, (const char *[]){m->model, "local"});
    return 0;
}

static void dn_metrics_outcome(dn_metrics *m, const char *outcome) {
    metrics_add(m->requests, (const char *[]){m->model, outcome}, 1);
}

/* A refused POST /v1/generate: 503 busy, else rejected (4xx) or error (5xx). */
void dn_metrics_refused(dn_metrics *m, unsigned status) {
    dn_metrics_outcome(m, status == 503 ? "busy" : status < 500 ? "rejected" : "error");
}

/* A finished job's tokens and times (seconds), then its outcome and
 * end-to-end time (last, so a scrape that sees them sees the rest). */
static void dn_metrics_job(dn_job *j, const char *outcome, double prefill_ms, double gen_ms) {
    dn_metrics *m = &j->n->mt;
    const sched_view *v = j->v;
    const char *const lm[] = {m->model};
    metrics_add(m->completion_tokens, lm, v->n_gen);
    if (v->t_admit > 0) {
        metrics_add(m->prompt_tokens, lm, j->n_prompt);
        metrics_add(m->reused_tokens, lm, v->start_pos);
        metrics_add(m->prefills, (const char *[]){m->model, j->remote ? "remote" : "local"}, 1);
        metrics_observe(m->queue, lm, (v->t_admit - j->t_arrive) / 1e3);
    }
    if (v->t_prompt_done > 0) metrics_observe(m->prefill, lm, prefill_ms / 1e3);
    if (j->remote) metrics_add(m->kv_received, lm, (double)j->hs.kv_bytes);
    if (j->fallback[0]) metrics_add(m->fallbacks, lm, 1);
    if (v->n_gen > 0) metrics_observe(m->ttft, lm, (v->t_first - j->t_arrive) / 1e3);
    if (v->n_gen > 1 && gen_ms > 0) metrics_observe(m->tpot, lm, gen_ms / 1e3 / (v->n_gen - 1));
    dn_metrics_outcome(m, outcome);
    if (v->t_admit > 0) metrics_observe(m->e2e, lm, (dn_now() - j->t_arrive) / 1e3);
}

void dn_count_job(dn_job *j) {
    dnode *n = j->n;
    const sched_view *v = j->v;
    int cancelled = v->state != SJ_DONE, failed = !cancelled && v->finish && !strcmp(v->finish, "error");
    if (cancelled) log_debug(j->rid, "client went away after %d tokens; generation stopped", v->n_gen);
    double prefill_ms = v->t_prompt_done > 0 ? v->t_prompt_done - v->t_admit : 0;
    double gen_ms = v->n_gen > 1 ? dn_now() - v->t_first : 0;
    pthread_mutex_lock(&n->smu);
    n->st.completion_tokens += (uint64_t)v->n_gen;
    if (j->index <= 0) {   /* a sibling choice's request is counted with choice 0 */
        if (cancelled) n->st.cancelled++;
        else if (failed) n->st.failed++;
        else n->st.ok++;
    }
    if (v->t_admit > 0) {
        n->st.prompt_tokens += (uint64_t)j->n_prompt;
        n->st.reused_positions += (uint64_t)v->start_pos;
    }
    if (j->remote) {
        n->st.remote_prefills++;
        n->st.positions_received += (uint64_t)j->hs.n_sent;
        n->st.kv_bytes += j->hs.kv_bytes;
        n->st.wire_bytes += j->hs.wire_bytes;
        if (j->hs.prefill_ms_remote > 0)
            dn_ema(&n->st.prefill_tps_remote, j->hs.n_computed_remote * 1e3 / j->hs.prefill_ms_remote);
        if (j->hs.total_ms > 0) dn_ema(&n->st.handoff_gbps, j->hs.wire_bytes / (j->hs.total_ms * 1e6));
    } else if (v->t_admit > 0) {
        n->st.local_prefills++;
        /* a one-token "prefill" measures decode speed, not prefill speed */
        if (v->computed_local >= 8 && prefill_ms > 0) dn_ema(&n->st.prefill_tps_local, v->computed_local * 1e3 / prefill_ms);
    }
    if (j->fallback[0]) n->st.fallbacks++;
    if (v->n_gen > 1 && gen_ms > 0) dn_ema(&n->st.decode_tps, (v->n_gen - 1) * 1e3 / gen_ms);
    if (v->n_gen > 0) dn_ema(&n->st.ttft_ms, v->t_first - j->t_arrive);
    pthread_mutex_unlock(&n->smu);
    dn_metrics_job(j, cancelled ? "cancelled" : failed ? "error" : "ok", prefill_ms, gen_ms);
}

/* Where the request's cached positions came from: the deepest tier used. */
const char *dn_cache_tier(const sched_view *v) {
    return v->store_disk_tokens ? "disk" : v->store_ram_tokens ? "ram" : v->start_pos ? "slot" : "none";
}

/* The request's one INFO line: tokens, where the prompt came from, times,
 * the model (its /metrics label). */
void dn_log_job(dn_job *j) {
    const sched_view *v = j->v;
    const char *finish = v->state != SJ_DONE ? "cancelled" : v->finish ? v->finish : "stop";
    char spec[96];
    spec_log_fields(spec, sizeof spec, draft_kind(j->n->draft), v);
    log_info(j->rid, "done finish=%s prompt=%d cached=%d tier=%s store_ram=%d store_disk=%d store_ms=%.1f "
             "computed_local=%d prefill=%s%s%s completion=%d queue_ms=%.1f ttft_ms=%.1f total_ms=%.1f model=%s%s%s%s%s%s",
             finish, j->n_prompt, v->start_pos, dn_cache_tier(v), v->store_ram_tokens, v->store_disk_tokens,
             v->store_ms, v->computed_local, j->remote ? "remote" : "local", j->remote ? "@" : "",
             j->remote ? j->node : "", v->n_gen, v->t_admit > 0 ? v->t_admit - j->t_arrive : 0.0,
             v->n_gen > 0 ? v->t_first - j->t_arrive : 0.0, dn_now() - j->t_arrive, j->n->mt.model,
             j->fallback[0] ? " fallback=" : "", j->fallback, v->error ? " error=" : "", v->error ? v->error : "", spec);
}

enum MHD_Result dn_handle_stats(dnode *n, struct MHD_Connection *c) {
    dn_stats s;
    sched_stats ss;
    pthread_mutex_lock(&n->smu);
    s = n->st;
    pthread_mutex_unlock(&n->smu);
    sched_get_stats(n->sc, &ss);
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
    json_object_set_new(o, "busy", json_integer(ss.slots_busy > 0));
    json_object_set_new(o, "slots", json_integer(ss.slots));
    json_object_set_new(o, "slots_busy", json_integer(ss.slots_busy));
    json_object_set_new(o, "queued", json_integer(ss.queued));
    json_object_set_new(o, "queue_max", json_integer(ss.queue_max));
    json_object_set_new(o, "sessions", json_integer(ss.slots));
    json_object_set_new(o, "sessions_used", json_integer(ss.sessions_used));
    json_object_set_new(o, "batch_steps", json_integer((json_int_t)ss.steps));
    json_object_set_new(o, "batched_tokens", json_integer((json_int_t)ss.batched_tokens));
    json_object_set_new(o, "n_ctx", json_integer(n->n_ctx));
    if (n->prefix_ok) json_object_set_new(o, "prefix", dn_prefix_json(n));
    spec_stats_json(o, draft_kind(n->draft), &ss);
    draft_remote_stats_json(o, draft_get_remote(n->draft));
    return dn_send_json(c, 200, o);
}

/* GET /metrics: the scheduler's gauges copied in, then the registry's text.
 * Open like /health: counts and timings only. */
enum MHD_Result dn_handle_metrics(dnode *n, struct MHD_Connection *c) {
    dn_metrics *m = &n->mt;
    const char *const lm[] = {m->model};
    sched_stats ss;
    sched_get_stats(n->sc, &ss);
    metrics_set(m->slots, lm, ss.slots);
    metrics_set(m->slots_busy, lm, ss.slots_busy);
    metrics_set(m->queued, lm, ss.queued);
    metrics_set(m->queue_cap, lm, ss.queue_max);
    metrics_set(m->kv_tokens, lm, (double)ss.cached_tokens);
    metrics_set(m->kv_capacity, lm, (double)ss.capacity_tokens);
    metrics_set(m->kv_usage, lm, ss.capacity_tokens ? (double)ss.cached_tokens / (double)ss.capacity_tokens : 0.0);
    metrics_set(m->steps, lm, (double)ss.steps);
    metrics_set(m->batched, lm, (double)ss.batched_tokens);
    kvstore_metrics_update(n->store, &m->store, m->model);
    spec_metrics_set(&m->spec, m->model, draft_kind(n->draft), &ss);
    size_t len = 0;
    char *text = metrics_render(m->reg, &len);
    return dn_send_body(c, 200, text, len, METRICS_CONTENT_TYPE);
}
