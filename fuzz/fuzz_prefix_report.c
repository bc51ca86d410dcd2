/* fuzz_prefix_report.c - libFuzzer target: the router's parser of a
 * decode node's prefix report (GET /v1/stats "prefix", rc_report_parse in
 * router_cache.c), the one new parser of outside data of issue 47.
 *
 * Input: a byte of mode, then either JSON (mode even: any bytes, parsed and
 * given to the parser as the "prefix" object) or hashes (mode odd: 8 bytes
 * each, a tier's and a connection's) that node/prefix_report.c writes into
 * a report, which the router must then take. Run:
 *   make fuzz && build/fuzz_prefix_report -max_total_time=60
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "node/prefix_report.h"
#include "router/router_cache.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || size > (1u << 16)) return 0;
    if (!(data[0] & 1)) {
        json_t *o = json_loadb((const char *)data + 1, size - 1, 0, NULL);
        rc_report_free(rc_report_parse(o));
        json_decref(o);
        return 0;
    }
    size_t n = (size - 1) / 8;
    uint64_t *h = malloc(sizeof *h * (n ? n : 1));
    if (!h) return 0;
    for (size_t i = 0; i < n; i++) memcpy(&h[i], data + 1 + 8 * i, 8);
    prefix_report *r = prefix_report_new(n ? h[0] : 0);
    prefix_report_add(r, "slots", h, (int)n);
    prefix_report_add(r, "host", h + n / 2, (int)(n - n / 2));
    prefix_report_add_peer(r, "127.0.0.1:9101", h, (int)(n / 3));
    json_t *o = prefix_report_json(r);
    rc_report *rep = rc_report_parse(o);
    if (!rep) abort();   /* what a node writes, the router takes */
    rc_report_free(rep);
    json_decref(o);
    prefix_report_free(r);
    free(h);
    return 0;
}
