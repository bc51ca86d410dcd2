/* kvcache.c - see kvcache.h. */
#include "engine/kvcache.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "engine/gguf.h"
#include "engine/quant.h"

/* ==== Element types ==== */

const char *const kv_dtype_names[] = { "f16", "bf16", "q8_0", NULL };
static const uint32_t kv_dtype_types[] = { GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0 };

uint32_t kv_dtype_parse(const char *name) {
    for (int i = 0; name && kv_dtype_names[i]; i++)
        if (!strcmp(name, kv_dtype_names[i])) return kv_dtype_types[i];
    return UINT32_MAX;
}

const char *kv_dtype_name(uint32_t dtype) {
    for (int i = 0; kv_dtype_names[i]; i++)
        if (kv_dtype_types[i] == dtype) return kv_dtype_names[i];
    return "?";
}

struct kvcache {
    int n_layer, n_ctx, n_head, head_dim, dim, used;
    uint32_t dtype;
    size_t row_bytes;         /* one position, all heads */
    size_t head_bytes;        /* one position, one head */
    uint8_t *k, *v;           /* [n_layer][n_head][n_ctx][head_bytes] each */
    size_t bytes;             /* of each of k and v */
    int mapped;               /* bit 0: k, bit 1: v mmapped by kv_map (else calloc) */
};

/* ==== Memory ==== */

/* Caches of at least this many bytes are mapped (zero pages, backed as
 * positions are used) with transparent huge pages refused: each head's
 * array fills from its start, so with 2 MiB pages a one-token sequence
 * would hold 2 MiB per head and layer (Qwen3-0.6B at a 40960-token
 * context: 896 MiB where 4 KiB pages hold 1.8). Head-major walks are
 * sequential, so small pages cost them little: the attention walk alone
 * 51 vs 55 GB/s, whole decode steps at depth 4096 within their noise. */
#define KV_MAP_MIN (4u << 20)

/* Zeroed memory that is only backed as positions are used (as calloc). */
static uint8_t *kv_map(size_t bytes, int *mapped) {
    *mapped = 0;
    if (bytes < KV_MAP_MIN) return calloc(1, bytes);
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return calloc(1, bytes);
#ifdef MADV_NOHUGEPAGE
    madvise(p, bytes, MADV_NOHUGEPAGE);   /* a hint: where THP is "always" */
#endif
    *mapped = 1;
    return p;
}

static void kv_unmap(uint8_t *p, size_t bytes, int mapped) {
    if (!p) return;
    if (mapped) munmap(p, bytes);
    else free(p);
}

int kv_create(kvcache **out, int n_layer, int n_ctx, int n_head, int head_dim, uint32_t dtype,
              char *err, size_t errlen) {
    *out = NULL;
    if (dtype != GGML_TYPE_F16 && dtype != GGML_TYPE_BF16 && dtype != GGML_TYPE_Q8_0) {
        snprintf(err, errlen, "unsupported KV cache type %s (use f16, bf16 or q8_0)", gguf_type_name(dtype));
        return -1;
    }
    if (n_layer < 1 || n_ctx < 1 || n_head < 1 || head_dim < 1 || (int64_t)n_head * head_dim > (1 << 20)) {
        snprintf(err, errlen, "bad KV cache shape: %d layers, %d positions, %d heads of %d", n_layer, n_ctx, n_head,
                 head_dim);
        return -1;
    }
    int dim = n_head * head_dim;
    uint64_t hb = gguf_row_bytes(dtype, (uint64_t)head_dim);
    if (hb == 0) {
        /* attention addresses the cache one head at a time */
        snprintf(err, errlen, "head dim %d is not a multiple of the %s block size (use an f16 or bf16 KV cache)",
                 head_dim, gguf_type_name(dtype));
        return -1;
    }
    uint64_t rb = hb * (uint64_t)n_head;
    kvcache *kv = calloc(1, sizeof *kv);
    size_t total = (size_t)n_layer * (size_t)n_ctx * rb;
    if (!kv) goto oom;
    kv->n_layer = n_layer; kv->n_ctx = n_ctx; kv->n_head = n_head; kv->head_dim = head_dim; kv->dim = dim;
    kv->dtype = dtype; kv->row_bytes = rb; kv->head_bytes = hb;
    /* pages are only touched as positions are used, so a long context costs
     * memory only when it is filled (4 KiB pages per head array, kv_map). */
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
int kv_n_head(const kvcache *kv) { return kv->n_head; }
int kv_head_dim(const kvcache *kv) { return kv->head_dim; }
size_t kv_head_bytes(const kvcache *kv) { return kv->head_bytes; }
uint32_t kv_dtype(const kvcache *kv) { return kv->dtype; }
size_t kv_row_bytes(const kvcache *kv) { return kv->row_bytes; }
int kv_used(const kvcache *kv) { return kv->used; }
void kv_set_used(kvcache *kv, int n) {
    if (n < 0) n = 0;
    if (n > kv->n_ctx) n = kv->n_ctx;
    kv->used = n;
}

/* Byte offset of (layer, head, pos) in k or v. */
static size_t kv_offset(const kvcache *kv, int layer, int head, int pos) {
    return (((size_t)layer * (size_t)kv->n_head + (size_t)head) * (size_t)kv->n_ctx + (size_t)pos) * kv->head_bytes;
}
const uint8_t *kv_k_head(const kvcache *kv, int layer, int head) { return kv->k + kv_offset(kv, layer, head, 0); }
const uint8_t *kv_v_head(const kvcache *kv, int layer, int head) { return kv->v + kv_offset(kv, layer, head, 0); }

/* ==== Spans ==== */

/* Position-major rows [n][row_bytes] (each [n_head][head_bytes]) to the
 * heads' arrays of one layer, from position pos on; and back. */
static void kv_scatter(const kvcache *kv, uint8_t *base, int layer, int pos, int n, const uint8_t *rows) {
    const size_t hb = kv->head_bytes;
    for (int h = 0; h < kv->n_head; h++) {
        uint8_t *dst = base + kv_offset(kv, layer, h, pos);
        const uint8_t *src = rows + (size_t)h * hb;
        for (int i = 0; i < n; i++) memcpy(dst + (size_t)i * hb, src + (size_t)i * kv->row_bytes, hb);
    }
}

static void kv_gather(const kvcache *kv, const uint8_t *base, int layer, int pos, int n, uint8_t *rows) {
    const size_t hb = kv->head_bytes;
    for (int h = 0; h < kv->n_head; h++) {
        const uint8_t *src = base + kv_offset(kv, layer, h, pos);
        uint8_t *dst = rows + (size_t)h * hb;
        for (int i = 0; i < n; i++) memcpy(dst + (size_t)i * kv->row_bytes, src + (size_t)i * hb, hb);
    }
}

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

/* Converting head by head gives the bytes a whole row's conversion would:
 * F16 and BF16 convert each value alone, and a Q8_0 head (head_dim a
 * multiple of 32) is whole blocks. */
void kv_store_f32(kvcache *kv, int layer, int pos, int n, const float *k, const float *v) {
    for (int h = 0; h < kv->n_head; h++) {
        uint8_t *kd = kv->k + kv_offset(kv, layer, h, pos), *vd = kv->v + kv_offset(kv, layer, h, pos);
        for (int i = 0; i < n; i++) {
            const size_t src = (size_t)i * kv->dim + (size_t)h * kv->head_dim, dst = (size_t)i * kv->head_bytes;
            quant_quantize_act_row(kv->dtype, k + src, kd + dst, kv->head_dim);
            quant_quantize_act_row(kv->dtype, v + src, vd + dst, kv->head_dim);
        }
    }
}

int kv_write_span(kvcache *kv, int layer, int pos, int n, const void *k, const void *v,
                  char *err, size_t errlen) {
    if (kv_check_range(kv, layer, pos, n, err, errlen)) return -1;
    if (k) kv_scatter(kv, kv->k, layer, pos, n, k);
    if (v) kv_scatter(kv, kv->v, layer, pos, n, v);
    return 0;
}

int kv_read_span(const kvcache *kv, int layer, int pos, int n, void *k, void *v,
                 char *err, size_t errlen) {
    if (kv_check_range(kv, layer, pos, n, err, errlen)) return -1;
    if (k) kv_gather(kv, kv->k, layer, pos, n, k);
    if (v) kv_gather(kv, kv->v, layer, pos, n, v);
    return 0;
}

int kv_copy_prefix(kvcache *dst, const kvcache *src, int n, char *err, size_t errlen) {
    if (dst->n_layer != src->n_layer || dst->n_head != src->n_head || dst->head_dim != src->head_dim ||
        dst->dtype != src->dtype) {
        snprintf(err, errlen, "KV caches of different shapes");
        return -1;
    }
    if (n > kv_used(src) || kv_check_range(dst, 0, 0, n, err, errlen)) {
        if (n > kv_used(src)) snprintf(err, errlen, "copying %d positions from a cache holding %d", n, kv_used(src));
        return -1;
    }
    size_t bytes = (size_t)n * dst->head_bytes;
    for (int l = 0; l < dst->n_layer; l++)
        for (int h = 0; h < dst->n_head; h++) {
            memcpy(dst->k + kv_offset(dst, l, h, 0), src->k + kv_offset(src, l, h, 0), bytes);
            memcpy(dst->v + kv_offset(dst, l, h, 0), src->v + kv_offset(src, l, h, 0), bytes);
        }
    kv_set_used(dst, n);
    return 0;
}
