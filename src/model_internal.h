/* model_internal.h - model and session internals shared by model.c and
 * forward.c only. */
#ifndef TANDEM_MODEL_INTERNAL_H
#define TANDEM_MODEL_INTERNAL_H

#include "model.h"

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
};

/* Activation buffers for one chunk of up to n_batch tokens (backend memory). */
typedef struct {
    int cap;                 /* tokens */
    float *x;                /* [cap][n_embd] residual stream */
    float *h;                /* [cap][n_embd] normed input */
    float *q;                /* [cap][n_head * hd] */
    float *k, *v;            /* [cap][n_head_kv * hd] */
    float *att;              /* [cap][n_head * hd] */
    float *o;                /* [cap][n_embd] */
    float *g, *u;            /* [cap][n_ff] */
    float *logits;           /* [n_vocab] */
} fwd_bufs;

struct session {
    model *m;
    kvcache *kv;
    fwd_bufs b;
};

int forward_alloc(model *m, session *s, char *err, size_t errlen);
void forward_release(model *m, session *s);

#endif
