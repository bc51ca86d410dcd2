/* kvstore.h - a node's KV prefix store: KV rows that outlive a slot and a
 * restart, in host memory and on disk.
 *
 * Unit: a block of PREFIX_HASH_BLOCK (64) prompt positions. Block i of a
 * token sequence holds the K and V rows of positions [64 i, 64 (i+1)) of
 * every layer, keyed by prefix_hash.h's chained hash of tokens
 * [0, 64 (i+1)) (seeded by the model fingerprint). A hash only says where
 * to look: every block carries the token ids of its whole prefix, and they
 * are compared with the request's before a row is used.
 *
 * Tiers: host memory up to ram_bytes, then a directory up to disk_bytes,
 * least recently used out first in each. A block enters memory when a
 * sequence ends (kvstore_put) and is written to disk by a background
 * thread (write-through: a kill -9 loses only blocks still queued). A
 * block loaded from disk is read straight into the slot's cache (header
 * and ids checked first, the checksum over what landed before the rows
 * count), and enters memory again when that sequence ends (kvstore_put);
 * kvstore_warm and a fill that starts inside a block read it into memory.
 *
 * On disk: DIR/<first 8 fingerprint bytes, hex>-<kv dtype>/<hash hex>.kvb,
 * one file per block, 0600 in 0700 directories; DIR itself must not be
 * writable by group or others, nor be a symbolic link, nor belong to
 * another user. A file is written to a temporary name, fsync'ed, then
 * renamed, so a crash or a full disk never leaves a half block under a
 * block's name. Each file carries a header (magic, layout version, model
 * fingerprint, KV dtype, block size, shape, its own hash, its size) and an
 * XXH3-64 checksum of everything; a file whose header, size or checksum
 * does not match is deleted with a log line and never loaded. Files are
 * opened with O_NOFOLLOW, and a file's size is checked against what its
 * header implies (and the node's context) before anything is allocated.
 * Several nodes of one model may share a directory: a block one wrote is
 * found by the others (they look a missing block up by its name), and one
 * that another deleted is a miss.
 *
 * Rows in a block: per layer, K then V, each [kv_head][64][head bytes]
 * (the cache's head-major order: copied in runs of 64 positions of a head).
 *
 * Used by the decode node (scheduler_admit.c: its loader thread fills an
 * admitted job's slot, off the scheduler's lock; a finished job puts) and
 * the prefill node (node_prefill.c: per request). A fill that goes to disk
 * asks the kernel for the chain's next block files ahead of the one it reads
 * (posix_fadvise WILLNEED, KVS_READAHEAD_BYTES ahead).
 *
 * Thread safety: every function may be called from any thread.
 */
#ifndef TANDEM_KVSTORE_H
#define TANDEM_KVSTORE_H

#include <stddef.h>
#include <stdint.h>

#include "engine/kvcache.h"
#include "base/metrics.h"
#include "engine/model.h"

typedef struct kvstore kvstore;

typedef struct {
    uint64_t ram_bytes;      /* host-memory tier (0: none) */
    const char *dir;         /* disk tier's directory (NULL: none) */
    uint64_t disk_bytes;     /* disk tier's budget (0 with a dir: 4 GiB) */
} kvstore_opts;

/* Where the positions of one request came from. */
typedef struct {
    int ram_tokens, disk_tokens;   /* positions loaded from each tier */
} kvstore_hit;

enum { KVS_TIER_RAM = 0, KVS_TIER_DISK, KVS_N_TIERS };

typedef struct {
    /* per tier (KVS_TIER_*): blocks found / looked for and not found,
     * bytes served and written, blocks evicted, what the tier holds */
    uint64_t hits[KVS_N_TIERS], misses[KVS_N_TIERS];
    uint64_t bytes_read[KVS_N_TIERS], bytes_written[KVS_N_TIERS];
    uint64_t evictions[KVS_N_TIERS];
    uint64_t blocks[KVS_N_TIERS], bytes[KVS_N_TIERS];
    uint64_t rejected;             /* disk blocks refused (bad header, size, checksum) */
    uint64_t write_errors;         /* disk writes that failed (full disk, directory gone) */
    uint64_t writes_pending;       /* blocks queued for the disk */
} kvstore_stats;

/* Opens the store for model m with caches of kv_dtype and contexts of up to
 * n_ctx positions. With a directory, refuses one that is unsafe (see above)
 * and indexes the blocks already there (checking each header). 0, or -1
 * with a message. */
int kvstore_open(kvstore **out, model *m, uint32_t kv_dtype, int n_ctx, const kvstore_opts *o,
                 char *err, size_t errlen);
/* Writes what is queued for the disk, stops the writer, frees. */
void kvstore_close(kvstore *st);

/* Keeps the full blocks of ids[0, n), whose rows are kv's positions [0, n),
 * that the store does not hold yet. Returns the number of blocks added. */
int kvstore_put(kvstore *st, const int32_t *ids, int n, const kvcache *kv);

/* Extends kv (which holds ids[0, have)) with the longest run of stored
 * blocks that continues it, within ids[0, n): writes their rows for
 * positions [have, end) and sets kv's used count to end. Returns end
 * (>= have); *hit (optional) says which tier served what. */
int kvstore_fill(kvstore *st, const int32_t *ids, int n, int have, kvcache *kv, kvstore_hit *hit);

/* Stored positions of ids[0, n) in the longest run from position 0 (memory
 * or disk), without loading anything: what kvstore_fill would reach from 0. */
int kvstore_probe(kvstore *st, const int32_t *ids, int n);

/* Writes every block of ids[0, n) held in memory to the disk now (an
 * operator's save); waits until they are written. Returns the positions
 * on disk from 0, or -1 when there is no disk tier. */
int kvstore_save(kvstore *st, const int32_t *ids, int n);

/* Loads the stored blocks of ids[0, n) from disk into memory (an
 * operator's load, ahead of the requests that will use them). Returns the
 * positions from 0 held in memory afterwards. */
int kvstore_warm(kvstore *st, const int32_t *ids, int n);

/* The block hashes the store holds, memory first then disk (each once), at
 * most max_out: what a node reports for cache-aware routing. */
int kvstore_list_hashes(kvstore *st, uint64_t *out, int max_out);

/* Checks a block file's bytes (d, size) as a disk load does before any row
 * is used: the header (magic, layout, fingerprint, dtype, shape, its hash
 * == hash, its index == index and within the context, its size field), the
 * size, the checksum, then its token ids == ids[0, 64 (index + 1)). 0: the
 * block to use; -1: a bad block (to delete; why says what); 1: a valid
 * block that is not this lookup's (another prefix with the same hash, or
 * beyond this node's context: another node's). ids is read only after the
 * header and size passed. The parser fuzz/fuzz_kvblock.c drives. */
int kvstore_block_check(const kvstore *st, const uint8_t *d, size_t size, uint64_t hash, int index, const int32_t *ids,
                        char *why, size_t whylen);

void kvstore_get_stats(kvstore *st, kvstore_stats *s);

/* "ram" / "disk" */
const char *kvstore_tier_name(int tier);

/* ==== /metrics ==== */

/* The store's families in a node's registry (labels model, tier). */
typedef struct {
    metrics_family *hits, *misses, *bytes_read, *bytes_written, *evictions, *blocks, *bytes, *rejected, *write_errors;
} kvstore_metrics;

/* prefix: "tandem_decode" or "tandem_prefill". 0, or -1 with a message. */
int kvstore_metrics_init(kvstore_metrics *km, metrics *reg, const char *prefix, char *err, size_t errlen);
/* Copies the store's counters into the families (before rendering). */
void kvstore_metrics_update(kvstore *st, kvstore_metrics *km, const char *model);

#endif
