/* node_auth.c - request signatures and the nonce replay cache (node_auth.h). */
#include "net/node_auth.h"

#include <curl/curl.h>
#include <microhttpd.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <openssl/sha.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NA_MAX_PATH 256
#define NA_MAX_METHOD 16
#define NA_MAX_TIME_DIGITS 15   /* ms until the year 33658: ample, and no overflow */

/* ==== Keys and MACs ==== */

void node_auth_derive(node_auth_key *k, const void *secret, size_t secret_len, const char *label) {
    unsigned int ml = 0;
    HMAC(EVP_sha256(), secret, (int)secret_len, (const unsigned char *)label, strlen(label), k->k, &ml);
}

void node_auth_wipe(node_auth_key *k) { OPENSSL_cleanse(k->k, sizeof k->k); }

long long node_auth_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void na_hex(const unsigned char *b, size_t n, char *out) {
    static const char d[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) { out[2 * i] = d[b[i] >> 4]; out[2 * i + 1] = d[b[i] & 15]; }
    out[2 * n] = 0;
}

static int na_unhex(const char *s, unsigned char *out, size_t n) {
    for (size_t i = 0; i < 2 * n; i++) {
        char c = s[i];
        int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (v < 0) return -1;
        if (i & 1) out[i / 2] |= (unsigned char)v;
        else out[i / 2] = (unsigned char)(v << 4);
    }
    return s[2 * n] ? -1 : 0;
}

/* hex MAC of the canonical string; -1 when method or path are too long. */
static int na_mac(const node_auth_key *k, const char *method, const char *path, const char *time,
                  const char *nonce, const void *body, size_t len, char out[65]) {
    if (strlen(method) > NA_MAX_METHOD || strlen(path) > NA_MAX_PATH) return -1;
    unsigned char h[32], mac[32];
    char hh[65], msg[NA_MAX_METHOD + NA_MAX_PATH + 200];
    SHA256(body ? body : (const void *)"", len, h);
    na_hex(h, 32, hh);
    int n = snprintf(msg, sizeof msg, "tandem-sig-v1\n%s\n%s\n%s\n%s\n%s", method, path, time, nonce, hh);
    if (n < 0 || (size_t)n >= sizeof msg) return -1;
    unsigned int ml = 0;
    HMAC(EVP_sha256(), k->k, sizeof k->k, (const unsigned char *)msg, (size_t)n, mac, &ml);
    na_hex(mac, 32, out);
    return 0;
}

int node_auth_sign(const node_auth_key *k, const char *method, const char *path, const void *body, size_t len,
                   long long now_ms, node_auth_sig *s) {
    unsigned char nonce[16];
    if (RAND_bytes(nonce, sizeof nonce) != 1) return -1;
    na_hex(nonce, sizeof nonce, s->nonce);
    snprintf(s->time, sizeof s->time, "%lld", now_ms);
    return na_mac(k, method, path, s->time, s->nonce, body, len, s->sig);
}

struct curl_slist *node_auth_curl_headers(struct curl_slist *l, const node_auth_sig *s) {
    char h[128];
    const char *names[3] = { NODE_AUTH_HDR_TIME, NODE_AUTH_HDR_NONCE, NODE_AUTH_HDR_SIG };
    const char *vals[3] = { s->time, s->nonce, s->sig };
    for (int i = 0; i < 3; i++) {
        snprintf(h, sizeof h, "%s: %s", names[i], vals[i]);
        struct curl_slist *n = curl_slist_append(l, h);
        if (!n) { curl_slist_free_all(l); return NULL; }
        l = n;
    }
    return l;
}

struct curl_slist *node_auth_curl_sign(struct curl_slist *l, const node_auth_key *k, const char *method,
                                       const char *path, const void *body, size_t len) {
    if (!k) return l;
    node_auth_sig sig;
    if (node_auth_sign(k, method, path, body ? body : "", body ? len : 0, node_auth_now_ms(), &sig)) {
        curl_slist_free_all(l);
        return NULL;
    }
    return node_auth_curl_headers(l, &sig);
}

/* ==== Replay cache ==== */

typedef struct { unsigned char nonce[16]; long long t; } na_seen;

struct node_auth_replay {
    pthread_mutex_t mu;
    na_seen *ring;               /* arrival order */
    int cap, head, count;
    long long floor_ms;          /* requests timed at or before this are refused */
};

node_auth_replay *node_auth_replay_new(int cap) {
    node_auth_replay *rp = calloc(1, sizeof *rp);
    if (!rp) return NULL;
    rp->cap = cap > 0 ? cap : NODE_AUTH_REPLAY_CAP;
    if (!(rp->ring = calloc((size_t)rp->cap, sizeof *rp->ring))) { free(rp); return NULL; }
    pthread_mutex_init(&rp->mu, NULL);
    rp->floor_ms = -1;
    return rp;
}

void node_auth_replay_free(node_auth_replay *rp) {
    if (!rp) return;
    pthread_mutex_destroy(&rp->mu);
    free(rp->ring);
    free(rp);
}

/* 0 and the nonce remembered, or -1 (seen before / before the floor). */
static int na_replay_admit(node_auth_replay *rp, const unsigned char nonce[16], long long t, long long now,
                           char *err, size_t errlen) {
    int rc = 0;
    pthread_mutex_lock(&rp->mu);
    /* entries older than the window can no longer pass the time check */
    while (rp->count && rp->ring[rp->head].t < now - NODE_AUTH_WINDOW_MS) {
        rp->head = (rp->head + 1) % rp->cap;
        rp->count--;
    }
    if (t <= rp->floor_ms) {
        snprintf(err, errlen, "request time is older than the replay cache remembers; sign it again");
        rc = -1;
    }
    for (int i = 0; !rc && i < rp->count; i++)
        if (!memcmp(rp->ring[(rp->head + i) % rp->cap].nonce, nonce, 16)) {
            snprintf(err, errlen, "replayed request (nonce already used)");
            rc = -1;
        }
    if (!rc) {
        if (rp->count == rp->cap) {   /* forget the oldest, and refuse anything not newer than it */
            if (rp->ring[rp->head].t > rp->floor_ms) rp->floor_ms = rp->ring[rp->head].t;
            rp->head = (rp->head + 1) % rp->cap;
            rp->count--;
        }
        na_seen *e = &rp->ring[(rp->head + rp->count) % rp->cap];
        memcpy(e->nonce, nonce, 16);
        e->t = t;
        rp->count++;
    }
    pthread_mutex_unlock(&rp->mu);
    return rc;
}

/* ==== Verification ==== */

static int na_parse_time(const char *s, long long *out) {
    size_t n = strlen(s);
    if (n == 0 || n > NA_MAX_TIME_DIGITS) return -1;
    long long v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        v = v * 10 + (s[i] - '0');
    }
    *out = v;
    return 0;
}

int node_auth_precheck(const char *time, const char *nonce, const char *sig, long long now_ms,
                       char *err, size_t errlen) {
    unsigned char nb[16], sb[32];
    long long t;
    if (!time || !nonce || !sig) {
        snprintf(err, errlen, "missing %s/%s/%s headers: this endpoint takes only requests signed with the "
                 "cluster's shared secret", NODE_AUTH_HDR_TIME, NODE_AUTH_HDR_NONCE, NODE_AUTH_HDR_SIG);
        return -1;
    }
    if (na_parse_time(time, &t)) { snprintf(err, errlen, "%s must be unix milliseconds", NODE_AUTH_HDR_TIME); return -1; }
    if (strlen(nonce) != 32 || na_unhex(nonce, nb, 16)) {
        snprintf(err, errlen, "%s must be 32 lower-case hex digits", NODE_AUTH_HDR_NONCE);
        return -1;
    }
    if (strlen(sig) != 64 || na_unhex(sig, sb, 32)) {
        snprintf(err, errlen, "%s must be 64 lower-case hex digits", NODE_AUTH_HDR_SIG);
        return -1;
    }
    if (t < now_ms - NODE_AUTH_WINDOW_MS || t > now_ms + NODE_AUTH_WINDOW_MS) {
        snprintf(err, errlen, "request time is %lld ms away from this node's clock (allowed: %d ms)",
                 t - now_ms, NODE_AUTH_WINDOW_MS);
        return -1;
    }
    return 0;
}

int node_auth_verify(const node_auth_key *k, node_auth_replay *rp, const char *method, const char *path,
                     const char *time, const char *nonce, const char *sig, const void *body, size_t len,
                     long long now_ms, char *err, size_t errlen) {
    if (node_auth_precheck(time, nonce, sig, now_ms, err, errlen)) return -1;
    char want[65];
    if (na_mac(k, method, path, time, nonce, body, len, want) || CRYPTO_memcmp(want, sig, 64)) {
        snprintf(err, errlen, "bad %s (wrong shared secret, or the request was altered)", NODE_AUTH_HDR_SIG);
        return -1;
    }
    unsigned char nb[16];
    long long t = 0;
    na_unhex(nonce, nb, 16);
    na_parse_time(time, &t);
    return rp ? na_replay_admit(rp, nb, t, now_ms, err, errlen) : 0;
}

int node_auth_check_request(struct MHD_Connection *c, const node_auth_key *k, node_auth_replay *rp,
                            const char *method, const char *path, const void *body, size_t len,
                            char *err, size_t errlen) {
    const char *t = MHD_lookup_connection_value(c, MHD_HEADER_KIND, NODE_AUTH_HDR_TIME);
    const char *nn = MHD_lookup_connection_value(c, MHD_HEADER_KIND, NODE_AUTH_HDR_NONCE);
    const char *s = MHD_lookup_connection_value(c, MHD_HEADER_KIND, NODE_AUTH_HDR_SIG);
    long long now = node_auth_now_ms();
    if (!body) return node_auth_precheck(t, nn, s, now, err, errlen);
    return node_auth_verify(k, rp, method, path, t, nn, s, body, len, now, err, errlen);
}
