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
 * Fair shares (checked as a connection is accepted, before any thread or
 * byte is spent on it):
 *   - trusted peers: an address from which a request was authenticated
 *     (httpd_trust_peer: on a decode node, the router's signed requests)
 *     within HD_TRUST_MS. Its connections are bound by max_conns only;
 *   - reserved_conns of max_conns are for trusted peers alone: strangers
 *     (every other address) hold at most max_conns - reserved_conns;
 *   - a stranger address holds at most max_conns_per_ip, and an address
 *     block (IPv4 /24, IPv6 /64: what one attacker easily owns) at most
 *     max_conns_per_block;
 *   - when the strangers' share is full, the stranger connection whose
 *     request has been arriving the longest (the slowest: a slow client,
 *     or an idle kept-alive one) is closed to make room, if it has taken
 *     over HD_EVICT_MIN_MS; else the newcomer is refused.
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

/* How long an authenticated address stays trusted after its last
 * authenticated request: the router probes each node every few seconds,
 * so ten minutes outlast any pause of its traffic. */
#define HD_TRUST_MS (10 * 60 * 1000)
/* Addresses trusted at once: the routers of one node, a handful. */
#define HD_TRUST_MAX 16
/* A stranger's request that has been arriving this long may be closed to
 * make room: a legitimate client sends its headers and body in a few ms
 * on a LAN, a slow client takes seconds. */
#define HD_EVICT_MIN_MS 250

typedef struct {
    unsigned max_conns;          /* all connections */
    unsigned max_conns_per_ip;   /* per stranger address; 0 = no per-address limit */
    unsigned max_conns_per_block; /* per stranger /24 or /64; 0 = half the strangers' share */
    unsigned reserved_conns;     /* only for trusted peers; 0 = none */
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
/* Stranger connections closed to make room (slowest first) and refused
 * for a full share. */
unsigned long long httpd_evicted(httpd *h);
unsigned long long httpd_refused(httpd *h);
/* The address of c's client is a trusted peer from now on (for
 * HD_TRUST_MS, renewed at each call): call it once a request from it was
 * authenticated. c's own connection moves to the trusted side. */
void httpd_trust_peer(struct MHD_Connection *c);
/* A client address for fair shares (also the prefill node's handshake
 * pool): IPv4, and IPv4-mapped IPv6, in a[0..3]. */
typedef struct {
    unsigned char a[16];
    unsigned char v6;
} httpd_addr;
int httpd_addr_of(const struct sockaddr *sa, httpd_addr *out);   /* 0, or -1 for a non-IP address */
int httpd_same_addr(const httpd_addr *x, const httpd_addr *y);
/* The same /24 (IPv4) or /64 (IPv6): what one attacker easily owns. */
int httpd_same_block(const httpd_addr *x, const httpd_addr *y);

/* ==== Drain ====
 * A graceful end: httpd_quiesce stops accepting (the listening socket
 * stops listening, so a new client is refused at once; open connections
 * go on), httpd_active counts requests in progress (handler called,
 * response not yet finished; an idle kept-alive connection is not one),
 * httpd_wait_idle waits up to timeout_ms for that count to reach 0 and
 * returns what is left. httpd_stop then closes whatever remains. */
void httpd_quiesce(httpd *h);
int httpd_active(httpd *h);
int httpd_wait_idle(httpd *h, int timeout_ms);

/* Stops the server: joins every connection thread, closes the socket. */
void httpd_stop(httpd *h);

#endif
