/* router_nodes.h - the functions of router_nodes.c that the other router files call
 * (router_internal.h has the types). Private to src/router/. */
#ifndef TANDEM_ROUTER_NODES_H
#define TANDEM_ROUTER_NODES_H

#include "router/router_internal.h"

int rt_node_load(const rt_node *n);
int rt_node_slots(const rt_node *n);
int rt_node_full(const rt_node *n, int by_own);
int rt_model_known(router *r, const char *model);
int rt_pick_locked(router *r, int role, const char *model, const int *tried);
long rt_http_post(const char *addr, const char *path, const char *body, size_t len, int timeout_ms, strbuf *out);
int rt_count_tokens(router *r, const char *addr, const api_request *req, char *err, size_t errlen);
void rt_health_round(router *r, int startup);
void *rt_health_main(void *arg);

#endif
