/* kvcache.h - the key/value cache of one sequence.
 *
 * Layout: for each layer, K and V are each an array of n_ctx rows; row p holds
 * token position p as [kv_head][head_dim] elements of the cache dtype (K after
 * RoPE). A layer's K (or V) for a token range [p0, p0+n) is therefore one
 * contiguous span of n * row_bytes bytes: the unit that the prefill node
 * streams to the decode node.
 *
 * dtype: GGML_TYPE_F16 (default, what llama.cpp uses), GGML_TYPE_BF16, or
 * GGML_TYPE_Q8_0 (head_dim must be a multiple of 32).
 */
#ifndef TANDEM_KVCACHE_H
#define TANDEM_KVCACHE_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvcache kvcache;

int kv_create(kvcache **out, int n_layer, int n_ctx, int kv_dim, uint32_t dtype,
              char *err, size_t errlen);
void kv_free(kvcache *kv);

int kv_n_layer(const kvcache *kv);
int kv_n_ctx(const kvcache *kv);
int kv_dim(const kvcache *kv);
uint32_t kv_dtype(const kvcache *kv);
size_t kv_row_bytes(const kvcache *kv);   /* bytes of one token's K (or V) in one layer */

/* Positions [0, kv_used) hold valid data. The forward pass advances it;
 * kv_set_used() truncates (or, for a decode node receiving frames, extends
 * after a completed transfer). */
int kv_used(const kvcache *kv);
void kv_set_used(kvcache *kv, int n);

/* Pointer to row `pos` of layer `layer`'s K or V (contiguous onwards). No
 * checks: callers validate with kv_check_range first. */
uint8_t *kv_k_row(kvcache *kv, int layer, int pos);
uint8_t *kv_v_row(kvcache *kv, int layer, int pos);
const uint8_t *kv_k_row_c(const kvcache *kv, int layer, int pos);
const uint8_t *kv_v_row_c(const kvcache *kv, int layer, int pos);

/* 0 if layer and [pos, pos+n) are inside the cache, else -1 with a message
 * (including the context-length error users see). */
int kv_check_range(const kvcache *kv, int layer, int pos, int n, char *err, size_t errlen);

/* Store n tokens of f32 K and V ([n][kv_dim] each) at positions pos.., converting. */
void kv_store_f32(kvcache *kv, int layer, int pos, int n, const float *k, const float *v);

/* Copy raw rows (already in the cache dtype) in or out: the handoff path. */
int kv_write_span(kvcache *kv, int layer, int pos, int n, const void *k, const void *v,
                  char *err, size_t errlen);
int kv_read_span(const kvcache *kv, int layer, int pos, int n, void *k, void *v,
                 char *err, size_t errlen);

/* dst's positions [0, n) := src's, every layer (same shape and dtype); dst
 * then holds n positions. Prefix sharing between sequences. */
int kv_copy_prefix(kvcache *dst, const kvcache *src, int n, char *err, size_t errlen);

#endif
