/* wire_tcp.c - the wire protocol's TCP sockets: "host:port" parsed and
 * resolved, listen, accept and connect with deadlines, TCP_NODELAY. */

#include "net/wire.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/platform.h"

#include "net/wire_internal.h"

/* ==== TCP ==== */

/* Split "host:port", ":port", "port" or "[v6]:port" into host (default
 * 127.0.0.1) and port. */
static int wire_split_hostport(const char *hp, char *host, size_t hostlen, char *port, size_t portlen,
                               char *err, size_t errlen) {
    if (!hp || !*hp) {
        wire_errf(err, errlen, "empty address");
        return -1;
    }
    const char *h = NULL, *p;
    size_t hl = 0;
    if (hp[0] == '[') {
        const char *rb = strchr(hp, ']');
        if (!rb || rb[1] != ':') {
            wire_errf(err, errlen, "bad address '%s' (expected [ipv6]:port)", hp);
            return -1;
        }
        h = hp + 1;
        hl = (size_t)(rb - h);
        p = rb + 2;
    } else {
        const char *colon = strrchr(hp, ':');
        if (colon && strchr(hp, ':') != colon) {
            wire_errf(err, errlen, "bad address '%s' (write IPv6 addresses as [addr]:port)", hp);
            return -1;
        }
        if (colon) {
            h = hp;
            hl = (size_t)(colon - hp);
            p = colon + 1;
        } else {
            p = hp;
        }
    }
    if (!hl) {
        h = "127.0.0.1";
        hl = strlen(h);
    }
    size_t pl = strlen(p);
    if (hl >= hostlen || !pl || pl >= portlen || strspn(p, "0123456789") != pl || atol(p) > 65535) {
        wire_errf(err, errlen, "bad address '%s' (expected host:port with port 0-65535)", hp);
        return -1;
    }
    memcpy(host, h, hl);
    host[hl] = 0;
    memcpy(port, p, pl + 1);
    return 0;
}

static int wire_resolve(const char *hostport, int passive, struct addrinfo **res, char *err, size_t errlen) {
    char host[256], port[16];
    if (wire_split_hostport(hostport, host, sizeof host, port, sizeof port, err, errlen)) return -1;
    struct addrinfo hints;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = passive ? AI_PASSIVE : 0;
    /* "*" (listen only): every local address. */
    int any = passive && !strcmp(host, "*");
    int rc = getaddrinfo(any ? NULL : host, port, &hints, res);
    if (rc) {
        wire_errf(err, errlen, "cannot resolve '%s': %s", hostport, gai_strerror(rc));
        return -1;
    }
    return 0;
}

static void wire_set_nodelay(int fd) {
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* Connections the kernel queues before accept: under a connection flood
 * a short queue overflows and a legitimate peer's SYN is dropped (then
 * retried after a second); the prefill node drains the queue at tens of
 * thousands a second (a flood's newcomers past their share are closed
 * unread), so a long one only delays a peer by milliseconds. The kernel
 * caps it at net.core.somaxconn. */
#define WIRE_LISTEN_BACKLOG 4096

int wire_listen(const char *hostport, char *err, size_t errlen) {
    struct addrinfo *res;
    if (wire_resolve(hostport, 1, &res, err, errlen)) return -1;
    int fd = -1, last = 0;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        fd = plat_socket(a->ai_family, a->ai_socktype, a->ai_protocol, 0);
        if (fd < 0) { last = errno; continue; }
        int one = 1;
        (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        wire_set_nodelay(fd);   /* inherited by accepted sockets on Linux */
        if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, WIRE_LISTEN_BACKLOG) == 0) break;
        last = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) wire_errf(err, errlen, "cannot listen on %s: %s", hostport, strerror(last));
    return fd;
}

int wire_local_port(int fd) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl)) return -1;
    if (ss.ss_family == AF_INET) return ntohs(((struct sockaddr_in *)&ss)->sin_port);
    if (ss.ss_family == AF_INET6) return ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    return -1;
}

int wire_accept(int lfd, int timeout_ms, char *err, size_t errlen) {
    int64_t deadline = wire_deadline(timeout_ms);
    for (;;) {
        int pr = wire_poll(lfd, POLLIN, deadline);
        if (pr == 0) return -2;
        if (pr < 0) {
            wire_errf(err, errlen, "poll on listening socket failed: %s", strerror(errno));
            return -1;
        }
        int fd = plat_accept(lfd, 1);
        if (fd >= 0) {
            /* Back to blocking: our I/O polls with deadlines and uses MSG_DONTWAIT. */
            int fl = fcntl(fd, F_GETFL);
            if (fl >= 0) (void)fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
            wire_set_nodelay(fd);
            return fd;
        }
        /* A connection that vanished before accept, or a signal: try again. */
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED ||
            errno == EPROTO)
            continue;
        wire_errf(err, errlen, "accept failed: %s", strerror(errno));
        return -1;
    }
}

/* Non-blocking connect to one address with a deadline. fd or -1 (errno set). */
static int wire_connect_one(const struct addrinfo *a, int64_t deadline, int *timed_out) {
    int fd = plat_socket(a->ai_family, a->ai_socktype, a->ai_protocol, 1);
    if (fd < 0) return -1;
    if (connect(fd, a->ai_addr, a->ai_addrlen) < 0) {
        if (errno != EINPROGRESS) goto fail;
        int pr = wire_poll(fd, POLLOUT, deadline);
        if (pr <= 0) {
            if (pr == 0) { *timed_out = 1; errno = ETIMEDOUT; }
            goto fail;
        }
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0) goto fail;
        if (soerr) { errno = soerr; goto fail; }
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) (void)fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    wire_set_nodelay(fd);
    return fd;
fail:;
    int e = errno;
    close(fd);
    errno = e;
    return -1;
}

int wire_connect(const char *hostport, int timeout_ms, char *err, size_t errlen) {
    struct addrinfo *res;
    if (wire_resolve(hostport, 0, &res, err, errlen)) return -1;
    int64_t deadline = wire_deadline(timeout_ms);
    int fd = -1, last = 0, timed_out = 0;
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = wire_connect_one(a, deadline, &timed_out);
        if (fd < 0) last = errno;
        if (timed_out) break;
    }
    freeaddrinfo(res);
    if (fd < 0) {
        if (timed_out)
            wire_errf(err, errlen, "cannot connect to %s: timed out after %d ms", hostport, timeout_ms);
        else
            wire_errf(err, errlen, "cannot connect to %s: %s", hostport, strerror(last));
    }
    return fd;
}
