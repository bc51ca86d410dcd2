/* xorshift.h - Marsaglia's xorshift generators (2003), for data that must
 * be the same on every machine and every run: benchmark prompts and KV
 * rows, the chain planner's calibration passes, the tests' random data.
 * Not for anything an attacker may predict to harm (keys, nonces: OpenSSL).
 * The state is the caller's; a seed of 0 stays 0. */
#ifndef TANDEM_XORSHIFT_H
#define TANDEM_XORSHIFT_H

#include <stdint.h>

/* xorshift64, shifts 13, 7, 17: the next state, which is also the value. */
static inline uint64_t xorshift64_next(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

/* 32 bits (16..47) of the next xorshift64 value. */
static inline uint32_t xorshift64_u32(uint64_t *s) { return (uint32_t)(xorshift64_next(s) >> 16); }

/* xorshift32, shifts 13, 17, 5. */
static inline uint32_t xorshift32_next(uint32_t *s) {
    uint32_t x = *s;
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    return *s = x;
}

#endif
