/* kvcache.h - the key/value cache of one sequence.
 *
 * Layout: head-major. For each layer and each KV head, K and V are each an
 * array of n_ctx head rows of head_dim elements of the cache dtype (K after
 * RoPE): [layer][kv_head][position][head_dim]. Attention walks one head's
 * positions in order, so that walk is one contiguous stream (position-major
 * rows put a head's 256-byte segment in every 2 KiB, a stride the hardware
 * prefetchers follow poorly: measured on a Zen 5 core pair, the Qwen3-0.6B
 * shape's decode attention at depth 4096 read its cache at 27-30 GB/s that
 * way and 50-55 GB/s head-major, with the same kernels, while a plain read
 * streamed 70-75; whole decode steps at that depth 10-20% faster).
 *
 * Spans (kv_read_span, kv_write_span) are position-major, [n][kv_dim] per
 * layer: a token's row holds all heads, [kv_head][head_dim], which is the
 * unit that the prefill node streams to the decode node; they are gathered
 * from (scattered to) the heads' arrays.
 *
 * dtype: GGML_TYPE_F16 (default, what llama.cpp uses), GGML_TYPE_BF16, or
 * GGML_TYPE_Q8_0 (head_dim must be a multiple of 32).
 */
#ifndef TANDEM_KVCACHE_H
#define TANDEM_KVCACHE_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvcache kvcache;

/* ==== Element types ====
 * The types a cache (and the wire) may hold, by the names users give them
 * (--kv-type, --wire-dtype): "f16", "bf16", "q8_0". */
extern const char *const kv_dtype_names[];      /* NULL-terminated, for cliopt_choice */
uint32_t kv_dtype_parse(const char *name);      /* ggml type; UINT32_MAX when unknown */
const char *kv_dtype_name(uint32_t dtype);      /* "?" when not one of them */

int kv_create(kvcache **out, int n_layer, int n_ctx, int n_head, int head_dim, uint32_t dtype,
              char *err, size_t errlen);
void kv_free(kvcache *kv);

int kv_n_layer(const kvcache *kv);
int kv_n_ctx(const kvcache *kv);
int kv_dim(const kvcache *kv);            /* n_head * head_dim */
int kv_n_head(const kvcache *kv);
int kv_head_dim(const kvcache *kv);
uint32_t kv_dtype(const kvcache *kv);
size_t kv_row_bytes(const kvcache *kv);   /* bytes of one token's K (or V) in one layer, all heads */
size_t kv_head_bytes(const kvcache *kv);  /* bytes of one token's K (or V) of one head */

/* Positions [0, kv_used) hold valid data. The forward pass advances it;
 * kv_set_used() truncates (or, for a decode node receiving frames, extends
 * after a completed transfer). */
int kv_used(const kvcache *kv);
void kv_set_used(kvcache *kv, int n);

/* Position 0 of head `head` of layer `layer`'s K or V; position p follows
 * at p * kv_head_bytes. No checks: callers validate layer and head. */
const uint8_t *kv_k_head(const kvcache *kv, int layer, int head);
const uint8_t *kv_v_head(const kvcache *kv, int layer, int head);

/* 0 if layer and [pos, pos+n) are inside the cache, else -1 with a message
 * (including the context-length error users see). */
int kv_check_range(const kvcache *kv, int layer, int pos, int n, char *err, size_t errlen);

/* Store n tokens of f32 K and V ([n][kv_dim] each) at positions pos.., converting. */
void kv_store_f32(kvcache *kv, int layer, int pos, int n, const float *k, const float *v);

/* Copy raw position-major rows ([n][row_bytes], already in the cache dtype)
 * in or out: the handoff path. k or v may be NULL (that half is skipped). */
int kv_write_span(kvcache *kv, int layer, int pos, int n, const void *k, const void *v,
                  char *err, size_t errlen);
int kv_read_span(const kvcache *kv, int layer, int pos, int n, void *k, void *v,
                 char *err, size_t errlen);

/* dst's positions [0, n) := src's, every layer (same shape and dtype); dst
 * then holds n positions. Prefix sharing between sequences. */
int kv_copy_prefix(kvcache *dst, const kvcache *src, int n, char *err, size_t errlen);

#endif
