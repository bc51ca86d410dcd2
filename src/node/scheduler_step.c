/* scheduler_step.c - the scheduler thread's steps: one batch built from the
 * running jobs, evaluated without the lock, each job's row sampled (stop
 * strings, logprobs, grammar) and published; speculative steps (drafts
 * asked for, verified, accepted); the thread's loop. */

#include "node/scheduler.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/generate.h"
#include "base/log.h"
#include "engine/spec_sample.h"
#include "engine/tokenizer.h"

#include "node/scheduler_internal.h"

/* ==== Constants ==== */

/* How long the idle scheduler sleeps before looking at the stop flag again. */
#define SCHED_IDLE_MS 200

/* ==== Output ==== */

/* How much of text[0, len) is final: all of it but the longest suffix that
 * is a proper prefix of a stop string (it may yet become one). */
static size_t sched_stable_len(const sched_job *j, size_t len) {
    size_t hold = 0;
    for (int i = 0; i < j->r.n_stop; i++) {
        size_t sl = strlen(j->r.stop[i]);
        for (size_t k = sl - 1 < len ? sl - 1 : len; k > hold; k--)
            if (!memcmp(j->text + len - k, j->r.stop[i], k)) { hold = k; break; }
    }
    return len - hold;
}

/* Appends the token's text and checks the stop strings (scheduler thread,
 * then publishes under mu). Returns 1 if a stop string ended generation. */
static int sched_job_text(sched *s, sched_job *j, int32_t id, size_t *keep) {
    size_t old = j->piece_end && j->v.n_gen > 0 ? j->piece_end[j->v.n_gen - 1] : 0;
    int w = tok_stream_push(&j->ts, id, j->text + old, s->piece_cap);
    size_t len = old + (w > 0 ? (size_t)w : 0);
    j->piece_end[j->v.n_gen] = len;
    *keep = len;
    int hit_any = 0;
    for (int i = 0; i < j->r.n_stop; i++) {
        size_t sl = strlen(j->r.stop[i]);
        size_t from = old + 1 > sl ? old + 1 - sl : 0;   /* a match must end in the new bytes */
        char *hit = len >= sl ? memmem(j->text + from, len - from, j->r.stop[i], sl) : NULL;
        if (hit && (size_t)(hit - j->text) < *keep) { *keep = (size_t)(hit - j->text); hit_any = 1; }
    }
    size_t prev = j->v.n_gen > 0 ? j->stable_end[j->v.n_gen - 1] : 0;
    size_t st = hit_any ? *keep : sched_stable_len(j, len);
    j->stable_end[j->v.n_gen] = st > prev ? st : prev;
    return hit_any;
}

/* The detokenizer's last bytes, once generation is over (no stop string cut them). */
static void sched_job_flush(sched *s, sched_job *j) {
    size_t end = j->v.n_gen > 0 ? j->piece_end[j->v.n_gen - 1] : 0;
    int w = tok_stream_flush(&j->ts, j->text + end, SCHED_FLUSH_BYTES);
    if (w > 0) {
        if (j->v.text_keep == j->v.text_len) j->v.text_keep = end + (size_t)w;
        j->v.text_len = end + (size_t)w;
    }
}

/* Log-softmax of the raw logits at `id`, and the k most likely tokens
 * (insertion into a k-long sorted list: k is at most 20). */
static void sched_logprob_fill(const float *logits, int n_vocab, int32_t id, int k, sched_logprob *out) {
    float mx = logits[0];
    for (int i = 1; i < n_vocab; i++) if (logits[i] > mx) mx = logits[i];
    double sum = 0;
    for (int i = 0; i < n_vocab; i++) sum += exp((double)(logits[i] - mx));
    float lse = mx + (float)log(sum);
    out->logprob = logits[id] - lse;
    out->n_top = 0;
    for (int i = 0; i < n_vocab && k > 0; i++) {
        float v = logits[i];
        if (out->n_top == k && v <= out->top_logprob[k - 1]) continue;
        int p = out->n_top < k ? out->n_top++ : k - 1;
        while (p > 0 && out->top_logprob[p - 1] < v) {
            out->top_logprob[p] = out->top_logprob[p - 1];
            out->top_id[p] = out->top_id[p - 1];
            p--;
        }
        out->top_logprob[p] = v;
        out->top_id[p] = i;
    }
    for (int t = 0; t < out->n_top; t++) out->top_logprob[t] -= lse;
}

/* min_tokens: the end-of-generation tokens and the stop ids cannot be
 * sampled yet (a vocabulary scan: only during the first min_tokens steps). */
static void sched_mask_end(sched *s, sched_job *j) {
    if (!j->r.ignore_eos)
        for (int32_t id = 0; id < s->n_vocab; id++)
            if (tokenizer_is_eog(s->tok, id)) j->logits[id] = -INFINITY;
    for (int i = 0; i < j->r.n_stop_ids; i++) j->logits[j->r.stop_ids[i]] = -INFINITY;
}

/* One sample from the job's fresh logits; mirrors generate_run's order:
 * length check, sample, end-of-generation, text and stop strings. */
static sched_sample sched_job_sample(sched *s, sched_job *j) {
    sched_sample r = { .id = -1 };
    if (j->v.n_gen >= j->r.max_tokens) { r.finish = "length"; return r; }
    if (j->gs) {
        /* nothing can follow a finished output; no token at all can
         * continue only when a size cap of the grammar was reached */
        if (grammar_is_finished(j->gs) || grammar_mask_logits(j->gs, j->r.gvocab, j->logits) == 0) {
            r.finish = "stop";
            return r;
        }
    }
    if (j->v.n_gen < j->r.min_tokens) sched_mask_end(s, j);
    r.id = j->spec_q ? spec_verify_sample(j->smp, j->logits, j->spec_x, j->spec_q, s->spec_p)
                     : sampler_sample(j->smp, j->logits);
    if (j->gs && grammar_accept_token(j->gs, j->r.gvocab, r.id) && !tokenizer_is_eog(s->tok, r.id)) {
        r.finish = "stop";   /* cannot happen: the mask allowed it */
        r.id = -1;
        return r;
    }
    if ((!j->r.ignore_eos || j->gs) && tokenizer_is_eog(s->tok, r.id)) { r.finish = "stop"; r.id = -1; return r; }
    for (int i = 0; i < j->r.n_stop_ids; i++)
        if (r.id == j->r.stop_ids[i]) { r.finish = "stop"; r.id = -1; return r; }
    sampler_accept(j->smp, r.id, 1);
    if (j->dsmp) sampler_accept(j->dsmp, r.id, 1);
    if (j->lp) sched_logprob_fill(j->logits, s->n_vocab, r.id, j->r.logprobs - 1, &j->lp[j->v.n_gen]);
    r.stop_hit = sched_job_text(s, j, r.id, &r.keep);
    if (r.stop_hit) r.finish = "stop";
    else if (j->gs && grammar_is_finished(j->gs)) r.finish = "stop";   /* the output is complete */
    else if (j->v.n_gen + 1 >= j->r.max_tokens) r.finish = "length";
    return r;
}

/* Publishes a sample (caller holds mu). */
static void sched_job_publish(sched *s, sched_job *j, const sched_sample *r) {
    if (r->id >= 0) {
        j->gen[j->v.n_gen] = r->id;
        j->v.n_gen++;
        j->v.text_len = j->piece_end[j->v.n_gen - 1];
        j->v.text_keep = r->stop_hit ? r->keep : j->v.text_len;
        if (j->v.n_gen == 1) j->v.t_first = gen_now_ms();
        j->next_tok = r->id;
        j->v.state = SJ_DECODE;
    }
    if (r->finish) {
        if (!r->stop_hit) sched_job_flush(s, j);
        sched_job_end(s, j, r->finish, NULL);
    }
}

/* ==== One step ==== */

/* Builds the step's batch (caller holds mu): every decoding job's next
 * token, then prompt spans within the budget. Returns the item count. */
static int sched_build_batch(sched *s) {
    int ni = 0, decoding = 0;
    for (int i = 0; i < s->o.n_slots; i++) {
        sched_slot *sl = &s->slots[i];
        sched_job *j = sl->job;
        if (!j || j->loading) continue;   /* the loader ends a loading job */
        if (j->cancelled) { sched_job_end(s, j, "cancelled", NULL); continue; }
        if (j->v.state != SJ_DECODE) continue;
        if (session_pos(sl->s) >= s->o.n_ctx) { sched_job_end(s, j, "length", NULL); continue; }
        s->items[ni] = (model_batch_item){ .s = sl->s, .ids = &j->next_tok, .n = 1, .logits = j->logits };
        s->item_job[ni++] = j;
        decoding++;
    }
    /* Alone, a prompt takes whole passes; beside running streams, the
     * budget bounds how long their next token waits. */
    int budget = decoding ? s->o.prefill_budget : s->o.n_ctx;
    for (int i = 0; i < s->o.n_slots && budget > 0; i++) {
        sched_slot *sl = &s->slots[i];
        sched_job *j = sl->job;
        if (!j || j->v.state != SJ_PROMPT) continue;
        int left = j->r.n_prompt - j->fed;
        int k = left < budget ? left : budget;
        s->items[ni] = (model_batch_item){ .s = sl->s, .ids = j->r.prompt + j->fed, .n = k,
                                           .logits = k == left ? j->logits : NULL };
        s->item_job[ni++] = j;
        budget -= k;
    }
    return ni;
}

/* ==== Speculative steps ==== */

/* Drafts for this step's decoding items (scheduler thread, without the
 * lock): each item of a job whose controller wants k > 0 drafts and that
 * gets some becomes next_tok + drafts, with logits for every row. */
static float *sched_spec_q(sched *s, const sched_slot *sl) {
    if (!s->spec_q) return NULL;
    return s->spec_q + (size_t)(sl - s->slots) * (size_t)(s->spec_rows - 1) * (size_t)s->n_vocab;
}

/* The step's room for a draft model's catch-up, in target rows: the
 * prefill budget less the step's own prompt rows (a step carries no more
 * prompt work than the target alone would), but never under a quarter of
 * it, so a run of new prompts does not hold the drafts back for good. */
static int sched_spec_room(const sched *s, int ni) {
    int prompt = 0;
    for (int k = 0; k < ni; k++)
        if (s->item_job[k]->v.state != SJ_DECODE) prompt += s->items[k].n;
    int room = s->o.prefill_budget - prompt, floor = s->o.prefill_budget / 4;
    return room > floor ? room : floor > 0 ? floor : 1;
}

static void sched_spec_draft(sched *s, int ni) {
    if (!s->o.draft) return;
    int na = 0, n_dec = 0;
    for (int k = 0; k < ni; k++) n_dec += s->item_job[k]->v.state == SJ_DECODE;
    double cost = draft_cost(s->o.draft, spec_cost_row(&s->cost, n_dec, draft_row_prior()));
    for (int k = 0; k < ni; k++) {
        sched_job *j = s->item_job[k];
        j->n_draft = 0;
        j->spec_sampled = 0;
        if (j->v.state != SJ_DECODE) continue;
        sched_slot *sl = j->slot;
        /* the step's tokens must fit the context and max_tokens */
        int room = s->o.n_ctx - sl->n - 1, left = j->r.max_tokens - j->v.n_gen - 1;
        int kmax = s->spec_rows - 1 < room ? s->spec_rows - 1 : room;
        if (left < kmax) kmax = left;
        int want = spec_adapt_k(&j->sa, kmax, cost);
        if (want <= 0) continue;
        sl->tokens[sl->n] = j->next_tok;   /* sl->n < n_ctx: sched_build_batch checked */
        s->asks[na] = (draft_ask){ .slot = (int)(sl - s->slots), .hist = sl->tokens, .n = sl->n + 1, .k = want,
                                   .out = j->spec_ids + 1, .smp = j->dsmp, .q = sched_spec_q(s, sl) };
        s->ask_item[na++] = k;
    }
    if (!na) return;
    draft_propose(s->o.draft, s->asks, na, sched_spec_room(s, ni));
    for (int a = 0; a < na; a++) {
        int k = s->ask_item[a];
        sched_job *j = s->item_job[k];
        if (s->asks[a].n_out <= 0) continue;
        j->n_draft = s->asks[a].n_out;
        j->spec_sampled = s->asks[a].sampled && j->dsmp;
        j->spec_ids[0] = j->next_tok;
        s->items[k].ids = j->spec_ids;
        s->items[k].n = s->items[k].n_logits = 1 + j->n_draft;
    }
}

/* Verification of item k (next_tok + drafts, evaluated): row i is sampled
 * as plain decoding would sample it, and published; while the token equals
 * draft i + 1, that draft's row is valid and row i + 1 follows. The cache
 * keeps the rows up to the last accepted draft. The lock is taken per
 * token (sampling runs without it); the last token's publication may end
 * and free the job, so the slot's bookkeeping comes before it. */
static void sched_spec_accept(sched *s, int k) {
    const model_batch_item *it = &s->items[k];
    sched_job *j = s->item_job[k];
    sched_slot *sl = j->slot;
    const int nd = it->n - 1, pos0 = sl->n;   /* the cache held pos0 positions before the step */
    float *base = j->logits;
    int produced = 0;
    for (int i = 0;; i++) {
        j->logits = base + (size_t)i * (size_t)s->n_vocab;
        j->spec_x = i < nd ? it->ids[i + 1] : -1;
        j->spec_q = j->spec_sampled && i < nd ? sched_spec_q(s, sl) + (size_t)i * (size_t)s->n_vocab : NULL;
        sched_sample r = sched_job_sample(s, j);
        j->spec_q = NULL;
        int last = r.finish || r.id < 0 || i == nd || r.id != it->ids[i + 1];
        produced += r.id >= 0;
        pthread_mutex_lock(&s->mu);
        if (last) {
            j->logits = base;
            session_reset(sl->s, pos0 + i + 1);      /* rejected drafts' rows leave the cache */
            memcpy(sl->tokens + sl->n, it->ids, sizeof(int32_t) * (size_t)(i + 1));
            sl->n += i + 1;
            j->v.drafted += nd;
            j->v.accepted += i;
            spec_adapt_update(&j->sa, nd, i, produced);
            s->spec_steps++;
            s->spec_tokens += (uint64_t)produced;
            s->spec_drafted += (uint64_t)nd;
            s->spec_accepted += (uint64_t)i;
        }
        sched_job_publish(s, j, &r);
        pthread_cond_broadcast(&s->cv_out);
        pthread_mutex_unlock(&s->mu);
        if (last) return;
    }
}

/* After a successful evaluation: samples (without the lock), then token
 * lists, prompt progress and output (with it); verification steps last. */
static void sched_after_eval(sched *s, int ni) {
    for (int k = 0; k < ni; k++) {
        if (!s->items[k].logits || s->items[k].n_logits > 1) continue;
        s->samples[k] = sched_job_sample(s, s->item_job[k]);
        s->samples[k].decode = s->item_job[k]->v.state == SJ_DECODE;
    }
    pthread_mutex_lock(&s->mu);
    for (int k = 0; k < ni; k++) {
        if (s->items[k].n_logits > 1) continue;
        sched_job *j = s->item_job[k];
        sched_slot *sl = j->slot;
        const model_batch_item *it = &s->items[k];
        memcpy(sl->tokens + sl->n, it->ids, sizeof(int32_t) * (size_t)it->n);
        sl->n += it->n;
        if (j->v.state == SJ_PROMPT) {
            j->fed += it->n;
            j->v.computed_local += it->n;
            if (j->fed == j->r.n_prompt) j->v.t_prompt_done = gen_now_ms();
        }
        if (!it->logits) continue;
        if (s->samples[k].decode) {
            int got = s->samples[k].id >= 0;
            spec_adapt_update(&j->sa, 0, 0, got);
            s->spec_steps++;
            s->spec_tokens += (uint64_t)got;
        }
        sched_job_publish(s, j, &s->samples[k]);
    }
    pthread_cond_broadcast(&s->cv_out);
    pthread_mutex_unlock(&s->mu);
    for (int k = 0; k < ni; k++)
        if (s->items[k].n_logits > 1) sched_spec_accept(s, k);
}

static void sched_fail_batch(sched *s, int ni, const char *err) {
    static const char msg[] = "evaluation failed";
    pthread_mutex_lock(&s->mu);
    for (int k = 0; k < ni; k++) {
        sched_job *j = s->item_job[k];
        if (!j->slot) continue;
        session_reset(j->slot->s, j->slot->n);
        sched_job_end(s, j, "error", msg);
    }
    pthread_mutex_unlock(&s->mu);
    log_error(NULL, "evaluation failed: %s", err);
}

static void sched_wait_work(sched *s) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += SCHED_IDLE_MS * 1000000L;
    if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
    pthread_cond_timedwait(&s->cv_work, &s->mu, &ts);
}

void *sched_main(void *arg) {
    sched *s = arg;
    char err[512];
    pthread_mutex_lock(&s->mu);
    while (!s->stopping) {
        sched_admit_queued(s);
        int ni = sched_build_batch(s);
        if (!ni) { sched_wait_work(s); continue; }
        pthread_mutex_unlock(&s->mu);
        sched_spec_draft(s, ni);
        int tokens = 0, prompt = 0;
        for (int k = 0; k < ni; k++) {
            tokens += s->items[k].n;
            prompt |= s->item_job[k]->v.state != SJ_DECODE;
        }
        double t0 = gen_now_ms();
        if (model_eval_batch(s->m, s->items, ni, err, sizeof err)) sched_fail_batch(s, ni, err);
        else {
            /* decode passes only: a prompt chunk's rows cost what a long
             * pass's do, not what a few more rows beside decode rows do */
            if (!prompt) spec_cost_add(&s->cost, tokens, gen_now_ms() - t0);
            sched_after_eval(s, ni);
        }
        pthread_mutex_lock(&s->mu);
        s->steps++;
        s->batched_tokens += (uint64_t)tokens;
    }
    /* shutting down: every job still here ends, but a slot lent to its
     * owner for a remote prefill stays lent until sched_remote_done */
    for (int i = 0; i < s->o.n_slots; i++) {
        sched_job *j = s->slots[i].job;
        if (j && j->v.state != SJ_REMOTE && !j->loading) sched_job_end(s, j, "error", "the server is shutting down");
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}
