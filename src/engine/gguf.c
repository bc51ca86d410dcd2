/* gguf.c - bounds-checked GGUF (v2, v3) reader over mmap, and a small writer.
 *
 * Reader policy (every rule below is checked at open, so the accessors can
 * trust what they hand out):
 *  - magic "GGUF"; version 2 or 3 (v1 used 32-bit counts and is refused).
 *  - n_kv and n_tensors are bounded by what the remaining bytes could hold
 *    before anything is allocated, so a hostile count cannot allocate more
 *    than a small multiple of the file size.
 *  - keys: 1..GGUF_MAX_KEY_LEN bytes, unique. Value types 0..12 only; arrays
 *    of arrays are refused. String values may hold any bytes.
 *  - general.alignment, when present, must be a U32 power of two of at least 8
 *    (default 32): the GGUF spec asks for a multiple of 8, llama.cpp for a
 *    power of two; anything else would leave tensor data (read as float,
 *    uint16 or block structs) misaligned.
 *  - tensors: unique names of 1..GGUF_MAX_TENSOR_NAME bytes, n_dims 1..4,
 *    every ne >= 1 (zero-sized tensors are refused: no model needs them and
 *    consumers may divide by a dimension), element count <= INT64_MAX, a known
 *    type, ne[0] a multiple of the type's block size, the byte size computed
 *    without overflow, offset aligned, data inside the file.
 *  - a file without tensors may end right after its metadata (no padding).
 * Integers are decoded byte by byte (little-endian), so the host's byte order
 * and alignment do not matter.
 */
#include "engine/gguf.h"
#include "base/strbuf.h"

#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ==== Limits ==== */
/* Smallest encodings, used to bound counts by the bytes left in the file:
 * a kv is key length (8) + a 1-byte key + type (4) + a 1-byte value; a tensor
 * info is name length (8) + a 1-byte name + n_dims (4) + one ne (8) + type (4)
 * + offset (8). */
#define GGUF_KV_MIN_BYTES     14u
#define GGUF_TINFO_MIN_BYTES  33u
/* Index entries hold 32-bit indices; real files have < 100 keys and < 10^4 tensors. */
#define GGUF_MAX_COUNT        (1u << 28)
#define GGUF_DEFAULT_ALIGN    32u
#define GGUF_VERSION_WRITE    3u

/* ==== Small helpers ==== */

static void gguf_set_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (!err || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static uint32_t gguf_load_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t gguf_load_u64(const uint8_t *p)
{
    return (uint64_t)gguf_load_u32(p) | (uint64_t)gguf_load_u32(p + 4) << 32;
}

static int gguf_is_pow2(uint64_t x) { return x != 0 && (x & (x - 1)) == 0; }
/* A valid general.alignment: a power of two and a multiple of 8 (see the top). */
static int gguf_alignment_ok(uint64_t x) { return gguf_is_pow2(x) && x >= 8; }

/* Printable, bounded copy of a name from the file, for error messages. */
static const char *gguf_show(char *buf, size_t cap, const char *s, uint64_t len)
{
    size_t n = 0;
    uint64_t shown = len < 48 ? len : 48;
    for (uint64_t i = 0; i < shown && n + 1 < cap; i++) {
        unsigned char c = (unsigned char)s[i];
        buf[n++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
    }
    if (len > shown && n + 4 < cap) {
        memcpy(buf + n, "...", 3);
        n += 3;
    }
    buf[n] = 0;
    return buf;
}

int gguf_str_eq(gguf_str s, const char *c)
{
    if (!c)
        return 0;
    size_t n = strlen(c);
    return s.len == n && (n == 0 || memcmp(s.ptr, c, n) == 0);
}

/* ==== Tensor types ==== */

typedef struct { const char *name; uint32_t blk, bytes; } gguf_type_info;

/* Block geometry per ggml type number (facts of the format; 4, 5, 31-33 and
 * 36-38 were removed from ggml and are unknown here). QK_K types use 256. */
static const gguf_type_info gguf_types[] = {
    [GGML_TYPE_F32] = {"F32", 1, 4},         [GGML_TYPE_F16] = {"F16", 1, 2},
    [GGML_TYPE_Q4_0] = {"Q4_0", 32, 18},     [GGML_TYPE_Q4_1] = {"Q4_1", 32, 20},
    [GGML_TYPE_Q5_0] = {"Q5_0", 32, 22},     [GGML_TYPE_Q5_1] = {"Q5_1", 32, 24},
    [GGML_TYPE_Q8_0] = {"Q8_0", 32, 34},     [GGML_TYPE_Q8_1] = {"Q8_1", 32, 36},
    [GGML_TYPE_Q2_K] = {"Q2_K", 256, 84},    [GGML_TYPE_Q3_K] = {"Q3_K", 256, 110},
    [GGML_TYPE_Q4_K] = {"Q4_K", 256, 144},   [GGML_TYPE_Q5_K] = {"Q5_K", 256, 176},
    [GGML_TYPE_Q6_K] = {"Q6_K", 256, 210},   [GGML_TYPE_Q8_K] = {"Q8_K", 256, 292},
    [GGML_TYPE_IQ2_XXS] = {"IQ2_XXS", 256, 66}, [GGML_TYPE_IQ2_XS] = {"IQ2_XS", 256, 74},
    [GGML_TYPE_IQ3_XXS] = {"IQ3_XXS", 256, 98}, [GGML_TYPE_IQ1_S] = {"IQ1_S", 256, 50},
    [GGML_TYPE_IQ4_NL] = {"IQ4_NL", 32, 18},  [GGML_TYPE_IQ3_S] = {"IQ3_S", 256, 110},
    [GGML_TYPE_IQ2_S] = {"IQ2_S", 256, 82},   [GGML_TYPE_IQ4_XS] = {"IQ4_XS", 256, 136},
    [GGML_TYPE_I8] = {"I8", 1, 1},           [GGML_TYPE_I16] = {"I16", 1, 2},
    [GGML_TYPE_I32] = {"I32", 1, 4},         [GGML_TYPE_I64] = {"I64", 1, 8},
    [GGML_TYPE_F64] = {"F64", 1, 8},         [GGML_TYPE_IQ1_M] = {"IQ1_M", 256, 56},
    [GGML_TYPE_BF16] = {"BF16", 1, 2},       [GGML_TYPE_TQ1_0] = {"TQ1_0", 256, 54},
    [GGML_TYPE_TQ2_0] = {"TQ2_0", 256, 66},  [GGML_TYPE_MXFP4] = {"MXFP4", 32, 17},
};

int gguf_type_geometry(uint32_t type, uint32_t *block_elems, uint32_t *block_bytes)
{
    if (type >= sizeof gguf_types / sizeof gguf_types[0] || !gguf_types[type].name)
        return 0;
    if (block_elems)
        *block_elems = gguf_types[type].blk;
    if (block_bytes)
        *block_bytes = gguf_types[type].bytes;
    return 1;
}

const char *gguf_type_name(uint32_t type)
{
    if (type >= sizeof gguf_types / sizeof gguf_types[0] || !gguf_types[type].name)
        return "unknown";
    return gguf_types[type].name;
}

uint64_t gguf_row_bytes(uint32_t type, uint64_t n)
{
    uint32_t blk, bytes;
    if (!gguf_type_geometry(type, &blk, &bytes) || n % blk != 0)
        return 0;
    uint64_t r;
    if (__builtin_mul_overflow(n / blk, (uint64_t)bytes, &r))
        return 0;
    return r;
}

/* Checked byte size of a tensor; -1 with a reason on failure. */
static int gguf_tensor_size(uint32_t type, uint32_t n_dims, const uint64_t *ne,
                            uint64_t *nbytes, const char **why)
{
    uint32_t blk, bsz;
    if (!gguf_type_geometry(type, &blk, &bsz)) {
        *why = "unknown type";
        return -1;
    }
    if (n_dims < 1 || n_dims > 4) {
        *why = "n_dims outside 1..4";
        return -1;
    }
    uint64_t elems = 1;
    for (uint32_t d = 0; d < 4; d++) {
        if (ne[d] == 0) {
            *why = "has a zero dimension";
            return -1;
        }
        if (ne[d] > (uint64_t)INT64_MAX || __builtin_mul_overflow(elems, ne[d], &elems)
            || elems > (uint64_t)INT64_MAX) {
            *why = "element count overflows";
            return -1;
        }
    }
    if (ne[0] % blk != 0) {
        *why = "ne[0] is not a multiple of the type's block size";
        return -1;
    }
    uint64_t b;
    if (__builtin_mul_overflow(ne[0] / blk, (uint64_t)bsz, &b)
        || __builtin_mul_overflow(b, ne[1], &b) || __builtin_mul_overflow(b, ne[2], &b)
        || __builtin_mul_overflow(b, ne[3], &b)) {
        *why = "byte size overflows";
        return -1;
    }
    *nbytes = b;
    return 0;
}

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

/* Cursor over the file with a description of what is being read. */
typedef struct {
    const uint8_t *p;
    uint64_t size, pos;
    char *err;
    size_t errlen;
    char what[192];
} gguf_cursor;

static int cur_need(gguf_cursor *c, uint64_t n)
{
    uint64_t left = c->size - c->pos;
    if (n <= left)
        return 0;
    gguf_set_err(c->err, c->errlen, "truncated: %s needs %llu more bytes at offset %llu",
                 c->what, (unsigned long long)(n - left), (unsigned long long)c->pos);
    return -1;
}

static int cur_u32(gguf_cursor *c, uint32_t *v)
{
    if (cur_need(c, 4))
        return -1;
    *v = gguf_load_u32(c->p + c->pos);
    c->pos += 4;
    return 0;
}

static int cur_u64(gguf_cursor *c, uint64_t *v)
{
    if (cur_need(c, 8))
        return -1;
    *v = gguf_load_u64(c->p + c->pos);
    c->pos += 8;
    return 0;
}

static int cur_str(gguf_cursor *c, gguf_str *s)
{
    uint64_t len;
    if (cur_u64(c, &len) || cur_need(c, len))
        return -1;
    s->ptr = (const char *)c->p + c->pos;
    s->len = len;
    c->pos += len;
    return 0;
}

/* ==== Metadata parsing ==== */

static uint64_t gguf_vtype_size(uint32_t t)
{
    switch (t) {
    case GGUF_VT_U8: case GGUF_VT_I8: case GGUF_VT_BOOL: return 1;
    case GGUF_VT_U16: case GGUF_VT_I16: return 2;
    case GGUF_VT_U32: case GGUF_VT_I32: case GGUF_VT_F32: return 4;
    case GGUF_VT_U64: case GGUF_VT_I64: case GGUF_VT_F64: return 8;
    default: return 0;
    }
}

static int gguf_parse_str_arr(gguf_cursor *c, gguf_arr *a)
{
    /* Each string needs at least its 8-byte length: bound n before allocating. */
    if (a->n > (c->size - c->pos) / 8) {
        gguf_set_err(c->err, c->errlen,
                     "truncated: %s: string array of %llu entries cannot fit in %llu bytes at offset %llu",
                     c->what, (unsigned long long)a->n, (unsigned long long)(c->size - c->pos),
                     (unsigned long long)c->pos);
        return -1;
    }
    a->base = c->p + c->pos;
    a->data = a->base;
    if (a->n == 0)
        return 0;
    uint64_t *off = malloc((a->n + GGUF_STR_STRIDE - 1) / GGUF_STR_STRIDE * sizeof *off);
    if (!off) {
        gguf_set_err(c->err, c->errlen, "out of memory: %s", c->what);
        return -1;
    }
    uint64_t start = c->pos;
    for (uint64_t i = 0; i < a->n; i++) {
        gguf_str s;
        if (i % GGUF_STR_STRIDE == 0)
            off[i / GGUF_STR_STRIDE] = c->pos - start;
        if (cur_str(c, &s)) {
            size_t l = strlen(c->err ? c->err : "");
            gguf_set_err(c->err ? c->err + l : NULL, c->errlen > l ? c->errlen - l : 0,
                         " (string %llu)", (unsigned long long)i);
            free(off);
            return -1;
        }
    }
    a->str_off = off;
    return 0;
}

static int gguf_parse_arr(gguf_cursor *c, gguf_arr *a)
{
    if (cur_u32(c, &a->elem_type) || cur_u64(c, &a->n))
        return -1;
    if (a->elem_type == GGUF_VT_ARR) {
        gguf_set_err(c->err, c->errlen, "%s: nested arrays are not supported (at offset %llu)",
                     c->what, (unsigned long long)c->pos);
        return -1;
    }
    if (a->elem_type == GGUF_VT_STR)
        return gguf_parse_str_arr(c, a);
    uint64_t es = gguf_vtype_size(a->elem_type);
    if (es == 0) {
        gguf_set_err(c->err, c->errlen, "%s: unknown array element type %u at offset %llu",
                     c->what, a->elem_type, (unsigned long long)(c->pos - 12));
        return -1;
    }
    if (a->n > (c->size - c->pos) / es) {
        gguf_set_err(c->err, c->errlen,
                     "truncated: %s: array of %llu %llu-byte entries needs more than the %llu bytes left at offset %llu",
                     c->what, (unsigned long long)a->n, (unsigned long long)es,
                     (unsigned long long)(c->size - c->pos), (unsigned long long)c->pos);
        return -1;
    }
    a->data = c->p + c->pos;
    c->pos += a->n * es;
    return 0;
}

static int gguf_parse_kv(gguf_cursor *c, int64_t i, gguf_kv_entry *e)
{
    char show[64];
    snprintf(c->what, sizeof c->what, "kv %lld key", (long long)i);
    if (cur_str(c, &e->key))
        return -1;
    if (e->key.len == 0 || e->key.len > GGUF_MAX_KEY_LEN) {
        gguf_set_err(c->err, c->errlen, "kv %lld: key length %llu outside 1..%u at offset %llu",
                     (long long)i, (unsigned long long)e->key.len, GGUF_MAX_KEY_LEN,
                     (unsigned long long)(c->pos - e->key.len - 8));
        return -1;
    }
    snprintf(c->what, sizeof c->what, "kv %lld (key '%s')", (long long)i,
             gguf_show(show, sizeof show, e->key.ptr, e->key.len));
    if (cur_u32(c, &e->type))
        return -1;
    uint64_t start = c->pos;
    e->val = c->p + start;
    if (e->type == GGUF_VT_STR) {
        gguf_str s;
        if (cur_str(c, &s))
            return -1;
    } else if (e->type == GGUF_VT_ARR) {
        if (gguf_parse_arr(c, &e->arr))
            return -1;
    } else {
        uint64_t sz = gguf_vtype_size(e->type);
        if (sz == 0) {
            gguf_set_err(c->err, c->errlen, "%s has unknown value type %u at offset %llu",
                         c->what, e->type, (unsigned long long)(c->pos - 4));
            return -1;
        }
        if (cur_need(c, sz))
            return -1;
        c->pos += sz;
    }
    e->val_len = c->pos - start;
    return 0;
}

/* ==== Name index (sorted) ==== */

static int gguf_name_cmp(const char *a, uint64_t alen, const char *b, uint64_t blen)
{
    uint64_t n = alen < blen ? alen : blen;
    int c = n ? memcmp(a, b, (size_t)n) : 0;
    if (c)
        return c;
    return alen < blen ? -1 : alen > blen;
}

static int gguf_ref_cmp(const void *x, const void *y)
{
    const gguf_name_ref *a = x, *b = y;
    int c = gguf_name_cmp(a->ptr, a->len, b->ptr, b->len);
    if (c)
        return c;
    return a->idx < b->idx ? -1 : a->idx > b->idx;   /* equal names: file order */
}

/* Sort the index; on a duplicate name set *first and *second to the two entries'
 * indices (file order) and return -1. */
static int gguf_index_build(gguf_name_ref *ix, uint64_t n, int64_t *first, int64_t *second)
{
    if (n > 1)
        qsort(ix, (size_t)n, sizeof *ix, gguf_ref_cmp);
    int64_t best = -1;
    for (uint64_t i = 1; i < n; i++) {
        /* Report the duplicate that comes first in the file. */
        if (gguf_name_cmp(ix[i - 1].ptr, ix[i - 1].len, ix[i].ptr, ix[i].len) == 0
            && (best < 0 || ix[i].idx < ix[best].idx))
            best = (int64_t)i;
    }
    if (best < 0)
        return 0;
    *first = ix[best - 1].idx;
    *second = ix[best].idx;
    return -1;
}

static int64_t gguf_index_find(const gguf_name_ref *ix, uint64_t n, const char *s, uint64_t len)
{
    uint64_t lo = 0, hi = n;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        int c = gguf_name_cmp(ix[mid].ptr, ix[mid].len, s, len);
        if (c == 0)
            return ix[mid].idx;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return -1;
}

/* ==== Header parsing ==== */

static int gguf_parse_header(gguf_file *f, gguf_cursor *c)
{
    uint64_t n_t, n_kv;
    snprintf(c->what, sizeof c->what, "header");
    if (cur_need(c, 4))
        return -1;
    if (memcmp(c->p, "GGUF", 4) != 0) {
        gguf_set_err(c->err, c->errlen, "not a GGUF file: magic is %02x %02x %02x %02x, expected \"GGUF\"",
                     c->p[0], c->p[1], c->p[2], c->p[3]);
        return -1;
    }
    c->pos = 4;
    if (cur_u32(c, &f->version))
        return -1;
    if (f->version != 2 && f->version != 3) {
        uint32_t v = f->version, sw = __builtin_bswap32(v);
        gguf_set_err(c->err, c->errlen, "unsupported GGUF version %u (only 2 and 3 are read)%s", v,
                     (sw == 2 || sw == 3) ? "; this looks like a big-endian file" :
                     v == 1 ? "; version 1 used 32-bit counts" : "");
        return -1;
    }
    if (cur_u64(c, &n_t) || cur_u64(c, &n_kv))
        return -1;
    uint64_t left = c->size - c->pos;
    if (n_kv > left / GGUF_KV_MIN_BYTES || n_kv > GGUF_MAX_COUNT) {
        gguf_set_err(c->err, c->errlen,
                     "truncated or corrupt header: n_kv %llu is impossible, the %llu bytes after the header hold at most %llu",
                     (unsigned long long)n_kv, (unsigned long long)left,
                     (unsigned long long)(left / GGUF_KV_MIN_BYTES));
        return -1;
    }
    left -= n_kv * GGUF_KV_MIN_BYTES;
    if (n_t > left / GGUF_TINFO_MIN_BYTES || n_t > GGUF_MAX_COUNT) {
        gguf_set_err(c->err, c->errlen,
                     "truncated or corrupt header: n_tensors %llu is impossible, the %llu bytes left after %llu kvs hold at most %llu",
                     (unsigned long long)n_t, (unsigned long long)left, (unsigned long long)n_kv,
                     (unsigned long long)(left / GGUF_TINFO_MIN_BYTES));
        return -1;
    }
    f->n_kv = (int64_t)n_kv;
    f->n_tensors = (int64_t)n_t;
    return 0;
}

static int gguf_parse_kvs(gguf_file *f, gguf_cursor *c)
{
    size_t n = f->n_kv ? (size_t)f->n_kv : 1;
    f->kv = calloc(n, sizeof *f->kv);
    f->kv_index = calloc(n, sizeof *f->kv_index);
    if (!f->kv || !f->kv_index) {
        gguf_set_err(c->err, c->errlen, "out of memory for %lld kvs", (long long)f->n_kv);
        return -1;
    }
    for (int64_t i = 0; i < f->n_kv; i++) {
        if (gguf_parse_kv(c, i, &f->kv[i]))
            return -1;
        f->kv_index[i] = (gguf_name_ref){ f->kv[i].key.ptr, f->kv[i].key.len, (uint32_t)i };
    }
    int64_t a, b;
    if (gguf_index_build(f->kv_index, (uint64_t)f->n_kv, &a, &b)) {
        char show[64];
        gguf_set_err(c->err, c->errlen, "kv %lld (key '%s') duplicates kv %lld", (long long)b,
                     gguf_show(show, sizeof show, f->kv[b].key.ptr, f->kv[b].key.len), (long long)a);
        return -1;
    }
    return 0;
}

static int gguf_read_alignment(gguf_file *f, char *err, size_t errlen)
{
    f->alignment = GGUF_DEFAULT_ALIGN;
    int64_t i = gguf_find_kv(f, "general.alignment");
    if (i < 0)
        return 0;
    const gguf_kv_entry *e = &f->kv[i];
    if (e->type != GGUF_VT_U32) {
        gguf_set_err(err, errlen, "general.alignment has value type %u, expected U32 (4)", e->type);
        return -1;
    }
    uint32_t a = gguf_load_u32(e->val);
    if (!gguf_alignment_ok(a)) {
        gguf_set_err(err, errlen, "general.alignment = %u is not a power of two >= 8 (GGUF requires a multiple of 8)", a);
        return -1;
    }
    f->alignment = a;
    return 0;
}

static int gguf_parse_tinfo(gguf_cursor *c, int64_t i, gguf_tensor *t)
{
    char show[64];
    const char *why = NULL;
    snprintf(c->what, sizeof c->what, "tensor info %lld name", (long long)i);
    if (cur_str(c, &t->name))
        return -1;
    if (t->name.len == 0 || t->name.len > GGUF_MAX_TENSOR_NAME) {
        gguf_set_err(c->err, c->errlen, "tensor info %lld: name length %llu outside 1..%u at offset %llu",
                     (long long)i, (unsigned long long)t->name.len, GGUF_MAX_TENSOR_NAME,
                     (unsigned long long)(c->pos - t->name.len - 8));
        return -1;
    }
    gguf_show(show, sizeof show, t->name.ptr, t->name.len);
    snprintf(c->what, sizeof c->what, "tensor info %lld (name '%s')", (long long)i, show);
    if (cur_u32(c, &t->n_dims))
        return -1;
    if (t->n_dims < 1 || t->n_dims > 4) {
        gguf_set_err(c->err, c->errlen, "tensor '%s' has n_dims %u, expected 1..4", show, t->n_dims);
        return -1;
    }
    for (uint32_t d = 0; d < 4; d++) {
        t->ne[d] = 1;
        if (d < t->n_dims && cur_u64(c, &t->ne[d]))
            return -1;
    }
    if (cur_u32(c, &t->type) || cur_u64(c, &t->offset))
        return -1;
    if (!gguf_type_geometry(t->type, NULL, NULL)) {
        gguf_set_err(c->err, c->errlen, "tensor '%s' has unknown type %u", show, t->type);
        return -1;
    }
    if (gguf_tensor_size(t->type, t->n_dims, t->ne, &t->nbytes, &why)) {
        gguf_set_err(c->err, c->errlen,
                     "tensor '%s' (%s, shape [%llu, %llu, %llu, %llu]): %s", show,
                     gguf_type_name(t->type), (unsigned long long)t->ne[0],
                     (unsigned long long)t->ne[1], (unsigned long long)t->ne[2],
                     (unsigned long long)t->ne[3], why);
        return -1;
    }
    return 0;
}

static int gguf_parse_tinfos(gguf_file *f, gguf_cursor *c)
{
    size_t n = f->n_tensors ? (size_t)f->n_tensors : 1;
    f->tensors = calloc(n, sizeof *f->tensors);
    f->t_index = calloc(n, sizeof *f->t_index);
    if (!f->tensors || !f->t_index) {
        gguf_set_err(c->err, c->errlen, "out of memory for %lld tensors", (long long)f->n_tensors);
        return -1;
    }
    for (int64_t i = 0; i < f->n_tensors; i++) {
        gguf_tensor *t = &f->tensors[i];
        if (gguf_parse_tinfo(c, i, t))
            return -1;
        f->t_index[i] = (gguf_name_ref){ t->name.ptr, t->name.len, (uint32_t)i };
    }
    int64_t a, b;
    if (gguf_index_build(f->t_index, (uint64_t)f->n_tensors, &a, &b)) {
        char show[64];
        gguf_set_err(c->err, c->errlen, "tensor info %lld (name '%s') duplicates the name of tensor %lld",
                     (long long)b, gguf_show(show, sizeof show, f->tensors[b].name.ptr, f->tensors[b].name.len),
                     (long long)a);
        return -1;
    }
    return 0;
}

/* Locate the data section and check every tensor's range inside it. */
static int gguf_place_data(gguf_file *f, gguf_cursor *c)
{
    uint64_t pad = (f->alignment - c->pos % f->alignment) % f->alignment;
    if (f->n_tensors == 0) {
        f->data_off = (c->size - c->pos < pad) ? c->size : c->pos + pad;
        return 0;
    }
    snprintf(c->what, sizeof c->what, "padding before the data section");
    if (cur_need(c, pad))
        return -1;
    f->data_off = c->pos + pad;
    uint64_t avail = c->size - f->data_off;
    for (int64_t i = 0; i < f->n_tensors; i++) {
        gguf_tensor *t = &f->tensors[i];
        char show[64];
        gguf_show(show, sizeof show, t->name.ptr, t->name.len);
        if (t->offset % f->alignment != 0) {
            gguf_set_err(c->err, c->errlen, "tensor '%s' data offset %llu is not a multiple of the alignment %llu",
                         show, (unsigned long long)t->offset, (unsigned long long)f->alignment);
            return -1;
        }
        if (t->offset > avail || t->nbytes > avail - t->offset) {
            uint64_t end_hi = t->offset > avail ? t->offset - avail : 0;
            uint64_t need = end_hi + (t->offset > avail ? t->nbytes : t->nbytes - (avail - t->offset));
            gguf_set_err(c->err, c->errlen,
                         "truncated: tensor '%s' data (offset %llu, %llu bytes) needs %llu more bytes past the end of the file (data section at %llu holds %llu bytes)",
                         show, (unsigned long long)t->offset, (unsigned long long)t->nbytes,
                         (unsigned long long)need, (unsigned long long)f->data_off,
                         (unsigned long long)avail);
            return -1;
        }
        t->data = f->base + f->data_off + t->offset;
    }
    return 0;
}

/* ==== Open / close ==== */

static void gguf_free_parsed(gguf_file *f)
{
    if (f->kv) {
        for (int64_t i = 0; i < f->n_kv; i++)
            free((void *)f->kv[i].arr.str_off);
    }
    free(f->kv);
    free(f->tensors);
    free(f->kv_index);
    free(f->t_index);
}

static int gguf_parse(gguf_file *f, char *err, size_t errlen)
{
    gguf_cursor c = { .p = f->base, .size = f->size, .pos = 0, .err = err, .errlen = errlen };
    if (gguf_parse_header(f, &c) || gguf_parse_kvs(f, &c) || gguf_read_alignment(f, err, errlen)
        || gguf_parse_tinfos(f, &c) || gguf_place_data(f, &c))
        return -1;
    return 0;
}

int gguf_open_memory(gguf_file **out, const void *data, size_t size, char *err, size_t errlen)
{
    static const uint8_t empty[1] = {0};
    if (!out)
        return -1;
    *out = NULL;
    gguf_file *f = calloc(1, sizeof *f);
    if (!f) {
        gguf_set_err(err, errlen, "out of memory");
        return -1;
    }
    f->base = data ? data : empty;
    f->size = data ? size : 0;
    if (gguf_parse(f, err, errlen)) {
        gguf_free_parsed(f);
        free(f);
        return -1;
    }
    *out = f;
    return 0;
}

int gguf_open_file(gguf_file **out, const char *path, char *err, size_t errlen)
{
    if (!out)
        return -1;
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        gguf_set_err(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        gguf_set_err(err, errlen, "%s: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    if (S_ISDIR(st.st_mode) || !S_ISREG(st.st_mode)) {   /* mmap would say "No such device" */
        gguf_set_err(err, errlen, "%s: %s", path, S_ISDIR(st.st_mode) ? "is a directory, not a GGUF file" : "not a regular file");
        close(fd);
        return -1;
    }
    if (st.st_size <= 0) {
        gguf_set_err(err, errlen, "%s: file is empty", path);
        close(fd);
        return -1;
    }
    size_t size = (size_t)st.st_size;
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) {
        gguf_set_err(err, errlen, "%s: mmap: %s", path, strerror(errno));
        return -1;
    }
    gguf_file *f = NULL;
    if (gguf_open_memory(&f, map, size, err, errlen)) {
        if (err && errlen) {   /* prefix the path */
            char tmp[512];
            snprintf(tmp, sizeof tmp, "%s", err);
            gguf_set_err(err, errlen, "%s: %s", path, tmp);
        }
        munmap(map, size);
        return -1;
    }
    f->mapped = 1;
    *out = f;
    return 0;
}

void gguf_close(gguf_file *f)
{
    if (!f)
        return;
    gguf_free_parsed(f);
    if (f->mapped)
        munmap((void *)f->base, (size_t)f->size);
    free(f);
}

uint32_t gguf_get_version(const gguf_file *f) { return f->version; }
uint64_t gguf_get_alignment(const gguf_file *f) { return f->alignment; }
const void *gguf_get_base(const gguf_file *f) { return f->base; }
uint64_t gguf_get_size(const gguf_file *f) { return f->size; }
uint64_t gguf_get_data_offset(const gguf_file *f) { return f->data_off; }

/* ==== Metadata access ==== */

int64_t gguf_count_kv(const gguf_file *f) { return f ? f->n_kv : 0; }

int64_t gguf_find_kv(const gguf_file *f, const char *key)
{
    if (!f || !key)
        return -1;
    return gguf_index_find(f->kv_index, (uint64_t)f->n_kv, key, strlen(key));
}

gguf_str gguf_kv_key(const gguf_file *f, int64_t i)
{
    gguf_str none = { "", 0 };
    if (!f || i < 0 || i >= f->n_kv)
        return none;
    return f->kv[i].key;
}

uint32_t gguf_kv_type(const gguf_file *f, int64_t i)
{
    if (!f || i < 0 || i >= f->n_kv)
        return UINT32_MAX;
    return f->kv[i].type;
}

static const gguf_kv_entry *gguf_lookup(const gguf_file *f, const char *key)
{
    int64_t i = gguf_find_kv(f, key);
    return i < 0 ? NULL : &f->kv[i];
}

/* Integer value of a scalar kv as a sign flag and magnitude-preserving pair:
 * returns 0 and sets *neg / *mag, or -1 if the kv is not an integer. */
static int gguf_int_value(const gguf_kv_entry *e, int *neg, uint64_t *mag)
{
    const uint8_t *p = e->val;
    int64_t s;
    *neg = 0;
    switch (e->type) {
    case GGUF_VT_U8:  *mag = p[0]; return 0;
    case GGUF_VT_U16: *mag = (uint64_t)p[0] | (uint64_t)p[1] << 8; return 0;
    case GGUF_VT_U32: *mag = gguf_load_u32(p); return 0;
    case GGUF_VT_U64: *mag = gguf_load_u64(p); return 0;
    case GGUF_VT_I8:  s = (int8_t)p[0]; break;
    case GGUF_VT_I16: s = (int16_t)(uint16_t)((uint16_t)p[0] | (uint16_t)p[1] << 8); break;
    case GGUF_VT_I32: s = (int32_t)gguf_load_u32(p); break;
    case GGUF_VT_I64: s = (int64_t)gguf_load_u64(p); break;
    default: return -1;
    }
    *neg = s < 0;
    *mag = s < 0 ? (uint64_t)0 - (uint64_t)s : (uint64_t)s;
    return 0;
}

int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out)
{
    const gguf_kv_entry *e = gguf_lookup(f, key);
    int neg;
    uint64_t m;
    if (!e)
        return -1;
    if (gguf_int_value(e, &neg, &m) || neg || m > UINT32_MAX)
        return -2;
    *out = (uint32_t)m;
    return 0;
}

int gguf_get_i64(const gguf_file *f, const char *key, int64_t *out)
{
    const gguf_kv_entry *e = gguf_lookup(f, key);
    int neg;
    uint64_t m;
    if (!e)
        return -1;
    if (gguf_int_value(e, &neg, &m))
        return -2;
    if (!neg && m > (uint64_t)INT64_MAX)
        return -2;
    *out = neg ? (int64_t)(0 - m) : (int64_t)m;   /* m <= 2^63 here; 0-m wraps to INT64_MIN at most */
    return 0;
}

int gguf_get_f32(const gguf_file *f, const char *key, float *out)
{
    const gguf_kv_entry *e = gguf_lookup(f, key);
    if (!e)
        return -1;
    if (e->type == GGUF_VT_F32) {
        uint32_t u = gguf_load_u32(e->val);
        memcpy(out, &u, 4);
        return 0;
    }
    if (e->type == GGUF_VT_F64) {
        uint64_t u = gguf_load_u64(e->val);
        double d;
        memcpy(&d, &u, 8);
        if (isfinite(d) && fabs(d) > FLT_MAX)
            return -2;   /* converting it would be undefined */
        *out = (float)d;
        return 0;
    }
    return -2;
}

int gguf_get_bool(const gguf_file *f, const char *key, int *out)
{
    const gguf_kv_entry *e = gguf_lookup(f, key);
    if (!e)
        return -1;
    if (e->type != GGUF_VT_BOOL)
        return -2;
    *out = e->val[0] != 0;
    return 0;
}

int gguf_get_str(const gguf_file *f, const char *key, gguf_str *out)
{
    const gguf_kv_entry *e = gguf_lookup(f, key);
    if (!e)
        return -1;
    if (e->type != GGUF_VT_STR)
        return -2;
    out->len = gguf_load_u64(e->val);
    out->ptr = (const char *)e->val + 8;
    return 0;
}

int gguf_get_arr(const gguf_file *f, const char *key, gguf_arr *out)
{
    const gguf_kv_entry *e = gguf_lookup(f, key);
    if (!e)
        return -1;
    if (e->type != GGUF_VT_ARR)
        return -2;
    *out = e->arr;
    return 0;
}

int gguf_arr_str(const gguf_arr *a, uint64_t i, gguf_str *out)
{
    if (!a || a->elem_type != GGUF_VT_STR || i >= a->n || !a->str_off || !a->base)
        return -1;
    /* every string was bounds-checked at open: walking from the nearest
     * indexed one stays inside the array */
    const uint8_t *p = a->base + a->str_off[i / GGUF_STR_STRIDE];
    for (uint64_t k = i % GGUF_STR_STRIDE; k > 0; k--)
        p += 8 + gguf_load_u64(p);
    out->len = gguf_load_u64(p);
    out->ptr = (const char *)p + 8;
    return 0;
}

void gguf_str_iter_init(gguf_str_iter *it, const gguf_arr *a)
{
    *it = (gguf_str_iter){ a, 0, 0 };
}

int gguf_str_iter_next(gguf_str_iter *it, gguf_str *out)
{
    const gguf_arr *a = it->a;
    if (!a || a->elem_type != GGUF_VT_STR || it->i >= a->n || !a->str_off || !a->base)
        return -1;
    const uint8_t *p = a->base + it->off;   /* checked at open, as every string */
    out->len = gguf_load_u64(p);
    out->ptr = (const char *)p + 8;
    it->off += 8 + out->len;
    it->i++;
    return 0;
}

/* ==== Tensor access ==== */

int64_t gguf_count_tensors(const gguf_file *f) { return f ? f->n_tensors : 0; }

const gguf_tensor *gguf_get_tensor(const gguf_file *f, int64_t i)
{
    if (!f || i < 0 || i >= f->n_tensors)
        return NULL;
    return &f->tensors[i];
}

const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name)
{
    if (!f || !name)
        return NULL;
    int64_t i = gguf_index_find(f->t_index, (uint64_t)f->n_tensors, name, strlen(name));
    return i < 0 ? NULL : &f->tensors[i];
}

/* ==== Writer ==== */

typedef struct {
    char *key;
    uint32_t type;
    uint8_t *val;      /* the value's encoding, exactly as written after the type */
    size_t val_len;
} gguf_wkv;

typedef struct {
    char *name;
    uint32_t type, n_dims;
    uint64_t ne[4];
    uint64_t nbytes;
    const void *data;
} gguf_wtensor;

struct gguf_writer {
    uint32_t alignment;
    int has_align_kv;
    gguf_wkv *kv;
    size_t n_kv, cap_kv;
    gguf_wtensor *t;
    size_t n_t, cap_t;
};

/* Growable byte buffer for value encodings. */
static void buf_u32(strbuf *b, uint32_t v)
{
    uint8_t x[4] = { (uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24) };
    strbuf_put(b, x, 4);
}

static void buf_u64(strbuf *b, uint64_t v)
{
    buf_u32(b, (uint32_t)v);
    buf_u32(b, (uint32_t)(v >> 32));
}

gguf_writer *gguf_writer_new(uint32_t alignment)
{
    if (alignment == 0)
        alignment = GGUF_DEFAULT_ALIGN;
    if (!gguf_alignment_ok(alignment))
        return NULL;
    gguf_writer *w = calloc(1, sizeof *w);
    if (w)
        w->alignment = alignment;
    return w;
}

void gguf_writer_free(gguf_writer *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kv[i].key);
        free(w->kv[i].val);
    }
    for (size_t i = 0; i < w->n_t; i++)
        free(w->t[i].name);
    free(w->kv);
    free(w->t);
    free(w);
}

static int gguf_writer_has_key(const gguf_writer *w, const char *key)
{
    for (size_t i = 0; i < w->n_kv; i++)
        if (strcmp(w->kv[i].key, key) == 0)
            return 1;
    return 0;
}

/* Takes ownership of val (freed on failure). */
static int gguf_writer_push(gguf_writer *w, const char *key, uint32_t type, strbuf *val)
{
    size_t klen = key ? strlen(key) : 0;
    if (!w || val->oom || klen == 0 || klen > GGUF_MAX_KEY_LEN || gguf_writer_has_key(w, key))
        goto fail;
    if (strcmp(key, "general.alignment") == 0) {
        /* The file's alignment follows this key: it must be a valid U32. */
        uint32_t a = type == GGUF_VT_U32 && val->len == 4 ? gguf_load_u32((const uint8_t *)val->p) : 0;
        if (!gguf_alignment_ok(a))
            goto fail;
        w->alignment = a;
        w->has_align_kv = 1;
    }
    if (w->n_kv == w->cap_kv) {
        size_t cap = w->cap_kv ? 2 * w->cap_kv : 16;
        gguf_wkv *kv = realloc(w->kv, cap * sizeof *kv);
        if (!kv)
            goto fail;
        w->kv = kv;
        w->cap_kv = cap;
    }
    char *k = strdup(key);
    if (!k)
        goto fail;
    w->kv[w->n_kv++] = (gguf_wkv){ k, type, (uint8_t *)val->p, val->len };
    return 0;
fail:
    strbuf_free(val);
    return -1;
}

static int gguf_writer_add_scalar(gguf_writer *w, const char *key, uint32_t type, uint64_t bits)
{
    strbuf b = {0};
    uint64_t n = gguf_vtype_size(type);
    for (uint64_t i = 0; i < n; i++) {
        uint8_t x = (uint8_t)(bits >> (8 * i));
        strbuf_put(&b, &x, 1);
    }
    return gguf_writer_push(w, key, type, &b);
}

int gguf_writer_add_u32(gguf_writer *w, const char *key, uint32_t v)
{
    return gguf_writer_add_scalar(w, key, GGUF_VT_U32, v);
}

int gguf_writer_add_i32(gguf_writer *w, const char *key, int32_t v)
{
    return gguf_writer_add_scalar(w, key, GGUF_VT_I32, (uint32_t)v);
}

int gguf_writer_add_f32(gguf_writer *w, const char *key, float v)
{
    uint32_t u;
    memcpy(&u, &v, 4);
    return gguf_writer_add_scalar(w, key, GGUF_VT_F32, u);
}

int gguf_writer_add_bool(gguf_writer *w, const char *key, int v)
{
    return gguf_writer_add_scalar(w, key, GGUF_VT_BOOL, v ? 1 : 0);
}

int gguf_writer_add_str(gguf_writer *w, const char *key, const char *v)
{
    if (!v)
        return -1;
    strbuf b = {0};
    size_t n = strlen(v);
    buf_u64(&b, n);
    strbuf_put(&b, v, n);
    return gguf_writer_push(w, key, GGUF_VT_STR, &b);
}

int gguf_writer_add_arr(gguf_writer *w, const char *key, uint32_t elem_type, const void *data, uint64_t n)
{
    uint64_t es = gguf_vtype_size(elem_type);
    if (es == 0 || (n && !data) || n > SIZE_MAX / es)
        return -1;
    strbuf b = {0};
    buf_u32(&b, elem_type);
    buf_u64(&b, n);
    strbuf_put(&b, data, (size_t)(n * es));   /* host is little-endian (x86-64, arm64) */
    return gguf_writer_push(w, key, GGUF_VT_ARR, &b);
}

int gguf_writer_add_str_arr(gguf_writer *w, const char *key, const char *const *v, const uint64_t *lens, uint64_t n)
{
    if (n && !v)
        return -1;
    strbuf b = {0};
    buf_u32(&b, GGUF_VT_STR);
    buf_u64(&b, n);
    for (uint64_t i = 0; i < n; i++) {
        uint64_t len = lens ? lens[i] : (v[i] ? strlen(v[i]) : 0);
        if (len && !v[i]) {
            strbuf_free(&b);
            return -1;
        }
        buf_u64(&b, len);
        strbuf_put(&b, v[i], (size_t)len);
    }
    return gguf_writer_push(w, key, GGUF_VT_ARR, &b);
}

int gguf_writer_copy_kv(gguf_writer *w, const gguf_file *src, int64_t i)
{
    if (!w || !src || i < 0 || i >= src->n_kv)
        return -1;
    const gguf_kv_entry *e = &src->kv[i];
    char *key = malloc((size_t)e->key.len + 1);
    if (!key)
        return -1;
    memcpy(key, e->key.ptr, (size_t)e->key.len);
    key[e->key.len] = 0;
    /* A key with an embedded NUL cannot be represented by this API. */
    if (strlen(key) != e->key.len) {
        free(key);
        return -1;
    }
    /* The validated value encoding is copied byte for byte. */
    strbuf b = {0};
    strbuf_put(&b, e->val, (size_t)e->val_len);
    int rc = gguf_writer_push(w, key, e->type, &b);
    free(key);
    return rc;
}

int gguf_writer_add_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                           const uint64_t *ne, const void *data)
{
    const char *why;
    uint64_t dims[4] = {1, 1, 1, 1}, nbytes;
    size_t nlen = name ? strlen(name) : 0;
    if (!w || !ne || nlen == 0 || nlen > GGUF_MAX_TENSOR_NAME || n_dims < 1 || n_dims > 4)
        return -1;
    for (uint32_t d = 0; d < n_dims; d++)
        dims[d] = ne[d];
    if (gguf_tensor_size(type, n_dims, dims, &nbytes, &why) || (!data && nbytes))
        return -1;
    for (size_t i = 0; i < w->n_t; i++)
        if (strcmp(w->t[i].name, name) == 0)
            return -1;
    if (w->n_t == w->cap_t) {
        size_t cap = w->cap_t ? 2 * w->cap_t : 64;
        gguf_wtensor *t = realloc(w->t, cap * sizeof *t);
        if (!t)
            return -1;
        w->t = t;
        w->cap_t = cap;
    }
    char *nm = strdup(name);
    if (!nm)
        return -1;
    gguf_wtensor *t = &w->t[w->n_t++];
    *t = (gguf_wtensor){ .name = nm, .type = type, .n_dims = n_dims, .nbytes = nbytes, .data = data };
    memcpy(t->ne, dims, sizeof dims);
    return 0;
}

/* ---- save ---- */

typedef struct { FILE *fp; uint64_t pos; int bad; } gguf_out;

static void out_put(gguf_out *o, const void *p, size_t n)
{
    if (o->bad || n == 0)
        return;
    if (fwrite(p, 1, n, o->fp) != n)
        o->bad = 1;
    o->pos += n;
}

static void out_u32(gguf_out *o, uint32_t v)
{
    uint8_t x[4] = { (uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24) };
    out_put(o, x, 4);
}

static void out_u64(gguf_out *o, uint64_t v)
{
    out_u32(o, (uint32_t)v);
    out_u32(o, (uint32_t)(v >> 32));
}

static void out_pad(gguf_out *o, uint64_t align)
{
    static const uint8_t zeros[64];
    uint64_t pad = (align - o->pos % align) % align;
    while (pad > 0) {
        size_t n = pad < sizeof zeros ? (size_t)pad : sizeof zeros;
        out_put(o, zeros, n);
        pad -= n;
    }
}

static void gguf_writer_emit_meta(const gguf_writer *w, gguf_out *o, int auto_align)
{
    out_put(o, "GGUF", 4);
    out_u32(o, GGUF_VERSION_WRITE);
    out_u64(o, w->n_t);
    out_u64(o, w->n_kv + (auto_align ? 1 : 0));
    for (size_t i = 0; i < w->n_kv; i++) {
        size_t kl = strlen(w->kv[i].key);
        out_u64(o, kl);
        out_put(o, w->kv[i].key, kl);
        out_u32(o, w->kv[i].type);
        out_put(o, w->kv[i].val, w->kv[i].val_len);
    }
    if (auto_align) {
        static const char k[] = "general.alignment";
        out_u64(o, sizeof k - 1);
        out_put(o, k, sizeof k - 1);
        out_u32(o, GGUF_VT_U32);
        out_u32(o, w->alignment);
    }
    uint64_t off = 0;
    for (size_t i = 0; i < w->n_t; i++) {
        const gguf_wtensor *t = &w->t[i];
        size_t nl = strlen(t->name);
        out_u64(o, nl);
        out_put(o, t->name, nl);
        out_u32(o, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++)
            out_u64(o, t->ne[d]);
        out_u32(o, t->type);
        out_u64(o, off);
        off += t->nbytes + (w->alignment - t->nbytes % w->alignment) % w->alignment;
    }
    out_pad(o, w->alignment);
}

int gguf_writer_save(gguf_writer *w, const char *path, char *err, size_t errlen)
{
    if (!w || !path) {
        gguf_set_err(err, errlen, "gguf_writer_save: no writer or path");
        return -1;
    }
    gguf_out o = { fopen(path, "wb"), 0, 0 };
    if (!o.fp) {
        gguf_set_err(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    /* general.alignment is written only when it differs from the default
     * (or when the caller added it explicitly). */
    int auto_align = !w->has_align_kv && w->alignment != GGUF_DEFAULT_ALIGN;
    gguf_writer_emit_meta(w, &o, auto_align);
    for (size_t i = 0; i < w->n_t && !o.bad; i++) {
        const uint8_t *p = w->t[i].data;
        for (uint64_t left = w->t[i].nbytes; left > 0 && !o.bad;) {
            size_t n = left > (1u << 26) ? (1u << 26) : (size_t)left;
            out_put(&o, p, n);
            p += n;
            left -= n;
        }
        out_pad(&o, w->alignment);
    }
    int bad = o.bad;
    int e = errno;
    if (fclose(o.fp) != 0 && !bad) {
        bad = 1;
        e = errno;
    }
    if (bad) {
        gguf_set_err(err, errlen, "%s: write failed: %s", path, strerror(e));
        remove(path);
        return -1;
    }
    return 0;
}
