/* router_web.h - the functions of router_web.c that the other router files
 * call (router_internal.h has the types). Private to src/router/. */
#ifndef TANDEM_ROUTER_WEB_H
#define TANDEM_ROUTER_WEB_H

#include "router/router_internal.h"

/* GET / (and HEAD /): the chat page, with headers that keep it from being
 * framed or loading anything from elsewhere. */
enum MHD_Result rt_web_page(router *r, struct MHD_Connection *c);

#endif
