/* threadpool.h - a fixed pool of worker threads for data-parallel kernels.
 *
 * A job is a set of numbered chunks. tpool_run(fn) makes nth chunks and calls
 * fn(ctx, i, nth) once for every i in [0, nth); tpool_run_chunks(fn, n) calls
 * fn(ctx, i, tid) for every chunk i in [0, n), tid being the index (< nth) of
 * the thread that runs it, for per-thread scratch. Threads claim chunks from
 * a shared counter, so when a worker is descheduled (another process on its
 * core) the caller simply runs the remaining chunks itself instead of waiting
 * for it. Waiting threads spin briefly (a decode step issues hundreds of small
 * jobs per token, and a wake-up per job would cost more than the job), then
 * sleep (platform.h: a futex on Linux, a condition variable elsewhere).
 */
#ifndef TANDEM_THREADPOOL_H
#define TANDEM_THREADPOOL_H

#include <stddef.h>

typedef struct tpool tpool;
typedef void (*tpool_fn)(void *ctx, int ith, int nth);

tpool *tpool_create(int n_threads);      /* NULL on failure; n_threads >= 1 */
void tpool_destroy(tpool *p);
int tpool_size(const tpool *p);
void tpool_run(tpool *p, tpool_fn fn, void *ctx);
/* fn(ctx, chunk, tid) for chunk in [0, n_chunks); tid < tpool_size(p). */
void tpool_run_chunks(tpool *p, tpool_fn fn, void *ctx, int n_chunks);
/* fn(ctx, item, tid) for item in [0, n_items), as tpool_run_chunks, but
 * thread t starts on the t-th contiguous run of items and walks it in order
 * (claiming a quarter of what is left of it at a time); a thread whose run
 * is done takes items one by one from the back of the fullest other run.
 * Memory-bound walks over consecutive items (a decode step's weight rows)
 * then read one sequential stream per thread, which the hardware
 * prefetchers follow, instead of a stream that jumps after every chunk. */
void tpool_run_ranges(tpool *p, tpool_fn fn, void *ctx, int n_items);

/* Memory a thread will read soon after this job. */
typedef struct {
    const void *addr;
    size_t len;
} tpool_warm;

/* tpool_run_ranges, then each thread t that ran items prefetches
 * warm[t] (warm: tpool_size(p) entries, or NULL) once its share is done: a
 * worker straight after it, the caller while it waits for the last worker
 * (stopping when that one finishes). A decode step's threads wait at the end
 * of every product and during the serial work between products while memory
 * idles; warming the start of each thread's run of the next product there
 * moves those bytes out of the next walk (measured on a 2-core Zen 5,
 * Qwen3-0.6B Q4_K_M / Q5_K_M decode, tokens alternated with and without in
 * one process: 1.5-3% faster per token). Prefetches never fault: warm
 * may name any addresses. */
void tpool_run_ranges_warm(tpool *p, tpool_fn fn, void *ctx, int n_items, const tpool_warm *warm);
/* Split [0, n) into nth near-equal parts; part ith is [*lo, *hi). */
void tpool_split(long n, int ith, int nth, long *lo, long *hi);

#endif
