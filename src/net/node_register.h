/* node_register.h - a node announcing itself to a router.
 *
 * `tandem serve --role decode|prefill --router URL` starts a thread that
 * POSTs {"role", "model", "addr"} to URL/v1/nodes/register every
 * interval_ms (the first as soon as the node listens); the same POST is the
 * heartbeat. Each POST is signed with the registration key derived from
 * the shared secret (node_auth.h, NODE_AUTH_LABEL_REGISTER) and carries a
 * fresh nonce, so a captured registration cannot be replayed. The thread
 * logs the first success and every change between success and failure.
 */
#ifndef TANDEM_NODE_REGISTER_H
#define TANDEM_NODE_REGISTER_H

#include <stddef.h>

/* Default heartbeat period: well inside the router's default 5 s
 * heartbeat_ttl_ms, so one lost POST does not mark the node down. */
#define NODE_REGISTER_INTERVAL_MS 1500

typedef struct {
    const char *router_url;      /* http://HOST:PORT of the router */
    const char *role;            /* "decode" or "prefill" */
    const char *model;           /* the name clients use in "model" */
    const char *advertise;       /* HOST or HOST:PORT the router reaches us at; NULL = the listen host */
    const char *listen;          /* our listen address (HOST:PORT) */
    volatile int *port;          /* our bound port: 0 until listening (the thread waits for it) */
    const void *secret;
    size_t secret_len;
    int interval_ms;             /* 0 = NODE_REGISTER_INTERVAL_MS */
} node_register_opts;

typedef struct node_register node_register;

/* Checks the options and starts the thread; 0, or -1 with a message. */
int node_register_start(node_register **out, const node_register_opts *o, char *err, size_t errlen);
/* A node that is shutting down: stops the heartbeats and POSTs one last
 * signed registration with "leaving": true, so that the router sends it no
 * new request while it finishes those in flight (the router removes it
 * once they are done). 0, or -1 when the router did not take it (it then
 * drops the node at its heartbeat timeout). Call node_register_stop after. */
int node_register_leave(node_register *r);
/* Stops the thread (no further POSTs) and frees everything. */
void node_register_stop(node_register *r);
/* The model name a node registers when none is given: the file's base
 * name without ".gguf" (into out, outlen bytes). */
void node_register_default_model(const char *path, char *out, size_t outlen);

#endif
