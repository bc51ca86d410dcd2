/* router_responses.h - the functions of router_responses.c (POST
 * /v1/responses) that the other router files call (router_internal.h has
 * the types). Private to src/router/. */
#ifndef TANDEM_ROUTER_RESPONSES_H
#define TANDEM_ROUTER_RESPONSES_H

#include "router/router_internal.h"
#include "api/responses_api.h"

typedef struct rt_responses rt_responses;

/* Checks a Responses body (cc->body) and replaces it with the equivalent
 * chat completions body, keeping what the answer needs in cc->responses.
 * 0, or -1 with e filled (400 naming the field, or 500). */
int rt_responses_prepare(router *r, rt_conn *cc, api_error *e);
/* A chat parser's error about the translated body, its param renamed as
 * the Responses body spells it (messages -> input, response_format ->
 * text.format, max_tokens -> max_output_tokens). */
void rt_responses_fix_error(api_error *e);
/* Runs the admitted request q (its chat form) and answers as the Responses
 * API: a Response object, or the Responses event stream. Takes
 * cc->responses; finishes q. */
enum MHD_Result rt_responses_run(rt_req *q, struct MHD_Connection *c, rt_conn *cc);
void rt_responses_free(rt_responses *rs);

#endif
