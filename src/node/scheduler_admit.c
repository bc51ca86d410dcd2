/* scheduler_admit.c - admission: a queued job into a slot (the slot whose
 * cached tokens share the longest prefix with its prompt, or a donor's
 * rows copied), the KV store's loader thread that fills an admitted slot
 * off the scheduler's lock, and the queue's order (cancelled jobs dropped,
 * one client's jobs behind others'). */

#include "node/scheduler.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/generate.h"

#include "node/scheduler_internal.h"

/* ==== Slots and prefix sharing ==== */

static int sched_common_prefix(const int32_t *a, int na, const int32_t *b, int nb) {
    int i = 0;
    while (i < na && i < nb && a[i] == b[i]) i++;
    return i;
}

int sched_slot_prepare(sched *s, sched_slot *sl, char *err, size_t errlen) {
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
        session_rows_read(donor->s);   /* the donor's rows may be newer on the backend than on the host */
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

void *sched_loader_main(void *arg) {
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
void sched_admit_queued(sched *s) {
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
