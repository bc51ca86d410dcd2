/* router_batch.h - the functions of router_batch.c that the other router files call
 * (router_internal.h has the types). Private to src/router/. */
#ifndef TANDEM_ROUTER_BATCH_H
#define TANDEM_ROUTER_BATCH_H

#include "router/router_internal.h"

enum MHD_Result rt_generate(router *r, struct MHD_Connection *c, rt_conn *cc);

#endif
