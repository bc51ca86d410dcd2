/* threadpool.c - see threadpool.h.
 *
 * Job state is one 64-bit word: generation (high 32 bits), the job's chunk
 * count (16 bits) and the next unclaimed chunk (low 16). A thread claims a
 * chunk by compare-and-swap on the whole word, so a claim can only succeed
 * for a chunk that exists in the job it read fn/ctx for. (The count must live
 * in the word: read separately, a late worker could see the next job's larger
 * count while the word still showed the finished job, claim a chunk that did
 * not exist, and push `done` past the count, leaving the caller asleep.) The
 * caller returns when `done` reaches the chunk count, and never waits for a
 * worker that has not started.
 */
#include "base/threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "base/platform.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TPOOL_PAUSE() _mm_pause()
#define TPOOL_PREFETCH(a) _mm_prefetch((const char *)(a), _MM_HINT_T0)
#else
#define TPOOL_PAUSE() ((void)0)
#define TPOOL_PREFETCH(a) __builtin_prefetch(a)
#endif

/* Polls before a worker sleeps: about 100-300 us, which bridges the serial
 * gaps between the kernels of one forward pass, yet lets an idle server (or a
 * core shared with another process) have the CPU back soon. */
#define TPOOL_SPIN_WORKER 4000
/* Polls before the caller sleeps waiting for the last chunk: the chunk is
 * normally running on a hot core and finishes within microseconds. */
#define TPOOL_SPIN_CALLER 2000

typedef void (*tpool_task)(void *ctx, int chunk, int arg);

/* Chunks of one job: 16 bits of the job word (more run as consecutive jobs). */
#define TPOOL_MAX_CHUNKS 0xFFFF

/* A thread's part of a ranged job: gen << 32 | front << 16 | back. The
 * owner takes items from the front, a thief from the back; the generation
 * makes a late thread's claim on a word of a newer job fail. */
typedef struct {
    _Alignas(64) _Atomic uint64_t w;
    /* bytes this thread prefetches once its share is done (tpool_warm) */
    _Atomic(const char *) warm;
    _Atomic size_t warm_len;
} tpool_range;

enum { TPOOL_MODE_N = 0, TPOOL_MODE_TID = 1, TPOOL_MODE_RANGES = 2 };

struct tpool {
    int n;
    pthread_t *threads;
    tpool_range *ranges;                   /* [n] */
    _Alignas(64) _Atomic uint64_t job;     /* gen << 32 | n_chunks << 16 | next chunk */
    _Atomic uint32_t gen32;                /* wait word (plat_wait): the generation */
    _Atomic int sleepers;                  /* workers in plat_wait on gen32 */
    _Atomic(tpool_task) fn;
    _Atomic(void *) ctx;
    _Atomic int mode;                      /* TPOOL_MODE_*: what fn gets as its third argument, how chunks are claimed */
    _Alignas(64) _Atomic uint32_t done;    /* chunks finished (wait word) */
    _Atomic int caller_waiting;
    _Atomic int quit;
};

typedef struct { tpool *p; int ith; } worker_arg;

/* ==== Warming ====
 * Prefetch [a, a + len) line by line, stopping early once *done reaches n
 * (done NULL: never). */
static void tpool_prefetch(const char *a, size_t len, _Atomic uint32_t *done, int n) {
    for (size_t o = 0; o < len; o += 64) {
        if (done && (o & 1023) == 0 && (int)atomic_load_explicit(done, memory_order_acquire) == n) return;
        TPOOL_PREFETCH(a + o);
    }
}

/* ==== Chunks ==== */

/* One more finished chunk (or d of them): the last one wakes the caller. */
static void tpool_done_add(tpool *p, uint32_t d, int n) {
    uint32_t t = atomic_fetch_add_explicit(&p->done, d, memory_order_seq_cst) + d;
    if ((int)t == n && atomic_load_explicit(&p->caller_waiting, memory_order_seq_cst))
        plat_wake(&p->done);
}

/* A thread's claim on its own run: a share of what is left, so that a run
 * of n items costs O(log n) locked operations instead of n. Each lock
 * cmpxchg waits for the core's outstanding memory operations; claiming 64-row
 * blocks one at a time, the claims were 8% of a Q4_K_M decode step (perf). A
 * thief still has the unclaimed rest, and what a thread holds but has not run
 * is at most a TPOOL_RANGE_SHARE-th of its run. */
#define TPOOL_RANGE_SHARE 4

/* Take items of range r of generation gen: the owner [*first, *first +
 * count) from the front, a thief one item from the back. Returns the count
 * taken, 0 when the range is empty or belongs to another job. */
static int tpool_range_take(tpool_range *r, uint32_t gen, int thief, int *first) {
    uint64_t v = atomic_load_explicit(&r->w, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(v >> 32) != gen) return 0;
        int front = (int)((v >> 16) & TPOOL_MAX_CHUNKS), back = (int)(v & TPOOL_MAX_CHUNKS);
        if (front >= back) return 0;
        int k = thief ? 1 : (back - front + TPOOL_RANGE_SHARE - 1) / TPOOL_RANGE_SHARE;
        uint64_t nv = thief ? v - 1 : v + ((uint64_t)k << 16);
        if (atomic_compare_exchange_weak_explicit(&r->w, &v, nv, memory_order_acq_rel, memory_order_acquire)) {
            *first = thief ? back - 1 : front;
            return k;
        }
    }
}

/* Ranged job: this thread's own items in order, then items stolen from the
 * back of the fullest other range until every range is empty. */
static void tpool_work_ranges(tpool *p, tpool_task fn, void *ctx, uint32_t gen, int n, int tid) {
    uint32_t ran = 0;
    for (int i, k; (k = tpool_range_take(&p->ranges[tid], gen, 0, &i)) > 0; ran += (uint32_t)k)
        for (int e = i + k; i < e; i++) fn(ctx, i, tid);
    for (;;) {
        int victim = -1, most = 0;
        for (int t = 0; t < p->n; t++) {
            uint64_t v = atomic_load_explicit(&p->ranges[t].w, memory_order_relaxed);
            int left = (int)(v & TPOOL_MAX_CHUNKS) - (int)((v >> 16) & TPOOL_MAX_CHUNKS);
            if ((uint32_t)(v >> 32) == gen && left > most) { most = left; victim = t; }
        }
        if (victim < 0) break;
        int i;
        if (tpool_range_take(&p->ranges[victim], gen, 1, &i)) { fn(ctx, i, tid); ran++; }
    }
    if (!ran) return;
    /* read before the done count lets the caller publish the next job */
    const char *wa = atomic_load_explicit(&p->ranges[tid].warm, memory_order_relaxed);
    size_t wl = atomic_load_explicit(&p->ranges[tid].warm_len, memory_order_relaxed);
    tpool_done_add(p, ran, n);
    if (tid) tpool_prefetch(wa, wl, NULL, 0);   /* the caller warms while it waits (tpool_wait_done) */
}

/* Claim and run chunks of the job whose word was `w` until none are left or
 * the job changed. */
static void tpool_work(tpool *p, uint64_t w, int tid) {
    tpool_task fn = atomic_load_explicit(&p->fn, memory_order_relaxed);
    void *ctx = atomic_load_explicit(&p->ctx, memory_order_relaxed);
    int mode = atomic_load_explicit(&p->mode, memory_order_relaxed);
    const uint64_t gen = w >> 32;
    const int n = (int)((w >> 16) & TPOOL_MAX_CHUNKS);
    if (mode == TPOOL_MODE_RANGES) { tpool_work_ranges(p, fn, ctx, (uint32_t)gen, n, tid); return; }
    for (;;) {
        int next = (int)(w & TPOOL_MAX_CHUNKS);
        if (next >= n) return;
        /* on success fn/ctx/n are those of generation w >> 32 (read after its
         * acquire, and not rewritten before all its chunks are done) */
        if (!atomic_compare_exchange_weak_explicit(&p->job, &w, w + 1, memory_order_acq_rel,
                                                   memory_order_acquire)) {
            if ((w >> 32) != gen) return;   /* a newer job: not ours to run */
            continue;                        /* lost a race for this chunk: w was reloaded */
        }
        fn(ctx, (int)next, mode == TPOOL_MODE_TID ? tid : n);
        tpool_done_add(p, 1, n);
        w++;
    }
}

static void *tpool_worker(void *arg) {
    worker_arg *wa = arg;
    tpool *p = wa->p;
    int ith = wa->ith;
    free(wa);
    uint32_t seen = 0;
    for (;;) {
        uint32_t g = atomic_load_explicit(&p->gen32, memory_order_acquire);
        for (int i = 0; g == seen && i < TPOOL_SPIN_WORKER; i++) {
            TPOOL_PAUSE();
            g = atomic_load_explicit(&p->gen32, memory_order_acquire);
        }
        if (g == seen) {
            atomic_fetch_add(&p->sleepers, 1);
            while ((g = atomic_load(&p->gen32)) == seen) plat_wait(&p->gen32, seen);
            atomic_fetch_sub(&p->sleepers, 1);
        }
        seen = g;
        if (atomic_load(&p->quit)) return NULL;
        uint64_t w = atomic_load_explicit(&p->job, memory_order_acquire);
        /* only join the job we were woken for; a later one wakes us again */
        if ((uint32_t)(w >> 32) == g) tpool_work(p, w, ith);
    }
}

tpool *tpool_create(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    tpool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n = n_threads;
    p->threads = calloc((size_t)n_threads, sizeof *p->threads);
    p->ranges = aligned_alloc(64, (size_t)n_threads * sizeof *p->ranges);
    if (!p->threads || !p->ranges) { free(p->threads); free(p->ranges); free(p); return NULL; }
    for (int i = 0; i < n_threads; i++) {
        atomic_init(&p->ranges[i].w, 0);
        atomic_init(&p->ranges[i].warm, NULL);
        atomic_init(&p->ranges[i].warm_len, 0);
    }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *wa = malloc(sizeof *wa);
        if (!wa) { p->n = i; tpool_destroy(p); return NULL; }
        wa->p = p; wa->ith = i;
        if (pthread_create(&p->threads[i], NULL, tpool_worker, wa) != 0) {
            free(wa); p->n = i; tpool_destroy(p); return NULL;
        }
    }
    return p;
}

int tpool_size(const tpool *p) { return p ? p->n : 1; }

/* Publish a new generation of n chunks and wake sleeping workers. A ranged
 * job's word shows every chunk claimed (next = n): its items are claimed
 * from the range words, and a late thread that read the previous job's
 * word with this job's mode must find nothing to claim in it. */
static uint64_t tpool_publish(tpool *p, int n, int ranged) {
    uint32_t g = atomic_load_explicit(&p->gen32, memory_order_relaxed) + 1;
    uint64_t w = (uint64_t)g << 32 | (uint64_t)n << 16 | (uint64_t)(ranged ? n : 0);
    atomic_store_explicit(&p->job, w, memory_order_release);
    atomic_store_explicit(&p->gen32, g, memory_order_seq_cst);
    if (atomic_load_explicit(&p->sleepers, memory_order_seq_cst)) plat_wake(&p->gen32);
    return w;
}

static void tpool_wait_done(tpool *p, int n, const tpool_warm *warm) {
    if (warm) tpool_prefetch(warm->addr, warm->len, &p->done, n);
    for (int i = 0; i < TPOOL_SPIN_CALLER; i++) {
        if ((int)atomic_load_explicit(&p->done, memory_order_acquire) == n) return;
        TPOOL_PAUSE();
    }
    atomic_store_explicit(&p->caller_waiting, 1, memory_order_seq_cst);
    uint32_t d;
    while ((int)(d = atomic_load_explicit(&p->done, memory_order_seq_cst)) != n) plat_wait(&p->done, d);
    atomic_store_explicit(&p->caller_waiting, 0, memory_order_relaxed);
}

static void tpool_exec(tpool *p, tpool_task fn, void *ctx, int n, int mode, const tpool_warm *warm);

/* A job of more chunks than the job word counts: consecutive jobs of at
 * most TPOOL_MAX_CHUNKS, each chunk numbered as in the whole. */
typedef struct { tpool_task fn; void *ctx; int base; } tpool_slice;

static void tpool_slice_run(void *ctx, int chunk, int arg) {
    const tpool_slice *s = ctx;
    s->fn(s->ctx, s->base + chunk, arg);
}

static void tpool_exec(tpool *p, tpool_task fn, void *ctx, int n, int mode, const tpool_warm *warm) {
    if (n <= 0) return;
    if (!p || p->n == 1 || n == 1) {
        for (int i = 0; i < n; i++) fn(ctx, i, mode == TPOOL_MODE_N ? n : 0);
        return;
    }
    if (n > TPOOL_MAX_CHUNKS) {   /* (never TPOOL_MODE_N: that job has one chunk per thread) */
        for (int base = 0; base < n; base += TPOOL_MAX_CHUNKS) {
            tpool_slice s = { fn, ctx, base };
            tpool_exec(p, tpool_slice_run, &s, n - base < TPOOL_MAX_CHUNKS ? n - base : TPOOL_MAX_CHUNKS, mode,
                       base + TPOOL_MAX_CHUNKS >= n ? warm : NULL);
        }
        return;
    }
    atomic_store_explicit(&p->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&p->ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&p->mode, mode, memory_order_relaxed);
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    if (mode == TPOOL_MODE_RANGES) {
        /* the next generation's words, published by tpool_publish's release */
        uint64_t g = atomic_load_explicit(&p->gen32, memory_order_relaxed) + 1;
        for (int t = 0; t < p->n; t++) {
            long lo, hi;
            tpool_split(n, t, p->n, &lo, &hi);
            atomic_store_explicit(&p->ranges[t].w, g << 32 | (uint64_t)lo << 16 | (uint64_t)hi, memory_order_relaxed);
            atomic_store_explicit(&p->ranges[t].warm, warm && t ? (const char *)warm[t].addr : NULL,
                                  memory_order_relaxed);
            atomic_store_explicit(&p->ranges[t].warm_len, warm && t ? warm[t].len : 0, memory_order_relaxed);
        }
    }
    uint64_t w = tpool_publish(p, n, mode == TPOOL_MODE_RANGES);
    tpool_work(p, w, 0);
    tpool_wait_done(p, n, mode == TPOOL_MODE_RANGES ? warm : NULL);
}

void tpool_run(tpool *p, tpool_fn fn, void *ctx) {
    tpool_exec(p, fn, ctx, p ? p->n : 1, TPOOL_MODE_N, NULL);
}

void tpool_run_chunks(tpool *p, tpool_fn fn, void *ctx, int n_chunks) {
    tpool_exec(p, fn, ctx, n_chunks, TPOOL_MODE_TID, NULL);
}

void tpool_run_ranges(tpool *p, tpool_fn fn, void *ctx, int n_items) {
    tpool_exec(p, fn, ctx, n_items, TPOOL_MODE_RANGES, NULL);
}

void tpool_run_ranges_warm(tpool *p, tpool_fn fn, void *ctx, int n_items, const tpool_warm *warm) {
    tpool_exec(p, fn, ctx, n_items, TPOOL_MODE_RANGES, warm);
}

void tpool_destroy(tpool *p) {
    if (!p) return;
    atomic_store(&p->quit, 1);
    tpool_publish(p, 0, 0);
    for (int i = 1; i < p->n; i++) pthread_join(p->threads[i], NULL);
    free(p->threads);
    free(p->ranges);
    free(p);
}

void tpool_split(long n, int ith, int nth, long *lo, long *hi) {
    long base = n / nth, rem = n % nth;
    *lo = ith * base + (ith < rem ? ith : rem);
    *hi = *lo + base + (ith < rem ? 1 : 0);
}
