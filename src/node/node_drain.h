/* node_drain.h - the nodes' graceful end on SIGTERM/SIGINT (issue 40).
 *
 * Every serving role ends the same way: it deregisters from its router
 * (node_register_leave: no new request is sent to it), stops accepting
 * connections, lets the requests in flight finish for up to
 * --drain-timeout ms, and only then cuts what is left: a decode node's
 * cut streams end with an error line ("the server is shutting down"),
 * which the router passes on as an error event and [DONE]; a prefill
 * node's cut handoffs get a wire ERROR, and their decode nodes prefill
 * locally. docs/router.md, Shutdown.
 */
#ifndef TANDEM_NODE_DRAIN_H
#define TANDEM_NODE_DRAIN_H

#include <stdatomic.h>

#include "net/httpd.h"
#include "net/node_register.h"

/* Long enough for a typical answer in flight to finish (a few hundred
 * tokens at tens of tokens a second), short enough for an orchestrator's
 * grace period (Kubernetes waits 30 s before SIGKILL). */
#define NODE_DRAIN_DEFAULT_MS 20000
/* After the drain timeout, how long the cut requests get to write their
 * last line or frame before the connections are closed. */
#define NODE_DRAIN_GRACE_MS 2000

/* A decode (or local) node's HTTP side: deregisters (reg may be NULL),
 * stops accepting on d, waits up to timeout_ms for its requests in
 * progress. Returns how many are left (to be cut). */
int node_drain_http(httpd *d, node_register *reg, int timeout_ms);

/* Waits up to timeout_ms for *count to reach 0; returns what is left. */
int node_drain_wait_count(atomic_int *count, int timeout_ms);

#endif
