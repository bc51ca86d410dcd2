/* test_quant.c - conversions, block layouts, quantizers, SIMD vs reference kernels,
 * and dequantization of real fixture tensors against their F16 originals. */
#include "t.h"
#include "engine/quant.h"
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif
#include "engine/gguf.h"

#include <math.h>
#include <stdint.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* ==== Helpers ==== */
/* t_rnd32 (xorshift32): the error bounds below were measured on its data */
static uint32_t rng_state = 12345u;
static float rng_uniform(void) { return (float)(t_rnd32(&rng_state) >> 8) * 0x1p-24f; }  /* [0,1) */
static float rng_normal(void) {
    float u1 = rng_uniform() + 1e-7f, u2 = rng_uniform();
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}
static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static size_t row_bytes(uint32_t t, int64_t n) {
    switch (t) {
    case GGML_TYPE_F32: return (size_t)n * 4;
    case GGML_TYPE_F16: case GGML_TYPE_BF16: return (size_t)n * 2;
    case GGML_TYPE_Q4_0: return (size_t)n / 32 * sizeof(block_q4_0);
    case GGML_TYPE_Q5_0: return (size_t)n / 32 * sizeof(block_q5_0);
    case GGML_TYPE_Q8_0: return (size_t)n / 32 * sizeof(block_q8_0);
    case GGML_TYPE_Q4_1: return (size_t)n / 32 * sizeof(block_q4_1);
    case GGML_TYPE_Q5_1: return (size_t)n / 32 * sizeof(block_q5_1);
    case GGML_TYPE_Q8_1: return (size_t)n / 32 * sizeof(block_q8_1);
    case GGML_TYPE_Q4_K: return (size_t)n / 256 * sizeof(block_q4_K);
    case GGML_TYPE_Q5_K: return (size_t)n / 256 * sizeof(block_q5_K);
    case GGML_TYPE_Q6_K: return (size_t)n / 256 * sizeof(block_q6_K);
    case GGML_TYPE_Q8_K: return (size_t)n / 256 * sizeof(block_q8_K);
    default: return 0;
    }
}

static const uint32_t wtypes[] = {
    GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q4_0, GGML_TYPE_Q5_0,
    GGML_TYPE_Q8_0, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K, GGML_TYPE_Q4_1, GGML_TYPE_Q5_1,
};
#define N_WTYPES (sizeof wtypes / sizeof wtypes[0])

static const char *tname(uint32_t t) {
    switch (t) {
    case GGML_TYPE_F32: return "F32"; case GGML_TYPE_F16: return "F16"; case GGML_TYPE_BF16: return "BF16";
    case GGML_TYPE_Q4_0: return "Q4_0"; case GGML_TYPE_Q5_0: return "Q5_0"; case GGML_TYPE_Q8_0: return "Q8_0";
    case GGML_TYPE_Q4_K: return "Q4_K"; case GGML_TYPE_Q5_K: return "Q5_K"; case GGML_TYPE_Q6_K: return "Q6_K";
    case GGML_TYPE_Q4_1: return "Q4_1"; case GGML_TYPE_Q5_1: return "Q5_1"; case GGML_TYPE_Q8_1: return "Q8_1";
    default: return "?";
    }
}

/* ==== fp16 / bf16 ==== */
static void test_fp16(void) {
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = fp16_to_f32((fp16_t)h);
        int is_nan = ((h >> 10) & 0x1f) == 0x1f && (h & 0x3ff);
        if (is_nan) { if (!isnan(f) || !(((f32_to_fp16(f) >> 10) & 0x1f) == 0x1f && (f32_to_fp16(f) & 0x3ff))) bad++; }
        else if (f32_to_fp16(f) != h) bad++;
    }
    CHECK(bad == 0, "fp16 round trip: %d of 65536 values differ", bad);
    CHECK(fp16_to_f32(0x3c00) == 1.0f && fp16_to_f32(0xc000) == -2.0f, "fp16 basic values");
    CHECK(fp16_to_f32(0x0001) == 0x1p-24f && fp16_to_f32(0x03ff) == 1023 * 0x1p-24f, "fp16 subnormals");
    CHECK(fp16_to_f32(0x7bff) == 65504.0f && isinf(fp16_to_f32(0x7c00)) && fp16_to_f32(0xfc00) < 0, "fp16 max/inf");
    CHECK(f32_to_fp16(65519.0f) == 0x7bff && f32_to_fp16(65520.0f) == 0x7c00, "fp16 overflow threshold");
    CHECK(f32_to_fp16(1e9f) == 0x7c00 && f32_to_fp16(-INFINITY) == 0xfc00, "fp16 inf");
    CHECK(f32_to_fp16(1.0f + 0x1p-11f) == 0x3c00, "tie rounds to even (down)");
    CHECK(f32_to_fp16(1.0f + 3 * 0x1p-11f) == 0x3c02, "tie rounds to even (up)");
    CHECK(f32_to_fp16(1.0f + 0x1p-11f + 0x1p-20f) == 0x3c01, "above tie rounds up");
    CHECK(f32_to_fp16(0x1p-25f) == 0x0000 && f32_to_fp16(0x1.8p-25f) == 0x0001, "subnormal tie/round");
    CHECK(f32_to_fp16(3 * 0x1p-25f) == 0x0002, "subnormal tie to even");
    CHECK(f32_to_fp16(0x1p-30f) == 0 && f32_to_fp16(-0x1p-30f) == 0x8000, "underflow keeps sign");
    CHECK(f32_to_fp16(0x1.ffcp-15f) == 0x0400, "round up into the smallest normal");
    CHECK(f32_to_fp16(-0.0f) == 0x8000 && f32_to_fp16(u2f(0x00000001)) == 0, "signed zero / f32 denormal");
    fp16_t hn = f32_to_fp16(NAN);
    CHECK(((hn >> 10) & 0x1f) == 0x1f && (hn & 0x3ff), "NaN stays NaN (0x%04x)", hn);
#if defined(__F16C__)
    /* the hardware converter rounds to nearest even: compare over a lattice of all float bit patterns */
    int diff = 0;
    for (uint64_t u = 0; u < 0x100000000ull; u += 997) {
        float f = u2f((uint32_t)u);
        if (isnan(f)) continue;
        if (_cvtss_sh(f, 0) != f32_to_fp16(f)) diff++;
    }
    CHECK(diff == 0, "f32_to_fp16 differs from F16C on %d samples", diff);
#endif
}

static void test_bf16(void) {
    CHECK(f32_to_bf16(1.0f) == 0x3f80 && bf16_to_f32(0x3f80) == 1.0f, "bf16 1.0");
    CHECK(f32_to_bf16(u2f(0x3f808000)) == 0x3f80, "bf16 tie to even (down)");
    CHECK(f32_to_bf16(u2f(0x3f818000)) == 0x3f82, "bf16 tie to even (up)");
    CHECK(f32_to_bf16(u2f(0x3f808001)) == 0x3f81, "bf16 above tie");
    CHECK(f32_to_bf16(u2f(0x7f7fffff)) == 0x7f80, "bf16 max float rounds to inf");
    CHECK(f32_to_bf16(INFINITY) == 0x7f80 && f32_to_bf16(-INFINITY) == 0xff80, "bf16 inf");
    bf16_t n = f32_to_bf16(u2f(0x7f800001));  /* signalling NaN whose payload is in the low bits */
    CHECK(isnan(bf16_to_f32(n)), "bf16 NaN kept (0x%04x)", n);
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = bf16_to_f32((bf16_t)h);
        if (!isnan(f) && f32_to_bf16(f) != h) bad++;
        if (f2u(f) != h << 16) bad++;
    }
    CHECK(bad == 0, "bf16 round trip: %d bad", bad);
}

/* ==== Hand-built blocks ==== */
static int close_all(const float *a, const float *b, int n, float tol) {
    for (int i = 0; i < n; i++)
        if (fabsf(a[i] - b[i]) > tol) {
            fprintf(stderr, "  index %d: %g vs %g\n", i, a[i], b[i]);
            return 0;
        }
    return 1;
}

static void test_blocks_32(void) {
    float y[32], e[32];
    /* Q4_0: element j is the low nibble of qs[j], element j+16 the high nibble; value (q-8)*d */
    block_q4_0 b4;
    b4.d = f32_to_fp16(0.5f);
    for (int j = 0; j < 16; j++) b4.qs[j] = (uint8_t)(j | ((15 - j) << 4));
    for (int j = 0; j < 16; j++) { e[j] = 0.5f * (j - 8); e[j + 16] = 0.5f * (7 - j); }
    quant_dequantize_row(GGML_TYPE_Q4_0, &b4, y, 32);
    CHECK(close_all(y, e, 32, 0), "Q4_0 hand block");

    /* Q5_0: qh bit j is the 5th bit of element j (bits 16..31 for the high nibbles) */
    block_q5_0 b5;
    b5.d = f32_to_fp16(0.25f);
    memset(b5.qs, 0, sizeof b5.qs);
    uint32_t qh = 0x80000001u;  /* element 0 and element 31 get +16 */
    memcpy(b5.qh, &qh, 4);
    b5.qs[0] = 0x3F;            /* element 0 low nibble 15, element 16 high nibble 3 */
    b5.qs[15] = 0xF0;           /* element 15: 0, element 31: 15 */
    for (int j = 0; j < 32; j++) e[j] = 0.25f * (0 - 16);
    e[0] = 0.25f * (31 - 16); e[16] = 0.25f * (3 - 16); e[15] = 0.25f * (0 - 16); e[31] = 0.25f * (31 - 16);
    quant_dequantize_row(GGML_TYPE_Q5_0, &b5, y, 32);
    CHECK(close_all(y, e, 32, 0), "Q5_0 hand block");

    block_q8_0 b8;
    b8.d = f32_to_fp16(-2.0f);
    for (int j = 0; j < 32; j++) { b8.qs[j] = (int8_t)(j * 8 - 128); e[j] = -2.0f * (j * 8 - 128); }
    quant_dequantize_row(GGML_TYPE_Q8_0, &b8, y, 32);
    CHECK(close_all(y, e, 32, 0), "Q8_0 hand block");

    /* Q4_1: value d*q + m, low nibbles then high nibbles */
    block_q4_1 c4;
    c4.d = f32_to_fp16(0.5f);
    c4.m = f32_to_fp16(-3.0f);
    for (int j = 0; j < 16; j++) c4.qs[j] = (uint8_t)(j | ((15 - j) << 4));
    for (int j = 0; j < 16; j++) { e[j] = 0.5f * j - 3.0f; e[j + 16] = 0.5f * (15 - j) - 3.0f; }
    quant_dequantize_row(GGML_TYPE_Q4_1, &c4, y, 32);
    CHECK(close_all(y, e, 32, 0), "Q4_1 hand block");

    /* Q5_1: Q5_0's bit layout, value d*q + m with q in 0..31 */
    block_q5_1 c5;
    c5.d = f32_to_fp16(0.25f);
    c5.m = f32_to_fp16(1.0f);
    memset(c5.qs, 0, sizeof c5.qs);
    memcpy(c5.qh, &qh, 4);      /* element 0 and element 31 get +16 */
    c5.qs[0] = 0x3F;
    c5.qs[15] = 0xF0;
    for (int j = 0; j < 32; j++) e[j] = 1.0f;
    e[0] = 0.25f * 31 + 1.0f; e[16] = 0.25f * 3 + 1.0f; e[31] = 0.25f * 31 + 1.0f;
    quant_dequantize_row(GGML_TYPE_Q5_1, &c5, y, 32);
    CHECK(close_all(y, e, 32, 0), "Q5_1 hand block");
    /* and their dot with a Q8_1 block: sum d_w d_a q a + m_w s_a */
    float act[32];
    for (int j = 0; j < 32; j++) act[j] = (float)(j % 5) - 2.0f;
    block_q8_1 a1;
    quant_ref_quantize_act_row(GGML_TYPE_Q8_1, act, &a1, 32);
    int asum = 0;
    for (int j = 0; j < 32; j++) asum += a1.qs[j];
    CHECK(a1.s == f32_to_fp16((float)asum * (2.0f / 127.0f)) && a1.d == f32_to_fp16(2.0f / 127.0f),
          "Q8_1 carries s = d * sum(q) (%d)", asum);
    float dot, want = 0.0f;
    quant_dequantize_row(GGML_TYPE_Q5_1, &c5, y, 32);
    quant_dequantize_row(GGML_TYPE_Q8_1, &a1, e, 32);
    for (int j = 0; j < 32; j++) want += y[j] * e[j];
    quant_ref_vec_dot(GGML_TYPE_Q5_1, 32, &dot, &c5, &a1);
    CHECK(fabsf(dot - want) < 1e-3f * (1.0f + fabsf(want)), "Q5_1 . Q8_1 dot %g vs %g", dot, want);
}

static void test_blocks_k(void) {
    float y[256], e[256];
    /* Q4_K with literal scale bytes. Sub-blocks 0-3: scale = byte j & 63, min = byte j+4 & 63.
     * Sub-blocks 4-7: low nibbles in bytes 8-11 (scale low, min high), top bits in
     * bits 6-7 of bytes 0-3 (scales) and 4-7 (mins). */
    block_q4_K k4;
    k4.d = f32_to_fp16(1.0f);
    k4.dmin = f32_to_fp16(0.5f);
    const uint8_t sb[12] = { 0x01 | 0x40, 0x02, 0x03 | 0xC0, 0x04,  0x05, 0x06 | 0x80, 0x07, 0x08,
                             0x21, 0x43, 0x65, 0x87 };
    memcpy(k4.scales, sb, 12);
    /* expected: scales 1,2,3,4, then (1|1<<4)=17, 3, (5|3<<4)=53, 7; mins 5,6,7,8, then 2, (4|2<<4)=36, 6, 8 */
    const int sc[8] = { 1, 2, 3, 4, 17, 3, 53, 7 }, mn[8] = { 5, 6, 7, 8, 2, 36, 6, 8 };
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) k4.qs[32 * c + l] = (uint8_t)((l & 15) | (((l + c) & 15) << 4));
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            e[64 * c + l] = 1.0f * sc[2 * c] * (l & 15) - 0.5f * mn[2 * c];
            e[64 * c + 32 + l] = 1.0f * sc[2 * c + 1] * ((l + c) & 15) - 0.5f * mn[2 * c + 1];
        }
    quant_dequantize_row(GGML_TYPE_Q4_K, &k4, y, 256);
    CHECK(close_all(y, e, 256, 0), "Q4_K hand block");

    /* Q5_K: same scales; qh[l] bit 2c is the 5th bit of element 64c+l, bit 2c+1 of 64c+32+l */
    block_q5_K k5;
    k5.d = k4.d; k5.dmin = k4.dmin;
    memcpy(k5.scales, sb, 12);
    memcpy(k5.qs, k4.qs, 128);
    for (int l = 0; l < 32; l++) k5.qh[l] = (uint8_t)(l * 37 + 11);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            int h0 = (k5.qh[l] >> (2 * c)) & 1, h1 = (k5.qh[l] >> (2 * c + 1)) & 1;
            e[64 * c + l] = 1.0f * sc[2 * c] * ((l & 15) + 16 * h0) - 0.5f * mn[2 * c];
            e[64 * c + 32 + l] = 1.0f * sc[2 * c + 1] * (((l + c) & 15) + 16 * h1) - 0.5f * mn[2 * c + 1];
        }
    quant_dequantize_row(GGML_TYPE_Q5_K, &k5, y, 256);
    CHECK(close_all(y, e, 256, 0), "Q5_K hand block");

    /* Q6_K: each half of 128 uses ql[64] and qh[32]: element 32g+l takes
     * ql[l + 32*(g&1)] (low nibble for g<2, high for g>=2) and bits 2g..2g+1 of qh[l]; value-32, scale per 16. */
    block_q6_K k6;
    k6.d = f32_to_fp16(0.125f);
    for (int j = 0; j < 16; j++) k6.scales[j] = (int8_t)(j * 9 - 70);
    int L[256];
    for (int i = 0; i < 256; i++) L[i] = (i * 29 + 7) % 64;
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const int *Lh = L + 128 * h;
            k6.ql[64 * h + l] = (uint8_t)((Lh[l] & 15) | ((Lh[l + 64] & 15) << 4));
            k6.ql[64 * h + 32 + l] = (uint8_t)((Lh[l + 32] & 15) | ((Lh[l + 96] & 15) << 4));
            k6.qh[32 * h + l] = (uint8_t)((Lh[l] >> 4) | ((Lh[l + 32] >> 4) << 2) | ((Lh[l + 64] >> 4) << 4) | ((Lh[l + 96] >> 4) << 6));
        }
    for (int i = 0; i < 256; i++) e[i] = 0.125f * k6.scales[i / 16] * (L[i] - 32);
    quant_dequantize_row(GGML_TYPE_Q6_K, &k6, y, 256);
    CHECK(close_all(y, e, 256, 0), "Q6_K hand block");
    /* one literal spot check: element 0 = (ql[0]&15 | (qh[0]&3)<<4) - 32 */
    k6.ql[0] = 0x0A; k6.qh[0] = 0x02; k6.scales[0] = 3;
    quant_dequantize_row(GGML_TYPE_Q6_K, &k6, y, 256);
    CHECK(y[0] == 0.125f * 3 * ((10 | 32) - 32), "Q6_K literal element 0: %g", y[0]);

    float f[4] = { 1.5f, -2.0f, 65504.0f, 0.0f }, g[4];
    fp16_t h16[4];
    bf16_t hb[4];
    for (int i = 0; i < 4; i++) { h16[i] = f32_to_fp16(f[i]); hb[i] = f32_to_bf16(f[i]); }
    quant_dequantize_row(GGML_TYPE_F16, h16, g, 4);
    CHECK(close_all(g, f, 4, 0), "F16 row");
    quant_dequantize_row(GGML_TYPE_BF16, hb, g, 3);
    CHECK(g[0] == 1.5f && g[1] == -2.0f && g[2] == 65536.0f, "BF16 row");
}

/* ==== Quantizers ==== */
/* relative RMS error of quantize -> dequantize, for gaussian data */
static void test_weight_quant(void) {
    const int n = 1024, rows = 8;
    float *x = malloc(sizeof(float) * n * rows), *y = malloc(sizeof(float) * n);
    void *q = malloc(row_bytes(GGML_TYPE_F32, n) * rows);
    void *q2 = malloc(row_bytes(GGML_TYPE_F32, n) * rows);
    for (int i = 0; i < n * rows; i++) x[i] = 0.02f * rng_normal();
    x[5] = 0.3f;  /* an outlier */
    /* bounds: roughly 1.5x what these formats achieve on gaussian data */
    const struct { uint32_t t; double bound; } cases[] = {
        { GGML_TYPE_F32, 0 }, { GGML_TYPE_F16, 1e-3 }, { GGML_TYPE_BF16, 5e-3 },
        { GGML_TYPE_Q8_0, 0.01 }, { GGML_TYPE_Q4_0, 0.16 }, { GGML_TYPE_Q5_0, 0.08 },
        { GGML_TYPE_Q4_K, 0.12 }, { GGML_TYPE_Q5_K, 0.06 }, { GGML_TYPE_Q6_K, 0.035 },
        { GGML_TYPE_Q4_1, 0.16 }, { GGML_TYPE_Q5_1, 0.08 },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        uint32_t t = cases[c].t;
        size_t rb = row_bytes(t, n);
        CHECK(quant_quantize_weight_rows(t, x, q, rows, n) == 0, "%s: quantize", tname(t));
        CHECK(quant_quantize_weight_rows(t, x, q2, rows, n) == 0 && memcmp(q, q2, rb * rows) == 0,
              "%s: deterministic", tname(t));
        double se = 0, sx = 0;
        for (int r = 0; r < rows; r++) {
            quant_dequantize_row(t, (char *)q + rb * r, y, n);
            for (int i = 0; i < n; i++) {
                double d = (double)y[i] - x[r * n + i];
                se += d * d;
                sx += (double)x[r * n + i] * x[r * n + i];
            }
        }
        double rel = sqrt(se / sx);
        CHECK(rel <= cases[c].bound, "%s: relative rms error %.4f > %.4f", tname(t), rel, cases[c].bound);
    }
    /* constant and zero rows must not break the K-quants */
    for (int i = 0; i < 256; i++) x[i] = 0.0f;
    for (int i = 256; i < 512; i++) x[i] = -0.75f;
    const uint32_t kt[] = { GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K, GGML_TYPE_Q4_0, GGML_TYPE_Q5_0,
                            GGML_TYPE_Q4_1, GGML_TYPE_Q5_1 };
    for (size_t c = 0; c < sizeof kt / sizeof kt[0]; c++) {
        CHECK(quant_quantize_weight_rows(kt[c], x, q, 1, 512) == 0, "quantize flat");
        quant_dequantize_row(kt[c], q, y, 512);
        int ok = 1;
        for (int i = 0; i < 512; i++) ok &= fabsf(y[i] - x[i]) < 0.01f;
        CHECK(ok, "%s: zero/constant blocks", tname(kt[c]));
    }
    CHECK(quant_quantize_weight_rows(GGML_TYPE_Q4_K, x, q, 1, 100) == -1, "bad row length rejected");
    CHECK(quant_quantize_weight_rows(GGML_TYPE_IQ2_XXS, x, q, 1, 256) == -1, "unsupported type rejected");
    free(x); free(y); free(q); free(q2);
}

/* Activation quantizers: reference definition spot checks, and fast == ref bit for bit. */
static void test_act_quant(void) {
    const int n = 4096;
    float *x = malloc(sizeof(float) * n);
    const size_t cap = row_bytes(GGML_TYPE_F32, n);
    void *a = malloc(cap), *b = malloc(cap);
    for (int i = 0; i < n; i++) x[i] = rng_normal() * (i % 7 == 0 ? 3.0f : 1.0f);
    /* ties and exact multiples: values on the rounding boundaries */
    for (int i = 0; i < 32; i++) x[i] = (float)(i - 16) * 0.5f;
    x[40] = 0.0f;
    for (int i = 256; i < 512; i++) x[i] = 0.0f;        /* a zero Q8_K block */
    x[600] = -50.0f; x[700] = 50.0f;                     /* equal magnitudes: the first one's sign wins */
    const uint32_t at[] = { GGML_TYPE_Q8_0, GGML_TYPE_Q8_K, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_F32, GGML_TYPE_Q8_1 };
    for (size_t c = 0; c < sizeof at / sizeof at[0]; c++) {
        size_t rb = row_bytes(at[c], n);
        memset(a, 0x55, cap); memset(b, 0xAA, cap);
        quant_ref_quantize_act_row(at[c], x, a, n);
        quant_quantize_act_row(at[c], x, b, n);
        CHECK(memcmp(a, b, rb) == 0, "act %s: fast != reference", at[c] == GGML_TYPE_Q8_K ? "Q8_K" : tname(at[c]));
    }
    /* Q8_0 definition: d = 8/127 for the first block, q = roundf(x/d): 7.5/d = 119.0625 -> 119 */
    block_q8_0 q0[2];
    quant_ref_quantize_act_row(GGML_TYPE_Q8_0, x, q0, 64);
    CHECK(q0[0].d == f32_to_fp16(8.0f / 127.0f), "Q8_0 scale");
    CHECK(q0[0].qs[0] == -127 && q0[0].qs[16] == 0 && q0[0].qs[31] == 119, "Q8_0 values %d %d %d",
          q0[0].qs[0], q0[0].qs[16], q0[0].qs[31]);
    /* Q8_K definition on a block whose largest magnitude is negative */
    block_q8_K qk[3];
    quant_ref_quantize_act_row(GGML_TYPE_Q8_K, x, qk, 768);
    CHECK(qk[1].d == 0.0f && qk[1].qs[5] == 0 && qk[1].bsums[3] == 0, "Q8_K zero block");
    CHECK(qk[2].d == 1.0f / (-127.0f / -50.0f), "Q8_K uses the signed max (d=%g)", qk[2].d);
    CHECK(qk[2].qs[600 - 512] == -127 && qk[2].qs[700 - 512] == 127, "Q8_K extremes map to +-127");
    int s = 0;
    for (int i = 0; i < 16; i++) s += qk[2].qs[16 * 3 + i];
    CHECK(qk[2].bsums[3] == s, "Q8_K bsums");
    /* NaN and infinite activations (a file with such weights): no undefined
     * float-to-int conversion (the ASan+UBSan run aborts on one), finite
     * blocks as before */
    float bad[64];
    for (int i = 0; i < 64; i++) bad[i] = x[i];
    bad[3] = NAN; bad[5] = INFINITY; bad[9] = -INFINITY;
    block_q8_0 qb[2];
    quant_ref_quantize_act_row(GGML_TYPE_Q8_0, bad, qb, 64);
    CHECK(qb[0].qs[3] == 0 && qb[0].qs[5] == 0 && qb[1].d == q0[1].d && !memcmp(qb[1].qs, q0[1].qs, 32),
          "Q8_0 with NaN/inf: %d %d", qb[0].qs[3], qb[0].qs[5]);
    quant_quantize_act_row(GGML_TYPE_Q8_0, bad, qb, 64);
    CHECK(qb[1].d == q0[1].d && !memcmp(qb[1].qs, q0[1].qs, 32), "Q8_0 (kernel set) with NaN/inf: finite block changed");
    free(x); free(a); free(b);
}

/* ==== Fast vs reference kernels ==== */
/* Random weight row of type t: quantize gaussian data (float types) or random bytes with sane scales. */
static void make_rows(uint32_t t, int64_t n, int rows, void *dst, float *tmp) {
    for (int64_t i = 0; i < n * rows; i++) tmp[i] = rng_normal() * 0.5f;
    quant_quantize_weight_rows(t, tmp, dst, rows, n);
}

static double dot_magnitude(uint32_t wt, int64_t n, const void *w, const void *a, float *fw, float *fa) {
    quant_dequantize_row(wt, w, fw, n);
    quant_dequantize_row(quant_vec_dot_type(wt), a, fa, n);
    double m = 0;
    for (int64_t i = 0; i < n; i++) m += fabs((double)fw[i] * fa[i]);
    return m;
}

static void test_kernel_set(void) {
    const int64_t lens32[] = { 32, 96, 256, 1024, 8192 + 64 }, lensK[] = { 256, 512, 1024, 3072 };
    const int64_t lensF[] = { 1, 7, 8, 33, 256, 1000 };
    const int64_t nmax = 8256;
    const int maxw = 9, maxa = 9;
    float *tmp = malloc(sizeof(float) * nmax * maxa), *fw = malloc(sizeof(float) * nmax), *fa = malloc(sizeof(float) * nmax);
    void *w = malloc(row_bytes(GGML_TYPE_F32, nmax) * maxw), *a = malloc(row_bytes(GGML_TYPE_F32, nmax) * maxa);
    float out_fast[128], out_ref[128];
    printf("kernels: %s\n", quant_kernel_name());
    for (size_t ti = 0; ti < N_WTYPES; ti++) {
        uint32_t wt = wtypes[ti], at = quant_vec_dot_type(wt);
        const int64_t *lens = wt == GGML_TYPE_Q4_K || wt == GGML_TYPE_Q5_K || wt == GGML_TYPE_Q6_K ? lensK
                            : wt == GGML_TYPE_F32 || wt == GGML_TYPE_F16 || wt == GGML_TYPE_BF16 ? lensF : lens32;
        int nl = lens == lensK ? 4 : lens == lensF ? 6 : 5;
        int worst_ok = 1, tile_ok = 1;
#if defined(__aarch64__)
        /* the NEON sets (neon, dotprod, i8mm) replay the reference's per-block
         * arithmetic for the quantised formats: their tiles equal it bit for bit */
        const int bits = lens != lensF;
#else
        const int bits = 0;
#endif
        for (int li = 0; li < nl; li++) {
            int64_t n = lens[li];
            size_t wrb = row_bytes(wt, n), arb = row_bytes(at, n);
            make_rows(wt, n, maxw, w, tmp);
            for (int64_t i = 0; i < n * maxa; i++) tmp[i] = rng_normal();
            for (int r = 0; r < maxa; r++) quant_ref_quantize_act_row(at, tmp + r * n, (char *)a + arb * r, n);
            /* vec_dot */
            for (int r = 0; r < 3; r++) {
                float sf, sr;
                const void *wr = (char *)w + wrb * r, *ar = (char *)a + arb * r;
                quant_vec_dot(wt, n, &sf, wr, ar);
                quant_ref_vec_dot(wt, n, &sr, wr, ar);
                double m = dot_magnitude(wt, n, wr, ar, fw, fa);
                if (!(fabs((double)sf - sr) <= 2e-6 * m + 1e-6)) {
                    worst_ok = 0;
                    fprintf(stderr, "  %s n=%lld: fast %.7g ref %.7g (magnitude %g)\n", tname(wt), (long long)n, sf, sr, m);
                }
            }
            /* tiles of many shapes, with strides larger than a row */
            const int shapes[][2] = { { 1, 1 }, { 1, 3 }, { 7, 1 }, { 7, 5 }, { 2, 4 },
                                      { 4, 8 }, { 9, 9 }, { 3, 2 }, { 6, 7 } };
            for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
                int nw = shapes[s][0], na = shapes[s][1];
                size_t os = (size_t)nw + 2;
                for (int k = 0; k < 128; k++) out_fast[k] = out_ref[k] = -999.0f;
                quant_mul_mat_tile(wt, n, w, wrb, nw, a, arb, na, out_fast, os);
                quant_ref_mul_mat_tile(wt, n, w, wrb, nw, a, arb, na, out_ref, os);
                for (int j = 0; j < na; j++)
                    for (int i = 0; i < (int)os; i++) {
                        size_t k = j * os + i;
                        if (i >= nw) { if (out_fast[k] != -999.0f) tile_ok = 0; continue; }  /* untouched */
                        double m = dot_magnitude(wt, n, (char *)w + wrb * i, (char *)a + arb * j, fw, fa);
                        if (!(fabs((double)out_fast[k] - out_ref[k]) <= 2e-6 * m + 1e-6) ||
                            (bits && out_fast[k] != out_ref[k])) {
                            tile_ok = 0;
                            fprintf(stderr, "  %s tile %dx%d n=%lld [%d,%d]: %.7g vs %.7g\n", tname(wt), nw, na,
                                    (long long)n, j, i, out_fast[k], out_ref[k]);
                        }
                    }
            }
        }
        CHECK(worst_ok, "%s %s: vec_dot fast vs reference", quant_kernel_name(), tname(wt));
        CHECK(tile_ok, "%s %s: mul_mat_tile vs reference", quant_kernel_name(), tname(wt));
    }
    /* the dot products themselves: a quantized dot should be close to the float dot */
    {
        int64_t n = 1024;
        for (int64_t i = 0; i < n; i++) { tmp[i] = rng_normal(); tmp[n + i] = rng_normal(); }
        double exact = 0;
        for (int64_t i = 0; i < n; i++) exact += (double)tmp[i] * tmp[n + i];
        for (size_t ti = 0; ti < N_WTYPES; ti++) {
            uint32_t wt = wtypes[ti];
            float s;
            quant_quantize_weight_rows(wt, tmp, w, 1, n);
            quant_quantize_act_row(quant_vec_dot_type(wt), tmp + n, a, n);
            quant_vec_dot(wt, n, &s, w, a);
            /* ~4 standard deviations of the quantization noise (relative rms error e gives e*sqrt(n)) */
            double e = wt == GGML_TYPE_Q4_0 || wt == GGML_TYPE_Q4_K || wt == GGML_TYPE_Q4_1 ? 0.1
                     : wt == GGML_TYPE_Q5_0 || wt == GGML_TYPE_Q5_K || wt == GGML_TYPE_Q5_1 ? 0.05
                     : wt == GGML_TYPE_Q6_K || wt == GGML_TYPE_Q8_0 ? 0.025 : 0.005;
            CHECK(fabs(s - exact) < 4 * e * sqrt((double)n), "%s %s: dot %g vs exact %g", quant_kernel_name(),
                  tname(wt), s, exact);
        }
    }
    free(tmp); free(fw); free(fa); free(w); free(a);
}

/* Every kernel set this CPU runs, each against the reference; then the
 * selection itself. */
/* Q8_0 prefill tiles of many rows (the avx512 set gathers 16 rows across
 * the lanes): every set within the tile tolerance of the reference, and the
 * avx512 set's 16-row groups equal to it bit for bit (they replay the
 * reference's per-block float arithmetic). 37 rows leave 5 for the pair
 * tile; 130
 * blocks cross the 128-block packing pass. */
static void test_q8_many_rows(void) {
    enum { NW = 37, NA = 70 };   /* 70: past the 64 activation rows whose corrections are kept */
    const int64_t lens[3] = { 32, 1024, 130 * 32 };
    const int nas[8] = { 1, 2, 3, 9, 16, 17, 29, NA };   /* the few-row (< 17) and the gathering paths */
    int64_t nmax = lens[2];
    size_t wrb = row_bytes(GGML_TYPE_Q8_0, nmax) + 34, arb = row_bytes(GGML_TYPE_Q8_0, nmax);
    float *tmp = malloc(sizeof(float) * nmax * (NW > NA ? NW : NA));
    uint8_t *w = malloc(wrb * NW), *a = malloc(arb * NA);
    static float out[NA * (NW + 3)], ref[NA * (NW + 3)];
    int exact = !strcmp(quant_kernel_name(), "avx512"), ok = 1;
    for (int li = 0; li < 3; li++) {
        int64_t n = lens[li];
        size_t rb = row_bytes(GGML_TYPE_Q8_0, n);
        for (int64_t i = 0; i < n * NW; i++) tmp[i] = rng_normal();
        for (int i = 0; i < NW; i++) quant_quantize_weight_rows(GGML_TYPE_Q8_0, tmp + i * n, w + wrb * i, 1, n);
        for (int64_t i = 0; i < n * NA; i++) tmp[i] = rng_normal();
        for (int r = 0; r < NA; r++) quant_ref_quantize_act_row(GGML_TYPE_Q8_0, tmp + r * n, a + arb * r, n);
        (void)rb;
        for (int c = 0; c < 8; c++) {
            int na = nas[c];
            size_t os = NW + 3;
            for (size_t k = 0; k < sizeof out / sizeof out[0]; k++) out[k] = ref[k] = -999.0f;
            quant_mul_mat_tile(GGML_TYPE_Q8_0, n, w, wrb, NW, a, arb, na, out, os);
            quant_ref_mul_mat_tile(GGML_TYPE_Q8_0, n, w, wrb, NW, a, arb, na, ref, os);
            for (int j = 0; j < na; j++)
                for (int i = 0; i < (int)os; i++) {
                    float f = out[j * os + i], r = ref[j * os + i];
                    /* rows past the last 16 take the pair tile: tolerance there */
                    int good = (exact && i < NW / 16 * 16) || i >= NW
                                   ? f == r : fabsf(f - r) <= 1e-4f * (1.0f + fabsf(r)) * sqrtf((float)n);
                    if (!good && ok) fprintf(stderr, "  q8_0 %d rows x %d n=%lld [%d,%d]: %.9g vs %.9g\n", NW, na,
                                             (long long)n, j, i, f, r);
                    ok &= good;
                }
        }
    }
    CHECK(ok, "%s Q8_0 tiles of %d rows vs reference (%s)", quant_kernel_name(), NW, exact ? "bit for bit" : "tolerance");
    free(tmp); free(w); free(a);
}

/* Q4_1 / Q5_1 tiles of few and many rows: every set equal to the
 * reference bit for bit (the x86 sets put 16 or 8 weight rows across the
 * lanes and replay its per-block arithmetic, the NEON sets replay it per
 * row), tails of the row groups included (1, 5, 17 and 37 rows), so a
 * verification step's rows equal the one-row decode; 4, 5, 8 and 9
 * activation rows cross the walks' 4 and 8, 130 blocks the 128-block pass. */
static void test_b32u_rows_type(uint32_t wt) {
    enum { NW = 37, NA = 70 };
    const int64_t lens[3] = { 32, 576, 130 * 32 };
    const int nws[4] = { 1, 5, 17, NW };
    const int nas[9] = { 1, 2, 3, 4, 5, 8, 9, 17, NA };
    int64_t nmax = lens[2];
    size_t wrb = row_bytes(wt, nmax) + 24, arb = row_bytes(GGML_TYPE_Q8_1, nmax) + 36;
    float *tmp = malloc(sizeof(float) * nmax * NA);
    uint8_t *w = malloc(wrb * NW), *a = malloc(arb * NA);
    static float out[NA * (NW + 3)], ref[NA * (NW + 3)];
    int ok = 1;
    for (int li = 0; li < 3; li++) {
        int64_t n = lens[li];
        for (int64_t i = 0; i < n * NW; i++) tmp[i] = rng_normal() + 0.5f;   /* mins away from zero */
        for (int i = 0; i < NW; i++) quant_quantize_weight_rows(wt, tmp + i * n, w + wrb * i, 1, n);
        for (int64_t i = 0; i < n * NA; i++) tmp[i] = rng_normal();
        for (int r = 0; r < NA; r++) quant_ref_quantize_act_row(GGML_TYPE_Q8_1, tmp + r * n, a + arb * r, n);
        for (int c = 0; c < 9 * 4; c++) {
            int na = nas[c % 9], nw = nws[c / 9];
            size_t os = NW + 3;
            for (size_t k = 0; k < sizeof out / sizeof out[0]; k++) out[k] = ref[k] = -999.0f;
            quant_mul_mat_tile(wt, n, w, wrb, nw, a, arb, na, out, os);
            quant_ref_mul_mat_tile(wt, n, w, wrb, nw, a, arb, na, ref, os);
            for (int j = 0; j < NA; j++)
                for (int i = 0; i < (int)os; i++) {
                    float f = out[j * os + i], r = ref[j * os + i];
                    int good = f == r;
                    if (!good && ok) fprintf(stderr, "  %s %d rows x %d n=%lld [%d,%d]: %.9g vs %.9g\n", tname(wt), nw,
                                             na, (long long)n, j, i, f, r);
                    ok &= good;
                }
        }
    }
    CHECK(ok, "%s %s tiles of 1-%d rows x 1-%d equal the reference bit for bit", quant_kernel_name(), tname(wt), NW, NA);
    free(tmp); free(w); free(a);
}

static void test_b32u_rows(void) {
    test_b32u_rows_type(GGML_TYPE_Q4_1);
    test_b32u_rows_type(GGML_TYPE_Q5_1);
}

/* Packed weights (quant.h): packing round-trips, and every set's product
 * over packed rows equals the reference on the plain rows bit for bit, for
 * decode (1-3 activation rows) and prefill shapes; the longest Q8_0 row
 * crosses the 128-block pass. */
static void test_packed_type(uint32_t t, const int64_t lens[3]) {
    enum { NW = 80, NA = 70 };   /* past 64 rows and 64 activation rows: the buffered tiles of the K-quant walks */
    const int nas[7] = { 1, 2, 3, 5, 9, 13, NA };
    const uint32_t at = quant_vec_dot_type(t);
    int64_t nmax = lens[2];
    size_t rbmax = row_bytes(t, nmax), abmax = row_bytes(at, nmax);
    float *tmp = malloc(sizeof(float) * nmax * (NW > NA ? NW : NA));
    uint8_t *w = malloc(rbmax * NW), *pk = malloc(rbmax * NW), *row = malloc(rbmax), *a = malloc(abmax * NA);
    static float out[NA * (NW + 3)], ref[NA * (NW + 3)];
    int ok_rt = 1, ok_mm = 1;
    for (int li = 0; li < 3; li++) {
        int64_t n = lens[li];
        size_t rb = row_bytes(t, n), ab = row_bytes(at, n);
        for (int64_t i = 0; i < n * NW; i++) tmp[i] = rng_normal();
        quant_quantize_weight_rows(t, tmp, w, NW, n);
        for (int64_t i = 0; i < n * NA; i++) tmp[i] = rng_normal();
        for (int r = 0; r < NA; r++) quant_ref_quantize_act_row(at, tmp + r * n, a + ab * r, n);
        CHECK(quant_pack_rows(t, w, rb, NW, pk) == 0, "pack %d %s rows of %lld", NW, tname(t), (long long)n);
        for (int i = 0; i < NW; i++) {
            quant_unpack_row(t, pk + (size_t)(i / 16) * 16 * rb, rb, i % 16, row);
            ok_rt &= memcmp(row, w + rb * i, rb) == 0;
        }
        for (int c = 0; c < 7; c++) {
            int na = nas[c];
            size_t os = NW + 3;
            for (size_t k = 0; k < sizeof out / sizeof out[0]; k++) out[k] = ref[k] = -999.0f;
            quant_mul_mat_tile_packed(t, n, pk, rb, NW, a, ab, na, out, os);
            quant_ref_mul_mat_tile(t, n, w, rb, NW, a, ab, na, ref, os);
            for (int k = 0; k < NA * (NW + 3); k++) {
                if (out[k] != ref[k] && ok_mm)
                    fprintf(stderr, "  packed %s n=%lld na=%d [%d]: %.9g vs %.9g\n", tname(t), (long long)n, na, k,
                            out[k], ref[k]);
                ok_mm &= out[k] == ref[k];
            }
        }
    }
    CHECK(ok_rt, "%s: packed %s rows unpack to the original bytes", quant_kernel_name(), tname(t));
    CHECK(ok_mm, "%s: products over packed %s rows equal the reference bit for bit", quant_kernel_name(), tname(t));
    CHECK(quant_pack_rows(t, w, row_bytes(t, lens[0]), 17, pk) == -1, "%s: 17 rows are not whole groups", tname(t));
    CHECK(quant_pack_pays(t) == !strcmp(quant_kernel_name(), "avx512"),
          "%s: packing %s pays only where the set has packed kernels", quant_kernel_name(), tname(t));
    free(tmp); free(w); free(pk); free(row); free(a);
}

static void test_packed(void) {
    const int64_t l32[3] = { 32, 1024, 130 * 32 }, lk[3] = { 256, 1024, 17 * 256 };
    test_packed_type(GGML_TYPE_Q8_0, l32);
    test_packed_type(GGML_TYPE_Q4_0, l32);
    test_packed_type(GGML_TYPE_Q5_0, l32);
    test_packed_type(GGML_TYPE_Q4_K, lk);
    test_packed_type(GGML_TYPE_Q5_K, lk);
    test_packed_type(GGML_TYPE_Q6_K, lk);
    uint8_t w[2 * 256 * 16], pk[sizeof w];
    memset(w, 0, sizeof w);
    CHECK(quant_pack_rows(GGML_TYPE_F16, w, 2 * 256, 16, pk) == -1, "F16 has no packed layout");
    CHECK(!quant_pack_pays(GGML_TYPE_F16) && !quant_pack_pays(GGML_TYPE_BF16), "no packing without a layout");
}

static void test_kernels(void) {
    const char *names[16];
    int n = quant_kernel_sets(names, 16);
    const char *best = quant_kernel_name();
    CHECK(n >= 1 && n <= 16 && strcmp(names[0], "ref") == 0, "kernel sets start with ref (%d sets)", n);
    /* the default is the best set, or the one TANDEM_KERNELS names where this
     * CPU runs it; an empty or unknown TANDEM_KERNELS leaves the best (quant_dispatch.c) */
    const char *forced = getenv("TANDEM_KERNELS");
    const char *want = n >= 1 && n <= 16 ? names[n - 1] : "?";
    for (int i = 0; forced && *forced && i < n && i < 16; i++)
        if (!strcmp(names[i], forced)) want = names[i];
    CHECK(strcmp(want, best) == 0, "the default set is %s (TANDEM_KERNELS=%s), got %s", want, forced ? forced : "(unset)",
          best);
#if defined(__x86_64__)
    /* one build: on any x86-64 with AVX2/FMA/F16C the avx2 set is there */
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        CHECK(quant_use_kernels("avx2") == 0, "avx2 set present on an AVX2 CPU");
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw"))
        CHECK(quant_use_kernels("avx512") == 0, "avx512 set present on an AVX-512 VNNI CPU");
#elif defined(__aarch64__) && defined(__linux__)
    /* one build: neon on every arm64, dotprod exactly where the CPU has sdot,
     * i8mm where it also has smmla (tools/arm64_check.sh runs this on CPU
     * models with neither, with sdot only, and with both) */
    int has_dot = (int)(getauxval(AT_HWCAP) >> 20 & 1), has_mm = has_dot && (getauxval(AT_HWCAP2) >> 13 & 1);
    CHECK(quant_use_kernels("neon") == 0, "neon set present on arm64");
    CHECK((quant_use_kernels("dotprod") == 0) == has_dot, "dotprod set present %s the CPU has sdot",
          has_dot ? "where" : "only where");
    CHECK((quant_use_kernels("i8mm") == 0) == has_mm, "i8mm set present %s the CPU has sdot and smmla",
          has_mm ? "where" : "only where");
    printf("arm64 hwcaps: dot products %s, int8 matrix multiplies %s\n", has_dot ? "yes" : "no",
           has_mm ? "yes" : "no");
#endif
    for (int i = 1; i < n && i < 16; i++) {
        CHECK(quant_use_kernels(names[i]) == 0 && strcmp(quant_kernel_name(), names[i]) == 0, "select %s", names[i]);
        test_act_quant();
        test_kernel_set();
        test_q8_many_rows();
        test_b32u_rows();
        test_packed();
    }
    quant_force_reference(1);
    test_packed();     /* the plain C walk of the packed layout */
    CHECK(quant_use_kernels("no-such-set") == -1, "unknown set refused");
    quant_force_reference(1);
    CHECK(strcmp(quant_kernel_name(), "ref") == 0, "force reference");
    quant_force_reference(0);
    CHECK(strcmp(quant_kernel_name(), names[n - 1]) == 0, "back to the best set");
    quant_use_kernels(best);
}

static void test_types(void) {
    for (size_t i = 0; i < N_WTYPES; i++) CHECK(quant_is_supported(wtypes[i]), "%s supported", tname(wtypes[i]));
    CHECK(!quant_is_supported(GGML_TYPE_Q8_1) && !quant_is_supported(GGML_TYPE_IQ2_XXS), "unsupported types");
    CHECK(quant_vec_dot_type(GGML_TYPE_Q4_1) == GGML_TYPE_Q8_1 && quant_vec_dot_type(GGML_TYPE_Q5_1) == GGML_TYPE_Q8_1,
          "Q4_1 / Q5_1 meet Q8_1 activations (they carry the sum the min needs)");
    CHECK(quant_vec_dot_type(GGML_TYPE_Q4_0) == GGML_TYPE_Q8_0 && quant_vec_dot_type(GGML_TYPE_Q6_K) == GGML_TYPE_Q8_K,
          "vec_dot types");
    CHECK(quant_vec_dot_type(GGML_TYPE_F16) == GGML_TYPE_F32 && quant_vec_dot_type(GGML_TYPE_BF16) == GGML_TYPE_F32,
          "half-precision weights take f32 activations");
    CHECK(sizeof(block_q4_0) == 18 && sizeof(block_q5_0) == 22 && sizeof(block_q8_0) == 34 &&
          sizeof(block_q4_K) == 144 && sizeof(block_q5_K) == 176 && sizeof(block_q6_K) == 210 &&
          sizeof(block_q8_K) == 292 && sizeof(block_q4_1) == 20 && sizeof(block_q5_1) == 24 &&
          sizeof(block_q8_1) == 36, "block sizes");
}

/* ==== Real tensors ==== */
/* Dequantize some rows of every quantized tensor and compare with the F16 original. */
static void check_fixture(const char *qname, const char *fname) {
    char qp[512], fp[512], err[256];
    snprintf(qp, sizeof qp, "%s/models/%s", t_fixtures(), qname);
    snprintf(fp, sizeof fp, "%s/%s", t_models(), fname);
    gguf_file *qf = NULL, *ff = NULL;
    if (!t_need(qp) || !t_need(fp)) return;
    if (gguf_open_file(&qf, qp, err, sizeof err) != 0 || gguf_open_file(&ff, fp, err, sizeof err) != 0) {
        CHECK(0, "open %s / %s: %s", qp, fp, err);
        if (qf) gguf_close(qf);
        return;
    }
    int checked[GGML_TYPE_COUNT] = { 0 };
    double worst[GGML_TYPE_COUNT] = { 0 }, mine_worst[GGML_TYPE_COUNT] = { 0 };
    float *y = malloc(sizeof(float) * 200000), *ref = malloc(sizeof(float) * 200000);
    void *requant = malloc(200000 * 4);
    int kernels_ok = 1;
    for (int64_t ti = 0; ti < gguf_count_tensors(qf); ti++) {
        const gguf_tensor *qt = gguf_get_tensor(qf, ti);
        if (qt->type == GGML_TYPE_F32 || !quant_is_supported(qt->type)) continue;
        char name[256];
        snprintf(name, sizeof name, "%.*s", (int)qt->name.len, qt->name.ptr);
        const gguf_tensor *ft = gguf_find_tensor(ff, name);
        if (!ft || ft->ne[0] != qt->ne[0] || qt->ne[0] > 200000) { CHECK(ft != NULL, "%s missing in F16", name); continue; }
        int64_t n = (int64_t)qt->ne[0], nrows = (int64_t)(qt->nbytes / row_bytes(qt->type, n));
        size_t qrb = row_bytes(qt->type, n), frb = row_bytes(ft->type, n);
        CHECK(qrb * (size_t)nrows == qt->nbytes, "%s: row size", name);
        int64_t pick[3] = { 0, nrows / 2, nrows - 1 };
        for (int p = 0; p < 3; p++) {
            int64_t r = pick[p];
            quant_dequantize_row(qt->type, (const char *)qt->data + qrb * r, y, n);
            quant_dequantize_row(ft->type, (const char *)ft->data + frb * r, ref, n);
            double se = 0, sx = 0;
            for (int64_t i = 0; i < n; i++) { se += ((double)y[i] - ref[i]) * (y[i] - ref[i]); sx += (double)ref[i] * ref[i]; }
            double rel = sx > 0 ? sqrt(se / sx) : 0;
            if (rel > worst[qt->type]) worst[qt->type] = rel;
            /* our own quantizer on the same row should do about as well as llama-quantize */
            quant_quantize_weight_rows(qt->type, ref, requant, 1, n);
            quant_dequantize_row(qt->type, requant, y, n);
            se = 0;
            for (int64_t i = 0; i < n; i++) se += ((double)y[i] - ref[i]) * (y[i] - ref[i]);
            double mine = sx > 0 ? sqrt(se / sx) : 0;
            if (mine > mine_worst[qt->type]) mine_worst[qt->type] = mine;
            /* and fast vs reference on a real row */
            if (n <= 4096) {
                float *act = malloc(sizeof(float) * n);
                void *aq = malloc(row_bytes(GGML_TYPE_F32, n));
                for (int64_t i = 0; i < n; i++) act[i] = rng_normal();
                quant_quantize_act_row(quant_vec_dot_type(qt->type), act, aq, n);
                float sf, sr;
                quant_vec_dot(qt->type, n, &sf, (const char *)qt->data + qrb * r, aq);
                quant_ref_vec_dot(qt->type, n, &sr, (const char *)qt->data + qrb * r, aq);
                if (fabsf(sf - sr) > 1e-4f * (fabsf(sr) + 1.0f)) kernels_ok = 0;
                free(act); free(aq);
            }
        }
        checked[qt->type]++;
    }
    /* bounds: the format's typical error on gaussian weights with margin */
    for (uint32_t t = 0; t < GGML_TYPE_COUNT; t++) {
        if (!checked[t]) continue;
        double bound = t == GGML_TYPE_Q4_K ? 0.12 : t == GGML_TYPE_Q4_0 || t == GGML_TYPE_Q4_1 ? 0.16
                     : t == GGML_TYPE_Q5_0 || t == GGML_TYPE_Q5_1 ? 0.08 :
                       t == GGML_TYPE_Q5_K ? 0.06 : t == GGML_TYPE_Q6_K ? 0.035 : t == GGML_TYPE_Q8_0 ? 0.01 : 1e-6;
        printf("  %s %s: %d tensors, rel rms error %.4f (our quantizer %.4f)\n", qname, tname(t), checked[t],
               worst[t], mine_worst[t]);
        CHECK(worst[t] < bound, "%s %s: dequantized vs F16 rel error %.4f", qname, tname(t), worst[t]);
        CHECK(mine_worst[t] < 1.3 * worst[t] + 1e-6, "%s %s: our quantizer error %.4f vs llama-quantize %.4f", qname,
              tname(t), mine_worst[t], worst[t]);
    }
    CHECK(kernels_ok, "%s: fast vs reference on real rows", qname);
    free(y); free(ref); free(requant);
    gguf_close(qf);
    gguf_close(ff);
}

int main(void) {
    test_types();
    test_fp16();
    test_bf16();
    test_blocks_32();
    test_blocks_k();
    test_weight_quant();
    test_act_quant();
    test_kernels();
    check_fixture("qwen3-mini-Q4_K_M.gguf", "qwen3-mini-F16.gguf");
    check_fixture("qwen3moe-mini-Q4_K_M.gguf", "qwen3moe-mini-F16.gguf");
    check_fixture("qwen3-mini-Q8_0.gguf", "qwen3-mini-F16.gguf");
    check_fixture("qwen2-mini-Q4_0.gguf", "qwen2-mini-F16.gguf");
    return t_done("test_quant");
}
