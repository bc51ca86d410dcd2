/* gguf_writer.c - the GGUF v3 writer (see gguf.h): metadata and tensor infos
 * collected in memory, then header, padding and tensor data streamed to the
 * file by gguf_writer_save(). */

#include "engine/gguf.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/strbuf.h"

#include "engine/gguf_internal.h"

#define GGUF_VERSION_WRITE    3u

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
