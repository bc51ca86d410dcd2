/* router_stream.h - the functions of router_stream.c that the other router files call
 * (router_internal.h has the types). Private to src/router/. */
#ifndef TANDEM_ROUTER_STREAM_H
#define TANDEM_ROUTER_STREAM_H

#include "router/router_internal.h"

void rt_up_close(rt_up *u);
int rt_up_open(rt_up *u, const char *addr, char *body, int connect_ms, const node_auth_key *key, const char *rid,
               const char *client);
long rt_up_status(rt_up *u);
int rt_up_line(rt_up *u, double deadline_ms, int client_fd, char **line, size_t *len);
int rt_tools_prepare(rt_req *q, api_error *e);
void rt_req_finish(rt_req *q);
void rt_meta(const rt_req *q, api_resp_meta *m);
int rt_render_choices(rt_req *q, char **bodies);
int rt_complete(rt_req *q, api_error *e);
enum MHD_Result rt_reply_json(struct MHD_Connection *c, const rt_req *q, const char *rid, char *body);
enum MHD_Result rt_run_blocking(rt_req *q, struct MHD_Connection *c);
int rt_out_set(rt_req *q, char *s);
int rt_stream_produce(rt_req *q);
char *rt_prefill_comment(const rt_req *q);
ssize_t rt_out_take(rt_req *q, char *buf, size_t max);
void rt_sse_headers(struct MHD_Response *resp);
enum MHD_Result rt_run_stream(rt_req *q, struct MHD_Connection *c);

#endif
