/* test_prefix_hash: chained block hashes name prefixes, not blocks. */
#include "t.h"

#include "base/prefix_hash.h"

#include <string.h>

int main(void) {
    enum { N = 300 };
    int32_t a[N], b[N];
    for (int i = 0; i < N; i++) a[i] = b[i] = (i * 7919) % 151936;
    uint64_t ha[N], hb[N];

    CHECK(prefix_hash_blocks(a, N, 64, 1, ha, N) == 4, "prefix_hash_blocks(a, N, 64, 1, ha, N) == 4");           /* 300/64: 4 full blocks */
    CHECK(prefix_hash_blocks(a, 63, 64, 1, ha, N) == 0, "prefix_hash_blocks(a, 63, 64, 1, ha, N) == 0");          /* a tail has no hash */
    CHECK(prefix_hash_blocks(a, N, 64, 1, ha, 2) == 2, "prefix_hash_blocks(a, N, 64, 1, ha, 2) == 2");           /* capped by max_out */
    CHECK(prefix_hash_blocks(a, N, 0, 1, ha, N) == -1, "prefix_hash_blocks(a, N, 0, 1, ha, N) == -1");
    CHECK(prefix_hash_blocks(a, N, PREFIX_HASH_BLOCK_MAX + 1, 1, ha, N) == -1, "prefix_hash_blocks(a, N, PREFIX_HASH_BLOCK_MAX + 1, 1, ha, N) == -1");
    CHECK(prefix_hash_blocks(a, -1, 64, 1, ha, N) == -1, "prefix_hash_blocks(a, -1, 64, 1, ha, N) == -1");

    /* Same ids, same hashes; a change in block 2 changes blocks 2.. only. */
    prefix_hash_blocks(a, N, 64, 1, ha, N);
    b[150] ^= 1;
    prefix_hash_blocks(b, N, 64, 1, hb, N);
    CHECK(ha[0] == hb[0] && ha[1] == hb[1], "ha[0] == hb[0] && ha[1] == hb[1]");
    CHECK(ha[2] != hb[2] && ha[3] != hb[3], "ha[2] != hb[2] && ha[3] != hb[3]");

    /* Chained: block 1 of a equals block 0 of nothing else; two prompts that
     * share block 1's ids but not block 0's differ at block 1. */
    memcpy(b, a, sizeof a);
    b[0] ^= 1;
    prefix_hash_blocks(b, N, 64, 1, hb, N);
    CHECK(ha[1] != hb[1], "ha[1] != hb[1]");

    /* Identical blocks at different positions hash differently. */
    int32_t rep[128];
    for (int i = 0; i < 128; i++) rep[i] = i % 64;
    uint64_t hr[2];
    prefix_hash_blocks(rep, 128, 64, 1, hr, 2);
    CHECK(hr[0] != hr[1], "hr[0] != hr[1]");

    /* The seed keeps models apart. */
    prefix_hash_blocks(a, N, 64, 2, hb, N);
    CHECK(ha[0] != hb[0], "ha[0] != hb[0]");

    /* A pinned value: the hash is part of what nodes report to the router,
     * so a change of it must be deliberate (and both sides rebuilt). */
    uint8_t fp[32] = {1, 2, 3, 4, 5, 6, 7, 8};
    CHECK(prefix_hash_seed(fp) == 0x0807060504030201ull, "seed is little-endian");
    int32_t ids[64];
    for (int i = 0; i < 64; i++) ids[i] = i;
    uint64_t h = 0;
    prefix_hash_blocks(ids, 64, 64, 0, &h, 1);
    CHECK(h == 0x98fd01657ccc215cull, "hash of ids 0..63, seed 0: %016llx", (unsigned long long)h);
    return t_done("test_prefix_hash");
}
