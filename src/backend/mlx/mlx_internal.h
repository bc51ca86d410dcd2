/* mlx_internal.h - state and helpers shared by the MLX backend's files
 * (C++ against MLX's C++ API; nothing here is visible to the C code):
 * backend_mlx.cpp (host <-> arrays, weights, row-wise ops, MoE, the table)
 * and backend_mlx_kv.cpp (KV caches, their host sync, attention).
 */
#ifndef TANDEM_MLX_INTERNAL_H
#define TANDEM_MLX_INTERNAL_H

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <vector>

#include <mlx/mlx.h>   /* MLX_DIR/include: MLX's C++ API */

extern "C" {
#include "engine/backend.h"
#include "engine/kvcache.h"
}

namespace mx = mlx::core;

/* ==== State ==== */

typedef struct mlx_weight {
    const void *host;          /* the be_weight's data (identity, as CUDA's cu_weight_find) */
    uint32_t type;
    int64_t ne0, ne1, ne2;
    int bits;                  /* 0: a float array w; else affine groups (wq, scales, biases) */
    mx::array w, wq, scales, biases;
    mlx_weight() : w(0.0f), wq(0.0f), scales(0.0f), biases(0.0f) {}
} mlx_weight;

/* One cache's arrays. Per layer, the arrays hold the current rows
 * [0, valid); the host cache holds them too below `host` (<= valid). Rows
 * [host, valid) exist only here until a host reader asks (kv_to_host):
 * with `enc`, kv_store encodes the rows here, exactly as the CPU's encoder
 * would, and leaves the host cache alone; without it (a Q8_0 cache, or an
 * encoder that failed its check) kv_store writes the host cache and host
 * stays equal to valid. */
typedef struct mlx_kv {
    kvcache *kv;
    int n_layer, n_ctx, n_head, head_dim, cap;
    int enc;                       /* rows encoded here (F16/BF16 caches) */
    mx::Dtype dt;
    std::vector<mx::array> k, v;   /* per layer [n_head][cap][head_dim] */
    std::vector<int> valid, host;
    mlx_kv() : dt(mx::float16) {}
} mlx_kv;

/* A result not yet on the host: floats [p, p + n) of a buffer are a's
 * (flat float32). */
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
    long n_sync;                   /* of them, kv_to_host's */
    int enc_ok[2];                 /* F16, BF16: -1 unchecked, 0 the host path, 1 encoded here */
    /* The one stream every entry point computes on, whichever thread calls
     * it (see ml_run). */
    std::optional<mx::Stream> stream;
    int failed;
    char err[256];
} mlx_impl;

/* MLX's graph and streams are process-wide: one op at a time. */
extern std::mutex g_mlx_mu;

static inline mlx_impl *ml_of(backend *be) { return (mlx_impl *)be->impl; }

/* ==== backend_mlx.cpp ==== */
void ml_fail(mlx_impl *c, const char *what, const char *msg);
/* Runs body under the lock on the backend's stream, MLX's exceptions
 * caught: 0, or -1 after ml_fail. */
int ml_run(mlx_impl *c, const char *what, std::function<void()> body);
/* The floats [p, p + prod(shape)) as an array (lazy results where pending,
 * host bytes elsewhere); dst's n floats become a (lazily). */
mx::array ml_in(mlx_impl *c, const float *p, mx::Shape shape);
void ml_out(mlx_impl *c, float *dst, mx::array a, size_t n);
/* One evaluation of the arrays (counted). */
void ml_eval(mlx_impl *c, const std::vector<mx::array> &ev);
typedef struct { const float *p; size_t n; } ml_range;
/* Evaluates the pending results overlapping the ranges into the host. */
void ml_flush_ranges(mlx_impl *c, const std::vector<ml_range> &rs);

/* ==== backend_mlx_kv.cpp ==== (callers hold the lock where marked) */
void ml_kv_store(backend *be, const be_batch *b, int layer, const float *k, const float *v);
void ml_kv_forget(backend *be, const kvcache *kv, int pos);
void ml_kv_to_host(backend *be, kvcache *kv, int layer, int end);
int ml_attention(backend *be, const float *q, const be_batch *b, int layer, int n_head, int n_head_kv, int head_dim,
                 float scale, float *out);
/* Evaluates the cache arrays a pass left lazy (a pass that read nothing
 * back): a pass's graph never reaches into the next. Lock held. */
void ml_kv_settle(mlx_impl *c);
void ml_kv_free_all(mlx_impl *c);   /* lock held */

#endif
