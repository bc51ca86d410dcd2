/* node_drain.c - the nodes' graceful end (node_drain.h). */
#include "node/node_drain.h"

#include <time.h>

#include "base/log.h"

/* How often a drain looks at what is left. */
#define NODE_DRAIN_POLL_MS 20

static double nd_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int node_drain_http(httpd *d, node_register *reg, int timeout_ms) {
    double t0 = nd_now_ms();
    node_register_leave(reg);   /* first: the router stops sending us work */
    httpd_quiesce(d);
    int left = httpd_wait_idle(d, timeout_ms - (int)(nd_now_ms() - t0));
    if (left > 0) log_warn(NULL, "drain timeout (%d ms): cutting %d request(s) in flight with an error", timeout_ms, left);
    else log_info(NULL, "drained in %.0f ms", nd_now_ms() - t0);
    return left;
}

int node_drain_wait_count(atomic_int *count, int timeout_ms) {
    double end = nd_now_ms() + timeout_ms;
    int n;
    while ((n = atomic_load(count)) > 0 && nd_now_ms() < end) {
        struct timespec ts = { 0, NODE_DRAIN_POLL_MS * 1000000L };
        nanosleep(&ts, NULL);
    }
    return n;
}
