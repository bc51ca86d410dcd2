/* kvstore.c - a node's KV prefix store in host memory and on disk (see kvstore.h):
 * the tiers, opening and closing, and the store's use (put, fill, probe, save,
 * warm, stats, /metrics). kvstore_block.c holds the block's file form,
 * kvstore_disk.c the disk tier's files; kvstore_internal.h between them.
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

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"
#include "base/prefix_hash.h"
#include "engine/fingerprint.h"

#include "node/kvstore_internal.h"

/* ==== Constants ==== */

#define KVS_DEFAULT_DISK (4ull << 30)   /* --kv-cache-dir without --kv-cache-disk */
/* How far ahead of the block being read a chain's next block files are
 * handed to the kernel (posix_fadvise WILLNEED): enough to keep the disk's
 * queue full while one block is checked and copied (a 0.6B-shape block is
 * 7 MB), little against the page cache. */
#define KVS_READAHEAD_BYTES (64u << 20)

/* ==== Tiers (caller holds mu) ==== */

void kvs_block_unref(kvs_block *b) {
    if (b && --b->refs == 0) kvs_block_free(b);
}

int kvs_ram_find(const kvstore *st, uint64_t hash) {
    for (int i = 0; i < st->n_ram; i++) if (st->ram[i]->hash == hash) return i;
    return -1;
}

int kvs_disk_find(const kvstore *st, uint64_t hash) {
    for (int i = 0; i < st->n_disk; i++) if (st->disk[i].hash == hash) return i;
    return -1;
}

static void kvs_ram_remove(kvstore *st, int i) {
    kvs_block *b = st->ram[i];
    st->ram_used -= b->size;
    st->ram[i] = st->ram[--st->n_ram];
    kvs_block_unref(b);
}

void kvs_disk_remove(kvstore *st, int i) {
    st->disk_used -= st->disk[i].size;
    st->disk[i] = st->disk[--st->n_disk];
}

void kvs_name(uint64_t hash, char out[KVS_NAME_LEN]) { snprintf(out, KVS_NAME_LEN, "%016llx.kvb", (unsigned long long)hash); }

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

int kvs_disk_add(kvstore *st, uint64_t hash, size_t size, uint64_t last_used) {
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

/* ==== Opening ==== */

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
