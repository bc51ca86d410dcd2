/* httpd.c - libmicrohttpd with connection limits and a whole-request
 * deadline (see httpd.h). */
#include "net/httpd.h"

#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "base/platform.h"

#define HD_REAP_MS 100            /* deadline resolution */
#define HD_LOG_BURST 20           /* MHD messages let through per window ... */
#define HD_LOG_WINDOW_MS 10000.0  /* ... then one "suppressed" line per window */
#define HD_FD_SPARE 256           /* fds beside the connections: models, peers, logs, curl */

/* ==== State ==== */

typedef struct hd_conn {
    struct hd_conn *prev, *next;
    int fd;
    int calls;                   /* access-handler calls for the current request */
    int receiving;               /* the current request is not complete yet */
    int killed;
    double deadline_ms;          /* monotonic */
} hd_conn;

struct httpd {
    struct MHD_Daemon *d;
    httpd_limits lim;
    int fd, port;
    MHD_AccessHandlerCallback handler;
    void *handler_cls;
    MHD_RequestCompletedCallback completed;
    void *completed_cls;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    hd_conn *conns;
    int stopping;
    pthread_t reaper;
    int reaper_started;
    unsigned long long expired;
    log_limit log_lim;   /* MHD's messages: HD_LOG_BURST per HD_LOG_WINDOW_MS */
};

static double hd_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static hd_conn *hd_conn_of(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

/* ==== MHD callbacks ==== */

/* MHD's messages about the server itself (limits reached, no thread, no
 * socket) are warnings; the rest concern one client's connection (it
 * closed, sent garbage) and are debug lines. */
static enum log_level hd_log_level(const char *msg) {
    static const char *const warn[] = { "limit", "thread", "accept", "listen", "memory", "Failed to create", NULL };
    for (int i = 0; warn[i]; i++)
        if (strstr(msg, warn[i])) return LOGL_WARN;
    return LOGL_DEBUG;
}

static void hd_logger(void *cls, const char *fmt, va_list ap) {
    httpd *h = cls;
    char raw[512];
    vsnprintf(raw, sizeof raw, fmt, ap);
    size_t n = strlen(raw);
    while (n && (raw[n - 1] == '\n' || raw[n - 1] == '\r')) raw[--n] = 0;
    enum log_level level = hd_log_level(raw);
    if (!log_enabled(level)) return;
    pthread_mutex_lock(&h->mu);
    double now = hd_now();
    unsigned long dropped;
    int show = log_limit_take(&h->log_lim, now, &dropped);
    pthread_mutex_unlock(&h->mu);
    if (dropped) log_warn(NULL, "http: %lu similar messages suppressed", dropped);
    if (show) log_line(level, NULL, "http: %s", raw);
}

static void hd_notify(void *cls, struct MHD_Connection *c, void **socket_context, enum MHD_ConnectionNotificationCode code) {
    httpd *h = cls;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        hd_conn *k = calloc(1, sizeof *k);
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        if (!k) return;   /* no deadline for this one; the limits still hold */
        k->fd = ci ? ci->connect_fd : -1;
        k->receiving = 1;
        k->deadline_ms = hd_now() + h->lim.request_deadline_ms;
        pthread_mutex_lock(&h->mu);
        k->next = h->conns;
        if (h->conns) h->conns->prev = k;
        h->conns = k;
        pthread_mutex_unlock(&h->mu);
        *socket_context = k;
        return;
    }
    hd_conn *k = *socket_context;
    if (!k) return;
    /* MHD notifies before it closes the socket: once unlinked under the
     * lock, the reaper can no longer touch this descriptor number. */
    pthread_mutex_lock(&h->mu);
    if (k->prev) k->prev->next = k->next;
    else h->conns = k->next;
    if (k->next) k->next->prev = k->prev;
    pthread_mutex_unlock(&h->mu);
    free(k);
    *socket_context = NULL;
}

/* MHD calls the handler once when the headers are in (no upload data),
 * once per body piece, and a last time with no data: from that last call
 * on the request is complete and the deadline no longer applies. */
static enum MHD_Result hd_access(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                 const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    httpd *h = cls;
    hd_conn *k = hd_conn_of(c);
    if (k) {
        pthread_mutex_lock(&h->mu);
        if (k->calls++ > 0 && *upload_size == 0) k->receiving = 0;
        pthread_mutex_unlock(&h->mu);
    }
    return h->handler(h->handler_cls, c, url, method, version, upload, upload_size, con_cls);
}

static void hd_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    httpd *h = cls;
    if (h->completed) h->completed(h->completed_cls, c, con_cls, toe);
    hd_conn *k = hd_conn_of(c);
    if (!k) return;
    pthread_mutex_lock(&h->mu);   /* a kept-alive connection: the next request has its own deadline */
    k->calls = 0;
    k->receiving = 1;
    k->deadline_ms = hd_now() + h->lim.request_deadline_ms;
    pthread_mutex_unlock(&h->mu);
}

/* ==== Deadline reaper ==== */

static void *hd_reaper_main(void *arg) {
    httpd *h = arg;
    pthread_mutex_lock(&h->mu);
    while (!h->stopping) {
        double now = hd_now();
        for (hd_conn *k = h->conns; k; k = k->next)
            if (k->receiving && !k->killed && k->fd >= 0 && now > k->deadline_ms) {
                /* wakes the connection's thread: its next read sees the end */
                shutdown(k->fd, SHUT_RDWR);
                k->killed = 1;
                h->expired++;
            }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += HD_REAP_MS * 1000000L;
        if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
        pthread_cond_timedwait(&h->cv, &h->mu, &ts);
    }
    pthread_mutex_unlock(&h->mu);
    return NULL;
}

/* ==== Start / stop ==== */

int httpd_listen(const struct sockaddr *addr, socklen_t len, char *err, size_t errlen) {
    int fd = plat_socket(addr->sa_family, SOCK_STREAM, 0, 0);
    if (fd < 0) { snprintf(err, errlen, "socket: %s", strerror(errno)); return -1; }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, addr, len) || listen(fd, 128)) {
        snprintf(err, errlen, "cannot listen: %s", strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

/* Thread-per-connection servers hold one descriptor per client: make
 * room for max_conns when the hard limit allows. */
static void hd_raise_nofile(unsigned max_conns) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl)) return;
    rlim_t want = (rlim_t)max_conns + HD_FD_SPARE;
    if (rl.rlim_cur >= want) return;
    rl.rlim_cur = rl.rlim_max == RLIM_INFINITY || rl.rlim_max > want ? want : rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
}

static int hd_local_port(int fd) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl)) return -1;
    return ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                    : ntohs(((struct sockaddr_in *)&ss)->sin_port);
}

int httpd_start(httpd **out, const httpd_limits *lim, int listen_fd, MHD_AccessHandlerCallback handler,
                void *handler_cls, MHD_RequestCompletedCallback completed, void *completed_cls,
                char *err, size_t errlen) {
    *out = NULL;
    httpd *h = calloc(1, sizeof *h);
    if (!h) { close(listen_fd); snprintf(err, errlen, "out of memory"); return -1; }
    h->lim = *lim;
    if (h->lim.request_deadline_ms <= 0) h->lim.request_deadline_ms = 1 << 30;
    h->fd = listen_fd;
    h->port = hd_local_port(listen_fd);
    h->handler = handler;
    h->handler_cls = handler_cls;
    h->completed = completed;
    h->completed_cls = completed_cls;
    h->log_lim = (log_limit){ .window_ms = HD_LOG_WINDOW_MS, .burst = HD_LOG_BURST, .t0 = hd_now() };
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    hd_raise_nofile(lim->max_conns);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    int v6 = !getsockname(listen_fd, (struct sockaddr *)&ss, &sl) && ss.ss_family == AF_INET6;
    /* poll, not select: descriptors beyond FD_SETSIZE must work */
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
                     MHD_USE_ERROR_LOG | (v6 ? MHD_USE_IPv6 : 0);
    h->d = MHD_start_daemon(flags, 0, NULL, NULL, hd_access, h,
                            MHD_OPTION_EXTERNAL_LOGGER, hd_logger, h,
                            MHD_OPTION_LISTEN_SOCKET, listen_fd,
                            MHD_OPTION_NOTIFY_CONNECTION, hd_notify, h,
                            MHD_OPTION_NOTIFY_COMPLETED, hd_completed, h,
                            MHD_OPTION_CONNECTION_LIMIT, lim->max_conns,
                            MHD_OPTION_PER_IP_CONNECTION_LIMIT, lim->max_conns_per_ip,
                            MHD_OPTION_CONNECTION_TIMEOUT, lim->idle_timeout_s,
                            MHD_OPTION_END);
    if (!h->d) {
        snprintf(err, errlen, "cannot start the HTTP server");
        close(listen_fd);
        httpd_stop(h);
        return -1;
    }
    if (pthread_create(&h->reaper, NULL, hd_reaper_main, h)) {
        snprintf(err, errlen, "cannot start the HTTP deadline thread");
        httpd_stop(h);
        return -1;
    }
    h->reaper_started = 1;
    *out = h;
    return 0;
}

int httpd_port(const httpd *h) { return h ? h->port : -1; }

unsigned long long httpd_expired(httpd *h) {
    pthread_mutex_lock(&h->mu);
    unsigned long long n = h->expired;
    pthread_mutex_unlock(&h->mu);
    return n;
}

void httpd_stop(httpd *h) {
    if (!h) return;
    if (h->reaper_started) {
        pthread_mutex_lock(&h->mu);
        h->stopping = 1;
        pthread_cond_broadcast(&h->cv);
        pthread_mutex_unlock(&h->mu);
        pthread_join(h->reaper, NULL);
    }
    if (h->d) MHD_stop_daemon(h->d);   /* joins the connection threads, closes listen_fd */
    pthread_cond_destroy(&h->cv);
    pthread_mutex_destroy(&h->mu);
    free(h);
}
