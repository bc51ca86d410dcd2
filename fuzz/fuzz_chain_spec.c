/* fuzz_chain_spec.c - libFuzzer target: the layer-split chain's parsers of
 * slice bounds (issue 41): wire_layers_parse (net/wire_act.c: "A:B", each
 * bound L or L.5), chain_spec_desc_layers (net/chain_spec.c: the "; layers
 * A:B" a prefill node's HELLO carries, bytes from the peer), and the chain
 * spec an operator writes, chain_spec_parse (net/chain_spec.c: the one
 * parser of the decode node, `tandem run` and the router).
 *
 * Input: a byte of mode (mod 4), then the text. What is taken must hold:
 * bounds 0 <= lo < hi <= 2 x WIRE_LAYERS_MAX half blocks, a bound written
 * back (wire_layers_format) parses to the same pair; a spec's slices start
 * at 0, each where the one before ended, each computing one block's
 * attention, each address non-empty with a ':'; mode 3: a taken spec
 * written back (addr/A:B,...) parses to the same members; a refusal says
 * why. Run:
 *   make fuzz && build/fuzz_chain_spec -max_total_time=60
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <stdio.h>

#include "net/chain_spec.h"
#include "net/wire_act.h"

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
        if (!chain_spec_desc_layers(s, &lo, &hi)) check_bounds(lo, hi);
        break;
    default: {
        static chain_spec sp, back;   /* 4 KiB each: off the fuzzer's stack */
        if (chain_spec_parse(s, &sp, err, sizeof err)) {
            if (!err[0]) abort();
            break;
        }
        if (sp.n < 1 || sp.n > CHAIN_SPEC_MAX) abort();
        check_chain(sp.n, sp.lo, sp.hi);
        for (int i = 0; i < sp.n; i++)
            if (!sp.addr[i][0] || !strchr(sp.addr[i], ':') || strchr(sp.addr[i], '/') || strchr(sp.addr[i], ',')) abort();
        if ((data[0] & 3) == 3) {   /* written back, the same members */
            static char t[CHAIN_SPEC_MAX * (CHAIN_SPEC_ADDR + 40)];
            size_t o = 0;
            for (int i = 0; i < sp.n; i++) {
                char r[64];
                wire_layers_format(r, sizeof r, sp.lo[i], sp.hi[i]);
                o += (size_t)snprintf(t + o, sizeof t - o, "%s%s/%s", i ? "," : "", sp.addr[i], r);
            }
            if (chain_spec_parse(t, &back, err, sizeof err) || back.n != sp.n) abort();
            for (int i = 0; i < sp.n; i++)
                if (strcmp(back.addr[i], sp.addr[i]) || back.lo[i] != sp.lo[i] || back.hi[i] != sp.hi[i]) abort();
        }
        break;
    }
    }
    free(s);
    return 0;
}
