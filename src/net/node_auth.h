/* node_auth.h - signed HTTP requests between tandem's own processes.
 *
 * Two internal HTTP endpoints act on a request: a decode node's
 * POST /v1/generate (the router forwards work there) and the router's
 * POST /v1/nodes/register (nodes announce themselves). Both are signed
 * with a key derived from the shared secret, one key per purpose so a
 * signature made for one endpoint never verifies at the other:
 *
 *   K = HMAC-SHA256(secret, label)      label: NODE_AUTH_LABEL_*
 *
 * and each request carries three headers:
 *
 *   X-Tandem-Time:      unix time in milliseconds (decimal)
 *   X-Tandem-Nonce:     16 random bytes, 32 lower-case hex digits
 *   X-Tandem-Signature: hex HMAC-SHA256(K, "tandem-sig-v1\n" METHOD "\n" PATH "\n"
 *                                          TIME "\n" NONCE "\n" hex(SHA-256(body)))
 *
 * The verifier accepts a time within NODE_AUTH_WINDOW_MS of its own clock,
 * checks the MAC in constant time and then remembers the nonce: the same
 * nonce within the window is refused (node_auth_replay), so a captured
 * request cannot be replayed. The replay cache is bounded; when it must
 * forget an unexpired nonce it raises a floor and refuses every request
 * whose time is not after it, so forgetting never reopens a replay.
 */
#ifndef TANDEM_NODE_AUTH_H
#define TANDEM_NODE_AUTH_H

#include <stddef.h>

#define NODE_AUTH_HDR_TIME  "X-Tandem-Time"
#define NODE_AUTH_HDR_NONCE "X-Tandem-Nonce"
#define NODE_AUTH_HDR_SIG   "X-Tandem-Signature"
#define NODE_AUTH_LABEL_DECODE_API "tandem decode-api v1"
#define NODE_AUTH_LABEL_REGISTER   "tandem register v1"
/* Allowed clock difference between signer and verifier (and so the time a
 * nonce must be remembered): NTP keeps hosts within milliseconds; 30 s
 * absorbs a badly synchronised host without keeping captured requests
 * valid for long. */
#define NODE_AUTH_WINDOW_MS 30000
/* Nonces remembered: 8192 in a 30 s window is ~270 signed requests/s
 * before the floor starts refusing late arrivals. */
#define NODE_AUTH_REPLAY_CAP 8192

typedef struct { unsigned char k[32]; } node_auth_key;

typedef struct {
    char time[24];
    char nonce[33];
    char sig[65];
} node_auth_sig;

/* K = HMAC-SHA256(secret, label). */
void node_auth_derive(node_auth_key *k, const void *secret, size_t secret_len, const char *label);
void node_auth_wipe(node_auth_key *k);
/* Wall-clock unix time in milliseconds. */
long long node_auth_now_ms(void);

/* Signs one request with a fresh random nonce; 0, or -1 if the random
 * generator or the path (at most 256 bytes) fails. */
int node_auth_sign(const node_auth_key *k, const char *method, const char *path, const void *body, size_t len,
                   long long now_ms, node_auth_sig *s);

/* Appends the three headers to a curl header list (struct curl_slist *);
 * returns the new list, or NULL (the old list freed) when out of memory. */
struct curl_slist;
struct curl_slist *node_auth_curl_headers(struct curl_slist *l, const node_auth_sig *s);

/* Signs method + path + body now (k NULL: leaves l as it is) and appends
 * the three headers: what a GET (body NULL) or POST to a node with a
 * secret needs in one call. The new list, or NULL (the old list freed). */
struct curl_slist *node_auth_curl_sign(struct curl_slist *l, const node_auth_key *k, const char *method,
                                       const char *path, const void *body, size_t len);

typedef struct node_auth_replay node_auth_replay;
node_auth_replay *node_auth_replay_new(int cap);
void node_auth_replay_free(node_auth_replay *rp);

/* Cheap checks that need no body: the three headers are present and well
 * formed, and the time is inside the window. 0, or -1 with a message. */
int node_auth_precheck(const char *time, const char *nonce, const char *sig, long long now_ms,
                       char *err, size_t errlen);
/* Full verification: precheck, the MAC over method, path and body, then
 * the replay cache (rp may be NULL only in tests). 0, or -1 with a message
 * fit for a 401 answer. */
int node_auth_verify(const node_auth_key *k, node_auth_replay *rp, const char *method, const char *path,
                     const char *time, const char *nonce, const char *sig, const void *body, size_t len,
                     long long now_ms, char *err, size_t errlen);

/* The same, reading the three headers of a libmicrohttpd request. With
 * body NULL only node_auth_precheck runs (the body has not arrived yet). */
struct MHD_Connection;
int node_auth_check_request(struct MHD_Connection *c, const node_auth_key *k, node_auth_replay *rp,
                            const char *method, const char *path, const void *body, size_t len,
                            char *err, size_t errlen);

#endif
