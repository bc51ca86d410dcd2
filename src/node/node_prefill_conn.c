/* node_prefill_conn.c - a decode node's connection to the prefill node:
 * the handshake, the loop of REQUEST frames, and the handshake pool's
 * shares (slots of their own, trust for addresses that authenticated, the
 * oldest evicted when a new one needs room). */

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "engine/generate.h"
#include "base/log.h"
#include "net/prefill_rate.h"

#include "node/node_prefill_internal.h"

/* ==== Connections ==== */

/* Waits until a frame starts arriving. 0 = readable, -1 = stop or idle
 * (nothing but PINGs since `since` for idle_ms counts as idle). */
static int pn_wait_frame(pn_conn *pc, double since) {
    while (!pn_stopped(pc->node) && !pc->node->draining) {
        /* checked before every frame: a peer sending PINGs faster than the
         * poll tick must still reach the limit */
        if (gen_now_ms() - since >= pc->node->o->idle_ms) {
            log_info(NULL, "conn %u (%s) sent no request for %d ms, closing", pc->id, pc->peer, pc->node->o->idle_ms);
            pn_send_error(&pc->conn, 0, WERR_TIMEOUT, "no request for %d ms", pc->node->o->idle_ms);
            return -1;
        }
        struct pollfd p = { .fd = pc->conn.fd, .events = POLLIN };
        int r = poll(&p, 1, PN_TICK_MS);
        if (r > 0) return 0;
        if (r < 0 && errno != EINTR) return -1;
    }
    return -1;
}

static int pn_handshake(pn_conn *pc) {
    pnode *node = pc->node;
    wire_hello mine = node->hello, peer;
    char err[512];
    pthread_mutex_lock(&node->mu);
    double tps = node->prefill_tps;
    pthread_mutex_unlock(&node->mu);
    prefill_rate_format(mine.model_desc, sizeof mine.model_desc, node->base_desc, tps);
    memset(&peer, 0, sizeof peer);
    if (wire_handshake(&pc->conn, &mine, node->o->secret, node->o->secret_len, &peer, err, sizeof err)) {
        /* A router's health probe reads our HELLO and hangs up without one
         * of its own: not worth a log line every second. */
        if (peer.node_id[0] || !strstr(err, "closed"))
            log_warn(NULL, "conn %u: handshake failed: %s", pc->id, err);
        return -1;
    }
    if (peer.role != WIRE_ROLE_DECODE && peer.role != WIRE_ROLE_ROUTER) {
        pn_send_error(&pc->conn, 0, WERR_PROTOCOL, "a prefill node serves decode nodes (peer role %u)", peer.role);
        log_warn(NULL, "conn %u: refused peer %s with role %u", pc->id, peer.node_id, peer.role);
        return -1;
    }
    pc->caps = mine.caps & peer.caps;
    snprintf(pc->peer, sizeof pc->peer, "%s", peer.node_id);
    return 0;
}

static void pn_conn_loop(pn_conn *pc) {
    char err[512];
    double since = gen_now_ms();
    while (pn_wait_frame(pc, since) == 0) {
        wire_header h;
        if (wire_recv(&pc->conn, &h, err, sizeof err)) {
            if (!strstr(err, "closed")) log_warn(NULL, "conn %u (%s): %s", pc->id, pc->peer, err);
            /* a bad CRC, tag or header is answered before we hang up */
            if (pc->conn.rx_err) wire_send_error(&pc->conn, 0, pc->conn.rx_err, err);
            return;
        }
        if (h.type == WIRE_REQUEST) {
            if (pn_request(pc, h.req_id)) return;
            since = gen_now_ms();
        } else if (h.type == WIRE_DRAFT && pc->node->drafter && (pc->caps & WIRE_CAP_DRAFT)) {
            if (draft_server_answer(pc->node->drafter, pc->id, &pc->conn, &h, err, sizeof err)) {
                log_warn(NULL, "conn %u (%s): draft: %s, closing", pc->id, pc->peer, err);
                return;
            }
            since = gen_now_ms();
        } else if (h.type == WIRE_PING) {
            wire_send(&pc->conn, WIRE_PONG, h.req_id, 0, pc->conn.rx.data, pc->conn.rx.len, err, sizeof err);
        } else if (h.type == WIRE_CANCEL || h.type == WIRE_PONG) {
            /* a cancel that crossed the DONE: nothing to stop */
        } else if (h.type == WIRE_ERROR) {
            wire_error we = { 0 };
            if (wire_decode_error(pc->conn.rx.data, pc->conn.rx.len, &we, err, sizeof err) == 0)
                log_warn(NULL, "conn %u (%s) reported error %u: %s", pc->id, pc->peer, we.code, we.message);
            if (h.req_id == 0) return;
        } else {
            pn_send_error(&pc->conn, 0, WERR_PROTOCOL, "unexpected frame type %u", h.type);
            log_warn(NULL, "conn %u (%s): unexpected frame type %u, closing", pc->id, pc->peer, h.type);
            return;
        }
    }
}

/* ==== Handshake pool shares ==== */

double pn_mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Locked. */
int pn_is_trusted(pnode *node, const httpd_addr *a, double now) {
    for (int i = 0; i < PN_TRUST_MAX; i++)
        if (node->trust[i].until_ms > now && httpd_same_addr(&node->trust[i].addr, a)) return 1;
    return 0;
}

/* Locked: a (renewed), in its own entry or the soonest-expiring one. */
static void pn_trust_add(pnode *node, const httpd_addr *a) {
    int slot = 0;
    for (int i = 0; i < PN_TRUST_MAX; i++) {
        if (node->trust[i].until_ms > 0 && httpd_same_addr(&node->trust[i].addr, a)) { slot = i; break; }
        if (node->trust[i].until_ms < node->trust[slot].until_ms) slot = i;
    }
    node->trust[slot].addr = *a;
    node->trust[slot].until_ms = pn_mono_ms() + PN_TRUST_MS;
}

/* Locked: drops a handshake in progress (its thread notices the shut socket). */
static void pn_evict(pnode *node, pn_slot *s) {
    s->evicted = 1;
    node->n_preauth--;
    node->preauth_evicted++;
    shutdown(s->fd, SHUT_RDWR);
}

/* Locked: makes room in the handshake pool for a newcomer from a (trusted
 * or not), by the shares above: a trusted newcomer drops the oldest
 * trusted handshake when its pool is full; a stranger whose address or
 * block already holds its share is refused (-1: closed at once, no thread
 * spent, so a flood is drained as fast as it arrives); else in a full pool
 * the oldest of the block holding the most is dropped (when that is more
 * than the newcomer's block holds), else the oldest. 0 = admit. */
int pn_make_room(pnode *node, const httpd_addr *a, int has_addr, int trusted) {
    pn_slot *pre[PN_MAX_CONNS * 3];
    int np = 0, nt = 0;
    pn_slot *oldest_t = NULL, *oldest = NULL, *own = NULL, *own_block = NULL;
    int same = 0, block = 0;
    for (int i = 0; i < node->n_slots && np < (int)(sizeof pre / sizeof pre[0]); i++) {
        pn_slot *s = &node->slots[i];
        if (!s->used || s->done || s->state != PN_PREAUTH || s->evicted) continue;
        if (s->trusted) {
            nt++;
            if (!oldest_t || s->id < oldest_t->id) oldest_t = s;
            continue;
        }
        pre[np++] = s;
        if (!oldest || s->id < oldest->id) oldest = s;
        if (has_addr && s->has_addr && httpd_same_addr(&s->addr, a)) { same++; if (!own || s->id < own->id) own = s; }
        if (has_addr && s->has_addr && httpd_same_block(&s->addr, a)) {
            block++;
            if (!own_block || s->id < own_block->id) own_block = s;
        }
    }
    if (trusted) {
        if (nt >= node->max_trusted_preauth && oldest_t) pn_evict(node, oldest_t);
        return 0;
    }
    int addr_share = node->max_preauth / PN_PREAUTH_ADDR_DIV, block_share = node->max_preauth / PN_PREAUTH_BLOCK_DIV;
    if (own && same >= (addr_share > 0 ? addr_share : 1)) return -1;
    if (own_block && block >= (block_share > 0 ? block_share : 1)) return -1;
    if (np < node->max_preauth) return 0;
    /* the block holding the most handshakes, and its oldest */
    pn_slot *greedy = NULL;
    int greedy_n = 0;
    for (int i = 0; i < np; i++) {
        int n = 0;
        pn_slot *first = NULL;
        for (int j = 0; j < np; j++)
            if (pre[i]->has_addr && pre[j]->has_addr && httpd_same_block(&pre[i]->addr, &pre[j]->addr)) {
                n++;
                if (!first || pre[j]->id < first->id) first = pre[j];
            }
        if (first && (n > greedy_n || (n == greedy_n && first->id < greedy->id))) { greedy = first; greedy_n = n; }
    }
    pn_evict(node, greedy && greedy_n > block ? greedy : oldest);
    return 0;
}

/* After a successful handshake: take an authenticated slot, or BUSY. */
static int pn_promote(pn_slot *slot, pn_conn *pc) {
    pnode *node = slot->node;
    pthread_mutex_lock(&node->mu);
    int ok = !slot->evicted && node->n_authed < node->max_authed;
    if (ok) {
        node->n_preauth--;
        node->n_authed++;
        slot->state = PN_AUTHED;
        if (slot->has_addr) pn_trust_add(node, &slot->addr);
    }
    int evicted = slot->evicted;
    pthread_mutex_unlock(&node->mu);
    if (!ok && !evicted) {
        pn_send_error(&pc->conn, 0, WERR_BUSY, "prefill node busy: %d connections", node->max_authed);
        log_warn(NULL, "refused %s after its handshake: all %d slots busy", pc->peer, node->max_authed);
    }
    return ok ? 0 : -1;
}

void *pn_conn_main(void *arg) {
    pn_slot *slot = arg;
    pnode *node = slot->node;
    pn_conn pc = { .node = node, .id = slot->id };
    snprintf(pc.peer, sizeof pc.peer, "?");
    /* the handshake's whole deadline is the conn's timeout while it runs */
    wire_conn_init(&pc.conn, slot->fd, node->o->handshake_ms);
    if (pn_handshake(&pc) == 0 && pn_promote(slot, &pc) == 0) {
        pc.conn.timeout_ms = node->o->timeout_ms;
        pn_conn_loop(&pc);
    }
    session_free(pc.s);
    free(pc.prev);
    draft_server_conn_gone(node->drafter, pc.id);
    /* done before close: the shutdown path only touches fds of slots not
     * done, under the same lock, so it never sees a closed (reused) fd */
    pthread_mutex_lock(&node->mu);
    slot->done = 1;
    if (slot->state == PN_AUTHED) node->n_authed--;
    else if (!slot->evicted) node->n_preauth--;
    slot->state = PN_FREE;
    pthread_mutex_unlock(&node->mu);
    wire_conn_close(&pc.conn);
    return NULL;
}
