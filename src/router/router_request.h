/* router_request.h - the functions of router_request.c that the other router files call
 * (router_internal.h has the types). Private to src/router/. */
#ifndef TANDEM_ROUTER_REQUEST_H
#define TANDEM_ROUTER_REQUEST_H

#include "router/router_internal.h"

int rt_text_add(rt_choice *c, const char *s);
void rt_lp_add(rt_choice *c, api_upstream_line *u);
void rt_lp_clear(rt_choice *c);
rt_choice *rt_choice_of(rt_req *q, const api_upstream_line *u);
void rt_choice_end(rt_req *q, rt_choice *c, api_upstream_line *u);
void rt_choices_reset(rt_req *q);
void rt_release_node(rt_req *q, int failed, int mark_down);
void rt_check_dead(rt_req *q);
int rt_start(rt_req *q, api_error *e);
int rt_prefill_outcome(const api_upstream_line *f);
void rt_learn(rt_req *q);
void rt_log_done(rt_req *q, const char *outcome);
int rt_next(rt_req *q, api_upstream_line *u);
void rt_on_token(rt_req *q, const api_upstream_line *u);

#endif
