/* gguf_access.c - metadata and tensor access on a parsed GGUF file: keys,
 * typed getters (any integer type whose value fits, F32 or F64), string
 * arrays by index or in order, tensors by index or name. Everything read here
 * was checked at open (gguf.c). */

#include "engine/gguf.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "engine/gguf_internal.h"

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
