/* kvstore_internal.h - what the KV store's files share (not part of its
 * interface: kvstore.h is). The block's file form, the store's state, and
 * the kvs_ functions one file calls in another:
 *   kvstore.c        the tiers (caller holds mu), open and close, put, fill,
 *                    probe, save, warm, stats, /metrics
 *   kvstore_block.c  a block's file form: build, rows, checks
 *   kvstore_disk.c   the disk tier's files: writer thread, loads, readahead,
 *                    the directory and its scan at start-up
 */

#ifndef TANDEM_NODE_KVSTORE_INTERNAL_H
#define TANDEM_NODE_KVSTORE_INTERNAL_H

#include "node/kvstore.h"

#include <pthread.h>
#include <string.h>

#include "base/prefix_hash.h"

/* ==== Constants ==== */

#define KVS_MAGIC "TDMKVBLK"        /* 8 bytes at offset 0 of every block */
/* Bumped whenever the header or the row layout below changes: an old file
 * is then refused (and deleted) instead of misread. */
#define KVS_LAYOUT 2
#define KVS_HDR 128                 /* header bytes; the rest is reserved (zero) */
#define KVS_NAME_LEN 21             /* 16 hex digits + ".kvb" + NUL */

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "kvstore files are little-endian");

/* Header fields (offsets): magic 0, layout 8, dtype 12, fingerprint 16..48,
 * hash 48, block tokens 56, block index 60, n_layer 64, (pad) 68,
 * row_bytes 72, file size 80, checksum 88. */
#define H_LAYOUT 8
#define H_DTYPE 12
#define H_FP 16
#define H_HASH 48
#define H_BTOK 56
#define H_INDEX 60
#define H_NLAYER 64
#define H_ROW 72
#define H_SIZE 80
#define H_SUM 88

/* ==== State ==== */

typedef struct kvs_block {
    uint64_t hash;
    int index;               /* positions [index * B, (index + 1) * B) */
    uint8_t *data;           /* the file form */
    size_t size;
    size_t mapped;           /* data is a hugemap of this many bytes, or 0 (malloc) */
    int refs;
    uint64_t last_used;
} kvs_block;

typedef struct {
    uint64_t hash;
    size_t size;
    uint64_t last_used;
} kvs_disk_entry;

struct kvstore {
    pthread_mutex_t mu;
    pthread_cond_t cv;       /* writer: queue non-empty or stopping; savers: queue drained */
    uint8_t fp[32];
    uint64_t seed;
    uint32_t dtype;
    int n_layer, n_ctx;
    size_t row_bytes;
    uint64_t ram_max, disk_max, ram_used, disk_used, tick;
    kvs_block **ram;         /* the memory tier */
    int n_ram, cap_ram;
    kvs_disk_entry *disk;    /* the disk tier's index */
    int n_disk, cap_disk;
    int dfd;                 /* the model's subdirectory, or -1 */
    char dpath[4096];        /* for log lines */
    kvs_block **wq;          /* blocks to write */
    int n_wq, cap_wq, writing, stopping;
    pthread_t th;
    int th_started;
    unsigned tmp_seq;
    kvstore_stats st;
};

/* ==== Block helpers ==== */

static inline void kvs_put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void kvs_put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static inline uint32_t kvs_get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t kvs_get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static inline size_t kvs_ids_bytes(int index) { return (size_t)(index + 1) * PREFIX_HASH_BLOCK * 4; }
static inline size_t kvs_rows_bytes(const kvstore *st) { return (size_t)st->n_layer * 2 * PREFIX_HASH_BLOCK * st->row_bytes; }
static inline size_t kvs_block_size(const kvstore *st, int index) { return KVS_HDR + kvs_ids_bytes(index) + kvs_rows_bytes(st); }

/* ==== kvstore_block.c ==== */

kvs_block *kvs_block_alloc(size_t size);
void kvs_block_free(kvs_block *b);
int kvs_rows_check(const kvstore *st, const kvcache *kv, int p0, char *err, size_t errlen);
void kvs_rows_copy(const kvstore *st, kvcache *kv, uint8_t *rows, int p0, int from, int in);
kvs_block *kvs_block_make(kvstore *st, uint64_t hash, int index, const int32_t *ids, const kvcache *kv);
int kvs_check_header(const kvstore *st, const uint8_t *h, uint64_t want_hash, int *index_out,
                     char *why, size_t whylen);

/* ==== kvstore.c: the tiers (caller holds mu) ==== */

void kvs_block_unref(kvs_block *b);
int kvs_ram_find(const kvstore *st, uint64_t hash);
int kvs_disk_find(const kvstore *st, uint64_t hash);
void kvs_disk_remove(kvstore *st, int i);
void kvs_name(uint64_t hash, char out[KVS_NAME_LEN]);
int kvs_disk_add(kvstore *st, uint64_t hash, size_t size, uint64_t last_used);

/* ==== kvstore_disk.c ==== */

void *kvs_writer_main(void *arg);
void kvs_queue_write(kvstore *st, kvs_block *b);
kvs_block *kvs_disk_load(kvstore *st, uint64_t hash, int index, const int32_t *ids);
void kvs_disk_readahead(kvstore *st, const uint64_t *h, int from, int to);
int kvs_disk_load_into(kvstore *st, uint64_t hash, int index, const int32_t *ids, kvcache *kv);
int kvs_open_dir(int at, const char *path, char *err, size_t errlen);
void kvs_scan(kvstore *st);

#endif /* TANDEM_NODE_KVSTORE_INTERNAL_H */
