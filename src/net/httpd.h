/* httpd.h - starting a libmicrohttpd server with limits against slow and
 * numerous clients; shared by the router, the decode node and the prefill
 * node's metrics listener.
 *
 * All of them run one thread per connection (their handlers block on
 * generation), so every open connection holds a thread and a slot. A
 * "slow loris" client (one header line every few seconds) never trips
 * MHD's inactivity timeout and, in numbers, used to fill every slot. The
 * defences, all set here:
 *   - max_conns: total connections, sized so that many idle or slow
 *     clients still leave room for /health and real work;
 *   - max_conns_per_ip: one address cannot take more than this
 *     (MHD_OPTION_PER_IP_CONNECTION_LIMIT);
 *   - request_deadline_ms: a request's headers and body must have arrived
 *     within this many ms of the connection opening (or of the previous
 *     response finishing, on a kept-alive connection). MHD only knows an
 *     inactivity timeout, so a reaper thread shuts down the socket of a
 *     connection whose request is still incomplete at its deadline. Once
 *     the request is in, the deadline stops: streaming a long answer is
 *     not limited by it.
 *   - idle_timeout_s: MHD's inactivity timeout.
 * MHD's own messages (refused connections, parse errors) go through log.h
 * (escaped; WARN for the server's limits, DEBUG for one client's
 * connection) and are rate limited, so a flood cannot flood the log.
 * The process's open-file limit is raised to fit max_conns when allowed.
 */
#ifndef TANDEM_HTTPD_H
#define TANDEM_HTTPD_H

#include <stddef.h>
#include <sys/socket.h>

#include <microhttpd.h>

typedef struct {
    unsigned max_conns;          /* all connections */
    unsigned max_conns_per_ip;   /* 0 = no per-address limit */
    int request_deadline_ms;     /* headers + body must arrive within this; 0 = no deadline */
    unsigned idle_timeout_s;     /* no byte moved for this long closes the connection; 0 = MHD default */
} httpd_limits;

typedef struct httpd httpd;

/* A listening TCP socket on addr (SO_REUSEADDR, CLOEXEC); fd or -1 with a message. */
int httpd_listen(const struct sockaddr *addr, socklen_t len, char *err, size_t errlen);

/* Serves listen_fd (which it owns from then on, also on failure) with
 * handler/completed as MHD's access handler and request-completed
 * callback. 0, or -1 with a message. */
int httpd_start(httpd **out, const httpd_limits *lim, int listen_fd, MHD_AccessHandlerCallback handler,
                void *handler_cls, MHD_RequestCompletedCallback completed, void *completed_cls,
                char *err, size_t errlen);
int httpd_port(const httpd *h);
/* Connections closed because their request missed the deadline. */
unsigned long long httpd_expired(httpd *h);
/* Stops the server: joins every connection thread, closes the socket. */
void httpd_stop(httpd *h);

#endif
