/* backend_mlx.cpp - the MLX backend (make MLX=1): engine/backend.h on Apple's
 * MLX through its C++ API (libmlx). On Linux it runs on MLX's CPU backend
 * (what is checked here); on a Mac the same code runs on Metal (MLX's
 * default device there). See src/backend/mlx/README.md and docs/mlx.md.
 *
 * Activation buffers are host memory (calloc), as on the CPU backend, so
 * that offsets into them (a sequence's rows, a token's row) mean what they
 * mean everywhere; results stay lazy MLX arrays between ops and reach the
 * host bytes when something reads them there ("Host <-> arrays" below):
 * a decode step evaluates about once per layer (the KV rows), not per op.
 *
 * Weights are converted once, at load, into MLX's own layout: affine
 * groups of 32 (w = scale * q + bias, q packed little-endian in uint32
 * words, scales and biases f32) where that represents every value of the
 * GGUF tensor exactly (checked value by value against quant.c's decoder),
 * else f32. Per type: F32 as it is; F16, BF16 widened to f32 (exact; the
 * products then meet unrounded activations, as on the CPU); Q8_0 (8 bits),
 * Q4_0, Q4_1 (4 bits), Q5_0, Q5_1 (5 bits), Q4_K (4 bits), Q5_K (5 bits)
 * exact in affine groups; Q6_K (sub-blocks of 16, each its own scale:
 * MLX's groups are 32 or more) dequantized to f32, exact, at 4 bytes a
 * value (docs/mlx.md: what a Mac would rather do).
 *
 * KV caches. The host caches (kvcache.c) stay the record the handoff and
 * prefix sharing read, written by kv_store with the CPU's own encoder
 * (kv_store_f32), so their bytes equal the CPU backend's. Each cache gets
 * MLX arrays per layer in the same head-major layout and dtype ([kv_head]
 * [position][head_dim], F16 or BF16; a Q8_0 cache's rows decoded to f32,
 * exactly), filled from the host rows before attention reads them: rows a
 * prefill node sent land in the host cache unchanged and reach the arrays
 * the same way.
 */
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <vector>

#include <mlx/mlx.h>   /* MLX_DIR/include: MLX's C++ API */

extern "C" {
#include "base/log.h"
#include "engine/backend.h"
#include "engine/gguf.h"
#include "engine/kvcache.h"
#include "engine/quant.h"
}

namespace mx = mlx::core;

/* MLX's graph and streams are process-wide: one op at a time (a prefill
 * node evaluates on its connections' threads). */
static std::mutex g_mlx_mu;

/* MLX's affine group size used for every quantized weight: Q8_0/Q4_0/Q4_1/
 * Q5_0/Q5_1 blocks are 32 values with one scale, K-quant sub-blocks too. */
#define MLX_GROUP 32
/* First capacity of a cache's arrays in positions; doubled as it fills
 * (up to the cache's context), so short sequences hold little. */
#define MLX_KV_FIRST 256

/* ==== State ==== */

typedef struct mlx_weight {
    const void *host;          /* the be_weight's data (identity, as CUDA's cu_weight_find) */
    uint32_t type;
    int64_t ne0, ne1, ne2;
    int bits;                  /* 0: a float array w; else affine groups (wq, scales, biases) */
    mx::array w, wq, scales, biases;
    mlx_weight() : w(0.0f), wq(0.0f), scales(0.0f), biases(0.0f) {}
} mlx_weight;

typedef struct mlx_kv {
    const kvcache *kv;
    int n_layer, n_ctx, n_head, head_dim, cap;
    mx::Dtype dt;
    std::vector<mx::array> k, v;   /* per layer [n_head][cap][head_dim] */
    std::vector<int> valid;        /* leading positions equal to the host rows */
    mlx_kv() : dt(mx::float16) {}
} mlx_kv;

/* A result not yet on the host: floats [p, p + n) of a buffer are a's. */
typedef struct {
    float *p;
    size_t n;
    mx::array a;
} mlx_pending;

typedef struct {
    std::vector<mlx_pending> pending;   /* disjoint ranges */
    std::vector<std::pair<float *, size_t>> bufs;   /* alloc'd buffers and their floats */
    std::vector<mlx_weight *> weights;
    std::vector<mlx_kv *> kvs;
    std::vector<float> rope_cs;    /* host cos/sin table of the last rope call */
    long n_eval;                   /* evaluations (TANDEM_MLX_STATS=1 prints them at the end) */
    /* The one stream every entry point computes on, whichever thread calls
     * it (see ml_run). */
    std::optional<mx::Stream> stream;
    int failed;
    char err[256];
} mlx_impl;

static mlx_impl *ml_of(backend *be) { return (mlx_impl *)be->impl; }

static void ml_fail(mlx_impl *c, const char *what, const char *msg) {
    if (!c->failed) snprintf(c->err, sizeof c->err, "%.60s: %.180s", what, msg);
    c->failed = 1;
    log_error(NULL, "MLX backend: %s: %s", what, msg);
}

/* Every entry point runs its body under the lock, MLX's exceptions caught:
 * 0, or -1 after ml_fail. */
static int ml_run(mlx_impl *c, const char *what, std::function<void()> body) {
    std::lock_guard<std::mutex> lk(g_mlx_mu);
    try {
        /* MLX's default streams are per thread (0.32): a result left
         * lazy by one thread (a serving node's start-up calibration pass,
         * on the main thread) and evaluated from another (its scheduler)
         * came out stale, one pass behind. Every entry point makes the
         * backend's own stream, made for use from any thread, the
         * default of the calling thread first; calls are serialised by
         * g_mlx_mu. */
        if (c->stream) mx::set_default_stream(*c->stream);
        body();
        return 0;
    } catch (const std::exception &e) {
        ml_fail(c, what, e.what());
        return -1;
    }
}

/* ==== Host <-> arrays ====
 * Activation buffers are host memory, so that offsets into them mean what
 * they mean on the CPU. An op's result stays a lazy MLX array, recorded as
 * pending for its range, and the next op that reads exactly that range
 * takes the array itself: MLX evaluates a layer's ops as one graph (one
 * Metal command stream on a Mac) instead of one evaluation per op. Anything
 * that reads or writes the host bytes of a pending range (read, write,
 * kv_store's rows, get_rows, a read of another extent) evaluates it first
 * (ml_flush), so the host bytes are always what the ops computed. */

static int ml_overlaps(const mlx_pending &e, const float *p, size_t n) { return e.p < p + n && p < e.p + e.n; }

typedef struct { const float *p; size_t n; } ml_range;

/* Evaluates every pending result overlapping one of the ranges into the
 * host (one evaluation for all) and drops it; drop_covered: results inside
 * a range are dropped unevaluated (the caller overwrites all of it). */
static void ml_flush_ranges(mlx_impl *c, const std::vector<ml_range> &rs, int drop_covered = 0) {
    std::vector<mlx_pending> out;
    std::vector<mx::array> ev;
    for (size_t i = 0; i < c->pending.size();) {
        mlx_pending &e = c->pending[i];
        const ml_range *hit = NULL;
        for (const ml_range &r : rs)
            if (ml_overlaps(e, r.p, r.n)) { hit = &r; break; }
        if (!hit) { i++; continue; }
        const float *p = hit->p;
        size_t n = hit->n;
        if (!(drop_covered && e.p >= p && e.p + e.n <= p + n)) {
            e.a = mx::reshape(mx::astype(e.a, mx::float32), { -1 });
            out.push_back(e);
            ev.push_back(e.a);
        }
        c->pending.erase(c->pending.begin() + (long)i);
    }
    if (ev.empty()) return;
    c->n_eval++;
    mx::eval(ev);
    for (mlx_pending &e : out) {
        if (e.a.size() != e.n) throw std::runtime_error("result size mismatch");
        memcpy(e.p, e.a.data<float>(), e.n * sizeof(float));
    }
}

static void ml_flush(mlx_impl *c, const float *p, size_t n, int drop_covered = 0) {
    ml_flush_ranges(c, { { p, n } }, drop_covered);
}

/* The floats [p, p + prod(shape)) as an array: a pending result of exactly
 * that range as it is, else the host bytes (after flushing overlaps). */
static mx::array ml_in(mlx_impl *c, const float *p, mx::Shape shape) {
    size_t n = 1;
    for (int d : shape) n *= (size_t)d;
    for (const mlx_pending &e : c->pending)
        if (e.p == p && e.n == n) return mx::reshape(e.a, std::move(shape));
    ml_flush(c, p, n);
    return mx::array(p, std::move(shape), mx::float32);
}

/* dst's n floats become a (lazily). */
static void ml_out(mlx_impl *c, float *dst, mx::array a, size_t n) {
    if (a.size() != n) throw std::runtime_error("result size mismatch");
    ml_flush(c, dst, n, 1);
    c->pending.push_back({ dst, n, mx::astype(a, mx::float32) });
}

/* Evaluates a now and copies its n floats to dst (host memory of our own). */
static void ml_now(float *dst, mx::array a, size_t n) {
    a = mx::reshape(mx::astype(a, mx::float32), { -1 });
    mx::eval(a);
    if (a.size() != n) throw std::runtime_error("result size mismatch");
    memcpy(dst, a.data<float>(), n * sizeof(float));
}

/* Host data that is no backend buffer (weights, tables): copied as it is. */
static mx::array ml_host(const float *p, mx::Shape shape) { return mx::array(p, std::move(shape), mx::float32); }

static float *ml_alloc(backend *be, size_t n) {
    mlx_impl *c = ml_of(be);
    float *p = (float *)calloc(n ? n : 1, sizeof(float));
    if (!p) return NULL;
    std::lock_guard<std::mutex> lk(g_mlx_mu);
    try { c->bufs.push_back({ p, n ? n : 1 }); } catch (...) { free(p); return NULL; }
    return p;
}

static void ml_release(backend *be, float *buf) {
    mlx_impl *c = ml_of(be);
    if (!buf) return;
    {
        std::lock_guard<std::mutex> lk(g_mlx_mu);
        for (size_t i = 0; i < c->bufs.size(); i++) {
            if (c->bufs[i].first != buf) continue;
            size_t n = c->bufs[i].second;
            for (size_t j = 0; j < c->pending.size();)
                if (ml_overlaps(c->pending[j], buf, n)) c->pending.erase(c->pending.begin() + (long)j);
                else j++;
            c->bufs.erase(c->bufs.begin() + (long)i);
            break;
        }
    }
    free(buf);
}

static void ml_read(backend *be, const float *src, float *dst, size_t n) {
    mlx_impl *c = ml_of(be);
    ml_run(c, "read", [&] { ml_flush(c, src, n); });
    memmove(dst, src, n * sizeof(float));
}

static void ml_write(backend *be, float *dst, const float *src, size_t n) {
    mlx_impl *c = ml_of(be);
    ml_run(c, "write", [&] { ml_flush(c, dst, n, 1); });
    memmove(dst, src, n * sizeof(float));
}

/* ==== Weights ==== */

/* Bits, offset of the level 0 (in units of d) and groups per block of a
 * type MLX holds exactly; 0 bits: not one. */
static int ml_affine_bits(uint32_t t) {
    switch (t) {
    case GGML_TYPE_Q8_0: return 8;
    case GGML_TYPE_Q4_0: case GGML_TYPE_Q4_1: case GGML_TYPE_Q4_K: return 4;
    case GGML_TYPE_Q5_0: case GGML_TYPE_Q5_1: case GGML_TYPE_Q5_K: return 5;
    default: return 0;
    }
}

/* The (scale, bias) of each group of 32 in one row, from the block headers:
 * w = scale * level + bias with level in [0, 2^bits). */
static void ml_row_groups(uint32_t t, const uint8_t *row, int64_t n, float *sc, float *bi) {
    int64_t ng = n / MLX_GROUP;
    for (int64_t g = 0; g < ng; g++) {
        switch (t) {
        case GGML_TYPE_Q8_0: { const block_q8_0 *b = (const block_q8_0 *)row + g; float d = fp16_to_f32(b->d); sc[g] = d; bi[g] = -128.0f * d; break; }
        case GGML_TYPE_Q4_0: { const block_q4_0 *b = (const block_q4_0 *)row + g; float d = fp16_to_f32(b->d); sc[g] = d; bi[g] = -8.0f * d; break; }
        case GGML_TYPE_Q5_0: { const block_q5_0 *b = (const block_q5_0 *)row + g; float d = fp16_to_f32(b->d); sc[g] = d; bi[g] = -16.0f * d; break; }
        case GGML_TYPE_Q4_1: { const block_q4_1 *b = (const block_q4_1 *)row + g; sc[g] = fp16_to_f32(b->d); bi[g] = fp16_to_f32(b->m); break; }
        case GGML_TYPE_Q5_1: { const block_q5_1 *b = (const block_q5_1 *)row + g; sc[g] = fp16_to_f32(b->d); bi[g] = fp16_to_f32(b->m); break; }
        case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: {
            /* both start with d, dmin, scales[12] */
            const block_q4_K *b = (const block_q4_K *)(row + (size_t)(g / 8) * (t == GGML_TYPE_Q4_K ? sizeof(block_q4_K) : sizeof(block_q5_K)));
            int j = (int)(g % 8);
            uint8_t s, m;
            if (j < 4) { s = b->scales[j] & 63; m = b->scales[j + 4] & 63; }
            else {
                s = (uint8_t)((b->scales[j + 4] & 0xF) | ((b->scales[j - 4] >> 6) << 4));
                m = (uint8_t)((b->scales[j + 4] >> 4) | ((b->scales[j] >> 6) << 4));
            }
            sc[g] = fp16_to_f32(b->d) * s;
            bi[g] = -(fp16_to_f32(b->dmin) * m);
            break;
        }
        }
    }
}

/* Packs a row's levels little-endian, `bits` each, into uint32 words (MLX's layout). */
static void ml_pack(const uint8_t *lv, int64_t n, int bits, uint32_t *out) {
    memset(out, 0, (size_t)(n * bits / 32) * sizeof(uint32_t));
    uint8_t *o = (uint8_t *)out;
    for (int64_t i = 0; i < n; i++)
        for (int k = 0; k < bits; k++)
            if ((lv[i] >> k) & 1) { int64_t bit = i * bits + k; o[bit / 8] |= (uint8_t)(1u << (bit % 8)); }
}

/* Affine groups for a quantized weight; 0, or -1 when some value is not
 * scale * level + bias exactly (the caller then keeps f32). */
static int ml_weight_affine(mlx_weight *w, const be_weight *bw, int bits) {
    const int64_t n = bw->ne[0], rows = w->ne1 * w->ne2, ng = n / MLX_GROUP, words = n * bits / 32;
    if (n % MLX_GROUP) return -1;
    std::vector<uint32_t> q((size_t)(rows * words));
    std::vector<float> sc((size_t)(rows * ng)), bi((size_t)(rows * ng)), row((size_t)n);
    std::vector<uint8_t> lv((size_t)n);
    const int top = (1 << bits) - 1;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *src = (const uint8_t *)bw->data + (size_t)r * bw->row_bytes;
        float *s = &sc[(size_t)(r * ng)], *b = &bi[(size_t)(r * ng)];
        ml_row_groups(w->type, src, n, s, b);
        quant_dequantize_row(w->type, src, row.data(), n);
        for (int64_t i = 0; i < n; i++) {
            float S = s[i / MLX_GROUP], B = b[i / MLX_GROUP];
            long l = S != 0.0f ? lrintf((row[(size_t)i] - B) / S) : 0;
            if (l < 0 || l > top) return -1;
            volatile float back = S * (float)l;   /* no fused multiply-add: MLX's order */
            if ((float)(back + B) != row[(size_t)i]) return -1;
            lv[(size_t)i] = (uint8_t)l;
        }
        ml_pack(lv.data(), n, bits, &q[(size_t)(r * words)]);
    }
    mx::Shape sw = { (int)w->ne2, (int)w->ne1, (int)words }, sg = { (int)w->ne2, (int)w->ne1, (int)ng };
    w->wq = mx::array(q.data(), sw, mx::uint32);
    w->scales = mx::array(sc.data(), sg, mx::float32);
    w->biases = mx::array(bi.data(), sg, mx::float32);
    w->bits = bits;
    return 0;
}

static void ml_weight_float(mlx_weight *w, const be_weight *bw) {
    const int64_t n = bw->ne[0], rows = w->ne1 * w->ne2;
    mx::Shape sh = { (int)w->ne2, (int)w->ne1, (int)n };
    if (bw->type == GGML_TYPE_F32) {
        w->w = mx::array((const float *)bw->data, sh, mx::float32);
    } else if (bw->type == GGML_TYPE_F16 || bw->type == GGML_TYPE_BF16) {
        /* widened to f32 once (exact): the products meet unrounded f32
         * activations as on the CPU, and converting per product cost 50x
         * in decode speed (qwen3-mini F16: 1.1 against 54 t/s) */
        w->w = mx::astype(mx::view(mx::array((const uint16_t *)bw->data, sh, mx::uint16),
                                   bw->type == GGML_TYPE_F16 ? mx::float16 : mx::bfloat16), mx::float32);
    } else {   /* dequantized to f32 by quant.c's decoder: exact, 4 bytes a value */
        std::vector<float> f((size_t)(rows * n));
        for (int64_t r = 0; r < rows; r++)
            quant_dequantize_row(bw->type, (const uint8_t *)bw->data + (size_t)r * bw->row_bytes, &f[(size_t)(r * n)], n);
        w->w = mx::array(f.data(), sh, mx::float32);
    }
    w->bits = 0;
}

static mlx_weight *ml_weight_find(mlx_impl *c, const be_weight *bw) {
    int64_t ne2 = bw->ne[2] > 0 ? bw->ne[2] : 1;
    for (mlx_weight *w : c->weights)
        if (w->host == bw->data && w->type == bw->type && w->ne0 == bw->ne[0] && w->ne1 == bw->ne[1] && w->ne2 == ne2)
            return w;
    return NULL;
}

/* Caller holds the lock. */
static mlx_weight *ml_weight_make(mlx_impl *c, const be_weight *bw) {
    mlx_weight *w = ml_weight_find(c, bw);
    if (w) return w;
    w = new mlx_weight();
    w->host = bw->data; w->type = bw->type; w->ne0 = bw->ne[0]; w->ne1 = bw->ne[1];
    w->ne2 = bw->ne[2] > 0 ? bw->ne[2] : 1;
    try {
        int bits = ml_affine_bits(bw->type);
        if (!bits || ml_weight_affine(w, bw, bits)) ml_weight_float(w, bw);
        if (w->bits) mx::eval({ w->wq, w->scales, w->biases });
        else mx::eval(w->w);
    } catch (...) {
        delete w;
        throw;
    }
    c->weights.push_back(w);
    return w;
}

static int ml_load_weight(backend *be, be_weight *bw, char *err, size_t errlen) {
    mlx_impl *c = ml_of(be);
    if (bw->rows_only) return 0;   /* get_rows reads the host rows */
    int rc = 0;
    if (ml_run(c, "weight", [&] { bw->dev = ml_weight_make(c, bw); })) rc = -1;
    if (rc) snprintf(err, errlen, "MLX backend: cannot convert tensor %s: %s", bw->name ? bw->name : "?", c->err);
    return rc;
}

/* Caller holds the lock. */
static mlx_weight *ml_weight_of(mlx_impl *c, const be_weight *bw) {
    if (bw->dev) return (mlx_weight *)bw->dev;
    mlx_weight *w = ml_weight_make(c, bw);
    ((be_weight *)bw)->dev = w;   /* the model's own (non-const) weight table */
    return w;
}

/* x [rows][ne0] times expert e of w: [rows][ne1], summed in f32. As on the
 * CPU backend (quant_vec_dot_type, moe_round_f16), a float weight meets x
 * unrounded, except F16 experts of a MoE block (round_f16), whose inputs
 * are rounded to F16 first. */
static mx::array ml_matmul(const mlx_weight *w, int e, const mx::array &x, int round_f16 = 0) {
    if (w->bits)
        return mx::quantized_matmul(x, mx::take(w->wq, e, 0), mx::take(w->scales, e, 0), mx::take(w->biases, e, 0), true,
                                    MLX_GROUP, w->bits, "affine");
    mx::array we = mx::take(w->w, e, 0);
    mx::array xr = x;
    if (round_f16 && w->type == GGML_TYPE_F16) xr = mx::astype(mx::astype(x, mx::float16), mx::float32);
    return mx::matmul(xr, mx::transpose(we));
}

/* ==== Row-wise ops ==== */

static int ml_get_rows(backend *be, const be_weight *w, const int32_t *ids, int n, float *out) {
    mlx_impl *c = ml_of(be);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= w->ne[1]) return -1;
    /* the embedding rows straight from the host tensor, as the CPU does:
     * a few rows per pass, exact for every type */
    if (ml_run(c, "get_rows", [&] { ml_flush(c, out, (size_t)n * w->ne[0], 1); })) return -1;
    for (int i = 0; i < n; i++)
        quant_dequantize_row(w->type, (const uint8_t *)w->data + (size_t)ids[i] * w->row_bytes, out + (size_t)i * w->ne[0],
                             w->ne[0]);
    return 0;
}

static void ml_rms_norm(backend *be, const float *x, const be_weight *w, float *y, int n_rows, int dim, float eps) {
    mlx_impl *c = ml_of(be);
    ml_run(c, "rms_norm", [&] {
        mx::array X = ml_in(c, x, { n_rows, dim });
        std::optional<mx::array> W;
        if (w && w->data) W = ml_host((const float *)w->data, { dim });
        ml_out(c, y, mx::fast::rms_norm(X, W, eps), (size_t)n_rows * dim);
    });
}

static void ml_mul_mat(backend *be, const be_weight *w, int expert, const float *x, int n_tok, float *y) {
    mlx_impl *c = ml_of(be);
    ml_run(c, "mul_mat", [&] {
        mlx_weight *mw = ml_weight_of(c, w);
        mx::array X = ml_in(c, x, { n_tok, (int)w->ne[0] });
        ml_out(c, y, ml_matmul(mw, expert, X), (size_t)n_tok * w->ne[1]);
    });
}

static void ml_add_bias(backend *be, float *x, const be_weight *b, int n_tok) {
    mlx_impl *c = ml_of(be);
    int d = (int)b->ne[0];
    ml_run(c, "add_bias", [&] {
        ml_out(c, x, mx::add(ml_in(c, x, { n_tok, d }), ml_host((const float *)b->data, { d })), (size_t)n_tok * d);
    });
}

static void ml_swiglu(backend *be, const float *g, const float *u, float *y, size_t n) {
    mlx_impl *c = ml_of(be);
    ml_run(c, "swiglu", [&] {
        mx::array G = ml_in(c, g, { (int)n }), U = ml_in(c, u, { (int)n });
        ml_out(c, y, mx::multiply(mx::multiply(G, mx::sigmoid(G)), U), n);
    });
}

static void ml_add(backend *be, float *x, const float *y, size_t n) {
    mlx_impl *c = ml_of(be);
    ml_run(c, "add", [&] { ml_out(c, x, mx::add(ml_in(c, x, { (int)n }), ml_in(c, y, { (int)n })), n); });
}

/* ==== RoPE ==== */

/* The angles as the CPU backend computes them (rope_table_rows): theta
 * advanced by repeated multiplication in float. Row t: cos then sin. */
static void ml_rope_table(float *table, int n_tok, const int32_t *pos, const rope_cfg *rc) {
    const int n_rot = rc->n_rot, half = n_rot / 2;
    const float theta_scale = powf(rc->freq_base, -2.0f / (float)n_rot);
    for (int t = 0; t < n_tok; t++) {
        float *cs = table + (size_t)t * n_rot, *sn = cs + half;
        float theta = (float)pos[t];
        for (int i = 0; i < half; i++) {
            float ff = rc->freq_factors ? rc->freq_factors[i] : 1.0f;
            float th = theta / ff * rc->freq_scale;
            cs[i] = cosf(th);
            sn[i] = sinf(th);
            theta *= theta_scale;
        }
    }
}

static void ml_rope(backend *be, float *x, int n_tok, int n_head, int head_dim, const int32_t *pos, const rope_cfg *rc) {
    mlx_impl *c = ml_of(be);
    const int n_rot = rc->n_rot, half = n_rot / 2;
    ml_run(c, "rope", [&] {
        c->rope_cs.resize((size_t)n_tok * n_rot);
        ml_rope_table(c->rope_cs.data(), n_tok, pos, rc);
        mx::array T = ml_host(c->rope_cs.data(), { n_tok, 1, n_rot });
        mx::array cs = mx::slice(T, { 0, 0, 0 }, { n_tok, 1, half }), sn = mx::slice(T, { 0, 0, half }, { n_tok, 1, n_rot });
        mx::array X = ml_in(c, x, { n_tok, n_head, head_dim });
        mx::array R = mx::slice(X, { 0, 0, 0 }, { n_tok, n_head, n_rot });
        mx::array out(0.0f);
        if (rc->mode == ROPE_NEOX) {
            mx::array a = mx::slice(R, { 0, 0, 0 }, { n_tok, n_head, half });
            mx::array b = mx::slice(R, { 0, 0, half }, { n_tok, n_head, n_rot });
            out = mx::concatenate({ mx::subtract(mx::multiply(a, cs), mx::multiply(b, sn)),
                                    mx::add(mx::multiply(a, sn), mx::multiply(b, cs)) }, 2);
        } else {
            mx::array P = mx::reshape(R, { n_tok, n_head, half, 2 });
            mx::array a = mx::squeeze(mx::slice(P, { 0, 0, 0, 0 }, { n_tok, n_head, half, 1 }), 3);
            mx::array b = mx::squeeze(mx::slice(P, { 0, 0, 0, 1 }, { n_tok, n_head, half, 2 }), 3);
            out = mx::reshape(mx::stack({ mx::subtract(mx::multiply(a, cs), mx::multiply(b, sn)),
                                          mx::add(mx::multiply(a, sn), mx::multiply(b, cs)) }, 3),
                              { n_tok, n_head, n_rot });
        }
        if (n_rot < head_dim) out = mx::concatenate({ out, mx::slice(X, { 0, 0, n_rot }, { n_tok, n_head, head_dim }) }, 2);
        ml_out(c, x, out, (size_t)n_tok * n_head * head_dim);
    });
}

/* ==== KV caches ==== */

static mlx_kv *ml_kv_find(mlx_impl *c, const kvcache *kv) {
    for (mlx_kv *m : c->kvs)
        if (m->kv == kv) return m;
    return NULL;
}

/* The arrays of kv, made at its first use (caller holds the lock). */
static mlx_kv *ml_kv_get(mlx_impl *c, const kvcache *kv) {
    mlx_kv *m = ml_kv_find(c, kv);
    if (m) return m;
    m = new mlx_kv();
    m->kv = kv; m->n_layer = kv_n_layer(kv); m->n_ctx = kv_n_ctx(kv); m->n_head = kv_n_head(kv);
    m->head_dim = kv_head_dim(kv);
    m->dt = kv_dtype(kv) == GGML_TYPE_F16 ? mx::float16 : kv_dtype(kv) == GGML_TYPE_BF16 ? mx::bfloat16 : mx::float32;
    m->cap = 0;
    m->valid.assign((size_t)m->n_layer, 0);
    c->kvs.push_back(m);
    return m;
}

/* Room for n positions in every layer's arrays (grown by doubling). */
static void ml_kv_room(mlx_kv *m, int n) {
    if (n <= m->cap) return;
    int cap = m->cap ? m->cap : MLX_KV_FIRST;
    while (cap < n) cap *= 2;
    if (cap > m->n_ctx) cap = m->n_ctx;
    for (int l = 0; l < m->n_layer; l++) {
        mx::array z = mx::zeros({ m->n_head, cap, m->head_dim }, m->dt);
        if (m->cap && m->valid[(size_t)l]) {
            mx::Shape lo = { 0, 0, 0 }, hi = { m->n_head, m->valid[(size_t)l], m->head_dim };
            z = mx::slice_update(z, mx::slice(m->k[(size_t)l], lo, hi), lo, hi);
            mx::array zv = mx::zeros({ m->n_head, cap, m->head_dim }, m->dt);
            zv = mx::slice_update(zv, mx::slice(m->v[(size_t)l], lo, hi), lo, hi);
            m->k[(size_t)l] = z;
            m->v[(size_t)l] = zv;
        } else if ((size_t)l < m->k.size()) {
            m->k[(size_t)l] = z;
            m->v[(size_t)l] = mx::zeros({ m->n_head, cap, m->head_dim }, m->dt);
        } else {
            m->k.push_back(z);
            m->v.push_back(mx::zeros({ m->n_head, cap, m->head_dim }, m->dt));
        }
    }
    m->cap = cap;
}

/* One half (K or V) of layer's host rows [from, to) as an array [n_head][to - from][head_dim]. */
static mx::array ml_kv_host_rows(const mlx_kv *m, int layer, int from, int to, int is_v) {
    const kvcache *kv = m->kv;
    const int n = to - from, hd = m->head_dim;
    const size_t hb = kv_head_bytes(kv);
    mx::Shape sh = { m->n_head, n, hd };
    if (kv_dtype(kv) == GGML_TYPE_Q8_0) {   /* decoded to f32: d * q, exact */
        std::vector<float> f((size_t)m->n_head * n * hd);
        for (int h = 0; h < m->n_head; h++) {
            const uint8_t *src = (is_v ? kv_v_head(kv, layer, h) : kv_k_head(kv, layer, h)) + (size_t)from * hb;
            for (int p = 0; p < n; p++) quant_dequantize_row(GGML_TYPE_Q8_0, src + (size_t)p * hb, &f[((size_t)h * n + p) * hd], hd);
        }
        return mx::array(f.data(), sh, mx::float32);
    }
    std::vector<uint16_t> u((size_t)m->n_head * n * hd);
    for (int h = 0; h < m->n_head; h++) {
        const uint8_t *src = (is_v ? kv_v_head(kv, layer, h) : kv_k_head(kv, layer, h)) + (size_t)from * hb;
        memcpy(&u[(size_t)h * n * hd], src, (size_t)n * hb);
    }
    return mx::view(mx::array(u.data(), sh, mx::uint16), m->dt);
}

/* Makes the arrays' rows [0, pos) of layer equal the host's. */
static void ml_kv_catch_up(mlx_kv *m, int layer, int pos) {
    int from = m->valid[(size_t)layer];
    if (from >= pos) return;
    ml_kv_room(m, pos);
    mx::Shape lo = { 0, from, 0 }, hi = { m->n_head, pos, m->head_dim };
    m->k[(size_t)layer] = mx::slice_update(m->k[(size_t)layer], ml_kv_host_rows(m, layer, from, pos, 0), lo, hi);
    m->v[(size_t)layer] = mx::slice_update(m->v[(size_t)layer], ml_kv_host_rows(m, layer, from, pos, 1), lo, hi);
    m->valid[(size_t)layer] = pos;   /* evaluated with the attention that reads them */
}

/* The new rows go into the host cache through the CPU's encoder (so its
 * bytes are the CPU backend's), then into the arrays at attention. */
static void ml_kv_store(backend *be, const be_batch *b, int layer, const float *k, const float *v) {
    mlx_impl *c = ml_of(be);
    ml_run(c, "kv_store", [&] {
        std::vector<ml_range> rows;   /* the rows read on the host below: one evaluation for all */
        for (int s = 0; s < b->n_seq; s++) {
            size_t off = (size_t)b->seq[s].t0 * kv_dim(b->seq[s].kv), n = (size_t)b->seq[s].n * kv_dim(b->seq[s].kv);
            rows.push_back({ k + off, n });
            rows.push_back({ v + off, n });
        }
        ml_flush_ranges(c, rows);
        for (int s = 0; s < b->n_seq; s++) {
            const be_seq *sq = &b->seq[s];
            size_t off = (size_t)sq->t0 * kv_dim(sq->kv);
            kv_store_f32(sq->kv, layer, sq->pos0, sq->n, k + off, v + off);
            mlx_kv *m = ml_kv_get(c, sq->kv);
            if (m->valid[(size_t)layer] > sq->pos0) m->valid[(size_t)layer] = sq->pos0;
        }
    });
}

static void ml_kv_forget(backend *be, const kvcache *kv, int pos) {
    mlx_impl *c = ml_of(be);
    std::lock_guard<std::mutex> lk(g_mlx_mu);
    for (size_t i = 0; i < c->kvs.size(); i++) {
        mlx_kv *m = c->kvs[i];
        if (m->kv != kv) continue;
        if (pos < 0) {
            delete m;
            c->kvs.erase(c->kvs.begin() + (long)i);
        } else {
            for (int &v : m->valid) if (v > pos) v = pos;
        }
        return;
    }
}

/* ==== Attention ==== */

static int ml_attention(backend *be, const float *q, const be_batch *b, int layer, int n_head, int n_head_kv,
                        int head_dim, float scale, float *out) {
    mlx_impl *c = ml_of(be);
    if (n_head_kv < 1 || n_head % n_head_kv || b->n_seq < 1 || head_dim < 1) return -1;
    int rc = 0;
    if (ml_run(c, "attention", [&] {
        for (int s = 0; s < b->n_seq; s++) {
            const be_seq *sq = &b->seq[s];
            const int n = sq->n, L = sq->pos0 + n;
            if (n < 1) continue;
            if (kv_n_head(sq->kv) != n_head_kv || kv_head_dim(sq->kv) != head_dim || L > kv_n_ctx(sq->kv)) { rc = -1; break; }
            mlx_kv *m = ml_kv_get(c, sq->kv);
            ml_kv_catch_up(m, layer, L);
            mx::Shape lo = { 0, 0, 0 }, hi = { n_head_kv, L, head_dim };
            mx::array K = mx::expand_dims(mx::astype(mx::slice(m->k[(size_t)layer], lo, hi), mx::float32), 0);
            mx::array V = mx::expand_dims(mx::astype(mx::slice(m->v[(size_t)layer], lo, hi), mx::float32), 0);
            mx::array Q = mx::expand_dims(mx::transpose(ml_in(c, q + (size_t)sq->t0 * n_head * head_dim, { n, n_head, head_dim }),
                                                        { 1, 0, 2 }), 0);
            /* causal: query row i (position pos0 + i) sees keys 0..pos0 + i */
            mx::array qi = mx::reshape(mx::arange(sq->pos0, L), { n, 1 });
            mx::array kj = mx::reshape(mx::arange(0, L), { 1, L });
            mx::array mask = mx::less_equal(kj, qi);
            mx::array O = mx::fast::scaled_dot_product_attention(Q, K, V, scale, "", mask);
            ml_out(c, out + (size_t)sq->t0 * n_head * head_dim, mx::transpose(mx::squeeze(O, 0), { 1, 0, 2 }),
                   (size_t)n * n_head * head_dim);
        }
    })) rc = -1;
    return rc;
}

/* ==== Mixture of experts ==== */

static int ml_moe_ffn(backend *be, const be_moe *mo, const float *x, int n_tok, float *y) {
    mlx_impl *c = ml_of(be);
    const int ne = mo->n_expert, k = mo->n_expert_used, dim = (int)mo->gate_inp->ne[0];
    if (ne > 256 || k > ne || k < 1 || n_tok < 1) return -1;
    int rc = 0;
    if (ml_run(c, "moe_ffn", [&] {
        mlx_weight *gi = ml_weight_of(c, mo->gate_inp), *wg = ml_weight_of(c, mo->gate_exps);
        mlx_weight *wu = ml_weight_of(c, mo->up_exps), *wd = ml_weight_of(c, mo->down_exps);
        mx::array X = ml_in(c, x, { n_tok, dim });
        /* the router on the host, shared with every backend */
        std::vector<float> logits((size_t)n_tok * ne), selw((size_t)n_tok * k);
        std::vector<int32_t> sel((size_t)n_tok * k);
        ml_now(logits.data(), ml_matmul(gi, 0, X), logits.size());
        for (int t = 0; t < n_tok; t++)
            moe_select_experts(&logits[(size_t)t * ne], ne, k, mo->norm_topk, &sel[(size_t)t * k], &selw[(size_t)t * k]);
        /* each used expert's rows, then its products; every token's sum in expert order, as on the CPU */
        std::vector<std::vector<int32_t>> rows((size_t)ne);
        for (int t = 0; t < n_tok; t++)
            for (int j = 0; j < k; j++) rows[(size_t)sel[(size_t)t * k + j]].push_back(t);
        std::vector<mx::array> res;
        std::vector<int> used;
        for (int e = 0; e < ne; e++) {
            if (rows[(size_t)e].empty()) continue;
            int ni = (int)rows[(size_t)e].size();
            mx::array idx(rows[(size_t)e].data(), { ni }, mx::int32);
            mx::array Xe = mx::take(X, idx, 0);
            mx::array G = ml_matmul(wg, e, Xe, 1), U = ml_matmul(wu, e, Xe, 1);
            mx::array H = mx::multiply(mx::multiply(G, mx::sigmoid(G)), U);
            res.push_back(mx::astype(ml_matmul(wd, e, H, 1), mx::float32));
            used.push_back(e);
        }
        mx::eval(res);
        c->n_eval += 2;   /* the router's logits (ml_now) and the experts */
        ml_flush(c, y, (size_t)n_tok * dim, 1);   /* summed on the host below */
        memset(y, 0, sizeof(float) * (size_t)n_tok * dim);
        for (size_t u = 0; u < used.size(); u++) {
            int e = used[u];
            mx::array R = mx::reshape(res[u], { -1 });
            mx::eval(R);
            const float *r = R.data<float>();
            for (size_t i = 0; i < rows[(size_t)e].size(); i++) {
                int t = rows[(size_t)e][i];
                float wt = 0.0f;
                for (int j = 0; j < k; j++) if (sel[(size_t)t * k + j] == e) wt = selw[(size_t)t * k + j];
                float *yt = y + (size_t)t * dim;
                const float *rt = r + i * (size_t)dim;
                for (int d = 0; d < dim; d++) yt[d] += wt * rt[d];
            }
        }
    })) rc = -1;
    return rc;
}

/* ==== Table ==== */

static void ml_destroy(backend *be) {
    if (!be) return;
    mlx_impl *c = ml_of(be);
    if (c) {
        std::lock_guard<std::mutex> lk(g_mlx_mu);
        const char *st = getenv("TANDEM_MLX_STATS");
        if (st && atoi(st) > 0) fprintf(stderr, "MLX backend: %ld evaluations\n", c->n_eval);
        for (mlx_weight *w : c->weights) delete w;
        for (mlx_kv *m : c->kvs) delete m;
        delete c;
    }
    free(be);
}

static const backend_ops ml_ops = {
    /* .name = */ "mlx",
    /* .destroy = */ ml_destroy,
    /* .alloc = */ ml_alloc,
    /* .release = */ ml_release,
    /* .read = */ ml_read,
    /* .write = */ ml_write,
    /* .get_rows = */ ml_get_rows,
    /* .rms_norm = */ ml_rms_norm,
    /* .mul_mat = */ ml_mul_mat,
    /* .add_bias = */ ml_add_bias,
    /* .rope = */ ml_rope,
    /* .attention = */ ml_attention,
    /* .kv_store = */ ml_kv_store,
    /* .swiglu = */ ml_swiglu,
    /* .add = */ ml_add,
    /* .moe_ffn = */ ml_moe_ffn,
    /* .load_weight = */ ml_load_weight,
    /* .sync_kv = */ NULL,
    /* .kv_forget = */ ml_kv_forget,
    /* .mul_mat_n = */ NULL,
    /* .warm_next = */ NULL,
    /* .pass_rows = */ 0,
};

/* ==== Creation ==== */

extern "C" backend *backend_mlx_create(int n_threads, char *err, size_t errlen) {
    (void)n_threads;
    backend *be = (backend *)calloc(1, sizeof *be);
    mlx_impl *c = new (std::nothrow) mlx_impl();
    if (!be || !c) { free(be); delete c; snprintf(err, errlen, "out of memory"); return NULL; }
    be->ops = &ml_ops;
    be->impl = c;
    /* TANDEM_MLX_DEVICE=cpu|gpu picks MLX's device (default: MLX's own,
     * the GPU on a Mac, the CPU on Linux builds without CUDA) */
    const char *dev = getenv("TANDEM_MLX_DEVICE");
    try {
        std::lock_guard<std::mutex> lk(g_mlx_mu);
        if (dev && *dev) {
            if (strcmp(dev, "cpu") && strcmp(dev, "gpu")) throw std::runtime_error("TANDEM_MLX_DEVICE must be cpu or gpu");
            mx::Device d(!strcmp(dev, "cpu") ? mx::Device::cpu : mx::Device::gpu);
            if (!mx::is_available(d)) throw std::runtime_error("the requested MLX device is not available");
            mx::set_default_device(d);
        }
        c->stream = mx::new_thread_unsafe_stream(mx::default_device());
        mx::set_default_stream(*c->stream);
        mx::array probe = mx::sum(mx::arange(0.0f, 4.0f, 1.0f));   /* proves the library runs */
        mx::eval(probe);
        if (probe.item<float>() != 6.0f) throw std::runtime_error("a probe sum came out wrong");
    } catch (const std::exception &e) {
        snprintf(err, errlen, "MLX backend: cannot start: %s", e.what());
        ml_destroy(be);
        return NULL;
    }
    return be;
}

extern "C" int backend_mlx_linked(void) { return 1; }

extern "C" const char *backend_mlx_device(void) {
    std::lock_guard<std::mutex> lk(g_mlx_mu);
    return mx::default_device().type == mx::Device::gpu ? "gpu" : "cpu";
}
