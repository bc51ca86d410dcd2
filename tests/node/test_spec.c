/* test_spec.c - speculative decoding (issue 42).
 *
 * In process, on the scheduler with real fixture models:
 *   - prompt lookup finds the longest recurring n-gram's continuation; the
 *     adaptive draft length falls to 0 when drafts are rejected and rises
 *     when they are kept;
 *   - greedy: the same tokens with and without drafts (prompt lookup, the
 *     F16 copy of stories260K as draft model, a deliberately poor random
 *     draft model), and the slot's cache afterwards holds exactly the
 *     positions plain decoding leaves (prompt + generated - 1), bit for bit
 *     the same rows: no rejected draft's row is kept;
 *   - sampling (temperature, top-k/p, min-p, penalties, logit bias): with
 *     the same seed, the same tokens with the poor draft and with lookup as
 *     without drafts; and a chi-square two-sample test on the distribution
 *     of one position over many seeds (plain on one set of seeds, drafts on
 *     another) does not reject equality;
 *   - a job cancelled while it drafts: the next job on that slot is exact.
 * With real processes (tandem serve), every golden model: the same tokens
 * with and without each draft source, each prompt alone and 8 at once;
 * through a prefill node (split) with prompt lookup.
 */
#include "proc.h"

#include <math.h>
#include <pthread.h>

#include "engine/model.h"
#include "engine/spec.h"
#include "engine/spec_sample.h"
#include "node/draft.h"
#include "node/scheduler.h"

#define MAX_GEN 160

/* ==== Units ==== */

static void test_lookup_units(void) {
    int32_t h[] = { 1, 2, 3, 4, 5, 9, 9, 1, 2, 3 }, out[16];
    int n = spec_lookup(h, 10, 4, out);
    CHECK(n == 4 && out[0] == 4 && out[1] == 5 && out[2] == 9 && out[3] == 9, "lookup: 3-gram continuation (%d)", n);
    int32_t h2[] = { 7, 8, 1, 2, 9, 1, 2, 5, 6, 3, 1, 2 };
    n = spec_lookup(h2, 12, 2, out);
    CHECK(n == 2 && out[0] == 5 && out[1] == 6, "lookup: the most recent occurrence (%d: %d %d)", n, out[0], out[1]);
    int32_t h3[] = { 1, 2, 3, 4, 5, 6 };
    CHECK(spec_lookup(h3, 6, 4, out) == 0, "lookup: nothing recurs");
    int32_t h4[] = { 4, 4, 4, 4 };
    n = spec_lookup(h4, 4, 8, out);
    CHECK(n >= 1 && n <= 2 && out[0] == 4, "lookup: continuation bounded by the history (%d)", n);

    spec_adapt a;
    spec_adapt_init(&a);
    int k0 = spec_adapt_k(&a, 8, 0.06);
    CHECK(k0 >= 1, "adapt: an unknown sequence drafts (k %d)", k0);
    for (int i = 0; i < 30; i++) spec_adapt_update(&a, 4, 0, 1);
    int zero = 0;
    for (int i = 0; i < 16; i++) zero += spec_adapt_k(&a, 8, 0.06) == 0;
    CHECK(zero >= 14, "adapt: rejected drafts turn drafting off (%d of 16 steps without)", zero);
    for (int i = 0; i < 40; i++) spec_adapt_update(&a, 8, 8, 9);
    CHECK(spec_adapt_k(&a, 8, 0.06) == 8, "adapt: kept drafts bring k back to its maximum");
    CHECK(spec_adapt_k(&a, 8, 0.0) == 8, "adapt: cost 0 asks for the maximum");

    spec_cost c;
    spec_cost_init(&c);
    CHECK(spec_cost_row(&c, 1, 0.3) == 0.3, "cost: the prior before any pass");
    for (int i = 0; i < 20; i++) spec_cost_add(&c, 4, 14.0);
    CHECK(spec_cost_row(&c, 1, 0.3) == 0.3, "cost: the prior while the rows do not vary");
    for (int i = 0; i < 200; i++) spec_cost_add(&c, 1 + i % 9, 10.0 + (1 + i % 9));
    double c1 = spec_cost_row(&c, 1, 0.3), c8 = spec_cost_row(&c, 8, 0.3);
    CHECK(fabs(c1 - 1.0 / 11.0) < 1e-3 && fabs(c8 - 1.0 / (10.0 / 8 + 1)) < 1e-3,
          "cost: t = 10 + rows gives c %.4f alone (want %.4f), %.4f beside 7 others (want %.4f)", c1, 1.0 / 11, c8,
          1.0 / 2.25);
}

/* ==== In process: the scheduler ==== */

typedef struct {
    int32_t tok[MAX_GEN];
    int n, drafted, accepted;
} gen_out;

static int sched_gen(sched *sc, const int32_t *prompt, int np, int max_tokens, const sampler_params *sp, gen_out *o) {
    sched_req r;
    memset(&r, 0, sizeof r);
    r.prompt = malloc(sizeof(int32_t) * (size_t)np);
    memcpy(r.prompt, prompt, sizeof(int32_t) * (size_t)np);
    r.n_prompt = np;
    r.max_tokens = max_tokens;
    r.ignore_eos = 1;
    r.sp = *sp;
    sched_job *j;
    if (sched_submit(sc, &r, &j)) return -1;
    const sched_view *v = NULL;
    int have = 0;
    for (;;) {
        v = sched_wait(sc, j, have, 10000);
        have = v->n_gen;
        if (v->state == SJ_DONE) break;
    }
    o->n = v->n_gen < MAX_GEN ? v->n_gen : MAX_GEN;
    memcpy(o->tok, v->gen, sizeof(int32_t) * (size_t)o->n);
    o->drafted = v->drafted;
    o->accepted = v->accepted;
    int ok = !strcmp(v->finish ? v->finish : "", "length");
    sched_release(sc, j);
    return ok ? 0 : -1;
}

/* 1 when the two sessions hold the same positions with the same bytes. */
static int same_cache(session *a, session *b) {
    kvcache *ka = session_kv(a), *kb = session_kv(b);
    int n = kv_used(ka);
    if (n != kv_used(kb)) return 0;
    size_t bytes = kv_row_bytes(ka) * (size_t)n;
    uint8_t *x = malloc(2 * bytes + 2), *y = malloc(2 * bytes + 2);
    char err[128];
    int same = x && y;
    for (int l = 0; same && l < kv_n_layer(ka); l++) {
        kv_read_span(ka, l, 0, n, x, x + bytes, err, sizeof err);
        kv_read_span(kb, l, 0, n, y, y + bytes, err, sizeof err);
        same = !memcmp(x, y, 2 * bytes);
    }
    free(x);
    free(y);
    return same;
}

static sched *new_sched_budget(model *m, draft_src *d, int slots, int prefill_budget) {
    sched_opts so = { .n_slots = slots, .queue_max = 16, .n_ctx = 512, .kv_dtype = kv_dtype_parse("f16"),
                      .prefill_budget = prefill_budget, .min_reuse = 1 << 20, .draft = d };
    sched *sc = NULL;
    char err[256];
    if (sched_create(&sc, m, &so, err, sizeof err)) fprintf(stderr, "sched_create: %s\n", err);
    return sc;
}

static sched *new_sched(model *m, draft_src *d, int slots) { return new_sched_budget(m, d, slots, 256); }

static draft_src *new_draft(model *m, int lookup, model *dm, int fixed, int slots) {
    draft_opts o = { .lookup = lookup, .dm = dm, .draft_max = 6, .n_slots = slots, .n_ctx = 512,
                     .kv_dtype = kv_dtype_parse("f16"), .fixed = fixed };
    draft_src *d = NULL;
    char err[256];
    if (draft_create(&d, m, &o, err, sizeof err)) fprintf(stderr, "draft_create: %s\n", err);
    return d;
}

static int encode(model *m, const char *text, int32_t *ids, int cap) {
    int64_t n = tokenizer_encode(model_get_tokenizer(m), text, strlen(text), 1, 0, ids, cap);
    return n > cap ? cap : (int)n;
}

static const char *const STORY =
    "Once upon a time, there was a little girl named Lily. She liked to play with her ball. "
    "One day, Lily went to the park with her mom. Once upon a time, there was a little girl named Lily.";

/* Greedy identity and the cache's rows, one draft source at a time. */
static void test_greedy_cache(model *m, const char *name, draft_src *d, const int32_t *ids, int np) {
    sched *plain = new_sched(m, NULL, 1), *spec = new_sched(m, d, 1);
    CHECK(plain && spec, "%s: schedulers", name);
    if (!plain || !spec) { sched_destroy(plain); sched_destroy(spec); return; }
    sampler_params sp = sampler_defaults();
    gen_out a, b;
    int ra = sched_gen(plain, ids, np, 150, &sp, &a), rb = sched_gen(spec, ids, np, 150, &sp, &b);
    CHECK(ra == 0 && rb == 0 && a.n == 150 && b.n == 150, "%s: generations (%d %d, %d %d tokens)", name, ra, rb, a.n, b.n);
    CHECK(!memcmp(a.tok, b.tok, sizeof(int32_t) * 150), "%s: greedy tokens differ with drafts", name);
    CHECK(b.drafted > 0, "%s: nothing was drafted", name);
    session *sa = sched_slot_session(plain, 0), *sb = sched_slot_session(spec, 0);
    int ua = kv_used(session_kv(sa)), ub = kv_used(session_kv(sb));
    CHECK(ua == np + 149 && ub == np + 149, "%s: cache holds %d / %d positions (want %d)", name, ua, ub, np + 149);
    CHECK(same_cache(sa, sb), "%s: cache rows differ from plain decoding's", name);
    printf("%s: 150 greedy tokens equal; %d drafted, %d accepted; cache %d positions, rows equal\n", name, b.drafted,
           b.accepted, ub);
    sched_destroy(plain);
    sched_destroy(spec);
}

/* The adaptive draft length turns drafts off where they do not pay: a draft
 * model that is never right (the poor one), a draft as costly as the target
 * (a second copy of the target: a step of k drafts costs more than the k
 * tokens it can save, even when every draft is right). Drafts stay at the
 * probes' rate: one every 8 steps or less. The F16 copy (half the target's
 * bytes, always right) starts at the probes' rate too, and each probe after
 * its stretch without drafts is caught up and verified in its step (with a
 * fixed catch-up of 30 draft rows, a probe after a longer stretch was fed a
 * chunk and drafted nothing: a draft that pays was not found out). (Prompt lookup on text with
 * nothing to copy finds no n-gram and proposes nothing: test_lookup_units.) */
static void test_adaptive_off(model *m, model *poor, model *self, model *f16, const int32_t *ids, int np) {
    struct { const char *name; model *dm; } cs[] = { { "poor draft", poor }, { "the target's copy", self },
                                                     { "F16 draft", f16 } };
    for (int c = 0; c < 3; c++) {
        draft_src *d = new_draft(m, 0, cs[c].dm, 0, 1);
        sched *spec = d ? new_sched(m, d, 1) : NULL;
        gen_out b;
        sampler_params sp = sampler_defaults();
        int ok = spec && !sched_gen(spec, ids, np, 150, &sp, &b);
        CHECK(ok, "adaptive off, %s: generation", cs[c].name);
        /* the prior's first steps, then a probe every 8 steps at most */
        if (c < 2)
            CHECK(!ok || b.drafted <= 150 / 8 + 8, "adaptive off, %s: %d drafts in 150 tokens (%d kept)", cs[c].name,
                  b.drafted, b.accepted);
        else
            CHECK(!ok || (b.drafted > 0 && b.accepted == b.drafted), "adaptive, %s: %d drafts in 150 tokens (%d kept)",
                  cs[c].name, b.drafted, b.accepted);
        if (ok) printf("adaptive, %s: %d drafted, %d accepted in 150 tokens\n", cs[c].name, b.drafted, b.accepted);
        sched_destroy(spec);
        draft_free(d);
    }
}

/* Same seed, same tokens, under every sampling control: as plain decoding
 * (point-mass drafts: lookup), or (sampled drafts from a draft model, at a
 * fixed draft length) as the same run again. */
static void test_sampling_identity(model *m, const char *name, draft_src *d, const int32_t *ids, int np, int sampled) {
    sched *plain = sampled ? new_sched(m, d, 1) : new_sched(m, NULL, 1), *spec = new_sched(m, d, 1);
    if (!plain || !spec) { CHECK(0, "%s: schedulers", name); sched_destroy(plain); sched_destroy(spec); return; }
    sampler_bias bias[] = { { 13, 2.0f }, { 300, -INFINITY } };
    int same = 0, runs = 0, drafted = 0, accepted = 0;
    for (int cfg = 0; cfg < 4; cfg++) {
        for (int seed = 1; seed <= 5; seed++) {
            sampler_params sp = sampler_defaults();
            sp.temp = cfg == 3 ? 0.3f : 0.9f;
            sp.seed = (uint64_t)(seed * 7919 + cfg);
            if (cfg == 1) { sp.top_k = 40; sp.top_p = 0.9f; sp.min_p = 0.02f; }
            if (cfg == 2) { sp.presence_penalty = 0.5f; sp.frequency_penalty = 0.3f; sp.repeat_penalty = 1.2f; }
            if (cfg == 3) { sp.bias = bias; sp.n_bias = 2; }
            gen_out a, b;
            int ok = !sched_gen(plain, ids, np, 60, &sp, &a) && !sched_gen(spec, ids, np, 60, &sp, &b);
            runs++;
            same += ok && a.n == b.n && !memcmp(a.tok, b.tok, sizeof(int32_t) * (size_t)a.n);
            drafted += b.drafted;
            accepted += b.accepted;
        }
    }
    CHECK(same == runs, "%s: %d of %d seeded samplings equal %s", name, same, runs,
          sampled ? "when run again" : "with drafts");
    CHECK(drafted > 0, "%s: sampling drafted nothing", name);
    printf("%s: %d/%d seeded samplings equal %s; %d drafted, %d accepted\n", name, same, runs,
           sampled ? "when run again" : "plain decoding's", drafted, accepted);
    sched_destroy(plain);
    sched_destroy(spec);
}

/* Upper 0.1% point of chi-square with df degrees (Wilson-Hilferty). */
static double chi2_crit(int df) {
    double z = 3.090, a = 2.0 / (9.0 * df), c = 1 - a + z * sqrt(a);
    return df * c * c * c;
}

/* Two-sample chi-square of counts a and b over V tokens: categories with at
 * least 10 in both together, the rest pooled. *df receives the degrees. */
static double chi2_two(const int *ca, const int *cb, int V, int *df) {
    double stat = 0;
    int cats = 0, ra = 0, rb = 0;
    for (int t = 0; t < V; t++) {
        int s = ca[t] + cb[t];
        if (s == 0) continue;
        if (s < 10) { ra += ca[t]; rb += cb[t]; continue; }
        stat += (double)(ca[t] - cb[t]) * (ca[t] - cb[t]) / s;
        cats++;
    }
    if (ra + rb > 0) { stat += (double)(ra - rb) * (ra - rb) / (ra + rb); cats++; }
    *df = cats - 1;
    return stat;
}

/* Goodness of fit of counts (n draws) to the law p over V tokens: cells
 * expecting fewer than 5 pooled. */
static double chi2_fit(const int *c, const float *p, int V, int n, int *df) {
    double stat = 0, pe = 0;
    int cats = 0, pc = 0;
    for (int t = 0; t < V; t++) {
        double e = (double)p[t] * n;
        if (e < 5) { pe += e; pc += c[t]; continue; }
        stat += (c[t] - e) * (c[t] - e) / e;
        cats++;
    }
    if (pe > 0) { stat += (pc - pe) * (pc - pe) / pe; cats++; }
    else if (pc > 0) stat += 1e9;   /* draws where p has no mass */
    *df = cats - 1;
    return stat;
}

/* The rule on one row (engine/spec_sample.h), against the exact target law:
 * the target's logits after the story, drafts drawn from q, verified: the
 * tokens' counts fit p; the drafts themselves ("accept always") and a
 * rejection that draws from p instead of the residual do not (the test can
 * fail). q: the poor draft model's logits at temperature 2 (a random model:
 * it overlaps p only when both are flat), then a closer draft (the target's
 * logits with the poor model's added at half weight) under top-k, top-p and
 * a repetition penalty at temperature 0.8. */
static void test_rule_units(model *m, model *poor, const int32_t *ids, int np) {
    enum { N = 20000 };
    int V = model_get_hparams(m)->n_vocab;
    session *st = NULL, *sd = NULL;
    char err[256];
    float *lt = malloc(sizeof(float) * (size_t)V), *ld = malloc(sizeof(float) * (size_t)V);
    float *p = malloc(sizeof(float) * (size_t)V), *q = malloc(sizeof(float) * (size_t)V);
    float *scratch = malloc(sizeof(float) * (size_t)V);
    int *good = calloc((size_t)V, sizeof(int)), *always = calloc((size_t)V, sizeof(int)), *fromp = calloc((size_t)V, sizeof(int));
    int ok = lt && ld && p && q && scratch && good && always && fromp &&
             !session_new(&st, m, 512, kv_dtype_parse("f16"), err, sizeof err) &&
             !session_new(&sd, poor, 512, kv_dtype_parse("f16"), err, sizeof err) &&
             !model_eval(m, st, ids, np, lt, NULL, NULL, err, sizeof err) &&
             !model_eval(poor, sd, ids, np, ld, NULL, NULL, err, sizeof err);
    CHECK(ok, "rule: set-up: %s", err);
    for (int cfg = 0; ok && cfg < 2; cfg++) {
        if (cfg == 1)
            for (int t = 0; t < V; t++) ld[t] = lt[t] + 0.5f * ld[t];
        memset(good, 0, sizeof(int) * (size_t)V);
        memset(always, 0, sizeof(int) * (size_t)V);
        memset(fromp, 0, sizeof(int) * (size_t)V);
        sampler_params sp = sampler_defaults();
        sp.temp = cfg ? 0.8f : 2.0f;
        if (!cfg) { sp.top_k = 0; sp.top_p = 1.0f; sp.min_p = 0.0f; }
        else { sp.top_k = 30; sp.top_p = 0.95f; sp.min_p = 0.0f; sp.repeat_penalty = 1.3f; }
        int acc = 0;
        for (int i = 0; i < N; i++) {
            sp.seed = (uint64_t)(i + 1);
            sampler *s = sampler_new(&sp, V), *w = sampler_new(&sp, V);
            sp.seed = (uint64_t)(i + 1) ^ 0x6a09e667f3bcc908ULL;   /* the draft's own stream */
            sampler *ds = sampler_new(&sp, V);
            for (int k = np > 64 ? np - 64 : 0; k < np; k++) {
                sampler_accept(s, ids[k], 0);
                sampler_accept(ds, ids[k], 0);
                sampler_accept(w, ids[k], 0);
            }
            int32_t x = spec_draft_sample(ds, ld, q);
            int32_t t = spec_verify_sample(s, lt, x, q, scratch);
            good[t]++;
            always[x]++;
            acc += t == x;
            /* the wrong residual: on rejection, a fresh draw from p */
            sampler_probs(w, lt, p);
            double u = sampler_unit(w);
            fromp[u * q[x] < p[x] ? x : sampler_draw(w, p)]++;
            sampler_free(s);
            sampler_free(ds);
            sampler_free(w);
        }
        sampler *s = sampler_new(&sp, V);
        for (int k = np > 64 ? np - 64 : 0; k < np; k++) sampler_accept(s, ids[k], 0);
        sampler_probs(s, lt, p);
        sampler_free(s);
        int dg, da, dp;
        double xg = chi2_fit(good, p, V, N, &dg), xa = chi2_fit(always, p, V, N, &da), xp = chi2_fit(fromp, p, V, N, &dp);
        CHECK(dg >= 3 && xg < chi2_crit(dg), "rule %d: verified tokens %.1f over %d df (0.1%% point %.1f): not p", cfg,
              xg, dg, chi2_crit(dg));
        CHECK(da >= 1 && xa > chi2_crit(da), "rule %d: accept-always fits p (%.1f over %d df): the test has no power", cfg,
              xa, da);
        CHECK(dp >= 1 && xp > chi2_crit(dp), "rule %d: residual-from-p fits p (%.1f over %d df): the test has no power",
              cfg, xp, dp);
        CHECK(acc > N / 20 && acc < N - N / 20, "rule %d: %d of %d drafts accepted (not a partial draft)", cfg, acc, N);
        printf("rule %d (%d draws, %d accepted): verified %.1f / %d df (0.1%% point %.1f); accept-always %.0f / %d; "
               "residual-from-p %.0f / %d\n", cfg, N, acc, xg, dg, chi2_crit(dg), xa, da, xp, dp);
    }
    session_free(st);
    session_free(sd);
    free(lt); free(ld); free(p); free(q); free(scratch); free(good); free(always); free(fromp);
}

/* The distribution of tokens 1-3 over N seeds at temperature 2 (where the
 * random draft overlaps the target): plain (seeds 1..N) vs a poor draft
 * model's sampled drafts on every step (seeds N+1..2N; 4 tokens: the step
 * after the first token verifies 2 drafts, token 3 is its bonus row or a
 * later step's). And the power check: the poor model decoding plainly
 * itself (what accepting every draft would give at token 1) differs. */
static void test_chi_square(model *m, model *poor, const int32_t *ids, int np) {
    enum { N = 600, NPOS = 3 };
    draft_src *d = new_draft(m, 0, poor, 1, 1);
    sched *plain = new_sched(m, NULL, 1), *spec = new_sched(m, d, 1), *qs = new_sched(poor, NULL, 1);
    int V = model_get_hparams(m)->n_vocab;
    int *ca = calloc((size_t)V * NPOS, sizeof(int)), *cb = calloc((size_t)V * NPOS, sizeof(int));
    int *cq = calloc((size_t)V, sizeof(int));
    int ok = plain && spec && qs && ca && cb && cq, drafted = 0, accepted = 0;
    for (int i = 0; ok && i < N; i++) {
        sampler_params sp = sampler_defaults();
        sp.temp = 2.0f;
        sp.top_k = 0;
        sp.top_p = 1.0f;
        sp.min_p = 0.0f;
        gen_out a, b, c;
        sp.seed = (uint64_t)(1 + i);
        ok = !sched_gen(plain, ids, np, NPOS + 1, &sp, &a);
        sp.seed = (uint64_t)(N + 1 + i);
        ok = ok && !sched_gen(spec, ids, np, NPOS + 1, &sp, &b) && !sched_gen(qs, ids, np, 2, &sp, &c);
        if (!ok) break;
        for (int k = 0; k < NPOS; k++) {
            ca[k * V + a.tok[k + 1]]++;
            cb[k * V + b.tok[k + 1]]++;
        }
        cq[c.tok[1]]++;
        drafted += b.drafted;
        accepted += b.accepted;
    }
    CHECK(ok, "chi-square: generations failed");
    for (int k = 0; ok && k < NPOS; k++) {
        int df;
        double stat = chi2_two(ca + k * V, cb + k * V, V, &df);
        CHECK(df >= 3, "chi-square: token %d: %d df (too few to test)", k + 1, df);
        CHECK(df < 1 || stat < chi2_crit(df), "chi-square: token %d: %.1f over %d df (0.1%% point %.1f): distributions differ",
              k + 1, stat, df, df >= 1 ? chi2_crit(df) : 0.0);
        printf("chi-square token %d (%d seeds each, sampled poor drafts: %d of %d kept): %.1f over %d df, 0.1%% point %.1f\n",
               k + 1, N, accepted, drafted, stat, df, df >= 1 ? chi2_crit(df) : 0.0);
    }
    int dq;
    double sq = chi2_two(ca, cq, V, &dq);
    CHECK(ok && dq >= 1 && sq > chi2_crit(dq), "chi-square: the poor draft's own law passes as the target's (%.1f over %d df)",
          sq, dq);
    printf("chi-square power: token 1 of the poor draft decoding alone vs plain: %.1f over %d df\n", sq, dq);
    CHECK(drafted > 0 && accepted > 0 && accepted < drafted, "chi-square: drafts not exercised (%d of %d kept)",
          accepted, drafted);
    free(ca);
    free(cb);
    free(cq);
    sched_destroy(plain);
    sched_destroy(spec);
    sched_destroy(qs);
    draft_free(d);
}

/* Catch-up in chunks: a long prompt (the story three times) decoded with a
 * draft model asked on every step, beside a stream already decoding, with
 * a prefill budget of CATCHUP_BUDGET target rows per step: the draft model
 * is fed at most that budget's worth of its rows for one slot in one step
 * (F16 costs about half the F32 target: under 2 x the budget; its whole
 * prompt at once before chunking), more than the budget in rows (the
 * draft's lower cost counts: a fixed 16 target rows, 30 of its rows, before
 * the budget followed the target's), both streams' greedy tokens equal
 * plain decoding's, and drafts start once the slot has caught up. */
#define CATCHUP_BUDGET 32
static void test_catchup(model *m, model *dm, const int32_t *ids, int np) {
    int32_t big[768];
    int nb = 0;
    for (int r = 0; r < 3; r++)
        for (int i = r ? 1 : 0; i < np && nb < 768; i++) big[nb++] = ids[i];   /* one BOS */
    draft_src *d = new_draft(m, 0, dm, 1, 2);
    sched *plain = new_sched_budget(m, NULL, 1, CATCHUP_BUDGET), *spec = new_sched_budget(m, d, 2, CATCHUP_BUDGET);
    if (!plain || !spec || !d) { CHECK(0, "catch-up: set-up"); goto out; }
    sampler_params sp = sampler_defaults();
    gen_out a, b;
    /* another stream first, so the long prompt arrives beside a decoding one */
    sched_req r;
    memset(&r, 0, sizeof r);
    r.prompt = malloc(sizeof(int32_t) * (size_t)np);
    memcpy(r.prompt, ids, sizeof(int32_t) * (size_t)np);
    r.n_prompt = np;
    r.max_tokens = 100;
    r.ignore_eos = 1;
    r.sp = sp;
    sched_job *other;
    int ok = !sched_submit(spec, &r, &other);
    if (ok) sched_wait(spec, other, 5, 10000);
    ok = ok && !sched_gen(plain, big, nb, 60, &sp, &a) && !sched_gen(spec, big, nb, 60, &sp, &b);
    if (ok) sched_release(spec, other);
    CHECK(ok && a.n == b.n && !memcmp(a.tok, b.tok, sizeof(int32_t) * (size_t)a.n),
          "catch-up: greedy tokens differ from plain decoding's");
    CHECK(b.drafted > 0, "catch-up: the long prompt's slot never drafted");
    int fed = draft_max_fed(d);
    CHECK(fed > CATCHUP_BUDGET && fed < 2 * CATCHUP_BUDGET && fed < nb / 2,
          "catch-up: the draft model was fed %d rows for one slot in one step (prompt %d, budget %d target rows)", fed,
          nb, CATCHUP_BUDGET);
    printf("catch-up: prompt %d tokens, at most %d draft rows per slot per step; %d drafted, %d accepted\n", nb, fed,
           b.drafted, b.accepted);
out:
    sched_destroy(plain);
    sched_destroy(spec);
    draft_free(d);
}

/* A job released while its steps draft: the next job on the slot is exact. */
static void test_cancel(model *m, model *dm, const int32_t *ids, int np) {
    draft_src *d = new_draft(m, 4, dm, 1, 1);
    sched *plain = new_sched(m, NULL, 1), *spec = new_sched(m, d, 1);
    if (!plain || !spec || !d) { CHECK(0, "cancel: set-up"); goto out; }
    sampler_params sp = sampler_defaults();
    int exact = 0;
    for (int round = 0; round < 5; round++) {
        sched_req r;
        memset(&r, 0, sizeof r);
        r.prompt = malloc(sizeof(int32_t) * (size_t)np);
        memcpy(r.prompt, ids, sizeof(int32_t) * (size_t)np);
        r.prompt[np - 1] = (int32_t)(20 + round);
        r.n_prompt = np;
        r.max_tokens = 120;
        r.ignore_eos = 1;
        r.sp = sp;
        sched_job *j;
        if (sched_submit(spec, &r, &j)) continue;
        sched_wait(spec, j, 3 + round, 10000);
        sched_release(spec, j);   /* cancelled mid-stream: its drafts may be in flight */
        gen_out a, b;
        int32_t other[64];
        int no = np < 60 ? np : 60;
        for (int i = 0; i < no; i++) other[i] = ids[(i * 7 + round) % np];
        if (!sched_gen(plain, other, no, 40, &sp, &a) && !sched_gen(spec, other, no, 40, &sp, &b))
            exact += a.n == b.n && !memcmp(a.tok, b.tok, sizeof(int32_t) * (size_t)a.n);
    }
    CHECK(exact == 5, "cancel: %d of 5 jobs after a cancelled one exact", exact);
out:
    sched_destroy(plain);
    sched_destroy(spec);
    draft_free(d);
}

static void test_in_process(const char *dir) {
    char path[1024], fpath[1024], poor[1024];
    t_fixture_path(path, sizeof path, "models/stories260K.gguf");
    t_fixture_path(fpath, sizeof fpath, "models/stories260K-F16.gguf");
    if (!t_need(path) || !t_need(fpath)) return;
    snprintf(poor, sizeof poor, "%s/poor.gguf", dir);
    char *gen[] = { (char *)bin(), "gen-model", "--arch", "llama", "--vocab-from", path, "--n-embd", "32", "--n-layer", "1",
                    "--n-head", "2", "--n-head-kv", "1", "--n-ff", "64", "--type", "f32", "--seed", "5", "-o", poor, "-q",
                    NULL };
    char *o = run_capture(gen);
    CHECK(o != NULL, "gen-model of the poor draft failed");
    free(o);
    model_opts mo = { .n_threads = 1 };
    model *m = NULL, *f16 = NULL, *pm = NULL, *self = NULL;
    char err[512];
    if (model_load(&m, path, &mo, err, sizeof err) || model_load(&f16, fpath, &mo, err, sizeof err) ||
        model_load(&pm, poor, &mo, err, sizeof err) || model_load(&self, path, &mo, err, sizeof err)) {
        CHECK(0, "model load: %s", err);
        goto out;
    }
    int32_t ids[256];
    int np = encode(m, STORY, ids, 256);
    draft_src *dl = new_draft(m, 8, NULL, 0, 1), *dm = new_draft(m, 0, f16, 1, 1), *dp = new_draft(m, 0, pm, 1, 1);
    draft_src *dlf = new_draft(m, 8, NULL, 1, 1);
    CHECK(dl && dm && dp && dlf, "draft sources");
    if (dl && dm && dp && dlf) {
        test_greedy_cache(m, "lookup", dl, ids, np);
        test_greedy_cache(m, "lookup (every step)", dlf, ids, np);
        test_greedy_cache(m, "draft F16 (every step)", dm, ids, np);
        test_adaptive_off(m, pm, self, f16, ids, np);
        test_greedy_cache(m, "poor draft (every step)", dp, ids, np);
        test_sampling_identity(m, "sampling, poor draft", dp, ids, np, 1);
        test_sampling_identity(m, "sampling, lookup", dlf, ids, np, 0);
        test_rule_units(m, pm, ids, np);
        test_chi_square(m, pm, ids, np);
        test_cancel(m, pm, ids, np);
        test_catchup(m, f16, ids, np);
    }
    draft_free(dl);
    draft_free(dm);
    draft_free(dp);
    draft_free(dlf);
    /* a draft model with another vocabulary is refused by name */
    char qpath[1024];
    t_fixture_path(qpath, sizeof qpath, "models/qwen2-mini-Q4_0.gguf");
    model *q = NULL;
    if (t_need(qpath) && !model_load(&q, qpath, &mo, err, sizeof err)) {
        draft_opts dox = { .dm = q, .n_slots = 1, .n_ctx = 64, .kv_dtype = kv_dtype_parse("f16") };
        draft_src *x = NULL;
        int rc = draft_create(&x, m, &dox, err, sizeof err);
        CHECK(rc == -1 && !x && strstr(err, "draft model"), "another vocabulary accepted as draft: %d %s", rc, err);
        model_free(q);
    }
out:
    model_free(m);
    model_free(f16);
    model_free(pm);
    model_free(self);
}

/* ==== Real processes ==== */

#define N_REQ 8
#define N_PROMPT PROMPT_SET_MAX

typedef struct {
    int port;
    const int32_t *prompt;
    int n_prompt, max_tokens, stream;
    int status, n_tok;
    int32_t tok[MAX_GEN];
} req;

static void req_run(req *r) {
    json_decref(gen_tokens(r->port, gen_req(r->prompt, r->n_prompt, r->max_tokens, r->stream, NULL), r->stream, r->tok,
                           MAX_GEN, &r->n_tok, &r->status));
}

static void *req_thread(void *arg) { req_run(arg); return NULL; }

/* Each prompt alone on the plain node (the references). */
static void run_refs(int plain_port, const prompt_set *ps, int max_tokens, req *ref) {
    for (int p = 0; p < ps->count; p++) {
        ref[p] = (req){ .port = plain_port, .prompt = ps->ids[p], .n_prompt = ps->n[p], .max_tokens = max_tokens };
        req_run(&ref[p]);
        CHECK(ref[p].status == 200 && ref[p].n_tok == max_tokens, "plain prompt %d: status %d, %d tokens", p, ref[p].status,
              ref[p].n_tok);
    }
}

/* Each prompt on the speculative node alone and 8 at once: the
 * references' tokens. want_drafts: the node must have verified drafts. */
static void check_node(const char *what, int spec_port, const prompt_set *ps, const req *ref, int want_drafts) {
    req alone[N_PROMPT], batch[N_REQ];
    int eq_alone = 0, eq_batch = 0, max_tokens = ref[0].max_tokens;
    for (int p = 0; p < ps->count; p++) {
        alone[p] = ref[p];
        alone[p].port = spec_port;
        alone[p].stream = p % 2;
        req_run(&alone[p]);
        eq_alone += alone[p].status == 200 && alone[p].n_tok == max_tokens &&
                    !memcmp(ref[p].tok, alone[p].tok, sizeof(int32_t) * (size_t)max_tokens);
    }
    pthread_t th[N_REQ];
    for (int i = 0; i < N_REQ; i++) {
        int p = (ps->count - 1 + i) % ps->count;   /* the long prompt first */
        batch[i] = alone[p];
        batch[i].stream = i % 2;
        pthread_create(&th[i], NULL, req_thread, &batch[i]);
    }
    for (int i = 0; i < N_REQ; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < N_REQ; i++) {
        int p = (ps->count - 1 + i) % ps->count;
        eq_batch += batch[i].status == 200 && batch[i].n_tok == max_tokens &&
                    !memcmp(ref[p].tok, batch[i].tok, sizeof(int32_t) * (size_t)max_tokens);
    }
    char *body = NULL;
    int st = http(spec_port, "GET", "/v1/stats", NULL, &body);
    json_t *o = st == 200 && body ? json_loads(body, 0, NULL) : NULL;
    long long drafted = o ? jint(o, "spec_drafted", NULL) : -1, accepted = o ? jint(o, "spec_accepted", NULL) : -1;
    json_decref(o);
    free(body);
    CHECK(eq_alone == ps->count, "%s: %d of %d prompts alone equal plain decoding", what, eq_alone, ps->count);
    CHECK(eq_batch == N_REQ, "%s: %d of %d in a batch of 8 equal plain decoding", what, eq_batch, N_REQ);
    CHECK(!want_drafts || drafted > 0, "%s: no drafts verified (%lld)", what, drafted);
    printf("%s: %d/%d alone, %d/%d in a batch of 8 equal; %lld drafted, %lld accepted\n", what, eq_alone, ps->count,
           eq_batch, N_REQ, drafted, accepted);
}

typedef struct { const char *golden, *model, *draft; int generated, lookup_drafts; } golden_model;

static void path_of(char *buf, size_t cap, const char *file, int generated) {
    if (generated) snprintf(buf, cap, "%s/%s", t_models(), file);
    else {
        char rel[256];
        snprintf(rel, sizeof rel, "models/%s", file);
        t_fixture_path(buf, cap, rel);
    }
}

static void test_processes(const char *dir) {
    /* every golden model, with the lower-bit (or F16) copy of its own
     * weights as the draft model */
    static const golden_model gm[] = {
        { "stories260K", "stories260K.gguf", "stories260K-F16.gguf", 0, 1 },
        { "stories260K-F16", "stories260K-F16.gguf", "stories260K.gguf", 0, 1 },
        { "qwen3-mini-F16", "qwen3-mini-F16.gguf", "qwen3-mini-Q4_K_M.gguf", 1, 1 },
        { "qwen3-mini-Q8_0", "qwen3-mini-Q8_0.gguf", "qwen3-mini-Q4_K_M.gguf", 0, 1 },
        { "qwen3-mini-Q4_K_M", "qwen3-mini-Q4_K_M.gguf", "qwen3-mini-Q8_0.gguf", 0, 0 },
        { "qwen3moe-mini-F16", "qwen3moe-mini-F16.gguf", "qwen3moe-mini-Q4_K_M.gguf", 1, 0 },
        { "qwen3moe-mini-Q4_K_M", "qwen3moe-mini-Q4_K_M.gguf", "qwen3-mini-Q8_0.gguf", 0, 0 },
        { "qwen2-mini-F16", "qwen2-mini-F16.gguf", "qwen2-mini-Q4_0.gguf", 1, 0 },
        { "qwen2-mini-Q4_0", "qwen2-mini-Q4_0.gguf", "qwen3-mini-Q4_K_M.gguf", 0, 0 },
    };
    for (size_t i = 0; i < sizeof gm / sizeof gm[0]; i++) {
        char mp[1024], dp[1024], gp[1024], rel[256];
        path_of(mp, sizeof mp, gm[i].model, gm[i].generated);
        path_of(dp, sizeof dp, gm[i].draft, !strcmp(gm[i].draft, "qwen3-mini-F16.gguf"));
        snprintf(rel, sizeof rel, "golden/visible/%s.jsonl", gm[i].golden);
        t_fixture_path(gp, sizeof gp, rel);
        if (!t_need(mp) || !t_need(dp) || !t_need(gp)) continue;
        static prompt_set ps;
        if (load_prompts(gp, &ps, 2, 400)) { CHECK(0, "%s: prompts", gp); continue; }
        int pp, lp, mport;
        char *base[] = { "--role", "local", "-m", mp, "-t", "1", "-c", "1024", "--parallel", "8", "--listen", "127.0.0.1:0",
                         NULL };
        char *look[] = { "--role", "local", "-m", mp, "-t", "1", "-c", "1024", "--parallel", "8", "--listen", "127.0.0.1:0",
                         "--lookup", "8", NULL };
        char *drf[] = { "--role", "local", "-m", mp, "-t", "1", "-c", "1024", "--parallel", "8", "--listen", "127.0.0.1:0",
                        "--draft-model", dp, "--draft-max", "6", "--draft-fixed", NULL };
        pid_t p0 = start_serve(dir, "plain", base, 1, &pp), p1 = start_serve(dir, "lookup", look, 1, &lp),
              p2 = start_serve(dir, "draft", drf, 1, &mport);
        CHECK(pp > 0 && lp > 0 && mport > 0, "%s: nodes did not start", gm[i].golden);
        char what[160];
        int max_tokens = strstr(gm[i].model, "qwen") ? 16 : 64;
        static req ref[N_PROMPT];
        if (pp > 0) run_refs(pp, &ps, max_tokens, ref);
        /* random-weight models' text seldom repeats a token, so prompt
         * lookup has nothing to propose there (identity still holds) */
        if (pp > 0 && lp > 0) {
            snprintf(what, sizeof what, "%s, lookup", gm[i].golden);
            check_node(what, lp, &ps, ref, gm[i].lookup_drafts);
        }
        if (pp > 0 && mport > 0) {
            snprintf(what, sizeof what, "%s, draft %s", gm[i].golden, gm[i].draft);
            check_node(what, mport, &ps, ref, 1);
        }
        CHECK(stop_proc(p0, 20000) == 0 && stop_proc(p1, 20000) == 0 && stop_proc(p2, 20000) == 0,
              "%s: node exit status", gm[i].golden);
        if (asan()) break;   /* sanitizer run: the same paths on one model */
    }
}

/* A decode node beside a prefill node, with prompt lookup: the same tokens
 * as a plain local node. */
#define SPEC_SECRET "5196dae8dc1f933f99140c261963334585c99d184456c3fc3b99681daef10a84"   /* 32 random bytes in hex */

static void test_split(const char *dir) {
    char mp[1024], gp[1024];
    path_of(mp, sizeof mp, "qwen3-mini-F16.gguf", 1);
    t_fixture_path(gp, sizeof gp, "golden/visible/qwen3-mini-F16.jsonl");
    if (!t_need(mp) || !t_need(gp)) return;
    static prompt_set ps;
    if (load_prompts(gp, &ps, 2, 400)) { CHECK(0, "split: prompts"); return; }
    static node_auth_key key;
    node_auth_derive(&key, SPEC_SECRET, strlen(SPEC_SECRET), NODE_AUTH_LABEL_DECODE_API);
    char sf[512];
    snprintf(sf, sizeof sf, "%s/secret", dir);
    write_text(sf, SPEC_SECRET "\n");
    int pport, dport, lport;
    char *pextra[] = { "--role", "prefill", "-m", mp, "-t", "1", "--listen", "127.0.0.1:0", "--secret-file", sf, NULL };
    pid_t pp = start_serve(dir, "split-prefill", pextra, 1, &pport);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", pport);
    char *dextra[] = { "--role", "decode", "-m", mp, "-t", "1", "-c", "1024", "--parallel", "8", "--prefill-node", addr,
                       "--min-split-tokens", "1", "--secret-file", sf, "--listen", "127.0.0.1:0", "--lookup", "8", NULL };
    pid_t dp = start_serve(dir, "split-decode", dextra, 1, &dport);
    char *lextra[] = { "--role", "local", "-m", mp, "-t", "1", "-c", "1024", "--parallel", "8", "--listen", "127.0.0.1:0",
                       "--secret-file", sf, NULL };
    pid_t lp = start_serve(dir, "split-plain", lextra, 1, &lport);
    CHECK(pport > 0 && dport > 0 && lport > 0, "split: nodes did not start");
    if (pport > 0 && dport > 0 && lport > 0) {
        sign_key = &key;
        static req ref[N_PROMPT];
        run_refs(lport, &ps, 24, ref);
        check_node("split qwen3-mini-F16, lookup", dport, &ps, ref, 1);
        char *body = NULL;
        http(dport, "GET", "/v1/stats", NULL, &body);
        json_t *o = body ? json_loads(body, 0, NULL) : NULL;
        CHECK(o && jint(o, "remote_prefills", NULL) >= ps.count, "split: %lld remote prefills",
              o ? jint(o, "remote_prefills", NULL) : -1);
        json_decref(o);
        free(body);
        sign_key = NULL;
    }
    CHECK(stop_proc(dp, 20000) == 0 && stop_proc(lp, 20000) == 0 && stop_proc(pp, 20000) == 0, "split: exit status");
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    unsetenv("TANDEM_KERNELS");
    char dir[] = "/tmp/tandem-test-spec-XXXXXX";
    if (!mkdtemp(dir)) return 1;
    double t0 = now_ms();
    test_lookup_units();
    test_in_process(dir);
    double t1 = now_ms();
    test_processes(dir);
    double t2 = now_ms();
    test_split(dir);
    printf("test_spec: in process %.1f s, golden models %.1f s, split %.1f s\n", (t1 - t0) / 1e3, (t2 - t1) / 1e3,
           (now_ms() - t2) / 1e3);
    printf("test_spec: logs in %s\n", dir);
    return t_done("test_spec");
}
