/* router_nodes.h - the functions of router_nodes.c that the other router files call
 * (router_internal.h has the types). Private to src/router/. */
#ifndef TANDEM_ROUTER_NODES_H
#define TANDEM_ROUTER_NODES_H

#include "router/router_internal.h"

int rt_node_load(const rt_node *n);
int rt_node_slots(const rt_node *n);
int rt_node_full(const rt_node *n, int by_own);
/* Is node a a better pick than node b by capacity alone (today's order)? */
int rt_node_better(const rt_node *a, const rt_node *b);
int rt_model_known(router *r, const char *model);
int rt_pick_locked(router *r, int role, const char *model, const int *tried);
/* Reply bounds per endpoint: a health or stats reply is tiny; a
 * /v1/tokenize or /v1/detokenize reply is at most about 30 bytes a token
 * ({"id":N,"piece":"..."} with pieces), or a piece's text (up to 6 bytes a
 * byte, JSON-escaped) for each of TOKAPI_MAX_TOKENS ids: 64 MiB holds the
 * largest body the router accepts (1 MiB of ids) with ordinary pieces, and a
 * reply past it is refused rather than buffered without end. */
#define RT_REPLY_SMALL ((size_t)1 << 20)
#define RT_REPLY_TOKENS ((size_t)64 << 20)

/* The key that signs calls to decode nodes, NULL without a secret. */
const node_auth_key *rt_node_key(const router *r);
long rt_http_post(const char *addr, const char *path, const char *body, size_t len, const node_auth_key *key,
                  size_t cap, int timeout_ms, strbuf *out);
/* ids (NULL: not wanted): the prompt's token ids, malloc'd, on success. */
int rt_count_tokens(router *r, const char *addr, const api_request *req, int32_t **ids, char *err, size_t errlen);
void rt_health_round(router *r, int startup);
/* Frees entry i of the node table (a registration past its heartbeat).
 * Caller holds mu. */
void rt_node_forget_locked(router *r, int i);
void *rt_health_main(void *arg);

#endif
