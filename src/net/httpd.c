/* httpd.c - libmicrohttpd with connection limits and a whole-request
 * deadline (see httpd.h). */
#include "net/httpd.h"

#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
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
/* MHD's own limit is max_conns plus this: room for evicted connections
 * whose threads have not closed them yet, so that they never make MHD
 * refuse a trusted peer; the fair shares count only live ones. */
#define HD_CLOSING_SPARE 64

/* ==== State ==== */

typedef httpd_addr hd_addr;

typedef struct {
    hd_addr addr;
    double until_ms;             /* monotonic; 0 = free */
} hd_trust;

typedef struct {
    hd_addr addr;
    unsigned n;                  /* 0 = empty slot */
} hd_tally;

typedef struct hd_conn {
    struct hd_conn *prev, *next;
    struct httpd *h;
    hd_addr addr;
    int has_addr;
    int trusted;                 /* from a trusted address, or made so by httpd_trust_peer */
    double request_ms;           /* when the current request began arriving (monotonic) */
    int fd;
    int calls;                   /* access-handler calls for the current request */
    int receiving;               /* the current request is not complete yet */
    int killed;
    int active;                  /* a request is in progress (counted in httpd.active) */
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
    int active;                  /* requests in progress: handler called, response not yet finished */
    int quiesced_fd;             /* the listening socket once httpd_quiesce took it back from MHD; -1 */
    pthread_t reaper;
    int reaper_started;
    unsigned long long expired, evicted, refused;
    hd_trust trust[HD_TRUST_MAX];
    hd_tally *tally;             /* hd_admit's scratch: connections per stranger address */
    unsigned tally_cap;          /* a power of two above twice max_conns */
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

/* ==== Fair shares ==== */

int httpd_addr_of(const struct sockaddr *sa, httpd_addr *out) {
    memset(out, 0, sizeof *out);
    if (!sa) return -1;
    if (sa->sa_family == AF_INET) {
        memcpy(out->a, &((const struct sockaddr_in *)sa)->sin_addr, 4);
        return 0;
    }
    if (sa->sa_family != AF_INET6) return -1;
    const unsigned char *b = ((const struct sockaddr_in6 *)sa)->sin6_addr.s6_addr;
    static const unsigned char mapped[12] = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff };
    if (!memcmp(b, mapped, 12)) { memcpy(out->a, b + 12, 4); return 0; }
    memcpy(out->a, b, 16);
    out->v6 = 1;
    return 0;
}

int httpd_same_addr(const httpd_addr *x, const httpd_addr *y) { return x->v6 == y->v6 && !memcmp(x->a, y->a, 16); }

int httpd_same_block(const httpd_addr *x, const httpd_addr *y) {
    return x->v6 == y->v6 && !memcmp(x->a, y->a, x->v6 ? 8 : 3);
}

/* Under h->mu. */
static int hd_is_trusted(httpd *h, const hd_addr *a, double now) {
    for (int i = 0; i < HD_TRUST_MAX; i++)
        if (h->trust[i].until_ms > now && httpd_same_addr(&h->trust[i].addr, a)) return 1;
    return 0;
}

static unsigned hd_block_share(const httpd *h) {
    unsigned strangers = h->lim.max_conns - h->lim.reserved_conns;
    unsigned b = h->lim.max_conns_per_block ? h->lim.max_conns_per_block : strangers / 2;
    return b < h->lim.max_conns_per_ip ? h->lim.max_conns_per_ip : b ? b : 1;
}

/* The tally slot of a (found or empty), under h->mu. */
static hd_tally *hd_tally_slot(httpd *h, const hd_addr *a) {
    uint32_t x = 2166136261u;   /* FNV-1a */
    for (int i = 0; i < 16; i++) x = (x ^ a->a[i]) * 16777619u;
    for (unsigned i = x & (h->tally_cap - 1);; i = (i + 1) & (h->tally_cap - 1))
        if (!h->tally[i].n || httpd_same_addr(&h->tally[i].addr, a)) return &h->tally[i];
}

/* MHD's accept policy: is there a share for a connection from sa? When
 * the strangers' pool is full it makes room by closing, in this order:
 * the slowest stranger (its request arriving for HD_EVICT_MIN_MS or
 * more); else, in a flood of fresh connections, the oldest incomplete one
 * of the address holding the most, when that is more than the newcomer's
 * address holds (so a quiet address always gets in). Runs on MHD's
 * listening thread, as does NOTIFY_STARTED right after it, so no other
 * admission comes between this decision and the count. */
static enum MHD_Result hd_admit(void *cls, const struct sockaddr *sa, socklen_t len) {
    httpd *h = cls;
    hd_addr a;
    (void)len;
    if (httpd_addr_of(sa, &a)) return MHD_YES;   /* not an IP socket: nothing to share */
    double now = hd_now();
    pthread_mutex_lock(&h->mu);
    unsigned live = 0, strangers = 0, same = 0, block = 0;
    hd_conn *slow = NULL, *greedy = NULL;
    unsigned greedy_n = 0;
    for (hd_conn *k = h->conns; k; k = k->next) {
        if (k->killed) continue;
        live++;
        if (k->trusted) continue;
        strangers++;
        if (k->has_addr && httpd_same_addr(&k->addr, &a)) same++;
        if (k->has_addr && httpd_same_block(&k->addr, &a)) block++;
        if (k->receiving && k->fd >= 0 && now - k->request_ms >= HD_EVICT_MIN_MS &&
            (!slow || k->request_ms < slow->request_ms))
            slow = k;
    }
    int full = strangers >= h->lim.max_conns - h->lim.reserved_conns || live >= h->lim.max_conns;
    if (full && !slow && h->tally) {   /* a flood of fresh ones: who holds the most? (only then: it costs a pass) */
        memset(h->tally, 0, (size_t)h->tally_cap * sizeof *h->tally);
        for (hd_conn *k = h->conns; k; k = k->next) {
            if (k->killed || k->trusted || !k->has_addr) continue;
            hd_tally *t = hd_tally_slot(h, &k->addr);
            t->addr = k->addr;
            t->n++;
        }
        for (hd_conn *k = h->conns; k; k = k->next) {
            if (k->killed || k->trusted || !k->has_addr || !k->receiving || k->fd < 0) continue;
            unsigned n = hd_tally_slot(h, &k->addr)->n;
            if (n > greedy_n || (n == greedy_n && k->request_ms < greedy->request_ms)) { greedy = k; greedy_n = n; }
        }
    }
    if (greedy && greedy_n <= same) greedy = NULL;
    enum MHD_Result ok = MHD_YES;
    if (hd_is_trusted(h, &a, now)) {
        ok = live < h->lim.max_conns ? MHD_YES : MHD_NO;
    } else if ((h->lim.max_conns_per_ip && same >= h->lim.max_conns_per_ip) || block >= hd_block_share(h)) {
        ok = MHD_NO;   /* this address (block) has its share: its own connections are its business */
    } else if (full) {
        hd_conn *v = slow ? slow : greedy;
        if (v) {
            shutdown(v->fd, SHUT_RDWR);   /* its thread sees the end and closes it */
            v->killed = 1;
            h->evicted++;
        } else {
            ok = MHD_NO;
        }
    }
    if (!ok) h->refused++;
    pthread_mutex_unlock(&h->mu);
    return ok;
}

void httpd_trust_peer(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    hd_conn *k = ci ? ci->socket_context : NULL;
    if (!k || !k->has_addr) return;
    httpd *h = k->h;
    double now = hd_now();
    pthread_mutex_lock(&h->mu);
    k->trusted = 1;
    int slot = -1;
    for (int i = 0; i < HD_TRUST_MAX; i++) {
        if (h->trust[i].until_ms > 0 && httpd_same_addr(&h->trust[i].addr, &k->addr)) { slot = i; break; }
        /* else the free or the soonest-expiring entry */
        if (slot < 0 || h->trust[i].until_ms < h->trust[slot].until_ms) slot = i;
    }
    h->trust[slot].addr = k->addr;
    h->trust[slot].until_ms = now + HD_TRUST_MS;
    pthread_mutex_unlock(&h->mu);
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
        const union MHD_ConnectionInfo *ai = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
        if (!k) return;   /* no deadline for this one; MHD's limits still hold */
        k->h = h;
        k->fd = ci ? ci->connect_fd : -1;
        k->receiving = 1;
        k->request_ms = hd_now();
        k->deadline_ms = k->request_ms + h->lim.request_deadline_ms;
        k->has_addr = ai && !httpd_addr_of(ai->client_addr, &k->addr);
        pthread_mutex_lock(&h->mu);
        k->trusted = k->has_addr && hd_is_trusted(h, &k->addr, k->request_ms);
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
        if (!k->active) { k->active = 1; h->active++; }
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
    if (k->active) { k->active = 0; h->active--; }
    k->calls = 0;
    k->receiving = 1;
    k->request_ms = hd_now();
    k->deadline_ms = k->request_ms + h->lim.request_deadline_ms;
    pthread_mutex_unlock(&h->mu);
}

/* How often httpd_wait_idle looks at the count of requests in progress. */
#define HD_IDLE_POLL_MS 20

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
    if (h->lim.max_conns < 1) h->lim.max_conns = 1;
    if (h->lim.reserved_conns >= h->lim.max_conns) h->lim.reserved_conns = h->lim.max_conns - 1;
    if (h->lim.request_deadline_ms <= 0) h->lim.request_deadline_ms = 1 << 30;
    h->fd = listen_fd;
    h->quiesced_fd = -1;
    h->port = hd_local_port(listen_fd);
    h->handler = handler;
    h->handler_cls = handler_cls;
    h->completed = completed;
    h->completed_cls = completed_cls;
    h->log_lim = (log_limit){ .window_ms = HD_LOG_WINDOW_MS, .burst = HD_LOG_BURST, .t0 = hd_now() };
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    hd_raise_nofile(h->lim.max_conns + HD_CLOSING_SPARE);
    for (h->tally_cap = 16; h->tally_cap < 2 * (h->lim.max_conns + HD_CLOSING_SPARE); h->tally_cap *= 2) {}
    h->tally = calloc(h->tally_cap, sizeof *h->tally);   /* without it, only the slowest are evicted */
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    int v6 = !getsockname(listen_fd, (struct sockaddr *)&ss, &sl) && ss.ss_family == AF_INET6;
    /* poll, not select: descriptors beyond FD_SETSIZE must work */
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
                     MHD_USE_ERROR_LOG | MHD_USE_ITC | (v6 ? MHD_USE_IPv6 : 0);   /* ITC: httpd_quiesce */
    h->d = MHD_start_daemon(flags, 0, hd_admit, h, hd_access, h,
                            MHD_OPTION_EXTERNAL_LOGGER, hd_logger, h,
                            MHD_OPTION_LISTEN_SOCKET, listen_fd,
                            MHD_OPTION_NOTIFY_CONNECTION, hd_notify, h,
                            MHD_OPTION_NOTIFY_COMPLETED, hd_completed, h,
                            MHD_OPTION_CONNECTION_LIMIT, h->lim.max_conns + HD_CLOSING_SPARE,
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

unsigned long long httpd_evicted(httpd *h) {
    pthread_mutex_lock(&h->mu);
    unsigned long long n = h->evicted;
    pthread_mutex_unlock(&h->mu);
    return n;
}

unsigned long long httpd_refused(httpd *h) {
    pthread_mutex_lock(&h->mu);
    unsigned long long n = h->refused;
    pthread_mutex_unlock(&h->mu);
    return n;
}

/* ==== Drain ==== */

void httpd_quiesce(httpd *h) {
    if (!h || !h->d || h->quiesced_fd >= 0) return;
    MHD_socket s = MHD_quiesce_daemon(h->d);
    if (s == MHD_INVALID_SOCKET) return;
    h->quiesced_fd = s;
    /* On Linux this takes the socket out of the listening state: a new
     * client is refused at once (ECONNREFUSED) instead of waiting in the
     * backlog for an accept that never comes. The descriptor itself stays
     * open until MHD_stop_daemon has joined its threads (MHD's rule). */
    shutdown(s, SHUT_RDWR);
}

int httpd_active(httpd *h) {
    if (!h) return 0;
    pthread_mutex_lock(&h->mu);
    int n = h->active;
    pthread_mutex_unlock(&h->mu);
    return n;
}

int httpd_wait_idle(httpd *h, int timeout_ms) {
    double end = hd_now() + (timeout_ms > 0 ? timeout_ms : 0);
    int n;
    while ((n = httpd_active(h)) > 0 && hd_now() < end) {
        struct timespec ts = { 0, HD_IDLE_POLL_MS * 1000000L };
        nanosleep(&ts, NULL);
    }
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
    if (h->quiesced_fd >= 0) close(h->quiesced_fd);   /* quiesced: MHD left it to us */
    pthread_cond_destroy(&h->cv);
    pthread_mutex_destroy(&h->mu);
    free(h->tally);
    free(h);
}
