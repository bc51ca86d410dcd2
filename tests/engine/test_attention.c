/* test_attention.c - the CPU backend's tiled attention against a plain
 * double-precision softmax(q K^T * scale) V computed from the same cache.
 *
 * Shapes are chosen to cross every tile edge: prompts longer than a key
 * tile (128) and than a query block (64 vectors), GQA groups of 1, 2 and 4,
 * two sequences in one batch with the second continuing an earlier prefix
 * (pos0 > 0), decode steps at depth, and F16, BF16 and Q8_0 caches. Each
 * shape runs with every kernel set the machine has (quant_kernel_sets).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "engine/backend.h"
#include "engine/kvcache.h"
#include "engine/quant.h"
#include "t.h"

static uint64_t rng = 0x243F6A8885A308D3ull;   /* t_rnd_float's state: one sequence through the file */

/* out[t][h][d] for row t of sequence rows [t0, t0+n) at pos0.., from the cache. */
static void naive_attention(const kvcache *kv, const float *q, int t0, int n, int pos0, int n_head, int n_head_kv,
                            int hd, float scale, double *out) {
    int grp = n_head / n_head_kv, kvd = n_head_kv * hd, np = pos0 + n;
    float *v = malloc(sizeof(float) * (size_t)kvd * np);
    double *s = malloc(sizeof(double) * (size_t)np);
    float *kall = malloc(sizeof(float) * (size_t)kvd * np);
    size_t rb = kv_row_bytes(kv);
    uint8_t *kr = malloc(rb * (size_t)np), *vr = malloc(rb * (size_t)np);
    char err[128];
    CHECK(kv_read_span(kv, 0, 0, np, kr, vr, err, sizeof err) == 0, "%s", err);
    for (int p = 0; p < np; p++) {
        quant_dequantize_row(kv_dtype(kv), kr + (size_t)p * rb, kall + (size_t)p * kvd, kvd);
        quant_dequantize_row(kv_dtype(kv), vr + (size_t)p * rb, v + (size_t)p * kvd, kvd);
    }
    free(kr); free(vr);
    for (int i = 0; i < n; i++)
        for (int h = 0; h < n_head; h++) {
            const float *qh = q + ((size_t)(t0 + i) * n_head + h) * hd;
            int kh = h / grp, npos = pos0 + i + 1;
            double mx = -INFINITY, sum = 0;
            for (int p = 0; p < npos; p++) {
                double d = 0;
                for (int e = 0; e < hd; e++) d += (double)qh[e] * kall[(size_t)p * kvd + kh * hd + e];
                s[p] = d * scale;
                if (s[p] > mx) mx = s[p];
            }
            for (int p = 0; p < npos; p++) { s[p] = exp(s[p] - mx); sum += s[p]; }
            double *o = out + ((size_t)i * n_head + h) * hd;
            for (int e = 0; e < hd; e++) {
                double acc = 0;
                for (int p = 0; p < npos; p++) acc += s[p] * v[(size_t)p * kvd + kh * hd + e];
                o[e] = acc / sum;
            }
        }
    free(v); free(s); free(kall);
}

/* Two sequences: A prefills nA tokens from 0; B has a prefix of preB tokens
 * stored by an earlier pass, then nB new tokens in the same batch as A. */
static void run_case(backend *be, uint32_t dt, int n_head, int n_head_kv, int hd, int nA, int preB, int nB) {
    char err[256];
    int kvd = n_head_kv * hd, n_tok = nA + nB;
    kvcache *ka = NULL, *kb = NULL;
    CHECK(kv_create(&ka, 1, nA + 8, n_head_kv, hd, dt, err, sizeof err) == 0, "kv_create: %s", err);
    CHECK(kv_create(&kb, 1, preB + nB + 8, n_head_kv, hd, dt, err, sizeof err) == 0, "kv_create: %s", err);
    if (!ka || !kb) { kv_free(ka); kv_free(kb); return; }
    size_t qn = (size_t)(n_tok > preB ? n_tok : preB) * n_head * hd;
    float *q = malloc(sizeof(float) * qn), *k = malloc(sizeof(float) * qn), *v = malloc(sizeof(float) * qn);
    float *out = malloc(sizeof(float) * qn);
    double *want = malloc(sizeof(double) * qn);
    /* B's prefix, stored directly */
    for (size_t i = 0; i < (size_t)preB * kvd; i++) {
        k[i] = t_rnd_float(&rng, -1.0f, 1.0f);
        v[i] = t_rnd_float(&rng, -1.0f, 1.0f);
    }
    kv_store_f32(kb, 0, 0, preB, k, v);
    for (size_t i = 0; i < qn; i++) {
        q[i] = t_rnd_float(&rng, -1.0f, 1.0f) * 2.0f;
        k[i] = t_rnd_float(&rng, -1.0f, 1.0f);
        v[i] = t_rnd_float(&rng, -1.0f, 1.0f);
    }
    be_seq seq[2] = { { ka, 0, nA, 0 }, { kb, nA, nB, preB } };
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)n_tok);
    for (int i = 0; i < nA; i++) pos[i] = i;
    for (int i = 0; i < nB; i++) pos[nA + i] = preB + i;
    be_batch b = { n_tok, pos, 2, seq };
    float scale = 1.0f / sqrtf((float)hd);
    be->ops->kv_store(be, &b, 0, k, v);
    CHECK(be->ops->attention(be, q, &b, 0, n_head, n_head_kv, hd, scale, out) == 0, "attention runs");
    double worst = 0;
    for (int s = 0; s < 2; s++) {
        naive_attention(seq[s].kv, q, seq[s].t0, seq[s].n, seq[s].pos0, n_head, n_head_kv, hd, scale, want);
        for (size_t i = 0; i < (size_t)seq[s].n * n_head * hd; i++) {
            double d = fabs(out[(size_t)seq[s].t0 * n_head * hd + i] - want[i]);
            if (d > worst) worst = d;
        }
    }
    /* outputs are O(1) averages; a Q8_0 cache meets q rounded to 8 bits too */
    double tol = dt == GGML_TYPE_Q8_0 ? 2e-2 : 2e-5;
    CHECK(worst <= tol, "%s %s heads %d/%d hd %d, A %d, B %d+%d: max error %.3g (tol %.0e)", quant_kernel_name(),
          dt == GGML_TYPE_F16 ? "F16" : dt == GGML_TYPE_BF16 ? "BF16" : "Q8_0", n_head, n_head_kv, hd, nA, preB,
          nB, worst, tol);
    free(q); free(k); free(v); free(out); free(want); free(pos);
    kv_free(ka); kv_free(kb);
}

/* A decode step at depth (the decode score and V walks) gives the same
 * bits as the same query row computed as the first of two tokens (the
 * tiled prefill walks): a token's attention does not depend on the pass
 * it is computed in. */
static void decode_exact(backend *be, uint32_t dt, int n_head, int n_head_kv, int hd, int depth) {
    char err[256];
    int kvd = n_head_kv * hd;
    kvcache *kv = NULL;
    CHECK(kv_create(&kv, 1, depth + 4, n_head_kv, hd, dt, err, sizeof err) == 0, "kv_create: %s", err);
    if (!kv) return;
    size_t qn = (size_t)2 * n_head * hd;
    float *k = malloc(sizeof(float) * (size_t)(depth + 2) * kvd), *v = malloc(sizeof(float) * (size_t)(depth + 2) * kvd);
    float *q = malloc(sizeof(float) * qn), *one = malloc(sizeof(float) * qn), *two = malloc(sizeof(float) * qn);
    for (size_t i = 0; i < (size_t)(depth + 2) * kvd; i++) {
        k[i] = t_rnd_float(&rng, -1.0f, 1.0f);
        v[i] = t_rnd_float(&rng, -1.0f, 1.0f);
    }
    for (size_t i = 0; i < qn; i++) q[i] = t_rnd_float(&rng, -1.0f, 1.0f) * 2.0f;
    kv_store_f32(kv, 0, 0, depth + 2, k, v);
    float scale = 1.0f / sqrtf((float)hd);
    int32_t pos[2] = { depth, depth + 1 };
    be_seq s1 = { kv, 0, 1, depth }, s2 = { kv, 0, 2, depth };
    be_batch b1 = { 1, pos, 1, &s1 }, b2 = { 2, pos, 1, &s2 };
    int ok = be->ops->attention(be, q, &b1, 0, n_head, n_head_kv, hd, scale, one) == 0 &&
             be->ops->attention(be, q, &b2, 0, n_head, n_head_kv, hd, scale, two) == 0;
    CHECK(ok && memcmp(one, two, sizeof(float) * (size_t)n_head * hd) == 0,
          "%s heads %d/%d hd %d at depth %d: the one-token step equals the first row of a two-token pass bit for bit",
          quant_kernel_name(), n_head, n_head_kv, hd, depth);
    free(k); free(v); free(q); free(one); free(two);
    kv_free(kv);
}

int main(void) {
    backend *be = backend_cpu_create(2);
    CHECK(be != NULL, "backend");
    if (!be) return t_done("test_attention");
    const char *sets[16];
    int n_sets = quant_kernel_sets(sets, 16);
    const char *best = quant_kernel_name();
    for (int si = 0; si < n_sets && si < 16; si++) {
        quant_use_kernels(sets[si]);
        printf("kernels: %s\n", quant_kernel_name());
        run_case(be, GGML_TYPE_F16, 4, 2, 64, 300, 0, 1);      /* multi-tile prefill + a fresh one-token sequence */
        run_case(be, GGML_TYPE_F16, 8, 2, 32, 17, 200, 70);    /* continuing prompt across tile edges */
        run_case(be, GGML_TYPE_F16, 4, 4, 64, 1, 700, 1);      /* two decode steps at depth */
        run_case(be, GGML_TYPE_BF16, 4, 1, 32, 130, 129, 3);
        run_case(be, GGML_TYPE_Q8_0, 4, 2, 64, 200, 60, 90);
        /* decode steps at depth with the heads of real models */
        run_case(be, GGML_TYPE_F16, 16, 8, 128, 1, 1300, 1);   /* Qwen3-0.6B's heads */
        run_case(be, GGML_TYPE_F16, 14, 2, 64, 1, 1100, 1);    /* Qwen2.5-0.5B's: 7 per KV head */
        run_case(be, GGML_TYPE_BF16, 32, 4, 128, 1, 1500, 1);  /* 30B-A3B's: 8 per KV head */
        run_case(be, GGML_TYPE_F16, 4, 4, 40, 1, 1023, 1);     /* odd width */
        run_case(be, GGML_TYPE_Q8_0, 4, 2, 64, 1, 1200, 1);
        decode_exact(be, GGML_TYPE_F16, 16, 8, 128, 1400);
        decode_exact(be, GGML_TYPE_F16, 14, 2, 64, 2100);
        decode_exact(be, GGML_TYPE_BF16, 32, 4, 128, 1025);
        decode_exact(be, GGML_TYPE_F16, 12, 1, 64, 1030);      /* more query heads per KV head than a decode tile */
    }
    quant_use_kernels(best);
    be->ops->destroy(be);
    return t_done("test_attention");
}
