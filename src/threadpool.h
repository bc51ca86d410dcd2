/* threadpool.h - a fixed pool of worker threads for data-parallel kernels.
 *
 * tpool_run(fn) calls fn(ctx, ith, nth) once on every thread (the caller is
 * thread 0) and returns when all have finished. Workers spin briefly before
 * sleeping, because a decode step issues hundreds of small jobs per token and
 * a condition-variable wake-up per job would cost more than the job.
 */
#ifndef TANDEM_THREADPOOL_H
#define TANDEM_THREADPOOL_H

typedef struct tpool tpool;
typedef void (*tpool_fn)(void *ctx, int ith, int nth);

tpool *tpool_create(int n_threads);      /* NULL on failure; n_threads >= 1 */
void tpool_destroy(tpool *p);
int tpool_size(const tpool *p);
void tpool_run(tpool *p, tpool_fn fn, void *ctx);

/* Split [0, n) into nth near-equal parts; part ith is [*lo, *hi). */
void tpool_split(long n, int ith, int nth, long *lo, long *hi);

#endif
