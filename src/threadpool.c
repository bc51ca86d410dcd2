/* threadpool.c - see threadpool.h. */
#include "threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

/* Spin iterations before a worker sleeps: long enough to bridge the gap
 * between back-to-back kernels of one forward pass (microseconds), short
 * enough that an idle server does not burn a core. */
#define TPOOL_SPIN 200000

struct tpool {
    int n;
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_uint gen;          /* bumped for each job */
    atomic_int pending;       /* workers still running the current job */
    atomic_int quit;
    int sleeping;             /* guarded by mu */
    tpool_fn fn;
    void *ctx;
};

typedef struct { tpool *p; int ith; } worker_arg;

static void tpool_wait_job(tpool *p, unsigned seen) {
    for (long i = 0; i < TPOOL_SPIN; i++) {
        if (atomic_load_explicit(&p->gen, memory_order_acquire) != seen) return;
        if ((i & 1023) == 1023) sched_yield();
    }
    pthread_mutex_lock(&p->mu);
    p->sleeping++;
    while (atomic_load(&p->gen) == seen) pthread_cond_wait(&p->cv, &p->mu);
    p->sleeping--;
    pthread_mutex_unlock(&p->mu);
}

static void *tpool_worker(void *arg) {
    worker_arg *wa = arg;
    tpool *p = wa->p;
    int ith = wa->ith;
    free(wa);
    unsigned seen = 0;
    for (;;) {
        tpool_wait_job(p, seen);
        seen = atomic_load_explicit(&p->gen, memory_order_acquire);
        if (atomic_load(&p->quit)) return NULL;
        p->fn(p->ctx, ith, p->n);
        atomic_fetch_sub_explicit(&p->pending, 1, memory_order_acq_rel);
    }
}

tpool *tpool_create(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    tpool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
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

static void tpool_wake(tpool *p) {
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add_explicit(&p->gen, 1, memory_order_acq_rel);
    if (p->sleeping) pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

void tpool_run(tpool *p, tpool_fn fn, void *ctx) {
    if (!p || p->n == 1) { fn(ctx, 0, 1); return; }
    p->fn = fn;
    p->ctx = ctx;
    atomic_store(&p->pending, p->n - 1);
    tpool_wake(p);
    fn(ctx, 0, p->n);
    while (atomic_load_explicit(&p->pending, memory_order_acquire) > 0) { /* spin: workers finish together */ }
}

void tpool_destroy(tpool *p) {
    if (!p) return;
    atomic_store(&p->quit, 1);
    tpool_wake(p);
    for (int i = 1; i < p->n; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p->threads);
    free(p);
}

void tpool_split(long n, int ith, int nth, long *lo, long *hi) {
    long base = n / nth, rem = n % nth;
    *lo = ith * base + (ith < rem ? ith : rem);
    *hi = *lo + base + (ith < rem ? 1 : 0);
}
