/* chain_plan.c - `tandem chain-plan`: where to cut a model into the slices
 * of a layer-split prefill chain (net/chain_plan.h, docs/layer-split.md
 * "Planning a chain"). Reads the model's shape from the GGUF's metadata
 * (model_peek_hparams: the loader's checks, no weights), prints each node's
 * `--layers A:B` and the chain spec for the decode node or the router. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/cliopt.h"
#include "cmd/cli.h"
#include "engine/model.h"
#include "net/chain_calib.h"
#include "net/chain_plan.h"
#include "net/wire_act.h"

#define CP "tandem chain-plan"

typedef struct {
    const char *model, *hosts;
    int nodes, tokens, logit_rows, bounds_only;
    double attn_rate;                       /* chain_plan_weigh's; 0: measure it */
    int measure_rows;                       /* rows of a measured pass (0: 256, at most half the prompt) */
    int n_rates;
    double rates[CHAIN_SPEC_MAX];
    char host_buf[CHAIN_SPEC_MAX * CHAIN_SPEC_ADDR];
    const char *host[CHAIN_SPEC_MAX];
    int n_hosts;
} cp_opts;

static void cp_usage(FILE *f) {
    fprintf(f,
        "usage: tandem chain-plan -m MODEL.gguf --nodes N [options]\n"
        "  the half-block bounds (L or L.5) of an N-node layer-split prefill chain that\n"
        "  minimise the slowest node's time for one prompt (FLOPs per half block from\n"
        "  the model's shape, attention weighed by --attn-rate, over each node's rate;\n"
        "  docs/layer-split.md)\n"
        "  -m FILE               the model (its metadata only is read, but for\n"
        "                        --attn-rate measure)\n"
        "  --nodes N             slice nodes, 1..min(blocks, %d)\n"
        "  --rates R1,...,RN     the nodes' relative speeds (> 0; default all 1)\n"
        "  --prompt-tokens T     the prompt length to balance for (default 4096)\n"
        "  --logit-rows R        rows needing logits on the last node (default 0: the\n"
        "                        decode node computes the prompt's last position)\n"
        "  --attn-rate R|measure the causal attention's FLOP rate as a fraction of the\n"
        "                        weight products' (default 1: the plain FLOP count; 0.5:\n"
        "                        attention FLOPs cost twice). measure: time both on this\n"
        "                        machine (the model's first block alone, one thread,\n"
        "                        seconds; every node assumed to have the same ratio,\n"
        "                        --rates giving their overall speeds)\n"
        "  --measure-rows N      rows of a measured pass (%d..%d, default 256; at most\n"
        "                        half the prompt, measured at 16384 tokens at most)\n"
        "  --hosts H1:P1,...     the nodes' addresses for the spec (default HOSTi:PORT)\n"
        "  --format text|bounds  bounds: one line per node, its A:B only\n", CHAIN_SPEC_MAX, CHAIN_CALIB_MIN_ROWS,
        CHAIN_CALIB_MAX_ROWS);
}

/* ==== Options ==== */

static int cp_parse_hosts(cp_opts *o, const char *v) {
    if (strlen(v) >= sizeof o->host_buf) { fprintf(stderr, CP ": --hosts: too long\n"); return -1; }
    strcpy(o->host_buf, v);
    for (char *p = o->host_buf; p;) {
        char *c = strchr(p, ',');
        if (c) *c = 0;
        if (o->n_hosts == CHAIN_SPEC_MAX || !*p || !strchr(p, ':') || strchr(p, '/') || strlen(p) >= CHAIN_SPEC_ADDR) {
            fprintf(stderr, CP ": --hosts: give 1..%d HOST:PORT separated by commas\n", CHAIN_SPEC_MAX);
            return -1;
        }
        o->host[o->n_hosts++] = p;
        p = c ? c + 1 : NULL;
    }
    return 0;
}

static int cp_parse(int argc, char **argv, cp_opts *o) {
    memset(o, 0, sizeof *o);
    o->tokens = 4096;   /* the speed table's middle length */
    o->attn_rate = 1;   /* the plain FLOP count, as before the rate was known */
    static const char *const formats[] = { "text", "bounds", NULL };
    for (int i = 0; i < argc; i += 2) {   /* every option takes a value */
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad;
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) bad = cliopt_str(CP, a, v, &o->model);
        else if (!strcmp(a, "--nodes")) bad = cliopt_int(CP, a, v, 1, CHAIN_SPEC_MAX, &o->nodes);
        else if (!strcmp(a, "--prompt-tokens")) bad = cliopt_int(CP, a, v, 1, CHAIN_PLAN_MAX_TOKENS, &o->tokens);
        else if (!strcmp(a, "--logit-rows")) bad = cliopt_int(CP, a, v, 0, CHAIN_PLAN_MAX_TOKENS, &o->logit_rows);
        else if (!strcmp(a, "--rates"))
            bad = cliopt_double_list(CP, a, v, CHAIN_PLAN_RATE_MIN, CHAIN_PLAN_RATE_MAX, o->rates, CHAIN_SPEC_MAX, &o->n_rates);
        else if (!strcmp(a, "--attn-rate") && v && !strcmp(v, "measure")) { o->attn_rate = 0; bad = 0; }
        else if (!strcmp(a, "--attn-rate"))
            bad = cliopt_double(CP, a, v, CHAIN_PLAN_ATTN_RATE_MIN, CHAIN_PLAN_ATTN_RATE_MAX, &o->attn_rate);
        else if (!strcmp(a, "--measure-rows"))
            bad = cliopt_int(CP, a, v, CHAIN_CALIB_MIN_ROWS, CHAIN_CALIB_MAX_ROWS, &o->measure_rows);
        else if (!strcmp(a, "--hosts")) bad = !v ? cliopt_str(CP, a, v, &a) : cp_parse_hosts(o, v);
        else if (!strcmp(a, "--format")) bad = cliopt_choice(CP, a, v, formats, &o->bounds_only);
        else { fprintf(stderr, CP ": unknown option %s\n", a); cp_usage(stderr); return -1; }
        if (bad) return -1;
    }
    if (!o->model || !o->nodes) { fprintf(stderr, CP ": give -m MODEL and --nodes N\n"); return -1; }
    if (o->n_rates && o->n_rates != o->nodes) {
        fprintf(stderr, CP ": --rates gives %d rates for %d nodes\n", o->n_rates, o->nodes);
        return -1;
    }
    if (o->n_hosts && o->n_hosts != o->nodes) {
        fprintf(stderr, CP ": --hosts gives %d addresses for %d nodes\n", o->n_hosts, o->nodes);
        return -1;
    }
    if (o->logit_rows > o->tokens) {
        fprintf(stderr, CP ": --logit-rows %d exceeds --prompt-tokens %d\n", o->logit_rows, o->tokens);
        return -1;
    }
    return 0;
}

/* ==== Output ==== */

static void cp_print_split(const char *what, const chain_plan *p, const double *rates, const double *kinds) {
    printf("%s:\n  node  layers      rate   GFLOP  attn   cost share    time\n", what);
    for (int i = 0; i < p->n; i++) {
        char t[40];
        double f = 0, at = 0;
        for (int k = p->lo[i]; k < p->hi[i]; k++) {
            f += kinds[k * CHAIN_KINDS + CHAIN_KIND_MAT] + kinds[k * CHAIN_KINDS + CHAIN_KIND_ATTN];
            at += kinds[k * CHAIN_KINDS + CHAIN_KIND_ATTN];
        }
        wire_layers_format(t, sizeof t, p->lo[i], p->hi[i]);
        printf("  %-4d  %-10s  %-5g  %6.1f  %3.0f%%  %9.1f%%  %6.1f%s\n", i + 1, t, rates ? rates[i] : 1.0, f / 1e9,
               f > 0 ? 100 * at / f : 0, 100.0 * p->flops[i] / p->total, p->time[i] / 1e9,
               p->time[i] == p->slowest ? "  slowest" : "");
    }
}

static void cp_print_bounds(const char *what, const chain_plan *c, const chain_plan *p) {
    char s[CHAIN_SPEC_MAX * 40];
    size_t k = 0;
    for (int i = 0; i < c->n; i++) {
        char t[40];
        wire_layers_format(t, sizeof t, c->lo[i], c->hi[i]);
        k += (size_t)snprintf(s + k, sizeof s - k, "%s%s", i ? "," : "", t);
    }
    printf("%s (%s): slowest node %.3fx the plan's\n", what, s, c->slowest / p->slowest);
}

static void cp_print_calib(const chain_calib *c) {
    printf("measured (one thread, the first block alone, %d rows a pass at positions 0 and %d of %d; CPU s, the least "
           "of 2 or more):\n  early %.3f s, late %.3f s: weight products %.1f GFLOP/s, attention %.1f GFLOP/s, "
           "--attn-rate %.3f\n", c->rows, c->tokens - c->rows, c->tokens, c->t_early, c->t_late, c->mat_rate / 1e9,
           c->attn_rate / 1e9, c->ratio);
}

typedef struct {
    const model_hparams *h;
    const double *kinds;
    const chain_plan *p, *cnt, *flop;     /* the plan, by layer count, by the plain FLOP count */
    const chain_calib *calib;
} cp_result;

static void cp_print(const cp_opts *o, const cp_result *r) {
    const double *rt = o->n_rates ? o->rates : NULL;
    const model_hparams *h = r->h;
    const chain_plan *p = r->p;
    if (o->bounds_only) {
        for (int i = 0; i < p->n; i++) {
            char t[40];
            wire_layers_format(t, sizeof t, p->lo[i], p->hi[i]);
            printf("%s\n", t);
        }
        return;
    }
    printf("model: %s, %s, %d blocks, %d wide, %d/%d heads of %d, ", o->model, h->arch_name, h->n_layer, h->n_embd,
           h->n_head, h->n_head_kv, h->head_dim_k);
    if (h->n_expert) printf("%d experts of %d (%d used)", h->n_expert, h->n_ff_exp, h->n_expert_used);
    else printf("feed-forward %d", h->n_ff);
    printf("; %d prompt tokens, %d rows of logits\n", o->tokens, o->logit_rows);
    if (r->calib) cp_print_calib(r->calib);
    printf("cost = weight-product FLOPs + attention FLOPs / %g; time = cost / rate (docs/layer-split.md, \"Planning "
           "a chain\")\n", o->attn_rate);
    cp_print_split("plan", p, rt, r->kinds);
    if (r->cnt) cp_print_bounds("by layer count", r->cnt, p);
    if (r->flop) cp_print_bounds("by FLOP count (attn-rate 1)", r->flop, p);
    printf("nodes:\n");
    for (int i = 0; i < p->n; i++) {
        char t[40];
        wire_layers_format(t, sizeof t, p->lo[i], p->hi[i]);
        printf("  tandem serve --role prefill -m %s --layers %s --listen %s ...\n", o->model, t,
               o->n_hosts ? o->host[i] : "HOST:PORT");
    }
    char spec[CHAIN_SPEC_MAX * (CHAIN_SPEC_ADDR + 40)];
    chain_plan_spec(p, o->n_hosts ? o->host : NULL, spec, sizeof spec);
    printf("spec: %s\n", spec);
}

/* ==== Plan ==== */

/* The plan at o->attn_rate, and the others cp_print compares it with;
 * the FLOP count's plan's bounds are made at rate 1 and costed at o's. */
static int cp_plan(const cp_opts *o, const model_hparams *h, double *kinds, double *cost, cp_result *r,
                   chain_plan *p, chain_plan *cnt, chain_plan *flop, char *err, size_t errlen) {
    const double *rt = o->n_rates ? o->rates : NULL;
    int H = 2 * h->n_layer;
    if (chain_plan_kinds(h, o->tokens, o->logit_rows, kinds, err, errlen) ||
        chain_plan_weigh(kinds, H, o->attn_rate, cost, err, errlen) ||
        chain_plan_solve(cost, H, o->nodes, rt, p, err, errlen))
        return -1;
    r->p = p;
    r->cnt = chain_plan_count(cost, h->n_layer, o->nodes, rt, cnt) ? NULL : cnt;
    r->flop = NULL;
    if (o->attn_rate != 1) {
        double *c1 = cost + H;   /* cost holds 2 H: the plain count's in the second half */
        if (chain_plan_weigh(kinds, H, 1.0, c1, err, errlen) || chain_plan_solve(c1, H, o->nodes, rt, flop, err, errlen))
            return -1;
        chain_plan_price(flop, cost, rt);   /* its bounds at the plan's rate */
        r->flop = flop;
    }
    return 0;
}

int cli_chain_plan(int argc, char **argv) {
    if (cliopt_wants_help(argc, argv)) { cp_usage(stdout); return CLI_EXIT_OK; }
    cp_opts o;
    if (cp_parse(argc, argv, &o)) return CLI_EXIT_USAGE;
    char err[600];
    model_hparams h;
    if (model_peek_hparams(o.model, &h, err, sizeof err)) { fprintf(stderr, CP ": %s\n", err); return CLI_EXIT_FAIL; }
    if (o.nodes > h.n_layer) {
        fprintf(stderr, CP ": --nodes %d for %d blocks: each node computes at least one block's attention\n", o.nodes,
                h.n_layer);
        return CLI_EXIT_USAGE;
    }
    chain_calib calib;
    cp_result r = { .h = &h };
    if (!o.attn_rate) {
        int t = o.tokens < CHAIN_CALIB_MAX_TOKENS ? o.tokens : CHAIN_CALIB_MAX_TOKENS;
        int rows = o.measure_rows ? o.measure_rows : t / 2 < 256 ? t / 2 : 256;   /* 256: a slice's chunk at 4,096 */
        if (chain_calib_measure(o.model, t, rows, &calib, err, sizeof err)) {
            fprintf(stderr, CP ": --attn-rate measure: %s\n", err);
            return CLI_EXIT_FAIL;
        }
        o.attn_rate = calib.ratio;
        r.calib = &calib;
    }
    size_t H = 2 * (size_t)h.n_layer;
    double *kinds = malloc(sizeof(double) * CHAIN_KINDS * H), *cost = malloc(sizeof(double) * 2 * H);
    chain_plan p, cnt, flop;
    int rc = !kinds || !cost ? (snprintf(err, sizeof err, "out of memory"), -1)
                             : cp_plan(&o, &h, kinds, cost, &r, &p, &cnt, &flop, err, sizeof err);
    r.kinds = kinds;
    if (!rc) cp_print(&o, &r);
    free(kinds);
    free(cost);
    if (rc) { fprintf(stderr, CP ": %s\n", err); return CLI_EXIT_FAIL; }
    return CLI_EXIT_OK;
}
