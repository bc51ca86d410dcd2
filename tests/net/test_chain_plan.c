/* test_chain_plan.c - the layer-split chain's planner (net/chain_plan.c):
 * the half-block costs against hand counts, the bounds against every
 * possible set of bounds (small models, random costs and rates), the two
 * issue shapes' 2-node splits equal to tools/bench_chain.sh's "cost" split
 * ((L - 1) / 2), unequal rates moving the bounds, the refusals, and
 * model_peek_hparams on a fixture and on hostile files; the FLOPs by kind
 * (weight products, attention) and an attention rate R weighing them
 * (R = 1: today's plans; R < 1 against enumeration), and R measured on
 * the fixture models (net/chain_calib.c). */
#include "t.h"

#include <math.h>
#include <unistd.h>

#include "engine/gguf.h"
#include "engine/model.h"
#include "net/chain_calib.h"
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

/* ==== Kinds ==== */

static void test_kinds(void) {
    char err[300];
    model_hparams h = shape_dense(3);
    h.n_embd = 8; h.n_head = 2; h.n_head_kv = 1; h.head_dim_k = h.head_dim_v = 4; h.n_ff = 16; h.n_vocab = 10;
    double k[6 * CHAIN_KINDS], c[6], w[6];
    /* T = 5: qkv 1280, Wo 640, ffn 3840, embedding 40 (weight products);
     * scores and values 2*2*4*5*6 = 480 (attention); the last block Q/K/V only */
    static const double want[6][2] = { { 1280 + 640 + 40, 480 }, { 3840, 0 }, { 1920, 480 }, { 3840, 0 }, { 1280, 0 }, { 0, 0 } };
    CHECK(chain_plan_kinds(&h, 5, 0, k, err, sizeof err) == 0, "kinds (%s)", err);
    int bad = 0;
    for (int i = 0; i < 6; i++)
        bad += k[i * CHAIN_KINDS + CHAIN_KIND_MAT] != want[i][0] || k[i * CHAIN_KINDS + CHAIN_KIND_ATTN] != want[i][1];
    CHECK(bad == 0, "FLOPs by kind by hand (%d half blocks differ; first %g + %g)", bad, k[0], k[1]);
    CHECK(chain_plan_row_mat(&h) == (1280 + 640 + 3840) / 5.0, "a row's weight products: %g", chain_plan_row_mat(&h));
    /* rows 2..4 read 3, 4, 5 positions, 2 * 2 * 2 * 4 FLOPs each */
    CHECK(chain_plan_attn_span(&h, 0, 5) == 480 && chain_plan_attn_span(&h, 2, 3) == 32 * (3 + 4 + 5),
          "attention of a span of rows: %g, %g", chain_plan_attn_span(&h, 0, 5), chain_plan_attn_span(&h, 2, 3));
    CHECK(chain_plan_weigh(k, 6, 0.5, w, err, sizeof err) == 0 && w[0] == 1960 + 960 && w[1] == 3840 && w[2] == 1920 + 960 &&
          w[4] == 1280, "attention at half the rate costs twice: %g %g %g %g", w[0], w[1], w[2], w[4]);
    CHECK(chain_plan_costs(&h, 5, 0, c, err, sizeof err) == 0 && chain_plan_weigh(k, 6, 1, w, err, sizeof err) == 0 &&
          !memcmp(c, w, sizeof c), "rate 1 is the plain FLOP count");
    CHECK(chain_plan_kinds(&h, 5, 1, k, err, sizeof err) == 0 && k[4 * CHAIN_KINDS + CHAIN_KIND_ATTN] == 480 &&
          k[5 * CHAIN_KINDS + CHAIN_KIND_MAT] == 3840 + 2 * 8 * 10, "a row of logits: the last attention and the head");
    static const double hostile[] = { 0, -1, 1e-4, 1e4, NAN, INFINITY, -INFINITY };
    int refused = 0;
    for (size_t i = 0; i < sizeof hostile / sizeof hostile[0]; i++)
        refused += chain_plan_weigh(k, 6, hostile[i], w, err, sizeof err) != 0 && strstr(err, "attention rate") != NULL;
    CHECK(refused == 7, "attention rates 0, -1, 1e-4, 1e4, NaN, +-inf refused (%d of 7): %s", refused, err);
    CHECK(chain_plan_weigh(k, 6, CHAIN_PLAN_ATTN_RATE_MIN, w, err, sizeof err) == 0 &&
          chain_plan_weigh(k, 6, CHAIN_PLAN_ATTN_RATE_MAX, w, err, sizeof err) == 0, "the range's ends taken");
    CHECK(chain_plan_kinds(&h, 0, 0, k, err, sizeof err) != 0 && strstr(err, "prompt tokens"), "0 tokens refused: %s", err);
}

/* R = 1 gives today's costs bit for bit, so today's plans, for both
 * shapes at every block count, prompt length and node count tried. */
static void test_rate_one(void) {
    char err[300];
    int bad = 0, runs = 0;
    double k[2 * 96 * CHAIN_KINDS], c[2 * 96], w[2 * 96];
    for (int L = 2; L <= 96; L += 7)
        for (int s = 0; s < 2; s++)
            for (int T = 128; T <= 65536; T *= 8) {
                model_hparams h = s ? shape_moe(L) : shape_dense(L);
                if (chain_plan_costs(&h, T, 0, c, err, sizeof err) || chain_plan_kinds(&h, T, 0, k, err, sizeof err) ||
                    chain_plan_weigh(k, 2 * L, 1.0, w, err, sizeof err) || memcmp(c, w, sizeof(double) * 2 * L)) {
                    bad++;
                    continue;
                }
                for (int n = 2; n <= 5 && n <= L; n++) {
                    chain_plan a, b;
                    runs++;
                    if (chain_plan_solve(c, 2 * L, n, NULL, &a, err, sizeof err) ||
                        chain_plan_solve(w, 2 * L, n, NULL, &b, err, sizeof err) || memcmp(&a, &b, sizeof a))
                        bad++;
                }
            }
    CHECK(runs > 0 && bad == 0, "attention rate 1: the FLOP count's costs and plans (%d of %d differ)", bad, runs);
}

/* R < 1: the plan is still the best of every bound set (enumerated), and
 * it moves the way the weights say: a slice rich in attention gets less of
 * the model. */
static void test_rate_moves(void) {
    char err[300];
    int bad = 0, runs = 0;
    for (int t = 0; t < 300; t++) {
        int L = 1 + (int)(rnd() % 6), H = 2 * L, n = 1 + (int)(rnd() % L);
        double k[12 * CHAIN_KINDS], cost[12], rates[6], R = 0.1 + (rnd() % 90) / 100.0;
        for (int i = 0; i < H; i++) {
            k[i * CHAIN_KINDS + CHAIN_KIND_MAT] = (double)(rnd() % 1000);
            k[i * CHAIN_KINDS + CHAIN_KIND_ATTN] = i % 2 ? 0 : (double)(rnd() % 1000);
        }
        for (int i = 0; i < n; i++) rates[i] = 0.25 + (rnd() % 16) / 4.0;
        chain_plan p;
        if (chain_plan_weigh(k, H, R, cost, err, sizeof err) ||
            chain_plan_solve(cost, H, n, t % 2 ? rates : NULL, &p, err, sizeof err)) { bad++; continue; }
        runs++;
        double want = brute(cost, H, n, t % 2 ? rates : NULL, 0, 0, 0);
        if (fabs(p.slowest - want) > 1e-9 * (want + 1)) bad++;
    }
    CHECK(runs == 300 && bad == 0, "rated plans equal the best of every bound set (%d of %d differ)", bad, runs);
    /* the 30B-A3B shape, a fast second node (rates 1, 2), 4,096 tokens:
     * the FLOP count gives the slow first node 0:2.5 (three attentions,
     * two feed-forwards); at R = 0.345 (measured here) an attention half
     * costs more than a MoE one, and the slow node hands one over: 0:2 */
    model_hparams h = shape_moe(8);
    double k[16 * CHAIN_KINDS], c1[16], cr[16], r12[2] = { 1, 2 };
    chain_plan p1, pr;
    CHECK(chain_plan_kinds(&h, 4096, 0, k, err, sizeof err) == 0 && chain_plan_weigh(k, 16, 1, c1, err, sizeof err) == 0 &&
          chain_plan_weigh(k, 16, 0.345, cr, err, sizeof err) == 0 &&
          chain_plan_solve(c1, 16, 2, r12, &p1, err, sizeof err) == 0 &&
          chain_plan_solve(cr, 16, 2, r12, &pr, err, sizeof err) == 0 && p1.hi[0] == 5 && pr.hi[0] == 4,
          "30B-A3B shape, rates 1,2: 0:%g by FLOPs, 0:%g at R 0.345 (want 0:2.5, 0:2)", p1.hi[0] / 2.0, pr.hi[0] / 2.0);
    /* over R from 1 down, the slow node's bound never moves later */
    int later = 0, prev = 16;
    for (double R = 1; R > 0.05; R *= 0.8) {
        chain_plan p;
        if (chain_plan_weigh(k, 16, R, cr, err, sizeof err) || chain_plan_solve(cr, 16, 2, r12, &p, err, sizeof err) ||
            p.hi[0] > prev)
            later++;
        prev = p.hi[0];
    }
    CHECK(later == 0 && prev <= pr.hi[0], "lower rates move the bound earlier, never later (%d later; 0:%g at R 0.05)",
          later, prev / 2.0);
}

/* ==== Measured ==== */

static void test_calib(void) {
    char path[512], err[600];
    static const char *const models[] = { "models/qwen3-mini-Q8_0.gguf", "models/qwen3moe-mini-Q4_K_M.gguf" };
    for (int i = 0; i < 2; i++) {
        t_fixture_path(path, sizeof path, models[i]);
        if (!t_need(path)) continue;
        chain_calib c;
        int rc = chain_calib_measure(path, 4096, 128, &c, err, sizeof err);
        CHECK(rc == 0 && isfinite(c.ratio) && c.ratio > 0 && c.mat_rate > 0 && c.attn_rate > 0 && c.t_late > c.t_early &&
              c.tokens == 4096 && c.rows == 128, "%s measured: R %g (%g, %g GFLOP/s; %s)", models[i], c.ratio,
              c.mat_rate / 1e9, c.attn_rate / 1e9, rc ? err : "");
        CHECK(chain_calib_measure(path, 1 << 20, 128, &c, err, sizeof err) == 0 && c.tokens == CHAIN_CALIB_MAX_TOKENS,
              "a 2^20-token plan measured at %d tokens (%s)", c.tokens, err);
        CHECK(chain_calib_measure(path, 4096, 8, &c, err, sizeof err) != 0 && strstr(err, "rows"), "8 rows refused: %s", err);
        CHECK(chain_calib_measure(path, 100, 64, &c, err, sizeof err) != 0 && strstr(err, "half the tokens"),
              "64 rows of 100 tokens refused: %s", err);
    }
    char tmp[] = "/tmp/test_chain_plan-XXXXXX";
    int fd = mkstemp(tmp);
    CHECK(fd >= 0 && write(fd, "GGUF\3\0\0\0", 8) == 8, "temp file");
    if (fd >= 0) close(fd);
    chain_calib c;
    CHECK(chain_calib_measure(tmp, 4096, 128, &c, err, sizeof err) != 0 && strstr(err, tmp), "a truncated GGUF refused: %s", err);
    unlink(tmp);
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
    test_kinds();
    test_rate_one();
    test_rate_moves();
    test_calib();
    test_peek();
    return t_done("test_chain_plan");
}
