/* router_chain.c - chain specs and their health (see router_chain.h). */
#include "router/router_chain.h"

#include <stdio.h>
#include <string.h>

#include "net/wire.h"
#include "net/wire_act.h"

int rt_chain_is_spec(const char *addr) { return addr && strchr(addr, '/') != NULL; }

int rt_chain_parse(const char *spec, char addrs[][128], int *lo, int *hi, char *err, size_t errlen) {
    int n = 0, want = 0;
    const char *p = spec;
    while (p && *p) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        const char *slash = memchr(p, '/', len);
        int a, b, k = 0;
        char range[40];
        size_t rl = slash ? len - (size_t)(slash + 1 - p) : 0;
        if (n == RT_CHAIN_MAX || !slash || slash == p || (size_t)(slash - p) >= 128 || !memchr(p, ':', (size_t)(slash - p)) ||
            rl == 0 || rl >= sizeof range) {
            snprintf(err, errlen, "chain member '%.*s' is not HOST:PORT/A:B (at most %d members)", (int)(len > 120 ? 120 : len),
                     p, RT_CHAIN_MAX);
            return -1;
        }
        memcpy(range, slash + 1, rl);
        range[rl] = 0;
        if (wire_layers_parse(range, &a, &b, &k) || range[k] || a != want || wire_layers_kv(a) == wire_layers_kv(b)) {
            char tw[16];
            wire_bound_format(tw, sizeof tw, want);
            snprintf(err, errlen, "chain member '%.*s': layers must be %s:B with B > %s (L or L.5; slices in order, "
                     "each layer once, each computing a block's attention)", (int)(len > 120 ? 120 : len), p, tw, tw);
            return -1;
        }
        memcpy(addrs[n], p, (size_t)(slash - p));
        addrs[n][slash - p] = 0;
        lo[n] = a;
        hi[n] = b;
        n++;
        want = b;
        p = comma ? comma + 1 : NULL;
    }
    if (!n) { snprintf(err, errlen, "empty chain"); return -1; }
    return n;
}

/* One member's HELLO: a prefill node serving exactly lo:hi. */
static int rt_chain_member(const char *addr, int lo, int hi, int timeout_ms, wire_hello *hello, char *err, size_t errlen) {
    int fd = wire_connect(addr, timeout_ms, err, errlen);
    if (fd < 0) return -1;
    wire_conn wc;
    wire_conn_init(&wc, fd, timeout_ms);
    wire_header h;
    int rc = -1;
    if (wire_recv(&wc, &h, err, errlen) == 0) {
        if (h.type != WIRE_HELLO) {
            snprintf(err, errlen, "no HELLO (got a %s frame)", wire_type_name(h.type));
        } else if (wire_decode_hello(wc.rx.data, wc.rx.len, hello, err, errlen) == 0) {
            const char *k = strstr(hello->model_desc, "; layers ");
            int a = -1, b = -1, used;
            char ta[32], tw[32];
            if (k && wire_layers_parse(k + 9, &a, &b, &used)) a = b = -1;
            wire_layers_format(ta, sizeof ta, a, b);
            wire_layers_format(tw, sizeof tw, lo, hi);
            if (hello->role != WIRE_ROLE_PREFILL) snprintf(err, errlen, "a %s node, not a prefill node", wire_role_name(hello->role));
            else if (!(hello->caps & WIRE_CAP_SLICE) || !k) snprintf(err, errlen, "serves no layer slice");
            else if (a != lo || b != hi) snprintf(err, errlen, "serves layers %s, the chain names it for %s", a < 0 ? "?" : ta, tw);
            else rc = 0;
        }
    }
    wire_conn_close(&wc);
    return rc;
}

int rt_chain_probe(const char *spec, int timeout_ms, char *desc, size_t desclen, char *err, size_t errlen) {
    char addrs[RT_CHAIN_MAX][128];
    int lo[RT_CHAIN_MAX], hi[RT_CHAIN_MAX];
    int n = rt_chain_parse(spec, addrs, lo, hi, err, errlen);
    if (n < 0) return -1;
    size_t o = (size_t)snprintf(desc, desclen, "chain of %d:", n);
    wire_hello hello;
    for (int i = 0; i < n; i++) {
        char e2[256], t[32];
        wire_layers_format(t, sizeof t, lo[i], hi[i]);
        if (rt_chain_member(addrs[i], lo[i], hi[i], timeout_ms, &hello, e2, sizeof e2)) {
            snprintf(err, errlen, "chain member %d of %d (%s, layers %s): %s", i + 1, n, addrs[i], t, e2);
            return -1;
        }
        if (o < desclen) o += (size_t)snprintf(desc + o, desclen - o, "%s %s [%s]", i ? "," : "", hello.node_id, t);
    }
    if (o < desclen) snprintf(desc + o, desclen - o, "; %.200s", hello.model_desc);
    return 0;
}
