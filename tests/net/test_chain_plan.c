/* test_chain_plan.c - the layer-split chain's planner (net/chain_plan.c):
 * the half-block costs against hand counts, the bounds against every
 * possible set of bounds (small models, random costs and rates), the two
 * issue shapes' 2-node splits equal to tools/bench_chain.sh's "cost" split
 * ((L - 1) / 2), unequal rates moving the bounds, the refusals, and
 * model_peek_hparams on a fixture and on hostile files. */
#include "t.h"

#include <math.h>
#include <unistd.h>

#include "engine/gguf.h"
#include "engine/model.h"
#include "net/chain_plan.h"
#include "net/chain_spec.h"
#include "net/wire_act.h"

static uint64_t rng_state = 0x2545F4914F6CDD1Dull;
static uint32_t rnd(void) { return t_rnd_u32(&rng_state); }

/* The Qwen3-0.6B shape and the Qwen3-30B-A3B one (tools/bench_chain.sh). */
static model_hparams shape_dense(int L) {
    model_hparams h = { .arch = ARCH_QWEN3, .arch_name = "qwen3", .n_vocab = 151936, .n_embd = 1024, .n_layer = L,
                        .n_head = 16, .n_head_kv = 8, .head_dim_k = 128, .head_dim_v = 128, .n_ff = 3072 };
    return h;
}
static model_hparams shape_moe(int L) {
    model_hparams h = { .arch = ARCH_QWEN3MOE, .arch_name = "qwen3moe", .n_vocab = 151936, .n_embd = 2048,
                        .n_layer = L, .n_head = 32, .n_head_kv = 4, .head_dim_k = 128, .head_dim_v = 128,
                        .n_expert = 128, .n_expert_used = 8, .n_ff_exp = 768 };
    return h;
}

/* ==== Costs ==== */

static void test_costs(void) {
    char err[300];
    model_hparams h = shape_dense(3);
    h.n_embd = 8; h.n_head = 2; h.n_head_kv = 1; h.head_dim_k = h.head_dim_v = 4; h.n_ff = 16; h.n_vocab = 10;
    double c[6];
    /* T = 5: qkv 2*5*8*(8+8) = 1280; attention 2*2*4*5*6 = 480; Wo 2*5*8*8 = 640; ffn 6*5*8*16 = 3840 */
    CHECK(chain_plan_costs(&h, 5, 0, c, err, sizeof err) == 0, "costs (%s)", err);
    CHECK(c[0] == 1280 + 480 + 640 + 40 && c[1] == 3840 && c[2] == 2400 && c[3] == 3840 && c[4] == 1280 && c[5] == 0,
          "dense costs by hand: %g %g %g %g %g %g", c[0], c[1], c[2], c[3], c[4], c[5]);
    CHECK(chain_plan_costs(&h, 5, 1, c, err, sizeof err) == 0 && c[4] == 2400 && c[5] == 3840 + 2 * 8 * 10,
          "a row of logits: the whole last block and the head (%g %g)", c[4], c[5]);
    h.n_expert = 4; h.n_expert_used = 2; h.n_ff_exp = 6;
    /* router 2*5*8*4 = 320; experts 6*5*8*6*2 = 2880 */
    CHECK(chain_plan_costs(&h, 5, 0, c, err, sizeof err) == 0 && c[1] == 320 + 2880 && c[3] == 3200,
          "MoE feed-forward by hand: %g", c[1]);
    CHECK(chain_plan_costs(&h, 0, 0, c, err, sizeof err) != 0 && strstr(err, "prompt tokens"), "0 tokens refused: %s", err);
    CHECK(chain_plan_costs(&h, 5, 6, c, err, sizeof err) != 0, "more logit rows than tokens refused");
    CHECK(chain_plan_costs(&h, CHAIN_PLAN_MAX_TOKENS + 1, 0, c, err, sizeof err) != 0, "2^24 + 1 tokens refused");
    h.n_layer = WIRE_LAYERS_MAX + 1;
    CHECK(chain_plan_costs(&h, 5, 0, c, err, sizeof err) != 0 && strstr(err, "shape"), "1,025 blocks refused: %s", err);
}

/* ==== Bounds ==== */

/* The least slowest time over every valid set of bounds, by enumeration:
 * node k's slice [a, b) with wire_layers_kv(a) < wire_layers_kv(b). */
static double brute(const double *cost, int H, int n, const double *rates, int k, int a, double sofar) {
    if (k == n) return a == H ? sofar : INFINITY;
    double best = INFINITY, f = 0;
    for (int b = a + 1; b <= H; b++) {
        f += cost[b - 1];
        if (wire_layers_kv(a) == wire_layers_kv(b)) continue;
        if (k == n - 1 && b != H) continue;
        double t = f / (rates ? rates[k] : 1.0), m = t > sofar ? t : sofar;
        double r = brute(cost, H, n, rates, k + 1, b, m);
        if (r < best) best = r;
    }
    return best;
}

static void test_exact(void) {
    char err[300];
    int bad = 0, bad_shape = 0, runs = 0;
    for (int t = 0; t < 400; t++) {
        int L = 1 + (int)(rnd() % 6), H = 2 * L, n = 1 + (int)(rnd() % L);
        double cost[12], rates[6];
        for (int k = 0; k < H; k++) cost[k] = rnd() % 4 == 0 ? 0 : (double)(rnd() % 1000);
        for (int k = 0; k < n; k++) rates[k] = 0.25 + (rnd() % 16) / 4.0;
        chain_plan p;
        if (chain_plan_solve(cost, H, n, t % 2 ? rates : NULL, &p, err, sizeof err)) { bad++; continue; }
        runs++;
        double want = brute(cost, H, n, t % 2 ? rates : NULL, 0, 0, 0);
        if (fabs(p.slowest - want) > 1e-9 * (want + 1)) bad++;
        /* the plan is a chain chain_spec_parse takes */
        char spec[2048];
        chain_spec sp;
        chain_plan_spec(&p, NULL, spec, sizeof spec);
        if (chain_spec_parse(spec, &sp, err, sizeof err) || sp.n != n || sp.hi[n - 1] != H) bad_shape++;
    }
    CHECK(runs == 400 && bad == 0, "the plan's slowest node equals the best of every bound set (%d of %d differ)", bad, runs);
    CHECK(bad_shape == 0, "every plan is a spec chain_spec_parse takes, ending at the last block (%d not)", bad_shape);
}

/* Two equal nodes: tools/bench_chain.sh's "cost" split, (L - 1) / 2 in
 * blocks (L - 1 half blocks), for every block count of both shapes. */
static void test_two_equal(void) {
    char err[300];
    int bad = 0, runs = 0;
    double cost[2 * 96];
    for (int L = 2; L <= 96; L++)
        for (int s = 0; s < 2; s++)
            for (int T = 128; T <= 16384; T *= 8) {
                model_hparams h = s ? shape_moe(L) : shape_dense(L);
                chain_plan p;
                runs++;
                if (chain_plan_costs(&h, T, 0, cost, err, sizeof err) ||
                    chain_plan_solve(cost, 2 * L, 2, NULL, &p, err, sizeof err) || p.hi[0] != L - 1) {
                    if (!bad) printf("  L %d %s T %d: split at half block %d, want %d\n", L, h.arch_name, T, p.hi[0], L - 1);
                    bad++;
                }
            }
    CHECK(runs > 0 && bad == 0, "2 equal nodes split at (L - 1) / 2 blocks, as bench_chain.sh's cost split (%d of %d not)",
          bad, runs);
    model_hparams h = shape_moe(8);
    chain_plan p, c;
    CHECK(chain_plan_costs(&h, 4097, 0, cost, err, sizeof err) == 0 &&
          chain_plan_solve(cost, 16, 2, NULL, &p, err, sizeof err) == 0 && p.hi[0] == 7 &&
          chain_plan_count(cost, 8, 2, NULL, &c) == 0 && c.hi[0] == 8 && c.slowest > p.slowest,
          "30B-A3B shape: 0:3.5 against the count split 0:4 (%.3fx)", c.slowest / p.slowest);
}

static void test_rates(void) {
    char err[300];
    model_hparams h = shape_dense(28);
    double cost[56], r12[2] = { 1, 2 }, r21[2] = { 2, 1 };
    chain_plan eq, a, b;
    CHECK(chain_plan_costs(&h, 4096, 0, cost, err, sizeof err) == 0 &&
          chain_plan_solve(cost, 56, 2, NULL, &eq, err, sizeof err) == 0 &&
          chain_plan_solve(cost, 56, 2, r12, &a, err, sizeof err) == 0 &&
          chain_plan_solve(cost, 56, 2, r21, &b, err, sizeof err) == 0, "plans (%s)", err);
    CHECK(a.hi[0] < eq.hi[0] && b.hi[0] > eq.hi[0] && a.flops[1] > 1.8 * a.flops[0] && b.flops[0] > 1.8 * b.flops[1],
          "a node twice as fast gets about twice the work (1,2: 0:%g; 2,1: 0:%g; equal: 0:%g)", a.hi[0] / 2.0,
          b.hi[0] / 2.0, eq.hi[0] / 2.0);
    CHECK(fabs(a.time[0] - a.time[1]) < 0.05 * a.slowest, "the two nodes' times within 5%% (%.4g, %.4g)", a.time[0],
          a.time[1]);
    chain_plan p;
    double bad_rates[2] = { 1, 0 }, nan_rates[2] = { 1, NAN };
    CHECK(chain_plan_solve(cost, 56, 2, bad_rates, &p, err, sizeof err) != 0 && strstr(err, "rate"), "rate 0 refused: %s", err);
    CHECK(chain_plan_solve(cost, 56, 2, nan_rates, &p, err, sizeof err) != 0, "rate NaN refused");
    CHECK(chain_plan_solve(cost, 56, 0, NULL, &p, err, sizeof err) != 0, "0 nodes refused");
    CHECK(chain_plan_solve(cost, 56, CHAIN_SPEC_MAX + 1, NULL, &p, err, sizeof err) != 0 && strstr(err, "at most 16"),
          "17 nodes refused: %s", err);
    CHECK(chain_plan_solve(cost, 6, 4, NULL, &p, err, sizeof err) != 0 && strstr(err, "attention"),
          "4 nodes for 3 blocks refused: %s", err);
    CHECK(chain_plan_solve(cost, 6, 3, NULL, &p, err, sizeof err) == 0 && p.hi[0] <= 2 && p.hi[1] <= 4,
          "3 nodes for 3 blocks: one attention each (0:%g,%g:%g)", p.hi[0] / 2.0, p.lo[1] / 2.0, p.hi[1] / 2.0);
    cost[3] = -1;
    CHECK(chain_plan_solve(cost, 56, 2, NULL, &p, err, sizeof err) != 0 && strstr(err, "cost"), "a negative cost refused: %s", err);
    char spec[400];
    const char *hosts[2] = { "10.0.0.1:7001", NULL };
    chain_plan_spec(&a, hosts, spec, sizeof spec);
    CHECK(!strncmp(spec, "10.0.0.1:7001/0:", 16) && strstr(spec, ",HOST2:PORT/"), "spec with a host and a placeholder: %s", spec);
    CHECK(chain_plan_spec(&a, hosts, spec, 8) > 8 && strlen(spec) == 7, "a short buffer cuts the spec (%s)", spec);
}

/* ==== Files ==== */

static void test_peek(void) {
    char path[512], err[600];
    model_hparams h;
    t_fixture_path(path, sizeof path, "models/qwen3moe-mini-Q4_K_M.gguf");
    if (t_need(path)) {
        CHECK(model_peek_hparams(path, &h, err, sizeof err) == 0 && h.n_layer == 4 && h.n_expert > 0 &&
              h.n_expert_used > 0 && h.n_vocab > 0, "a fixture's shape (%s): %d blocks, %d experts", err, h.n_layer,
              h.n_expert);
    }
    char tmp[] = "/tmp/test_chain_plan-XXXXXX";
    int fd = mkstemp(tmp);
    CHECK(fd >= 0, "temp file");
    if (fd < 0) return;
    CHECK(write(fd, "GGUF\3\0\0\0", 8) == 8, "write");
    close(fd);
    CHECK(model_peek_hparams(tmp, &h, err, sizeof err) != 0 && strstr(err, tmp), "a truncated GGUF refused: %s", err);
    gguf_writer *w = gguf_writer_new(0);
    CHECK(w && gguf_writer_add_str(w, "general.architecture", "qwen3") == 0 &&
          gguf_writer_add_u32(w, "qwen3.block_count", 5000) == 0 && gguf_writer_add_u32(w, "qwen3.embedding_length", 64) == 0 &&
          gguf_writer_add_u32(w, "qwen3.attention.head_count", 4) == 0 && gguf_writer_save(w, tmp, err, sizeof err) == 0,
          "a GGUF of 5,000 blocks written (%s)", err);
    gguf_writer_free(w);
    CHECK(model_peek_hparams(tmp, &h, err, sizeof err) != 0 && strstr(err, "block_count = 5000 is out of range"),
          "5,000 blocks refused by the loader's check: %s", err);
    w = gguf_writer_new(0);
    CHECK(w && gguf_writer_add_str(w, "general.architecture", "qwen3") == 0 &&
          gguf_writer_add_u32(w, "qwen3.block_count", 2) == 0 && gguf_writer_add_u32(w, "qwen3.embedding_length", 64) == 0 &&
          gguf_writer_add_u32(w, "qwen3.attention.head_count", 4) == 0 &&
          gguf_writer_add_u32(w, "qwen3.feed_forward_length", 128) == 0 && gguf_writer_save(w, tmp, err, sizeof err) == 0,
          "a GGUF without a vocabulary written (%s)", err);
    gguf_writer_free(w);
    CHECK(model_peek_hparams(tmp, &h, err, sizeof err) != 0 && strstr(err, "tokenizer.ggml.tokens"),
          "no vocabulary refused: %s", err);
    unlink(tmp);
}

int main(void) {
    test_costs();
    test_exact();
    test_two_equal();
    test_rates();
    test_peek();
    return t_done("test_chain_plan");
}
