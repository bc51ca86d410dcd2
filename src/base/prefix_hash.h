/* prefix_hash.h - one name for "the first i*B tokens of a prompt".
 *
 * A prompt's token ids are cut into blocks of B tokens; block i's hash
 * covers every token from 0 to (i+1)*B, because it is chained: it hashes
 * the previous block's 128-bit state together with the block's own ids.
 * Two prompts therefore share block i's hash exactly when (up to hash
 * collisions) they share their first (i+1)*B tokens, and the longest stored
 * prefix of a prompt is found by walking its hashes from the first block.
 *
 * Used by the decode and prefill nodes (to index what their slots and KV
 * store hold, and to report it) and by the router (to match a request
 * against those reports). The hash is XXH3-128, not a cryptographic one: a
 * client can make two prompts collide on purpose, so a hash may only choose
 * where to look or where to route; whoever reuses KV rows must compare the
 * token ids themselves before using them.
 *
 * seed keeps two models apart (callers pass the first 8 bytes of the model
 * fingerprint, read little-endian, so a report from one model never matches
 * another's prompts). Only full blocks are hashed; a tail shorter than B has
 * no hash.
 */
#ifndef TANDEM_PREFIX_HASH_H
#define TANDEM_PREFIX_HASH_H

#include <stdint.h>

/* Tokens per block. 64 tokens of a Qwen3-0.6B-shaped f16 cache are about
 * 7 MB of KV: large enough that a 4k-token rubric is 64 entries to index and
 * report, small enough that at most 63 tokens of a stored prefix are
 * recomputed because they end in a partial block. */
#define PREFIX_HASH_BLOCK 64

/* Largest block size accepted (bounds the stack buffer of one block). */
#define PREFIX_HASH_BLOCK_MAX 1024

/* Hashes of the full blocks of ids[0..n): out[i] covers ids[0 .. (i+1)*block).
 * Writes at most max_out hashes and returns how many it wrote (n / block,
 * capped), or -1 if block is outside 1..PREFIX_HASH_BLOCK_MAX or n < 0. */
int prefix_hash_blocks(const int32_t *ids, int n, int block, uint64_t seed, uint64_t *out, int max_out);

/* The seed for a model: its 32-byte fingerprint's first 8 bytes, little-endian. */
uint64_t prefix_hash_seed(const uint8_t fingerprint[32]);

#endif
