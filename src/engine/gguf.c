/* gguf.c - bounds-checked GGUF (v2, v3) reader over mmap: type geometry,
 * parsing and validation, open and close (gguf_access.c reads what it
 * parsed, gguf_writer.c writes files; gguf_internal.h between them).
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

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/gguf_internal.h"

/* ==== Limits ==== */
/* Smallest encodings, used to bound counts by the bytes left in the file:
 * a kv is key length (8) + a 1-byte key + type (4) + a 1-byte value; a tensor
 * info is name length (8) + a 1-byte name + n_dims (4) + one ne (8) + type (4)
 * + offset (8). */
#define GGUF_KV_MIN_BYTES     14u
#define GGUF_TINFO_MIN_BYTES  33u
/* Index entries hold 32-bit indices; real files have < 100 keys and < 10^4 tensors. */
#define GGUF_MAX_COUNT        (1u << 28)

/* ==== Small helpers ==== */

void gguf_set_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (!err || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

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
int gguf_tensor_size(uint32_t type, uint32_t n_dims, const uint64_t *ne,
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

uint64_t gguf_vtype_size(uint32_t t)
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

int64_t gguf_index_find(const gguf_name_ref *ix, uint64_t n, const char *s, uint64_t len)
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
