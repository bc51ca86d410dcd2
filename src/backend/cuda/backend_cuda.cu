/* backend_cuda.cu - the CUDA backend: device, memory, weights, the KV cache
 * mirrors and the op table. Kernels are in cuda_kernels.cu, matrix products
 * in cuda_matmul.cu, attention in cuda_attention.cu, MoE in cuda_moe.cu.
 *
 * Every entry point makes the backend's device current first: the prefill
 * node evaluates on its connections' threads, and the current device is
 * per thread. All work goes to one compute stream in order, so activation
 * buffers need no other synchronisation; only `read` waits for it.
 *
 * KV caches. The host caches (kvcache.c) stay the record that the handoff
 * sender and prefix reuse read. Each cache the backend computes on gets a
 * device mirror of the same layout, made at its first use. kv_store encodes
 * the new rows into the mirror on the compute stream, then a second stream
 * copies them to pinned staging; sync_kv (called by forward.c once the rest
 * of the layer has been queued) waits for that copy and puts the rows into
 * the host cache, where the layer hook finds exactly the bytes the CPU
 * backend would have written there. A mirror knows how many leading
 * positions of each layer equal the host rows (`valid`); rows the host got
 * from elsewhere (prefix reuse after kv_forget, a decode node's received
 * frames) are uploaded before they are needed.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "backend/cuda/cuda_internal.h"
#include "base/log.h"

/* Device memory left free at load when deciding whether a quantized weight
 * may be dequantized to F16: KV mirrors and activations come later. */
#define CU_RESERVE_FRACTION 8          /* 1/8 of the device ... */
#define CU_RESERVE_MIN (1ull << 30)    /* ... and at least 1 GiB */
/* Rows of a forward pass unless the caller names a size: 4096-row passes
 * against 512-row ones on an H200 (tandem bench, Q4_K_M): Qwen3-0.6B shape
 * pp4096 24.5k vs 18.3k t/s, pp16384 8.2k vs 6.3k; Qwen3-30B-A3B shape
 * pp4096 4.2k vs 1.4k, pp16384 2.0k vs 0.96k (the experts' products get 8x
 * the rows each). A long prompt's KV still streams layer by layer. */
#define CU_PASS_ROWS 4096

/* ==== Errors ==== */

static void cu_fail(cu_impl *c, const char *what, const char *msg) {
    if (c->failed) return;
    c->failed = 1;
    snprintf(c->err, sizeof c->err, "%.60s: %.180s", what, msg);
    log_error(NULL, "CUDA backend: %s", c->err);
}

int cu_check(cu_impl *c, cudaError_t e, const char *what) {
    if (e == cudaSuccess) return 0;
    cu_fail(c, what, cudaGetErrorString(e));
    return -1;
}

int cu_check_blas(cu_impl *c, cublasStatus_t s, const char *what) {
    if (s == CUBLAS_STATUS_SUCCESS) return 0;
    cu_fail(c, what, cublasGetStatusString(s));
    return -1;
}

#define CU_ENTER(c) cudaSetDevice((c)->device)

/* ==== Op timing ==== */

static const char *const cu_prof_name[CU_P_N] = {
    "get_rows", "rms_norm", "mul_mat (matrix-vector)", "mul_mat (cuBLAS)", "add_bias", "rope", "kv_store",
    "attention", "swiglu", "add", "moe: router logits", "moe: top-k", "moe: counts to the host",
    "moe: place + gather", "moe: gate + up products, SwiGLU", "moe: down product", "moe: combine", "sync_kv",
};

static double cu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

double cu_prof_begin(cu_impl *c) {
    if (!c->prof) return 0.0;
    cudaStreamSynchronize(c->cs);
    return cu_now();
}

void cu_prof_end(cu_impl *c, int op, double t0) {
    if (!c->prof) return;
    cudaStreamSynchronize(c->cs);
    c->prof_s[op] += cu_now() - t0;
    c->prof_n[op]++;
}

static void cu_prof_print(const cu_impl *c) {
    double tot = 0.0;
    for (int i = 0; i < CU_P_N; i++) tot += c->prof_s[i];
    if (tot <= 0.0) return;
    fprintf(stderr, "CUDA op times (TANDEM_CUDA_PROFILE; each op waited for, so no overlap):\n"
                    "| op | calls | ms | %% | us per call |\n|---|---:|---:|---:|---:|\n");
    for (int i = 0; i < CU_P_N; i++)
        if (c->prof_n[i])
            fprintf(stderr, "| %s | %ld | %.1f | %.1f | %.1f |\n", cu_prof_name[i], c->prof_n[i], c->prof_s[i] * 1e3,
                    100.0 * c->prof_s[i] / tot, c->prof_s[i] * 1e6 / (double)c->prof_n[i]);
    fprintf(stderr, "| all | | %.1f | 100 | |\n", tot * 1e3);
    if (c->moe_calls)
        fprintf(stderr, "MoE layouts: %ld of %ld blocks padded (they multiplied %lld rows for %lld routed)\n",
                c->moe_padded, c->moe_calls, c->moe_rows_padded, c->moe_rows_routed);
}

/* ==== Device buffers ==== */

int cu_buf_need(cu_impl *c, cu_buf *b, size_t bytes) {
    if (b->cap >= bytes) return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < bytes) cap *= 2;
    if (b->p) {
        cudaStreamSynchronize(c->cs);   /* queued work may still read the old buffer */
        cudaFree(b->p);
        b->p = NULL;
        b->cap = 0;
    }
    if (cu_check(c, cudaMalloc(&b->p, cap), "cudaMalloc (scratch)")) return -1;
    b->cap = cap;
    return 0;
}

static float *cu_alloc(backend *be, size_t n) {
    cu_impl *c = cu_of(be);
    CU_ENTER(c);
    void *p = NULL;
    size_t bytes = (n ? n : 1) * sizeof(float);
    if (cudaMalloc(&p, bytes) != cudaSuccess) { cudaGetLastError(); return NULL; }
    cudaMemsetAsync(p, 0, bytes, c->cs);
    return (float *)p;
}

static void cu_release(backend *be, float *buf) {
    cu_impl *c = cu_of(be);
    CU_ENTER(c);
    cudaStreamSynchronize(c->cs);
    cudaFree(buf);
}

static void cu_read(backend *be, const float *src, float *dst, size_t n) {
    cu_impl *c = cu_of(be);
    CU_ENTER(c);
    cu_check(c, cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToHost, c->cs), "read");
    cu_check(c, cudaStreamSynchronize(c->cs), "read (a kernel before it failed)");
}

static void cu_write(backend *be, float *dst, const float *src, size_t n) {
    cu_impl *c = cu_of(be);
    CU_ENTER(c);
    cu_check(c, cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyHostToDevice, c->cs), "write");
    cudaStreamSynchronize(c->cs);   /* src may be a caller's stack buffer */
}

/* Copies n host bytes into the stage buffer at offset off (the caller made
 * room with cu_buf_need first); returns the device address. */
static void *cu_stage_put(cu_impl *c, size_t off, const void *host, size_t n) {
    char *d = (char *)c->stage.p + off;
    cu_check(c, cudaMemcpyAsync(d, host, n, cudaMemcpyHostToDevice, c->cs), "upload");
    return d;
}

/* ==== Weights ==== */

/* Whether a quantized weight of `half_bytes` as F16 may be kept that way. */
static int cu_want_dequant(cu_impl *c, size_t half_bytes) {
    if (c->dequant >= 0) return c->dequant;
    size_t free_b = 0, total = 0;
    if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) return 0;
    return free_b > half_bytes + c->reserve;
}

/* The device copy made from the same host bytes as bw (tied embeddings
 * bind one tensor twice). Type and shape must match too: host memory freed
 * and allocated again may come back at the same address. */
static cu_weight *cu_weight_find(cu_impl *c, const be_weight *bw) {
    int64_t rows = bw->ne[1] * (bw->ne[2] > 0 ? bw->ne[2] : 1);
    for (cu_weight *w = c->weights; w; w = w->next)
        if (w->host == bw->data && w->type == bw->type && w->ne0 == bw->ne[0] && w->ne1 == bw->ne[1] &&
            w->rows == rows && w->row_bytes == bw->row_bytes)
            return w;
    return NULL;
}

static cu_weight *cu_weight_upload(cu_impl *c, const be_weight *bw, char *err, size_t errlen) {
    int64_t rows = bw->ne[1] * (bw->ne[2] > 0 ? bw->ne[2] : 1);
    size_t bytes = bw->row_bytes * (size_t)rows;
    cu_weight *w = (cu_weight *)calloc(1, sizeof *w);
    if (!w) { snprintf(err, errlen, "out of memory"); return NULL; }
    w->host = bw->data; w->type = bw->type; w->ne0 = bw->ne[0]; w->ne1 = bw->ne[1]; w->rows = rows; w->row_bytes = bw->row_bytes;
    cudaError_t e = cudaMalloc(&w->raw, bytes ? bytes : 1);
    /* In the compute stream's order and waited for: a plain cudaMemcpy goes
     * on the legacy stream, which the non-blocking streams do not wait for,
     * and from pageable memory it returns once the bytes are staged, not
     * landed. The dequantize kernel below (and every kernel after) read
     * w->raw; on an H200 that race left a Q8_0 file's F16 copies partly
     * garbage in one load of several (every logit off by ~10). */
    if (e == cudaSuccess) e = cudaMemcpyAsync(w->raw, bw->data, bytes, cudaMemcpyHostToDevice, c->cs);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->cs);
    if (e != cudaSuccess) goto fail;
    if (!cu_is_half_native(w->type)) {
        size_t hb = (size_t)w->ne0 * (size_t)rows * 2;
        if (cu_want_dequant(c, hb)) {
            if (cudaMalloc(&w->half, hb) == cudaSuccess &&
                cu_launch_dequant(c, w->type, w->raw, w->half, w->ne0 * rows) == 0 &&
                cudaStreamSynchronize(c->cs) == cudaSuccess) {
                cudaFree(w->raw);
                w->raw = NULL;
            } else {
                cudaGetLastError();
                cudaFree(w->half);    /* keep the quantized copy */
                w->half = NULL;
            }
        }
    }
    w->next = c->weights;
    c->weights = w;
    return w;
fail:
    snprintf(err, errlen, "cannot copy tensor %s (%zu bytes) to %s: %s", bw->name ? bw->name : "?", bytes,
             c->dev_name, cudaGetErrorString(e));
    cudaGetLastError();
    cudaFree(w->raw);
    free(w);
    return NULL;
}

static int cu_load_weight(backend *be, be_weight *w, char *err, size_t errlen) {
    cu_impl *c = cu_of(be);
    CU_ENTER(c);
    pthread_mutex_lock(&c->mu);
    cu_weight *cw = cu_weight_find(c, w);
    if (!cw) cw = cu_weight_upload(c, w, err, errlen);
    pthread_mutex_unlock(&c->mu);
    if (!cw) return -1;
    w->dev = cw;
    return 0;
}

cu_weight *cu_weight_of(cu_impl *c, const be_weight *w) {
    if (w->dev) return (cu_weight *)w->dev;
    char err[256];
    pthread_mutex_lock(&c->mu);
    cu_weight *cw = cu_weight_find(c, w);
    if (!cw) cw = cu_weight_upload(c, w, err, sizeof err);
    pthread_mutex_unlock(&c->mu);
    if (!cw) { cu_fail(c, "weight upload", err); return NULL; }
    ((be_weight *)w)->dev = cw;   /* the model's own (non-const) weight table */
    return cw;
}

/* The f32 vector of a norm or bias weight on the device. */
static const float *cu_vec(cu_impl *c, const be_weight *w) {
    if (!w || !w->data) return NULL;
    cu_weight *cw = cu_weight_of(c, w);
    return cw ? (const float *)cw->raw : NULL;
}

/* ==== KV mirrors ==== */

static cu_kv *cu_kv_find(cu_impl *c, const kvcache *kv) {
    for (cu_kv *m = c->kvs; m; m = m->next)
        if (m->kv == kv) return m;
    return NULL;
}

static void cu_kv_free(cu_kv *m) {
    if (!m) return;
    cudaFree(m->k);
    cudaFree(m->v);
    free(m->valid);
    free(m);
}

/* The mirror of kv, made at its first use (caller holds c->mu). */
static cu_kv *cu_kv_get(cu_impl *c, const kvcache *kv) {
    cu_kv *m = cu_kv_find(c, kv);
    if (m) return m;
    m = (cu_kv *)calloc(1, sizeof *m);
    if (!m) return NULL;
    m->kv = kv; m->n_layer = kv_n_layer(kv); m->n_ctx = kv_n_ctx(kv); m->dim = kv_dim(kv);
    m->dtype = kv_dtype(kv); m->row_bytes = kv_row_bytes(kv);
    size_t bytes = (size_t)m->n_layer * (size_t)m->n_ctx * m->row_bytes;
    m->valid = (int *)calloc((size_t)m->n_layer, sizeof(int));
    if (!m->valid || cudaMalloc(&m->k, bytes) != cudaSuccess || cudaMalloc(&m->v, bytes) != cudaSuccess) {
        char msg[160];
        snprintf(msg, sizeof msg, "no room for a KV cache of %zu MiB", 2 * bytes >> 20);
        cudaGetLastError();
        cu_kv_free(m);
        cu_fail(c, "KV cache", msg);
        return NULL;
    }
    m->next = c->kvs;
    c->kvs = m;
    return m;
}

static size_t cu_kv_off(const cu_kv *m, int layer, int pos) {
    return ((size_t)layer * (size_t)m->n_ctx + (size_t)pos) * m->row_bytes;
}

/* Makes the mirror's rows [0, pos) of `layer` equal the host's. The mirror
 * is position-major ([layer][pos][row_bytes], what the kernels read), the
 * host cache head-major: one strided copy per head puts each head's run of
 * positions into its column of the rows. */
static int cu_kv_catch_up(cu_impl *c, cu_kv *m, int layer, int pos) {
    int from = m->valid[layer];
    if (from >= pos) return 0;
    const size_t hb = kv_head_bytes(m->kv), off = cu_kv_off(m, layer, from);
    for (int h = 0; h < kv_n_head(m->kv); h++) {
        const uint8_t *hk = kv_k_head(m->kv, layer, h) + (size_t)from * hb;
        const uint8_t *hv = kv_v_head(m->kv, layer, h) + (size_t)from * hb;
        if (cu_check(c, cudaMemcpy2DAsync(m->k + off + (size_t)h * hb, m->row_bytes, hk, hb, hb, (size_t)(pos - from),
                                          cudaMemcpyHostToDevice, c->cs), "KV upload") ||
            cu_check(c, cudaMemcpy2DAsync(m->v + off + (size_t)h * hb, m->row_bytes, hv, hb, hb, (size_t)(pos - from),
                                          cudaMemcpyHostToDevice, c->cs), "KV upload"))
            return -1;
    }
    m->valid[layer] = pos;
    return 0;
}

/* Waits for a slot's copy and puts its rows (position-major) into the host caches. */
static void cu_slot_finish(cu_impl *c, cu_kv_slot *s) {
    if (!s->pending) return;
    s->pending = 0;
    if (cu_check(c, cudaEventSynchronize(s->done), "KV copy to the host")) return;
    for (int i = 0; i < s->n_span; i++) {
        const cu_span *sp = &s->span[i];
        size_t n = (size_t)sp->n * kv_row_bytes(sp->kv);
        char err[160];
        if (kv_write_span(sp->kv, s->layer, sp->pos0, sp->n, s->host + sp->off, s->host + sp->off + n, err, sizeof err))
            cu_fail(c, "KV copy to the host", err);
    }
}

static int cu_slot_room(cu_impl *c, cu_kv_slot *s, size_t bytes, int n_span) {
    if (s->cap < bytes) {
        size_t cap = s->cap ? s->cap : 1 << 16;
        while (cap < bytes) cap *= 2;
        if (s->host) cudaFreeHost(s->host);
        s->host = NULL;
        s->cap = 0;
        if (cu_check(c, cudaMallocHost((void **)&s->host, cap), "cudaMallocHost (KV staging)")) return -1;
        s->cap = cap;
    }
    if (s->span_cap < n_span) {
        cu_span *p = (cu_span *)realloc(s->span, sizeof *p * (size_t)n_span);
        if (!p) { cu_fail(c, "KV staging", "out of memory"); return -1; }
        s->span = p;
        s->span_cap = n_span;
    }
    return 0;
}

/* Queues the copy of layer's new rows (already in the mirrors) back to the host. */
static void cu_kv_copy_back(cu_impl *c, const be_batch *b, int layer, cu_kv *const *mir) {
    cu_kv_slot *s = &c->slot[layer & 1];
    cu_slot_finish(c, s);
    size_t bytes = 0;
    for (int i = 0; i < b->n_seq; i++) bytes += 2 * (size_t)b->seq[i].n * mir[i]->row_bytes;
    if (cu_slot_room(c, s, bytes, b->n_seq)) return;
    if (cu_check(c, cudaEventRecord(c->stored, c->cs), "event") ||
        cu_check(c, cudaStreamWaitEvent(c->xs, c->stored, 0), "event"))
        return;
    size_t off = 0;
    for (int i = 0; i < b->n_seq; i++) {
        const be_seq *sq = &b->seq[i];
        const cu_kv *m = mir[i];
        size_t n = (size_t)sq->n * m->row_bytes, src = cu_kv_off(m, layer, sq->pos0);
        cudaMemcpyAsync(s->host + off, m->k + src, n, cudaMemcpyDeviceToHost, c->xs);
        cudaMemcpyAsync(s->host + off + n, m->v + src, n, cudaMemcpyDeviceToHost, c->xs);
        s->span[i] = (cu_span){ sq->kv, sq->pos0, sq->n, off };
        off += 2 * n;
    }
    s->n_span = b->n_seq;
    s->layer = layer;
    if (cu_check(c, cudaEventRecord(s->done, c->xs), "event")) return;
    s->pending = 1;
}

/* The batch's mirrors, caught up for `layer` to each sequence's pos0 (the
 * KV store: the sequence holds exactly pos0 positions, so rows past it are
 * stale) or to pos0 + n (attention, after the store). Caller holds c->mu;
 * mir has n_seq entries. */
static int cu_kv_prepare(cu_impl *c, const be_batch *b, int layer, cu_kv **mir, int store) {
    for (int i = 0; i < b->n_seq; i++) {
        const be_seq *sq = &b->seq[i];
        mir[i] = cu_kv_get(c, sq->kv);
        if (!mir[i]) return -1;
        if (store && mir[i]->valid[layer] > sq->pos0) mir[i]->valid[layer] = sq->pos0;
        if (cu_kv_catch_up(c, mir[i], layer, store ? sq->pos0 : sq->pos0 + sq->n)) return -1;
    }
    return 0;
}

static void cu_kv_store(backend *be, const be_batch *b, int layer, const float *k, const float *v) {
    cu_impl *c = cu_of(be);
    CU_ENTER(c);
    if (c->failed || b->n_seq < 1) return;
    cu_kv **mir = (cu_kv **)malloc(sizeof *mir * (size_t)b->n_seq);
    uint8_t **dst = (uint8_t **)malloc(sizeof *dst * 2 * (size_t)b->n_tok);
    if (!mir || !dst) { free(mir); free(dst); cu_fail(c, "kv_store", "out of memory"); return; }
    double t0 = cu_prof_begin(c);
    pthread_mutex_lock(&c->mu);
    if (cu_kv_prepare(c, b, layer, mir, 1)) goto out;
    /* one launch per cache type in the batch (sessions may differ) */
    for (int pass = 0; pass < b->n_seq; pass++) {
        uint32_t dt = mir[pass]->dtype;
        int seen = 0, rows = 0;
        for (int i = 0; i < pass; i++) seen |= mir[i]->dtype == dt;
        if (seen) continue;
        for (int i = 0; i < b->n_seq; i++) {
            if (mir[i]->dtype != dt) continue;
            const be_seq *sq = &b->seq[i];
            for (int t = 0; t < sq->n; t++) {
                size_t o = cu_kv_off(mir[i], layer, sq->pos0 + t);
                dst[rows] = mir[i]->k + o;
                dst[b->n_tok + rows] = mir[i]->v + o;
                rows++;
            }
        }
        /* rows are contiguous per type only when all sequences share it (the
         * usual case); otherwise store each sequence on its own */
        if (rows == b->n_tok) {
            size_t tb = sizeof(uint8_t *) * 2 * (size_t)b->n_tok;
            if (cu_buf_need(c, &c->stage, tb)) goto out;
            uint8_t **kd = (uint8_t **)cu_stage_put(c, 0, dst, tb);
            cu_launch_kv_store(c, dt, mir[0]->dim, b->n_tok, kd, kd + b->n_tok, k, v);
        } else {
            for (int i = 0; i < b->n_seq; i++) {
                if (mir[i]->dtype != dt) continue;
                const be_seq *sq = &b->seq[i];
                size_t o = (size_t)sq->t0 * mir[i]->dim, tb = sizeof(uint8_t *) * 2 * (size_t)sq->n;
                for (int t = 0; t < sq->n; t++) {
                    size_t ko = cu_kv_off(mir[i], layer, sq->pos0 + t);
                    dst[t] = mir[i]->k + ko;
                    dst[sq->n + t] = mir[i]->v + ko;
                }
                if (cu_buf_need(c, &c->stage, tb)) goto out;
                uint8_t **kd = (uint8_t **)cu_stage_put(c, 0, dst, tb);
                cu_launch_kv_store(c, dt, mir[i]->dim, sq->n, kd, kd + sq->n, k + o, v + o);
            }
        }
    }
    for (int i = 0; i < b->n_seq; i++) mir[i]->valid[layer] = b->seq[i].pos0 + b->seq[i].n;
    cu_kv_copy_back(c, b, layer, mir);
out:
    pthread_mutex_unlock(&c->mu);
    cu_prof_end(c, CU_P_KV_STORE, t0);
    free(mir);
    free(dst);
}

static void cu_sync_kv(backend *be, const be_batch *b, int layer) {
    cu_impl *c = cu_of(be);
    CU_ENTER(c);
    double t0 = cu_prof_begin(c);
    pthread_mutex_lock(&c->mu);
    cu_kv_slot *s = &c->slot[layer & 1];
    if (s->pending && s->layer == layer) cu_slot_finish(c, s);
    pthread_mutex_unlock(&c->mu);
    cu_prof_end(c, CU_P_SYNC_KV, t0);
}

static void cu_kv_forget(backend *be, const kvcache *kv, int pos) {
    cu_impl *c = cu_of(be);
    CU_ENTER(c);
    pthread_mutex_lock(&c->mu);
    /* copies in flight write host rows: let them land before the caller
     * rewrites or frees those rows */
    for (int i = 0; i < 2; i++) {
        cu_kv_slot *s = &c->slot[i];
        int mine = 0;
        for (int j = 0; s->pending && j < s->n_span; j++) mine |= s->span[j].kv == kv;
        if (mine) cu_slot_finish(c, s);
    }
    cu_kv **pp = &c->kvs;
    while (*pp && (*pp)->kv != kv) pp = &(*pp)->next;
    cu_kv *m = *pp;
    if (m && pos < 0) {
        *pp = m->next;
        cudaStreamSynchronize(c->cs);
        cu_kv_free(m);
    } else if (m) {
        for (int l = 0; l < m->n_layer; l++)
            if (m->valid[l] > pos) m->valid[l] = pos;
    }
    pthread_mutex_unlock(&c->mu);
}

/* ==== Row-wise ops ==== */

static int cu_get_rows(backend *be, const be_weight *w, const int32_t *ids, int n, float *out) {
    cu_impl *c = cu_of(be);
    CU_ENTER(c);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= w->ne[1]) return -1;
    cu_weight *cw = cu_weight_of(c, w);
    if (!cw || c->failed || cu_buf_need(c, &c->stage, sizeof(int32_t) * (size_t)n)) return -1;
    double t0 = cu_prof_begin(c);
    const int32_t *d = (const int32_t *)cu_stage_put(c, 0, ids, sizeof(int32_t) * (size_t)n);
    int rc = cu_launch_get_rows(c, cw, d, n, out);
    cu_prof_end(c, CU_P_GET_ROWS, t0);
    return rc || c->failed ? -1 : 0;
}

static void cu_rms_norm(backend *be, const float *x, const be_weight *w, float *y, int n_rows, int dim, float eps) {
    cu_impl *c = cu_of(be);
    CU_ENTER(c);
    const float *wd = cu_vec(c, w);
    double t0 = cu_prof_begin(c);
    cu_launch_rms_norm(c, x, wd, y, n_rows, dim, eps);
    cu_prof_end(c, CU_P_RMS_NORM, t0);
}

static void cu_mul_mat(backend *be, const be_weight *w, int expert, const float *x, int n_tok, float *y) {
    cu_impl *c = cu_of(be);
    CU_ENTER(c);
    cu_weight *cw = cu_weight_of(c, w);
    if (!cw) return;
    double t0 = cu_prof_begin(c);
    cu_matmul(c, cw, expert, x, n_tok, y);
    cu_prof_end(c, cu_matmul_uses_mmv(n_tok) ? CU_P_MMV : CU_P_GEMM, t0);
}

static void cu_add_bias(backend *be, float *x, const be_weight *b, int n_tok) {
    cu_impl *c = cu_of(be);
    CU_ENTER(c);
    const float *d = cu_vec(c, b);
    if (!d) return;
    double t0 = cu_prof_begin(c);
    cu_launch_add_bias(c, x, d, n_tok, (int)b->ne[0]);
    cu_prof_end(c, CU_P_BIAS, t0);
}

/* The device copy of the rope frequency factors (one array per model). */
static const float *cu_freq_factors(cu_impl *c, const rope_cfg *rc) {
    if (!rc->freq_factors) return NULL;
    int n = rc->n_rot / 2;
    if (c->ff_host == rc->freq_factors && c->ff_n == n) return c->ff_dev;
    cudaStreamSynchronize(c->cs);
    cudaFree(c->ff_dev);
    c->ff_dev = NULL;
    c->ff_host = NULL;
    if (cu_check(c, cudaMalloc(&c->ff_dev, sizeof(float) * (size_t)n), "cudaMalloc (rope factors)") ||
        cu_check(c, cudaMemcpyAsync(c->ff_dev, rc->freq_factors, sizeof(float) * (size_t)n, cudaMemcpyHostToDevice,
                                    c->cs), "rope factors"))   /* stream order: see cu_weight_upload */
        return NULL;
    c->ff_host = rc->freq_factors;
    c->ff_n = n;
    return c->ff_dev;
}

static void cu_rope(backend *be, float *x, int n_tok, int n_head, int head_dim, const int32_t *pos, const rope_cfg *rc) {
    cu_impl *c = cu_of(be);
    CU_ENTER(c);
    if (c->failed) return;
    const float *ff = cu_freq_factors(c, rc);
    if (rc->freq_factors && !ff) return;
    if (cu_buf_need(c, &c->stage, sizeof(int32_t) * (size_t)n_tok)) return;
    double t0 = cu_prof_begin(c);
    const int32_t *d = (const int32_t *)cu_stage_put(c, 0, pos, sizeof(int32_t) * (size_t)n_tok);
    cu_launch_rope(c, x, n_tok, n_head, head_dim, d, rc, ff);
    cu_prof_end(c, CU_P_ROPE, t0);
}

static void cu_swiglu(backend *be, const float *g, const float *u, float *y, size_t n) {
    cu_impl *c = cu_of(be);
    CU_ENTER(c);
    double t0 = cu_prof_begin(c);
    cu_launch_swiglu(c, g, u, y, n);
    cu_prof_end(c, CU_P_SWIGLU, t0);
}

static void cu_add(backend *be, float *x, const float *y, size_t n) {
    cu_impl *c = cu_of(be);
    CU_ENTER(c);
    double t0 = cu_prof_begin(c);
    cu_launch_add(c, x, y, n);
    cu_prof_end(c, CU_P_ADD, t0);
}

/* ==== Attention ==== */

static int cu_attention(backend *be, const float *q, const be_batch *b, int layer, int n_head, int n_head_kv,
                        int head_dim, float scale, float *out) {
    cu_impl *c = cu_of(be);
    CU_ENTER(c);
    if (c->failed || n_head_kv < 1 || n_head % n_head_kv || b->n_seq < 1) return -1;
    cu_kv **mir = (cu_kv **)malloc(sizeof *mir * (size_t)b->n_seq);
    cu_attn_seq *as = (cu_attn_seq *)malloc(sizeof *as * (size_t)b->n_seq);
    int rc = -1;
    double t0 = cu_prof_begin(c);
    if (!mir || !as) goto out;
    pthread_mutex_lock(&c->mu);
    rc = cu_kv_prepare(c, b, layer, mir, 0);
    pthread_mutex_unlock(&c->mu);
    if (rc) goto out;
    /* one launch per cache type in the batch */
    for (int pass = 0; pass < b->n_seq && !rc; pass++) {
        uint32_t dt = mir[pass]->dtype;
        int seen = 0, n = 0;
        for (int i = 0; i < pass; i++) seen |= mir[i]->dtype == dt;
        if (seen) continue;
        for (int i = 0; i < b->n_seq; i++) {
            if (mir[i]->dtype != dt) continue;
            size_t o = cu_kv_off(mir[i], layer, 0);
            as[n++] = (cu_attn_seq){ mir[i]->k + o, mir[i]->v + o, b->seq[i].t0, b->seq[i].n, b->seq[i].pos0 };
        }
        rc = cu_launch_attention(c, dt, q, as, n, n_head, n_head_kv, head_dim, mir[pass]->row_bytes, scale, out);
    }
out:
    cu_prof_end(c, CU_P_ATTN, t0);
    free(mir);
    free(as);
    return rc || c->failed ? -1 : 0;
}

static int cu_moe(backend *be, const be_moe *m, const float *x, int n_tok, float *y) {
    cu_impl *c = cu_of(be);
    CU_ENTER(c);
    if (c->failed) return -1;
    return cu_moe_ffn(c, m, x, n_tok, y) || c->failed ? -1 : 0;
}

/* ==== Table ==== */

static void cu_destroy(backend *be) {
    if (!be) return;
    cu_impl *c = cu_of(be);
    if (c) {
        CU_ENTER(c);
        if (c->prof) cu_prof_print(c);
        for (int i = 0; i < 2; i++) {
            cu_slot_finish(c, &c->slot[i]);
            if (c->slot[i].host) cudaFreeHost(c->slot[i].host);
            free(c->slot[i].span);
            if (c->slot[i].done) cudaEventDestroy(c->slot[i].done);
        }
        if (c->cs) cudaStreamSynchronize(c->cs);
        while (c->weights) {
            cu_weight *w = c->weights;
            c->weights = w->next;
            cudaFree(w->raw);
            cudaFree(w->half);
            free(w);
        }
        while (c->kvs) {
            cu_kv *m = c->kvs;
            c->kvs = m->next;
            cu_kv_free(m);
        }
        cu_buf *bufs[] = { &c->stage, &c->act, &c->wtmp, &c->moe, &c->moe_rows, &c->ptrs };
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaFree(bufs[i]->p);
        cudaFree(c->ff_dev);
        if (c->blas) cublasDestroy(c->blas);
        if (c->stored) cudaEventDestroy(c->stored);
        if (c->cs) cudaStreamDestroy(c->cs);
        if (c->xs) cudaStreamDestroy(c->xs);
        pthread_mutex_destroy(&c->mu);
        free(c);
    }
    free(be);
}

static const backend_ops cu_ops = {
    /* .name = */ "cuda",
    /* .destroy = */ cu_destroy,
    /* .alloc = */ cu_alloc,
    /* .release = */ cu_release,
    /* .read = */ cu_read,
    /* .write = */ cu_write,
    /* .get_rows = */ cu_get_rows,
    /* .rms_norm = */ cu_rms_norm,
    /* .mul_mat = */ cu_mul_mat,
    /* .add_bias = */ cu_add_bias,
    /* .rope = */ cu_rope,
    /* .attention = */ cu_attention,
    /* .kv_store = */ cu_kv_store,
    /* .swiglu = */ cu_swiglu,
    /* .add = */ cu_add,
    /* .moe_ffn = */ cu_moe,
    /* .load_weight = */ cu_load_weight,
    /* .sync_kv = */ cu_sync_kv,
    /* .kv_forget = */ cu_kv_forget,
    /* .mul_mat_n = */ NULL,
    /* .warm_next = */ NULL,
    /* .pass_rows = */ CU_PASS_ROWS,
};

/* ==== Creation ==== */

static int cu_env_int(const char *name, int def) {
    const char *e = getenv(name);
    if (!e || !*e) return def;
    if (!strcmp(e, "auto")) return -1;
    return atoi(e);
}

/* A trivial kernel: launching it proves the build has code for this GPU. */
__global__ void cu_probe_kernel(int *p) { if (p) *p = 1; }

/* Whether the NVIDIA driver's library can be loaded at all (cudart, linked
 * statically, loads it itself on first use). */
static int cu_driver_library_present(void) {
    void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!h) return 0;
    dlclose(h);
    return 1;
}

/* "No CUDA device" (the wording the tests take as a skip, and only these
 * three cases) is a machine that has none: the driver reports 0 devices or
 * cudaErrorNoDevice, or there is no driver at all (libcuda.so.1 cannot be
 * loaded; cudart then says cudaErrorInsufficientDriver). A driver that is
 * there but fails (too old for this runtime, cudaErrorInitializationError,
 * a kernel module of another version, ...) is a broken machine, not a
 * machine without a GPU: its message says "the CUDA driver failed". */
static int cu_start(cu_impl *c, int device, char *err, size_t errlen) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        int lib = cu_driver_library_present();
        if (e == cudaSuccess || e == cudaErrorNoDevice)
            snprintf(err, errlen, "CUDA backend: no CUDA device found (cudaGetDeviceCount: %s)",
                     e == cudaSuccess ? "0 devices" : cudaGetErrorString(e));
        else if (!lib)
            snprintf(err, errlen, "CUDA backend: no CUDA device found (no NVIDIA driver: libcuda.so.1 not found; "
                     "cudaGetDeviceCount: %s)", cudaGetErrorString(e));
        else
            snprintf(err, errlen, "CUDA backend: the CUDA driver failed to start (libcuda.so.1 is there; "
                     "cudaGetDeviceCount: %s, error %d)", cudaGetErrorString(e), (int)e);
        cudaGetLastError();
        return -1;
    }
    if (device < 0 || device >= n) {
        snprintf(err, errlen, "CUDA backend: device %d does not exist (%d device%s found)", device, n, n == 1 ? "" : "s");
        return -1;
    }
    c->device = device;
    cudaDeviceProp p;
    if ((e = cudaSetDevice(device)) != cudaSuccess || (e = cudaGetDeviceProperties(&p, device)) != cudaSuccess) {
        snprintf(err, errlen, "CUDA backend: cannot open device %d: %s", device, cudaGetErrorString(e));
        return -1;
    }
    snprintf(c->dev_name, sizeof c->dev_name, "CUDA device %d (%.80s, sm_%d%d)", device, p.name, p.major, p.minor);
    cu_probe_kernel<<<1, 1>>>(NULL);
    if ((e = cudaGetLastError()) != cudaSuccess || (e = cudaDeviceSynchronize()) != cudaSuccess) {
        snprintf(err, errlen, "CUDA backend: %s cannot run this build's kernels (%s); it was built for "
                 "sm_90, sm_100, sm_120, sm_121 and compute_90 PTX", c->dev_name, cudaGetErrorString(e));
        return -1;
    }
    cublasStatus_t bs = cublasCreate(&c->blas);
    if (bs != CUBLAS_STATUS_SUCCESS) {
        c->blas = NULL;
        snprintf(err, errlen, "CUDA backend: cuBLAS could not start on %s (cublasCreate: %s)", c->dev_name,
                 cublasGetStatusString(bs));
        return -1;
    }
    if ((e = cudaStreamCreateWithFlags(&c->cs, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&c->xs, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&c->stored, cudaEventDisableTiming)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&c->slot[0].done, cudaEventDisableTiming)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&c->slot[1].done, cudaEventDisableTiming)) != cudaSuccess) {
        snprintf(err, errlen, "CUDA backend: cannot create streams on %s: %s", c->dev_name, cudaGetErrorString(e));
        return -1;
    }
    cublasSetStream(c->blas, c->cs);
    c->reserve = p.totalGlobalMem / CU_RESERVE_FRACTION;
    if (c->reserve < CU_RESERVE_MIN) c->reserve = CU_RESERVE_MIN;
    int mib = cu_env_int("TANDEM_CUDA_RESERVE_MIB", 0);
    if (mib > 0) c->reserve = (size_t)mib << 20;
    c->dequant = cu_env_int("TANDEM_CUDA_DEQUANT", -1);
    c->gemm_split = cu_env_int("TANDEM_CUDA_GEMM_SPLIT", 1);
    c->moe_grouped = cu_env_int("TANDEM_CUDA_MOE_GROUPED", 1);
    c->moe_pad = cu_env_int("TANDEM_CUDA_MOE_PAD", 1);
    c->prof = cu_env_int("TANDEM_CUDA_PROFILE", 0) > 0;
    const char *att = getenv("TANDEM_CUDA_ATTN");
    c->attn_tc = !(att && !strcmp(att, "cores"));   /* long prompts on tensor cores unless told otherwise */
    /* 1: q as hi + lo halves, probabilities hi only (the default); 3: both
     * split; 0: neither (see cuda_attention.cu) */
    c->attn_split = cu_env_int("TANDEM_CUDA_ATTN_SPLIT", 1);
    if (c->attn_split != 0 && c->attn_split != 3) c->attn_split = 1;
    c->smem_optin = p.sharedMemPerBlockOptin;
    return 0;
}

extern "C" backend *backend_cuda_create(int device, int n_threads, char *err, size_t errlen) {
    (void)n_threads;
    backend *be = (backend *)calloc(1, sizeof *be);
    cu_impl *c = (cu_impl *)calloc(1, sizeof *c);
    if (!be || !c) { free(be); free(c); snprintf(err, errlen, "out of memory"); return NULL; }
    pthread_mutex_init(&c->mu, NULL);
    be->ops = &cu_ops;
    be->impl = c;
    if (cu_start(c, device, err, errlen)) { cu_destroy(be); return NULL; }
    return be;
}

/* ==== Host versions of the device code (tests) ==== */

extern "C" void backend_cuda_host_dequantize_row(uint32_t type, const void *row, float *y, int64_t n) {
    const uint8_t *r = (const uint8_t *)row;
    for (int64_t i = 0; i < n; i++) {
        float v = 0.0f;
        CU_TYPE_SWITCH(type, v = cu_dq<TT>(r, i));
        y[i] = v;
    }
}

extern "C" void backend_cuda_host_kv_row(uint32_t dtype, const float *x, void *y, int64_t n) {
    uint8_t *o = (uint8_t *)y;
    if (dtype == GGML_TYPE_Q8_0)
        for (int64_t b = 0; b < n / 32; b++) cu_kv_encode_q8_0(x + 32 * b, o + 34 * (size_t)b);
    else
        for (int64_t i = 0; i < n; i++) cu_kv_encode_half(dtype, x[i], o + 2 * (size_t)i);
}

extern "C" void backend_cuda_host_rope_angles(int pos, const rope_cfg *rc, float *cs, float *sn) {
    float theta_scale = powf(rc->freq_base, -2.0f / (float)rc->n_rot);
    for (int i = 0; i < rc->n_rot / 2; i++)
        cu_rope_angle(pos, i, theta_scale, rc->freq_factors ? rc->freq_factors[i] : 1.0f, rc->freq_scale, &cs[i], &sn[i]);
}
