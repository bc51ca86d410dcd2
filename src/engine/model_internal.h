/* model_internal.h - model and session internals shared by model.c and
 * forward.c only. */
#ifndef TANDEM_MODEL_INTERNAL_H
#define TANDEM_MODEL_INTERNAL_H

#include <pthread.h>

#include "engine/model.h"

/* Activation buffers for one forward pass of up to n_batch rows (backend
 * memory), shared by every session of the model and allocated at the first
 * evaluation. */
typedef struct {
    int cap;                 /* rows (tokens) */
    float *x;                /* [cap][n_embd] residual stream */
    float *h;                /* [cap][n_embd] normed input */
    float *q;                /* [cap][n_head * hd] */
    float *k, *v;            /* [cap][n_head_kv * hd] */
    float *att;              /* [cap][n_head * hd] */
    float *o;                /* [cap][n_embd] */
    float *g, *u;            /* [cap][n_ff] */
    float *logits;           /* [logits_cap][n_vocab] */
    int logits_cap;          /* rows of logits allocated */
    int32_t *pos;            /* [cap] host: position of each row */
    be_seq *seq;             /* [cap] host: the pass's sequences */
} fwd_bufs;

/* model_fingerprint's result, computed once: it hashes every tensor's bytes,
 * which after a CPU load are packed copies and the file's pages given back. */
typedef struct {
    pthread_mutex_t mu;
    int done;
    int n_threads;           /* threads hashing the tensors (the model's own count) */
    uint8_t fp[32];
    char desc[384];          /* the file name (up to 255 bytes) and the shape */
} model_fp_memo;

struct model {
    gguf_file *gf;
    model_hparams hp;
    tokenizer *tok;
    backend *be;
    int n_batch;
    be_weight tok_embd;      /* [n_embd, n_vocab] */
    be_weight output_norm;   /* [n_embd] */
    be_weight output;        /* [n_embd, n_vocab]; = tok_embd when tied */
    be_weight rope_freqs;    /* [n_rot/2], Llama 3.x only */
    model_layer *layers;     /* [n_layer] */
    char **names;            /* owned copies of bound tensor names */
    int n_names, n_bound;
    /* forward pass state: one evaluation at a time per model */
    pthread_mutex_t eval_mu;
    fwd_bufs b;
    model_fp_memo *fp;       /* see model_fp_memo */
    int layer_lo, layer_hi;  /* blocks held: [layer_lo, layer_hi) */
    int sliced;              /* loaded with model_opts.layer_hi (no output head) */
    int ffn_first;           /* block layer_lo: its feed-forward only (model_opts.ffn_first) */
    int attn_last;           /* block layer_hi - 1: its attention only (model_opts.attn_last) */
};

/* 1 when tensor `name` (len bytes) is bound by this model (a slice leaves
 * the other layers' tensors unbound and unread after the fingerprint). */
int model_tensor_bound(const model *m, const char *name, size_t len);

/* A slice: the pages of its file mapping that it no longer reads (every
 * page but its bound weights' not copied by the backend) leave its
 * resident set. Called once loaded and after the fingerprint's hashing;
 * nothing for a whole model. */
void model_drop_unused_pages(const model *m);

struct session {
    model *m;
    kvcache *kv;
};

void forward_release(model *m);

#endif
