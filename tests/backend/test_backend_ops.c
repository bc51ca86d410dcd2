/* test_backend_ops.c - every op of backend.h on a backend under test against
 * the CPU backend, by normalised mean squared error (NMSE = sum (a - b)^2 /
 * sum b^2), in the manner of ggml's test-backend-ops: every weight type
 * (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_1, Q5_0, Q4_K, Q5_K, Q6_K), odd sizes, several
 * sequences per batch, every KV cache type. The KV rows a backend leaves in
 * the host caches must equal the CPU backend's byte for byte (the handoff
 * streams them).
 *
 * Under test:
 *   - built with CUDA=1 and a CUDA device present: the CUDA backend (device
 *     `TANDEM_CUDA_DEVICE`, default 0). Without a device (t_cuda_absent) a
 *     counted "skipped: cuda: ..." line is printed and the device part is
 *     skipped; any other start-up failure is a failure with its cause;
 *     the host versions of the CUDA block decoders and KV encoders are
 *     still checked bit for bit against quant.c.
 *   - linked with the MLX object (make MLX=1 mlx, backend_mlx_linked(); not
 *     CUDA): the MLX backend (src/backend/mlx: MLX's CPU backend on Linux,
 *     Metal on a Mac); a build with MLX that cannot start it is a failure
 *     with its cause.
 *   - built without CUDA: the same cases compare the CPU backend's vector kernels against its plain
 *     C reference kernels (which keeps this harness itself tested).
 * Also: selecting an unavailable backend gives a clear error.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "engine/backend.h"
#include "engine/gguf.h"
#include "engine/kvcache.h"
#include "engine/model.h"
#include "engine/quant.h"
#include "t.h"
#ifdef TANDEM_CUDA
#include "backend/cuda/backend_cuda.h"
#endif

/* ==== Sides ==== */

static backend *ref_be, *test_be;   /* reference (CPU) and under test */
static int cpu_vs_ref;              /* no CUDA: CPU vector kernels vs CPU reference kernels */

/* Makes `be` ready to run: in CPU-vs-reference mode the reference side runs
 * the plain C kernels. */
static void side(backend *be) {
    if (cpu_vs_ref) quant_force_reference(be == ref_be);
}

/* ==== Data ==== */

static uint32_t rng = 12345;
static float frand(void) { rng = rng * 1664525u + 1013904223u; return (float)(rng >> 8) / 16777216.0f * 2.0f - 1.0f; }
static void fill(float *x, size_t n, float scale) { for (size_t i = 0; i < n; i++) x[i] = frand() * scale; }

static float *upload(backend *be, const float *host, size_t n) {
    float *d = be->ops->alloc(be, n);
    if (d && host) be->ops->write(be, d, host, n);
    return d;
}

static float *download(backend *be, const float *dev, size_t n) {
    float *h = malloc(sizeof(float) * (n ? n : 1));
    be->ops->read(be, dev, h, n);
    return h;
}

static double nmse(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        if (!isfinite(a[i]) || !isfinite(b[i])) return INFINITY;
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? num / den : num;
}

/* Worst NMSE seen per op family, printed at the end. */
typedef struct { const char *name; double worst; int cases; } op_stat;
static op_stat stats[64];
static int n_stats;

static void record(const char *name, double e, double tol, const char *what) {
    op_stat *s = NULL;
    for (int i = 0; i < n_stats; i++) if (!strcmp(stats[i].name, name)) s = &stats[i];
    if (!s && n_stats < 64) { s = &stats[n_stats++]; s->name = name; }
    if (s) { if (e > s->worst) s->worst = e; s->cases++; }
    CHECK(e <= tol, "%s: %s: nmse %.3g > %.3g", name, what, e, tol);
}

/* ==== Weights ==== */

typedef struct {
    be_weight w;
    void *bytes;
} test_weight;

/* Weight bytes stay allocated until the end: a backend may keep a device
 * copy keyed by the host address (weights are a model's mmap, fixed for
 * its life), and freed memory comes back at the same address. */
static void *retired[4096];
static int n_retired;
static void retire(void *p) {
    if (n_retired < (int)(sizeof retired / sizeof retired[0])) retired[n_retired++] = p;
    else CHECK(0, "more weights than the retired list holds");
}
static void retired_free(void) { while (n_retired > 0) free(retired[--n_retired]); }

static const uint32_t TYPES[] = { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_1,
                                  GGML_TYPE_Q5_0, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K };
#define N_TYPES (sizeof TYPES / sizeof TYPES[0])

static int is_k(uint32_t t) { return t == GGML_TYPE_Q4_K || t == GGML_TYPE_Q5_K || t == GGML_TYPE_Q6_K; }
static int is_q(uint32_t t) { return t != GGML_TYPE_F32 && t != GGML_TYPE_F16 && t != GGML_TYPE_BF16; }
/* An odd row length the type allows: 3 blocks (K-quants: 2 super-blocks), 67 for float types. */
static int64_t odd_cols(uint32_t t) { return is_k(t) ? 512 : is_q(t) ? 96 : 67; }

static int make_weight(test_weight *tw, uint32_t type, int64_t ne0, int64_t ne1, int64_t ne2, float scale) {
    memset(tw, 0, sizeof *tw);
    size_t rows = (size_t)ne1 * (size_t)ne2, rb = gguf_row_bytes(type, (uint64_t)ne0);
    float *f = malloc(sizeof(float) * (size_t)ne0 * rows);
    tw->bytes = malloc(rb * rows);
    if (!f || !tw->bytes) { free(f); return -1; }
    fill(f, (size_t)ne0 * rows, scale);
    int rc = quant_quantize_weight_rows(type, f, tw->bytes, (int64_t)rows, ne0);
    free(f);
    tw->w = (be_weight){ .name = gguf_type_name(type), .type = type, .ne = { ne0, ne1, ne2, 1 }, .row_bytes = rb,
                         .data = tw->bytes };
    return rc;
}

/* A fresh be_weight per backend: `dev` belongs to the backend that set it. */
static be_weight wcopy(const test_weight *tw) { be_weight w = tw->w; w.dev = NULL; return w; }

/* ==== Ops ==== */

static void case_get_rows(uint32_t type) {
    test_weight tw;
    int64_t ne0 = odd_cols(type), ne1 = 37;
    if (make_weight(&tw, type, ne0, ne1, 1, 1.0f)) { CHECK(0, "make weight %s", gguf_type_name(type)); return; }
    int32_t ids[] = { 0, 36, 5, 5, 17, 2, 36 };
    int n = (int)(sizeof ids / sizeof ids[0]);
    float *out[2];
    backend *bes[2] = { ref_be, test_be };
    for (int s = 0; s < 2; s++) {
        side(bes[s]);
        be_weight w = wcopy(&tw);
        float *d = upload(bes[s], NULL, (size_t)n * ne0);
        CHECK(bes[s]->ops->get_rows(bes[s], &w, ids, n, d) == 0, "get_rows %s", gguf_type_name(type));
        int32_t bad = (int32_t)ne1;
        CHECK(bes[s]->ops->get_rows(bes[s], &w, &bad, 1, d) != 0, "get_rows takes an id past the end");
        out[s] = download(bes[s], d, (size_t)n * ne0);
        bes[s]->ops->release(bes[s], d);
    }
    /* F16 rows of a dequantized weight round each value once */
    record("get_rows", nmse(out[1], out[0], (size_t)n * ne0), is_q(type) ? 1e-6 : 0, gguf_type_name(type));
    free(out[0]); free(out[1]); retire(tw.bytes);
}

static void case_mul_mat(uint32_t type, int n_tok, int expert) {
    test_weight tw;
    int64_t ne0 = odd_cols(type), ne1 = 67, ne2 = expert ? 3 : 1;
    if (make_weight(&tw, type, ne0, ne1, ne2, 0.5f)) { CHECK(0, "make weight"); return; }
    float *x = malloc(sizeof(float) * (size_t)n_tok * ne0), *out[2];
    fill(x, (size_t)n_tok * ne0, 1.0f);
    backend *bes[2] = { ref_be, test_be };
    for (int s = 0; s < 2; s++) {
        side(bes[s]);
        be_weight w = wcopy(&tw);
        if (bes[s]->ops->load_weight) {
            char err[256];
            CHECK(bes[s]->ops->load_weight(bes[s], &w, err, sizeof err) == 0, "load_weight: %s", err);
        }
        float *dx = upload(bes[s], x, (size_t)n_tok * ne0), *dy = upload(bes[s], NULL, (size_t)n_tok * ne1);
        bes[s]->ops->mul_mat(bes[s], &w, expert, dx, n_tok, dy);
        out[s] = download(bes[s], dy, (size_t)n_tok * ne1);
        bes[s]->ops->release(bes[s], dx);
        bes[s]->ops->release(bes[s], dy);
    }
    char what[64];
    snprintf(what, sizeof what, "%s, %d rows, expert %d", gguf_type_name(type), n_tok, expert);
    /* the CPU backend quantizes activations to 8 bits for quantized weights */
    record("mul_mat", nmse(out[1], out[0], (size_t)n_tok * ne1), is_q(type) ? 5e-4 : 1e-6, what);
    free(out[0]); free(out[1]); free(x); retire(tw.bytes);
}

/* Element-wise and row-wise ops on one input set. */
static void case_rows(int n_rows, int dim) {
    size_t n = (size_t)n_rows * dim;
    float *x = malloc(sizeof(float) * n), *y = malloc(sizeof(float) * n), *out[2][5];
    fill(x, n, 3.0f);
    fill(y, n, 2.0f);
    test_weight nw, bw;
    make_weight(&nw, GGML_TYPE_F32, dim, 1, 1, 1.0f);
    make_weight(&bw, GGML_TYPE_F32, dim, 1, 1, 1.0f);
    backend *bes[2] = { ref_be, test_be };
    for (int s = 0; s < 2; s++) {
        backend *be = bes[s];
        side(be);
        be_weight wn = wcopy(&nw), wb = wcopy(&bw);
        float *dx = upload(be, x, n), *dy = upload(be, y, n), *d0 = upload(be, NULL, n);
        be->ops->rms_norm(be, dx, &wn, d0, n_rows, dim, 1e-6f);
        out[s][0] = download(be, d0, n);
        be->ops->rms_norm(be, dx, NULL, d0, n_rows, dim, 1e-5f);
        out[s][1] = download(be, d0, n);
        be->ops->write(be, d0, x, n);
        be->ops->rms_norm(be, d0, &wn, d0, n_rows, dim, 1e-6f);   /* in place, as q/k norm */
        be->ops->add_bias(be, d0, &wb, n_rows);
        out[s][2] = download(be, d0, n);
        be->ops->swiglu(be, dx, dy, d0, n);
        out[s][3] = download(be, d0, n);
        be->ops->add(be, dx, dy, n);
        out[s][4] = download(be, dx, n);
        be->ops->release(be, dx); be->ops->release(be, dy); be->ops->release(be, d0);
    }
    char what[64];
    snprintf(what, sizeof what, "%d x %d", n_rows, dim);
    record("rms_norm", nmse(out[1][0], out[0][0], n), 1e-12, what);
    record("rms_norm", nmse(out[1][1], out[0][1], n), 1e-12, what);
    record("add_bias", nmse(out[1][2], out[0][2], n), 1e-12, what);
    record("swiglu", nmse(out[1][3], out[0][3], n), 1e-12, what);
    record("add", nmse(out[1][4], out[0][4], n), 0, what);
    for (int s = 0; s < 2; s++) for (int i = 0; i < 5; i++) free(out[s][i]);
    free(x); free(y); retire(nw.bytes); retire(bw.bytes);
}

/* The CPU backend keeps the last cos/sin table while positions and
 * configuration repeat (q and k of every layer): whatever changed between
 * two calls, the second must equal a fresh backend's result bit for bit. */
static void check_rope_reuse(void) {
    enum { NT = 5, NH = 2, HD = 64 };
    int32_t pa[NT] = { 0, 1, 2, 3, 4 }, pb[NT] = { 0, 1, 2, 3, 5 };
    float ff[HD / 2], x[NT * NH * HD];
    for (int i = 0; i < HD / 2; i++) ff[i] = 1.0f + (float)i;
    struct { const int32_t *pos; int mode; float base, scale; int ffv; } step[] = {
        { pa, ROPE_NEOX, 1e4f, 1.0f, 0 }, { pa, ROPE_NEOX, 1e4f, 1.0f, 0 },   /* a hit */
        { pb, ROPE_NEOX, 1e4f, 1.0f, 0 },                                     /* one position changed */
        { pb, ROPE_NORM, 1e4f, 1.0f, 0 }, { pb, ROPE_NORM, 1e6f, 1.0f, 0 }, { pb, ROPE_NORM, 1e6f, 0.5f, 0 },
        { pb, ROPE_NORM, 1e6f, 0.5f, 1 }, { pb, ROPE_NORM, 1e6f, 0.5f, 2 },   /* factors: new values, same address */
    };
    backend *kept = backend_cpu_create(1);
    CHECK(kept != NULL, "CPU backend");
    if (!kept) return;
    int same = 0, n = (int)(sizeof step / sizeof step[0]);
    for (int i = 0; i < n; i++) {
        for (int k = 0; k < HD / 2; k++) ff[k] = step[i].ffv == 2 ? 2.0f + (float)k : 1.0f + (float)k;
        rope_cfg rc = { step[i].mode, HD, step[i].base, step[i].scale, step[i].ffv ? ff : NULL };
        float got[NT * NH * HD], want[NT * NH * HD];
        fill(x, NT * NH * HD, 1.0f);
        backend *fresh = backend_cpu_create(1);
        if (!fresh) { CHECK(0, "CPU backend"); break; }
        float *d = upload(kept, x, NT * NH * HD), *e = upload(fresh, x, NT * NH * HD);
        kept->ops->rope(kept, d, NT, NH, HD, step[i].pos, &rc);
        fresh->ops->rope(fresh, e, NT, NH, HD, step[i].pos, &rc);
        kept->ops->read(kept, d, got, NT * NH * HD);
        fresh->ops->read(fresh, e, want, NT * NH * HD);
        same += !memcmp(got, want, sizeof got);
        kept->ops->release(kept, d);
        fresh->ops->release(fresh, e);
        fresh->ops->destroy(fresh);
    }
    CHECK(same == n, "rope after another rope call equals a fresh backend's: %d of %d", same, n);
    kept->ops->destroy(kept);
}

static void case_rope(int mode, int n_rot, int head_dim, int factors, float freq_scale) {
    int n_tok = 7, n_head = 3;
    size_t n = (size_t)n_tok * n_head * head_dim;
    int32_t pos[7] = { 0, 1, 2, 100, 4095, 30000, 7 };
    float ff[256], *x = malloc(sizeof(float) * n), *out[2];
    for (int i = 0; i < n_rot / 2; i++) ff[i] = 1.0f + (float)i * 0.25f;
    fill(x, n, 1.0f);
    rope_cfg rc = { mode, n_rot, 10000.0f, freq_scale, factors ? ff : NULL };
    backend *bes[2] = { ref_be, test_be };
    for (int s = 0; s < 2; s++) {
        side(bes[s]);
        float *d = upload(bes[s], x, n);
        bes[s]->ops->rope(bes[s], d, n_tok, n_head, head_dim, pos, &rc);
        out[s] = download(bes[s], d, n);
        bes[s]->ops->release(bes[s], d);
    }
    char what[96];
    snprintf(what, sizeof what, "%s, n_rot %d of %d%s", mode == ROPE_NEOX ? "NEOX" : "NORM", n_rot, head_dim,
             factors ? ", freq factors" : "");
    record("rope", nmse(out[1], out[0], n), 1e-10, what);
    free(out[0]); free(out[1]); free(x);
}

/* ==== KV store and attention ==== */

#define KV_LAYERS 2
#define KV_CTX 256

typedef struct { int pos0, n; } seq_shape;

/* 1 if layer l's positions [0, n) of a and b hold the same K and V bytes. */
static int kv_same_rows(const kvcache *a, const kvcache *b, int l, int n) {
    size_t bytes = kv_row_bytes(a) * (size_t)n;
    uint8_t *x = malloc(2 * bytes + 1), *y = malloc(2 * bytes + 1);
    char err[128];
    int same = x && y && !kv_read_span(a, l, 0, n, x, x + bytes, err, sizeof err) &&
               !kv_read_span(b, l, 0, n, y, y + bytes, err, sizeof err) && !memcmp(x, y, 2 * bytes);
    free(x); free(y);
    return same;
}

/* Runs on one backend: the prefix rows of every sequence are stored in a
 * first pass (or, with host_prefix, written straight into the host cache as
 * a decode node receives them), then one batched pass stores the new rows
 * and attends. Returns the attention output; caches stay for comparison. */
static float *kv_run(backend *be, kvcache **kv, const seq_shape *sh, int n_seq, int n_head, int n_head_kv, int hd,
                     const float *q, const float *k, const float *v, const float *kp, const float *vp, int host_prefix) {
    int kvd = n_head_kv * hd, n_tok = 0, n_pre = 0;
    be_seq seq[8], pseq[8];
    int32_t pos[256], ppos[256];
    for (int s = 0; s < n_seq; s++) {
        seq[s] = (be_seq){ kv[s], n_tok, sh[s].n, sh[s].pos0 };
        pseq[s] = (be_seq){ kv[s], n_pre, sh[s].pos0, 0 };
        for (int i = 0; i < sh[s].n; i++) pos[n_tok + i] = sh[s].pos0 + i;
        for (int i = 0; i < sh[s].pos0; i++) ppos[n_pre + i] = i;
        n_tok += sh[s].n;
        n_pre += sh[s].pos0;
    }
    for (int l = 0; l < KV_LAYERS; l++) {
        if (host_prefix) {
            char err[128];
            for (int s = 0; s < n_seq; s++) {
                int off = pseq[s].t0;
                uint8_t *kb = malloc(kv_row_bytes(kv[s]) * (size_t)(sh[s].pos0 + 1));
                uint8_t *vb = malloc(kv_row_bytes(kv[s]) * (size_t)(sh[s].pos0 + 1));
                for (int i = 0; i < sh[s].pos0; i++) {
                    quant_quantize_act_row(kv_dtype(kv[s]), kp + (size_t)(off + i) * kvd, kb + i * kv_row_bytes(kv[s]), kvd);
                    quant_quantize_act_row(kv_dtype(kv[s]), vp + (size_t)(off + i) * kvd, vb + i * kv_row_bytes(kv[s]), kvd);
                }
                CHECK(kv_write_span(kv[s], l, 0, sh[s].pos0, kb, vb, err, sizeof err) == 0, "%s", err);
                free(kb); free(vb);
            }
        } else if (n_pre) {
            int ns = 0;
            be_seq ps[8];
            for (int s = 0; s < n_seq; s++) if (pseq[s].n) ps[ns++] = pseq[s];
            be_batch pb = { n_pre, ppos, ns, ps };
            float *dk = upload(be, kp, (size_t)n_pre * kvd), *dv = upload(be, vp, (size_t)n_pre * kvd);
            be->ops->kv_store(be, &pb, l, dk, dv);
            if (be->ops->sync_kv) be->ops->sync_kv(be, &pb, l);
            be->ops->release(be, dk); be->ops->release(be, dv);
        }
    }
    if (host_prefix && be->ops->kv_forget)
        for (int s = 0; s < n_seq; s++) be->ops->kv_forget(be, kv[s], 0);
    be_batch b = { n_tok, pos, n_seq, seq };
    size_t qn = (size_t)n_tok * n_head * hd;
    float *dq = upload(be, q, qn), *dk = upload(be, k, (size_t)n_tok * kvd), *dv = upload(be, v, (size_t)n_tok * kvd);
    float *dout = upload(be, NULL, qn), *res = calloc(qn * KV_LAYERS, sizeof(float));
    for (int l = 0; l < KV_LAYERS; l++) {
        be->ops->kv_store(be, &b, l, dk, dv);
        CHECK(be->ops->attention(be, dq, &b, l, n_head, n_head_kv, hd, 1.0f / sqrtf((float)hd), dout) == 0, "attention");
        if (be->ops->sync_kv) be->ops->sync_kv(be, &b, l);
        be->ops->read(be, dout, res + qn * l, qn);
    }
    be->ops->release(be, dq); be->ops->release(be, dk); be->ops->release(be, dv); be->ops->release(be, dout);
    return res;
}

static const char *att_label = "attention";   /* the stats line of the attention cases */

static void case_attention(uint32_t dt, int n_head, int n_head_kv, int hd, const seq_shape *sh, int n_seq,
                           int host_prefix) {
    int kvd = n_head_kv * hd, n_tok = 0, n_pre = 0;
    for (int s = 0; s < n_seq; s++) { n_tok += sh[s].n; n_pre += sh[s].pos0; }
    size_t qn = (size_t)n_tok * n_head * hd;
    float *q = malloc(sizeof(float) * qn), *k = malloc(sizeof(float) * (size_t)n_tok * kvd);
    float *v = malloc(sizeof(float) * (size_t)n_tok * kvd), *kp = malloc(sizeof(float) * ((size_t)n_pre * kvd + 1));
    float *vp = malloc(sizeof(float) * ((size_t)n_pre * kvd + 1)), *out[2];
    fill(q, qn, 1.0f); fill(k, (size_t)n_tok * kvd, 1.0f); fill(v, (size_t)n_tok * kvd, 1.0f);
    fill(kp, (size_t)n_pre * kvd, 1.0f); fill(vp, (size_t)n_pre * kvd, 1.0f);
    kvcache *kv[2][8];
    char err[256];
    backend *bes[2] = { ref_be, test_be };
    for (int s = 0; s < 2; s++) {
        side(bes[s]);
        for (int i = 0; i < n_seq; i++)
            CHECK(kv_create(&kv[s][i], KV_LAYERS, KV_CTX, n_head_kv, hd, dt, err, sizeof err) == 0, "%s", err);
        out[s] = kv_run(bes[s], kv[s], sh, n_seq, n_head, n_head_kv, hd, q, k, v, kp, vp, host_prefix && s == 1);
    }
    char what[128];
    snprintf(what, sizeof what, "%s cache, %d/%d heads of %d, %d sequences%s", gguf_type_name(dt), n_head, n_head_kv,
             hd, n_seq, host_prefix ? ", prefix from the host" : "");
    /* a Q8_0 cache: the CPU backend meets it with q quantized to Q8_0 */
    record(att_label, nmse(out[1], out[0], qn * KV_LAYERS), dt == GGML_TYPE_Q8_0 ? 5e-4 : 1e-6, what);
    int same = 1;
    for (int s = 0; s < 2; s++)   /* a backend that keeps new rows on its side writes them to the host (MLX) */
        for (int i = 0; i < n_seq; i++)
            if (bes[s]->ops->kv_to_host) bes[s]->ops->kv_to_host(bes[s], kv[s][i], -1, sh[i].pos0 + sh[i].n);
    for (int i = 0; i < n_seq; i++)
        for (int l = 0; l < KV_LAYERS; l++) same &= kv_same_rows(kv[0][i], kv[1][i], l, sh[i].pos0 + sh[i].n);
    CHECK(same, "kv_store: %s: host cache bytes differ from the CPU backend's", what);
    for (int s = 0; s < 2; s++)
        for (int i = 0; i < n_seq; i++) {
            if (bes[s]->ops->kv_forget) bes[s]->ops->kv_forget(bes[s], kv[s][i], -1);
            kv_free(kv[s][i]);
        }
    free(out[0]); free(out[1]); free(q); free(k); free(v); free(kp); free(vp);
}

/* ==== MoE ==== */

/* The CPU backend's MoE block (its vector kernels) gives every token the
 * same bits whether it runs alone, in a batch, or in a batch whose experts
 * are split into groups of one expert each: batching never changes a token. */
static void moe_cpu_same_run(backend *be, const be_weight *wgi, const be_weight *wg, const be_weight *wu,
                             const be_weight *wd, int ne, int k, const float *x, int n_tok, int dim, int packed) {
    be_moe m = { wgi, wg, wu, wd, ne, k, 1 };
    size_t n = (size_t)n_tok * dim;
    float *dx = upload(be, x, n), *dy = upload(be, NULL, n);
    int ok = 1;
    for (int t = 0; t < n_tok; t++)
        ok &= be->ops->moe_ffn(be, &m, dx + (size_t)t * dim, 1, dy + (size_t)t * dim) == 0;
    float *one = download(be, dy, n);
    ok &= be->ops->moe_ffn(be, &m, dx, n_tok, dy) == 0;
    float *all = download(be, dy, n);
    backend_cpu_set_moe_scratch(be, 1);
    ok &= be->ops->moe_ffn(be, &m, dx, n_tok, dy) == 0;
    backend_cpu_set_moe_scratch(be, 0);   /* the default again */
    float *split = download(be, dy, n);
    CHECK(ok, "moe_ffn on the CPU");
    CHECK(!memcmp(one, all, sizeof(float) * n), "%s experts%s, %d rows: a batch differs from one token at a time",
          gguf_type_name(wg->type), packed ? " (packed)" : "", n_tok);
    CHECK(!memcmp(split, all, sizeof(float) * n), "%s experts%s, %d rows: experts in groups differ from one group",
          gguf_type_name(wg->type), packed ? " (packed)" : "", n_tok);
    be->ops->release(be, dx); be->ops->release(be, dy);
    free(one); free(all); free(split);
}

static void moe_cpu_same(const test_weight *gi, const test_weight *g, const test_weight *u, const test_weight *d,
                         int ne, int k, const float *x, int n_tok, int dim) {
    backend *be = cpu_vs_ref ? test_be : ref_be;   /* the CPU with its vector kernels */
    side(be);
    for (int packed = 0; packed < 2; packed++) {
        be_weight wgi = wcopy(gi), wg = wcopy(g), wu = wcopy(u), wd = wcopy(d);
        char err[256];
        if (packed)   /* the rows interleaved as at load, where the kernel set multiplies this type so */
            CHECK(!be->ops->load_weight(be, &wg, err, sizeof err) && !be->ops->load_weight(be, &wu, err, sizeof err) &&
                  !be->ops->load_weight(be, &wd, err, sizeof err), "load_weight: %s", err);
        moe_cpu_same_run(be, &wgi, &wg, &wu, &wd, ne, k, x, n_tok, dim, packed);
    }
}

static const char *moe_label = "moe_ffn";       /* the stats line of the MoE cases */

/* ne experts, k of them per token (3 of 8: a sum order shows; 8 of 128
 * over 300 tokens: Qwen3-30B-A3B's routing, 2400 selections, so the CUDA
 * grouping scans several block-widths and most experts get a product of
 * their own). */
static void case_moe(uint32_t type, int n_tok, int ne, int k) {
    int dim = is_k(type) ? 256 : 96, nff = is_k(type) ? 256 : 64;
    test_weight gi, g, u, d;
    make_weight(&gi, GGML_TYPE_F32, dim, ne, 1, 1.0f);
    make_weight(&g, type, dim, nff, ne, 0.5f);
    make_weight(&u, type, dim, nff, ne, 0.5f);
    make_weight(&d, type, nff, dim, ne, 0.5f);
    float *x = malloc(sizeof(float) * (size_t)n_tok * dim), *out[2];
    fill(x, (size_t)n_tok * dim, 1.0f);
    backend *bes[2] = { ref_be, test_be };
    for (int s = 0; s < 2; s++) {
        side(bes[s]);
        be_weight wgi = wcopy(&gi), wg = wcopy(&g), wu = wcopy(&u), wd = wcopy(&d);
        be_moe m = { &wgi, &wg, &wu, &wd, ne, k, 1 };
        float *dx = upload(bes[s], x, (size_t)n_tok * dim), *dy = upload(bes[s], NULL, (size_t)n_tok * dim);
        CHECK(bes[s]->ops->moe_ffn(bes[s], &m, dx, n_tok, dy) == 0, "moe_ffn");
        out[s] = download(bes[s], dy, (size_t)n_tok * dim);
        bes[s]->ops->release(bes[s], dx); bes[s]->ops->release(bes[s], dy);
    }
    char what[64];
    snprintf(what, sizeof what, "%s experts, %d rows", gguf_type_name(type), n_tok);
    record(moe_label, nmse(out[1], out[0], (size_t)n_tok * dim), is_q(type) ? 5e-4 : 1e-6, what);
    moe_cpu_same(&gi, &g, &u, &d, ne, k, x, n_tok, dim);
    free(out[0]); free(out[1]); free(x);
    retire(gi.bytes); retire(g.bytes); retire(u.bytes); retire(d.bytes);
}

/* kv_store's encoding of every kind of f32 (NaN with payloads, infinities,
 * f16 overflow, f32 and f16 subnormals, ties at both types' rounding bits,
 * random bit patterns) into an F16 or BF16 cache: the host bytes, after
 * kv_to_host where the backend has one, equal the CPU backend's. */
static void case_kv_encode(uint32_t dt) {
    static const uint32_t special[] = { 0x7fc00000, 0xffc00001, 0x7f800001, 0xff812345, 0x7fbfffff, 0x7f800000,
                                        0xff800000, 0x477ff000, 0x477fefff, 0xc77ff000, 0x38800000, 0x387fffff,
                                        0x33000000, 0x33000001, 0x33800000, 0x00000001, 0x80000000, 0x00000000,
                                        0x3f801000, 0x3f803000, 0x3f808000, 0x3f818000, 0x7f7fffff, 0xff7fffff,
                                        0x35801000, 0x35803000, 0x00008000, 0x00018000, 0x007fffff, 0x3c7fe000 };
    const int n_head_kv = 2, hd = 64, kvd = n_head_kv * hd, n = 48;
    float *k = malloc(sizeof(float) * (size_t)n * kvd), *v = malloc(sizeof(float) * (size_t)n * kvd);
    uint32_t x = 0x9e3779b9u;
    for (size_t i = 0; i < (size_t)n * kvd; i++) {
        uint32_t bits;
        t_rnd32(&x);
        bits = i < sizeof special / sizeof special[0] ? special[i] : (i % 3 ? x : (x & 0x8000ffffu) | 0x3f800000u);
        memcpy(&k[i], &bits, sizeof bits);
        bits = special[i % (sizeof special / sizeof special[0])] ^ (i & 1 ? 0x80000000u : 0);
        memcpy(&v[i], &bits, sizeof bits);
    }
    kvcache *kv[2];
    char err[256];
    backend *bes[2] = { ref_be, test_be };
    int32_t pos[48];
    for (int i = 0; i < n; i++) pos[i] = 5 + i;
    for (int s = 0; s < 2; s++) {
        side(bes[s]);
        CHECK(kv_create(&kv[s], KV_LAYERS, KV_CTX, n_head_kv, hd, dt, err, sizeof err) == 0, "%s", err);
        be_seq sq = { kv[s], 0, n, 5 };
        be_batch b = { n, pos, 1, &sq };
        float *dk = upload(bes[s], k, (size_t)n * kvd), *dv = upload(bes[s], v, (size_t)n * kvd);
        for (int l = 0; l < KV_LAYERS; l++) {
            bes[s]->ops->kv_store(bes[s], &b, l, dk, dv);
            if (bes[s]->ops->sync_kv) bes[s]->ops->sync_kv(bes[s], &b, l);
        }
        if (bes[s]->ops->kv_to_host) bes[s]->ops->kv_to_host(bes[s], kv[s], -1, 5 + n);
        bes[s]->ops->release(bes[s], dk); bes[s]->ops->release(bes[s], dv);
    }
    int same = 1;
    for (int l = 0; l < KV_LAYERS; l++) {
        size_t bytes = kv_row_bytes(kv[0]) * (size_t)n;
        uint8_t *a = malloc(2 * bytes), *c = malloc(2 * bytes);
        same &= a && c && !kv_read_span(kv[0], l, 5, n, a, a + bytes, err, sizeof err) &&
                !kv_read_span(kv[1], l, 5, n, c, c + bytes, err, sizeof err) && !memcmp(a, c, 2 * bytes);
        free(a); free(c);
    }
    CHECK(same, "kv_store: %s cache: special values: host cache bytes differ from the CPU backend's", gguf_type_name(dt));
    for (int s = 0; s < 2; s++) {
        if (bes[s]->ops->kv_forget) bes[s]->ops->kv_forget(bes[s], kv[s], -1);
        kv_free(kv[s]);
    }
    free(k); free(v);
}

/* Every attention case: batches of prompt spans and decode tokens, GQA
 * groups of 1 to 16, head sizes 32 to 256, and long spans (64-row blocks
 * and more: the CUDA tensor-core path, its default for long spans). */
static void attention_cases(void) {
    const uint32_t dts[] = { GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0 };
    const seq_shape one[] = { { 0, 37 } };
    const seq_shape mix[] = { { 0, 5 }, { 40, 1 }, { 11, 23 }, { 70, 1 } };
    const seq_shape dec[] = { { 50, 1 }, { 3, 1 }, { 90, 1 } };
    const seq_shape lng[] = { { 0, 150 }, { 37, 70 }, { 5, 1 } };
    for (size_t i = 0; i < 3; i++) {
        case_attention(dts[i], 4, 4, 64, one, 1, 0);
        case_attention(dts[i], 8, 2, 64, mix, 4, 0);
        case_attention(dts[i], 6, 1, 128, dec, 3, 0);
        case_attention(dts[i], 32, 2, 32, mix, 4, 0);    /* 16 query heads per KV head */
        case_attention(dts[i], 4, 2, 256, mix, 4, 1);
        case_attention(dts[i], 16, 8, 128, lng, 3, 0);   /* the Qwen3-0.6B heads */
        case_attention(dts[i], 14, 2, 64, lng, 3, 1);    /* the Qwen2.5-0.5B heads */
    }
    case_attention(GGML_TYPE_F16, 3, 3, 40, mix, 4, 0);  /* a head size that is no multiple of 32 */
    case_kv_encode(GGML_TYPE_F16);
    case_kv_encode(GGML_TYPE_BF16);
}

/* Every weight type at decode and prompt sizes, and Qwen3-30B-A3B's
 * routing (the CUDA backend picks a packed or padded layout by the counts:
 * its default run meets both, and the padded-only and packed-only runs
 * below check each on every case). */
static void moe_cases(void) {
    const uint32_t mt[] = { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_K, GGML_TYPE_Q6_K };
    for (size_t i = 0; i < sizeof mt / sizeof mt[0]; i++) {
        case_moe(mt[i], 1, 8, 3);
        case_moe(mt[i], 5, 8, 3);
        case_moe(mt[i], 40, 8, 3);
    }
    case_moe(GGML_TYPE_F16, 300, 128, 8);
    case_moe(GGML_TYPE_Q4_K, 300, 128, 8);
    case_moe(GGML_TYPE_F16, 2048, 128, 8);
}

/* ==== Everything ==== */

static void run_cases(void) {
    for (size_t i = 0; i < N_TYPES; i++) {
        case_get_rows(TYPES[i]);
        int toks[] = { 1, 3, 8, 9, 67 };
        for (size_t j = 0; j < sizeof toks / sizeof toks[0]; j++) case_mul_mat(TYPES[i], toks[j], 0);
        case_mul_mat(TYPES[i], 2, 2);
        case_mul_mat(TYPES[i], 33, 1);
    }
    int rows[][2] = { { 1, 1 }, { 5, 67 }, { 33, 4099 }, { 2, 128 } };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) case_rows(rows[i][0], rows[i][1]);
    case_rope(ROPE_NORM, 64, 64, 0, 1.0f);
    case_rope(ROPE_NEOX, 64, 64, 0, 1.0f);
    case_rope(ROPE_NEOX, 32, 80, 0, 0.25f);
    case_rope(ROPE_NORM, 128, 128, 1, 1.0f);
    case_rope(ROPE_NEOX, 128, 128, 1, 0.5f);
    attention_cases();
    moe_cases();
}

static void print_stats(void) {
    for (int i = 0; i < n_stats; i++)
        printf("  %-10s %3d cases, worst nmse %.3g\n", stats[i].name, stats[i].cases, stats[i].worst);
}

/* ==== Backend selection ==== */

static void check_selection(void) {
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/qwen3-mini-F16.gguf", t_models());
    if (!t_need(path)) return;
    FILE *f = fopen(path, "rb");
    CHECK(f != NULL, "selection checks need %s (make models)", path);
    if (!f) return;
    fclose(f);
    model *m = NULL;
    model_opts o = { .n_threads = 1, .backend = "tpu" };
    CHECK(model_load(&m, path, &o, err, sizeof err) != 0 && strstr(err, "unknown backend"), "bad backend: %s", err);
    o.backend = "cuda";
    int rc = model_load(&m, path, &o, err, sizeof err);
#ifdef TANDEM_CUDA
    if (rc) CHECK(strstr(err, "CUDA backend: ") != NULL, "cuda backend error names CUDA: %s", err);
    else model_free(m);
    o.device = 99;
    m = NULL;
    CHECK(model_load(&m, path, &o, err, sizeof err) != 0 && strstr(err, "CUDA backend: "), "device 99: %s", err);
#else
    CHECK(rc != 0 && strstr(err, "rebuild with make CUDA=1"), "no CUDA in this build: %s", err);
#endif
    m = NULL;
    o.backend = "mlx";
    o.device = 0;
    rc = model_load(&m, path, &o, err, sizeof err);
    if (backend_mlx_linked()) {
        CHECK(rc == 0, "mlx backend loads %s: %s", path, err);
        if (!rc) model_free(m);
    } else {
        CHECK(rc != 0 && strstr(err, "make MLX=1 mlx"), "no MLX in this build: %s", err);
    }
}

#ifdef TANDEM_CUDA
/* The CUDA block decoders and KV encoders, run on the host, against quant.c. */
static void check_cuda_host_code(void) {
    for (size_t i = 0; i < N_TYPES; i++) {
        test_weight tw;
        int64_t n = odd_cols(TYPES[i]) * 2;
        make_weight(&tw, TYPES[i], n, 3, 1, 2.0f);
        float *a = malloc(sizeof(float) * (size_t)n), *b = malloc(sizeof(float) * (size_t)n);
        int same = 1;
        for (int r = 0; r < 3; r++) {
            const uint8_t *row = (const uint8_t *)tw.bytes + (size_t)r * tw.w.row_bytes;
            quant_dequantize_row(TYPES[i], row, a, n);
            backend_cuda_host_dequantize_row(TYPES[i], row, b, n);
            /* K-quants: d * sc * q - dmin * m may contract differently; 1 ulp-ish */
            for (int64_t j = 0; j < n; j++) same &= fabsf(a[j] - b[j]) <= 1e-6f * (1.0f + fabsf(a[j]));
        }
        CHECK(same, "CUDA block decoder for %s differs from quant.c", gguf_type_name(TYPES[i]));
        free(a); free(b); retire(tw.bytes);
    }
    const uint32_t dts[] = { GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0 };
    float x[256];
    fill(x, 256, 40.0f);
    x[3] = 70000.0f; x[9] = -1e-7f; x[100] = 0.0f;   /* overflow to inf, a subnormal, zero */
    for (int i = 0; i < 3; i++) {
        uint8_t a[600], b[600];
        quant_ref_quantize_act_row(dts[i], x, a, 256);
        backend_cuda_host_kv_row(dts[i], x, b, 256);
        CHECK(!memcmp(a, b, gguf_row_bytes(dts[i], 256)), "CUDA KV encoder for %s differs", gguf_type_name(dts[i]));
    }
    float ff[64], cs[64], sn[64];
    for (int i = 0; i < 64; i++) ff[i] = 1.0f + i;
    rope_cfg rc = { ROPE_NEOX, 128, 1000000.0f, 0.5f, ff };
    int worst_ok = 1;
    for (int p = 0; p < 40000; p += 997) {
        backend_cuda_host_rope_angles(p, &rc, cs, sn);
        float theta_scale = powf(rc.freq_base, -2.0f / (float)rc.n_rot), theta = (float)p;
        for (int i = 0; i < 64; i++) {
            float th = theta / ff[i] * rc.freq_scale;
            worst_ok &= fabsf(cosf(th) - cs[i]) <= 1e-6f && fabsf(sinf(th) - sn[i]) <= 1e-6f;
            theta *= theta_scale;
        }
    }
    CHECK(worst_ok, "CUDA rope angles differ from the CPU backend's");
}
#endif

#ifdef TANDEM_CUDA
/* cases() again on a CUDA backend made with var=value, their stats line
 * named name (*label). */
static void rerun_with(const char *var, const char *value, void (*cases)(void), const char **label,
                       const char *name) {
    char err[512];
    const char *dv = getenv("TANDEM_CUDA_DEVICE");
    setenv(var, value, 1);
    backend *be = backend_cuda_create(dv ? atoi(dv) : 0, 2, err, sizeof err);
    unsetenv(var);
    CHECK(be != NULL, "CUDA backend with %s=%s: %s", var, value, err);
    if (!be) return;
    backend *plain = test_be;
    const char *plain_label = *label;
    test_be = be;
    *label = name;
    cases();
    test_be = plain;
    *label = plain_label;
    be->ops->destroy(be);
}
#endif

int main(void) {
    check_selection();
    ref_be = backend_cpu_create(2);
    CHECK(ref_be != NULL, "CPU backend");
    if (!ref_be) return t_done("backend_ops");
#ifdef TANDEM_CUDA
    check_cuda_host_code();
    char err[512];
    const char *dv = getenv("TANDEM_CUDA_DEVICE");
    test_be = backend_cuda_create(dv ? atoi(dv) : 0, 2, err, sizeof err);
    if (!test_be) {
        /* no device: a counted skip; any other cause: a failure that names it */
        if (!t_cuda_absent(err)) CHECK(0, "the CUDA backend cannot start: %s", err);
        ref_be->ops->destroy(ref_be);
        return t_done("backend_ops");
    }
#else
    if (backend_mlx_linked()) {
        /* the same binary linked with the MLX object (make MLX=1 mlx) */
        char err[512];
        test_be = backend_mlx_create(2, err, sizeof err);
        CHECK(test_be != NULL, "the MLX backend cannot start: %s", err);
        if (!test_be) { ref_be->ops->destroy(ref_be); return t_done("backend_ops"); }
        printf("(comparing the MLX backend with the CPU backend)\n");
    } else {
        /* not a skip: the same cases run, on the CPU's two kernel sets */
        printf("(built without CUDA or MLX: comparing the CPU backend's vector kernels with its reference kernels)\n");
        cpu_vs_ref = 1;
        test_be = backend_cpu_create(2);
        CHECK(test_be != NULL, "second CPU backend");
        if (!test_be) return t_done("backend_ops");
    }
#endif
    run_cases();
#ifdef TANDEM_CUDA
    /* the attention cases again with long spans on CUDA cores too (the
     * default puts them on tensor cores); the tensor-core attention with
     * q and the probabilities both split into hi + lo halves, then neither
     * (the default splits q only); the MoE cases with every group padded,
     * then with none */
    rerun_with("TANDEM_CUDA_ATTN", "cores", attention_cases, &att_label, "attention_cores");
    rerun_with("TANDEM_CUDA_ATTN_SPLIT", "3", attention_cases, &att_label, "attention_split_qp");
    rerun_with("TANDEM_CUDA_ATTN_SPLIT", "0", attention_cases, &att_label, "attention_split_none");
    rerun_with("TANDEM_CUDA_MOE_PAD", "2", moe_cases, &moe_label, "moe_ffn_padded");
    rerun_with("TANDEM_CUDA_MOE_PAD", "0", moe_cases, &moe_label, "moe_ffn_packed");
#endif
    quant_force_reference(0);
    check_rope_reuse();
    print_stats();
    test_be->ops->destroy(test_be);
    ref_be->ops->destroy(ref_be);
    retired_free();
    return t_done("backend_ops");
}
