/* chain_spec.h - a layer-split prefill chain as an operator writes it
 * (issue 41; docs/layer-split.md): "HOST:PORT/A:B,HOST:PORT/B:C,...", the
 * slice owners in layer order. The decode node (node/chain.c), `tandem
 * run --prefill-node` and the router's `--prefill MODEL=SPEC`
 * (router/router_chain.c, router_config.c) all parse it here, so that one
 * spec is taken or refused the same way, with the same message, wherever
 * it is written. Also the slice a prefill node advertises in its HELLO
 * ("...; layers A:B" at the end of model_desc). Bounds are in half blocks
 * (wire_act.h: "L" or "L.5"). */
#ifndef TANDEM_CHAIN_SPEC_H
#define TANDEM_CHAIN_SPEC_H

#include <stddef.h>

/* Most nodes in one chain (a 1024-layer cap makes more pointless here). */
#define CHAIN_SPEC_MAX 16
/* Bytes of one member's HOST:PORT, NUL included. */
#define CHAIN_SPEC_ADDR 256

typedef struct {
    int n;
    char addr[CHAIN_SPEC_MAX][CHAIN_SPEC_ADDR];
    int lo[CHAIN_SPEC_MAX], hi[CHAIN_SPEC_MAX];   /* half blocks (wire_act.h) */
} chain_spec;

/* 1 when s looks like a chain spec (has a '/'), else 0. */
int chain_spec_is(const char *s);
/* Parses "addr/A:B,addr/B:C,...": 1..CHAIN_SPEC_MAX members, each addr
 * non-empty, shorter than CHAIN_SPEC_ADDR and holding a ':' (HOST:PORT:
 * the port's range is the caller's to check), each A < B (a bound L or
 * L.5), the first at 0, each starting where the one before ended, each
 * computing at least one block's attention. The model's layer count is
 * checked when the nodes answer. 0, or -1 with a message naming the
 * member. */
int chain_spec_parse(const char *s, chain_spec *out, char *err, size_t errlen);
/* The slice a prefill node advertises at the end of its HELLO's
 * model_desc ("...; layers A:B"); 0 with *lo, *hi in half blocks, or -1 if
 * none. */
int chain_spec_desc_layers(const char *desc, int *lo, int *hi);

#endif
