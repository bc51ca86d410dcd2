/* scheduler.c - continuous batching for a decode node (see scheduler.h).
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
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/generate.h"
#include "base/log.h"
#include "base/prefix_hash.h"
#include "engine/spec_sample.h"
#include "engine/tokenizer.h"

/* ==== Constants ==== */

/* Bytes one flush of the detokenizer can add at the end of a stream. */
#define SCHED_FLUSH_BYTES 32
/* How long the idle scheduler sleeps before looking at the stop flag again. */
#define SCHED_IDLE_MS 200
/* A sampled sequence's draft sampler seed: the request's seed with these
 * bits flipped, so the draft's draws do not repeat the verifier's. */
#define SCHED_DRAFT_SEED_XOR 0x6a09e667f3bcc908ULL

/* ==== State ==== */

/* What one sample decided (computed without the lock, published with it). */
typedef struct {
    int32_t id;              /* -1: no new token */
    const char *finish;
    int stop_hit;
    size_t keep;
    int decode;              /* the job was decoding (not reading its prompt) */
} sched_sample;

typedef struct {
    session *s;
    int32_t *tokens;         /* ids whose K/V are in the cache: tokens[0..n), n == session_pos */
    int n;
    uint64_t last_used;
    sched_job *job;          /* running job, or NULL when idle */
} sched_slot;

struct sched_job {
    sched_req r;
    sched_view v;            /* published fields (under mu) */
    sched_view snap;         /* the owner's copy, from sched_wait */
    int refs;                /* owner + scheduler */
    int cancelled;           /* the owner let go before the end */
    sched_slot *slot;
    struct sched_job *next;  /* queue link */
    /* scheduler thread only */
    sampler *smp;
    grammar_state *gs;       /* constrained decoding, or NULL */
    tok_stream ts;
    int32_t *gen;
    size_t *piece_end, *stable_end;
    sched_logprob *lp;       /* [cap] when logprobs were asked for */
    char *text;
    size_t text_cap;
    int cap;                 /* tokens that can be generated */
    int fed;                 /* prompt tokens in the cache (state SJ_PROMPT) */
    int32_t next_tok;        /* SJ_DECODE: the token to evaluate next */
    int loading;             /* (mu) admitted, state still SJ_QUEUED: 1 waits for the
                              * loader, 2 its slot is the loader's (nobody else
                              * touches the session or ends the job) */
    float *logits;           /* [spec_rows][n_vocab] while in a batch */
    /* speculative decoding (spec.h): this step's rows (next_tok, then the
     * drafts) and the draft length's controller */
    int n_draft;
    int32_t spec_ids[1 + SPEC_MAX_DRAFT];
    spec_adapt sa;
    /* sampled drafts (engine/spec_sample.h): the draft sampler (NULL when
     * greedy or without a draft model), whether this step's drafts were
     * drawn from q, and the row being verified's draft and q (NULL: plain) */
    sampler *dsmp;
    int spec_sampled;
    int32_t spec_x;
    const float *spec_q;
};

struct sched {
    model *m;
    sched_opts o;
    const tokenizer *tok;
    int n_vocab;
    size_t piece_cap;
    sched_slot *slots;
    pthread_mutex_t mu;
    pthread_cond_t cv_work;  /* the scheduler: new job, remote done, cancel, stop */
    pthread_cond_t cv_out;   /* owners: new output or state */
    sched_job *q_head, *q_tail;
    int queued, stopping, sessions_used;
    uint64_t tick, steps, batched_tokens;
    pthread_t th;
    int th_started;
    /* one step's scratch (scheduler thread) */
    model_batch_item *items;
    sched_job **item_job;
    sched_sample *samples;
    /* the store's loader thread: fills slots of jobs admitted with
     * `loading` (kvstore_fill without mu), then starts their prompts */
    pthread_t loader;
    int loader_started;
    pthread_cond_t cv_load;  /* the loader: a job to fill, or stop */
    float *logits;           /* [n_slots][spec_rows][n_vocab] */
    int spec_rows;           /* rows of logits a decode step may want: 1 + drafts */
    draft_ask *asks;         /* [n_slots] */
    int *ask_item;           /* [n_slots] */
    spec_cost cost;          /* passes timed against their rows (scheduler thread) */
    float *spec_q;           /* [n_slots][spec_rows - 1][n_vocab] sampled drafts' q, or NULL */
    float *spec_p;           /* [n_vocab] the verified row's p */
    uint64_t spec_steps, spec_tokens, spec_drafted, spec_accepted;   /* (mu) */
};

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
static void sched_job_unref(sched_job *j) {
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
static void sched_job_end(sched *s, sched_job *j, const char *finish, const char *error) {
    if (j->v.state == SJ_DONE) return;
    /* the slot's rows outlive it in the store (not while lent to a remote fill) */
    if (s->o.store && j->slot && j->v.state != SJ_REMOTE)
        kvstore_put(s->o.store, j->slot->tokens, j->slot->n, session_kv(j->slot->s));
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

/* ==== Slots and prefix sharing ==== */

static int sched_common_prefix(const int32_t *a, int na, const int32_t *b, int nb) {
    int i = 0;
    while (i < na && i < nb && a[i] == b[i]) i++;
    return i;
}

static int sched_slot_prepare(sched *s, sched_slot *sl, char *err, size_t errlen) {
    if (sl->s) return 0;
    if (session_new(&sl->s, s->m, s->o.n_ctx, s->o.kv_dtype, err, errlen)) return -1;
    if (!(sl->tokens = malloc(sizeof(int32_t) * (size_t)s->o.n_ctx))) {
        session_free(sl->s);
        sl->s = NULL;
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    sl->n = 0;
    s->sessions_used++;
    return 0;
}

/* The idle slot for a prompt: the one sharing the longest prefix when it is
 * worth it (all of that slot's tokens, or at least min_reuse), else an
 * unused one, else the least recently used. NULL when every slot runs. */
static sched_slot *sched_slot_pick(sched *s, const int32_t *ids, int n) {
    sched_slot *best = NULL, *empty = NULL, *lru = NULL;
    int best_l = 0;
    for (int i = 0; i < s->o.n_slots; i++) {
        sched_slot *sl = &s->slots[i];
        if (sl->job) continue;
        if (!sl->s) { if (!empty) empty = sl; continue; }
        int l = sched_common_prefix(sl->tokens, sl->n, ids, n);
        if (l > best_l) { best_l = l; best = sl; }
        if (!lru || sl->last_used < lru->last_used) lru = sl;
    }
    if (best && (best_l == best->n || best_l >= s->o.min_reuse)) return best;
    return empty ? empty : lru;
}

/* The slot (any, running or idle, other than `not`) whose cache shares the
 * longest prefix with ids; *len receives it. */
static sched_slot *sched_slot_donor(sched *s, const sched_slot *not, const int32_t *ids, int n, int *len) {
    sched_slot *best = NULL;
    *len = 0;
    for (int i = 0; i < s->o.n_slots; i++) {
        sched_slot *sl = &s->slots[i];
        if (sl == not || !sl->s || (sl->job && sl->job->loading)) continue;   /* the loader's */
        int l = sched_common_prefix(sl->tokens, sl->n, ids, n);
        if (l > *len) { *len = l; best = sl; }
    }
    return best;
}

/* Places a queued job in a slot (caller holds mu): reuses the slot's own
 * prefix, or copies a longer one from another slot. The last prompt token
 * is always evaluated, so its logits pick the first token. */
static int sched_admit(sched *s, sched_job *j, sched_slot *sl, char *err, size_t errlen) {
    if (sched_slot_prepare(s, sl, err, errlen)) return -1;
    const int32_t *p = j->r.prompt;
    int n = j->r.n_prompt;
    int own = sched_common_prefix(sl->tokens, sl->n, p, n), other = 0;
    sched_slot *donor = sched_slot_donor(s, sl, p, n, &other);
    int keep = own;
    if (donor && other > own && other >= (j->r.sibling ? 1 : s->o.min_reuse)) {
        int len = other < n - 1 ? other : n - 1;
        if (!kv_copy_prefix(session_kv(sl->s), session_kv(donor->s), len, err, errlen)) {
            session_rows_written(sl->s, 0);   /* the backend's mirror of this slot's old rows is stale */
            memcpy(sl->tokens, donor->tokens, sizeof(int32_t) * (size_t)len);
            sl->n = len;
            keep = len;
            j->v.reused_from_other = 1;
        }
    }
    if (keep > n - 1) keep = n - 1;
    session_reset(sl->s, keep);
    sl->n = keep;
    sl->job = j;
    sl->last_used = ++s->tick;
    j->slot = sl;
    j->logits = s->logits + (size_t)(sl - s->slots) * (size_t)s->spec_rows * (size_t)s->n_vocab;
    j->fed = keep;
    j->v.start_pos = keep;
    j->v.t_admit = gen_now_ms();
    if (s->o.store && s->loader_started && keep < n - 1) {
        /* continue with the longest run of stored blocks: the loader's */
        j->loading = 1;
        pthread_cond_signal(&s->cv_load);
        return 0;
    }
    j->v.state = j->r.want_remote && keep < n - 1 ? SJ_REMOTE : SJ_PROMPT;
    return 0;
}

/* ==== The store's loader ==== */

/* A job whose slot waits for the loader, or NULL (caller holds mu). */
static sched_job *sched_load_next(sched *s) {
    for (int i = 0; i < s->o.n_slots; i++)
        if (s->slots[i].job && s->slots[i].job->loading == 1) return s->slots[i].job;
    return NULL;
}

/* Fills j's slot from the store without mu (the slot is the loader's while
 * loading == 2), then starts its prompt (or ends it: cancelled, stopping). */
static void sched_load_job(sched *s, sched_job *j) {
    sched_slot *sl = j->slot;
    int keep = sl->n, n = j->r.n_prompt, end = keep;
    kvstore_hit hit = { 0, 0 };
    j->loading = 2;
    if (!j->cancelled && !s->stopping) {
        pthread_mutex_unlock(&s->mu);
        double t0 = gen_now_ms();
        end = kvstore_fill(s->o.store, j->r.prompt, n - 1, keep, session_kv(sl->s), &hit);
        double ms = gen_now_ms() - t0;
        pthread_mutex_lock(&s->mu);
        j->v.store_ms = ms;
    }
    if (end > keep) {
        memcpy(sl->tokens + keep, j->r.prompt + keep, sizeof(int32_t) * (size_t)(end - keep));
        sl->n = end;
        j->fed = j->v.start_pos = end;
        j->v.store_ram_tokens = hit.ram_tokens;
        j->v.store_disk_tokens = hit.disk_tokens;
    }
    j->loading = 0;
    j->v.state = j->r.want_remote && end < n - 1 ? SJ_REMOTE : SJ_PROMPT;
    if (j->cancelled) sched_job_end(s, j, "cancelled", NULL);
    else if (s->stopping && j->v.state != SJ_REMOTE) sched_job_end(s, j, "error", "the server is shutting down");
    pthread_cond_broadcast(&s->cv_out);
    pthread_cond_signal(&s->cv_work);
}

static void *sched_loader_main(void *arg) {
    sched *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        sched_job *j = sched_load_next(s);
        if (j) { sched_load_job(s, j); continue; }
        if (s->stopping) break;
        pthread_cond_wait(&s->cv_load, &s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* Whether a queued job should wait for a prompt being computed in another
 * slot: when that prompt shares at least min_reuse more tokens with this one
 * than any cache holds now, waiting for it and copying its rows saves the
 * work (a class of requests that all start with the same rubric computes
 * the rubric once). */
static int sched_should_wait(sched *s, const sched_job *j) {
    int have = 0, pending = 0;
    for (int i = 0; i < s->o.n_slots; i++) {
        sched_slot *sl = &s->slots[i];
        if (!sl->s) continue;
        int l = sched_common_prefix(sl->tokens, sl->n, j->r.prompt, j->r.n_prompt);
        if (l > have) have = l;
        const sched_job *o = sl->job;
        if (o && (o->v.state == SJ_PROMPT || o->v.state == SJ_REMOTE || o->loading)) {
            int p = sched_common_prefix(o->r.prompt, o->r.n_prompt, j->r.prompt, j->r.n_prompt);
            if (p > pending) pending = p;
        }
    }
    if (pending > j->r.n_prompt - 1) pending = j->r.n_prompt - 1;
    return pending >= have + (j->r.sibling ? 1 : s->o.min_reuse);
}

/* Drops queued jobs whose owners left (caller holds mu). */
static void sched_drop_cancelled(sched *s) {
    for (sched_job **pp = &s->q_head; *pp;) {
        sched_job *j = *pp;
        if (!j->cancelled) { pp = &j->next; continue; }
        *pp = j->next;
        s->queued--;
        j->v.state = SJ_DONE;
        j->v.finish = "cancelled";
        sched_job_unref(j);
    }
}

/* Slots running jobs of client c (caller holds mu). */
static int sched_client_running(const sched *s, uint64_t c) {
    int k = 0;
    for (int i = 0; i < s->o.n_slots; i++) k += s->slots[i].job && s->slots[i].job->r.client == c;
    return k;
}

/* The link to the queued job to admit next: of those not waiting for a
 * shared prefix, the one whose client runs the fewest slots (a client
 * with many slow streams does not keep the others queued), the earliest
 * among equals; NULL if none (caller holds mu). */
static sched_job **sched_next_queued(sched *s) {
    sched_job **best = NULL;
    int best_k = 0;
    for (sched_job **pp = &s->q_head; *pp; pp = &(*pp)->next) {
        sched_job *j = *pp;
        if (sched_should_wait(s, j)) continue;
        int k = j->r.client ? sched_client_running(s, j->r.client) : 0;
        if (!best || k < best_k) { best = pp; best_k = k; }
        if (k == 0) break;
    }
    return best;
}

/* Moves queued jobs into free slots (sched_next_queued's order), except
 * those that wait for a shared prefix being computed (caller holds mu). */
static void sched_admit_queued(sched *s) {
    sched_drop_cancelled(s);
    for (sched_job **pp; (pp = sched_next_queued(s));) {
        sched_job *j = *pp;
        sched_slot *sl = sched_slot_pick(s, j->r.prompt, j->r.n_prompt);
        if (!sl) break;
        *pp = j->next;
        s->queued--;
        char err[256];
        if (sched_admit(s, j, sl, err, sizeof err)) {
            j->v.state = SJ_DONE;
            j->v.finish = "error";
            j->v.error = "out of memory for a KV cache";
            sched_job_unref(j);
        }
    }
    s->q_tail = NULL;
    for (sched_job *j = s->q_head; j; j = j->next) s->q_tail = j;
    pthread_cond_broadcast(&s->cv_out);
}

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

static void *sched_main(void *arg) {
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
