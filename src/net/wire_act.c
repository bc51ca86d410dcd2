/* wire_act.c - ACT frames (see wire_act.h, docs/wire-protocol.md 4.9). */
#include "net/wire_act.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/gguf.h"
#include "engine/quant.h"

#include "net/wire_internal.h"

uint32_t wire_act_elt_bytes(uint32_t dtype) {
    switch (dtype) {
    case GGML_TYPE_F32: return 4;
    case GGML_TYPE_F16: case GGML_TYPE_BF16: return 2;
    default: return 0;
    }
}

uint32_t wire_act_max_rows(uint32_t dtype, uint32_t dim) {
    uint64_t row = (uint64_t)wire_act_elt_bytes(dtype) * dim;
    if (!row) return 1;
    uint64_t r = (WIRE_MAX_PAYLOAD - WIRE_ACT_FIXED) / row;
    return r < 1 ? 1 : r > 0x7fffffffu ? 0x7fffffffu : (uint32_t)r;
}

int wire_encode_act(wire_buf *b, uint32_t pos0, uint32_t n, uint32_t dtype, uint32_t dim, const float *rows) {
    uint32_t eb = wire_act_elt_bytes(dtype);
    if (!eb || !n || !dim) return -1;
    uint64_t body = (uint64_t)n * dim * eb;
    if (body > WIRE_MAX_PAYLOAD - WIRE_ACT_FIXED) return -1;
    size_t need = b->len + WIRE_ACT_FIXED + (size_t)body;
    if (need > b->cap) {
        uint8_t *p = realloc(b->data, need);
        if (!p) return -1;
        b->data = p;
        b->cap = need;
    }
    uint8_t *p = b->data + b->len;
    put_u32(p + 0, pos0);
    put_u32(p + 4, n);
    put_u32(p + 8, dtype);
    put_u32(p + 12, dim);
    uint8_t *d = p + WIRE_ACT_FIXED;
    if (dtype == GGML_TYPE_F32) {
        memcpy(d, rows, (size_t)body);   /* little-endian hosts only, like the rest of the wire code */
    } else {
        for (uint32_t r = 0; r < n; r++)
            quant_quantize_act_row(dtype, rows + (size_t)r * dim, d + (size_t)r * dim * eb, (int64_t)dim);
    }
    b->len = need;
    return 0;
}

int wire_decode_act(const uint8_t *p, size_t n, wire_act *a, char *err, size_t errlen) {
    if (wire_len_min("ACT", n, WIRE_ACT_FIXED, err, errlen)) return -1;
    wire_act x = { get_u32(p), get_u32(p + 4), get_u32(p + 8), get_u32(p + 12), p + WIRE_ACT_FIXED };
    uint32_t eb = wire_act_elt_bytes(x.dtype);
    if (!eb) { wire_errf(err, errlen, "ACT dtype %u is not F32, F16 or BF16", x.dtype); return -1; }
    if (x.n == 0 || x.dim == 0) { wire_errf(err, errlen, "ACT frame of %u rows of %u elements", x.n, x.dim); return -1; }
    if ((uint64_t)x.pos0 + x.n > 0x7fffffffu) {
        wire_errf(err, errlen, "ACT positions %u..%llu beyond 2^31", x.pos0, (unsigned long long)x.pos0 + x.n);
        return -1;
    }
    uint64_t body = (uint64_t)x.n * x.dim * eb;
    if (body != n - WIRE_ACT_FIXED) {
        wire_errf(err, errlen, "ACT frame size mismatch: %u rows of %u elements need %llu bytes, payload has %zu",
                 x.n, x.dim, (unsigned long long)body, n - WIRE_ACT_FIXED);
        return -1;
    }
    *a = x;
    return 0;
}

void wire_act_rows_f32(const wire_act *a, float *out) {
    if (a->dtype == GGML_TYPE_F32) {
        memcpy(out, a->rows, (size_t)a->n * a->dim * 4);
        return;
    }
    uint32_t eb = wire_act_elt_bytes(a->dtype);
    for (uint32_t r = 0; r < a->n; r++)
        quant_dequantize_row(a->dtype, a->rows + (size_t)r * a->dim * eb, out + (size_t)r * a->dim, (int64_t)a->dim);
}

/* ==== Slice bounds ==== */

/* One bound "L" or "L.5" at s: half blocks, or -1. */
static int act_bound_parse(const char *s, int *used) {
    int v = 0, k = 0;
    while (s[k] >= '0' && s[k] <= '9') {
        v = v * 10 + (s[k] - '0');
        if (++k > 4 || v > WIRE_LAYERS_MAX) return -1;
    }
    if (!k) return -1;
    v *= 2;
    if (s[k] == '.' && s[k + 1] == '5') { v++; k += 2; }
    if (v > 2 * WIRE_LAYERS_MAX) return -1;
    *used = k;
    return v;
}

int wire_layers_parse(const char *s, int *lo, int *hi, int *used) {
    int ka, kb;
    if (!s) return -1;
    int a = act_bound_parse(s, &ka);
    if (a < 0 || s[ka] != ':') return -1;
    int b = act_bound_parse(s + ka + 1, &kb);
    if (b < 0 || b <= a) return -1;
    *lo = a;
    *hi = b;
    *used = ka + 1 + kb;
    return 0;
}

void wire_bound_format(char *buf, size_t len, int bound) {
    snprintf(buf, len, "%d%s", bound / 2, bound % 2 ? ".5" : "");
}

void wire_layers_format(char *buf, size_t len, int lo, int hi) {
    char a[16], b[16];
    wire_bound_format(a, sizeof a, lo);
    wire_bound_format(b, sizeof b, hi);
    snprintf(buf, len, "%s:%s", a, b);
}
