/* backend.h - the one internal interface between model code and kernels.
 *
 * The forward pass (forward.c) is written only against these operations. The
 * CPU backend (backend_cpu.c) implements them with the kernels of quant.c and
 * a thread pool; the CUDA backend (backend/cuda/) implements the same table
 * on a GPU, and a Metal backend (decode) would too. Activation buffers come
 * from the backend's own allocator (device memory on a GPU), and the model
 * code never dereferences them: it reads results back with be_read. Weights
 * are described by be_weight; a backend may keep its own copy in `dev` after
 * upload.
 */
#ifndef TANDEM_BACKEND_H
#define TANDEM_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "engine/kvcache.h"

typedef struct {
    const char *name;       /* GGUF tensor name, for messages */
    uint32_t type;          /* enum ggml_type */
    int64_t ne[4];          /* ne[0] = row length; ne[1] rows; ne[2] experts */
    size_t row_bytes;       /* bytes of one row of ne[0] elements */
    const void *data;       /* host copy (the mmap) */
    void *dev;              /* backend-owned copy, if any (CPU: rows packed for its kernels) */
    int rows_only;          /* read only by get_rows (the embedding table): no copy for mul_mat */
    int file_mapped;        /* data lies in a read-only mapping of the model file: pages this process
                             * drops are read from the file again (never lost) */
} be_weight;

enum rope_mode { ROPE_NORM = 0, ROPE_NEOX = 2 };   /* ggml's numbering */

typedef struct {
    int mode;               /* ROPE_NORM: pairs (2i, 2i+1); ROPE_NEOX: (i, i + n_rot/2) */
    int n_rot;              /* rotated dims per head (<= head_dim) */
    float freq_base;
    float freq_scale;       /* 1 / linear scaling factor */
    const float *freq_factors;  /* per pair divisor (Llama 3.x rope_freqs), or NULL */
} rope_cfg;

/* One MoE feed-forward block (qwen3moe). */
typedef struct {
    const be_weight *gate_inp;   /* router [n_embd] x n_expert rows, usually F32 */
    const be_weight *gate_exps;  /* [n_embd] x n_ff_exp rows x n_expert */
    const be_weight *up_exps;
    const be_weight *down_exps;  /* [n_ff_exp] x n_embd rows x n_expert */
    int n_expert, n_expert_used;
    int norm_topk;               /* renormalise the chosen weights to sum to 1 */
} be_moe;

/* ==== Batches ====
 * One forward pass carries tokens of several sequences (continuous batching).
 * Tokens of one sequence are contiguous in the batch and in position order;
 * each sequence has its own KV cache. Row-wise ops (matrix products, norms,
 * SwiGLU) ignore the mapping: every token is a row, so the weights are read
 * once for all of them. RoPE needs each token's position; the KV store and
 * attention need each token's sequence. Shapes: activations are
 * [n_tok][dim] row-major, token t of sequence s at row seq[s].t0 + i. */
typedef struct {
    kvcache *kv;            /* this sequence's cache */
    int t0, n;              /* its tokens: batch rows [t0, t0 + n) */
    int pos0;               /* position of row t0; row t0 + i is at pos0 + i */
} be_seq;

typedef struct {
    int n_tok;              /* rows in the batch */
    const int32_t *pos;     /* [n_tok] position of each row (= its sequence's pos0 + i) */
    int n_seq;
    const be_seq *seq;      /* [n_seq], in row order, covering [0, n_tok) */
} be_batch;

typedef struct backend backend;

typedef struct {
    const char *name;
    void (*destroy)(backend *be);
    float *(*alloc)(backend *be, size_t n_floats);
    void (*release)(backend *be, float *buf);
    void (*read)(backend *be, const float *src, float *host_dst, size_t n);
    void (*write)(backend *be, float *dst, const float *host_src, size_t n);

    /* out[i] = dequantised row ids[i] of w (embedding lookup) */
    int (*get_rows)(backend *be, const be_weight *w, const int32_t *ids, int n, float *out);
    /* y[t] = x[t] / rms(x[t]) * w   (w may be NULL), n_rows rows of dim */
    void (*rms_norm)(backend *be, const float *x, const be_weight *w, float *y, int n_rows, int dim, float eps);
    /* y[t][r] = sum_c W_e[r][c] x[t][c] for t < n_tok (expert e of a 3-D weight, else 0) */
    void (*mul_mat)(backend *be, const be_weight *w, int expert, const float *x, int n_tok, float *y);
    /* x[t][c] += b[c] */
    void (*add_bias)(backend *be, float *x, const be_weight *b, int n_tok);
    /* rotate n_head heads of head_dim for each row t, at position pos[t] */
    void (*rope)(backend *be, float *x, int n_tok, int n_head, int head_dim, const int32_t *pos, const rope_cfg *rc);
    /* causal GQA attention: the query rows of each sequence of the batch at
     * positions pos0.. over that sequence's cache rows [0, pos0 + n) */
    int (*attention)(backend *be, const float *q, const be_batch *b, int layer,
                      int n_head, int n_head_kv, int head_dim, float scale, float *out);
    /* store each sequence's K and V rows ([n_tok][kv_dim] f32) into its cache at pos0.. */
    void (*kv_store)(backend *be, const be_batch *b, int layer, const float *k, const float *v);
    /* y = silu(g) * u, n elements */
    void (*swiglu)(backend *be, const float *g, const float *u, float *y, size_t n);
    /* x += y, n elements */
    void (*add)(backend *be, float *x, const float *y, size_t n);
    /* y[t] = MoE FFN of x[t] */
    int (*moe_ffn)(backend *be, const be_moe *m, const float *x, int n_tok, float *y);

    /* ==== Optional: NULL where a backend has no use for them ==== */
    /* Copies w to the backend once, at load (sets w->dev): device memory, or
     * the CPU's packed rows (it never fails for want of them); 0 or -1 with a message. */
    int (*load_weight)(backend *be, be_weight *w, char *err, size_t errlen);
    /* A backend that keeps the caches on a device: after this returns, the
     * host caches hold layer `layer`'s K/V rows of every sequence of b (the
     * layer hook streams them from there). Called once per layer and pass. */
    void (*sync_kv)(backend *be, const be_batch *b, int layer);
    /* The host rows of kv from position pos on may change behind the
     * backend's back (truncation, rows received from a prefill node);
     * pos < 0: kv is about to be freed. */
    void (*kv_forget)(backend *be, const kvcache *kv, int pos);
    /* mul_mat for n (<= 4) 2-D weights of the same input x: y[i] = W_i x.
     * One job instead of n (a decode step's Q, K and V; gate and up): the
     * threads wait once, and the input is converted once. */
    void (*mul_mat_n)(backend *be, const be_weight *const *w, int n, const float *x, int n_tok, float *const *y);
    /* A hint: the product after the next mul_mat / mul_mat_n reads these n
     * (<= 4) 2-D weights, in this order. A backend whose threads idle at the
     * end of a product and between products may start fetching them then
     * (the CPU's decode steps). The next product uses the hint up. */
    void (*warm_next)(backend *be, const be_weight *const *w, int n);
    /* Rows of one forward pass where the caller names none (0: 512, the
     * CPU's, whose products gain nothing from more). */
    int pass_rows;
    /* Optional (NULL where nothing is to do): every weight is loaded; what
     * loading reserved and did not fill may go back (the CPU: the unfilled
     * tail of its last packed-weights arena's last huge page). */
    void (*load_done)(backend *be);
    /* Optional (NULL where kv_store writes the host caches): a backend that
     * stores new K/V rows on its side only (MLX) writes kv's rows of layer
     * `layer` (every layer: layer < 0) below position `end` into the host
     * cache, bytes equal to the CPU backend's. Called before a host reader
     * reads them: the layer hook (forward.c) and session_rows_read. */
    void (*kv_to_host)(backend *be, kvcache *kv, int layer, int end);
} backend_ops;

struct backend {
    const backend_ops *ops;
    void *impl;
};

/* CPU backend with n_threads workers (see threadpool.h). */
backend *backend_cpu_create(int n_threads);
int backend_cpu_threads(const backend *be);
/* Scratch a MoE block's group of experts may fill (0: the default, 64
 * MiB): the used experts run in groups of whole experts within it, a smaller
 * cap giving more groups and the same results (the tests split them so). */
void backend_cpu_set_moe_scratch(backend *be, size_t bytes);

/* Backend on CUDA device `device` (backend/cuda/backend_cuda.cu, built with
 * make CUDA=1; undefined otherwise, so only TANDEM_CUDA code calls it). NULL
 * with a message naming what is missing (driver, device, cuBLAS) when it
 * cannot start. n_threads is kept for host-side work (none yet). */
backend *backend_cuda_create(int device, int n_threads, char *err, size_t errlen);

/* Backend on Apple's MLX (backend/mlx/backend_mlx.cpp, linked by make MLX=1
 * mlx into build-mlx/; every other build links backend_mlx_absent.c's
 * versions, which say so): Metal on a Mac, MLX's CPU backend on Linux.
 * NULL with a message starting "MLX backend: " when MLX cannot start, or
 * naming `make MLX=1 mlx` in a build without it. backend_mlx_linked(): 1
 * where the MLX object is linked, else 0 (the choice is made at run time,
 * so the library is compiled once for both builds). */
backend *backend_mlx_create(int n_threads, char *err, size_t errlen);
int backend_mlx_linked(void);

/* ==== Shared helpers (plain C; every backend uses the same routing math) ==== */
/* Softmax over n router logits, pick the top k (ties -> lower index), and
 * renormalise their weights if norm. ids/w get k entries, best first. */
void moe_select_experts(const float *logits, int n, int k, int norm, int32_t *ids, float *w);

#endif
