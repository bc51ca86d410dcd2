/* backend_mlx.cpp - the MLX backend (make MLX=1): engine/backend.h on Apple's
 * MLX through its C++ API (libmlx). On Linux it runs on MLX's CPU backend
 * (what is checked here); on a Mac the same code runs on Metal (MLX's
 * default device there). See src/backend/mlx/README.md and docs/mlx.md.
 *
 * Activation buffers are host memory (calloc), as on the CPU backend, so
 * that offsets into them (a sequence's rows, a token's row) mean what they
 * mean everywhere; results stay lazy MLX arrays between ops and reach the
 * host bytes when something reads them there ("Host <-> arrays" below):
 * a decode step evaluates once, for its logits (a MoE layer also waits for
 * its router's logits), not per op or per layer.
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
 * KV caches: backend_mlx_kv.cpp (the arrays per cache and layer, their
 * encoding, when the host cache gets the rows, attention).
 */
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>

#include "backend/mlx/mlx_internal.h"

extern "C" {
#include "base/log.h"
#include "engine/gguf.h"
#include "engine/quant.h"
/* base/platform.h's (that header's C11 _Atomic is not C++): the whole
 * pages of a read-only file mapping leave the resident set */
void plat_map_drop(const void *p, size_t n);
}

std::mutex g_mlx_mu;

/* MLX's affine group size used for every quantized weight: Q8_0/Q4_0/Q4_1/
 * Q5_0/Q5_1 blocks are 32 values with one scale, K-quant sub-blocks too. */
#define MLX_GROUP 32

/* ==== State ==== */

void ml_fail(mlx_impl *c, const char *what, const char *msg) {
    if (!c->failed) snprintf(c->err, sizeof c->err, "%.60s: %.180s", what, msg);
    c->failed = 1;
    log_error(NULL, "MLX backend: %s: %s", what, msg);
}

int ml_run(mlx_impl *c, const char *what, std::function<void()> body) {
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
 * pending for its range, and ops reading any range take the pending arrays
 * (or slices of them) for its parts and the host bytes for the rest: MLX
 * evaluates a pass's ops as one graph (one Metal command stream on a Mac)
 * instead of one evaluation per op. Only a read of the host bytes (read,
 * the MoE router's logits, kv_store's rows on the host path) evaluates
 * (ml_flush): the host bytes are then what the ops computed. A write over
 * part of a pending range keeps the rest of it lazy (ml_trim). */

static int ml_overlaps(const mlx_pending &e, const float *p, size_t n) { return e.p < p + n && p < e.p + e.n; }

/* a's floats [lo, hi) (a flat) */
static mx::array ml_part(const mx::array &a, size_t lo, size_t hi) {
    if (lo == 0 && hi == a.size()) return a;
    return mx::slice(a, { (int)lo }, { (int)hi });
}

void ml_eval(mlx_impl *c, const std::vector<mx::array> &ev) {
    c->n_eval++;
    mx::eval(ev);
}

void ml_flush_ranges(mlx_impl *c, const std::vector<ml_range> &rs) {
    std::vector<mlx_pending> out;
    std::vector<mx::array> ev;
    for (size_t i = 0; i < c->pending.size();) {
        mlx_pending &e = c->pending[i];
        int hit = 0;
        for (const ml_range &r : rs) hit |= ml_overlaps(e, r.p, r.n);
        if (!hit) { i++; continue; }
        e.a = mx::contiguous(e.a);
        out.push_back(e);
        ev.push_back(e.a);
        c->pending.erase(c->pending.begin() + (long)i);
    }
    if (ev.empty()) return;
    ml_eval(c, ev);
    for (mlx_pending &e : out) {
        if (e.a.size() != e.n) throw std::runtime_error("result size mismatch");
        memcpy(e.p, e.a.data<float>(), e.n * sizeof(float));
    }
}

static void ml_flush(mlx_impl *c, const float *p, size_t n) { ml_flush_ranges(c, { { p, n } }); }

/* The host bytes [p, p + n) are about to be overwritten: pending results
 * inside are dropped, the parts of others outside the range stay lazy. */
static void ml_trim(mlx_impl *c, const float *p, size_t n) {
    std::vector<mlx_pending> keep;
    for (size_t i = 0; i < c->pending.size();) {
        mlx_pending &e = c->pending[i];
        if (!ml_overlaps(e, p, n)) { i++; continue; }
        if (e.p < p) keep.push_back({ e.p, (size_t)(p - e.p), ml_part(e.a, 0, (size_t)(p - e.p)) });
        if (e.p + e.n > p + n) {
            size_t lo = (size_t)(p + n - e.p);
            keep.push_back({ e.p + lo, e.n - lo, ml_part(e.a, lo, e.n) });
        }
        c->pending.erase(c->pending.begin() + (long)i);
    }
    for (mlx_pending &e : keep) c->pending.push_back(e);
}

mx::array ml_in(mlx_impl *c, const float *p, mx::Shape shape) {
    size_t n = 1;
    for (int d : shape) n *= (size_t)d;
    std::vector<const mlx_pending *> hit;
    for (const mlx_pending &e : c->pending) {
        if (e.p == p && e.n == n) return mx::reshape(e.a, std::move(shape));
        if (ml_overlaps(e, p, n)) hit.push_back(&e);
    }
    if (hit.empty()) return mx::array(p, std::move(shape), mx::float32);
    std::sort(hit.begin(), hit.end(), [](const mlx_pending *a, const mlx_pending *b) { return a->p < b->p; });
    std::vector<mx::array> parts;
    const float *at = p, *end = p + n;
    for (const mlx_pending *e : hit) {
        const float *lo = std::max((const float *)e->p, p), *hi = std::min((const float *)(e->p + e->n), end);
        if (lo > at) parts.push_back(mx::array(at, { (int)(lo - at) }, mx::float32));
        parts.push_back(ml_part(e->a, (size_t)(lo - e->p), (size_t)(hi - e->p)));
        at = hi;
    }
    if (at < end) parts.push_back(mx::array(at, { (int)(end - at) }, mx::float32));
    return mx::reshape(parts.size() == 1 ? parts[0] : mx::concatenate(parts, 0), std::move(shape));
}

void ml_out(mlx_impl *c, float *dst, mx::array a, size_t n) {
    if (a.size() != n) throw std::runtime_error("result size mismatch");
    ml_trim(c, dst, n);
    c->pending.push_back({ dst, n, mx::reshape(mx::astype(a, mx::float32), { -1 }) });
}

/* Evaluates a now (counted) and copies its n floats to dst (host memory of our own). */
static void ml_now(mlx_impl *c, float *dst, mx::array a, size_t n) {
    a = mx::contiguous(mx::reshape(mx::astype(a, mx::float32), { -1 }));
    ml_eval(c, { a });
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
    ml_run(c, "write", [&] { ml_trim(c, dst, n); ml_kv_settle(c); });
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

/* The converted weight's file rows are not read again (MLX holds its own
 * copy): their pages leave the resident set, as the CPU backend's packed
 * rows do (cpu_drop_pages). Without it a whole-model MLX node kept every
 * page of the file beside the converted copy (Qwen3-0.6B Q8_0: 609.8 MiB
 * of file pages beside 771 MiB of arrays); a slice's were dropped by
 * model_drop_unused_pages already. Only a read-only file mapping: a later
 * read (a tied output's rows through get_rows) faults its pages back. */
static void ml_drop_host(const be_weight *bw) {
    if (!bw->file_mapped || !bw->data) return;
    uint64_t rows = (uint64_t)bw->ne[1] * (uint64_t)(bw->ne[2] > 0 ? bw->ne[2] : 1) * (uint64_t)(bw->ne[3] > 0 ? bw->ne[3] : 1);
    plat_map_drop(bw->data, (size_t)(rows * bw->row_bytes));
}

static int ml_load_weight(backend *be, be_weight *bw, char *err, size_t errlen) {
    mlx_impl *c = ml_of(be);
    if (bw->rows_only) return 0;   /* get_rows reads the host rows */
    int rc = 0;
    if (ml_run(c, "weight", [&] { bw->dev = ml_weight_make(c, bw); })) rc = -1;
    if (rc) snprintf(err, errlen, "MLX backend: cannot convert tensor %s: %s", bw->name ? bw->name : "?", c->err);
    else ml_drop_host(bw);
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
    if (ml_run(c, "get_rows", [&] { ml_trim(c, out, (size_t)n * w->ne[0]); ml_kv_settle(c); })) return -1;
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

/* ==== Mixture of experts ==== */

/* The router's logits are read on the host (the experts are chosen there
 * with the shared moe_select_experts): one evaluation per MoE layer. The
 * experts' products and their weighted sum stay lazy: each token's sum
 * starts at 0 and adds weight * product in ascending expert order, a
 * multiply then an add (no fused multiply-add), as the host loop it
 * replaces did (bit for bit). */
static int ml_moe_ffn(backend *be, const be_moe *mo, const float *x, int n_tok, float *y) {
    mlx_impl *c = ml_of(be);
    const int ne = mo->n_expert, k = mo->n_expert_used, dim = (int)mo->gate_inp->ne[0];
    if (ne > 256 || k > ne || k < 1 || n_tok < 1) return -1;
    int rc = 0;
    if (ml_run(c, "moe_ffn", [&] {
        mlx_weight *gi = ml_weight_of(c, mo->gate_inp), *wg = ml_weight_of(c, mo->gate_exps);
        mlx_weight *wu = ml_weight_of(c, mo->up_exps), *wd = ml_weight_of(c, mo->down_exps);
        mx::array X = ml_in(c, x, { n_tok, dim });
        std::vector<float> logits((size_t)n_tok * ne), selw((size_t)n_tok * k);
        std::vector<int32_t> sel((size_t)n_tok * k);
        ml_now(c, logits.data(), ml_matmul(gi, 0, X), logits.size());
        for (int t = 0; t < n_tok; t++) {
            moe_select_experts(&logits[(size_t)t * ne], ne, k, mo->norm_topk, &sel[(size_t)t * k], &selw[(size_t)t * k]);
            /* ascending expert order within the token: the summation order */
            for (int a = 1; a < k; a++)
                for (int b = a; b > 0 && sel[(size_t)t * k + b - 1] > sel[(size_t)t * k + b]; b--) {
                    std::swap(sel[(size_t)t * k + b - 1], sel[(size_t)t * k + b]);
                    std::swap(selw[(size_t)t * k + b - 1], selw[(size_t)t * k + b]);
                }
        }
        /* each used expert's rows; where (t, j)'s product lands among them */
        std::vector<std::vector<int32_t>> rows((size_t)ne);
        std::vector<int32_t> at((size_t)n_tok * k);
        for (int t = 0; t < n_tok; t++)
            for (int j = 0; j < k; j++) {
                std::vector<int32_t> &r = rows[(size_t)sel[(size_t)t * k + j]];
                at[(size_t)t * k + j] = (int32_t)r.size();
                r.push_back(t);
            }
        std::vector<mx::array> res;
        std::vector<int32_t> base((size_t)ne, 0);
        int32_t total = 0;
        for (int e = 0; e < ne; e++) {
            if (rows[(size_t)e].empty()) continue;
            int ni = (int)rows[(size_t)e].size();
            mx::array idx(rows[(size_t)e].data(), { ni }, mx::int32);
            mx::array Xe = mx::take(X, idx, 0);
            mx::array G = ml_matmul(wg, e, Xe, 1), U = ml_matmul(wu, e, Xe, 1);
            mx::array H = mx::multiply(mx::multiply(G, mx::sigmoid(G)), U);
            res.push_back(mx::astype(ml_matmul(wd, e, H, 1), mx::float32));
            base[(size_t)e] = total;
            total += ni;
        }
        mx::array R = res.size() == 1 ? res[0] : mx::concatenate(res, 0);   /* [total][dim] */
        mx::array Y = mx::zeros({ n_tok, dim }, mx::float32);
        std::vector<int32_t> gi_j((size_t)n_tok);
        std::vector<float> w_j((size_t)n_tok);
        for (int j = 0; j < k; j++) {
            for (int t = 0; t < n_tok; t++) {
                gi_j[(size_t)t] = base[(size_t)sel[(size_t)t * k + j]] + at[(size_t)t * k + j];
                w_j[(size_t)t] = selw[(size_t)t * k + j];
            }
            mx::array Rj = mx::take(R, mx::array(gi_j.data(), { n_tok }, mx::int32), 0);
            Y = mx::add(Y, mx::multiply(mx::array(w_j.data(), { n_tok, 1 }, mx::float32), Rj));
        }
        ml_out(c, y, Y, (size_t)n_tok * dim);
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
        if (st && atoi(st) > 0)
            fprintf(stderr, "MLX backend: %ld evaluations (%ld of them K/V rows to the host cache; rows encoded here: f16 %s, bf16 %s)\n",
                    c->n_eval, c->n_sync, c->enc_ok[0] < 0 ? "unused" : c->enc_ok[0] ? "yes" : "no",
                    c->enc_ok[1] < 0 ? "unused" : c->enc_ok[1] ? "yes" : "no");
        for (mlx_weight *w : c->weights) delete w;
        ml_kv_free_all(c);
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
    /* .load_done = */ NULL,
    /* .kv_to_host = */ ml_kv_to_host,
};

/* ==== Creation ==== */

extern "C" backend *backend_mlx_create(int n_threads, char *err, size_t errlen) {
    (void)n_threads;
    backend *be = (backend *)calloc(1, sizeof *be);
    mlx_impl *c = new (std::nothrow) mlx_impl();
    if (!be || !c) { free(be); delete c; snprintf(err, errlen, "out of memory"); return NULL; }
    be->ops = &ml_ops;
    be->impl = c;
    c->enc_ok[0] = c->enc_ok[1] = -1;
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
