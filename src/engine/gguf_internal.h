/* gguf_internal.h - what the GGUF reader's and writer's files share (not
 * part of their interface: gguf.h is). The parsed file's layout, the
 * byte-order helpers, and the gguf_ functions one file calls in another:
 *   gguf.c         type geometry, parsing and validation, open and close
 *   gguf_access.c  metadata and tensor access on a parsed file
 *   gguf_writer.c  the writer: metadata, tensor infos, save
 */

#ifndef TANDEM_ENGINE_GGUF_INTERNAL_H
#define TANDEM_ENGINE_GGUF_INTERNAL_H

#include "engine/gguf.h"

#define GGUF_DEFAULT_ALIGN    32u

/* ==== Little-endian helpers ==== */

static inline uint32_t gguf_load_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t gguf_load_u64(const uint8_t *p)
{
    return (uint64_t)gguf_load_u32(p) | (uint64_t)gguf_load_u32(p + 4) << 32;
}

static inline int gguf_is_pow2(uint64_t x) { return x != 0 && (x & (x - 1)) == 0; }
/* A valid general.alignment: a power of two and a multiple of 8 (see the top). */
static inline int gguf_alignment_ok(uint64_t x) { return gguf_is_pow2(x) && x >= 8; }

/* ==== Reader state ==== */

/* One entry of a sorted name index. A sorted index rather than a hash table:
 * lookups stay O(log n) however the names were chosen by the file's author. */
typedef struct { const char *ptr; uint64_t len; uint32_t idx; } gguf_name_ref;

typedef struct {
    gguf_str key;
    uint32_t type;
    const uint8_t *val;   /* value encoding (after the type field) */
    uint64_t val_len;     /* its length in bytes */
    gguf_arr arr;         /* GGUF_VT_ARR */
} gguf_kv_entry;

struct gguf_file {
    const uint8_t *base;
    uint64_t size;
    int mapped;
    uint32_t version;
    uint64_t alignment;
    uint64_t data_off;
    int64_t n_kv;
    gguf_kv_entry *kv;
    int64_t n_tensors;
    gguf_tensor *tensors;
    gguf_name_ref *kv_index;         /* keys sorted bytewise, for binary search */
    gguf_name_ref *t_index;          /* tensor names, likewise */
};

/* ==== gguf.c ==== */

void gguf_set_err(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Checked byte size of a tensor; -1 with a reason on failure. */
int gguf_tensor_size(uint32_t type, uint32_t n_dims, const uint64_t *ne,
                     uint64_t *nbytes, const char **why);
uint64_t gguf_vtype_size(uint32_t t);
int64_t gguf_index_find(const gguf_name_ref *ix, uint64_t n, const char *s, uint64_t len);

#endif /* TANDEM_ENGINE_GGUF_INTERNAL_H */
