/* test_gguf.c - the GGUF reader on every fixture, on truncated and corrupted
 * files, and the writer round trip. */
#include "engine/gguf.h"
#include "t.h"

#include <dirent.h>
#include <stdint.h>
#include <unistd.h>

/* ==== Helpers ==== */

static unsigned char *slurp(const char *path, size_t *size)
{
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return NULL;
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    unsigned char *p = malloc(n > 0 ? (size_t)n : 1);
    if (p && fread(p, 1, (size_t)n, fp) != (size_t)n) {
        free(p);
        p = NULL;
    }
    fclose(fp);
    *size = (size_t)n;
    return p;
}

static int has(const char *s, const char *sub) { return strstr(s, sub) != NULL; }

static uint32_t get_u32(const gguf_file *f, const char *key)
{
    uint32_t v = 0xdeadbeef;
    gguf_get_u32(f, key, &v);
    return v;
}

static int64_t arr_len(const gguf_file *f, const char *key)
{
    gguf_arr a;
    return gguf_get_arr(f, key, &a) == 0 ? (int64_t)a.n : -1;
}

static int shape_is(const gguf_tensor *t, uint32_t n_dims, uint64_t a, uint64_t b, uint64_t c)
{
    return t && t->n_dims == n_dims && t->ne[0] == a && t->ne[1] == b && t->ne[2] == c && t->ne[3] == 1;
}

/* Generic invariants every successfully opened file must satisfy. */
static void check_invariants(const gguf_file *f, const char *path)
{
    const unsigned char *base = gguf_get_base(f);
    uint64_t size = gguf_get_size(f), doff = gguf_get_data_offset(f), al = gguf_get_alignment(f);
    int bad = 0;
    CHECK(gguf_get_version(f) == 3 || gguf_get_version(f) == 2, "%s: version %u", path, gguf_get_version(f));
    /* A file without tensors may end right after its metadata, unpadded. */
    CHECK(al && !(al & (al - 1)) && doff <= size && (doff % al == 0 || (gguf_count_tensors(f) == 0 && doff == size)),
          "%s: alignment %llu data offset %llu", path,
          (unsigned long long)al, (unsigned long long)doff);
    for (int64_t i = 0; i < gguf_count_tensors(f); i++) {
        const gguf_tensor *t = gguf_get_tensor(f, i);
        const unsigned char *d = t->data;
        if (d < base + doff || t->nbytes > size || d + t->nbytes > base + size || t->offset % al
            || (uint64_t)(d - base) != doff + t->offset
            || t->nbytes != gguf_row_bytes(t->type, t->ne[0]) * t->ne[1] * t->ne[2] * t->ne[3])
            bad++;
        char name[300];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        if (gguf_find_tensor(f, name) != t)
            bad++;
    }
    CHECK(bad == 0, "%s: %d tensor invariant failures", path, bad);
    /* Every kv is found by its key; every string of every array is readable. */
    bad = 0;
    for (int64_t i = 0; i < gguf_count_kv(f); i++) {
        gguf_str k = gguf_kv_key(f, i);
        char key[GGUF_MAX_KEY_LEN + 1];
        snprintf(key, sizeof key, "%.*s", (int)k.len, k.ptr);
        if (gguf_find_kv(f, key) != i)
            bad++;
        gguf_arr a;
        if (gguf_kv_type(f, i) == GGUF_VT_ARR && gguf_get_arr(f, key, &a) == 0
            && a.elem_type == GGUF_VT_STR) {
            /* in order and at random: the same string, inside the file */
            gguf_str_iter it;
            gguf_str_iter_init(&it, &a);
            for (uint64_t j = 0; j < a.n; j++) {
                gguf_str s, r;
                if (gguf_str_iter_next(&it, &s) || gguf_arr_str(&a, j, &r) || r.ptr != s.ptr || r.len != s.len
                    || (const unsigned char *)s.ptr < base || (const unsigned char *)s.ptr + s.len > base + size)
                    bad++;
            }
            gguf_str s;
            if (gguf_arr_str(&a, a.n, &s) == 0 || gguf_str_iter_next(&it, &s) == 0)
                bad++;
        }
    }
    CHECK(bad == 0, "%s: %d kv invariant failures", path, bad);
    CHECK(gguf_find_kv(f, "no.such.key") == -1 && gguf_find_tensor(f, "no.such.tensor") == NULL,
          "%s: absent lookups", path);
    CHECK(gguf_kv_type(f, -1) == UINT32_MAX && gguf_kv_key(f, gguf_count_kv(f)).len == 0
          && gguf_get_tensor(f, gguf_count_tensors(f)) == NULL, "%s: out-of-range index", path);
}

/* ==== Type table ==== */

static void test_types(void)
{
    static const struct { uint32_t t, blk, bytes; const char *name; } want[] = {
        {0, 1, 4, "F32"}, {1, 1, 2, "F16"}, {2, 32, 18, "Q4_0"}, {3, 32, 20, "Q4_1"},
        {6, 32, 22, "Q5_0"}, {7, 32, 24, "Q5_1"}, {8, 32, 34, "Q8_0"}, {9, 32, 36, "Q8_1"},
        {10, 256, 84, "Q2_K"}, {11, 256, 110, "Q3_K"}, {12, 256, 144, "Q4_K"},
        {13, 256, 176, "Q5_K"}, {14, 256, 210, "Q6_K"}, {15, 256, 292, "Q8_K"},
        {16, 256, 66, "IQ2_XXS"}, {17, 256, 74, "IQ2_XS"}, {18, 256, 98, "IQ3_XXS"},
        {19, 256, 50, "IQ1_S"}, {20, 32, 18, "IQ4_NL"}, {21, 256, 110, "IQ3_S"},
        {22, 256, 82, "IQ2_S"}, {23, 256, 136, "IQ4_XS"}, {24, 1, 1, "I8"}, {25, 1, 2, "I16"},
        {26, 1, 4, "I32"}, {27, 1, 8, "I64"}, {28, 1, 8, "F64"}, {29, 256, 56, "IQ1_M"},
        {30, 1, 2, "BF16"}, {34, 256, 54, "TQ1_0"}, {35, 256, 66, "TQ2_0"}, {39, 32, 17, "MXFP4"},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        uint32_t b = 0, s = 0;
        int ok = gguf_type_geometry(want[i].t, &b, &s);
        CHECK(ok && b == want[i].blk && s == want[i].bytes && strcmp(gguf_type_name(want[i].t), want[i].name) == 0,
              "type %u: got %d %u/%u %s", want[i].t, ok, b, s, gguf_type_name(want[i].t));
    }
    static const uint32_t unknown[] = {4, 5, 31, 32, 33, 36, 37, 38, 40, 99, 0xffffffffu};
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
        uint32_t b = 7;
        CHECK(!gguf_type_geometry(unknown[i], &b, NULL) && b == 7
              && strcmp(gguf_type_name(unknown[i]), "unknown") == 0
              && gguf_row_bytes(unknown[i], 256) == 0, "type %u must be unknown", unknown[i]);
    }
    CHECK(gguf_row_bytes(GGML_TYPE_Q4_K, 512) == 288, "Q4_K row");
    CHECK(gguf_row_bytes(GGML_TYPE_Q4_K, 128) == 0, "Q4_K partial block");
    CHECK(gguf_row_bytes(GGML_TYPE_F16, 3) == 6, "F16 row");
    CHECK(gguf_row_bytes(GGML_TYPE_F32, UINT64_MAX / 2) == 0, "row byte overflow is 0");
}

/* ==== Fixtures ==== */

static gguf_file *open_or_skip(const char *dir, const char *name, char *path, size_t cap)
{
    char err[512];
    gguf_file *f = NULL;
    snprintf(path, cap, "%s/%s", dir, name);
    if (!t_need(path))
        return NULL;
    int rc = gguf_open_file(&f, path, err, sizeof err);
    CHECK(rc == 0, "open %s: %s", path, err);
    return rc == 0 ? f : NULL;
}

static void test_every_fixture(void)
{
    static const char *subdirs[] = {"models", "vocab"};
    char dir[1024], path[2048];
    int n = 0;
    snprintf(dir, sizeof dir, "%s/models", t_fixtures());
    if (!t_need(dir))
        return;
    for (int s = 0; s < 3; s++) {
        if (s < 2)
            snprintf(dir, sizeof dir, "%s/%s", t_fixtures(), subdirs[s]);
        else
            snprintf(dir, sizeof dir, "%s", t_models());
        DIR *d = opendir(dir);
        if (!d)
            continue;
        struct dirent *e;
        while ((e = readdir(d))) {
            size_t l = strlen(e->d_name);
            if (l < 5 || strcmp(e->d_name + l - 5, ".gguf") != 0)
                continue;
            gguf_file *f = open_or_skip(dir, e->d_name, path, sizeof path);
            if (!f)
                continue;
            n++;
            check_invariants(f, path);
            gguf_close(f);
        }
        closedir(d);
    }
    CHECK(n >= 9, "expected at least the 9 shipped fixture files, opened %d", n);
}

static void check_qwen_vocab(const gguf_file *f, const char *path)
{
    gguf_arr a;
    gguf_str s;
    CHECK(gguf_get_arr(f, "tokenizer.ggml.tokens", &a) == 0 && a.elem_type == GGUF_VT_STR && a.n == 151936,
          "%s: tokens", path);
    CHECK(gguf_arr_str(&a, 151645, &s) == 0 && gguf_str_eq(s, "<|im_end|>"), "%s: token 151645", path);
    CHECK(gguf_arr_str(&a, 151935, &s) == 0 && gguf_str_eq(s, "[PAD151935]"), "%s: last token", path);
    CHECK(gguf_get_str(f, "tokenizer.ggml.model", &s) == 0 && gguf_str_eq(s, "gpt2"), "%s: model", path);
    CHECK(gguf_get_str(f, "tokenizer.ggml.pre", &s) == 0 && gguf_str_eq(s, "qwen2"), "%s: pre", path);
    CHECK(gguf_get_arr(f, "tokenizer.ggml.merges", &a) == 0 && a.elem_type == GGUF_VT_STR && a.n == 151387,
          "%s: merges", path);
    CHECK(gguf_get_arr(f, "tokenizer.ggml.token_type", &a) == 0 && a.elem_type == GGUF_VT_I32 && a.n == 151936,
          "%s: token_type", path);
}

static void check_qwen_model(const gguf_file *f, const char *path, const char *arch, uint32_t emb_type)
{
    char k[128];
    gguf_str s;
    float fb = 0;
    int bos = 1;
    CHECK(gguf_get_str(f, "general.architecture", &s) == 0 && gguf_str_eq(s, arch), "%s: arch", path);
    snprintf(k, sizeof k, "%s.block_count", arch);
    CHECK(get_u32(f, k) == 4, "%s: block_count", path);
    snprintf(k, sizeof k, "%s.embedding_length", arch);
    CHECK(get_u32(f, k) == 256, "%s: n_embd", path);
    snprintf(k, sizeof k, "%s.rope.freq_base", arch);
    CHECK(gguf_get_f32(f, k, &fb) == 0 && fb == 1e6f, "%s: freq_base %g", path, fb);
    CHECK(get_u32(f, "tokenizer.ggml.bos_token_id") == 151643 && get_u32(f, "tokenizer.ggml.eos_token_id") == 151645,
          "%s: bos/eos", path);
    CHECK(gguf_get_bool(f, "tokenizer.ggml.add_bos_token", &bos) == 0 && bos == 0, "%s: add_bos", path);
    const gguf_tensor *t = gguf_find_tensor(f, "token_embd.weight");
    CHECK(shape_is(t, 2, 256, 151936, 1) && t->type == emb_type, "%s: token_embd", path);
    check_qwen_vocab(f, path);
}

static void test_known_metadata(void)
{
    char path[2048];
    const char *fx = t_fixtures();
    char models[1024], vocab[1024];
    snprintf(models, sizeof models, "%s/models", fx);
    snprintf(vocab, sizeof vocab, "%s/vocab", fx);
    gguf_file *f;
    gguf_str s;
    gguf_arr a;

    if ((f = open_or_skip(models, "stories260K.gguf", path, sizeof path))) {
        CHECK(gguf_get_str(f, "general.architecture", &s) == 0 && gguf_str_eq(s, "llama"), "stories arch");
        CHECK(get_u32(f, "llama.block_count") == 5 && get_u32(f, "llama.embedding_length") == 64
              && get_u32(f, "llama.feed_forward_length") == 172 && get_u32(f, "llama.attention.head_count") == 8
              && get_u32(f, "llama.attention.head_count_kv") == 4, "stories hparams");
        CHECK(gguf_get_version(f) == 3 && gguf_get_alignment(f) == 32 && gguf_count_tensors(f) == 47 && arr_len(f, "tokenizer.ggml.tokens") == 512
              && arr_len(f, "tokenizer.ggml.scores") == 512, "stories counts");
        const gguf_tensor *t = gguf_find_tensor(f, "token_embd.weight");
        CHECK(shape_is(t, 2, 64, 512, 1) && t->type == GGML_TYPE_F32 && t->nbytes == 64 * 512 * 4, "stories embd");
        CHECK(shape_is(gguf_find_tensor(f, "blk.4.ffn_down.weight"), 2, 172, 64, 1), "stories ffn_down");
        CHECK(gguf_find_tensor(f, "output.weight") == NULL, "stories has tied output");
        CHECK(gguf_get_str(f, "tokenizer.ggml.model", &s) == 0 && gguf_str_eq(s, "llama"), "stories tokenizer");
        gguf_close(f);
    }
    if ((f = open_or_skip(models, "qwen3-mini-Q8_0.gguf", path, sizeof path))) {
        check_qwen_model(f, path, "qwen3", GGML_TYPE_Q8_0);
        CHECK(get_u32(f, "qwen3.attention.key_length") == 128 && get_u32(f, "qwen3.attention.head_count") == 4
              && get_u32(f, "qwen3.attention.head_count_kv") == 2, "qwen3 attention");
        CHECK(shape_is(gguf_find_tensor(f, "blk.0.attn_q.weight"), 2, 256, 512, 1), "qwen3 attn_q");
        CHECK(shape_is(gguf_find_tensor(f, "blk.3.attn_q_norm.weight"), 1, 128, 1, 1), "qwen3 q_norm");
        CHECK(gguf_find_tensor(f, "output.weight") == NULL && gguf_count_tensors(f) == 46, "qwen3 tied");
        gguf_str tmpl;
        CHECK(gguf_get_str(f, "tokenizer.chat_template", &tmpl) == 0 && tmpl.len > 100, "qwen3 template");
        gguf_close(f);
    }
    if ((f = open_or_skip(models, "qwen3-mini-Q4_K_M.gguf", path, sizeof path))) {
        check_qwen_model(f, path, "qwen3", GGML_TYPE_Q6_K);
        const gguf_tensor *t = gguf_find_tensor(f, "blk.0.attn_q.weight");
        CHECK(t && t->type == GGML_TYPE_Q4_K && t->nbytes == 144 * 512, "qwen3 Q4_K attn_q");
        gguf_close(f);
    }
    if ((f = open_or_skip(models, "qwen3moe-mini-Q4_K_M.gguf", path, sizeof path))) {
        check_qwen_model(f, path, "qwen3moe", GGML_TYPE_Q6_K);
        CHECK(get_u32(f, "qwen3moe.expert_count") == 8 && get_u32(f, "qwen3moe.expert_used_count") == 2
              && get_u32(f, "qwen3moe.expert_feed_forward_length") == 128, "moe hparams");
        CHECK(shape_is(gguf_find_tensor(f, "blk.0.ffn_gate_inp.weight"), 2, 256, 8, 1), "moe router");
        CHECK(shape_is(gguf_find_tensor(f, "blk.1.ffn_up_exps.weight"), 3, 256, 128, 8), "moe up");
        const gguf_tensor *d0 = gguf_find_tensor(f, "blk.0.ffn_down_exps.weight");
        const gguf_tensor *d2 = gguf_find_tensor(f, "blk.2.ffn_down_exps.weight");
        CHECK(shape_is(d0, 3, 128, 256, 8) && d0->type == GGML_TYPE_Q5_0 && d2 && d2->type == GGML_TYPE_Q8_0,
              "moe down types");
        gguf_close(f);
    }
    if ((f = open_or_skip(models, "qwen2-mini-Q4_0.gguf", path, sizeof path))) {
        check_qwen_model(f, path, "qwen2", GGML_TYPE_Q4_0);
        const gguf_tensor *t = gguf_find_tensor(f, "output.weight");
        CHECK(shape_is(t, 2, 256, 151936, 1) && t->type == GGML_TYPE_Q6_K, "qwen2 output");
        CHECK(shape_is(gguf_find_tensor(f, "blk.0.attn_q.bias"), 1, 256, 1, 1), "qwen2 q bias");
        gguf_close(f);
    }
    static const char *f16[][2] = {{"qwen3-mini-F16.gguf", "qwen3"}, {"qwen3moe-mini-F16.gguf", "qwen3moe"},
                                   {"qwen2-mini-F16.gguf", "qwen2"}};
    for (int i = 0; i < 3; i++) {
        if ((f = open_or_skip(t_models(), f16[i][0], path, sizeof path))) {
            check_qwen_model(f, path, f16[i][1], GGML_TYPE_F16);
            CHECK(gguf_get_alignment(f) == 32, "%s: alignment", path);
            gguf_close(f);
        }
    }
    if ((f = open_or_skip(vocab, "ggml-vocab-qwen2.gguf", path, sizeof path))) {
        CHECK(gguf_count_tensors(f) == 0, "vocab file has no tensors");
        check_qwen_vocab(f, path);
        gguf_close(f);
    }
    if ((f = open_or_skip(vocab, "ggml-vocab-llama-spm.gguf", path, sizeof path))) {
        CHECK(arr_len(f, "tokenizer.ggml.tokens") == 32000 && gguf_get_arr(f, "tokenizer.ggml.scores", &a) == 0
              && a.elem_type == GGUF_VT_F32 && a.n == 32000, "spm vocab");
        gguf_close(f);
    }
    if ((f = open_or_skip(vocab, "ggml-vocab-llama-bpe.gguf", path, sizeof path))) {
        CHECK(arr_len(f, "tokenizer.ggml.tokens") == 128256, "llama-bpe vocab");
        gguf_close(f);
    }
}

/* ==== Truncation ==== */

/* Open the first `cut` bytes from an exactly-sized heap copy (so the sanitizer
 * sees any read past the end); returns 1 if refused with a "truncated" error. */
static int refuses_cut(const unsigned char *src, size_t cut, char *err, size_t errlen)
{
    unsigned char *p = malloc(cut ? cut : 1);
    gguf_file *f = NULL;
    if (!p)
        return 0;
    if (cut)
        memcpy(p, src, cut);
    err[0] = 0;
    int rc = gguf_open_memory(&f, cut ? p : NULL, cut, err, errlen);
    gguf_close(f);
    free(p);
    return rc != 0 && f == NULL && has(err, "truncated");
}

static void test_truncation(void)
{
    char path[2048], err[512];
    size_t size;
    t_fixture_path(path, sizeof path, "models/stories260K.gguf");
    unsigned char *buf = slurp(path, &size);
    if (!buf)
        return;
    gguf_file *f;
    CHECK(gguf_open_memory(&f, buf, size, err, sizeof err) == 0, "stories from memory: %s", err);
    if (!f) {
        free(buf);
        return;
    }
    uint64_t doff = gguf_get_data_offset(f), end = 0;
    for (int64_t i = 0; i < gguf_count_tensors(f); i++) {
        const gguf_tensor *t = gguf_get_tensor(f, i);
        if (t->offset + t->nbytes > end)
            end = t->offset + t->nbytes;
    }
    gguf_close(f);
    end += doff;
    /* Every cut through the header, kvs, tensor infos and padding. */
    int bad = 0;
    for (size_t cut = 0; cut <= doff; cut++) {
        if (!refuses_cut(buf, cut, err, sizeof err)) {
            if (bad++ < 3)
                fprintf(stderr, "cut %zu: '%s'\n", cut, err);
        }
    }
    CHECK(bad == 0, "%d header cuts (of %llu) were not refused as truncated", bad, (unsigned long long)doff + 1);
    /* A sample of cuts through the tensor data, up to the last byte. */
    bad = 0;
    int n = 0;
    for (uint64_t cut = doff + 1; cut < end; cut += (end - doff) / 97 + 1, n++)
        bad += !refuses_cut(buf, (size_t)cut, err, sizeof err);
    bad += !refuses_cut(buf, (size_t)end - 1, err, sizeof err);
    CHECK(bad == 0 && n > 50, "%d of %d data cuts were not refused", bad, n);
    CHECK(refuses_cut(buf, (size_t)end - 1, err, sizeof err) && has(err, "needs 1 more bytes"),
          "last-byte cut message: %s", err);
    free(buf);
}

/* ==== Hand-built files ==== */

typedef struct { unsigned char *p; size_t n, cap; } bbuf;

static void b_put(bbuf *b, const void *src, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}
static void b_u32(bbuf *b, uint32_t v) { b_put(b, &v, 4); }   /* little-endian host */
static void b_u64(bbuf *b, uint64_t v) { b_put(b, &v, 8); }
static void b_str(bbuf *b, const char *s) { b_u64(b, strlen(s)); b_put(b, s, strlen(s)); }
static void b_pad(bbuf *b, size_t a) { static const char z[64]; b_put(b, z, (a - b->n % a) % a); }

/* One small file with knobs for breaking it. */
typedef struct {
    const char *magic;
    uint32_t version;
    int64_t n_kv, n_t;            /* -1: the true count */
    uint32_t align_type;          /* 0: no general.alignment kv */
    uint64_t align;
    int extra;                    /* which extra kv to append, see build() */
    const char *tname;
    const char *tname2;           /* second tensor's name */
    uint32_t n_dims, ttype;
    uint64_t ne[4], offset;
    uint64_t data_bytes;          /* data section size */
} spec;

enum { X_NONE, X_NESTED, X_UNKNOWN_VT, X_UNKNOWN_ELEM, X_DUP_KEY, X_EMPTY_KEY, X_LONG_KEY,
       X_HUGE_STR_ARR, X_HUGE_ARR, X_HUGE_STR };

static spec base_spec(void)
{
    spec s = { "GGUF", 3, -1, -1, 0, 0, X_NONE, "blk.0.attn_q.weight", "output.weight", 2,
               GGML_TYPE_F32, {8, 2, 1, 1}, 0, 144 };
    return s;
}

static void build(bbuf *b, const spec *s)
{
    static const uint8_t u8s[3] = {1, 2, 250};
    int n_extra = s->extra != X_NONE;
    uint64_t n_kv = 8 + (s->align_type != 0) + n_extra;
    b->n = 0;
    b_put(b, s->magic, 4);
    b_u32(b, s->version);
    b_u64(b, s->n_t == -1 ? 2 : (uint64_t)s->n_t);
    b_u64(b, s->n_kv == -1 ? n_kv : (uint64_t)s->n_kv);
    b_str(b, "general.architecture"); b_u32(b, GGUF_VT_STR); b_str(b, "test");
    b_str(b, "k.u8"); b_u32(b, GGUF_VT_U8); b_put(b, &u8s[2], 1);
    b_str(b, "k.i8"); b_u32(b, GGUF_VT_I8); int8_t i8 = -5; b_put(b, &i8, 1);
    b_str(b, "k.i32"); b_u32(b, GGUF_VT_I32); b_u32(b, (uint32_t)-7);
    b_str(b, "k.u64"); b_u32(b, GGUF_VT_U64); b_u64(b, 1ull << 40);
    b_str(b, "k.f64"); b_u32(b, GGUF_VT_F64); double big = 1e300; b_put(b, &big, 8);
    b_str(b, "k.bool"); b_u32(b, GGUF_VT_BOOL); b_put(b, &u8s[0], 1);
    b_str(b, "k.strs"); b_u32(b, GGUF_VT_ARR); b_u32(b, GGUF_VT_STR); b_u64(b, 3);
    b_str(b, "a"); b_str(b, ""); b_str(b, "ccc");
    if (s->align_type) {
        b_str(b, "general.alignment"); b_u32(b, s->align_type);
        if (s->align_type == GGUF_VT_U64) b_u64(b, s->align); else b_u32(b, (uint32_t)s->align);
    }
    switch (s->extra) {
    case X_NESTED: b_str(b, "k.nested"); b_u32(b, GGUF_VT_ARR); b_u32(b, GGUF_VT_ARR); b_u64(b, 1);
        b_u32(b, GGUF_VT_U8); b_u64(b, 1); b_put(b, u8s, 1); break;
    case X_UNKNOWN_VT: b_str(b, "k.weird"); b_u32(b, 13); b_u32(b, 0); break;
    case X_UNKNOWN_ELEM: b_str(b, "k.weird"); b_u32(b, GGUF_VT_ARR); b_u32(b, 77); b_u64(b, 1); b_u32(b, 0); break;
    case X_DUP_KEY: b_str(b, "k.u8"); b_u32(b, GGUF_VT_U8); b_put(b, u8s, 1); break;
    case X_EMPTY_KEY: b_str(b, ""); b_u32(b, GGUF_VT_U8); b_put(b, u8s, 1); break;
    case X_LONG_KEY: {
        char k[GGUF_MAX_KEY_LEN + 2];
        memset(k, 'k', sizeof k - 1);
        k[sizeof k - 1] = 0;
        b_str(b, k); b_u32(b, GGUF_VT_U8); b_put(b, u8s, 1); break;
    }
    case X_HUGE_STR_ARR: b_str(b, "k.big"); b_u32(b, GGUF_VT_ARR); b_u32(b, GGUF_VT_STR); b_u64(b, 1ull << 61); break;
    case X_HUGE_ARR: b_str(b, "k.big"); b_u32(b, GGUF_VT_ARR); b_u32(b, GGUF_VT_F32); b_u64(b, 1ull << 62); break;
    case X_HUGE_STR: b_str(b, "k.big"); b_u32(b, GGUF_VT_STR); b_u64(b, 1ull << 63); break;
    }
    /* Tensor 0 is the one under test; tensor 1 is a valid F32 [4] after it. */
    b_str(b, s->tname); b_u32(b, s->n_dims);
    for (uint32_t d = 0; d < s->n_dims && d < 8; d++) b_u64(b, s->ne[d < 4 ? d : 3]);
    b_u32(b, s->ttype); b_u64(b, s->offset);
    b_str(b, s->tname2); b_u32(b, 1); b_u64(b, 4); b_u32(b, GGML_TYPE_F32); b_u64(b, 128);
    b_pad(b, s->align_type == GGUF_VT_U32 && s->align && !(s->align & (s->align - 1)) ? s->align : 32);
    for (uint64_t i = 0; i < s->data_bytes; i++) {
        uint8_t v = (uint8_t)i;
        b_put(b, &v, 1);
    }
}

/* Build, open, and expect failure with `want` in the message (NULL: expect success). */
static void expect(const spec *s, const char *want, const char *what)
{
    bbuf b = {0};
    char err[512] = "";
    gguf_file *f = NULL;
    build(&b, s);
    unsigned char *p = malloc(b.n);   /* exact size, for the sanitizer */
    memcpy(p, b.p, b.n);
    int rc = gguf_open_memory(&f, p, b.n, err, sizeof err);
    if (want)
        CHECK(rc == -1 && !f && has(err, want), "%s: expected error containing \"%s\", got rc %d '%s'",
              what, want, rc, err);
    else
        CHECK(rc == 0 && f, "%s: expected success, got '%s'", what, err);
    gguf_close(f);
    free(p);
    free(b.p);
}

static void test_handmade_valid(void)
{
    spec s = base_spec();
    bbuf b = {0};
    char err[512];
    gguf_file *f;
    build(&b, &s);
    CHECK(gguf_open_memory(&f, b.p, b.n, err, sizeof err) == 0, "handmade: %s", err);
    if (!f) {
        free(b.p);
        return;
    }
    uint32_t u;
    int64_t i64;
    float fl;
    int bo;
    gguf_str str;
    gguf_arr a;
    CHECK(gguf_get_u32(f, "k.u8", &u) == 0 && u == 250, "u32 from u8");
    CHECK(gguf_get_u32(f, "k.i8", &u) == -2 && gguf_get_u32(f, "k.i32", &u) == -2, "u32 from negative");
    CHECK(gguf_get_i64(f, "k.i8", &i64) == 0 && i64 == -5, "i64 from i8");
    CHECK(gguf_get_i64(f, "k.i32", &i64) == 0 && i64 == -7, "i64 from i32");
    CHECK(gguf_get_i64(f, "k.u64", &i64) == 0 && i64 == (1ll << 40), "i64 from u64");
    CHECK(gguf_get_u32(f, "k.u64", &u) == -2, "u32 from a too-large u64");
    CHECK(gguf_get_f32(f, "k.f64", &fl) == -2, "f32 from a too-large f64");
    CHECK(gguf_get_f32(f, "k.u8", &fl) == -2 && gguf_get_u32(f, "k.f64", &u) == -2, "type mismatch");
    CHECK(gguf_get_bool(f, "k.bool", &bo) == 0 && bo == 1 && gguf_get_bool(f, "k.u8", &bo) == -2, "bool");
    CHECK(gguf_get_str(f, "general.architecture", &str) == 0 && gguf_str_eq(str, "test")
          && gguf_get_str(f, "k.u8", &str) == -2, "str");
    CHECK(gguf_get_u32(f, "absent", &u) == -1 && gguf_get_str(f, "absent", &str) == -1
          && gguf_get_arr(f, "absent", &a) == -1, "absent keys");
    CHECK(gguf_get_arr(f, "k.strs", &a) == 0 && a.n == 3 && gguf_arr_str(&a, 0, &str) == 0 && gguf_str_eq(str, "a")
          && gguf_arr_str(&a, 1, &str) == 0 && str.len == 0 && gguf_arr_str(&a, 2, &str) == 0
          && gguf_str_eq(str, "ccc") && gguf_arr_str(&a, 3, &str) == -1, "string array");
    CHECK(gguf_get_arr(f, "k.u8", &a) == -2, "arr type mismatch");
    const gguf_tensor *t = gguf_find_tensor(f, "blk.0.attn_q.weight");
    CHECK(t && t->nbytes == 64 && t->data == (const unsigned char *)b.p + gguf_get_data_offset(f)
          && ((const unsigned char *)t->data)[5] == 5, "tensor 0 data");
    t = gguf_find_tensor(f, "output.weight");
    CHECK(t && t->nbytes == 16 && ((const unsigned char *)t->data)[0] == 128, "tensor 1 data");
    gguf_close(f);
    free(b.p);
}

static void test_corrupt_headers(void)
{
    spec s;
    expect((s = base_spec(), &s), NULL, "baseline");
    expect((s = base_spec(), s.magic = "GGML", &s), "not a GGUF file", "magic");
    expect((s = base_spec(), s.version = 1, &s), "version 1", "v1");
    expect((s = base_spec(), s.version = 2, &s), NULL, "v2");
    expect((s = base_spec(), s.version = 4, &s), "unsupported GGUF version 4", "v4");
    expect((s = base_spec(), s.version = 0x03000000, &s), "big-endian", "big-endian");
    expect((s = base_spec(), s.n_kv = 1ll << 60, &s), "n_kv 1152921504606846976", "huge n_kv");
    expect((s = base_spec(), s.n_kv = -2, &s), "n_kv", "n_kv 2^64-2");
    expect((s = base_spec(), s.n_t = 1ll << 60, &s), "n_tensors", "huge n_tensors");
    expect((s = base_spec(), s.n_t = 3, &s), "tensor info 2", "one tensor too many");
    expect((s = base_spec(), s.align_type = GGUF_VT_U32, s.align = 64, &s), NULL, "alignment 64");
    expect((s = base_spec(), s.align_type = GGUF_VT_U32, s.align = 0, &s), "power of two", "alignment 0");
    expect((s = base_spec(), s.align_type = GGUF_VT_U32, s.align = 48, &s), "power of two", "alignment 48");
    /* GGUF asks for a multiple of 8: 1, 2 and 4 would misalign F32 and block data */
    expect((s = base_spec(), s.align_type = GGUF_VT_U32, s.align = 1, &s), "general.alignment = 1 is not a power of two >= 8",
           "alignment 1");
    expect((s = base_spec(), s.align_type = GGUF_VT_U32, s.align = 4, &s), "general.alignment = 4", "alignment 4");
    expect((s = base_spec(), s.align_type = GGUF_VT_U32, s.align = 12, &s), "general.alignment = 12", "alignment 12");
    expect((s = base_spec(), s.align_type = GGUF_VT_U32, s.align = 8, &s), NULL, "alignment 8");
    expect((s = base_spec(), s.align_type = GGUF_VT_U64, s.align = 32, &s), "expected U32", "alignment type");
    expect((s = base_spec(), s.align_type = GGUF_VT_U32, s.align = 64, s.offset = 32, &s), "not a multiple",
           "offset aligned to 32 but not 64");
    expect((s = base_spec(), s.offset = 4, &s), "not a multiple of the alignment", "misaligned offset");
    expect((s = base_spec(), s.offset = 1ull << 40, &s), "past the end", "offset out of range");
    expect((s = base_spec(), s.offset = UINT64_MAX - 31, &s), "past the end", "offset near 2^64");
    expect((s = base_spec(), s.data_bytes = 132, &s), "needs 12 more bytes", "data section short");
    expect((s = base_spec(), s.ne[0] = 1ull << 32, s.ne[1] = 1ull << 32, &s), "overflows", "overflowing shape");
    expect((s = base_spec(), s.ne[0] = 1ull << 63, s.ne[1] = 1, &s), "overflows", "ne >= 2^63");
    expect((s = base_spec(), s.n_dims = 4, s.ne[0] = 1ull << 16, s.ne[1] = 1ull << 16, s.ne[2] = 1ull << 16,
            s.ne[3] = 1ull << 16, &s), "overflows", "4-d overflow");
    expect((s = base_spec(), s.ttype = GGML_TYPE_F64, s.ne[0] = 1ull << 62, s.ne[1] = 1, &s), "byte size overflows",
           "byte size overflow");
    expect((s = base_spec(), s.ttype = 99, &s), "tensor 'blk.0.attn_q.weight' has unknown type 99", "type 99");
    expect((s = base_spec(), s.ttype = 4, &s), "unknown type 4", "removed type 4");
    expect((s = base_spec(), s.ttype = GGML_TYPE_Q4_0, s.ne[0] = 16, &s), "block size", "partial block");
    expect((s = base_spec(), s.ne[1] = 0, &s), "zero dimension", "ne 0");
    expect((s = base_spec(), s.n_dims = 0, &s), "n_dims 0", "n_dims 0");
    expect((s = base_spec(), s.n_dims = 5, &s), "n_dims 5", "n_dims 5");
    expect((s = base_spec(), s.tname2 = s.tname, &s), "duplicates the name of tensor 0", "duplicate tensor");
    expect((s = base_spec(), s.tname = "", &s), "name length 0", "empty tensor name");
    expect((s = base_spec(), s.extra = X_NESTED, &s), "nested arrays", "nested array");
    expect((s = base_spec(), s.extra = X_UNKNOWN_VT, &s), "unknown value type 13", "unknown value type");
    expect((s = base_spec(), s.extra = X_UNKNOWN_ELEM, &s), "unknown array element type 77", "unknown elem type");
    expect((s = base_spec(), s.extra = X_DUP_KEY, &s), "key 'k.u8') duplicates kv 1", "duplicate key");
    expect((s = base_spec(), s.extra = X_EMPTY_KEY, &s), "key length 0", "empty key");
    expect((s = base_spec(), s.extra = X_LONG_KEY, &s), "key length 1025", "long key");
    expect((s = base_spec(), s.extra = X_HUGE_STR_ARR, &s), "string array of 2305843009213693952", "huge str arr");
    expect((s = base_spec(), s.extra = X_HUGE_ARR, &s), "array of 4611686018427387904", "huge arr");
    expect((s = base_spec(), s.extra = X_HUGE_STR, &s), "truncated", "huge string");
}

/* The same corruptions patched into a real file. */
static void test_corrupt_real(void)
{
    char path[2048], err[512];
    size_t size;
    t_fixture_path(path, sizeof path, "models/stories260K.gguf");
    unsigned char *buf = slurp(path, &size);
    if (!buf)
        return;
    gguf_file *f;
    uint64_t huge = 1ull << 60;
    memcpy(buf + 16, &huge, 8);   /* n_kv */
    CHECK(gguf_open_memory(&f, buf, size, err, sizeof err) == -1 && has(err, "n_kv"), "real huge n_kv: %s", err);
    memcpy(buf + 8, &huge, 8);    /* n_tensors */
    CHECK(gguf_open_memory(&f, buf, size, err, sizeof err) == -1 && has(err, "n_kv"), "real huge counts: %s", err);
    free(buf);
    CHECK(gguf_open_file(&f, "/nonexistent/x.gguf", err, sizeof err) == -1 && has(err, "/nonexistent/x.gguf"),
          "missing file: %s", err);
    CHECK(gguf_open_memory(&f, NULL, 0, err, sizeof err) == -1 && has(err, "truncated"), "empty buffer: %s", err);
    CHECK(gguf_open_memory(&f, "GGUF", 4, NULL, 0) == -1, "no error buffer");
}

/* ==== Writer ==== */

static void tmp_path(char *p, size_t cap, const char *tag)
{
    const char *d = getenv("TMPDIR");
    snprintf(p, cap, "%s/test_gguf_%ld_%s.gguf", d && *d ? d : "/tmp", (long)getpid(), tag);
}

static void test_writer_roundtrip(void)
{
    char path[1024], err[512];
    tmp_path(path, sizeof path, "rt");
    gguf_writer *w = gguf_writer_new(64);
    CHECK(w != NULL, "writer_new(64)");
    if (!w)
        return;
    static const uint8_t u8[] = {0, 1, 255};
    static const int8_t i8[] = {-128, 0, 127};
    static const uint16_t u16[] = {0, 65535};
    static const int16_t i16[] = {-32768, 32767};
    static const uint32_t u32[] = {0, 4000000000u};
    static const int32_t i32[] = {-2000000000, 7};
    static const float f32[] = {1.5f, -0.25f};
    static const uint8_t bo[] = {1, 0};
    static const uint64_t u64[] = {UINT64_MAX, 3};
    static const int64_t i64[] = {INT64_MIN, 9};
    static const double f64[] = {3.25, -1e-300};
    struct { const char *k; uint32_t t; const void *d; uint64_t n, es; } arrs[] = {
        {"a.u8", GGUF_VT_U8, u8, 3, 1}, {"a.i8", GGUF_VT_I8, i8, 3, 1}, {"a.u16", GGUF_VT_U16, u16, 2, 2},
        {"a.i16", GGUF_VT_I16, i16, 2, 2}, {"a.u32", GGUF_VT_U32, u32, 2, 4}, {"a.i32", GGUF_VT_I32, i32, 2, 4},
        {"a.f32", GGUF_VT_F32, f32, 2, 4}, {"a.bool", GGUF_VT_BOOL, bo, 2, 1}, {"a.u64", GGUF_VT_U64, u64, 2, 8},
        {"a.i64", GGUF_VT_I64, i64, 2, 8}, {"a.f64", GGUF_VT_F64, f64, 2, 8}, {"a.empty", GGUF_VT_U8, NULL, 0, 1},
    };
    const char *strs[] = {"hello", "", "wi\0th nul", "\xe4\xbd\xa0"};
    uint64_t lens[] = {5, 0, 9, 3};
    int rc = 0;
    rc |= gguf_writer_add_str(w, "general.architecture", "rt");
    rc |= gguf_writer_add_u32(w, "s.u32", 4000000000u);
    rc |= gguf_writer_add_i32(w, "s.i32", -12345);
    rc |= gguf_writer_add_f32(w, "s.f32", 0.125f);
    rc |= gguf_writer_add_bool(w, "s.bool", 1);
    rc |= gguf_writer_add_str(w, "s.str", "");
    for (size_t i = 0; i < sizeof arrs / sizeof arrs[0]; i++)
        rc |= gguf_writer_add_arr(w, arrs[i].k, arrs[i].t, arrs[i].d, arrs[i].n);
    rc |= gguf_writer_add_str_arr(w, "a.str", strs, lens, 4);
    rc |= gguf_writer_add_str_arr(w, "a.str0", NULL, NULL, 0);
    CHECK(rc == 0, "writer adds");
    /* Refusals. */
    CHECK(gguf_writer_add_u32(w, "s.u32", 1) == -1, "duplicate key refused");
    CHECK(gguf_writer_add_u32(w, "", 1) == -1, "empty key refused");
    CHECK(gguf_writer_add_arr(w, "bad", GGUF_VT_STR, u8, 1) == -1 && gguf_writer_add_arr(w, "bad", 13, u8, 1) == -1,
          "bad array element type refused");
    CHECK(gguf_writer_add_u32(w, "general.alignment", 48) == -1, "bad general.alignment refused");
    CHECK(gguf_writer_new(48) == NULL, "writer_new(48) refused");
    CHECK(gguf_writer_new(4) == NULL && gguf_writer_add_u32(w, "general.alignment", 4) == -1,
          "alignment 4 (not a multiple of 8) refused by the writer");

    /* Copy every kv of a real file, string arrays included. */
    char spath[2048];
    gguf_file *src = NULL;
    t_fixture_path(spath, sizeof spath, "models/stories260K.gguf");
    if (t_need(spath) && gguf_open_file(&src, spath, err, sizeof err) == 0) {
        for (int64_t i = 0; i < gguf_count_kv(src); i++) {
            gguf_str k = gguf_kv_key(src, i);
            if (gguf_str_eq(k, "general.architecture"))
                continue;   /* already set; the writer refuses duplicates */
            rc = gguf_writer_copy_kv(w, src, i);
            if (gguf_str_eq(k, "general.alignment"))
                CHECK(rc == 0, "copy general.alignment (it sets the writer's alignment to 32)");
            else
                CHECK(rc == 0, "copy kv %lld", (long long)i);
        }
        CHECK(gguf_writer_copy_kv(w, src, 0) == -1 && gguf_writer_copy_kv(w, src, 999) == -1,
              "copy refuses duplicates and bad indices");
    }
    uint32_t want_align = src ? 32 : 64;

    /* Tensors of several types and ranks. */
    static float t0[64 * 3];
    static uint8_t t1[2 * 2 * 34], t3[1 * 3 * 2 * 144];
    static uint16_t t2[5];
    for (size_t i = 0; i < sizeof t0 / sizeof t0[0]; i++) t0[i] = (float)i * 0.5f;
    for (size_t i = 0; i < sizeof t1; i++) t1[i] = (uint8_t)(i * 7);
    for (size_t i = 0; i < 5; i++) t2[i] = (uint16_t)(0x3c00 + i);
    for (size_t i = 0; i < sizeof t3; i++) t3[i] = (uint8_t)(i * 13 + 1);
    const uint64_t ne0[] = {64, 3}, ne1[] = {64, 2}, ne2[] = {5}, ne3[] = {256, 3, 2};
    rc = gguf_writer_add_tensor(w, "t.f32", GGML_TYPE_F32, 2, ne0, t0);
    rc |= gguf_writer_add_tensor(w, "t.q8", GGML_TYPE_Q8_0, 2, ne1, t1);
    rc |= gguf_writer_add_tensor(w, "t.f16", GGML_TYPE_F16, 1, ne2, t2);
    rc |= gguf_writer_add_tensor(w, "t.q4k", GGML_TYPE_Q4_K, 3, ne3, t3);
    CHECK(rc == 0, "add tensors");
    CHECK(gguf_writer_add_tensor(w, "t.f32", GGML_TYPE_F32, 2, ne0, t0) == -1, "duplicate tensor refused");
    CHECK(gguf_writer_add_tensor(w, "t.bad", GGML_TYPE_Q8_0, 1, ne2, t1) == -1, "partial block refused");
    CHECK(gguf_writer_add_tensor(w, "t.bad", 99, 1, ne2, t1) == -1, "unknown type refused");
    CHECK(gguf_writer_add_tensor(w, "t.bad", GGML_TYPE_F32, 5, ne3, t1) == -1, "n_dims 5 refused");

    CHECK(gguf_writer_save(w, path, err, sizeof err) == 0, "save: %s", err);
    gguf_writer_free(w);

    gguf_file *f = NULL;
    CHECK(gguf_open_file(&f, path, err, sizeof err) == 0, "reopen: %s", err);
    if (f) {
        uint32_t u;
        int64_t v;
        float fl;
        int b;
        gguf_str s;
        gguf_arr a;
        CHECK(gguf_get_version(f) == 3 && gguf_get_alignment(f) == want_align, "version/alignment %llu",
              (unsigned long long)gguf_get_alignment(f));
        CHECK(gguf_get_u32(f, "general.alignment", &u) == 0 && u == want_align, "general.alignment written");
        CHECK(gguf_get_u32(f, "s.u32", &u) == 0 && u == 4000000000u, "s.u32");
        CHECK(gguf_get_i64(f, "s.i32", &v) == 0 && v == -12345, "s.i32");
        CHECK(gguf_get_f32(f, "s.f32", &fl) == 0 && fl == 0.125f, "s.f32");
        CHECK(gguf_get_bool(f, "s.bool", &b) == 0 && b == 1, "s.bool");
        CHECK(gguf_get_str(f, "s.str", &s) == 0 && s.len == 0, "s.str");
        CHECK(gguf_get_str(f, "general.architecture", &s) == 0 && gguf_str_eq(s, "rt"), "arch");
        for (size_t i = 0; i < sizeof arrs / sizeof arrs[0]; i++) {
            int ok = gguf_get_arr(f, arrs[i].k, &a) == 0 && a.elem_type == arrs[i].t && a.n == arrs[i].n
                     && (a.n == 0 || memcmp(a.data, arrs[i].d, a.n * arrs[i].es) == 0);
            CHECK(ok, "array %s", arrs[i].k);
        }
        CHECK(gguf_get_arr(f, "a.str", &a) == 0 && a.n == 4, "a.str");
        for (uint64_t i = 0; i < 4 && a.n == 4; i++)
            CHECK(gguf_arr_str(&a, i, &s) == 0 && s.len == lens[i] && memcmp(s.ptr, strs[i], lens[i]) == 0,
                  "a.str[%llu]", (unsigned long long)i);
        CHECK(gguf_get_arr(f, "a.str0", &a) == 0 && a.n == 0 && a.elem_type == GGUF_VT_STR, "empty str array");
        if (src) {
            int bad = 0;
            for (int64_t i = 0; i < gguf_count_kv(src); i++) {
                gguf_str k = gguf_kv_key(src, i);
                char key[256];
                snprintf(key, sizeof key, "%.*s", (int)k.len, k.ptr);
                int64_t j = gguf_find_kv(f, key);
                if (j < 0 || gguf_kv_type(f, j) != gguf_kv_type(src, i))
                    bad++;
            }
            gguf_arr x, y;
            gguf_str p, q;
            if (gguf_get_arr(src, "tokenizer.ggml.tokens", &x) || gguf_get_arr(f, "tokenizer.ggml.tokens", &y)
                || x.n != y.n)
                bad++;
            else
                for (uint64_t i = 0; i < x.n; i++)
                    if (gguf_arr_str(&x, i, &p) || gguf_arr_str(&y, i, &q) || p.len != q.len
                        || memcmp(p.ptr, q.ptr, p.len))
                        bad++;
            if (gguf_get_arr(src, "tokenizer.ggml.scores", &x) || gguf_get_arr(f, "tokenizer.ggml.scores", &y)
                || x.n != y.n || memcmp(x.data, y.data, x.n * 4))
                bad++;
            CHECK(bad == 0, "copied kvs differ in %d places", bad);
        }
        struct { const char *n; const void *d; uint64_t nb; uint32_t nd; } ts[] = {
            {"t.f32", t0, sizeof t0, 2}, {"t.q8", t1, sizeof t1, 2}, {"t.f16", t2, sizeof t2, 1},
            {"t.q4k", t3, sizeof t3, 3}};
        for (int i = 0; i < 4; i++) {
            const gguf_tensor *t = gguf_find_tensor(f, ts[i].n);
            CHECK(t && t->nbytes == ts[i].nb && t->n_dims == ts[i].nd && memcmp(t->data, ts[i].d, t->nbytes) == 0
                  && t->offset % want_align == 0, "tensor %s", ts[i].n);
        }
        const gguf_tensor *t = gguf_find_tensor(f, "t.q4k");
        CHECK(shape_is(t, 3, 256, 3, 2) && t->type == GGML_TYPE_Q4_K, "q4k shape");
        check_invariants(f, path);
        gguf_close(f);
    }
    gguf_close(src);
    remove(path);
}

/* Copy a whole real model through the writer; llama.cpp's writer lays the
 * file out the same way, so the bytes must come back identical. */
static void test_writer_copy_model(void)
{
    char spath[2048], path[1024], err[512];
    snprintf(spath, sizeof spath, "%s/models/stories260K-F16.gguf", t_fixtures());
    gguf_file *src;
    if (!t_need(spath) || gguf_open_file(&src, spath, err, sizeof err) != 0)
        return;
    tmp_path(path, sizeof path, "copy");
    gguf_writer *w = gguf_writer_new(32);
    int rc = 0;
    for (int64_t i = 0; i < gguf_count_kv(src); i++)
        rc |= gguf_writer_copy_kv(w, src, i);
    for (int64_t i = 0; i < gguf_count_tensors(src); i++) {
        const gguf_tensor *t = gguf_get_tensor(src, i);
        char name[300];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        rc |= gguf_writer_add_tensor(w, name, t->type, t->n_dims, t->ne, t->data);
    }
    CHECK(rc == 0 && gguf_writer_save(w, path, err, sizeof err) == 0, "copy model: %s", err);
    gguf_writer_free(w);
    size_t n;
    unsigned char *got = slurp(path, &n);
    CHECK(got && n == gguf_get_size(src) && memcmp(got, gguf_get_base(src), n) == 0,
          "copied model is byte-identical (%zu vs %llu bytes)", n, (unsigned long long)gguf_get_size(src));
    free(got);
    remove(path);
    gguf_close(src);

    w = gguf_writer_new(0);
    CHECK(w && gguf_writer_save(w, "/nonexistent/dir/x.gguf", err, sizeof err) == -1 && has(err, "/nonexistent"),
          "save to a bad path: %s", err);
    gguf_writer_free(w);
}

/* String arrays are indexed one string in GGUF_STR_STRIDE: every element
 * of arrays around and across the stride reads back (in reverse order, so
 * each lookup walks from its own indexed string), lengths 0 and long
 * included; one past the end is refused. */
static void test_str_stride(void)
{
    static const uint64_t ns[] = { 1, 100, GGUF_STR_STRIDE - 1, GGUF_STR_STRIDE, GGUF_STR_STRIDE + 1,
                                   2 * GGUF_STR_STRIDE + 1 };
    for (size_t c = 0; c < sizeof ns / sizeof ns[0]; c++) {
        uint64_t n = ns[c];
        bbuf b = {0};
        b_put(&b, "GGUF", 4);
        b_u32(&b, 3);
        b_u64(&b, 0);   /* tensors */
        b_u64(&b, 1);   /* kvs */
        b_str(&b, "k.strs");
        b_u32(&b, GGUF_VT_ARR);
        b_u32(&b, GGUF_VT_STR);
        b_u64(&b, n);
        char want[64];
        for (uint64_t i = 0; i < n; i++) {
            size_t len = (size_t)(i * 7 % 41);   /* 0 .. 40 bytes */
            for (size_t k = 0; k < len; k++) want[k] = (char)('a' + (i + k) % 26);
            b_u64(&b, len);
            b_put(&b, want, len);
        }
        char err[256];
        gguf_file *f = NULL;
        gguf_arr a;
        gguf_str s;
        int bad = gguf_open_memory(&f, b.p, b.n, err, sizeof err) != 0 || gguf_get_arr(f, "k.strs", &a) != 0 || a.n != n;
        for (uint64_t i = n; !bad && i-- > 0;) {
            size_t len = (size_t)(i * 7 % 41);
            for (size_t k = 0; k < len; k++) want[k] = (char)('a' + (i + k) % 26);
            bad = gguf_arr_str(&a, i, &s) != 0 || s.len != len || memcmp(s.ptr, want, len) != 0;
        }
        gguf_str_iter it;
        gguf_str_iter_init(&it, &a);
        for (uint64_t i = 0; !bad && i < n; i++) {
            size_t len = (size_t)(i * 7 % 41);
            for (size_t k = 0; k < len; k++) want[k] = (char)('a' + (i + k) % 26);
            bad = gguf_str_iter_next(&it, &s) != 0 || it.i != i + 1 || s.len != len || memcmp(s.ptr, want, len) != 0;
        }
        CHECK(!bad && gguf_arr_str(&a, n, &s) == -1 && gguf_str_iter_next(&it, &s) == -1,
              "string array of %llu: every element at random and in order, none past the end", (unsigned long long)n);
        gguf_close(f);
        free(b.p);
    }
}

int main(void)
{
    test_types();
    test_every_fixture();
    test_known_metadata();
    test_handmade_valid();
    test_str_stride();
    test_corrupt_headers();
    test_corrupt_real();
    test_truncation();
    test_writer_roundtrip();
    test_writer_copy_model();
    return t_done("test_gguf");
}
