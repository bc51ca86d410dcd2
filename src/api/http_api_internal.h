/* http_api_internal.h - between http_api.c (request parsing),
 * http_api_upstream.c (the decode node's protocol) and http_api_render.c
 * (responses); not part of the interface: http_api.h is. */

#ifndef TANDEM_API_HTTP_API_INTERNAL_H
#define TANDEM_API_HTTP_API_INTERNAL_H

#include "api/http_api.h"

#include <jansson.h>

/* o dumped compactly and released (NULL when o is; http_api_render.c). */
char *api_dump(json_t *o);

#endif
