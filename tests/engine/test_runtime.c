/* test_runtime.c - the pieces under the forward pass: thread pool, KV cache
 * spans and limits, sampler. */
#include <math.h>
#include <stdatomic.h>

#include "engine/gguf.h"
#include "engine/kvcache.h"
#include "engine/quant.h"
#include "engine/sampler.h"
#include "base/threadpool.h"
#include "t.h"

/* ==== thread pool ==== */

typedef struct { atomic_int hits[1000]; atomic_int calls; } tp_ctx;

static void tp_job(void *ud, int ith, int nth) {
    tp_ctx *c = ud;
    long lo, hi;
    tpool_split(1000, ith, nth, &lo, &hi);
    for (long i = lo; i < hi; i++) atomic_fetch_add(&c->hits[i], 1);
    atomic_fetch_add(&c->calls, 1);
}

static void test_threadpool(void) {
    for (int nth = 1; nth <= 4; nth++) {
        tpool *p = tpool_create(nth);
        CHECK(p && tpool_size(p) == nth, "pool of %d", nth);
        static tp_ctx c;
        memset(&c, 0, sizeof c);
        for (int r = 0; r < 500; r++) tpool_run(p, tp_job, &c);
        int ok = 1;
        for (int i = 0; i < 1000; i++) ok &= atomic_load(&c.hits[i]) == 500;
        CHECK(ok, "every index covered exactly once per run with %d threads", nth);
        CHECK(atomic_load(&c.calls) == 500 * nth, "calls %d", atomic_load(&c.calls));
        tpool_destroy(p);
    }
    long lo, hi, prev = 0;
    for (int i = 0; i < 7; i++) {
        tpool_split(20, i, 7, &lo, &hi);
        CHECK(lo == prev && hi >= lo, "split contiguous");
        prev = hi;
    }
    CHECK(prev == 20, "split covers all");
}

/* Back-to-back jobs whose chunk counts grow and shrink: every chunk of every
 * job runs exactly once and each job returns (regression: a worker that read
 * the next job's larger count could claim a chunk that did not exist, push
 * the done counter past the count, and leave the caller asleep forever). */
typedef struct { atomic_int hits[64]; int n; } chunk_ctx;

static void chunk_job(void *ud, int chunk, int tid) {
    chunk_ctx *c = ud;
    (void)tid;
    if (chunk >= 0 && chunk < 64) atomic_fetch_add(&c->hits[chunk], 1);
}

static void test_threadpool_chunks(void) {
    tpool *p = tpool_create(2);
    static chunk_ctx c;
    int bad = 0;
    for (int it = 0; it < 1000000 && !bad; it++) {
        int n = 1 + (int)(((unsigned)it * 7919u) % 13u);   /* 1..13 chunks, scrambled order */
        memset(&c, 0, sizeof c);
        c.n = n;
        tpool_run_chunks(p, chunk_job, &c, n);
        for (int i = 0; i < 64; i++) bad |= atomic_load(&c.hits[i]) != (i < n);
    }
    CHECK(!bad, "every chunk of 1000000 jobs of 1..13 chunks ran exactly once");
    tpool_destroy(p);
}

/* Ranged jobs (tpool_run_ranges) back to back with chunked ones: every item
 * runs exactly once, tids are in range, and a thread whose own run is done
 * takes items from the back of a slow thread's run (item 0's thread sleeps). */
typedef struct { atomic_int hits[64]; atomic_int tid_of[64]; int nth, slow; } range_ctx;

static void range_job(void *ud, int item, int tid) {
    range_ctx *c = ud;
    if (item < 0 || item >= 64) return;
    atomic_fetch_add(&c->hits[item], 1);
    atomic_store(&c->tid_of[item], tid < 0 || tid >= c->nth ? -1 : tid);
    if (c->slow && item == 0) usleep(3000);
}

static void test_threadpool_ranges(void) {
    for (int nth = 1; nth <= 4; nth++) {
        tpool *p = tpool_create(nth);
        static range_ctx c;
        /* warm lists with a real buffer, no bytes, and addresses nothing is
         * mapped at (a prefetch must not fault) */
        static char buf[1 << 16];
        tpool_warm warm[4] = { { buf, sizeof buf }, { NULL, 0 }, { (const void *)64, 8192 },
                               { buf + 100, sizeof buf - 100 } };
        int bad = 0;
        for (int it = 0; it < 200000 && !bad; it++) {
            int n = 1 + (int)(((unsigned)it * 7919u) % 40u);
            memset(&c, 0, sizeof c);
            c.nth = nth;
            if (it % 3 == 2) tpool_run_chunks(p, range_job, &c, n);
            else if (it % 3 == 1) tpool_run_ranges_warm(p, range_job, &c, n, warm);
            else tpool_run_ranges(p, range_job, &c, n);
            for (int i = 0; i < 64; i++) bad |= atomic_load(&c.hits[i]) != (i < n) || atomic_load(&c.tid_of[i]) < 0;
        }
        CHECK(!bad, "%d threads: every item of 200000 ranged (with and without warm lists) and chunked jobs ran exactly once, tids in range", nth);
        int stolen = 0;
        for (int tries = 0; tries < 20 && nth > 1 && !stolen; tries++) {
            memset(&c, 0, sizeof c);
            c.nth = nth;
            c.slow = 1;
            tpool_run_ranges(p, range_job, &c, 40);
            long lo, hi;
            tpool_split(40, 0, nth, &lo, &hi);   /* thread 0 (the caller) owns [lo, hi) and sleeps in item 0 */
            for (long i = lo + 1; i < hi; i++) stolen |= atomic_load(&c.tid_of[i]) != 0;
            for (int i = 0; i < 40; i++) bad |= atomic_load(&c.hits[i]) != 1;
        }
        if (nth > 1) CHECK(stolen && !bad, "%d threads: the slow thread's items were taken by the others", nth);
        tpool_destroy(p);
    }
}

/* ==== KV cache ==== */

static void test_kvcache(void) {
    char err[256];
    kvcache *kv = NULL;
    CHECK(kv_create(&kv, 2, 16, 2, 33, GGML_TYPE_Q8_0, err, sizeof err) != 0, "q8_0 needs a head dim that is a multiple of 32");
    CHECK(kv_create(&kv, 2, 16, 4, 16, GGML_TYPE_Q8_0, err, sizeof err) != 0, "q8_0 refuses 16-wide heads of a 64 dim");
    CHECK(kv_create(&kv, 2, 16, 2, 32, GGML_TYPE_Q4_K, err, sizeof err) != 0, "q4_k cache refused");
    CHECK(strstr(err, "Q4_K") != NULL, "message names the type: %s", err);
    uint32_t types[] = { GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0 };
    for (int ti = 0; ti < 3; ti++) {
        CHECK(kv_create(&kv, 3, 16, 2, 32, types[ti], err, sizeof err) == 0, "create: %s", err);
        if (!kv) continue;
        CHECK(kv_row_bytes(kv) == gguf_row_bytes(types[ti], 64), "row bytes");
        CHECK(kv_head_bytes(kv) == gguf_row_bytes(types[ti], 32) && kv_dim(kv) == 64, "head bytes, dim");
        float k[4 * 64], v[4 * 64];
        for (int i = 0; i < 4 * 64; i++) { k[i] = sinf(i * 0.1f); v[i] = cosf(i * 0.07f); }
        kv_store_f32(kv, 1, 5, 4, k, v);
        size_t rb = kv_row_bytes(kv);
        uint8_t *kb = malloc(4 * rb), *vb = malloc(4 * rb);
        CHECK(kv_read_span(kv, 1, 5, 4, kb, vb, err, sizeof err) == 0, "read span");
        /* head-major inside: head 1 of position 7 is the third row of head 1's array from 5 */
        size_t hb = kv_head_bytes(kv);
        CHECK(memcmp(kb + 2 * rb + hb, kv_k_head(kv, 1, 1) + 7 * hb, hb) == 0, "span row = the heads' rows");
        CHECK(memcmp(vb + 3 * rb, kv_v_head(kv, 1, 0) + 8 * hb, hb) == 0, "span V row = head 0's row");
        float back[64];
        quant_dequantize_row(types[ti], kb + 2 * rb, back, 64);
        float maxerr = 0;
        for (int i = 0; i < 64; i++) maxerr = fmaxf(maxerr, fabsf(back[i] - k[2 * 64 + i]));
        CHECK(maxerr < 0.02f, "round trip error %g", maxerr);
        /* write into another layer and position, read it back */
        CHECK(kv_write_span(kv, 2, 0, 4, kb, vb, err, sizeof err) == 0, "write span");
        CHECK(memcmp(kv_v_head(kv, 2, 1) + 3 * hb, vb + 3 * rb + hb, hb) == 0, "written V row, head 1");
        uint8_t *kb2 = malloc(4 * rb), *vb2 = malloc(4 * rb);
        CHECK(kv_read_span(kv, 2, 0, 4, kb2, vb2, err, sizeof err) == 0 && !memcmp(kb, kb2, 4 * rb) &&
              !memcmp(vb, vb2, 4 * rb), "written span reads back");
        free(kb2); free(vb2);
        CHECK(kv_write_span(kv, 2, 14, 4, kb, vb, err, sizeof err) != 0, "past the context refused");
        CHECK(strstr(err, "context length exceeded") != NULL, "message: %s", err);
        CHECK(kv_write_span(kv, 3, 0, 1, kb, vb, err, sizeof err) != 0, "bad layer refused");
        CHECK(kv_read_span(kv, 0, -1, 1, kb, vb, err, sizeof err) != 0, "negative position refused");
        kv_set_used(kv, 99);
        CHECK(kv_used(kv) == 16, "used clamps to n_ctx");
        free(kb); free(vb);
        kv_free(kv);
        kv = NULL;
    }
}

/* Prefix sharing: every layer's and head's first n positions copied, the
 * rest of dst untouched, caches of other shapes refused. */
static void test_kv_copy_prefix(void) {
    char err[256];
    kvcache *a = NULL, *b = NULL, *c = NULL;
    CHECK(kv_create(&a, 2, 16, 3, 32, GGML_TYPE_F16, err, sizeof err) == 0, "create a: %s", err);
    CHECK(kv_create(&b, 2, 16, 3, 32, GGML_TYPE_F16, err, sizeof err) == 0, "create b: %s", err);
    CHECK(kv_create(&c, 2, 16, 2, 48, GGML_TYPE_F16, err, sizeof err) == 0, "create c: %s", err);
    if (!a || !b || !c) { kv_free(a); kv_free(b); kv_free(c); return; }
    float k[10 * 96], v[10 * 96];
    for (int i = 0; i < 10 * 96; i++) { k[i] = (float)i; v[i] = -(float)i; }
    for (int l = 0; l < 2; l++) kv_store_f32(a, l, 0, 10, k, v);
    kv_set_used(a, 10);
    CHECK(kv_copy_prefix(b, a, 11, err, sizeof err) != 0, "more than the source holds refused");
    CHECK(kv_copy_prefix(c, a, 4, err, sizeof err) != 0, "other head shape refused (same dim)");
    CHECK(kv_copy_prefix(b, a, 7, err, sizeof err) == 0 && kv_used(b) == 7, "copy 7: %s", err);
    size_t rb = kv_row_bytes(a);
    uint8_t x[10 * 192], y[10 * 192], xv[10 * 192], yv[10 * 192], zero[192] = { 0 };
    for (int l = 0; l < 2; l++) {
        CHECK(kv_read_span(a, l, 0, 10, x, xv, err, sizeof err) == 0 && kv_read_span(b, l, 0, 10, y, yv, err, sizeof err) == 0,
              "read spans");
        CHECK(!memcmp(x, y, 7 * rb) && !memcmp(xv, yv, 7 * rb), "layer %d: positions 0..6 copied", l);
        int rest = 1;
        for (int p = 7; p < 10; p++) rest &= !memcmp(y + p * rb, zero, rb) && !memcmp(yv + p * rb, zero, rb);
        CHECK(rest, "layer %d: positions 7..9 of the copy untouched", l);
    }
    kv_free(a); kv_free(b); kv_free(c);
}

/* ==== sampler ==== */

static void test_sampler(void) {
    enum { N = 1000 };
    static float logits[N];
    for (int i = 0; i < N; i++) logits[i] = (float)((i * 7919) % 1000) / 100.0f;  /* max at some id */
    int best = sampler_argmax(logits, N);
    sampler_params p = sampler_defaults();
    p.temp = 0;
    sampler *s = sampler_new(&p, N);
    CHECK(sampler_sample(s, logits) == best, "greedy = argmax");
    sampler_free(s);
    logits[3] = logits[best];
    CHECK(sampler_argmax(logits, N) == (best < 3 ? best : 3), "ties go to the lowest id");

    p.temp = 1.0f; p.top_k = 5; p.top_p = 1.0f; p.min_p = 0; p.seed = 42;
    sampler *a = sampler_new(&p, N), *b = sampler_new(&p, N);
    int same = 1, in_top = 1, distinct = 0, seen[N] = { 0 };
    float sorted[N];
    memcpy(sorted, logits, sizeof sorted);
    /* 5th largest value */
    for (int i = 0; i < 5; i++) {
        int m = i;
        for (int j = i + 1; j < N; j++) if (sorted[j] > sorted[m]) m = j;
        float t = sorted[i]; sorted[i] = sorted[m]; sorted[m] = t;
    }
    for (int i = 0; i < 200; i++) {
        int x = sampler_sample(a, logits), y = sampler_sample(b, logits);
        same &= x == y;
        in_top &= logits[x] >= sorted[4];
        if (!seen[x]++) distinct++;
    }
    CHECK(same, "same seed, same draws");
    CHECK(in_top, "top-k respected");
    CHECK(distinct > 1, "temperature 1 draws more than one token (%d)", distinct);
    sampler_free(a); sampler_free(b);

    /* min-p: only tokens within a factor of the best survive */
    for (int i = 0; i < N; i++) logits[i] = -10.0f;
    logits[10] = 5.0f; logits[11] = 4.5f;
    p.top_k = 0; p.top_p = 1.0f; p.min_p = 0.5f; p.temp = 1.0f;
    s = sampler_new(&p, N);
    int only = 1;
    for (int i = 0; i < 300; i++) { int x = sampler_sample(s, logits); only &= x == 10 || x == 11; }
    CHECK(only, "min-p keeps only the two close tokens");
    sampler_free(s);
    /* top-p 0.5 with one dominant token: always that token */
    p.min_p = 0; p.top_p = 0.5f;
    logits[10] = 20.0f;
    s = sampler_new(&p, N);
    only = 1;
    for (int i = 0; i < 100; i++) only &= sampler_sample(s, logits) == 10;
    CHECK(only, "top-p keeps the dominant token");
    sampler_free(s);
}

int main(void) {
    test_threadpool();
    test_threadpool_chunks();
    test_threadpool_ranges();
    test_kvcache();
    test_kv_copy_prefix();
    test_sampler();
    return t_done("test_runtime");
}
