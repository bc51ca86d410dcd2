/* scheduler.h - continuous batching for a decode node.
 *
 * A scheduler owns n_slots sequences (one KV cache each) and one thread
 * that runs the model. At every step it evaluates, in one model_eval_batch
 * call, the next token of every decoding sequence plus at most
 * `prefill_budget` prompt tokens of sequences still reading their prompt
 * (chunked prefill: a long prompt does not freeze the streams already
 * running), then samples for each sequence whose logits came out.
 *
 * Jobs wait in a bounded queue until a slot is free (every slot's cache is
 * reserved at start-up, so a free slot is free KV memory). A job is placed
 * in the idle slot whose cache shares the longest prefix with its prompt; if
 * another slot (running or not) shares more, those rows are copied over, so
 * a prompt that starts like another one (the same rubric) computes only the
 * rest. A job can ask for its prompt to be filled from outside (a prefill
 * node): it then goes to SJ_REMOTE, its owner fills the slot's session with
 * positions [start_pos, n_prompt - 1) and calls sched_remote_done(); the
 * last prompt position is always evaluated here, in the batch. With a KV
 * store, an admitted job's slot first goes to the scheduler's loader thread,
 * which continues it with the longest run of stored blocks (memory or disk)
 * without the scheduler's lock, then starts its prompt: the streams already
 * running keep decoding while a prefix loads (the job stays SJ_QUEUED
 * meanwhile).
 *
 * Ownership: a job is shared between its owner (the HTTP request) and the
 * scheduler; sched_release() drops the owner's reference. A job released
 * before it is done is cancelled, and its slot is freed at the next step.
 */
#ifndef TANDEM_SCHEDULER_H
#define TANDEM_SCHEDULER_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model.h"
#include "engine/grammar.h"
#include "engine/sampler.h"
#include "node/kvstore.h"
#include "engine/spec.h"
#include "node/draft.h"

#define SCHED_MAX_STOP 8
#define SCHED_MAX_STOP_IDS 64   /* = API_MAX_STOP_IDS */

typedef struct sched sched;

typedef enum { SJ_QUEUED = 0, SJ_REMOTE, SJ_PROMPT, SJ_DECODE, SJ_DONE } sched_state;

typedef struct {
    int n_slots;             /* sequences decoded together */
    int queue_max;           /* jobs that may wait for a slot */
    int n_ctx;               /* context of every slot */
    uint32_t kv_dtype;
    int prefill_budget;      /* prompt tokens per step while other sequences decode */
    int min_reuse;           /* shared tokens worth taking another idle slot's cache for */
    kvstore *store;          /* KV prefix store (kvstore.h), or NULL: an admitted job
                              * continues its slot's prefix with stored blocks, and a
                              * finished job's blocks are put there */
    draft_src *draft;        /* speculative drafts (draft.h; the caller frees it after
                              * sched_destroy), or NULL: one token per sequence per step */
} sched_opts;

/* The request: filled by the owner before sched_submit, read-only after. */
typedef struct {
    int32_t *prompt;         /* owned by the job once submitted */
    int n_prompt;
    int max_tokens, ignore_eos;
    int min_tokens;          /* end-of-generation and stop_ids masked before this many tokens */
    int32_t stop_ids[SCHED_MAX_STOP_IDS];   /* tokens that end the output (not emitted) */
    int n_stop_ids;
    sampler_params sp;
    char *stop[SCHED_MAX_STOP];   /* owned by the job */
    int n_stop;
    int want_remote;         /* fill the prompt from outside (SJ_REMOTE) when admitted */
    int logprobs;            /* 0: off; 1 + k: each token's log-probability and its k
                              * most likely alternatives (k <= SCHED_MAX_TOP_LOGPROBS) */
    grammar *grammar;        /* owned by the job: constrained decoding (masks every
                              * token that cannot continue a valid output), or NULL */
    const grammar_vocab *gvocab;   /* the model's vocabulary index, with grammar */
    uint64_t client;         /* who asked (node_decode.c's client id), 0 = unknown: a
                              * free slot goes to the queued job whose client runs the
                              * fewest, arrival order among equals */
    int sibling;             /* one of a request's n > 1 choices after the first: it
                              * waits for a same-prompt job computing its prompt and
                              * copies any shared prefix, however short (others only
                              * from min_reuse tokens), so the prompt is computed once */
} sched_req;

#define SCHED_MAX_TOP_LOGPROBS 20

/* A token's log-probability under the model (log-softmax of the logits,
 * before any sampling transform; with a grammar, of the masked logits, so
 * tokens the output could not take have none), with its top alternatives. */
typedef struct {
    float logprob;
    int n_top;
    int32_t top_id[SCHED_MAX_TOP_LOGPROBS];
    float top_logprob[SCHED_MAX_TOP_LOGPROBS];
} sched_logprob;

/* What the owner reads; fields marked (lock) only via sched_wait / under
 * sched_lock. */
typedef struct {
    sched_state state;       /* (lock) */
    int n_gen;               /* (lock) tokens generated */
    const int32_t *gen;      /* (lock) [n_gen] */
    const char *text;        /* (lock) generated text (pieces back to back) */
    const size_t *piece_end; /* (lock) [n_gen] end of each token's piece in text */
    const sched_logprob *lp; /* (lock) [n_gen] when requested, else NULL */
    const size_t *stable_end;/* (lock) [n_gen] text that is final after each token: a
                              * stream sends text[stable_end[k-1], stable_end[k]) with
                              * token k. Text that could still begin a stop string
                              * is held back; a stop string and what follows it
                              * never become stable. */
    size_t text_len;         /* (lock) bytes of text, including a final flush */
    size_t text_keep;        /* (lock) reported length: cut before a stop string; once
                              * done, everything in [stable_end[n_gen-1], text_keep)
                              * is released too */
    const char *finish;      /* (lock) "stop", "length", "error" once done */
    const char *error;       /* (lock) message when finish is "error" */
    /* prefill report, final once state >= SJ_DECODE or done */
    int start_pos;           /* positions reused from a cache */
    int reused_from_other;   /* start_pos came from another slot's cache (copied) */
    int computed_local;      /* prompt positions evaluated here */
    int store_ram_tokens;    /* of start_pos: positions loaded from the store's memory */
    int store_disk_tokens;   /* ... and from its disk */
    double store_ms;         /* time spent looking up and loading stored blocks */
    int drafted, accepted;   /* (lock) speculative drafts verified and kept */
    double t_submit, t_admit, t_first, t_prompt_done;   /* ms (gen_now_ms) */
} sched_view;

typedef struct sched_job sched_job;

int sched_create(sched **out, model *m, const sched_opts *o, char *err, size_t errlen);
/* Ends every unfinished job with "error" and wakes their owners; the
 * thread stops. Owners must still sched_release their jobs. */
void sched_stop(sched *s);
/* Stops (if needed) and frees; no owner may still hold a job. */
void sched_destroy(sched *s);

/* Queues a job (taking ownership of r's allocations, even on failure).
 * 0: queued; -1: the queue is full; -2: shutting down. */
int sched_submit(sched *s, sched_req *r, sched_job **out);
/* Blocks until the job has more than `have` tokens, is done, enters
 * SJ_REMOTE, or timeout_ms passes; returns a snapshot (valid until the next
 * call for this job). */
const sched_view *sched_wait(sched *s, sched_job *j, int have, int timeout_ms);
/* For SJ_REMOTE: the slot's session to fill (from sched_view.start_pos)
 * and the prompt. */
session *sched_remote_session(sched_job *j);
const int32_t *sched_job_prompt(const sched_job *j);
/* ok: positions [start_pos, n_prompt - 1) are in the session; else the
 * session is back at start_pos and the rest is computed here. */
void sched_remote_done(sched *s, sched_job *j, int ok);
/* Drops the owner's reference (cancels a job that is not done). */
void sched_release(sched *s, sched_job *j);

typedef struct {
    int slots, slots_busy, queued, queue_max, sessions_used;
    uint64_t steps, batched_tokens;   /* model passes and tokens they carried */
    uint64_t cached_tokens;           /* positions held in the slots' KV caches */
    uint64_t capacity_tokens;         /* what they can hold: slots x n_ctx */
    /* speculative decoding (all 0 without a draft source) */
    uint64_t spec_steps;              /* a sequence's decode step (with or without drafts) */
    uint64_t spec_tokens;             /* tokens those steps produced */
    uint64_t spec_drafted, spec_accepted;
} sched_stats;
void sched_get_stats(sched *s, sched_stats *st);

/* The chained block hashes (base/prefix_hash.h) of every slot's cached
 * tokens, slot after slot (duplicates across slots included), at most max;
 * returns how many it wrote. For the node's prefix report (prefix_report.h). */
int sched_prefix_hashes(sched *s, uint64_t seed, uint64_t *out, int max);
/* Slot i's session, or NULL (tests: what a cache holds once its job is
 * done; read it only while no job runs). */
session *sched_slot_session(sched *s, int i);

#endif
