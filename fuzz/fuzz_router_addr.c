/* fuzz_router_addr.c - libFuzzer target: the router's check of a node
 * address in a registration (router_check_addr, router_endpoints.c), the
 * one parser of issue 39's router side.
 *
 * Input: one byte of policy (its low bit: registration_addresses
 * "private"), then the address. An address the check takes must be
 * HOST:PORT only: no byte outside the host and port alphabets, a port of
 * 1-65535 after the last ':', and never a link-local host. Run:
 *   make fuzz && build/fuzz_router_addr -max_total_time=60
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>

#include "router/router.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || size > 200) return 0;
    int priv = data[0] & 1;
    char a[201], err[256];
    memcpy(a, data + 1, size - 1);
    a[size - 1] = 0;
    if (router_check_addr(a, priv, err, sizeof err)) {
        if (!err[0]) abort();   /* a refusal says why */
        return 0;
    }
    const char *colon = strrchr(a, ':');
    if (!colon || strspn(a, "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-.:[]") != strlen(a)) abort();
    long port = strtol(colon + 1, NULL, 10);
    if (port < 1 || port > 65535) abort();
    /* the host as an IP address, when it is one: never link-local */
    char host[201];
    size_t hl = (size_t)(colon - a);
    int v6 = a[0] == '[';
    memcpy(host, a + v6, hl - 2 * v6);
    host[hl - 2 * v6] = 0;
    unsigned char ip[16];
    if (!v6 && inet_pton(AF_INET, host, ip) == 1 && ip[0] == 169 && ip[1] == 254) abort();
    if (v6 && inet_pton(AF_INET6, host, ip) == 1 && ip[0] == 0xfe && (ip[1] & 0xc0) == 0x80) abort();
    return 0;
}
