/* kvstore.c - a node's KV prefix store in host memory and on disk (see kvstore.h).
 *
 * A block in memory is kept in its file form (header, ids, rows), so the
 * writer thread writes it as it is and a block read from disk enters memory
 * without another copy. Both tiers are small arrays searched linearly: a
 * 64 GiB memory tier of 7 MB blocks is 10k entries, and a lookup walks at
 * most n_ctx / 64 hashes.
 *
 * Locking: `mu` guards the arrays, counters and the write queue; rows are
 * copied and files read and written without it (a block in use holds a
 * reference, so eviction only unlinks it from the tier).
 */
#include "node/kvstore.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include <xxhash.h>

#include "base/hugemap.h"
#include "base/log.h"
#include "base/platform.h"
#include "base/prefix_hash.h"
#include "engine/fingerprint.h"

/* ==== Constants ==== */

#define KVS_MAGIC "TDMKVBLK"        /* 8 bytes at offset 0 of every block */
/* Bumped whenever the header or the row layout below changes: an old file
 * is then refused (and deleted) instead of misread. */
#define KVS_LAYOUT 2
#define KVS_HDR 128                 /* header bytes; the rest is reserved (zero) */
#define KVS_DEFAULT_DISK (4ull << 30)   /* --kv-cache-dir without --kv-cache-disk */
/* A temporary file older than this is a crashed writer's (ours or another
 * node's sharing the directory) and is removed at start-up. */
#define KVS_STALE_TMP_S 600
#define KVS_NAME_LEN 21             /* 16 hex digits + ".kvb" + NUL */
/* How far ahead of the block being read a chain's next block files are
 * handed to the kernel (posix_fadvise WILLNEED): enough to keep the disk's
 * queue full while one block is checked and copied (a 0.6B-shape block is
 * 7 MB), little against the page cache. */
#define KVS_READAHEAD_BYTES (64u << 20)

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

/* ==== Block form ==== */

/* A block and its data buffer (on huge pages when large: a block of a real
 * model is megabytes, and faulting it in 4 KiB pages cost more than reading
 * it), or NULL. */
static kvs_block *kvs_block_alloc(size_t size) {
    kvs_block *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    if (size >= 2 * HUGEMAP_PAGE) b->data = hugemap_alloc(size, &b->mapped);
    else b->data = malloc(size);
    if (!b->data) { free(b); return NULL; }
    b->size = size;
    return b;
}

static void kvs_block_free(kvs_block *b) {
    if (!b) return;
    if (b->mapped) hugemap_free(b->data, b->mapped);
    else free(b->data);
    free(b);
}


static void kvs_put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void kvs_put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static uint32_t kvs_get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t kvs_get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static size_t kvs_ids_bytes(int index) { return (size_t)(index + 1) * PREFIX_HASH_BLOCK * 4; }
static size_t kvs_rows_bytes(const kvstore *st) { return (size_t)st->n_layer * 2 * PREFIX_HASH_BLOCK * st->row_bytes; }
static size_t kvs_block_size(const kvstore *st, int index) { return KVS_HDR + kvs_ids_bytes(index) + kvs_rows_bytes(st); }

/* Checksum of a block: everything but the checksum field itself. */
static uint64_t kvs_checksum(const uint8_t *d, size_t size) {
    uint64_t h = XXH3_64bits(d, H_SUM);
    return XXH3_64bits_withSeed(d + KVS_HDR, size - KVS_HDR, h);
}

/* Rows of a block: per layer, K then V, each [kv_head][64 positions]
 * [head bytes], the cache's own head-major order, so a block is copied in
 * or out in runs of 64 positions of one head (a position-major layout took
 * 256-byte pieces). 0 if positions [p0, p0 + 64) of every layer fit kv and
 * kv has this store's shape, else -1 with a message. */
static int kvs_rows_check(const kvstore *st, const kvcache *kv, int p0, char *err, size_t errlen) {
    if (kv_n_layer(kv) != st->n_layer || kv_row_bytes(kv) != st->row_bytes || kv_dtype(kv) != st->dtype) {
        snprintf(err, errlen, "cache shape differs from the store's");
        return -1;
    }
    return kv_check_range(kv, st->n_layer - 1, p0, PREFIX_HASH_BLOCK, err, errlen);
}

/* Copies positions [p0 + from, p0 + 64) of every layer between the block's
 * rows and kv (to kv when in, else from it); kvs_rows_check passed. */
static void kvs_rows_copy(const kvstore *st, kvcache *kv, uint8_t *rows, int p0, int from, int in) {
    int nh = kv_n_head(kv);
    size_t hb = kv_head_bytes(kv), run = (size_t)(PREFIX_HASH_BLOCK - from) * hb;
    size_t off = (size_t)from * hb, cache_off = (size_t)(p0 + from) * hb;
    for (int l = 0; l < st->n_layer; l++)
        for (int kvi = 0; kvi < 2; kvi++)
            for (int h = 0; h < nh; h++) {
                uint8_t *blk = rows + (((size_t)l * 2 + (size_t)kvi) * (size_t)nh + (size_t)h) * PREFIX_HASH_BLOCK * hb + off;
                /* the cache's own buffer, writable: kvcache.h hands out const
                 * pointers for readers; the range was checked above */
                uint8_t *c = (uint8_t *)(kvi ? kv_v_head(kv, l, h) : kv_k_head(kv, l, h)) + cache_off;
                if (in) memcpy(c, blk, run);
                else memcpy(blk, c, run);
            }
}

/* A block of index `index` built from ids and kv's rows, or NULL (memory). */
static kvs_block *kvs_block_make(kvstore *st, uint64_t hash, int index, const int32_t *ids, const kvcache *kv) {
    size_t size = kvs_block_size(st, index);
    kvs_block *b = kvs_block_alloc(size);
    if (!b) return NULL;
    uint8_t *d = b->data;
    memset(d, 0, KVS_HDR);
    memcpy(d, KVS_MAGIC, 8);
    kvs_put32(d + H_LAYOUT, KVS_LAYOUT);
    kvs_put32(d + H_DTYPE, st->dtype);
    memcpy(d + H_FP, st->fp, 32);
    kvs_put64(d + H_HASH, hash);
    kvs_put32(d + H_BTOK, PREFIX_HASH_BLOCK);
    kvs_put32(d + H_INDEX, (uint32_t)index);
    kvs_put32(d + H_NLAYER, (uint32_t)st->n_layer);
    kvs_put64(d + H_ROW, st->row_bytes);
    kvs_put64(d + H_SIZE, size);
    memcpy(d + KVS_HDR, ids, kvs_ids_bytes(index));
    char err[256];
    if (kvs_rows_check(st, kv, index * PREFIX_HASH_BLOCK, err, sizeof err)) { kvs_block_free(b); return NULL; }
    kvs_rows_copy(st, (kvcache *)kv, d + KVS_HDR + kvs_ids_bytes(index), index * PREFIX_HASH_BLOCK, 0, 0);
    kvs_put64(d + H_SUM, kvs_checksum(d, size));
    b->hash = hash;
    b->index = index;
    b->refs = 1;
    return b;
}

/* Checks a header against this store: 0, -1 with the reason (a bad
 * block), or 1: a valid block beyond this node's context (another node
 * sharing the directory may run a longer one: not ours to delete).
 * index_out receives the block index. */
static int kvs_check_header(const kvstore *st, const uint8_t *h, uint64_t want_hash, int *index_out,
                            char *why, size_t whylen) {
    if (memcmp(h, KVS_MAGIC, 8)) { snprintf(why, whylen, "not a KV block (bad magic)"); return -1; }
    if (kvs_get32(h + H_LAYOUT) != KVS_LAYOUT) {
        snprintf(why, whylen, "layout version %u, this build reads %d", kvs_get32(h + H_LAYOUT), KVS_LAYOUT);
        return -1;
    }
    if (memcmp(h + H_FP, st->fp, 32)) { snprintf(why, whylen, "written for another model (fingerprint differs)"); return -1; }
    if (kvs_get32(h + H_DTYPE) != st->dtype) {
        snprintf(why, whylen, "KV dtype %s, this node's cache is %s", kv_dtype_name(kvs_get32(h + H_DTYPE)),
                 kv_dtype_name(st->dtype));
        return -1;
    }
    if (kvs_get32(h + H_BTOK) != PREFIX_HASH_BLOCK || kvs_get32(h + H_NLAYER) != (uint32_t)st->n_layer ||
        kvs_get64(h + H_ROW) != st->row_bytes) {
        snprintf(why, whylen, "shape differs (block %u, layers %u, row bytes %llu)", kvs_get32(h + H_BTOK),
                 kvs_get32(h + H_NLAYER), (unsigned long long)kvs_get64(h + H_ROW));
        return -1;
    }
    if (kvs_get64(h + H_HASH) != want_hash) { snprintf(why, whylen, "its hash does not match its name"); return -1; }
    uint32_t index = kvs_get32(h + H_INDEX);
    if ((uint64_t)(index + 1ull) * PREFIX_HASH_BLOCK > (uint64_t)st->n_ctx) {
        snprintf(why, whylen, "block %u is beyond the context (%d)", index, st->n_ctx);
        return 1;
    }
    if (kvs_get64(h + H_SIZE) != kvs_block_size(st, (int)index)) { snprintf(why, whylen, "size field is wrong"); return -1; }
    *index_out = (int)index;
    return 0;
}

int kvstore_block_check(const kvstore *st, const uint8_t *d, size_t size, uint64_t hash, int index, const int32_t *ids,
                        char *why, size_t whylen) {
    int bi = -1, hc;
    if (size < KVS_HDR) { snprintf(why, whylen, "shorter than a header"); return -1; }
    if ((hc = kvs_check_header(st, d, hash, &bi, why, whylen)) > 0) return 1;
    if (hc < 0) return -1;
    if (bi != index) { snprintf(why, whylen, "holds block %d, looked up as block %d", bi, index); return -1; }
    if (size != kvs_block_size(st, index)) {
        snprintf(why, whylen, "%zu bytes, a block %d is %zu (truncated or foreign)", size, index, kvs_block_size(st, index));
        return -1;
    }
    if (kvs_checksum(d, size) != kvs_get64(d + H_SUM)) { snprintf(why, whylen, "checksum mismatch"); return -1; }
    if (memcmp(d + KVS_HDR, ids, kvs_ids_bytes(index))) {
        /* a valid block of another prefix with the same hash (a collision):
         * not ours to use, nor to delete */
        snprintf(why, whylen, "it has the prompt's hash but other tokens");
        return 1;
    }
    return 0;
}

/* ==== Tiers (caller holds mu) ==== */

static void kvs_block_unref(kvs_block *b) {
    if (b && --b->refs == 0) kvs_block_free(b);
}

static int kvs_ram_find(const kvstore *st, uint64_t hash) {
    for (int i = 0; i < st->n_ram; i++) if (st->ram[i]->hash == hash) return i;
    return -1;
}

static int kvs_disk_find(const kvstore *st, uint64_t hash) {
    for (int i = 0; i < st->n_disk; i++) if (st->disk[i].hash == hash) return i;
    return -1;
}

static void kvs_ram_remove(kvstore *st, int i) {
    kvs_block *b = st->ram[i];
    st->ram_used -= b->size;
    st->ram[i] = st->ram[--st->n_ram];
    kvs_block_unref(b);
}

static void kvs_disk_remove(kvstore *st, int i) {
    st->disk_used -= st->disk[i].size;
    st->disk[i] = st->disk[--st->n_disk];
}

static void kvs_name(uint64_t hash, char out[KVS_NAME_LEN]) { snprintf(out, KVS_NAME_LEN, "%016llx.kvb", (unsigned long long)hash); }

/* Adds b (taking a reference) to memory, evicting the least recently used
 * blocks to make room; 0, or -1 when it cannot fit. */
static int kvs_ram_insert(kvstore *st, kvs_block *b) {
    if (b->size > st->ram_max) return -1;
    while (st->ram_used + b->size > st->ram_max && st->n_ram) {
        int lru = 0;
        for (int i = 1; i < st->n_ram; i++) if (st->ram[i]->last_used < st->ram[lru]->last_used) lru = i;
        kvs_ram_remove(st, lru);
        st->st.evictions[KVS_TIER_RAM]++;
    }
    if (st->n_ram == st->cap_ram) {
        int nc = st->cap_ram ? 2 * st->cap_ram : 64;
        kvs_block **nr = realloc(st->ram, sizeof *nr * (size_t)nc);
        if (!nr) return -1;
        st->ram = nr;
        st->cap_ram = nc;
    }
    b->refs++;
    b->last_used = ++st->tick;
    st->ram[st->n_ram++] = b;
    st->ram_used += b->size;
    return 0;
}

static int kvs_disk_add(kvstore *st, uint64_t hash, size_t size, uint64_t last_used) {
    int i = kvs_disk_find(st, hash);
    if (i >= 0) { st->disk[i].last_used = last_used; return 0; }
    if (st->n_disk == st->cap_disk) {
        int nc = st->cap_disk ? 2 * st->cap_disk : 64;
        kvs_disk_entry *nd = realloc(st->disk, sizeof *nd * (size_t)nc);
        if (!nd) return -1;
        st->disk = nd;
        st->cap_disk = nc;
    }
    st->disk[st->n_disk++] = (kvs_disk_entry){ .hash = hash, .size = size, .last_used = last_used };
    st->disk_used += size;
    return 0;
}

/* ==== Disk ==== */

static int kvs_write_all(int fd, const uint8_t *p, size_t n) {
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) { if (w == 0) errno = ENOSPC; return -1; }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Makes room on disk for `size` bytes by deleting least recently used
 * blocks (caller holds mu); -1 when the block is larger than the budget. */
static int kvs_disk_make_room(kvstore *st, size_t size) {
    if (size > st->disk_max) return -1;
    while (st->disk_used + size > st->disk_max && st->n_disk) {
        int lru = 0;
        for (int i = 1; i < st->n_disk; i++) if (st->disk[i].last_used < st->disk[lru].last_used) lru = i;
        char name[KVS_NAME_LEN];
        kvs_name(st->disk[lru].hash, name);
        unlinkat(st->dfd, name, 0);
        kvs_disk_remove(st, lru);
        st->st.evictions[KVS_TIER_DISK]++;
    }
    return 0;
}

/* Writes one block: a temporary file, fsync, rename (writer thread). */
static void kvs_disk_write(kvstore *st, kvs_block *b) {
    char name[KVS_NAME_LEN], tmp[64];
    kvs_name(b->hash, name);
    pthread_mutex_lock(&st->mu);
    int have = kvs_disk_find(st, b->hash) >= 0, room = have ? 0 : kvs_disk_make_room(st, b->size);
    unsigned seq = ++st->tmp_seq;
    pthread_mutex_unlock(&st->mu);
    if (have || room) return;
    snprintf(tmp, sizeof tmp, ".tmp-%ld-%u-%s", (long)getpid(), seq, name);
    int fd = openat(st->dfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    int ok = fd >= 0 && !kvs_write_all(fd, b->data, b->size) && !fsync(fd);
    int e = errno;
    if (fd >= 0 && close(fd) && ok) { ok = 0; e = errno; }
    if (ok && renameat(st->dfd, tmp, st->dfd, name)) { ok = 0; e = errno; }
    if (!ok) {
        if (fd >= 0) unlinkat(st->dfd, tmp, 0);
        log_warn(NULL, "kv store: cannot write block %s to %s: %s (the block stays in memory only)", name, st->dpath,
                 strerror(e));
        pthread_mutex_lock(&st->mu);
        st->st.write_errors++;
        pthread_mutex_unlock(&st->mu);
        return;
    }
    fsync(st->dfd);
    pthread_mutex_lock(&st->mu);
    kvs_disk_add(st, b->hash, b->size, ++st->tick);
    st->st.bytes_written[KVS_TIER_DISK] += b->size;
    pthread_mutex_unlock(&st->mu);
}

static void *kvs_writer_main(void *arg) {
    kvstore *st = arg;
    pthread_mutex_lock(&st->mu);
    for (;;) {
        while (!st->n_wq && !st->stopping) pthread_cond_wait(&st->cv, &st->mu);
        if (!st->n_wq) break;
        kvs_block *b = st->wq[0];
        memmove(st->wq, st->wq + 1, sizeof *st->wq * (size_t)(st->n_wq - 1));
        st->n_wq--;
        st->writing = 1;
        pthread_mutex_unlock(&st->mu);
        kvs_disk_write(st, b);
        pthread_mutex_lock(&st->mu);
        st->writing = 0;
        kvs_block_unref(b);
        pthread_cond_broadcast(&st->cv);
    }
    pthread_mutex_unlock(&st->mu);
    return NULL;
}

/* Queues b for the disk (caller holds mu). */
static void kvs_queue_write(kvstore *st, kvs_block *b) {
    if (st->dfd < 0 || kvs_disk_find(st, b->hash) >= 0) return;
    for (int i = 0; i < st->n_wq; i++) if (st->wq[i]->hash == b->hash) return;
    if (st->n_wq == st->cap_wq) {
        int nc = st->cap_wq ? 2 * st->cap_wq : 64;
        kvs_block **nq = realloc(st->wq, sizeof *nq * (size_t)nc);
        if (!nq) return;
        st->wq = nq;
        st->cap_wq = nc;
    }
    b->refs++;
    st->wq[st->n_wq++] = b;
    pthread_cond_broadcast(&st->cv);
}

/* Deletes a bad block file (with its log line) and forgets it. */
static void kvs_disk_reject(kvstore *st, const char *name, uint64_t hash, const char *why) {
    log_warn(NULL, "kv store: block %s/%s refused and deleted: %s", st->dpath, name, why);
    unlinkat(st->dfd, name, 0);
    pthread_mutex_lock(&st->mu);
    int i = kvs_disk_find(st, hash);
    if (i >= 0) kvs_disk_remove(st, i);
    st->st.rejected++;
    pthread_mutex_unlock(&st->mu);
}

/* Reads block `index` with `hash` from disk and checks it completely
 * (header, size, checksum, the prefix's ids); NULL when absent or bad. */
static kvs_block *kvs_disk_load(kvstore *st, uint64_t hash, int index, const int32_t *ids) {
    char name[KVS_NAME_LEN], why[256];
    kvs_name(hash, name);
    int fd = openat(st->dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        if (errno != ENOENT) log_warn(NULL, "kv store: cannot open %s/%s: %s", st->dpath, name, strerror(errno));
        pthread_mutex_lock(&st->mu);
        int i = kvs_disk_find(st, hash);
        if (i >= 0) kvs_disk_remove(st, i);   /* deleted by another node, or the directory is gone */
        pthread_mutex_unlock(&st->mu);
        return NULL;
    }
    struct stat sb;
    uint8_t h[KVS_HDR];
    int bi = -1;
    kvs_block *b = NULL;
    size_t want = kvs_block_size(st, index);
    if (fstat(fd, &sb) || !S_ISREG(sb.st_mode)) { snprintf(why, sizeof why, "not a regular file"); goto bad; }
    if ((uint64_t)sb.st_size != want) {
        snprintf(why, sizeof why, "%lld bytes, a block %d is %zu (truncated or foreign)", (long long)sb.st_size, index, want);
        goto bad;
    }
    if (pread(fd, h, KVS_HDR, 0) != KVS_HDR) { snprintf(why, sizeof why, "short header"); goto bad; }
    if (kvs_check_header(st, h, hash, &bi, why, sizeof why)) goto bad;
    if (bi != index) { snprintf(why, sizeof why, "holds block %d, looked up as block %d", bi, index); goto bad; }
    if (!(b = kvs_block_alloc(want))) { close(fd); return NULL; }
    size_t got = 0;
    while (got < want) {
        ssize_t r = pread(fd, b->data + got, want - got, (off_t)got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    if (got != want) { snprintf(why, sizeof why, "short read (%zu of %zu bytes)", got, want); goto bad; }
    if (memcmp(b->data, h, KVS_HDR)) { snprintf(why, sizeof why, "changed while read"); goto bad; }
    int rc = kvstore_block_check(st, b->data, want, hash, index, ids, why, sizeof why);
    if (rc < 0) goto bad;
    close(fd);
    if (rc > 0) {
        log_warn(NULL, "kv store: block %s/%s: %s; not used", st->dpath, name, why);
        kvs_block_free(b);
        return NULL;
    }
    b->hash = hash;
    b->index = index;
    b->refs = 1;
    return b;
bad:
    close(fd);
    kvs_block_free(b);
    kvs_disk_reject(st, name, hash, why);
    return NULL;
}

/* Asks the kernel to start reading the block files of hashes [from, to)
 * that memory does not hold (posix_fadvise WILLNEED: asynchronous, the
 * reads later find the pages); a file that is not there is skipped. */
static void kvs_disk_readahead(kvstore *st, const uint64_t *h, int from, int to) {
    for (int i = from; i < to; i++) {
        pthread_mutex_lock(&st->mu);
        int in_ram = kvs_ram_find(st, h[i]) >= 0;
        pthread_mutex_unlock(&st->mu);
        if (in_ram) continue;
        char name[KVS_NAME_LEN];
        kvs_name(h[i], name);
        int fd = openat(st->dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        if (fd < 0) break;            /* the chain stops here */
        plat_file_advise(fd, PLAT_FILE_WILLNEED);
        close(fd);
    }
}

/* Reads [off, off + sum of iov) of fd into iov (IOV_MAX at a time, short
 * reads resumed): 0, or -1. iov is consumed. */
static int kvs_preadv_all(int fd, struct iovec *iov, int n, off_t off) {
    while (n > 0) {
        ssize_t r = preadv(fd, iov, n < IOV_MAX ? n : IOV_MAX, off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        off += r;
        while (n > 0 && (size_t)r >= iov->iov_len) { r -= (ssize_t)iov->iov_len; iov++; n--; }
        if (n > 0) { iov->iov_base = (uint8_t *)iov->iov_base + r; iov->iov_len -= (size_t)r; }
    }
    return 0;
}

/* Block `index` with `hash` read straight into kv's positions
 * [64 index, 64 (index + 1)) (kvs_rows_check passed):
 * header and ids first and checked, then the rows in one preadv into the
 * cache's runs (the file's row order is the cache's), then the checksum of
 * what landed. 0 when the block is good and in place; -1 when absent, bad
 * (deleted) or another prefix's: the rows there are then not valid, and the
 * caller does not count them (kv's used count is not moved). */
static int kvs_disk_load_into(kvstore *st, uint64_t hash, int index, const int32_t *ids, kvcache *kv) {
    char name[KVS_NAME_LEN], why[256];
    kvs_name(hash, name);
    int fd = openat(st->dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        pthread_mutex_lock(&st->mu);
        int i = kvs_disk_find(st, hash);
        if (i >= 0) kvs_disk_remove(st, i);   /* deleted by another node, or the directory is gone */
        pthread_mutex_unlock(&st->mu);
        return -1;
    }
    int nh = kv_n_head(kv), nv = st->n_layer * 2 * nh, bi = -1, rc = -1;
    size_t hb = kv_head_bytes(kv), head = KVS_HDR + kvs_ids_bytes(index), want = kvs_block_size(st, index);
    size_t p0 = (size_t)index * PREFIX_HASH_BLOCK * hb, run = PREFIX_HASH_BLOCK * hb;
    uint8_t *hd = malloc(head);
    struct iovec *iov = malloc(sizeof *iov * (size_t)nv), *iv = malloc(sizeof *iov * (size_t)nv);
    struct stat sb;
    why[0] = 0;
    if (!hd || !iov || !iv) goto out;
    if (fstat(fd, &sb) || !S_ISREG(sb.st_mode)) { snprintf(why, sizeof why, "not a regular file"); goto out; }
    if ((uint64_t)sb.st_size != want) {
        snprintf(why, sizeof why, "%lld bytes, a block %d is %zu (truncated or foreign)", (long long)sb.st_size, index, want);
        goto out;
    }
    if (pread(fd, hd, head, 0) != (ssize_t)head) { snprintf(why, sizeof why, "short header"); goto out; }
    if (kvs_check_header(st, hd, hash, &bi, why, sizeof why)) goto out;
    if (bi != index) { snprintf(why, sizeof why, "holds block %d, looked up as block %d", bi, index); goto out; }
    if (memcmp(hd + KVS_HDR, ids, kvs_ids_bytes(index))) {
        log_warn(NULL, "kv store: block %s/%s has the prompt's hash but other tokens; not used", st->dpath, name);
        goto out;   /* a collision: not ours to use, nor to delete */
    }
    for (int l = 0, k = 0; l < st->n_layer; l++)
        for (int kvi = 0; kvi < 2; kvi++)
            for (int h = 0; h < nh; h++, k++) {
                /* the cache's own buffer, writable (see kvs_rows_copy) */
                iov[k].iov_base = (uint8_t *)(kvi ? kv_v_head(kv, l, h) : kv_k_head(kv, l, h)) + p0;
                iov[k].iov_len = run;
            }
    memcpy(iv, iov, sizeof *iov * (size_t)nv);
    if (kvs_preadv_all(fd, iv, nv, (off_t)head)) { snprintf(why, sizeof why, "short read"); goto out; }
    XXH3_state_t *xs = XXH3_createState();
    if (!xs) goto out;
    XXH3_64bits_reset_withSeed(xs, XXH3_64bits(hd, H_SUM));
    XXH3_64bits_update(xs, hd + KVS_HDR, head - KVS_HDR);
    for (int k = 0; k < nv; k++) XXH3_64bits_update(xs, iov[k].iov_base, iov[k].iov_len);
    uint64_t sum = XXH3_64bits_digest(xs);
    XXH3_freeState(xs);
    if (sum != kvs_get64(hd + H_SUM)) snprintf(why, sizeof why, "checksum mismatch");
    else rc = 0;
out:
    close(fd);
    free(hd);
    free(iov);
    free(iv);
    if (why[0]) kvs_disk_reject(st, name, hash, why);
    return rc;
}

/* ==== Opening ==== */

/* A directory fd we may keep blocks in: not a symlink, ours, not writable
 * by group or others. */
static int kvs_open_dir(int at, const char *path, char *err, size_t errlen) {
    if (mkdirat(at, path, 0700) && errno != EEXIST) {
        snprintf(err, errlen, "--kv-cache-dir: cannot create %s: %s", path, strerror(errno));
        return -1;
    }
    int fd = openat(at, path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "--kv-cache-dir: cannot open %s: %s%s", path, strerror(errno),
                 errno == ELOOP || errno == ENOTDIR ? " (a symbolic link or not a directory)" : "");
        return -1;
    }
    struct stat sb;
    if (fstat(fd, &sb)) { snprintf(err, errlen, "--kv-cache-dir: %s: %s", path, strerror(errno)); close(fd); return -1; }
    if (sb.st_uid != geteuid()) {
        snprintf(err, errlen, "--kv-cache-dir: %s belongs to uid %u, not to this user (%u)", path, (unsigned)sb.st_uid,
                 (unsigned)geteuid());
        close(fd);
        return -1;
    }
    if (sb.st_mode & (S_IWGRP | S_IWOTH)) {
        snprintf(err, errlen, "--kv-cache-dir: %s is writable by %s (mode %03o); refusing to load KV from it",
                 path, sb.st_mode & S_IWOTH ? "others" : "its group", (unsigned)(sb.st_mode & 0777));
        close(fd);
        return -1;
    }
    return fd;
}

static int kvs_hex_hash(const char *name, uint64_t *out) {
    if (strlen(name) != 20 || strcmp(name + 16, ".kvb")) return -1;
    uint64_t v = 0;
    for (int i = 0; i < 16; i++) {
        char c = name[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return -1;
        v = v << 4 | (uint64_t)d;
    }
    *out = v;
    return 0;
}

/* Indexes the blocks already in the directory (headers checked; the rest
 * is checked when a block is loaded), oldest first by modification time. */
static void kvs_scan(kvstore *st) {
    int fd = dup(st->dfd);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) { if (fd >= 0) close(fd); return; }
    time_t now = time(NULL);
    int kept = 0, bad = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        struct stat sb;
        uint64_t hash;
        if (fstatat(st->dfd, e->d_name, &sb, AT_SYMLINK_NOFOLLOW)) continue;
        if (!strncmp(e->d_name, ".tmp-", 5)) {
            if (S_ISREG(sb.st_mode) && now - sb.st_mtime > KVS_STALE_TMP_S) unlinkat(st->dfd, e->d_name, 0);
            continue;
        }
        if (kvs_hex_hash(e->d_name, &hash)) continue;
        char why[256];
        uint8_t h[KVS_HDR];
        int index = -1;
        int ok = 0, hc = 0;
        why[0] = 0;
        int bf = S_ISREG(sb.st_mode) ? openat(st->dfd, e->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC) : -1;
        if (!S_ISREG(sb.st_mode)) snprintf(why, sizeof why, "not a regular file");
        else if (bf < 0) { log_warn(NULL, "kv store: %s/%s: %s (skipped)", st->dpath, e->d_name, strerror(errno)); continue; }
        else if (pread(bf, h, KVS_HDR, 0) != KVS_HDR) snprintf(why, sizeof why, "shorter than a header");
        else if ((hc = kvs_check_header(st, h, hash, &index, why, sizeof why)) > 0) { close(bf); continue; }
        else if (hc < 0) {}
        else if ((uint64_t)sb.st_size != kvs_block_size(st, index))
            snprintf(why, sizeof why, "%lld bytes, a block %d is %zu (truncated)", (long long)sb.st_size, index,
                     kvs_block_size(st, index));
        else ok = 1;
        if (bf >= 0) close(bf);
        if (!ok) {
            log_warn(NULL, "kv store: block %s/%s refused and deleted: %s", st->dpath, e->d_name, why);
            unlinkat(st->dfd, e->d_name, 0);
            st->st.rejected++;
            bad++;
            continue;
        }
        kvs_disk_add(st, hash, (size_t)sb.st_size, (uint64_t)sb.st_mtime);
        kept++;
    }
    closedir(d);
    /* make the modification times into ticks below every later use */
    uint64_t mx = 0;
    for (int i = 0; i < st->n_disk; i++) if (st->disk[i].last_used > mx) mx = st->disk[i].last_used;
    st->tick = mx + 1;
    log_info(NULL, "kv store: %s holds %d block(s), %.1f MB%s", st->dpath, kept, st->disk_used / 1e6,
             bad ? " (some refused, see above)" : "");
    while (st->disk_used > st->disk_max && st->n_disk) kvs_disk_make_room(st, 0);
}

int kvstore_open(kvstore **out, model *m, uint32_t kv_dtype, int n_ctx, const kvstore_opts *o, char *err, size_t errlen) {
    *out = NULL;
    kvstore *st = calloc(1, sizeof *st);
    if (!st) { snprintf(err, errlen, "out of memory"); return -1; }
    st->dfd = -1;
    pthread_mutex_init(&st->mu, NULL);
    pthread_cond_init(&st->cv, NULL);
    const model_hparams *hp = model_get_hparams(m);
    kvcache *probe = NULL;
    char desc[256];
    if (kv_create(&probe, hp->n_layer, 1, hp->n_head_kv, hp->head_dim_k, kv_dtype, err, errlen)) goto fail;
    st->row_bytes = kv_row_bytes(probe);
    kv_free(probe);
    if (model_fingerprint(m, st->fp, desc, sizeof desc)) { snprintf(err, errlen, "kv store: %s", desc); goto fail; }
    st->seed = prefix_hash_seed(st->fp);
    st->dtype = kv_dtype;
    st->n_layer = hp->n_layer;
    st->n_ctx = n_ctx;
    st->ram_max = o->ram_bytes;
    st->disk_max = o->disk_bytes ? o->disk_bytes : KVS_DEFAULT_DISK;
    if (o->dir && *o->dir) {
        int top = kvs_open_dir(AT_FDCWD, o->dir, err, errlen);
        if (top < 0) goto fail;
        char sub[64], fph[17];
        fingerprint_hex(st->fp, 8, fph);
        snprintf(sub, sizeof sub, "%s-%s", fph, kv_dtype_name(kv_dtype));
        st->dfd = kvs_open_dir(top, sub, err, errlen);
        close(top);
        if (st->dfd < 0) goto fail;
        snprintf(st->dpath, sizeof st->dpath, "%s/%s", o->dir, sub);
        /* a full file-size limit must fail the write, not kill the node */
        signal(SIGXFSZ, SIG_IGN);
        kvs_scan(st);
        if (pthread_create(&st->th, NULL, kvs_writer_main, st)) {
            snprintf(err, errlen, "kv store: cannot start the writer thread");
            goto fail;
        }
        st->th_started = 1;
    }
    *out = st;
    return 0;
fail:
    kvstore_close(st);
    return -1;
}

void kvstore_close(kvstore *st) {
    if (!st) return;
    if (st->th_started) {
        pthread_mutex_lock(&st->mu);
        st->stopping = 1;
        pthread_cond_broadcast(&st->cv);
        pthread_mutex_unlock(&st->mu);
        pthread_join(st->th, NULL);
    }
    for (int i = 0; i < st->n_wq; i++) kvs_block_unref(st->wq[i]);
    while (st->n_ram) kvs_ram_remove(st, 0);
    free(st->ram);
    free(st->disk);
    free(st->wq);
    if (st->dfd >= 0) close(st->dfd);
    pthread_mutex_destroy(&st->mu);
    pthread_cond_destroy(&st->cv);
    free(st);
}

/* ==== Use ==== */

/* The chained hashes of ids[0, n)'s full blocks (malloc'ed; *nb their count). */
static uint64_t *kvs_hashes(const kvstore *st, const int32_t *ids, int n, int *nb) {
    *nb = n > 0 ? n / PREFIX_HASH_BLOCK : 0;
    if (!*nb) return NULL;
    uint64_t *h = malloc(sizeof *h * (size_t)*nb);
    if (!h || prefix_hash_blocks(ids, *nb * PREFIX_HASH_BLOCK, PREFIX_HASH_BLOCK, st->seed, h, *nb) != *nb) {
        free(h);
        *nb = 0;
        return NULL;
    }
    return h;
}

/* The memory block with `hash` whose ids are ids' prefix (a reference the
 * caller drops), or NULL (caller holds mu). */
static kvs_block *kvs_ram_get(kvstore *st, uint64_t hash, int index, const int32_t *ids) {
    int i = kvs_ram_find(st, hash);
    if (i < 0) return NULL;
    kvs_block *b = st->ram[i];
    if (b->index != index || memcmp(b->data + KVS_HDR, ids, kvs_ids_bytes(index))) return NULL;
    b->refs++;
    b->last_used = ++st->tick;
    return b;
}

int kvstore_put(kvstore *st, const int32_t *ids, int n, const kvcache *kv) {
    if (!st || (!st->ram_max && st->dfd < 0)) return 0;
    if (n > kv_used(kv)) n = kv_used(kv);
    int nb, added = 0;
    uint64_t *h = kvs_hashes(st, ids, n, &nb);
    for (int i = 0; i < nb; i++) {
        pthread_mutex_lock(&st->mu);
        kvs_block *have = kvs_ram_get(st, h[i], i, ids);
        int on_disk = st->dfd >= 0 && kvs_disk_find(st, h[i]) >= 0;
        int taken = kvs_ram_find(st, h[i]) >= 0;   /* by another prefix with the same hash */
        if (have) kvs_block_unref(have);
        if (on_disk) st->disk[kvs_disk_find(st, h[i])].last_used = ++st->tick;
        pthread_mutex_unlock(&st->mu);
        if (have || taken || (on_disk && !st->ram_max)) continue;
        kvs_block *b = kvs_block_make(st, h[i], i, ids, kv);
        if (!b) break;
        pthread_mutex_lock(&st->mu);
        if (st->ram_max && kvs_ram_insert(st, b) == 0) st->st.bytes_written[KVS_TIER_RAM] += b->size;
        kvs_queue_write(st, b);
        kvs_block_unref(b);
        pthread_mutex_unlock(&st->mu);
        added++;
    }
    free(h);
    return added;
}

int kvstore_fill(kvstore *st, const int32_t *ids, int n, int have, kvcache *kv, kvstore_hit *hit) {
    if (hit) memset(hit, 0, sizeof *hit);
    if (!st || have < 0) return have;
    if (n > kv_n_ctx(kv)) n = kv_n_ctx(kv);
    int nb, end = have, ra = 0;
    uint64_t *h = kvs_hashes(st, ids, n, &nb);
    char err[256];
    int ra_blocks = (int)(KVS_READAHEAD_BYTES / kvs_block_size(st, nb > 0 ? nb - 1 : 0)) + 1;
    for (int i = have / PREFIX_HASH_BLOCK; i < nb; i++) {
        pthread_mutex_lock(&st->mu);
        int tier = KVS_TIER_RAM;
        kvs_block *b = kvs_ram_get(st, h[i], i, ids);
        if (!b) st->st.misses[KVS_TIER_RAM]++;
        pthread_mutex_unlock(&st->mu);
        if (!b && st->dfd >= 0) {
            tier = KVS_TIER_DISK;
            /* keep ra_blocks of the chain's files in flight ahead of this one */
            int to = i + ra_blocks < nb ? i + ra_blocks : nb;
            if (ra < to) { kvs_disk_readahead(st, h, ra > i ? ra : i, to); ra = to; }
            int p0 = i * PREFIX_HASH_BLOCK;
            if (end <= p0 && !kvs_rows_check(st, kv, p0, err, sizeof err)) {
                /* straight into the slot: no buffer to allocate (fresh pages
                 * cost more than the read) nor copy; the memory tier gets the
                 * block when this sequence ends and puts its blocks */
                int bad = kvs_disk_load_into(st, h[i], i, ids, kv);
                pthread_mutex_lock(&st->mu);
                if (bad) st->st.misses[KVS_TIER_DISK]++;
                else {
                    int di = kvs_disk_find(st, h[i]);
                    if (di >= 0) st->disk[di].last_used = ++st->tick;
                    else kvs_disk_add(st, h[i], kvs_block_size(st, i), ++st->tick);   /* written by another node */
                    st->st.hits[KVS_TIER_DISK]++;
                    st->st.bytes_read[KVS_TIER_DISK] += kvs_block_size(st, i);
                }
                pthread_mutex_unlock(&st->mu);
                if (bad) break;
                end = p0 + PREFIX_HASH_BLOCK;
                if (hit) hit->disk_tokens += PREFIX_HASH_BLOCK;
                continue;
            }
            b = kvs_disk_load(st, h[i], i, ids);
            pthread_mutex_lock(&st->mu);
            if (!b) st->st.misses[KVS_TIER_DISK]++;
            else {
                int di = kvs_disk_find(st, h[i]);
                if (di >= 0) st->disk[di].last_used = ++st->tick;
                else kvs_disk_add(st, h[i], b->size, ++st->tick);   /* written by another node */
                if (st->ram_max) kvs_ram_insert(st, b);
            }
            pthread_mutex_unlock(&st->mu);
        }
        if (!b) break;
        int p0 = i * PREFIX_HASH_BLOCK, from = end > p0 ? end - p0 : 0, k = PREFIX_HASH_BLOCK - from;
        int bad = kvs_rows_check(st, kv, p0, err, sizeof err);
        if (!bad) kvs_rows_copy(st, kv, b->data + KVS_HDR + kvs_ids_bytes(i), p0, from, 1);
        pthread_mutex_lock(&st->mu);
        st->st.hits[tier]++;
        st->st.bytes_read[tier] += b->size;
        kvs_block_unref(b);
        pthread_mutex_unlock(&st->mu);
        if (bad) { log_warn(NULL, "kv store: %s", err); break; }
        end = p0 + PREFIX_HASH_BLOCK;
        if (hit) { if (tier == KVS_TIER_RAM) hit->ram_tokens += k; else hit->disk_tokens += k; }
    }
    free(h);
    if (end > have) kv_set_used(kv, end);
    return end;
}

int kvstore_probe(kvstore *st, const int32_t *ids, int n) {
    if (!st) return 0;
    int nb, end = 0;
    uint64_t *h = kvs_hashes(st, ids, n, &nb);
    for (int i = 0; i < nb; i++) {
        pthread_mutex_lock(&st->mu);
        kvs_block *b = kvs_ram_get(st, h[i], i, ids);
        int on_disk = !b && st->dfd >= 0 && kvs_disk_find(st, h[i]) >= 0;
        kvs_block_unref(b);
        pthread_mutex_unlock(&st->mu);
        if (!b && !on_disk) {
            /* another node sharing the directory may have it */
            char name[KVS_NAME_LEN];
            kvs_name(h[i], name);
            if (st->dfd < 0 || faccessat(st->dfd, name, R_OK, AT_SYMLINK_NOFOLLOW)) break;
        }
        end = (i + 1) * PREFIX_HASH_BLOCK;
    }
    free(h);
    return end;
}

int kvstore_save(kvstore *st, const int32_t *ids, int n) {
    if (!st || st->dfd < 0) return -1;
    int nb;
    uint64_t *h = kvs_hashes(st, ids, n, &nb);
    pthread_mutex_lock(&st->mu);
    for (int i = 0; i < nb; i++) {
        kvs_block *b = kvs_ram_get(st, h[i], i, ids);
        if (!b) continue;
        kvs_queue_write(st, b);
        kvs_block_unref(b);
    }
    while (st->n_wq || st->writing) pthread_cond_wait(&st->cv, &st->mu);
    int end = 0;
    for (int i = 0; i < nb && kvs_disk_find(st, h[i]) >= 0; i++) end = (i + 1) * PREFIX_HASH_BLOCK;
    pthread_mutex_unlock(&st->mu);
    free(h);
    return end;
}

int kvstore_warm(kvstore *st, const int32_t *ids, int n) {
    if (!st || !st->ram_max) return 0;
    int nb, end = 0;
    uint64_t *h = kvs_hashes(st, ids, n, &nb);
    for (int i = 0; i < nb; i++) {
        pthread_mutex_lock(&st->mu);
        kvs_block *b = kvs_ram_get(st, h[i], i, ids);
        pthread_mutex_unlock(&st->mu);
        if (!b && st->dfd >= 0 && (b = kvs_disk_load(st, h[i], i, ids))) {
            pthread_mutex_lock(&st->mu);
            if (kvs_disk_find(st, h[i]) < 0) kvs_disk_add(st, h[i], b->size, ++st->tick);
            st->st.hits[KVS_TIER_DISK]++;
            st->st.bytes_read[KVS_TIER_DISK] += b->size;
            int in = kvs_ram_insert(st, b) == 0;
            pthread_mutex_unlock(&st->mu);
            if (!in) { kvs_block_unref(b); break; }
        }
        if (!b) break;
        pthread_mutex_lock(&st->mu);
        kvs_block_unref(b);
        pthread_mutex_unlock(&st->mu);
        end = (i + 1) * PREFIX_HASH_BLOCK;
    }
    free(h);
    return end;
}

int kvstore_list_hashes(kvstore *st, uint64_t *out, int max_out) {
    if (!st) return 0;
    int k = 0;
    pthread_mutex_lock(&st->mu);
    for (int i = 0; i < st->n_ram && k < max_out; i++) out[k++] = st->ram[i]->hash;
    for (int i = 0; i < st->n_disk && k < max_out; i++)
        if (kvs_ram_find(st, st->disk[i].hash) < 0) out[k++] = st->disk[i].hash;
    pthread_mutex_unlock(&st->mu);
    return k;
}

void kvstore_get_stats(kvstore *st, kvstore_stats *s) {
    memset(s, 0, sizeof *s);
    if (!st) return;
    pthread_mutex_lock(&st->mu);
    *s = st->st;
    s->blocks[KVS_TIER_RAM] = (uint64_t)st->n_ram;
    s->bytes[KVS_TIER_RAM] = st->ram_used;
    s->blocks[KVS_TIER_DISK] = (uint64_t)st->n_disk;
    s->bytes[KVS_TIER_DISK] = st->disk_used;
    s->writes_pending = (uint64_t)st->n_wq + (uint64_t)st->writing;
    pthread_mutex_unlock(&st->mu);
}

const char *kvstore_tier_name(int tier) { return tier == KVS_TIER_RAM ? "ram" : "disk"; }

/* ==== /metrics ==== */

int kvstore_metrics_init(kvstore_metrics *km, metrics *reg, const char *prefix, char *err, size_t errlen) {
    static const char *const lt[] = {"model", "tier", NULL}, *const lm[] = {"model", NULL};
    char n[9][96];
    static const char *const suffix[9] = {"hits_total", "misses_total", "read_bytes_total", "written_bytes_total",
                                          "evictions_total", "blocks", "bytes", "rejected_total", "write_errors_total"};
    for (int i = 0; i < 9; i++) snprintf(n[i], sizeof n[i], "%s_kv_store_%s", prefix, suffix[i]);
    return !(km->hits = metrics_counter(reg, n[0], "KV store blocks found, by tier (ram, disk).", lt, err, errlen)) ||
           !(km->misses = metrics_counter(reg, n[1], "KV store blocks looked for in a tier and not found there.", lt,
                                          err, errlen)) ||
           !(km->bytes_read = metrics_counter(reg, n[2], "Bytes of KV blocks served by each tier.", lt, err, errlen)) ||
           !(km->bytes_written = metrics_counter(reg, n[3], "Bytes of KV blocks put into each tier.", lt, err, errlen)) ||
           !(km->evictions = metrics_counter(reg, n[4], "KV blocks evicted from each tier (least recently used).", lt,
                                             err, errlen)) ||
           !(km->blocks = metrics_gauge(reg, n[5], "KV blocks each tier holds.", lt, err, errlen)) ||
           !(km->bytes = metrics_gauge(reg, n[6], "Bytes of KV blocks each tier holds.", lt, err, errlen)) ||
           !(km->rejected = metrics_counter(reg, n[7], "Disk blocks refused and deleted (header, size or checksum).",
                                            lm, err, errlen)) ||
           !(km->write_errors = metrics_counter(reg, n[8], "KV blocks that could not be written to disk.", lm, err,
                                                errlen)) ? -1 : 0;
}

void kvstore_metrics_update(kvstore *st, kvstore_metrics *km, const char *model) {
    if (!st || !km->hits) return;
    kvstore_stats s;
    kvstore_get_stats(st, &s);
    for (int t = 0; t < KVS_N_TIERS; t++) {
        const char *const lv[] = {model, kvstore_tier_name(t)};
        metrics_set(km->hits, lv, (double)s.hits[t]);
        metrics_set(km->misses, lv, (double)s.misses[t]);
        metrics_set(km->bytes_read, lv, (double)s.bytes_read[t]);
        metrics_set(km->bytes_written, lv, (double)s.bytes_written[t]);
        metrics_set(km->evictions, lv, (double)s.evictions[t]);
        metrics_set(km->blocks, lv, (double)s.blocks[t]);
        metrics_set(km->bytes, lv, (double)s.bytes[t]);
    }
    const char *const lm[] = {model};
    metrics_set(km->rejected, lm, (double)s.rejected);
    metrics_set(km->write_errors, lm, (double)s.write_errors);
}
