/* kvstore_disk.c - the KV store's disk tier: block files written by the
 * writer thread (temporary file, fsync, rename), read back and checked
 * whole or straight into a cache, read ahead, evicted; the directory
 * opened, checked and indexed at start-up. */

#include "node/kvstore.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include <xxhash.h>

#include "base/log.h"
#include "base/platform.h"
#include "base/prefix_hash.h"

#include "node/kvstore_internal.h"

/* A temporary file older than this is a crashed writer's (ours or another
 * node's sharing the directory) and is removed at start-up. */
#define KVS_STALE_TMP_S 600

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

void *kvs_writer_main(void *arg) {
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
void kvs_queue_write(kvstore *st, kvs_block *b) {
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
kvs_block *kvs_disk_load(kvstore *st, uint64_t hash, int index, const int32_t *ids) {
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
void kvs_disk_readahead(kvstore *st, const uint64_t *h, int from, int to) {
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
int kvs_disk_load_into(kvstore *st, uint64_t hash, int index, const int32_t *ids, kvcache *kv) {
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
int kvs_open_dir(int at, const char *path, char *err, size_t errlen) {
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
void kvs_scan(kvstore *st) {
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
