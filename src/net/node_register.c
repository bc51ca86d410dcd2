/* node_register.c - registration and heartbeat thread (node_register.h). */
#include "net/node_register.h"

#include <curl/curl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "net/node_auth.h"

#define NR_TIMEOUT_MS 3000         /* one registration POST */
#define NR_MAX_REPLY 4096          /* the router's answer is a short JSON object */

struct node_register {
    char url[512], role[16], model[128], host[256];
    int fixed_port;              /* from --advertise HOST:PORT; 0 = our bound port */
    volatile int *port;
    node_auth_key key;
    int interval_ms;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stopping;
    pthread_t th;
    int th_started;
    int registered_port;         /* the port of the last accepted registration; 0 = none yet */
};

typedef struct { char s[NR_MAX_REPLY + 1]; size_t len; } nr_buf;

void node_register_default_model(const char *path, char *out, size_t outlen) {
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    size_t n = strlen(b);
    if (n > 5 && !strcmp(b + n - 5, ".gguf")) n -= 5;
    snprintf(out, outlen, "%.*s", (int)n, b);
}

/* ==== Address to advertise ==== */

/* Splits HOST[:PORT] ("[v6]" or "[v6]:PORT" for IPv6); port 0 when absent. */
static int nr_split(const char *s, char *host, size_t hl, int *port) {
    const char *colon = NULL;
    *port = 0;
    if (s[0] == '[') {
        const char *e = strchr(s, ']');
        if (!e) return -1;
        colon = e[1] == ':' ? e + 1 : NULL;
        if (e[1] && !colon) return -1;
    } else {
        colon = strchr(s, ':');
        if (colon && strchr(colon + 1, ':')) return -1;   /* a bare IPv6 address needs brackets */
    }
    size_t n = colon ? (size_t)(colon - s) : strlen(s);
    if (n == 0 || n >= hl) return -1;
    memcpy(host, s, n);
    host[n] = 0;
    if (colon) {
        char *end;
        long p = strtol(colon + 1, &end, 10);
        if (*end || end == colon + 1 || p < 0 || p > 65535) return -1;
        *port = (int)p;
    }
    return 0;
}

static int nr_wildcard(const char *host) {
    return !strcmp(host, "0.0.0.0") || !strcmp(host, "[::]") || !strcmp(host, "*");
}

static int nr_resolve_addr(node_register *r, const node_register_opts *o, char *err, size_t errlen) {
    const char *src = o->advertise ? o->advertise : o->listen ? o->listen : "127.0.0.1:0";
    int port = 0;
    if (src[0] == ':') { snprintf(r->host, sizeof r->host, "127.0.0.1"); port = atoi(src + 1); }
    else if (nr_split(src, r->host, sizeof r->host, &port)) {
        snprintf(err, errlen, "cannot read the address to register from '%s' (want HOST or HOST:PORT)", src);
        return -1;
    }
    for (const char *p = r->host; *p; p++)
        if (*p <= ' ' || *p == 0x7f || *p == '/' || *p == '@') {
            snprintf(err, errlen, "bad host in the address to register: '%s'", src);
            return -1;
        }
    if (nr_wildcard(r->host)) {
        snprintf(err, errlen, "listening on all interfaces (%s): give --advertise HOST[:PORT], the address the router "
                 "should use", src);
        return -1;
    }
    r->fixed_port = o->advertise ? port : 0;
    return 0;
}

/* ==== One registration ==== */

static size_t nr_sink(char *p, size_t sz, size_t nm, void *ud) {
    nr_buf *b = ud;
    size_t n = sz * nm, room = NR_MAX_REPLY - b->len;
    memcpy(b->s + b->len, p, n < room ? n : room);
    b->len += n < room ? n : room;
    b->s[b->len] = 0;
    return n;
}

/* POSTs one registration; HTTP status (-1 transport failure), reply in *b. */
static long nr_post(node_register *r, int port, int leaving, nr_buf *b, char *cerr) {
    char addr[300];
    snprintf(addr, sizeof addr, "%s:%d", r->host, port);
    json_t *o = json_pack("{s:s, s:s, s:s}", "role", r->role, "model", r->model, "addr", addr);
    if (o && leaving) json_object_set_new(o, "leaving", json_true());
    char *body = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    node_auth_sig sig;
    struct curl_slist *hl = NULL;
    CURL *h = curl_easy_init();
    long code = -1;
    if (!body || !h || node_auth_sign(&r->key, "POST", "/v1/nodes/register", body, strlen(body), node_auth_now_ms(), &sig) ||
        !(hl = curl_slist_append(NULL, "Content-Type: application/json")) || !(hl = node_auth_curl_headers(hl, &sig))) {
        snprintf(cerr, CURL_ERROR_SIZE, "out of memory");
        goto out;
    }
    char url[600];
    snprintf(url, sizeof url, "%s/v1/nodes/register", r->url);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hl);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, nr_sink);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, b);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)NR_TIMEOUT_MS);
    curl_easy_setopt(h, CURLOPT_PROXY, "");   /* the router is reached directly */
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, cerr);
    if (curl_easy_perform(h) == CURLE_OK) curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
out:
    curl_slist_free_all(hl);
    curl_easy_cleanup(h);
    free(body);
    return code;
}

/* ==== Thread ==== */

/* Sleeps ms or until stopped; 1 when stopping. */
static int nr_wait(node_register *r, int ms) {
    pthread_mutex_lock(&r->mu);
    if (!r->stopping) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        long long ns = ts.tv_nsec + (long long)ms * 1000000LL;
        ts.tv_sec += ns / 1000000000LL;
        ts.tv_nsec = ns % 1000000000LL;
        pthread_cond_timedwait(&r->cv, &r->mu, &ts);
    }
    int s = r->stopping;
    pthread_mutex_unlock(&r->mu);
    return s;
}

static void *nr_main(void *arg) {
    node_register *r = arg;
    int state = 0;   /* 0 unknown, 1 registered, -1 failing */
    while (*r->port <= 0)
        if (nr_wait(r, 50)) return NULL;
    int port = r->fixed_port ? r->fixed_port : *r->port;
    do {
        nr_buf b = { .len = 0 };
        char cerr[CURL_ERROR_SIZE] = "";
        long code = nr_post(r, port, 0, &b, cerr);
        pthread_mutex_lock(&r->mu);
        r->registered_port = code == 200 ? port : r->registered_port;
        pthread_mutex_unlock(&r->mu);
        if (code == 200 && state != 1)
            log_info(NULL, "registered with router %s as %s:%d (model %s), heartbeat every %d ms", r->url, r->host, port,
                     r->model, r->interval_ms);
        else if (code != 200 && state != -1)
            log_warn(NULL, "registration with router %s failed: %s%ld %s%s", r->url, code < 0 ? "" : "HTTP ", code,
                     code < 0 ? cerr : b.s, state == 1 ? "" : " (retrying quietly)");
        state = code == 200 ? 1 : -1;
    } while (!nr_wait(r, r->interval_ms));
    return NULL;
}

int node_register_start(node_register **out, const node_register_opts *o, char *err, size_t errlen) {
    *out = NULL;
    if (!o->secret || !o->secret_len) {
        snprintf(err, errlen, "registering with a router needs the shared secret (--secret-file or TANDEM_SECRET)");
        return -1;
    }
    if (!o->router_url || (strncmp(o->router_url, "http://", 7) && strncmp(o->router_url, "https://", 8)) ||
        strlen(o->router_url) >= 512) {
        snprintf(err, errlen, "--router wants the router's URL, http://HOST:PORT");
        return -1;
    }
    if (!o->model || !*o->model || strlen(o->model) >= 128) { snprintf(err, errlen, "bad model name to register"); return -1; }
    node_register *r = calloc(1, sizeof *r);
    if (!r) { snprintf(err, errlen, "out of memory"); return -1; }
    snprintf(r->url, sizeof r->url, "%s", o->router_url);
    size_t ul = strlen(r->url);
    while (ul && r->url[ul - 1] == '/') r->url[--ul] = 0;
    snprintf(r->role, sizeof r->role, "%s", o->role);
    snprintf(r->model, sizeof r->model, "%s", o->model);
    if (nr_resolve_addr(r, o, err, errlen)) { free(r); return -1; }
    r->port = o->port;
    r->interval_ms = o->interval_ms > 0 ? o->interval_ms : NODE_REGISTER_INTERVAL_MS;
    node_auth_derive(&r->key, o->secret, o->secret_len, NODE_AUTH_LABEL_REGISTER);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    curl_global_init(CURL_GLOBAL_DEFAULT);
    if (pthread_create(&r->th, NULL, nr_main, r)) {
        snprintf(err, errlen, "cannot start the registration thread");
        node_register_stop(r);
        return -1;
    }
    r->th_started = 1;
    *out = r;
    return 0;
}

/* Ends the heartbeat thread (idempotent). */
static void nr_join(node_register *r) {
    pthread_mutex_lock(&r->mu);
    r->stopping = 1;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    if (r->th_started) pthread_join(r->th, NULL);
    r->th_started = 0;
}

int node_register_leave(node_register *r) {
    if (!r) return 0;
    nr_join(r);
    if (!r->registered_port) return 0;   /* never registered: nothing to take back */
    nr_buf b = { .len = 0 };
    char cerr[CURL_ERROR_SIZE] = "";
    long code = nr_post(r, r->registered_port, 1, &b, cerr);
    if (code == 200) log_info(NULL, "deregistered from router %s", r->url);
    else log_warn(NULL, "deregistering from router %s failed: %s%ld %s (it drops us at the heartbeat timeout)", r->url,
                  code < 0 ? "" : "HTTP ", code, code < 0 ? cerr : b.s);
    return code == 200 ? 0 : -1;
}

void node_register_stop(node_register *r) {
    if (!r) return;
    nr_join(r);
    node_auth_wipe(&r->key);
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
    curl_global_cleanup();
    free(r);
}
