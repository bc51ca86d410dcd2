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
#include "threadpool.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TPOOL_PAUSE() _mm_pause()
#else
#define TPOOL_PAUSE() ((void)0)
#endif

/* Polls before a worker sleeps: about 100-300 us, which bridges the serial
 * gaps between the kernels of one forward pass, yet lets an idle server (or a
 * core shared with another process) have the CPU back soon. */
#define TPOOL_SPIN_WORKER 4000
/* Polls before the caller sleeps waiting for the last chunk: the chunk is
 * normally running on a hot core and finishes within microseconds. */
#define TPOOL_SPIN_CALLER 2000

typedef void (*tpool_task)(void *ctx, int chunk, int arg);

/* Chunks of one job: 16 bits of the job word (more runs on the caller alone). */
#define TPOOL_MAX_CHUNKS 0xFFFF

struct tpool {
    int n;
    pthread_t *threads;
    _Alignas(64) _Atomic uint64_t job;     /* gen << 32 | n_chunks << 16 | next chunk */
    _Atomic uint32_t gen32;                /* futex word: the generation */
    _Atomic int sleepers;                  /* workers in futex_wait on gen32 */
    _Atomic(tpool_task) fn;
    _Atomic(void *) ctx;
    _Atomic int mode_tid;                  /* 1: pass tid as arg, 0: pass n_chunks */
    _Alignas(64) _Atomic uint32_t done;    /* chunks finished (futex word) */
    _Atomic int caller_waiting;
    _Atomic int quit;
};

typedef struct { tpool *p; int ith; } worker_arg;

/* ==== Futex ==== */

static void tpool_futex_wait(_Atomic uint32_t *addr, uint32_t val) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void tpool_futex_wake(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* ==== Chunks ==== */

/* Claim and run chunks of the job whose word was `w` until none are left or
 * the job changed. */
static void tpool_work(tpool *p, uint64_t w, int tid) {
    tpool_task fn = atomic_load_explicit(&p->fn, memory_order_relaxed);
    void *ctx = atomic_load_explicit(&p->ctx, memory_order_relaxed);
    int mode_tid = atomic_load_explicit(&p->mode_tid, memory_order_relaxed);
    const uint64_t gen = w >> 32;
    const int n = (int)((w >> 16) & TPOOL_MAX_CHUNKS);
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
        fn(ctx, (int)next, mode_tid ? tid : n);
        uint32_t d = atomic_fetch_add_explicit(&p->done, 1, memory_order_seq_cst) + 1;
        if ((int)d == n && atomic_load_explicit(&p->caller_waiting, memory_order_seq_cst))
            tpool_futex_wake(&p->done);
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
            while ((g = atomic_load(&p->gen32)) == seen) tpool_futex_wait(&p->gen32, seen);
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
    if (!p->threads) { free(p); return NULL; }
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

/* Publish a new generation of n chunks and wake sleeping workers. */
static uint64_t tpool_publish(tpool *p, int n) {
    uint32_t g = atomic_load_explicit(&p->gen32, memory_order_relaxed) + 1;
    uint64_t w = (uint64_t)g << 32 | (uint64_t)n << 16;
    atomic_store_explicit(&p->job, w, memory_order_release);
    atomic_store_explicit(&p->gen32, g, memory_order_seq_cst);
    if (atomic_load_explicit(&p->sleepers, memory_order_seq_cst)) tpool_futex_wake(&p->gen32);
    return w;
}

static void tpool_wait_done(tpool *p, int n) {
    for (int i = 0; i < TPOOL_SPIN_CALLER; i++) {
        if ((int)atomic_load_explicit(&p->done, memory_order_acquire) == n) return;
        TPOOL_PAUSE();
    }
    atomic_store_explicit(&p->caller_waiting, 1, memory_order_seq_cst);
    uint32_t d;
    while ((int)(d = atomic_load_explicit(&p->done, memory_order_seq_cst)) != n) tpool_futex_wait(&p->done, d);
    atomic_store_explicit(&p->caller_waiting, 0, memory_order_relaxed);
}

static void tpool_exec(tpool *p, tpool_task fn, void *ctx, int n, int mode_tid) {
    if (n <= 0) return;
    if (!p || p->n == 1 || n == 1 || n > TPOOL_MAX_CHUNKS) {
        for (int i = 0; i < n; i++) fn(ctx, i, mode_tid ? 0 : n);
        return;
    }
    atomic_store_explicit(&p->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&p->ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&p->mode_tid, mode_tid, memory_order_relaxed);
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    uint64_t w = tpool_publish(p, n);
    tpool_work(p, w, 0);
    tpool_wait_done(p, n);
}

void tpool_run(tpool *p, tpool_fn fn, void *ctx) {
    tpool_exec(p, fn, ctx, p ? p->n : 1, 0);
}

void tpool_run_chunks(tpool *p, tpool_fn fn, void *ctx, int n_chunks) {
    tpool_exec(p, fn, ctx, n_chunks, 1);
}

void tpool_destroy(tpool *p) {
    if (!p) return;
    atomic_store(&p->quit, 1);
    tpool_publish(p, 0);
    for (int i = 1; i < p->n; i++) pthread_join(p->threads[i], NULL);
    free(p->threads);
    free(p);
}

void tpool_split(long n, int ith, int nth, long *lo, long *hi) {
    long base = n / nth, rem = n % nth;
    *lo = ith * base + (ith < rem ? ith : rem);
    *hi = *lo + base + (ith < rem ? 1 : 0);
}
