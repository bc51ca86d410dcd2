/* prefix_hash.c - chained block hashes of token prefixes (prefix_hash.h). */
#include "base/prefix_hash.h"

#include <string.h>

#include <xxhash.h>

/* ==== Chained block hashes ==== */

/* One block's input: the previous state (16 bytes), then the block's ids as
 * little-endian 32-bit words, so the hash does not depend on the host's
 * byte order. */
static XXH128_hash_t prefix_hash_step(XXH128_hash_t prev, const int32_t *ids, int block, uint64_t seed) {
    uint8_t buf[16 + 4 * PREFIX_HASH_BLOCK_MAX];
    for (int i = 0; i < 8; i++) {
        buf[i] = (uint8_t)(prev.low64 >> (8 * i));
        buf[8 + i] = (uint8_t)(prev.high64 >> (8 * i));
    }
    for (int t = 0; t < block; t++) {
        uint32_t v = (uint32_t)ids[t];
        for (int i = 0; i < 4; i++) buf[16 + 4 * t + i] = (uint8_t)(v >> (8 * i));
    }
    return XXH3_128bits_withSeed(buf, 16 + 4 * (size_t)block, seed);
}

int prefix_hash_blocks(const int32_t *ids, int n, int block, uint64_t seed, uint64_t *out, int max_out) {
    if (block < 1 || block > PREFIX_HASH_BLOCK_MAX || n < 0 || max_out < 0) return -1;
    XXH128_hash_t h = {0, 0};
    int nb = n / block;
    if (nb > max_out) nb = max_out;
    for (int b = 0; b < nb; b++) {
        h = prefix_hash_step(h, ids + (size_t)b * block, block, seed);
        out[b] = h.low64;
    }
    return nb;
}

uint64_t prefix_hash_seed(const uint8_t fingerprint[32]) {
    uint64_t s = 0;
    for (int i = 0; i < 8; i++) s |= (uint64_t)fingerprint[i] << (8 * i);
    return s;
}
