/* fuzz_node_auth.c - libFuzzer target: the signed-request checks every
 * node applies to outside headers (node_auth.h), and the log escaper.
 *
 * Input: "TIME\nNONCE\nSIGNATURE\nMETHOD\nPATH\nBODY..." (missing lines are
 * missing headers). The verifier runs at a fixed clock with a small replay
 * cache, so repeated nonces and the cache's floor are reached too. The whole
 * input is also escaped with logsafe_escape, whose output must hold no
 * control byte and no raw newline. Run:
 *   make fuzz && build/fuzz_node_auth -max_total_time=60
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/logsafe.h"
#include "net/node_auth.h"

#define FZ_NOW_MS 1700000000000LL   /* fixed clock: seeds stay inside the window */

static node_auth_key K;
static node_auth_replay *RP;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!RP) {
        node_auth_derive(&K, "fuzz-secret", 11, NODE_AUTH_LABEL_DECODE_API);
        RP = node_auth_replay_new(64);
    }
    char *buf = malloc(size + 1);
    if (!buf) return 0;
    memcpy(buf, data, size);
    buf[size] = 0;
    const char *f[5] = { NULL, NULL, NULL, "POST", "/v1/generate" };
    char *p = buf;
    int n = 0;
    for (; n < 5 && p; n++) {
        char *nl = memchr(p, '\n', size - (size_t)(p - buf));
        if (!nl) { f[n] = p; p = NULL; n++; break; }
        *nl = 0;
        f[n] = p;
        p = nl + 1;
    }
    const char *body = p ? p : "";
    size_t blen = p ? size - (size_t)(p - buf) : 0;
    char err[256];
    node_auth_verify(&K, RP, f[3], f[4], f[0], f[1], f[2], body, blen, FZ_NOW_MS, err, sizeof err);
    char out[4096];
    size_t ol = logsafe_escape(out, sizeof out, (const char *)data, size);
    if (ol != strlen(out)) abort();
    for (size_t i = 0; i < ol; i++)
        if ((unsigned char)out[i] < 0x20 || out[i] == 0x7f) abort();
    free(buf);
    return 0;
}
