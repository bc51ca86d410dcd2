/* router_chain.h - layer-split prefill chains in the router's configuration
 * (issue 41; docs/layer-split.md): a prefill "node" whose address is a
 * chain spec, HOST:PORT/A:B,HOST:PORT/B:C,..., passed as is to the decode
 * node as the request's prefill_node. */
#ifndef TANDEM_ROUTER_CHAIN_H
#define TANDEM_ROUTER_CHAIN_H

#include <stddef.h>

#include "net/chain_spec.h"

/* A chain spec (chain_spec_is: it has a '/') is parsed and checked by
 * chain_spec_parse (net/chain_spec.h: 1..CHAIN_SPEC_MAX members
 * HOST:PORT/A:B, bounds L or L.5, the first at 0, each starting where the
 * previous ended), the parser the decode node uses; the model's layer
 * count is the decode node's to check.
 *
 * Health: each member answers with a prefill HELLO naming the spec's
 * layers ("; layers A:B"). 0 with desc ("chain of N: id [A:B], ...;
 * model"), or -1 with err naming the member. */
int rt_chain_probe(const char *spec, int timeout_ms, char *desc, size_t desclen, char *err, size_t errlen);

#endif
