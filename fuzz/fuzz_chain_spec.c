/* fuzz_chain_spec.c - libFuzzer target: the layer-split chain's parsers of
 * slice bounds (issue 41): wire_layers_parse (net/wire_act.c: "A:B", each
 * bound L or L.5), chain_desc_layers (node/chain.c: the "; layers A:B" a
 * prefill node's HELLO carries, bytes from the peer), and the two chain
 * specs an operator writes, chain_parse (decode node) and rt_chain_parse
 * (router).
 *
 * Input: a byte of mode (mod 4), then the text. What is taken must hold:
 * bounds 0 <= lo < hi <= 2 x WIRE_LAYERS_MAX half blocks, a bound written
 * back (wire_layers_format) parses to the same pair; a spec's slices start
 * at 0, each where the one before ended, each computing one block's
 * attention; a refusal says why. Run:
 *   make fuzz && build/fuzz_chain_spec -max_total_time=60
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "net/wire_act.h"
#include "node/chain.h"
#include "router/router_chain.h"

/* lo, hi taken: in range, and written back they parse to themselves. */
static void check_bounds(int lo, int hi) {
    if (lo < 0 || hi <= lo || hi > 2 * WIRE_LAYERS_MAX) abort();
    char t[64];
    int a, b, used;
    wire_layers_format(t, sizeof t, lo, hi);
    if (wire_layers_parse(t, &a, &b, &used) || a != lo || b != hi || t[used]) abort();
}

/* n slices lo[i]:hi[i] taken as a chain: in order from 0, no gap. */
static void check_chain(int n, const int *lo, const int *hi) {
    int want = 0;
    for (int i = 0; i < n; i++) {
        check_bounds(lo[i], hi[i]);
        if (lo[i] != want || wire_layers_kv(lo[i]) == wire_layers_kv(hi[i])) abort();
        want = hi[i];
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || size > 4096) return 0;
    char *s = malloc(size);
    if (!s) return 0;
    memcpy(s, data + 1, size - 1);
    s[size - 1] = 0;
    char err[512] = "";
    int lo, hi, used;
    switch (data[0] & 3) {
    case 0:
        if (!wire_layers_parse(s, &lo, &hi, &used)) {
            if (used < 3 || (size_t)used > strlen(s)) abort();
            check_bounds(lo, hi);
        }
        break;
    case 1:
        if (!chain_desc_layers(s, &lo, &hi)) check_bounds(lo, hi);
        break;
    case 2: {
        chain_spec sp;
        if (chain_parse(s, &sp, err, sizeof err)) {
            if (!err[0]) abort();
        } else {
            if (sp.n < 1 || sp.n > CHAIN_MAX_NODES) abort();
            check_chain(sp.n, sp.lo, sp.hi);
        }
        break;
    }
    default: {
        char addrs[RT_CHAIN_MAX][128];
        int l[RT_CHAIN_MAX], h[RT_CHAIN_MAX];
        int n = rt_chain_parse(s, addrs, l, h, err, sizeof err);
        if (n < 0) {
            if (!err[0]) abort();
        } else {
            if (n < 1 || n > RT_CHAIN_MAX) abort();
            check_chain(n, l, h);
        }
        break;
    }
    }
    free(s);
    return 0;
}
