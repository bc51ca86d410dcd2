/* router_chain.c - chain specs and their health (see router_chain.h). */
#include "router/router_chain.h"

#include <stdio.h>
#include <string.h>

#include "net/wire.h"
#include "net/wire_act.h"

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
            int a = -1, b = -1;   /* "?" when the HELLO's "; layers " does not parse */
            char ta[32], tw[32];
            (void)chain_spec_desc_layers(hello->model_desc, &a, &b);
            wire_layers_format(ta, sizeof ta, a, b);
            wire_layers_format(tw, sizeof tw, lo, hi);
            if (hello->role != WIRE_ROLE_PREFILL) snprintf(err, errlen, "a %s node, not a prefill node", wire_role_name(hello->role));
            else if (!(hello->caps & WIRE_CAP_SLICE) || !strstr(hello->model_desc, "; layers ")) snprintf(err, errlen, "serves no layer slice");
            else if (a != lo || b != hi) snprintf(err, errlen, "serves layers %s, the chain names it for %s", a < 0 ? "?" : ta, tw);
            else rc = 0;
        }
    }
    wire_conn_close(&wc);
    return rc;
}

int rt_chain_probe(const char *spec, int timeout_ms, char *desc, size_t desclen, char *err, size_t errlen) {
    chain_spec sp;
    if (chain_spec_parse(spec, &sp, err, errlen)) return -1;
    int n = sp.n;
    size_t o = (size_t)snprintf(desc, desclen, "chain of %d:", n);
    wire_hello hello;
    for (int i = 0; i < n; i++) {
        char e2[256], t[32];
        wire_layers_format(t, sizeof t, sp.lo[i], sp.hi[i]);
        if (rt_chain_member(sp.addr[i], sp.lo[i], sp.hi[i], timeout_ms, &hello, e2, sizeof e2)) {
            snprintf(err, errlen, "chain member %d of %d (%s, layers %s): %s", i + 1, n, sp.addr[i], t, e2);
            return -1;
        }
        if (o < desclen) o += (size_t)snprintf(desc + o, desclen - o, "%s %s [%s]", i ? "," : "", hello.node_id, t);
    }
    if (o < desclen) snprintf(desc + o, desclen - o, "; %.200s", hello.model_desc);
    return 0;
}
