/* scheduler.c - continuous batching for a decode node (see scheduler.h):
 * jobs, creation and teardown, what owners call (submit, wait, release,
 * remote fills, stats) and the slots' prefixes for the prefix report.
 * scheduler_admit.c admits queued jobs into slots (prefix sharing, the KV
 * store's loader), scheduler_step.c runs the steps; scheduler_internal.h
 * between them.
 *
 *
 * Threading: one scheduler thread runs the model; owners (HTTP connection
 * threads) submit, wait and release. `mu` guards the queue, slot
 * assignment, job states and everything a sched_view publishes. The
 * scheduler thread evaluates and samples without the lock: the sessions of
 * running jobs, their samplers and their text state are its own. A job in
 * SJ_REMOTE lends its slot's session to the owner until sched_remote_done.
 * A job admitted with the KV store behind it lends its slot to the loader
 * thread (`loading`) until the stored blocks are in place: the store's
 * lookup, disk reads, checks and copies run off the scheduler's thread and
 * lock, so the other streams keep decoding while a prefix loads.
 * Output arrays are allocated at their final size when the job is created
 * and only appended to, so an owner may read the published prefix after
 * unlocking.
 */
#include "node/scheduler.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/generate.h"
#include "base/prefix_hash.h"
#include "engine/spec_sample.h"
#include "engine/tokenizer.h"

#include "node/scheduler_internal.h"

/* ==== Constants ==== */

/* A sampled sequence's draft sampler seed: the request's seed with these
 * bits flipped, so the draft's draws do not repeat the verifier's. */
#define SCHED_DRAFT_SEED_XOR 0x6a09e667f3bcc908ULL

/* ==== Jobs ==== */

static void sched_job_free(sched_job *j) {
    if (!j) return;
    free(j->r.prompt);
    for (int i = 0; i < j->r.n_stop; i++) free(j->r.stop[i]);
    grammar_state_free(j->gs);
    grammar_free(j->r.grammar);
    sampler_free(j->smp);
    sampler_free(j->dsmp);
    free(j->gen);
    free(j->piece_end);
    free(j->stable_end);
    free(j->lp);
    free(j->text);
    free(j);
}

/* Drops one reference; the caller holds mu. */
void sched_job_unref(sched_job *j) {
    if (--j->refs == 0) sched_job_free(j);
}

static sched_job *sched_job_new(sched *s, sched_req *r) {
    sched_job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->r = *r;
    memset(r, 0, sizeof *r);
    j->cap = j->r.max_tokens < s->o.n_ctx ? j->r.max_tokens : s->o.n_ctx;
    j->text_cap = (size_t)j->cap * s->piece_cap + SCHED_FLUSH_BYTES + 1;
    j->gen = malloc(sizeof(int32_t) * (size_t)(j->cap + 1));
    j->piece_end = malloc(sizeof(size_t) * (size_t)(j->cap + 1));
    j->stable_end = malloc(sizeof(size_t) * (size_t)(j->cap + 1));
    j->text = malloc(j->text_cap);
    j->smp = sampler_new(&j->r.sp, s->n_vocab);
    if (j->r.sp.temp > 0.0f && s->spec_q) {
        /* the draft sampler: the same transforms, its own random stream */
        sampler_params dp = j->r.sp;
        dp.seed ^= SCHED_DRAFT_SEED_XOR;
        if (!(j->dsmp = sampler_new(&dp, s->n_vocab))) { sched_job_free(j); return NULL; }
    }
    if (j->r.logprobs > 1 + SCHED_MAX_TOP_LOGPROBS) j->r.logprobs = 1 + SCHED_MAX_TOP_LOGPROBS;
    if (j->r.logprobs > 0) j->lp = malloc(sizeof(sched_logprob) * (size_t)(j->cap + 1));
    if (!j->gen || !j->piece_end || !j->stable_end || !j->text || !j->smp || (j->r.logprobs > 0 && !j->lp)) {
        sched_job_free(j);
        return NULL;
    }
    j->v.lp = j->lp;
    if (j->r.grammar && (!j->r.gvocab || !(j->gs = grammar_state_new(j->r.grammar)))) { sched_job_free(j); return NULL; }
    /* the repetition penalty's window starts in the prompt */
    for (int i = j->r.n_prompt > 64 ? j->r.n_prompt - 64 : 0; i < j->r.n_prompt; i++) {
        sampler_accept(j->smp, j->r.prompt[i], 0);
        if (j->dsmp) sampler_accept(j->dsmp, j->r.prompt[i], 0);
    }
    j->refs = 2;
    j->v.gen = j->gen;
    j->v.piece_end = j->piece_end;
    j->v.stable_end = j->stable_end;
    j->v.text = j->text;
    j->v.t_submit = gen_now_ms();
    tok_stream_init_prompt(&j->ts, s->tok, j->r.prompt, j->r.n_prompt);
    spec_adapt_init(&j->sa);
    return j;
}

/* Ends a job (caller holds mu): frees its slot for the next one. */
void sched_job_end(sched *s, sched_job *j, const char *finish, const char *error) {
    if (j->v.state == SJ_DONE) return;
    /* the slot's rows outlive it in the store (not while lent to a remote fill) */
    if (s->o.store && j->slot && j->v.state != SJ_REMOTE) {
        session_rows_read(j->slot->s);
        kvstore_put(s->o.store, j->slot->tokens, j->slot->n, session_kv(j->slot->s));
    }
    j->v.state = SJ_DONE;
    j->v.finish = finish;
    j->v.error = error;
    if (j->slot) {
        j->slot->job = NULL;
        j->slot->last_used = ++s->tick;
        j->slot = NULL;
        sched_job_unref(j);              /* the scheduler's reference */
    }
    pthread_cond_broadcast(&s->cv_out);
}

/* ==== Public ==== */

int sched_create(sched **out, model *m, const sched_opts *o, char *err, size_t errlen) {
    *out = NULL;
    sched *s = calloc(1, sizeof *s);
    if (!s) { snprintf(err, errlen, "out of memory"); return -1; }
    s->m = m;
    s->o = *o;
    s->tok = model_get_tokenizer(m);
    s->n_vocab = model_get_hparams(m)->n_vocab;
    s->piece_cap = (size_t)tokenizer_max_token_bytes(s->tok) + 16;
    if (s->o.n_slots < 1) s->o.n_slots = 1;
    if (s->o.prefill_budget < 1) s->o.prefill_budget = 256;
    s->spec_rows = 1 + draft_k_max(s->o.draft);
    spec_cost_init(&s->cost);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv_work, NULL);
    pthread_cond_init(&s->cv_out, NULL);
    pthread_cond_init(&s->cv_load, NULL);
    s->slots = calloc((size_t)s->o.n_slots, sizeof *s->slots);
    s->items = calloc((size_t)s->o.n_slots, sizeof *s->items);
    s->item_job = calloc((size_t)s->o.n_slots, sizeof *s->item_job);
    s->samples = calloc((size_t)s->o.n_slots, sizeof *s->samples);
    s->logits = malloc(sizeof(float) * (size_t)s->n_vocab * (size_t)s->o.n_slots * (size_t)s->spec_rows);
    s->asks = calloc((size_t)s->o.n_slots, sizeof *s->asks);
    s->ask_item = calloc((size_t)s->o.n_slots, sizeof *s->ask_item);
    if (draft_has_model(s->o.draft)) {
        s->spec_q = malloc(sizeof(float) * (size_t)s->n_vocab * (size_t)s->o.n_slots * (size_t)(s->spec_rows - 1));
        s->spec_p = malloc(sizeof(float) * (size_t)s->n_vocab);
        if (!s->spec_q || !s->spec_p) { snprintf(err, errlen, "out of memory"); sched_destroy(s); return -1; }
    }
    if (!s->slots || !s->items || !s->item_job || !s->samples || !s->logits || !s->asks || !s->ask_item) {
        snprintf(err, errlen, "out of memory");
        sched_destroy(s);
        return -1;
    }
    /* every slot's cache exists from the start: a free slot is free KV memory */
    for (int i = 0; i < s->o.n_slots; i++)
        if (sched_slot_prepare(s, &s->slots[i], err, errlen)) { sched_destroy(s); return -1; }
    if (pthread_create(&s->th, NULL, sched_main, s)) {
        snprintf(err, errlen, "cannot start the scheduler thread: %s", strerror(errno));
        sched_destroy(s);
        return -1;
    }
    s->th_started = 1;
    if (s->o.store) {
        if (pthread_create(&s->loader, NULL, sched_loader_main, s)) {
            snprintf(err, errlen, "cannot start the KV store's loader thread: %s", strerror(errno));
            sched_destroy(s);
            return -1;
        }
        s->loader_started = 1;
    }
    *out = s;
    return 0;
}

void sched_stop(sched *s) {
    pthread_mutex_lock(&s->mu);
    s->stopping = 1;
    pthread_cond_broadcast(&s->cv_work);
    pthread_cond_broadcast(&s->cv_out);
    pthread_cond_broadcast(&s->cv_load);
    pthread_mutex_unlock(&s->mu);
    if (s->th_started) pthread_join(s->th, NULL);
    s->th_started = 0;
    /* after the scheduler: a job it admitted last may still be loading */
    if (s->loader_started) pthread_join(s->loader, NULL);
    s->loader_started = 0;
}

void sched_destroy(sched *s) {
    if (!s) return;
    sched_stop(s);
    /* queued jobs: their owners still hold them */
    for (sched_job *j = s->q_head, *nx; j; j = nx) {
        nx = j->next;
        j->v.state = SJ_DONE;
        j->v.finish = "error";
        j->v.error = "the server is shutting down";
        sched_job_unref(j);
    }
    for (int i = 0; s->slots && i < s->o.n_slots; i++) {
        session_free(s->slots[i].s);
        free(s->slots[i].tokens);
    }
    free(s->slots);
    free(s->items);
    free(s->item_job);
    free(s->samples);
    free(s->logits);
    free(s->asks);
    free(s->spec_q);
    free(s->spec_p);
    free(s->ask_item);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv_work);
    pthread_cond_destroy(&s->cv_out);
    pthread_cond_destroy(&s->cv_load);
    free(s);
}

int sched_submit(sched *s, sched_req *r, sched_job **out) {
    *out = NULL;
    pthread_mutex_lock(&s->mu);
    int rc = s->stopping ? -2 : s->queued >= s->o.queue_max ? -1 : 0;
    pthread_mutex_unlock(&s->mu);
    if (rc) {
        free(r->prompt);
        for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
        grammar_free(r->grammar);
        memset(r, 0, sizeof *r);
        return rc;
    }
    sched_job *j = sched_job_new(s, r);
    if (!j) return -1;
    pthread_mutex_lock(&s->mu);
    if (s->stopping) rc = -2;
    else if (s->queued >= s->o.queue_max) rc = -1;
    if (rc) { pthread_mutex_unlock(&s->mu); sched_job_free(j); return rc; }
    if (s->q_tail) s->q_tail->next = j; else s->q_head = j;
    s->q_tail = j;
    s->queued++;
    pthread_cond_signal(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
    *out = j;
    return 0;
}

const sched_view *sched_wait(sched *s, sched_job *j, int have, int timeout_ms) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += timeout_ms / 1000;
    ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
    pthread_mutex_lock(&s->mu);
    while (j->v.state != SJ_DONE && j->v.state != SJ_REMOTE && j->v.n_gen <= have && !s->stopping)
        if (pthread_cond_timedwait(&s->cv_out, &s->mu, &ts) == ETIMEDOUT) break;
    j->snap = j->v;
    pthread_mutex_unlock(&s->mu);
    return &j->snap;
}

session *sched_remote_session(sched_job *j) { return j->slot ? j->slot->s : NULL; }
const int32_t *sched_job_prompt(const sched_job *j) { return j->r.prompt; }

void sched_remote_done(sched *s, sched_job *j, int ok) {
    pthread_mutex_lock(&s->mu);
    if (j->v.state == SJ_REMOTE && j->slot) {
        sched_slot *sl = j->slot;
        int pos = session_pos(sl->s);
        if (!ok || pos < j->fed) { session_reset(sl->s, j->fed); pos = j->fed; }
        /* the received positions join the slot's token list */
        memcpy(sl->tokens + sl->n, j->r.prompt + sl->n, sizeof(int32_t) * (size_t)(pos - sl->n));
        sl->n = pos;
        j->fed = pos;
        j->v.state = SJ_PROMPT;
        if (s->stopping) sched_job_end(s, j, "error", "the server is shutting down");
        pthread_cond_signal(&s->cv_work);
    }
    pthread_mutex_unlock(&s->mu);
}

void sched_release(sched *s, sched_job *j) {
    if (!j) return;
    pthread_mutex_lock(&s->mu);
    if (j->v.state != SJ_DONE) {
        j->cancelled = 1;
        /* a queued job is dropped at the next admission; a running one at the next step */
        pthread_cond_signal(&s->cv_work);
    }
    sched_job_unref(j);
    pthread_mutex_unlock(&s->mu);
}

void sched_get_stats(sched *s, sched_stats *st) {
    memset(st, 0, sizeof *st);
    pthread_mutex_lock(&s->mu);
    st->slots = s->o.n_slots;
    for (int i = 0; i < s->o.n_slots; i++) {
        st->slots_busy += s->slots[i].job != NULL;
        st->cached_tokens += (uint64_t)s->slots[i].n;
    }
    st->capacity_tokens = (uint64_t)s->o.n_slots * (uint64_t)s->o.n_ctx;
    st->queued = s->queued;
    st->queue_max = s->o.queue_max;
    st->sessions_used = s->sessions_used;
    st->steps = s->steps;
    st->batched_tokens = s->batched_tokens;
    st->spec_steps = s->spec_steps;
    st->spec_tokens = s->spec_tokens;
    st->spec_drafted = s->spec_drafted;
    st->spec_accepted = s->spec_accepted;
    pthread_mutex_unlock(&s->mu);
}

/* ==== Prefix report ==== */

int sched_prefix_hashes(sched *s, uint64_t seed, uint64_t *out, int max) {
    int n = 0;
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->o.n_slots && n < max; i++) {
        const sched_slot *sl = &s->slots[i];
        if (!sl->s) continue;
        int k = prefix_hash_blocks(sl->tokens, sl->n, PREFIX_HASH_BLOCK, seed, out + n, max - n);
        if (k > 0) n += k;
    }
    pthread_mutex_unlock(&s->mu);
    return n;
}

session *sched_slot_session(sched *s, int i) {
    return i >= 0 && i < s->o.n_slots ? s->slots[i].s : NULL;
}
