/* kvstore_block.c - a KV block's file form (see kvstore_internal.h for the
 * header's fields): allocation, the checksum, the rows' layout and their
 * copy to and from a cache, building a block and checking one. */

#include "node/kvstore.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "base/hugemap.h"
#include "base/prefix_hash.h"

#include "node/kvstore_internal.h"

/* ==== Block form ==== */

/* A block and its data buffer (on huge pages when large: a block of a real
 * model is megabytes, and faulting it in 4 KiB pages cost more than reading
 * it), or NULL. */
kvs_block *kvs_block_alloc(size_t size) {
    kvs_block *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    if (size >= 2 * HUGEMAP_PAGE) b->data = hugemap_alloc(size, &b->mapped);
    else b->data = malloc(size);
    if (!b->data) { free(b); return NULL; }
    b->size = size;
    return b;
}

void kvs_block_free(kvs_block *b) {
    if (!b) return;
    if (b->mapped) hugemap_free(b->data, b->mapped);
    else free(b->data);
    free(b);
}



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
int kvs_rows_check(const kvstore *st, const kvcache *kv, int p0, char *err, size_t errlen) {
    if (kv_n_layer(kv) != st->n_layer || kv_row_bytes(kv) != st->row_bytes || kv_dtype(kv) != st->dtype) {
        snprintf(err, errlen, "cache shape differs from the store's");
        return -1;
    }
    return kv_check_range(kv, st->n_layer - 1, p0, PREFIX_HASH_BLOCK, err, errlen);
}

/* Copies positions [p0 + from, p0 + 64) of every layer between the block's
 * rows and kv (to kv when in, else from it); kvs_rows_check passed. */
void kvs_rows_copy(const kvstore *st, kvcache *kv, uint8_t *rows, int p0, int from, int in) {
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
kvs_block *kvs_block_make(kvstore *st, uint64_t hash, int index, const int32_t *ids, const kvcache *kv) {
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
int kvs_check_header(const kvstore *st, const uint8_t *h, uint64_t want_hash, int *index_out,
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
