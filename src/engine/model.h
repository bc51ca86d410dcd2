/* model.h - a loaded GGUF model (weights, hyper-parameters, tokenizer) and
 * the sessions (one KV cache each) that run it.
 *
 * Supported architectures: llama (Llama 2/3, TinyStories), qwen2 (q/k/v
 * biases), qwen3 (q/k RMS norm per head), qwen3moe (routed experts).
 */
#ifndef TANDEM_MODEL_H
#define TANDEM_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "engine/backend.h"
#include "engine/gguf.h"
#include "engine/kvcache.h"
#include "engine/tokenizer.h"

enum arch_id { ARCH_LLAMA = 0, ARCH_QWEN2, ARCH_QWEN3, ARCH_QWEN3MOE };

typedef struct {
    enum arch_id arch;
    const char *arch_name;
    int n_vocab, n_ctx_train, n_embd, n_layer, n_head, n_head_kv;
    int head_dim_k, head_dim_v;      /* attention.key_length / value_length */
    int n_ff;                        /* dense FFN width */
    int n_expert, n_expert_used, n_ff_exp, expert_norm;
    float rms_eps;
    rope_cfg rope;
} model_hparams;

/* Weights of one transformer block (shape comments in ggml order: [cols, rows]). */
typedef struct {
    be_weight attn_norm;     /* [n_embd] */
    be_weight wq;            /* [n_embd, n_head * hd_k] */
    be_weight wk;            /* [n_embd, n_head_kv * hd_k] */
    be_weight wv;            /* [n_embd, n_head_kv * hd_v] */
    be_weight wo;            /* [n_head * hd_v, n_embd] */
    be_weight bq, bk, bv;    /* qwen2: [n_head * hd_k], [kv dims] */
    be_weight q_norm, k_norm;/* qwen3: [hd_k] */
    be_weight ffn_norm;      /* [n_embd] */
    be_weight ffn_gate;      /* [n_embd, n_ff] */
    be_weight ffn_up;        /* [n_embd, n_ff] */
    be_weight ffn_down;      /* [n_ff, n_embd] */
    be_weight gate_inp;      /* moe: [n_embd, n_expert] */
    be_weight gate_exps;     /* moe: [n_embd, n_ff_exp, n_expert] */
    be_weight up_exps;       /* moe: [n_embd, n_ff_exp, n_expert] */
    be_weight down_exps;     /* moe: [n_ff_exp, n_embd, n_expert] */
    be_moe moe;
} model_layer;

typedef struct model model;
typedef struct session session;

typedef struct {
    int n_threads;           /* CPU threads (default 1) */
    int n_batch;             /* rows per pass (0: the backend's, 512 on the CPU, 4096 with CUDA) */
    const char *backend;     /* "cpu" (default when NULL), "cuda" (CUDA=1) or "mlx" (MLX=1) */
    int device;              /* CUDA device ordinal (default 0) */
    /* Called while the weights are copied to a backend that keeps its own
     * (CUDA; the CPU when its kernel set packs them): `done` of `total`
     * layers; NULL for none. */
    void (*on_load)(void *ud, int done, int total);
    void *on_load_ud;
    /* 1: do not take the fingerprint (fingerprint.h) during the load, for a
     * command that never joins a node link (bench, run): a backend that keeps
     * its own copy of the weights hashes them while they are read anyway
     * (every byte of the file: about a CPU-second for 3 GB), and a later
     * model_fingerprint reads the file again. 0 (default): hash at load. */
    int fingerprint_later;
    /* A slice of the layers (layer-split prefill, issue 41): layer_hi > 0
     * loads only blocks [layer_lo, layer_hi) (end exclusive), plus the token
     * embedding when layer_lo is 0 and never the output head (the decode
     * node, which holds the whole model, computes the logits). Such a model
     * evaluates only through model_eval_slice. 0, 0: the whole model. The
     * fingerprint stays the whole file's (every node of a chain agrees).
     * ffn_first: block layer_lo's attention belongs to the slice before, this
     * one computes its feed-forward only; attn_last: block layer_hi - 1's
     * feed-forward belongs to the slice after (bounds "L.5", wire_act.h). */
    int layer_lo, layer_hi;
    int ffn_first, attn_last;
} model_opts;

/* Every error message starts with "PATH: " (printed once by the callers). */
int model_load(model **out, const char *path, const model_opts *o, char *err, size_t errlen);
void model_free(model *m);
/* The hyper-parameters of the model at path, with model_load's checks of
 * them (and of the vocabulary's count), without loading a weight or the
 * tokenizer: what a planner needs of a file it will not run (chain_plan.h). */
int model_peek_hparams(const char *path, model_hparams *out, char *err, size_t errlen);
const model_hparams *model_get_hparams(const model *m);
/* A slice's bounds in half blocks (wire_act.h: 2 * layer_lo + ffn_first,
 * 2 * layer_hi - attn_last); 0, 2 * n_layer for the whole model. */
void model_get_halves(const model *m, int *lo, int *hi);
const tokenizer *model_get_tokenizer(const model *m);   /* NULL for a slice (model_opts.layer_hi): it never tokenizes */
const gguf_file *model_get_gguf(const model *m);
backend *model_get_backend(model *m);
int model_get_n_batch(const model *m);       /* rows per forward pass */
/* Bytes of weights read per decoded token (all tensors; for MoE only the used experts). */
uint64_t model_weight_bytes_per_token(const model *m);
uint64_t model_file_bytes(const model *m);
const char *model_type_summary(const model *m);   /* e.g. "Q8_0" / "Q4_K_M"-ish: most common weight type */

/* ==== Sessions ==== (freed before their model) */
int session_new(session **out, model *m, int n_ctx, uint32_t kv_dtype, char *err, size_t errlen);
void session_free(session *s);
kvcache *session_kv(session *s);
model *session_model(session *s);
int session_pos(const session *s);          /* tokens in the cache */
void session_reset(session *s, int pos);    /* forget positions >= pos */
/* The host cache's rows from pos on were written behind the backend's back
 * (kv_copy_prefix from another slot): a backend that mirrors the cache
 * (MLX's arrays) drops its copies of them. The rows and kv_used stay. */
void session_rows_written(session *s, int pos);
/* The host cache's rows [0, session_pos) are about to be read outside a
 * forward pass (a prefix copy's source, kvstore_put, a prefill node's
 * cached rows): a backend that stores rows on its side only (MLX) writes
 * the ones the host lacks there first. Forward passes' layer hooks need
 * nothing: forward.c asks the backend before each. */
void session_rows_read(session *s);

/* Called after layer `layer` has written K/V for positions [pos0, pos0+n);
 * the host cache holds those rows then. */
typedef int (*layer_hook)(void *ud, int layer, int pos0, int n);

/* ==== Evaluation ====
 * One call evaluates tokens of one or more sessions in shared forward
 * passes (continuous batching): each item appends n tokens at its session's
 * current position. The weights are read once per pass for every token of
 * every item; attention runs per session over its own cache. Passes hold at
 * most n_batch tokens; an item longer than what is left of a pass continues
 * in the next one. Results do not depend on what else is in the batch.
 * Calls on one model are serialised (the activation buffers are shared). */
typedef struct {
    session *s;
    const int32_t *ids;
    int n;
    float *logits;           /* if non-NULL: n_vocab floats for each of the item's last
                              * n_logits tokens, in token order */
    int n_logits;            /* rows of logits wanted (0: 1); at most n. Speculative
                              * verification wants every row: the last accepted
                              * token's and each draft's */
    layer_hook hook;         /* optional: after each layer of each pass that holds
                              * tokens of this item (the handoff streams from it);
                              * non-zero aborts the whole evaluation */
    void *hook_ud;
} model_batch_item;

/* 0 on success; -1 with a message, each session keeping the positions
 * completed before the failure. Items must name distinct sessions. */
int model_eval_batch(model *m, model_batch_item *items, int n_items, char *err, size_t errlen);

/* The layers this model holds: [*lo, *hi); returns 1 for a slice
 * (model_opts.layer_hi), 0 for the whole model (lo 0, hi n_layer). */
int model_get_layers(const model *m, int *lo, int *hi);

/* A slice's part of the forward pass for n (<= model_get_n_batch) positions
 * of session s, appended at its current position: the input is ids (a slice
 * starting at layer 0) or x_in, the hidden states entering layer lo
 * ([n][n_embd] f32); x_out, if non-NULL, receives the hidden states leaving
 * layer hi - 1. Works on the whole model too (then x_in must be NULL). */
int model_eval_slice(model *m, session *s, const int32_t *ids, const float *x_in, int n, float *x_out,
                     layer_hook hook, void *hook_ud, char *err, size_t errlen);

/* The single-sequence case: n tokens of one session. */
int model_eval(model *m, session *s, const int32_t *ids, int n, float *logits,
               layer_hook hook, void *hook_ud, char *err, size_t errlen);

#endif
