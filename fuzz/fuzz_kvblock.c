/* fuzz_kvblock.c - libFuzzer target: the KV prefix store's block files
 * (node/kvstore.h), the one parser of files a node reads back from its
 * --kv-cache-dir: kvstore_block_check, which a disk load runs on a file's
 * bytes before any row is used (header, size, checksum, the prefix's ids).
 *
 * The store is a real one, opened on the real model assets/stories260K.gguf
 * (f16 cache, a context of 256 positions: blocks 0-3). Input: a byte of
 * mode, then a block file. Mode bit 0: the checksum is made right first (as
 * a block another model or node wrote would carry one), so the fuzzer gets
 * past it to the ids; bit 1: the lookup's ids are the file's own (else a
 * fixed prompt's); bit 2: the lookup's hash is the chained hash of those
 * ids (else the file's own hash field). A block accepted must have this
 * store's exact size and the lookup's ids, or the target aborts. Seeds: a
 * real block file of stories260K (tools/kvblock_seed.sh DIR). Run:
 *   make fuzz && tools/kvblock_seed.sh build/seeds-fuzz_kvblock &&
 *   build/fuzz_kvblock -max_total_time=60 -max_len=65536 build/corpus-fuzz_kvblock build/seeds-fuzz_kvblock
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "base/prefix_hash.h"
#include "engine/fingerprint.h"
#include "engine/kvcache.h"
#include "engine/model.h"
#include "node/kvstore.h"

#define FK_CTX 256                 /* blocks 0-3 */
#define FK_HDR 128                 /* the file's header bytes (kvstore.c) */
#define FK_SUM 88                  /* its checksum's offset */

static model *M;
static kvstore *S;
static uint64_t seed;
static size_t rows_bytes;          /* rows of one block: n_layer x K,V x 64 x row bytes */

static void fk_open(void) {
    char err[256], desc[256];
    model_opts mo = { .n_threads = 1, .n_batch = 64 };
    if (model_load(&M, "assets/stories260K.gguf", &mo, err, sizeof err)) { fprintf(stderr, "%s\n", err); abort(); }
    kvstore_opts ko = { 0 };
    uint32_t f16 = kv_dtype_parse("f16");
    if (kvstore_open(&S, M, f16, FK_CTX, &ko, err, sizeof err)) { fprintf(stderr, "%s\n", err); abort(); }
    uint8_t fp[32];
    if (model_fingerprint(M, fp, desc, sizeof desc)) { fprintf(stderr, "%s\n", desc); abort(); }
    seed = prefix_hash_seed(fp);
    const model_hparams *hp = model_get_hparams(M);
    kvcache *probe = NULL;
    if (kv_create(&probe, hp->n_layer, 1, hp->n_head_kv, hp->head_dim_k, f16, err, sizeof err)) abort();
    rows_bytes = (size_t)hp->n_layer * 2 * PREFIX_HASH_BLOCK * kv_row_bytes(probe);
    kv_free(probe);
}

static uint32_t fk_get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!S) fk_open();
    if (size < 1 || size > (1u << 20)) return 0;
    int mode = data[0];
    size_t n = size - 1;
    uint8_t *d = malloc(n ? n : 1);
    if (!d) return 0;
    memcpy(d, data + 1, n);
    if ((mode & 1) && n >= FK_HDR) {
        uint64_t sum = XXH3_64bits_withSeed(d + FK_HDR, n - FK_HDR, XXH3_64bits(d, FK_SUM));
        memcpy(d + FK_SUM, &sum, 8);
    }
    /* a lookup is of block 0-3; the file's index field picks which */
    int index = n >= 64 ? (int)(fk_get32(d + 60) % (FK_CTX / PREFIX_HASH_BLOCK)) : 0;
    int32_t ids[FK_CTX];
    for (int i = 0; i < FK_CTX; i++) ids[i] = 3 + (i * 37) % 500;   /* tools/kvblock_seed.sh's prompt */
    if (mode & 2) {
        size_t have = n > FK_HDR ? (n - FK_HDR) / 4 : 0;
        memcpy(ids, d + FK_HDR, 4 * (have < FK_CTX ? have : FK_CTX));
    }
    uint64_t hash, h[FK_CTX / PREFIX_HASH_BLOCK];
    if ((mode & 4) || n < 56) {
        int nb = prefix_hash_blocks(ids, (index + 1) * PREFIX_HASH_BLOCK, PREFIX_HASH_BLOCK, seed, h, FK_CTX / PREFIX_HASH_BLOCK);
        if (nb != index + 1) abort();
        hash = h[index];
    } else {
        memcpy(&hash, d + 48, 8);
    }
    char why[256] = "";
    int rc = kvstore_block_check(S, d, n, hash, index, ids, why, sizeof why);
    size_t ids_bytes = (size_t)(index + 1) * PREFIX_HASH_BLOCK * 4;
    if (rc == 0 && (n != FK_HDR + ids_bytes + rows_bytes || memcmp(d + FK_HDR, ids, ids_bytes))) abort();
    if (rc != 0 && !why[0]) abort();   /* every refusal says why (the log line) */
    free(d);
    return 0;
}
