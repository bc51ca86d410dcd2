/* chain_spec.c - chain specs and a slice's advertised bounds (see
 * chain_spec.h). */
#include "net/chain_spec.h"

#include <stdio.h>
#include <string.h>

#include "net/wire_act.h"

/* ==== Specs ==== */

int chain_spec_is(const char *s) { return s && strchr(s, '/') != NULL; }

/* Member p (len bytes, not NUL-terminated) into out->addr[n], lo[n], hi[n],
 * where the slices before it end at `want` (half blocks). */
static int chain_spec_member(const char *p, size_t len, int want, chain_spec *out, char *err, size_t errlen) {
    int shown = (int)(len > 200 ? 200 : len);
    const char *slash = memchr(p, '/', len);
    if (!slash || slash == p || (size_t)(slash - p) >= CHAIN_SPEC_ADDR || !memchr(p, ':', (size_t)(slash - p))) {
        snprintf(err, errlen, "chain entry '%.*s' is not HOST:PORT/A:B", shown, p);
        return -1;
    }
    char range[40];
    size_t rl = len - (size_t)(slash + 1 - p);
    int a, b, k = 0;
    if (rl == 0 || rl >= sizeof range) {
        snprintf(err, errlen, "chain entry '%.*s' has no layers A:B", shown, p);
        return -1;
    }
    memcpy(range, slash + 1, rl);
    range[rl] = 0;
    if (wire_layers_parse(range, &a, &b, &k) || range[k] || wire_layers_kv(a) == wire_layers_kv(b)) {
        snprintf(err, errlen, "chain entry '%.*s': layers must be A:B with 0 <= A < B (end exclusive; L or L.5), "
                 "computing at least one block's attention", shown, p);
        return -1;
    }
    if (a != want) {
        char ta[16], tw[16];
        wire_bound_format(ta, sizeof ta, a);
        wire_bound_format(tw, sizeof tw, want);
        snprintf(err, errlen, "chain entry '%.*s' starts at layer %s, but the slices before it end at %s "
                 "(layers must be %s:B: slices cover the layers in order, each exactly once)", shown, p, ta, tw, tw);
        return -1;
    }
    int i = out->n;
    memcpy(out->addr[i], p, (size_t)(slash - p));
    out->addr[i][slash - p] = 0;
    out->lo[i] = a;
    out->hi[i] = b;
    out->n++;
    return 0;
}

int chain_spec_parse(const char *s, chain_spec *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    const char *p = s;
    int want = 0;
    while (p && *p) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        if (out->n == CHAIN_SPEC_MAX) { snprintf(err, errlen, "a chain has at most %d nodes", CHAIN_SPEC_MAX); return -1; }
        if (chain_spec_member(p, len, want, out, err, errlen)) return -1;
        want = out->hi[out->n - 1];
        p = comma ? comma + 1 : NULL;
    }
    if (!out->n) { snprintf(err, errlen, "empty chain"); return -1; }
    return 0;
}

/* ==== A slice's HELLO ==== */

int chain_spec_desc_layers(const char *desc, int *lo, int *hi) {
    const char *k = desc ? strstr(desc, "; layers ") : NULL;
    int a, b, used;
    if (!k || wire_layers_parse(k + 9, &a, &b, &used)) return -1;
    *lo = a;
    *hi = b;
    return 0;
}
