/* prefix_report.c - a decode node's report of the prefixes it holds
 * (prefix_report.h). */
#include "node/prefix_report.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/prefix_hash.h"

/* Tiers a report can name ("slots" and a KV store's two). */
#define PR_TIERS 3
/* Prefill-node connections a decode node keeps (node_decode.c DN_MAX_PEERS). */
#define PR_PEERS 16

typedef struct {
    char name[8];
    uint64_t *h;
    int n, cap;
} pr_list;

struct prefix_report {
    uint64_t seed;
    int total, truncated;
    pr_list tier[PR_TIERS];
    int n_tier;
    struct { char addr[256]; pr_list l; } peer[PR_PEERS];
    int n_peer;
};

/* ==== Building ==== */

prefix_report *prefix_report_new(uint64_t seed) {
    prefix_report *r = calloc(1, sizeof *r);
    if (r) r->seed = seed;
    return r;
}

void prefix_report_free(prefix_report *r) {
    if (!r) return;
    for (int i = 0; i < r->n_tier; i++) free(r->tier[i].h);
    for (int i = 0; i < r->n_peer; i++) free(r->peer[i].l.h);
    free(r);
}

static int pr_cmp(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Appends up to cap_left of h[0..n) to l, then sorts and drops duplicates;
 * returns the hashes added. */
static int pr_list_add(pr_list *l, const uint64_t *h, int n, int cap_left, int *truncated) {
    if (n <= 0) return 0;
    if (n > cap_left) { n = cap_left; *truncated = 1; }
    if (n <= 0) return 0;
    if (l->n + n > l->cap) {
        int cap = l->n + n;
        uint64_t *p = realloc(l->h, sizeof *p * (size_t)cap);
        if (!p) { *truncated = 1; return 0; }
        l->h = p;
        l->cap = cap;
    }
    int before = l->n;
    memcpy(l->h + l->n, h, sizeof *h * (size_t)n);
    l->n += n;
    qsort(l->h, (size_t)l->n, sizeof *l->h, pr_cmp);
    int k = 0;
    for (int i = 0; i < l->n; i++)
        if (k == 0 || l->h[i] != l->h[k - 1]) l->h[k++] = l->h[i];
    l->n = k;
    return l->n - before;
}

void prefix_report_add(prefix_report *r, const char *tier, const uint64_t *h, int n) {
    if (!r || !tier) return;
    pr_list *l = NULL;
    for (int i = 0; i < r->n_tier && !l; i++)
        if (!strcmp(r->tier[i].name, tier)) l = &r->tier[i];
    if (!l) {
        if (r->n_tier == PR_TIERS || strlen(tier) >= sizeof l->name) { r->truncated = 1; return; }
        l = &r->tier[r->n_tier++];
        snprintf(l->name, sizeof l->name, "%s", tier);
    }
    r->total += pr_list_add(l, h, n, PREFIX_REPORT_MAX - r->total, &r->truncated);
}

void prefix_report_add_peer(prefix_report *r, const char *addr, const uint64_t *h, int n) {
    if (!r || !addr || n <= 0) return;
    pr_list *l = NULL;
    for (int i = 0; i < r->n_peer && !l; i++)
        if (!strcmp(r->peer[i].addr, addr)) l = &r->peer[i].l;
    if (!l) {
        if (r->n_peer == PR_PEERS) { r->truncated = 1; return; }
        snprintf(r->peer[r->n_peer].addr, sizeof r->peer[r->n_peer].addr, "%s", addr);
        l = &r->peer[r->n_peer++].l;
    }
    int left = PREFIX_REPORT_PEER_MAX - l->n;
    if (left > PREFIX_REPORT_MAX - r->total) left = PREFIX_REPORT_MAX - r->total;
    r->total += pr_list_add(l, h, n, left, &r->truncated);
}

/* ==== JSON ==== */

static json_t *pr_hex_array(const pr_list *l) {
    json_t *a = json_array();
    char hex[17];
    for (int i = 0; a && i < l->n; i++) {
        snprintf(hex, sizeof hex, "%016llx", (unsigned long long)l->h[i]);
        json_array_append_new(a, json_string(hex));
    }
    return a;
}

json_t *prefix_report_json(const prefix_report *r) {
    if (!r) return NULL;
    char seed[17];
    snprintf(seed, sizeof seed, "%016llx", (unsigned long long)r->seed);
    json_t *tiers = json_object(), *peers = json_array();
    for (int i = 0; tiers && i < r->n_tier; i++) json_object_set_new(tiers, r->tier[i].name, pr_hex_array(&r->tier[i]));
    for (int i = 0; peers && i < r->n_peer; i++)
        json_array_append_new(peers, json_pack("{s:s, s:o}", "addr", r->peer[i].addr, "hashes", pr_hex_array(&r->peer[i].l)));
    return json_pack("{s:i, s:s, s:b, s:o, s:o}", "block", PREFIX_HASH_BLOCK, "seed", seed, "truncated", r->truncated,
                     "tiers", tiers, "peers", peers);
}

/* ==== A prefill-node connection's prompt ==== */

prefix_held prefix_held_make(const int32_t *ids, int n, uint64_t seed) {
    prefix_held p = {0};
    int nb = ids && n > 0 ? n / PREFIX_HASH_BLOCK : 0;
    if (nb > PREFIX_REPORT_PEER_MAX) nb = PREFIX_REPORT_PEER_MAX;
    if (nb == 0 || !(p.h = malloc(sizeof *p.h * (size_t)nb))) return p;
    int k = prefix_hash_blocks(ids, n, PREFIX_HASH_BLOCK, seed, p.h, nb);
    p.n = k > 0 ? k : 0;
    return p;
}

void prefix_held_clear(prefix_held *p) {
    free(p->h);
    p->h = NULL;
    p->n = 0;
}

int prefix_held_match(const prefix_held *p, const uint64_t *h, int n) {
    int k = 0;
    while (k < n && k < p->n && p->h[k] == h[k]) k++;
    return k;
}
