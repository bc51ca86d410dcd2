/* prefix_report.h - what a decode node tells the router it holds, for
 * cache-aware routing (issue 47; docs/router.md "Routing by cache and
 * capacity").
 *
 * The report names prefixes by their chained 64-token block hashes
 * (base/prefix_hash.h, seeded by the model fingerprint), by tier:
 *   "slots"  the generation slots' KV caches (scheduler.c);
 *   "store"  the KV store's tiers, memory then disk (kvstore_list_hashes);
 * and, per prefill node this node talks to, what that connection's session
 * on the prefill node holds (a prefill node keeps the last prompt of each
 * connection and computes only past it). GET /v1/stats carries it as
 *   "prefix": {"block": 64, "seed": "<16 hex>", "truncated": false,
 *              "tiers": {"slots": ["<16 hex>", ...], ...},
 *              "peers": [{"addr": "HOST:PORT", "hashes": [...]}]}
 * Bounded: PREFIX_REPORT_MAX hashes in all (duplicates across slots and
 * tiers are sent once per tier), PREFIX_REPORT_PEER_MAX per connection;
 * past them "truncated" is true and the rest is left out (the router then
 * knows less, never something wrong).
 */
#ifndef TANDEM_PREFIX_REPORT_H
#define TANDEM_PREFIX_REPORT_H

#include <stdint.h>

#include <jansson.h>

/* 4096 blocks of 64 tokens: 256k positions, the slots of a node with 64
 * slots of 4k context; about 80 KB of JSON at most, once per health
 * interval. */
#define PREFIX_REPORT_MAX 4096
/* A prefill-node connection holds one prompt: a 64k-token one. */
#define PREFIX_REPORT_PEER_MAX 1024

typedef struct prefix_report prefix_report;

/* NULL when out of memory. */
prefix_report *prefix_report_new(uint64_t seed);
void prefix_report_free(prefix_report *r);
/* Hashes held in a tier ("slots", "host", "disk"). */
void prefix_report_add(prefix_report *r, const char *tier, const uint64_t *h, int n);
/* What the connection to the prefill node at addr holds. */
void prefix_report_add_peer(prefix_report *r, const char *addr, const uint64_t *h, int n);
/* The "prefix" object (a new reference, or NULL when out of memory). */
json_t *prefix_report_json(const prefix_report *r);

/* ==== A prompt held by a prefill-node connection ==== */

typedef struct {
    uint64_t *h;                 /* block hashes of the prompt's first n positions */
    int n;
} prefix_held;

/* The hashes of ids[0..n) (n <= 0 or ids NULL: empty); h NULL when out of
 * memory (then empty too). */
prefix_held prefix_held_make(const int32_t *ids, int n, uint64_t seed);
void prefix_held_clear(prefix_held *p);
/* Leading hashes of h[0..n) that p holds. */
int prefix_held_match(const prefix_held *p, const uint64_t *h, int n);

#endif
