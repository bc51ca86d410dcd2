/* scheduler_internal.h - what the scheduler's files share (not part of its
 * interface: scheduler.h is). The state of a job, a slot and the scheduler,
 * and the sched_ functions one file calls in another:
 *   scheduler.c        jobs, create/stop/destroy, submit, wait, release,
 *                      remote fills, stats, the slots' prefix hashes
 *   scheduler_admit.c  slots and prefix sharing, the KV store's loader,
 *                      admission of queued jobs
 *   scheduler_step.c   output (text, stop strings, logprobs), sampling,
 *                      one step, speculative steps, the thread's loop
 */

#ifndef TANDEM_NODE_SCHEDULER_INTERNAL_H
#define TANDEM_NODE_SCHEDULER_INTERNAL_H

#include "node/scheduler.h"

#include <pthread.h>

#include "engine/tokenizer.h"

/* ==== Constants ==== */

/* Bytes one flush of the detokenizer can add at the end of a stream. */
#define SCHED_FLUSH_BYTES 32

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


/* ==== scheduler.c ==== */

/* Drops one reference; the caller holds mu. */
void sched_job_unref(sched_job *j);
void sched_job_end(sched *s, sched_job *j, const char *finish, const char *error);

/* ==== scheduler_admit.c ==== */

int sched_slot_prepare(sched *s, sched_slot *sl, char *err, size_t errlen);
void *sched_loader_main(void *arg);
void sched_admit_queued(sched *s);

/* ==== scheduler_step.c ==== */

void *sched_main(void *arg);

#endif /* TANDEM_NODE_SCHEDULER_INTERNAL_H */
