/* router_chain.h - layer-split prefill chains in the router's configuration
 * (issue 41; docs/layer-split.md): a prefill "node" whose address is a
 * chain spec, HOST:PORT/A:B,HOST:PORT/B:C,..., passed as is to the decode
 * node as the request's prefill_node. */
#ifndef TANDEM_ROUTER_CHAIN_H
#define TANDEM_ROUTER_CHAIN_H

#include <stddef.h>

#define RT_CHAIN_MAX 16

/* 1 when addr is a chain spec (it has a '/'). */
int rt_chain_is_spec(const char *addr);
/* Checks the spec: 1..RT_CHAIN_MAX members HOST:PORT/A:B (bounds L or L.5,
 * lo/hi out in half blocks: wire_act.h), the first at 0,
 * each starting where the previous ended. Returns the count, or -1 with a
 * message. The model's layer count is the decode node's to check. */
int rt_chain_parse(const char *spec, char addrs[][128], int *lo, int *hi, char *err, size_t errlen);
/* Health: each member answers with a prefill HELLO naming the spec's
 * layers ("; layers A:B"). 0 with desc ("chain of N: id [A:B], ...;
 * model"), or -1 with err naming the member. */
int rt_chain_probe(const char *spec, int timeout_ms, char *desc, size_t desclen, char *err, size_t errlen);

#endif
