/* router_endpoints.h - the functions of router_endpoints.c that the other router files call
 * (router_internal.h has the types). Private to src/router/. */
#ifndef TANDEM_ROUTER_ENDPOINTS_H
#define TANDEM_ROUTER_ENDPOINTS_H

#include "router/router_internal.h"

enum MHD_Result rt_models(router *r, struct MHD_Connection *c);
enum MHD_Result rt_model_one(router *r, struct MHD_Connection *c, const char *id);
enum MHD_Result rt_health(router *r, struct MHD_Connection *c);
enum MHD_Result rt_metrics_page(router *r, struct MHD_Connection *c);
/* Body bytes a POST /tokenize may carry: what the largest context of a
 * healthy decode node can hold (RT_TOK_BODY_PER_TOKEN), at most max_body_bytes. */
size_t rt_tokenize_cap(router *r);
enum MHD_Result rt_tokens(router *r, struct MHD_Connection *c, rt_conn *cc, int detok);
int rt_node_upsert_locked(router *r, const router_node_cfg *cfg, int registered);
enum MHD_Result rt_register(router *r, struct MHD_Connection *c, rt_conn *cc);

#endif
