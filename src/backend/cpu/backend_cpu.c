/* backend_cpu.c - the CPU implementation of backend.h.
 *
 * Matrix products quantise the activations once to the weight type's
 * vec_dot type (quant.h), then split the weight rows over the thread pool;
 * each thread walks its rows in small blocks and hands every block with all
 * tokens to quant_mul_mat_tile, which reuses each decoded weight block across
 * several tokens. Attention is tiled (flash-attention style, see below) and
 * split over (kv head, block of query tokens) items. Element-wise ops (ops.h)
 * are split over rows or ranges when they are big enough to pay for a wake-up.
 */
#include "engine/backend.h"

#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "engine/gguf.h"
#include "base/hugemap.h"
#include "base/platform.h"
#include "backend/cpu/ops.h"
#include "engine/quant.h"
#include "base/threadpool.h"

/* Weight rows per tile call: 64 rows of a 1024-wide Q8_0 matrix are 68 KiB,
 * which stays in L2 beside a 64-token tile of activations; 64 rather than 16
 * because the tile kernel prepares each activation block (scales, VNNI
 * offsets) once per call: about 5% less CPU time on a 512-token prefill. */
#define CPU_ROW_BLOCK 64
/* Tokens per tile call: bounds the activation working set to L2. */
#define CPU_TOK_BLOCK 64
_Static_assert(CPU_ROW_BLOCK % QUANT_PACK_ROWS == 0, "row blocks must start on a packed group");

typedef struct cpu_arena cpu_arena;

typedef struct {
    tpool *pool;
    int nth;
    uint8_t *qbuf;          /* quantised activations */
    size_t qbuf_size;
    float **scratch;        /* per-thread attention scratch */
    size_t *scratch_size;
    float *moe_buf;         /* MoE gather/scatter scratch */
    size_t moe_size;
    size_t moe_cap;         /* bytes of scratch one group of experts may fill (CPU_MOE_GROUP_BYTES) */
    cpu_arena *arenas;      /* packed weight copies (be_weight.dev), unmapped with the backend */
    const be_weight *next[4];   /* warm_next's hint for the next product, consumed by it */
    int n_next;
    tpool_warm *warm;       /* [nth] */
    /* RoPE's cos/sin of the last position list, reused while the positions
     * and the configuration stay the same: a pass rotates q and k of every
     * layer at the same positions (2 x n_layer calls, one table). */
    struct {
        int n;              /* rows in the table; 0: empty */
        rope_cfg rc;        /* the configuration it was made for */
        float ff[512];      /* its frequency factors' values (rc.freq_factors: where they were) */
        int32_t *pos;       /* [n] */
        float *cs;          /* [n][n_rot]: n_rot / 2 cosines, then the sines */
        size_t pos_size, cs_size;
    } rope;
} cpu_impl;

static cpu_impl *cpu_of(backend *be) { return (cpu_impl *)be->impl; }

/* ==== Memory ==== */

static int cpu_grow(void **buf, size_t *size, size_t need) {
    if (*size >= need) return 0;
    void *p = realloc(*buf, need);
    if (!p) return -1;
    *buf = p;
    *size = need;
    return 0;
}

static float *cpu_alloc(backend *be, size_t n) { (void)be; return calloc(n ? n : 1, sizeof(float)); }
static void cpu_release(backend *be, float *buf) { (void)be; free(buf); }
static void cpu_read(backend *be, const float *src, float *dst, size_t n) { (void)be; memmove(dst, src, n * sizeof(float)); }
static void cpu_write(backend *be, float *dst, const float *src, size_t n) { (void)be; memmove(dst, src, n * sizeof(float)); }

/* ==== Element-wise jobs ==== */

/* Below this many elements an element-wise op runs on the calling thread:
 * waking the pool costs about a microsecond. */
#define CPU_PAR_MIN 32768

typedef struct {
    int op;
    float *x;
    const float *y, *u, *w;
    float *out;
    size_t n, row;          /* elements (or rows) and row length */
    float eps;
    kvcache *kv;
    int layer, pos0;
    const int32_t *pos;
    const float *k, *v;
    const rope_cfg *rc;
    int n_head, head_dim;
} ew_job;

enum { EW_RMS, EW_SWIGLU, EW_ADD, EW_BIAS, EW_KV, EW_ROPE, EW_ROPE_TABLE };

static void rope_tokens(float *x, int t0, int t1, int n_head, int head_dim, const float *table, int n_rot, int mode);
static void rope_table_rows(float *table, int t0, int t1, const int32_t *pos, const rope_cfg *rc);

static void ew_run(void *ctx, int chunk, int nch) {
    ew_job *j = ctx;
    long lo, hi;
    tpool_split((long)j->n, chunk, nch, &lo, &hi);
    switch (j->op) {
    case EW_RMS:
        for (long r = lo; r < hi; r++)
            ops_rms_norm_row(j->y + (size_t)r * j->row, j->w, j->out + (size_t)r * j->row, j->row, j->eps);
        break;
    case EW_SWIGLU: ops_swiglu(j->y + lo, j->u + lo, j->out + lo, (size_t)(hi - lo)); break;
    case EW_ADD: ops_add(j->x + lo, j->y + lo, (size_t)(hi - lo)); break;
    case EW_BIAS:
        for (long r = lo; r < hi; r++) ops_add(j->x + (size_t)r * j->row, j->w, j->row);
        break;
    case EW_KV:
        if (hi > lo)
            kv_store_f32(j->kv, j->layer, j->pos0 + (int)lo, (int)(hi - lo), j->k + (size_t)lo * j->row,
                         j->v + (size_t)lo * j->row);
        break;
    case EW_ROPE: rope_tokens(j->x, (int)lo, (int)hi, j->n_head, j->head_dim, j->w, j->rc->n_rot, j->rc->mode); break;
    case EW_ROPE_TABLE: rope_table_rows(j->x, (int)lo, (int)hi, j->pos, j->rc); break;
    }
}

/* Run an element-wise job over j->n units (elements or rows), split over
 * the pool when it is big enough (`work`: elements touched). */
static void ew_exec(backend *be, ew_job *j, size_t work) {
    cpu_impl *c = cpu_of(be);
    if (c->nth == 1 || work < CPU_PAR_MIN || j->n < 2) { ew_run(j, 0, 1); return; }
    tpool_run(c->pool, ew_run, j);
}

/* ==== Embedding lookup ==== */

static int cpu_get_rows(backend *be, const be_weight *w, const int32_t *ids, int n, float *out) {
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= w->ne[1]) return -1;
        const uint8_t *row = (const uint8_t *)w->data + (size_t)ids[i] * w->row_bytes;
        quant_dequantize_row(w->type, row, out + (size_t)i * w->ne[0], w->ne[0]);
    }
    return 0;
}

/* ==== RMS norm ==== */

static void cpu_rms_norm(backend *be, const float *x, const be_weight *w, float *y, int n_rows, int dim, float eps) {
    const float *g = w ? (const float *)w->data : NULL;   /* norm weights are F32 (checked at load) */
    ew_job j = { .op = EW_RMS, .y = x, .w = g, .out = y, .n = (size_t)n_rows, .row = (size_t)dim, .eps = eps };
    ew_exec(be, &j, (size_t)n_rows * dim * 2);
}

/* ==== Matrix product ==== */

typedef struct {
    const be_weight *w;
    const uint8_t *wdata;
    const float *x;
    uint8_t *qx;
    size_t qrow;
    uint32_t vt;
    int n_tok;
    int packed;             /* wdata is w->dev: groups of QUANT_PACK_ROWS rows packed */
    float *y;
} mm_job;

static void mm_quantize(void *ctx, int ith, int nth) {
    mm_job *j = ctx;
    long lo, hi;
    tpool_split(j->n_tok, ith, nth, &lo, &hi);
    for (long t = lo; t < hi; t++)
        quant_quantize_act_row(j->vt, j->x + t * j->w->ne[0], j->qx + t * j->qrow, j->w->ne[0]);
}

/* Rows [lo, hi) of j's weight (whole row blocks: threads never share a
 * cache line of y), each block multiplied against all tokens in tiles. */
static void mm_rows(const mm_job *j, long lo, long hi) {
    const be_weight *w = j->w;
    long rows = w->ne[1];
    for (long r0 = lo; r0 < hi; r0 += CPU_ROW_BLOCK) {
        int nr = (int)((hi - r0) < CPU_ROW_BLOCK ? (hi - r0) : CPU_ROW_BLOCK);
        for (int t0 = 0; t0 < j->n_tok; t0 += CPU_TOK_BLOCK) {
            int nt = j->n_tok - t0 < CPU_TOK_BLOCK ? j->n_tok - t0 : CPU_TOK_BLOCK;
            int np = j->packed ? nr / QUANT_PACK_ROWS * QUANT_PACK_ROWS : 0;
            if (np)   /* chunks start on a group: CPU_ROW_BLOCK is a multiple of 16 */
                quant_mul_mat_tile_packed(w->type, w->ne[0], j->wdata + r0 * w->row_bytes, w->row_bytes, np,
                                          j->qx + (size_t)t0 * j->qrow, j->qrow, nt,
                                          j->y + (size_t)t0 * rows + r0, (size_t)rows);
            if (np < nr)
                quant_mul_mat_tile(w->type, w->ne[0], j->wdata + (r0 + np) * w->row_bytes, w->row_bytes, nr - np,
                                   j->qx + (size_t)t0 * j->qrow, j->qrow, nt,
                                   j->y + (size_t)t0 * rows + r0 + np, (size_t)rows);
        }
    }
}

static long mm_blocks(const be_weight *w) { return (w->ne[1] + CPU_ROW_BLOCK - 1) / CPU_ROW_BLOCK; }

/* Row block `blk` of j's weight. */
static void mm_block(const mm_job *j, long blk) {
    long rows = j->w->ne[1], r1 = (blk + 1) * CPU_ROW_BLOCK;
    mm_rows(j, blk * CPU_ROW_BLOCK, r1 < rows ? r1 : rows);
}

static void mm_compute(void *ctx, int blk, int tid) { mm_block(ctx, blk); }

/* Row blocks [0, n) over the pool, each thread walking a contiguous run of
 * them (tpool_run_ranges): with chunks claimed in turn, each thread's stream
 * of weights jumped every few blocks and the hardware prefetchers ran on
 * into the other thread's rows. Measured on a 2-core Zen 5, two threads
 * streaming packed Q4_K rows: 77 GB/s as two runs, 53 when alternating
 * 64-row blocks, 70 alternating 256-row ones. */
/* Bytes of the next product each thread prefetches once its share of the
 * current one is done (tpool_run_ranges_warm). Measured on a 2-core Zen 5,
 * Qwen3-0.6B decode, tokens alternated with and without in one process:
 * Q4_K_M 32 KiB 0.2%, 64 KiB 1.5%, 192 KiB 1.3%, 512 KiB 1.1% faster;
 * Q5_K_M 1.1%, 1.7%, 2.2%, 2.9%. 256 KiB is an eighth of a Zen 5 L2. */
#define CPU_WARM_BYTES (256 << 10)

/* The first bytes of each thread's run of row blocks in the hinted
 * product (its blocks numbered across the parts, as mm_run_many does),
 * into c->warm; 0 when there is no hint. The hint is used up. */
static int mm_warm_plan(cpu_impl *c) {
    if (!c->n_next) return 0;
    long total = 0;
    for (int i = 0; i < c->n_next; i++) total += mm_blocks(c->next[i]);
    for (int t = 0; t < c->nth; t++) {
        long lo, hi;
        tpool_split(total, t, c->nth, &lo, &hi);
        int i = 0;
        while (i < c->n_next && lo >= mm_blocks(c->next[i])) lo -= mm_blocks(c->next[i++]);
        c->warm[t] = (tpool_warm){ NULL, 0 };
        if (i == c->n_next || hi == lo) continue;
        const be_weight *w = c->next[i];
        size_t off = (size_t)lo * CPU_ROW_BLOCK * w->row_bytes, all = (size_t)w->ne[1] * w->row_bytes;
        c->warm[t].addr = (const uint8_t *)(w->dev ? w->dev : w->data) + off;
        c->warm[t].len = all - off < CPU_WARM_BYTES ? all - off : CPU_WARM_BYTES;
    }
    c->n_next = 0;
    return 1;
}

static void mm_run_blocks(cpu_impl *c, tpool_fn fn, void *ctx, long n) {
    int warm = mm_warm_plan(c);
    if (n > 0 && n <= INT_MAX) tpool_run_ranges_warm(c->pool, fn, ctx, (int)n, warm ? c->warm : NULL);
}

static void cpu_warm_next(backend *be, const be_weight *const *w, int n) {
    cpu_impl *c = cpu_of(be);
    c->n_next = 0;
    for (int i = 0; i < n && i < 4; i++)
        if (w[i] && w[i]->ne[2] <= 1) c->next[c->n_next++] = w[i];
}

/* Weight w (expert e of a 3-D one) for n_tok activation rows already
 * quantised at qx, into y. */
static void mm_part_init(mm_job *j, const be_weight *w, int expert, const uint8_t *qx, int n_tok, float *y) {
    memset(j, 0, sizeof *j);
    j->w = w;
    j->packed = w->dev != NULL;
    j->wdata = (const uint8_t *)(j->packed ? w->dev : w->data) + (size_t)expert * (size_t)w->ne[1] * w->row_bytes;
    j->vt = quant_vec_dot_type(w->type);
    j->qrow = gguf_row_bytes(j->vt, (uint64_t)w->ne[0]);
    j->qx = (uint8_t *)qx;
    j->n_tok = n_tok;
    j->y = y;
}

/* ==== Several products in one job ====
 * A decode step's MoE block is 8 experts x 3 small matrices: one pool job
 * for all the experts' gate and up products, one for their down products,
 * instead of a job (and a wait for the slowest thread) per matrix. The row
 * blocks of all parts are numbered one after the other; each part's results
 * are those of its own job, bit for bit. */
typedef struct {
    const mm_job *parts;
    const long *first;      /* [n + 1] first row block of each part */
    int n;
} mm_many;

static void mm_many_compute(void *ctx, int blk, int tid) {
    const mm_many *m = ctx;
    int p = 0;
    while (blk >= m->first[p + 1]) p++;
    mm_block(&m->parts[p], blk - m->first[p]);
}

static void mm_run_many(cpu_impl *c, const mm_job *parts, int n, long *first) {
    first[0] = 0;
    for (int i = 0; i < n; i++) first[i + 1] = first[i] + mm_blocks(parts[i].w);
    mm_many m = { parts, first, n };
    mm_run_blocks(c, mm_many_compute, &m, first[n]);
}

/* j's input x quantised into c->qbuf in j's vec_dot type: inline for one
 * row, on the pool for a batch; -1 when qbuf cannot grow. */
static int mm_quantize_input(cpu_impl *c, mm_job *j, const float *x) {
    if (cpu_grow((void **)&c->qbuf, &c->qbuf_size, j->qrow * (size_t)j->n_tok)) return -1;
    j->x = x;
    j->qx = c->qbuf;
    if (j->n_tok == 1) mm_quantize(j, 0, 1); else tpool_run(c->pool, mm_quantize, j);
    return 0;
}

static void cpu_mul_mat(backend *be, const be_weight *w, int expert, const float *x, int n_tok, float *y) {
    cpu_impl *c = cpu_of(be);
    mm_job j;
    mm_part_init(&j, w, expert, NULL, n_tok, y);
    if (mm_quantize_input(c, &j, x)) {
        /* Out of memory for a few MiB of activations: fall back to token
         * by token so the result is still right. */
        for (int t = 0; t < n_tok; t++) cpu_mul_mat(be, w, expert, x + (size_t)t * w->ne[0], 1, y + (size_t)t * w->ne[1]);
        return;
    }
    mm_run_blocks(c, mm_compute, &j, mm_blocks(w));
}

/* Several weights of one input: quantised once when they share its
 * conversion (same width and vec_dot type), then every part's row blocks in
 * one job (mm_run_many); otherwise one product after the other. */
static void cpu_mul_mat_n(backend *be, const be_weight *const *w, int n, const float *x, int n_tok, float *const *y) {
    cpu_impl *c = cpu_of(be);
    mm_job parts[4];
    long first[5];
    int same = n >= 1 && n <= 4;
    for (int i = 1; same && i < n; i++)
        same = w[i]->ne[0] == w[0]->ne[0] && quant_vec_dot_type(w[i]->type) == quant_vec_dot_type(w[0]->type);
    if (same) {
        mm_part_init(&parts[0], w[0], 0, NULL, n_tok, y[0]);
        same = !mm_quantize_input(c, &parts[0], x);
    }
    if (!same) {
        for (int i = 0; i < n; i++) cpu_mul_mat(be, w[i], 0, x, n_tok, y[i]);
        return;
    }
    for (int i = 1; i < n; i++) mm_part_init(&parts[i], w[i], 0, c->qbuf, n_tok, y[i]);
    mm_run_many(c, parts, n, first);
}

static void cpu_add_bias(backend *be, float *x, const be_weight *b, int n_tok) {
    ew_job j = { .op = EW_BIAS, .x = x, .w = (const float *)b->data, .n = (size_t)n_tok, .row = (size_t)b->ne[0] };
    ew_exec(be, &j, (size_t)n_tok * b->ne[0]);
}

/* ==== RoPE ==== */

/* The table rows [t0, t1): row t holds cos then sin of the n_rot / 2
 * angles at position pos[t]. theta is advanced by repeated multiplication
 * in float, as ggml does, so that positions far into the context round the
 * same way. */
static void rope_table_rows(float *table, int t0, int t1, const int32_t *pos, const rope_cfg *rc) {
    const int n_rot = rc->n_rot, half = n_rot / 2;
    const float theta_scale = powf(rc->freq_base, -2.0f / (float)n_rot);
    for (int t = t0; t < t1; t++) {
        float *cs = table + (size_t)t * n_rot, *sn = cs + half;
        float theta = (float)pos[t];
        for (int i = 0; i < half; i++) {
            float ff = rc->freq_factors ? rc->freq_factors[i] : 1.0f;
            float th = theta / ff * rc->freq_scale;
            cs[i] = cosf(th);
            sn[i] = sinf(th);
            theta *= theta_scale;
        }
    }
}

/* Rows [t0, t1) of x rotated by their table rows, every head alike. */
static void rope_tokens(float *x, int t0, int t1, int n_head, int head_dim, const float *table, int n_rot, int mode) {
    const int half = n_rot / 2;
    for (int t = t0; t < t1; t++) {
        const float *cs = table + (size_t)t * n_rot, *sn = cs + half;
        for (int h = 0; h < n_head; h++) {
            float *v = x + ((size_t)t * n_head + h) * head_dim;
            if (mode == ROPE_NEOX) {
                float *a = v, *b = v + half;
                for (int i = 0; i < half; i++) {   /* vectorises: no overlap between a and b */
                    float x0 = a[i], x1 = b[i];
                    a[i] = x0 * cs[i] - x1 * sn[i];
                    b[i] = x0 * sn[i] + x1 * cs[i];
                }
            } else {
                for (int i = 0; i < half; i++) {
                    float x0 = v[2 * i], x1 = v[2 * i + 1];
                    v[2 * i] = x0 * cs[i] - x1 * sn[i];
                    v[2 * i + 1] = x0 * sn[i] + x1 * cs[i];
                }
            }
        }
    }
}

/* Whether the table made for (a, its factors' values ff) serves b. */
static int rope_cfg_same(const rope_cfg *a, const float *ff, const rope_cfg *b) {
    if (a->mode != b->mode || a->n_rot != b->n_rot || a->freq_base != b->freq_base || a->freq_scale != b->freq_scale ||
        !a->freq_factors != !b->freq_factors)
        return 0;
    return !b->freq_factors || !memcmp(ff, b->freq_factors, sizeof(float) * (size_t)(b->n_rot / 2));
}

/* The table for these positions: the last one if it still fits, else made
 * now (on the pool for a long prompt: about 60 adds' worth per pair). NULL
 * when it cannot grow. */
static const float *rope_table(backend *be, int n_tok, const int32_t *pos, const rope_cfg *rc) {
    cpu_impl *c = cpu_of(be);
    if (c->rope.n == n_tok && rope_cfg_same(&c->rope.rc, c->rope.ff, rc) &&
        !memcmp(c->rope.pos, pos, sizeof *pos * (size_t)n_tok))
        return c->rope.cs;
    c->rope.n = 0;
    if (rc->n_rot / 2 > (int)(sizeof c->rope.ff / sizeof c->rope.ff[0])) return NULL;   /* refused at load */
    if (cpu_grow((void **)&c->rope.pos, &c->rope.pos_size, sizeof *pos * (size_t)n_tok) ||
        cpu_grow((void **)&c->rope.cs, &c->rope.cs_size, sizeof(float) * (size_t)n_tok * (size_t)rc->n_rot))
        return NULL;
    memcpy(c->rope.pos, pos, sizeof *pos * (size_t)n_tok);
    ew_job j = { .op = EW_ROPE_TABLE, .x = c->rope.cs, .n = (size_t)n_tok, .pos = c->rope.pos, .rc = rc };
    ew_exec(be, &j, (size_t)n_tok * (size_t)rc->n_rot * 30);
    c->rope.rc = *rc;
    if (rc->freq_factors) memcpy(c->rope.ff, rc->freq_factors, sizeof(float) * (size_t)(rc->n_rot / 2));
    c->rope.n = n_tok;
    return c->rope.cs;
}

static void cpu_rope(backend *be, float *x, int n_tok, int n_head, int head_dim, const int32_t *pos,
                     const rope_cfg *rc) {
    if (n_tok < 1 || rc->n_rot < 2) return;
    const float *table = rope_table(be, n_tok, pos, rc);
    float one[1024];
    if (!table) {   /* no memory for a table: one row at a time on the stack */
        if (rc->n_rot > 1024) return;   /* refused at load */
        for (int t = 0; t < n_tok; t++) {
            rope_table_rows(one, 0, 1, pos + t, rc);
            rope_tokens(x + (size_t)t * n_head * head_dim, 0, 1, n_head, head_dim, one, rc->n_rot, rc->mode);
        }
        return;
    }
    ew_job j = { .op = EW_ROPE, .x = x, .w = table, .n = (size_t)n_tok, .n_head = n_head, .head_dim = head_dim,
                 .rc = rc };
    ew_exec(be, &j, (size_t)n_tok * (size_t)n_head * (size_t)head_dim);
}

/* ==== Attention ====
 * Tiled causal attention. An item is one block of query rows of one
 * sequence and one KV head: its (about) ATT_QVEC query vectors, the grp =
 * n_head / n_head_kv heads that share the KV head for several tokens, meet
 * the cache in blocks of 128 positions (ops_attn_scores), each block's
 * scores one small matrix product (the tile kernel, with the cache's K rows
 * as weight rows), so each K row is read once per query block instead of
 * once per token and stays in L1 for all the block's queries. Then each
 * row's softmax, and its weighted sum of V rows (ops_attn_pv, all rows of
 * the block in one walk of the positions). Decode is the same walk with one
 * token (ops_attn_scores streams the keys for up to 8 query rows).
 *
 * The softmax is not online (flash attention's running max and rescaled
 * partial sums): a row's scores are kept whole ([query rows][positions]
 * scratch per thread, linear in the context) so that every row is computed
 * exactly as before tiling, in the same order: the quantised golden tests sit
 * close to their tolerances, and the online form's different rounding moved
 * two of them past it (measured: 0.6031 vs 0.60 on qwen3 Q4_K_M, 0.3223 vs
 * 0.30 on qwen2 Q4_0). q meets the cache in the cache type's vec_dot type
 * (f32 for an F16 or BF16 cache, Q8_0 for a Q8_0 cache), and the
 * probabilities stay f32: what the primary oracle computes with flash
 * attention off. */

/* Query vectors per item: each K/V row read is shared by 64 vectors, and
 * 64 rows of scores at 4096 positions are 1 MiB (L2). */
#define ATT_QVEC 64

typedef struct {
    cpu_impl *c;
    const float *q;
    const be_batch *b;
    int layer, n_head, n_head_kv, head_dim;
    float scale;
    float *out;
    int qb;                 /* tokens per query block */
    long *first;            /* [n_seq + 1] first item of each sequence */
    long n_items;
    int n_chunks;
} attn_job;

/* Bytes of scratch one item of nq query vectors needs over npos positions. */
static size_t attn_scratch_bytes(int nq, size_t npos, int hd) {
    return sizeof(float) * ((size_t)nq * npos + 2 * (size_t)nq * hd + (size_t)hd + 32 + ops_attn_tmp(hd));
}

/* Query tokens [t0, t0 + nt) of sequence sq against KV head kvh. */
static void attn_block(const attn_job *j, const be_seq *sq, int kvh, int t0, int nt, float *scratch) {
    const int hd = j->head_dim, grp = j->n_head / j->n_head_kv, nq = nt * grp;
    const kvcache *kv = sq->kv;
    const uint32_t dt = kv_dtype(kv), vt = quant_vec_dot_type(dt);
    const size_t hb = kv_head_bytes(kv);                  /* a head's positions are hb apart */
    const int p_first = sq->pos0 + t0, p_end = p_first + nt;   /* query positions [p_first, p_end) */
    const size_t ss = (size_t)p_end;                      /* score row stride */
    float *S = scratch;                                   /* [nq][p_end] scores, then probabilities */
    float *O = S + (size_t)nq * ss;                       /* [nq][hd] outputs */
    float *tmp = O + (size_t)nq * hd;                     /* [hd] */
    uint8_t *qc = (uint8_t *)(tmp + hd);                  /* nq rows of q in vt (<= 4 bytes a value) */
                                                          /* then ops_attn_scores' scratch */
    /* query vector r = i * grp + g: token t0 + i, head kvh * grp + g (contiguous in q) */
    const float *q0 = j->q + (((size_t)sq->t0 + t0) * j->n_head + (size_t)kvh * grp) * hd;
    const size_t qstride = (size_t)j->n_head * hd, qrow = gguf_row_bytes(vt, (uint64_t)hd);
    for (int i = 0; i < nt; i++)
        for (int g = 0; g < grp; g++)
            quant_quantize_act_row(vt, q0 + i * qstride + (size_t)g * hd, qc + (size_t)(i * grp + g) * qrow, hd);
    /* scaled scores: the last rows' causal triangle is computed and then ignored */
    float *kt = (float *)(qc + ((size_t)nq * qrow + 63) / 64 * 64);
    ops_attn_scores(dt, kv_k_head(kv, j->layer, kvh), hb, p_end, qc, qrow, nq, hd, j->scale, S, ss, kt);
    for (int r = 0; r < nq; r++) {
        float *s = S + (size_t)r * ss;
        size_t npos = (size_t)(p_first + r / grp + 1);
        float mx = ops_max(s, npos);
        double sum = ops_exp_sum(s, mx, s, npos);
        ops_scale(s, (float)(1.0 / sum), npos);
        /* masked positions weigh exactly 0: adding 0 * V leaves a sum unchanged */
        if (npos < ss) memset(s + npos, 0, sizeof(float) * (ss - npos));
    }
    ops_attn_pv(dt, kv_v_head(kv, j->layer, kvh), hb, p_end, S, ss, nq, hd, O, kt);
    for (int i = 0; i < nt; i++)
        memcpy(j->out + (((size_t)sq->t0 + t0 + i) * j->n_head + (size_t)kvh * grp) * hd,
               O + (size_t)i * grp * hd, sizeof(float) * (size_t)grp * hd);
}

/* Items are numbered sequence by sequence, and within one sequence head-major
 * (a head's K/V rows stay in cache across its query blocks); they are cut
 * into more chunks than threads, because later query blocks see more keys
 * and threads claim chunks as they free up. */
static void attn_run(void *ctx, int chunk, int tid) {
    attn_job *j = ctx;
    long lo, hi;
    tpool_split(j->n_items, chunk, j->n_chunks, &lo, &hi);
    int s = 0;
    for (long i = lo; i < hi; i++) {
        while (i >= j->first[s + 1]) s++;
        const be_seq *sq = &j->b->seq[s];
        long nblk = (sq->n + j->qb - 1) / j->qb, k = i - j->first[s];
        int t0 = (int)(k % nblk) * j->qb, nt = sq->n - t0 < j->qb ? sq->n - t0 : j->qb;
        attn_block(j, sq, (int)(k / nblk), t0, nt, j->c->scratch[tid]);
    }
}

static int cpu_attention(backend *be, const float *q, const be_batch *b, int layer,
                          int n_head, int n_head_kv, int head_dim, float scale, float *out) {
    cpu_impl *c = cpu_of(be);
    if (n_head_kv < 1 || n_head % n_head_kv || b->n_seq < 1 || head_dim < 1) return -1;
    int grp = n_head / n_head_kv, qb = ATT_QVEC / grp > 1 ? ATT_QVEC / grp : 1;
    long *first = malloc(sizeof(long) * (size_t)(b->n_seq + 1));
    if (!first) return -1;
    first[0] = 0;
    for (int s = 0; s < b->n_seq; s++)
        first[s + 1] = first[s] + (long)((b->seq[s].n + qb - 1) / qb) * n_head_kv;
    size_t max_pos = 0;
    for (int s = 0; s < b->n_seq; s++)
        if ((size_t)b->seq[s].pos0 + (size_t)b->seq[s].n > max_pos) max_pos = (size_t)b->seq[s].pos0 + b->seq[s].n;
    size_t need = attn_scratch_bytes(qb * grp, max_pos, head_dim);
    for (int i = 0; i < c->nth; i++)
        if (cpu_grow((void **)&c->scratch[i], &c->scratch_size[i], need)) { free(first); return -1; }
    attn_job j = { c, q, b, layer, n_head, n_head_kv, head_dim, scale, out, qb, first, first[b->n_seq], 0 };
    j.n_chunks = c->nth == 1 ? 1 : (int)(j.n_items < 16L * c->nth ? j.n_items : 16L * c->nth);
    tpool_run_chunks(c->pool, attn_run, &j, j.n_chunks);
    free(first);
    return 0;
}

/* ==== Element-wise ops ==== */

static void cpu_kv_store(backend *be, const be_batch *b, int layer, const float *k, const float *v) {
    for (int s = 0; s < b->n_seq; s++) {
        const be_seq *sq = &b->seq[s];
        size_t row = (size_t)kv_dim(sq->kv), off = (size_t)sq->t0 * row;
        ew_job j = { .op = EW_KV, .kv = sq->kv, .layer = layer, .pos0 = sq->pos0, .k = k + off, .v = v + off,
                     .n = (size_t)sq->n, .row = row };
        ew_exec(be, &j, (size_t)sq->n * row * 2);
    }
}

static void cpu_swiglu(backend *be, const float *g, const float *u, float *y, size_t n) {
    ew_job j = { .op = EW_SWIGLU, .y = g, .u = u, .out = y, .n = n };
    ew_exec(be, &j, n * 8);   /* exp costs several adds' worth */
}

static void cpu_add(backend *be, float *x, const float *y, size_t n) {
    ew_job j = { .op = EW_ADD, .x = x, .y = y, .n = n };
    ew_exec(be, &j, n);
}

/* ==== Mixture of experts ==== */

void moe_select_experts(const float *logits, int n, int k, int norm, int32_t *ids, float *w) {
    float mx = -INFINITY;
    for (int i = 0; i < n; i++) if (logits[i] > mx) mx = logits[i];
    double sum = 0.0;
    float p[256];
    for (int i = 0; i < n; i++) { p[i] = expf(logits[i] - mx); sum += p[i]; }
    for (int i = 0; i < n; i++) p[i] = (float)(p[i] / sum);
    for (int s = 0; s < k; s++) {
        int best = -1;
        for (int i = 0; i < n; i++) {
            int taken = 0;
            for (int q = 0; q < s; q++) if (ids[q] == i) taken = 1;
            if (!taken && (best < 0 || p[i] > p[best])) best = i;
        }
        ids[s] = best;
        w[s] = p[best];
    }
    if (norm) {
        float tot = 0.0f;
        for (int s = 0; s < k; s++) tot += w[s];
        for (int s = 0; s < k; s++) w[s] /= tot;
    }
}

/* Scratch a MoE block's experts may fill at once (products, SwiGLU inputs,
 * quantised rows): the used experts are taken in groups of whole experts
 * whose rows fit it. 64 MiB holds all 4096 (token, expert) rows of a
 * 512-token pass of Qwen3-30B-A3B's shape (n_embd 2048, expert ffn 768, 8
 * of 128 used) in one group; one expert's rows always make a group. */
#define CPU_MOE_GROUP_BYTES ((size_t)64 << 20)

/* The experts' rows: for every used expert in index order, the (token,
 * slot) pairs routed to it. n_act experts; tok[] and slot[] (n_tok * k
 * entries) hold their pairs one expert after the other, start[a] where
 * expert act[a]'s begin. */
typedef struct {
    int n_act, act[256], start[257];   /* at most 256 experts (checked) */
    int *tok, *slot;
} moe_rows;

/* Counting sort of the (token, slot) pairs by expert, tokens then slots in
 * order within each. NULL when out of memory; free() releases it whole. */
static moe_rows *moe_gather(const int32_t *sel, int n_tok, int k, int ne) {
    moe_rows *r = malloc(sizeof *r + sizeof(int) * 2 * (size_t)n_tok * k);
    if (!r) return NULL;
    r->tok = (int *)(r + 1);
    r->slot = r->tok + (size_t)n_tok * k;
    int count[256] = {0}, at[256];
    for (size_t i = 0; i < (size_t)n_tok * k; i++) count[sel[i]]++;
    int n = 0;
    r->n_act = 0;
    for (int e = 0; e < ne; e++) {
        at[e] = n;
        if (count[e]) { r->act[r->n_act] = e; r->start[r->n_act++] = n; }
        n += count[e];
    }
    r->start[r->n_act] = n;
    for (int t = 0; t < n_tok; t++)
        for (int s = 0; s < k; s++) {
            int i = at[sel[(size_t)t * k + s]]++;
            r->tok[i] = t;
            r->slot[i] = s;
        }
    return r;
}

/* One group of experts, act[a0, a1): their rows [i0, i1) of the routing
 * table. Buffers hold the group's rows from 0. */
typedef struct {
    const be_moe *m;
    const moe_rows *r;
    const float *x, *selw;
    float *y;
    int a0, a1, i0, i1, n_tok;
    int64_t dim, nff;
    uint32_t vg, vu, vd;    /* vec_dot types of gate, up, down */
    int rg, ru, rd;         /* 1: that matrix is F16, its f32 input rows are rounded to f16 */
    size_t qg, qu, qd;      /* their quantised row bytes */
    uint8_t *xg, *xu, *hq;  /* gate's and up's inputs (xu == xg when they share a type), down's */
    float *gate, *up, *down;
} moe_group;

/* An f32 input row of an F16 expert matrix, rounded to f16 in place. Both
 * oracles multiply the experts (ggml's mul_mat_id) against activations
 * converted to F16, F16's vec_dot_type, while tandem's dense products keep
 * them f32 as ik_llama.cpp's do (quant.h). Measured on qwen3moe-mini-F16,
 * "03_multilingual" of shared/cases/moe-divergence.jsonl against
 * ik_llama.cpp: unrounded, logits 0.11 apart at worst and another greedy
 * token at step 22 (a router near-tie at prompt position 53, layer 2, 2nd
 * and 3rd experts 2e-4..6e-4 apart, resolved the other way); a float64
 * forward with these rows rounded is 0.0075 from the oracle at worst. */
static void moe_round_f16(float *x, int64_t n) {
    fp16_t h[1024];   /* chunks, converted by the kernel set's (F16C) path */
    for (int64_t i = 0; i < n; i += 1024) {
        int64_t m = n - i < 1024 ? n - i : 1024;
        quant_quantize_act_row(GGML_TYPE_F16, x + i, h, m);
        quant_dequantize_row(GGML_TYPE_F16, h, x + i, m);
    }
}

/* Rows [lo, hi) of the group's inputs, quantised for gate and up. */
static void moe_quantize_in(void *ctx, int ith, int nth) {
    const moe_group *g = ctx;
    long lo, hi;
    tpool_split(g->i1 - g->i0, ith, nth, &lo, &hi);
    for (long i = lo; i < hi; i++) {
        const float *xr = g->x + (size_t)g->r->tok[g->i0 + i] * g->dim;
        uint8_t *yg = g->xg + (size_t)i * g->qg, *yu = g->xu + (size_t)i * g->qu;
        quant_quantize_act_row(g->vg, xr, yg, g->dim);
        if (g->rg) moe_round_f16((float *)yg, g->dim);
        if (g->xu != g->xg) {
            quant_quantize_act_row(g->vu, xr, yu, g->dim);
            if (g->ru) moe_round_f16((float *)yu, g->dim);
        }
    }
}

/* Rows of SwiGLU's output, quantised for down. */
static void moe_quantize_mid(void *ctx, int ith, int nth) {
    const moe_group *g = ctx;
    long lo, hi;
    tpool_split(g->i1 - g->i0, ith, nth, &lo, &hi);
    for (long i = lo; i < hi; i++) {
        quant_quantize_act_row(g->vd, g->gate + (size_t)i * g->nff, g->hq + (size_t)i * g->qd, g->nff);
        if (g->rd) moe_round_f16((float *)(g->hq + (size_t)i * g->qd), g->nff);
    }
}

/* y[t] += weight x down row, tokens [lo, hi) of this thread: every thread
 * walks the group's rows in order, so each token's sum runs in expert order
 * whatever the split (the serial loop's bits). */
static void moe_scatter(void *ctx, int ith, int nth) {
    const moe_group *g = ctx;
    long lo, hi;
    tpool_split(g->n_tok, ith, nth, &lo, &hi);
    const int k = g->m->n_expert_used;
    for (int i = g->i0; i < g->i1; i++) {
        int t = g->r->tok[i];
        if (t < lo || t >= hi) continue;
        float wt = g->selw[(size_t)t * k + g->r->slot[i]];
        ops_axpy(wt, g->down + (size_t)(i - g->i0) * g->dim, g->y + (size_t)t * g->dim, (size_t)g->dim);
    }
}

/* A row job on the pool, or on this thread when the group is small (a
 * decode step's 8 rows: waking the pool would cost more than the rows). */
static void moe_rows_run(cpu_impl *c, tpool_fn fn, moe_group *g, size_t work) {
    if (c->nth == 1 || work < CPU_PAR_MIN) fn(g, 0, 1); else tpool_run(c->pool, fn, g);
}

/* The group's experts: every gate and up product in one pool job, SwiGLU,
 * every down product in a second job, then the weighted sums. Each product
 * is the one expert's rows against its own weights, as a product of that
 * expert alone would be: the same tiles, the same bits. */
static void moe_group_run(cpu_impl *c, backend *be, moe_group *g, mm_job *parts, long *first) {
    const int n = g->i1 - g->i0;
    moe_rows_run(c, moe_quantize_in, g, (size_t)n * g->dim);
    for (int a = g->a0; a < g->a1; a++) {
        int e = g->r->act[a], o = g->r->start[a] - g->i0, cnt = g->r->start[a + 1] - g->r->start[a];
        mm_job *p = &parts[2 * (a - g->a0)];
        mm_part_init(p, g->m->gate_exps, e, g->xg + (size_t)o * g->qg, cnt, g->gate + (size_t)o * g->nff);
        mm_part_init(p + 1, g->m->up_exps, e, g->xu + (size_t)o * g->qu, cnt, g->up + (size_t)o * g->nff);
    }
    mm_run_many(c, parts, 2 * (g->a1 - g->a0), first);
    cpu_swiglu(be, g->gate, g->up, g->gate, (size_t)n * g->nff);   /* element-wise: the same bits in one call */
    moe_rows_run(c, moe_quantize_mid, g, (size_t)n * g->nff);
    for (int a = g->a0; a < g->a1; a++) {
        int o = g->r->start[a] - g->i0, cnt = g->r->start[a + 1] - g->r->start[a];
        mm_part_init(&parts[a - g->a0], g->m->down_exps, g->r->act[a], g->hq + (size_t)o * g->qd, cnt,
                     g->down + (size_t)o * g->dim);
    }
    mm_run_many(c, parts, g->a1 - g->a0, first);
    moe_rows_run(c, moe_scatter, g, (size_t)n * g->dim);
}

/* Rows of scratch one group may hold: whole experts from a0 on while their
 * rows fit `cap`, at least one. Returns a1. */
static int moe_group_end(const moe_rows *r, int a0, size_t cap) {
    int a1 = a0 + 1;
    while (a1 < r->n_act && (size_t)(r->start[a1 + 1] - r->start[a0]) <= cap) a1++;
    return a1;
}

/* Tokens are grouped by expert, so each expert's matrices are multiplied
 * once against all the tokens routed to it (a matrix-matrix product in
 * prefill), then the outputs are added back with their weights in expert
 * order. A group of experts runs as six pool jobs, where each expert had
 * been seven (quantising and product for gate, for up and for down, and
 * SwiGLU): a 512-token pass of a 128-expert model had waited for the
 * slowest thread 7 x 128 times a layer. */
static int cpu_moe_ffn(backend *be, const be_moe *m, const float *x, int n_tok, float *y) {
    cpu_impl *c = cpu_of(be);
    const int ne = m->n_expert, k = m->n_expert_used;
    if (ne > 256 || k > ne || k < 1 || n_tok < 1) return -1;
    moe_group g = { .m = m, .x = x, .y = y, .n_tok = n_tok, .dim = m->gate_inp->ne[0], .nff = m->gate_exps->ne[1],
                    .vg = quant_vec_dot_type(m->gate_exps->type), .vu = quant_vec_dot_type(m->up_exps->type),
                    .vd = quant_vec_dot_type(m->down_exps->type),
                    .rg = m->gate_exps->type == GGML_TYPE_F16, .ru = m->up_exps->type == GGML_TYPE_F16,
                    .rd = m->down_exps->type == GGML_TYPE_F16 };
    const int shared = g.vu == g.vg && g.ru == g.rg;   /* gate and up read one quantised copy of x */
    g.qg = gguf_row_bytes(g.vg, (uint64_t)g.dim);
    g.qu = gguf_row_bytes(g.vu, (uint64_t)g.dim);
    g.qd = gguf_row_bytes(g.vd, (uint64_t)g.nff);
    const size_t row_f = (size_t)(2 * g.nff + g.dim), row_q = g.qg + (shared ? 0 : g.qu) + g.qd;
    const size_t rows = (size_t)n_tok * k, cap = c->moe_cap / (row_f * sizeof(float) + row_q);

    /* the router: logits, then each token's experts and weights */
    size_t head = (size_t)n_tok * ne + rows * 2;
    if (cpu_grow((void **)&c->moe_buf, &c->moe_size, sizeof(float) * head)) return -1;
    float *logits = c->moe_buf;
    cpu_mul_mat(be, m->gate_inp, 0, x, n_tok, logits);
    int32_t *sel = (int32_t *)(logits + (size_t)n_tok * ne);
    float *selw = (float *)(sel + rows);
    for (int t = 0; t < n_tok; t++)
        moe_select_experts(logits + (size_t)t * ne, ne, k, m->norm_topk, sel + (size_t)t * k, selw + (size_t)t * k);
    moe_rows *r = moe_gather(sel, n_tok, k, ne);
    mm_job *parts = malloc(sizeof(mm_job) * 2 * (size_t)ne);
    long *first = malloc(sizeof(long) * (2 * (size_t)ne + 1));
    int rc = -1;
    if (!r || !parts || !first) goto out;

    /* the groups' scratch: the biggest group's rows */
    size_t most = 0;
    for (int a0 = 0, a1; a0 < r->n_act; a0 = a1) {
        a1 = moe_group_end(r, a0, cap);
        size_t n = (size_t)(r->start[a1] - r->start[a0]);
        if (n > most) most = n;
    }
    if (cpu_grow((void **)&c->moe_buf, &c->moe_size, sizeof(float) * (head + most * row_f)) ||
        cpu_grow((void **)&c->qbuf, &c->qbuf_size, most * row_q))
        goto out;
    logits = c->moe_buf;   /* moved by the growth */
    g.selw = (float *)((int32_t *)(logits + (size_t)n_tok * ne) + rows);
    g.r = r;
    g.gate = logits + head;
    g.up = g.gate + most * g.nff;
    g.down = g.up + most * g.nff;
    g.xg = c->qbuf;
    g.xu = shared ? g.xg : g.xg + most * g.qg;
    g.hq = g.xu + most * g.qu;

    memset(y, 0, sizeof(float) * (size_t)n_tok * g.dim);
    for (g.a0 = 0; g.a0 < r->n_act; g.a0 = g.a1) {
        g.a1 = moe_group_end(r, g.a0, cap);
        g.i0 = r->start[g.a0];
        g.i1 = r->start[g.a1];
        moe_group_run(c, be, &g, parts, first);
    }
    rc = 0;
out:
    free(r); free(parts); free(first);
    return rc;
}

/* ==== Packed weights ====
 * At load, a matrix whose type the active kernel set multiplies packed
 * (quant_pack_pays) is copied into the interleaved layout of quant.h by all
 * the pool's threads; the mmap stays for get_rows and for rows past the last
 * whole group. A copy that cannot be made (memory) is not an error: the
 * plain rows still work. */
typedef struct {
    const be_weight *w;
    uint8_t *dst;
    int64_t groups;
} pack_job;

static void pack_run(void *ctx, int ith, int nth) {
    pack_job *j = ctx;
    long lo, hi;
    tpool_split(j->groups, ith, nth, &lo, &hi);
    size_t gb = (size_t)QUANT_PACK_ROWS * j->w->row_bytes;
    if (hi > lo)
        quant_pack_rows(j->w->type, (const uint8_t *)j->w->data + (size_t)lo * gb, j->w->row_bytes,
                        (int64_t)(hi - lo) * QUANT_PACK_ROWS, j->dst + (size_t)lo * gb);
}

/* The plain rows of a packed weight are not read again: give their pages
 * back, so a model does not hold its weights twice. MADV_PAGEOUT reclaims
 * them (a file mapping's are read from the file again if they ever are;
 * any other memory is swapped, never lost), and takes them out of the page
 * cache too, so that a later fault near them (the kernel maps a cached
 * large folio whole) does not map them back. It skips a page another
 * process maps as well: two nodes loading one file at once each kept the
 * whole file mapped beside its packed copy (Qwen3-0.6B Q8_0 started 0.5 s
 * apart: 609.8 MiB of file pages each, 43.5 MiB alone). So rows in the
 * model file's read-only mapping then leave this process with
 * MADV_DONTNEED (plat_map_drop), whoever else maps them; the last node to
 * drop them reclaims them. */
static void cpu_drop_pages(const be_weight *w, size_t bytes) {
#if defined(MADV_PAGEOUT)
    long pg = sysconf(_SC_PAGESIZE);
    if (pg <= 0) return;
    uintptr_t lo = ((uintptr_t)w->data + (uintptr_t)pg - 1) & ~((uintptr_t)pg - 1);
    uintptr_t hi = ((uintptr_t)w->data + bytes) & ~((uintptr_t)pg - 1);
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_PAGEOUT);
#endif
    if (w->file_mapped) plat_map_drop(w->data, bytes);
}

/* Packed copies live in anonymous mappings of CPU_ARENA_BYTES (or one per
 * bigger matrix) marked for transparent huge pages, filled one matrix after
 * the other: a decode step streams every weight once, and with 4 KiB pages
 * the hardware prefetchers stop at each page boundary and every page costs
 * a TLB walk. Measured on a 2-core Zen 5 VM, two threads streaming packed
 * rows through the decode walks: Q4_K 59-61 -> 75 GB/s, Q6_K 61-64 -> 62-70
 * (a plain read: 75-86 either way). Pages never written are never backed,
 * so an arena's unused tail costs address space only. */
#define CPU_ARENA_BYTES ((size_t)256 << 20)

struct cpu_arena {
    cpu_arena *next;
    uint8_t *base;
    size_t size, used;
};

static cpu_arena *cpu_arena_new(size_t need) {
    cpu_arena *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    a->base = hugemap_alloc(need > CPU_ARENA_BYTES ? need : CPU_ARENA_BYTES, &a->size);
    if (!a->base) { free(a); return NULL; }
    return a;
}

/* bytes at a 64-byte boundary in an arena with room (a new one if none has) */
static void *cpu_arena_take(cpu_impl *c, size_t bytes) {
    size_t need = (bytes + 63) & ~(size_t)63;
    for (cpu_arena *a = c->arenas; a; a = a->next)
        if (a->size - a->used >= need) { void *p = a->base + a->used; a->used += need; return p; }
    cpu_arena *a = cpu_arena_new(need);
    if (!a) return NULL;
    a->next = c->arenas;
    c->arenas = a;
    a->used = need;
    return a->base;
}

static void cpu_arena_free_all(cpu_impl *c) {
    while (c->arenas) {
        cpu_arena *a = c->arenas;
        c->arenas = a->next;
        hugemap_free(a->base, a->size);
        free(a);
    }
}

static int cpu_load_weight(backend *be, be_weight *w, char *err, size_t errlen) {
    cpu_impl *c = cpu_of(be);
    int64_t rows = w->ne[1] * (w->ne[2] > 0 ? w->ne[2] : 1);
    if (w->rows_only || w->dev || !quant_pack_pays(w->type) || w->ne[1] % QUANT_PACK_ROWS || rows <= 0) return 0;
    size_t bytes = (size_t)rows * w->row_bytes;
    void *p = cpu_arena_take(c, bytes);
    if (!p) return 0;
    pack_job j = { .w = w, .dst = p, .groups = rows / QUANT_PACK_ROWS };
    tpool_run(c->pool, pack_run, &j);
    w->dev = p;
    cpu_drop_pages(w, bytes);
    return 0;
}

/* Loading is over: the last huge page an arena's packing touched is
 * backed whole, up to 2 MiB of it past the last weight (448 KiB for a
 * 7-layer slice of Qwen3-0.6B Q8_0); those pages go back. */
static void cpu_load_done(backend *be) {
    for (cpu_arena *a = cpu_of(be)->arenas; a; a = a->next) hugemap_trim(a->base, a->size, a->used);
}

/* ==== Table ==== */

static void cpu_destroy(backend *be) {
    if (!be) return;
    cpu_impl *c = cpu_of(be);
    if (c) {
        tpool_destroy(c->pool);
        for (int i = 0; i < c->nth; i++) free(c->scratch ? c->scratch[i] : NULL);
        free(c->scratch);
        free(c->scratch_size);
        free(c->warm);
        free(c->qbuf);
        free(c->moe_buf);
        free(c->rope.pos);
        free(c->rope.cs);
        cpu_arena_free_all(c);
        free(c);
    }
    free(be);
}

static const backend_ops cpu_ops = {
    .name = "cpu", .destroy = cpu_destroy, .alloc = cpu_alloc, .release = cpu_release,
    .read = cpu_read, .write = cpu_write, .get_rows = cpu_get_rows, .rms_norm = cpu_rms_norm,
    .mul_mat = cpu_mul_mat, .mul_mat_n = cpu_mul_mat_n, .add_bias = cpu_add_bias, .rope = cpu_rope,
    .attention = cpu_attention,
    .kv_store = cpu_kv_store, .swiglu = cpu_swiglu, .add = cpu_add, .moe_ffn = cpu_moe_ffn,
    .load_weight = cpu_load_weight, .warm_next = cpu_warm_next, .load_done = cpu_load_done,
};

backend *backend_cpu_create(int n_threads) {
    backend *be = calloc(1, sizeof *be);
    cpu_impl *c = calloc(1, sizeof *c);
    if (!be || !c) { free(be); free(c); return NULL; }
    be->ops = &cpu_ops;
    be->impl = c;
    c->pool = tpool_create(n_threads);
    c->nth = tpool_size(c->pool);
    c->scratch = calloc((size_t)c->nth, sizeof *c->scratch);
    c->scratch_size = calloc((size_t)c->nth, sizeof *c->scratch_size);
    c->warm = calloc((size_t)c->nth, sizeof *c->warm);
    if (!c->pool || !c->scratch || !c->scratch_size || !c->warm) { cpu_destroy(be); return NULL; }
    c->moe_cap = CPU_MOE_GROUP_BYTES;
    return be;
}

int backend_cpu_threads(const backend *be) { return ((const cpu_impl *)be->impl)->nth; }

void backend_cpu_set_moe_scratch(backend *be, size_t bytes) { cpu_of(be)->moe_cap = bytes ? bytes : CPU_MOE_GROUP_BYTES; }
