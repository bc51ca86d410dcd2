/* backend_mlx_kv.cpp - the MLX backend's KV caches and attention.
 *
 * The host caches (kvcache.c) stay the record that everything outside the
 * backend reads: the prefill node's layer hook (streaming KV), the KV
 * store, prefix copies between slots, a prefill node's cached rows. Each
 * cache also gets MLX arrays per layer in the same head-major layout and
 * dtype ([kv_head][position][head_dim], F16 or BF16; a Q8_0 cache's rows
 * decoded to f32, exactly).
 *
 * F16 and BF16 caches: kv_store encodes the new rows in MLX, with the CPU
 * encoder's rounding (quant.c's f32_to_fp16, f32_to_bf16: round to
 * nearest even, NaN kept as the CPU keeps it; checked value by value on
 * the running device at the first use, ml_kv_enc_check), into the arrays
 * only: a decode step then evaluates once, for its logits, instead of
 * once per layer for the host rows. The host cache lags until a host
 * reader asks: kv_to_host (backend.h) evaluates the rows it lacks and
 * writes them there, bytes equal to the CPU backend's. forward.c calls it
 * before each layer hook, session_rows_read (model.c) before the other
 * readers. Q8_0 caches (and an encoder that failed its check) keep the
 * host path: kv_store writes the host cache with the CPU's own encoder,
 * one evaluation per layer, and the arrays catch up from the host rows.
 *
 * Rows the host got from elsewhere (a prefill node's frames, a prefix
 * copy, the KV store) reach the arrays from the host before attention
 * reads them; kv_forget tells the backend which of its rows went stale.
 */
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "backend/mlx/mlx_internal.h"

extern "C" {
#include "base/log.h"
#include "engine/gguf.h"
#include "engine/quant.h"
}

/* First capacity of a cache's arrays in positions; doubled as it fills
 * (up to the cache's context), so short sequences hold little. */
#define MLX_KV_FIRST 256

/* ==== Encoding rows as the CPU does ==== */

/* The cache dtype dt's bits of f32 x, as quant.c's f32_to_fp16 /
 * f32_to_bf16 give them: MLX's own conversion (round to nearest even) for
 * numbers, and the CPU's NaN (MLX writes one NaN of its own). */
static mx::array ml_kv_encode(const mx::array &x, mx::Dtype dt) {
    auto U = [](uint32_t v) { return mx::array(v, mx::uint32); };
    mx::array u = mx::view(x, mx::uint32);
    mx::array nan = dt == mx::float16
                        ? mx::bitwise_or(mx::bitwise_or(mx::bitwise_and(mx::right_shift(u, U(16)), U(0x8000)), U(0x7e00)),
                                         mx::bitwise_and(mx::right_shift(u, U(13)), U(0x3ff)))
                        : mx::bitwise_or(mx::right_shift(u, U(16)), U(0x40));
    mx::array h = mx::view(mx::astype(x, dt), mx::uint16);
    return mx::view(mx::where(mx::isnan(x), mx::astype(nan, mx::uint16), h), dt);
}

/* Every f32 whose top 16 bits are any pattern and whose low 16 bits are
 * one of these: the rounding bits of both types (bf16: bit 15 below the
 * kept bit 16; f16: bits 12-15 below bit 13, and the subnormals' bits
 * higher up) as ties, just below and just above, and NaN payloads. */
static const uint16_t ml_enc_low[] = { 0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x2000, 0x2fff, 0x3000, 0x3001,
                                       0x5000, 0x7000, 0x7fff, 0x8000, 0x8001, 0x9000, 0xb000, 0xd000, 0xefff,
                                       0xf000, 0xf001, 0xffff };

/* 1 if ml_kv_encode gives the CPU encoder's bits for every probe value on
 * this device (checked once per type, caller holds the lock), else 0: that
 * type keeps the host path. */
static int ml_kv_enc_check(mlx_impl *c, uint32_t type) {
    int &ok = c->enc_ok[type == GGML_TYPE_BF16];
    if (ok >= 0) return ok;
    const size_t nl = sizeof ml_enc_low / sizeof ml_enc_low[0];
    std::vector<uint32_t> u;
    u.reserve(65536 * nl);
    for (uint32_t hi = 0; hi < 65536; hi++)
        for (size_t i = 0; i < nl; i++) u.push_back(hi << 16 | ml_enc_low[i]);
    mx::array x = mx::view(mx::array(u.data(), { (int)u.size() }, mx::uint32), mx::float32);
    mx::array h = mx::contiguous(mx::view(ml_kv_encode(x, type == GGML_TYPE_BF16 ? mx::bfloat16 : mx::float16), mx::uint16));
    mx::eval(h);   /* once per type, at the first cache: not counted */
    const uint16_t *got = h.data<uint16_t>();
    ok = 1;
    for (size_t i = 0; i < u.size() && ok; i++) {
        float f;
        memcpy(&f, &u[i], sizeof f);
        uint16_t want = type == GGML_TYPE_BF16 ? f32_to_bf16(f) : f32_to_fp16(f);
        if (got[i] != want) {
            ok = 0;
            log_info(NULL, "MLX backend: %s rows encoded on this device differ from the CPU's (f32 %08x: %04x, CPU %04x): "
                     "%s caches keep the host path", gguf_type_name(type), u[i], got[i], want, gguf_type_name(type));
        }
    }
    return ok;
}

/* ==== Arrays per cache ==== */

static mlx_kv *ml_kv_find(mlx_impl *c, const kvcache *kv) {
    for (mlx_kv *m : c->kvs)
        if (m->kv == kv) return m;
    return NULL;
}

/* The arrays of kv, made at its first use (caller holds the lock). */
static mlx_kv *ml_kv_get(mlx_impl *c, kvcache *kv) {
    mlx_kv *m = ml_kv_find(c, kv);
    if (m) return m;
    uint32_t t = kv_dtype(kv);
    int enc = (t == GGML_TYPE_F16 || t == GGML_TYPE_BF16) && ml_kv_enc_check(c, t);
    m = new mlx_kv();
    m->kv = kv; m->n_layer = kv_n_layer(kv); m->n_ctx = kv_n_ctx(kv); m->n_head = kv_n_head(kv);
    m->head_dim = kv_head_dim(kv);
    m->dt = t == GGML_TYPE_F16 ? mx::float16 : t == GGML_TYPE_BF16 ? mx::bfloat16 : mx::float32;
    m->enc = enc;
    m->cap = 0;
    m->valid.assign((size_t)m->n_layer, 0);
    m->host.assign((size_t)m->n_layer, 0);
    try { c->kvs.push_back(m); } catch (...) { delete m; throw; }
    return m;
}

/* A [n_head][cap][head_dim] array of zeros holding old's first keep
 * positions (none when keep is 0: old may then be NULL). */
static mx::array ml_kv_grown(const mlx_kv *m, const mx::array *old, int keep, int cap) {
    mx::array z = mx::zeros({ m->n_head, cap, m->head_dim }, m->dt);
    if (!keep) return z;
    mx::Shape lo = { 0, 0, 0 }, hi = { m->n_head, keep, m->head_dim };
    return mx::slice_update(z, mx::slice(*old, lo, hi), lo, hi);
}

/* Room for n positions in every layer's arrays (grown by doubling). */
static void ml_kv_room(mlx_kv *m, int n) {
    if (n <= m->cap) return;
    int cap = m->cap ? m->cap : MLX_KV_FIRST;
    while (cap < n) cap *= 2;
    if (cap > m->n_ctx) cap = m->n_ctx;
    for (size_t l = 0; l < (size_t)m->n_layer; l++) {
        int keep = m->cap ? m->valid[l] : 0;   /* arrays made before the first room hold nothing */
        if (l < m->k.size()) {
            m->k[l] = ml_kv_grown(m, &m->k[l], keep, cap);
            m->v[l] = ml_kv_grown(m, &m->v[l], keep, cap);
        } else {
            m->k.push_back(ml_kv_grown(m, NULL, 0, cap));
            m->v.push_back(ml_kv_grown(m, NULL, 0, cap));
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

/* Makes the arrays' rows [0, pos) of layer current: rows [valid, pos)
 * come from the host cache (which holds them: they are past the rows only
 * the arrays hold). */
static void ml_kv_catch_up(mlx_kv *m, int layer, int pos) {
    const size_t l = (size_t)layer;
    int from = m->valid[l];
    if (from >= pos) return;
    ml_kv_room(m, pos);
    mx::Shape lo = { 0, from, 0 }, hi = { m->n_head, pos, m->head_dim };
    m->k[l] = mx::slice_update(m->k[l], ml_kv_host_rows(m, layer, from, pos, 0), lo, hi);
    m->v[l] = mx::slice_update(m->v[l], ml_kv_host_rows(m, layer, from, pos, 1), lo, hi);
    if (m->host[l] == from) m->host[l] = pos;
    m->valid[l] = pos;   /* evaluated with the attention that reads them */
}

/* ==== Storing rows ==== */

/* Sequence sq's new rows [n][kv_dim] (f32, k and v at off) into layer's
 * arrays, encoded as the CPU would; the host cache is left behind. */
static void ml_kv_store_enc(mlx_impl *c, mlx_kv *m, const be_seq *sq, int layer, const float *k, const float *v) {
    const size_t l = (size_t)layer;
    const int p0 = sq->pos0, n = sq->n, nh = m->n_head, hd = m->head_dim;
    if (m->valid[l] > p0) m->valid[l] = p0;   /* rows from p0 on are replaced */
    if (m->host[l] > m->valid[l]) m->host[l] = m->valid[l];
    ml_kv_catch_up(m, layer, p0);
    ml_kv_room(m, p0 + n);
    mx::Shape lo = { 0, p0, 0 }, hi = { nh, p0 + n, hd };
    mx::array K = mx::transpose(ml_kv_encode(ml_in(c, k, { n, nh, hd }), m->dt), { 1, 0, 2 });
    mx::array V = mx::transpose(ml_kv_encode(ml_in(c, v, { n, nh, hd }), m->dt), { 1, 0, 2 });
    m->k[l] = mx::slice_update(m->k[l], K, lo, hi);
    m->v[l] = mx::slice_update(m->v[l], V, lo, hi);
    m->valid[l] = p0 + n;
}

void ml_kv_store(backend *be, const be_batch *b, int layer, const float *k, const float *v) {
    mlx_impl *c = ml_of(be);
    ml_run(c, "kv_store", [&] {
        std::vector<ml_range> rows;   /* the host path's rows: one evaluation for all */
        for (int s = 0; s < b->n_seq; s++) {
            const be_seq *sq = &b->seq[s];
            size_t off = (size_t)sq->t0 * kv_dim(sq->kv), n = (size_t)sq->n * kv_dim(sq->kv);
            mlx_kv *m = ml_kv_get(c, sq->kv);
            if (m->enc) {
                ml_kv_store_enc(c, m, sq, layer, k + off, v + off);
                continue;
            }
            rows.push_back({ k + off, n });
            rows.push_back({ v + off, n });
        }
        if (rows.empty()) return;
        ml_flush_ranges(c, rows);
        for (int s = 0; s < b->n_seq; s++) {
            const be_seq *sq = &b->seq[s];
            mlx_kv *m = ml_kv_get(c, sq->kv);
            if (m->enc) continue;
            size_t off = (size_t)sq->t0 * kv_dim(sq->kv);
            kv_store_f32(sq->kv, layer, sq->pos0, sq->n, k + off, v + off);
            if (m->valid[(size_t)layer] > sq->pos0) m->valid[(size_t)layer] = sq->pos0;
            m->host[(size_t)layer] = m->valid[(size_t)layer];
        }
    });
}

/* ==== The host cache ==== */

void ml_kv_to_host(backend *be, kvcache *kv, int layer, int end) {
    mlx_impl *c = ml_of(be);
    ml_run(c, "kv_to_host", [&] {
        mlx_kv *m = ml_kv_find(c, kv);
        if (!m || !m->enc) return;
        std::vector<mx::array> ev;
        std::vector<int> ls, his;
        for (int l = layer < 0 ? 0 : layer; l < (layer < 0 ? m->n_layer : layer + 1) && l < m->n_layer; l++) {
            int lo = m->host[(size_t)l], hi = m->valid[(size_t)l] < end ? m->valid[(size_t)l] : end;
            if (lo >= hi) continue;
            /* position-major [n][kv_head][head_dim]: the span layout kv_write_span takes */
            mx::Shape a = { 0, lo, 0 }, z = { m->n_head, hi, m->head_dim };
            ev.push_back(mx::view(mx::contiguous(mx::transpose(mx::slice(m->k[(size_t)l], a, z), { 1, 0, 2 })), mx::uint16));
            ev.push_back(mx::view(mx::contiguous(mx::transpose(mx::slice(m->v[(size_t)l], a, z), { 1, 0, 2 })), mx::uint16));
            ls.push_back(l);
            his.push_back(hi);
        }
        if (ev.empty()) return;
        ml_eval(c, ev);
        c->n_sync++;
        for (size_t i = 0; i < ls.size(); i++) {
            const size_t l = (size_t)ls[i];
            char err[160];
            if (kv_write_span(kv, ls[i], m->host[l], his[i] - m->host[l], ev[2 * i].data<uint16_t>(),
                              ev[2 * i + 1].data<uint16_t>(), err, sizeof err))
                throw std::runtime_error(err);
            m->host[l] = his[i];
        }
    });
}

void ml_kv_forget(backend *be, const kvcache *kv, int pos) {
    mlx_impl *c = ml_of(be);
    std::lock_guard<std::mutex> lk(g_mlx_mu);
    for (size_t i = 0; i < c->kvs.size(); i++) {
        mlx_kv *m = c->kvs[i];
        if (m->kv != kv) continue;
        if (pos < 0) {
            delete m;
            c->kvs.erase(c->kvs.begin() + (long)i);
        } else {
            for (int l = 0; l < m->n_layer; l++) {
                if (m->valid[(size_t)l] > pos) m->valid[(size_t)l] = pos;
                if (m->host[(size_t)l] > m->valid[(size_t)l]) m->host[(size_t)l] = m->valid[(size_t)l];
            }
        }
        return;
    }
}

void ml_kv_settle(mlx_impl *c) {
    std::vector<mx::array> ev;
    for (mlx_kv *m : c->kvs)
        for (size_t l = 0; l < m->k.size(); l++) {
            if (m->k[l].status() == mx::array::Status::unscheduled) ev.push_back(m->k[l]);
            if (m->v[l].status() == mx::array::Status::unscheduled) ev.push_back(m->v[l]);
        }
    if (!ev.empty()) ml_eval(c, ev);
}

void ml_kv_free_all(mlx_impl *c) {
    for (mlx_kv *m : c->kvs) delete m;
    c->kvs.clear();
}

/* ==== Attention ==== */

int ml_attention(backend *be, const float *q, const be_batch *b, int layer, int n_head, int n_head_kv, int head_dim,
                 float scale, float *out) {
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
