/* kvcache.c - see kvcache.h. */
#include "kvcache.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "gguf.h"
#include "quant.h"

struct kvcache {
    int n_layer, n_ctx, dim, used;
    uint32_t dtype;
    size_t row_bytes;
    uint8_t *k, *v;           /* [n_layer][n_ctx][row_bytes] each */
    size_t bytes;             /* of each of k and v */
    int mapped;               /* bit 0: k, bit 1: v mmapped by kv_map (else calloc) */
};

/* ==== Memory ==== */

/* Caches of at least this many bytes are mapped with transparent huge pages
 * asked for: attention walks one head's slice of every position, a stride
 * of a whole row (all heads, 2 KiB for 8 F16 heads of 128), so a 4096-token
 * walk touches 2048 small pages per layer and misses the TLB on most rows. */
#define KV_HUGE_MIN (4u << 20)

/* Zeroed memory that is only backed as positions are used (as calloc). */
static uint8_t *kv_map(size_t bytes, int *mapped) {
    *mapped = 0;
    if (bytes < KV_HUGE_MIN) return calloc(1, bytes);
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return calloc(1, bytes);
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE);   /* a hint: without THP the pages stay small */
#endif
    *mapped = 1;
    return p;
}

static void kv_unmap(uint8_t *p, size_t bytes, int mapped) {
    if (!p) return;
    if (mapped) munmap(p, bytes);
    else free(p);
}

int kv_create(kvcache **out, int n_layer, int n_ctx, int dim, uint32_t dtype,
              char *err, size_t errlen) {
    *out = NULL;
    if (dtype != GGML_TYPE_F16 && dtype != GGML_TYPE_BF16 && dtype != GGML_TYPE_Q8_0) {
        snprintf(err, errlen, "unsupported KV cache type %s (use f16, bf16 or q8_0)", gguf_type_name(dtype));
        return -1;
    }
    if (n_layer < 1 || n_ctx < 1 || dim < 1) {
        snprintf(err, errlen, "bad KV cache shape: %d layers, %d positions, dim %d", n_layer, n_ctx, dim);
        return -1;
    }
    uint64_t rb = gguf_row_bytes(dtype, (uint64_t)dim);
    if (rb == 0) {
        snprintf(err, errlen, "KV dim %d is not a multiple of the %s block size", dim, gguf_type_name(dtype));
        return -1;
    }
    kvcache *kv = calloc(1, sizeof *kv);
    size_t total = (size_t)n_layer * (size_t)n_ctx * rb;
    if (!kv) goto oom;
    kv->n_layer = n_layer; kv->n_ctx = n_ctx; kv->dim = dim; kv->dtype = dtype; kv->row_bytes = rb;
    /* pages are only touched as positions are used, so a long context costs
     * memory only when it is filled (in 2 MiB steps with huge pages). */
    kv->bytes = total;
    int mk = 0, mv = 0;
    kv->k = kv_map(total, &mk);
    kv->v = kv_map(total, &mv);
    kv->mapped = mk | (mv << 1);
    if (!kv->k || !kv->v) goto oom;
    *out = kv;
    return 0;
oom:
    snprintf(err, errlen, "out of memory for a KV cache of %zu bytes", 2 * total);
    kv_free(kv);
    return -1;
}

void kv_free(kvcache *kv) {
    if (!kv) return;
    kv_unmap(kv->k, kv->bytes, kv->mapped & 1);
    kv_unmap(kv->v, kv->bytes, kv->mapped & 2);
    free(kv);
}

int kv_n_layer(const kvcache *kv) { return kv->n_layer; }
int kv_n_ctx(const kvcache *kv) { return kv->n_ctx; }
int kv_dim(const kvcache *kv) { return kv->dim; }
uint32_t kv_dtype(const kvcache *kv) { return kv->dtype; }
size_t kv_row_bytes(const kvcache *kv) { return kv->row_bytes; }
int kv_used(const kvcache *kv) { return kv->used; }
void kv_set_used(kvcache *kv, int n) {
    if (n < 0) n = 0;
    if (n > kv->n_ctx) n = kv->n_ctx;
    kv->used = n;
}

static size_t kv_offset(const kvcache *kv, int layer, int pos) {
    return ((size_t)layer * (size_t)kv->n_ctx + (size_t)pos) * kv->row_bytes;
}
uint8_t *kv_k_row(kvcache *kv, int layer, int pos) { return kv->k + kv_offset(kv, layer, pos); }
uint8_t *kv_v_row(kvcache *kv, int layer, int pos) { return kv->v + kv_offset(kv, layer, pos); }
const uint8_t *kv_k_row_c(const kvcache *kv, int layer, int pos) { return kv->k + kv_offset(kv, layer, pos); }
const uint8_t *kv_v_row_c(const kvcache *kv, int layer, int pos) { return kv->v + kv_offset(kv, layer, pos); }

int kv_check_range(const kvcache *kv, int layer, int pos, int n, char *err, size_t errlen) {
    if (layer < 0 || layer >= kv->n_layer) {
        snprintf(err, errlen, "layer %d out of range (model has %d)", layer, kv->n_layer);
        return -1;
    }
    if (pos < 0 || n < 0 || (long)pos + n > kv->n_ctx) {
        snprintf(err, errlen, "context length exceeded: positions %d..%ld do not fit in a context of %d tokens",
                 pos, (long)pos + n, kv->n_ctx);
        return -1;
    }
    return 0;
}

void kv_store_f32(kvcache *kv, int layer, int pos, int n, const float *k, const float *v) {
    for (int i = 0; i < n; i++) {
        quant_quantize_act_row(kv->dtype, k + (size_t)i * kv->dim, kv_k_row(kv, layer, pos + i), kv->dim);
        quant_quantize_act_row(kv->dtype, v + (size_t)i * kv->dim, kv_v_row(kv, layer, pos + i), kv->dim);
    }
}

int kv_write_span(kvcache *kv, int layer, int pos, int n, const void *k, const void *v,
                  char *err, size_t errlen) {
    if (kv_check_range(kv, layer, pos, n, err, errlen)) return -1;
    size_t bytes = (size_t)n * kv->row_bytes;
    if (k) memcpy(kv_k_row(kv, layer, pos), k, bytes);
    if (v) memcpy(kv_v_row(kv, layer, pos), v, bytes);
    return 0;
}

int kv_read_span(const kvcache *kv, int layer, int pos, int n, void *k, void *v,
                 char *err, size_t errlen) {
    if (kv_check_range(kv, layer, pos, n, err, errlen)) return -1;
    size_t bytes = (size_t)n * kv->row_bytes;
    if (k) memcpy(k, kv_k_row_c(kv, layer, pos), bytes);
    if (v) memcpy(v, kv_v_row_c(kv, layer, pos), bytes);
    return 0;
}

int kv_copy_prefix(kvcache *dst, const kvcache *src, int n, char *err, size_t errlen) {
    if (dst->n_layer != src->n_layer || dst->dim != src->dim || dst->dtype != src->dtype) {
        snprintf(err, errlen, "KV caches of different shapes");
        return -1;
    }
    if (n > kv_used(src) || kv_check_range(dst, 0, 0, n, err, errlen)) {
        if (n > kv_used(src)) snprintf(err, errlen, "copying %d positions from a cache holding %d", n, kv_used(src));
        return -1;
    }
    size_t bytes = (size_t)n * dst->row_bytes;
    for (int l = 0; l < dst->n_layer; l++) {
        memcpy(kv_k_row(dst, l, 0), kv_k_row_c(src, l, 0), bytes);
        memcpy(kv_v_row(dst, l, 0), kv_v_row_c(src, l, 0), bytes);
    }
    kv_set_used(dst, n);
    return 0;
}
