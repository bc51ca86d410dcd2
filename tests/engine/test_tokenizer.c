/* test_tokenizer.c - tokenizers and chat templates against llama.cpp's outputs.
 *
 *  1. vocab/ggml-vocab-*.gguf with llama.cpp's .inp/.out test vectors
 *  2. tokenize/visible.jsonl (ids with and without parse_special, pieces)
 *  3. prompt_ids and token pieces of every golden file, for every model present
 *  4. decoding: round trips, streaming never splits a UTF-8 sequence
 *  5. chat templates: the golden ChatML prompt, Llama 3 rendering, detection
 *  6. robustness: invalid UTF-8, small buffers, refused pre-tokenizers
 */
#include "t.h"
#include "engine/gguf.h"
#include "engine/tokenizer.h"
#include "base/unicode.h"

#include <dirent.h>
#include <jansson.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

/* ==== Helpers ==== */

static char *read_whole(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = malloc((size_t)n + 1);
    if (p && fread(p, 1, (size_t)n, f) != (size_t)n) {
        free(p);
        p = NULL;
    }
    fclose(f);
    if (p) {
        p[n] = 0;
        *len = (size_t)n;
    }
    return p;
}

typedef struct {
    gguf_file *g;
    tokenizer *t;
} loaded;

static int load_model(loaded *m, const char *path)
{
    char err[256] = "";
    m->g = NULL;
    m->t = NULL;
    if (access(path, R_OK) != 0) {   /* callers asked t_need first: here a missing file is a failure */
        CHECK(0, "%s not found", path);
        return -1;
    }
    if (gguf_open_file(&m->g, path, err, sizeof err)) {
        CHECK(0, "open %s: %s", path, err);
        return -1;
    }
    if (tokenizer_load(&m->t, m->g, err, sizeof err)) {
        CHECK(0, "tokenizer_load %s: %s", path, err);
        gguf_close(m->g);
        return -1;
    }
    return 0;
}

static void unload(loaded *m)
{
    tokenizer_free(m->t);
    gguf_close(m->g);
}

/* Encode into a malloc'd array; *n gets the count (-1 on error). */
static int32_t *encode(const tokenizer *t, const char *s, size_t len, int add_special, int parse_special, int64_t *n)
{
    int64_t need = tokenizer_encode(t, s, len, add_special, parse_special, NULL, 0);
    *n = need;
    if (need < 0)
        return NULL;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(need + 1));
    int64_t again = tokenizer_encode(t, s, len, add_special, parse_special, ids, need);
    CHECK(again == need, "encode count changed: %lld vs %lld", (long long)again, (long long)need);
    return ids;
}

static int ids_equal_json(const int32_t *ids, int64_t n, json_t *arr)
{
    if (!json_is_array(arr) || (int64_t)json_array_size(arr) != n)
        return 0;
    for (int64_t i = 0; i < n; i++)
        if (json_integer_value(json_array_get(arr, (size_t)i)) != ids[i])
            return 0;
    return 1;
}

static void print_ids(const char *label, const int32_t *ids, int64_t n)
{
    fprintf(stderr, "  %s:", label);
    for (int64_t i = 0; i < n && i < 80; i++)
        fprintf(stderr, " %d", ids[i]);
    fprintf(stderr, "\n");
}

/* Concatenated bytes of the tokens (render_special as given). */
static char *decode_all(const tokenizer *t, const int32_t *ids, int64_t n, int render_special, size_t *len)
{
    size_t cap = (size_t)n * (tokenizer_max_token_bytes(t) + 1) + 1, o = 0;
    char *out = malloc(cap);
    for (int64_t i = 0; i < n; i++) {
        int k = tokenizer_token_bytes(t, ids[i], render_special, out + o, cap - o);
        CHECK(k >= 0, "token_bytes(%d) failed", ids[i]);
        if (k > 0)
            o += (size_t)k;
    }
    out[o] = 0;
    *len = o;
    return out;
}

/* Stream-decode; checks every chunk is valid UTF-8 when valid_chunks is set. */
static char *stream_all(const tokenizer *t, const int32_t *ids, int64_t n, int valid_chunks, size_t *len)
{
    size_t piece_cap = tokenizer_max_token_bytes(t) + 8;
    size_t cap = (size_t)n * piece_cap + 16, o = 0;
    char *out = malloc(cap);
    tok_stream st;
    tok_stream_init(&st, t);
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        int k = tok_stream_push(&st, ids[i], out + o, piece_cap);
        CHECK(k >= 0, "stream push %d failed", ids[i]);
        if (k < 0)
            break;
        if (valid_chunks && !unicode_valid_utf8((const unsigned char *)out + o, (size_t)k))
            bad++;
        o += (size_t)k;
    }
    int k = tok_stream_flush(&st, out + o, piece_cap);
    CHECK(k >= 0, "stream flush failed");
    if (k > 0)
        o += (size_t)k;
    CHECK(bad == 0, "stream emitted %d chunks of invalid UTF-8", bad);
    out[o] = 0;
    *len = o;
    return out;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* ==== 1. llama.cpp's vocabulary test vectors ==== */

static void test_vocab_file(const char *name)
{
    char path[1024], pin[1100], pout[1100];
    snprintf(path, sizeof path, "%s/vocab/ggml-vocab-%s.gguf", t_fixtures(), name);
    snprintf(pin, sizeof pin, "%s.inp", path);
    snprintf(pout, sizeof pout, "%s.out", path);
    if (!t_need(path))
        return;
    loaded m;
    size_t nin = 0, nout = 0;
    char *inp = read_whole(pin, &nin), *outp = read_whole(pout, &nout);
    CHECK(inp && outp, "missing %s / %s", pin, pout);
    if (!inp || !outp || load_model(&m, path)) {
        CHECK(0, "cannot load %s", path);
        free(inp);
        free(outp);
        return;
    }
    /* Cases in .inp are separated by "\n__ggml_vocab_test__\n"; .out has one
     * line of space-separated ids per case. */
    static const char sep[] = "\n__ggml_vocab_test__\n";
    const size_t seplen = sizeof sep - 1;
    const char *ip = inp, *iend = inp + nin, *op = outp, *oend = outp + nout;
    int ncase = 0, nbad = 0;
    while (ip <= iend && op < oend) {
        const char *cend = memmem(ip, (size_t)(iend - ip), sep, seplen);
        if (!cend)
            cend = iend;
        const char *lend = memchr(op, '\n', (size_t)(oend - op));
        if (!lend)
            lend = oend;
        int32_t want[1024];
        int nw = 0;
        for (const char *q = op; q < lend && nw < 1024;) {
            while (q < lend && *q == ' ')
                q++;
            if (q >= lend)
                break;
            want[nw++] = (int32_t)strtol(q, (char **)&q, 10);
        }
        int64_t n;
        int32_t *ids = encode(m.t, ip, (size_t)(cend - ip), 0, 0, &n);
        int ok = ids && n == nw && memcmp(ids, want, sizeof(int32_t) * (size_t)nw) == 0;
        CHECK(ok, "vocab %s case %d (%.*s)", name, ncase, (int)(cend - ip > 60 ? 60 : cend - ip), ip);
        if (!ok) {
            nbad++;
            print_ids("got ", ids, n);
            print_ids("want", want, nw);
        }
        free(ids);
        ncase++;
        ip = cend + seplen;
        op = lend + 1;
    }
    CHECK(ncase >= 40, "vocab %s: only %d cases parsed", name, ncase);
    printf("vocab %s: %d cases, %d mismatches\n", name, ncase, nbad);
    unload(&m);
    free(inp);
    free(outp);
}

/* ==== 2 + 4. tokenize/visible.jsonl, decoding ==== */

static void test_visible_prompt(const tokenizer *t, json_t *o)
{
    const char *name = json_string_value(json_object_get(o, "name"));
    json_t *jt = json_object_get(o, "text");
    const char *text = json_string_value(jt);
    size_t len = json_string_length(jt);
    int64_t n, n2;
    int32_t *ids = encode(t, text, len, 0, 1, &n);
    int ok = ids_equal_json(ids, n, json_object_get(o, "ids"));
    CHECK(ok, "visible %s: ids differ", name);
    if (!ok)
        print_ids("got", ids, n);
    int32_t *ids2 = encode(t, text, len, 0, 0, &n2);
    CHECK(ids_equal_json(ids2, n2, json_object_get(o, "ids_no_parse_special")),
          "visible %s: ids_no_parse_special differ", name);
    /* pieces are the GGUF token strings */
    json_t *pieces = json_object_get(o, "pieces");
    int pieces_ok = json_is_array(pieces) && (int64_t)json_array_size(pieces) == n;
    for (int64_t i = 0; pieces_ok && i < n; i++) {
        size_t pl;
        const char *ps = tokenizer_token_str(t, ids[i], &pl);
        json_t *jp = json_array_get(pieces, (size_t)i);
        pieces_ok = ps && pl == json_string_length(jp) && memcmp(ps, json_string_value(jp), pl) == 0;
    }
    CHECK(pieces_ok, "visible %s: pieces differ", name);
    /* decoding with specials rendered gives the text back exactly */
    size_t dl;
    char *dec = decode_all(t, ids, n, 1, &dl);
    CHECK(dl == len && memcmp(dec, text, len) == 0, "visible %s: decode round trip differs", name);
    free(dec);
    /* streaming the no-special encoding gives the text back, in valid chunks */
    char *st = stream_all(t, ids2, n2, 1, &dl);
    CHECK(dl == len && memcmp(st, text, len) == 0, "visible %s: stream round trip differs", name);
    free(st);
    free(ids);
    free(ids2);
}

static void test_visible(void)
{
    char path[1024];
    char mpath[1024];
    snprintf(path, sizeof path, "%s/tokenize/visible.jsonl", t_fixtures());
    snprintf(mpath, sizeof mpath, "%s/models/qwen3-mini-Q8_0.gguf", t_fixtures());
    if (!t_need(path) || !t_need(mpath))
        return;
    FILE *f = fopen(path, "r");
    CHECK(f != NULL, "missing %s", path);
    if (!f)
        return;
    snprintf(path, sizeof path, "%s/models/qwen3-mini-Q8_0.gguf", t_fixtures());
    if (!t_need(path))
        return;
    loaded m;
    if (load_model(&m, path)) {
        CHECK(0, "cannot load %s", path);
        fclose(f);
        return;
    }
    char *line = NULL;
    size_t cap = 0;
    int nprompts = 0;
    while (getline(&line, &cap, f) > 0) {
        json_error_t je;
        json_t *o = json_loads(line, 0, &je);
        CHECK(o != NULL, "bad JSON line in visible.jsonl: %s", je.text);
        if (!o)
            continue;
        const char *type = json_string_value(json_object_get(o, "type"));
        if (type && strcmp(type, "prompt") == 0) {
            test_visible_prompt(m.t, o);
            nprompts++;
        }
        json_decref(o);
    }
    CHECK(nprompts >= 8, "only %d prompts in visible.jsonl", nprompts);
    free(line);
    fclose(f);
    unload(&m);
}

/* ==== 3. golden prompt ids and pieces ==== */

static void model_path(const char *file, char *out, size_t cap)
{
    char rel[512];
    snprintf(rel, sizeof rel, "models/%s", file ? file : "");
    t_fixture_path(out, cap, rel);
    if (access(out, R_OK) != 0)
        snprintf(out, cap, "%s/%s", t_models(), file);
}

static int hex_equal(const char *hex, const char *bytes, int n)
{
    if (!hex || (int)strlen(hex) != 2 * n)
        return 0;
    for (int i = 0; i < n; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1 || (unsigned char)bytes[i] != v)
            return 0;
    }
    return 1;
}

static void test_golden_prompt(const tokenizer *t, json_t *o, const char *file)
{
    const char *name = json_string_value(json_object_get(o, "name"));
    json_t *jp = json_object_get(o, "prompt");
    int64_t n;
    int32_t *ids = encode(t, json_string_value(jp), json_string_length(jp), 1, 1, &n);
    int ok = ids_equal_json(ids, n, json_object_get(o, "prompt_ids"));
    CHECK(ok, "golden %s %s: prompt_ids differ", file, name);
    if (!ok)
        print_ids("got", ids, n);
    free(ids);
    /* every step's piece_hex is the raw bytes of the chosen token */
    json_t *steps = json_object_get(o, "steps");
    size_t i;
    json_t *s;
    int bad = 0;
    char buf[1024];
    json_array_foreach(steps, i, s) {
        int32_t tok = (int32_t)json_integer_value(json_object_get(s, "token"));
        int k = tokenizer_token_bytes(t, tok, 1, buf, sizeof buf);
        if (k < 0 || !hex_equal(json_string_value(json_object_get(s, "piece_hex")), buf, k))
            bad++;
    }
    CHECK(bad == 0, "golden %s %s: %d step pieces differ", file, name, bad);
}

static void test_golden_file(const char *dir, const char *file)
{
    char path[1024], mpath[1024];
    if (snprintf(path, sizeof path, "%s/%s", dir, file) >= (int)sizeof path)
        return;
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    char *line = NULL;
    size_t cap = 0;
    loaded m = { 0 };
    int have = 0, nprompts = 0;
    while (getline(&line, &cap, f) > 0) {
        json_t *o = json_loads(line, 0, NULL);
        CHECK(o != NULL, "bad JSON in %s", path);
        if (!o)
            continue;
        const char *type = json_string_value(json_object_get(o, "type"));
        if (type && strcmp(type, "header") == 0) {
            model_path(json_string_value(json_object_get(o, "model_file")), mpath, sizeof mpath);
            if (load_model(&m, mpath)) {
                CHECK(0, "%s: cannot load model %s", file, mpath);
                json_decref(o);
                break;
            }
            have = 1;
            CHECK(tokenizer_n_vocab(m.t) == json_integer_value(json_object_get(o, "n_vocab")), "%s n_vocab", file);
            CHECK(tokenizer_add_bos(m.t) == json_is_true(json_object_get(o, "add_bos")), "%s add_bos", file);
            CHECK(tokenizer_bos(m.t) == json_integer_value(json_object_get(o, "bos_id")), "%s bos_id", file);
            CHECK(tokenizer_eos(m.t) == json_integer_value(json_object_get(o, "eos_id")), "%s eos_id", file);
            CHECK(tokenizer_is_eog(m.t, tokenizer_eos(m.t)), "%s eos is eog", file);
        } else if (have) {
            test_golden_prompt(m.t, o, file);
            nprompts++;
        }
        json_decref(o);
    }
    if (have) {
        CHECK(nprompts >= 8, "%s: only %d prompts", file, nprompts);
        unload(&m);
    }
    free(line);
    fclose(f);
}

static void test_golden(const char *sub)
{
    char dir[1024];
    t_fixture_path(dir, sizeof dir, sub);
    if (!t_need(dir))
        return;
    DIR *d = opendir(dir);
    CHECK(d != NULL, "missing %s", dir);
    if (!d)
        return;
    struct dirent *e;
    int nfiles = 0;
    while ((e = readdir(d))) {
        size_t l = strlen(e->d_name);
        if (l > 6 && strcmp(e->d_name + l - 6, ".jsonl") == 0) {
            test_golden_file(dir, e->d_name);
            nfiles++;
        }
    }
    closedir(d);
    CHECK(nfiles > 0, "no golden files in %s", dir);
}

/* ==== 4. more decoding ==== */

static void test_stories_stream(void)
{
    char path[1024];
    t_fixture_path(path, sizeof path, "golden/stories260K_greedy200_expected.txt");
    if (!t_need(path))
        return;
    t_fixture_path(path, sizeof path, "models/stories260K.gguf");
    loaded m;
    if (load_model(&m, path)) {
        CHECK(0, "cannot load %s", path);
        return;
    }
    size_t len, dl;
    int64_t n;
    t_fixture_path(path, sizeof path, "golden/stories260K_greedy200_expected.txt");
    char *text = read_whole(path, &len);
    CHECK(text != NULL, "missing %s", path);
    if (text) {
        while (len && text[len - 1] == '\n')   /* the file's own final newline */
            len--;
        int32_t *ids = encode(m.t, text, len, 1, 1, &n);
        CHECK(n > 1 && ids[0] == tokenizer_bos(m.t), "stories: BOS first");
        /* BOS, then the text: the stream drops the space the encoder prefixed */
        char *st = stream_all(m.t, ids, n, 1, &dl);
        CHECK(dl == len && memcmp(st, text, len) == 0, "stories: stream round trip differs");
        free(st);
        /* plain decode keeps that space */
        char *dec = decode_all(m.t, ids, n, 0, &dl);
        CHECK(dl == len + 1 && dec[0] == ' ' && memcmp(dec + 1, text, len) == 0, "stories: decode differs");
        free(dec);
        free(ids);
        free(text);
    }
    /* generated tokens after a prompt: the space is dropped only after BOS alone */
    {
        int64_t n1, n2;
        int32_t *p1 = encode(m.t, "", 0, 1, 1, &n1);
        int32_t *p2 = encode(m.t, "Lily had a", 10, 1, 1, &n2);
        int32_t *g = encode(m.t, "big day", 7, 0, 1, &n);   /* "▁big" "▁day": text " big day" */
        char out[64];
        tok_stream st;
        tok_stream_init_prompt(&st, m.t, p1, n1);
        int k = tok_stream_push(&st, g[0], out, sizeof out);
        CHECK(n1 == 1 && k == 3 && memcmp(out, "big", 3) == 0, "after BOS alone: 'big'");
        tok_stream_init_prompt(&st, m.t, p2, n2);
        k = tok_stream_push(&st, g[0], out, sizeof out);
        CHECK(k == 4 && memcmp(out, " big", 4) == 0, "after a text prompt: ' big'");
        free(p1);
        free(p2);
        free(g);
    }
    /* SPM byte fallback round-trips CJK/emoji through <0xNN> tokens */
    const char *u = "héllo 你好 😀 end\xff";
    int32_t *ids = encode(m.t, u, strlen(u), 0, 0, &n);
    char *dec = decode_all(m.t, ids, n, 0, &dl);
    CHECK(dl == strlen(u) + 1 && memcmp(dec + 1, u, strlen(u)) == 0, "stories: byte fallback round trip");
    free(dec);
    free(ids);
    unload(&m);
}

/* Emoji and CJK split over byte-level tokens: each stream chunk is valid UTF-8. */
static void test_stream_split(const tokenizer *t)
{
    const char *s = "😀👍🏽 👨\u200d👩\u200d👧 你好，世界！ 𝔘𝔫𝔦 ꙮ";
    int64_t n;
    int32_t *ids = encode(t, s, strlen(s), 0, 0, &n);
    size_t dl;
    int split = 0;   /* at least one token must hold a partial sequence */
    char buf[512];
    for (int64_t i = 0; i < n; i++) {
        int k = tokenizer_token_bytes(t, ids[i], 0, buf, sizeof buf);
        if (k > 0 && !unicode_valid_utf8((unsigned char *)buf, (size_t)k))
            split++;
    }
    CHECK(split > 0, "stream test needs tokens that split a UTF-8 sequence");
    char *st = stream_all(t, ids, n, 1, &dl);
    CHECK(dl == strlen(s) && memcmp(st, s, dl) == 0, "stream of emoji/CJK differs");
    free(st);
    /* held bytes come out on flush; a too-small buffer fails without losing state */
    tok_stream ts;
    tok_stream_init(&ts, t);
    int32_t id0 = ids[0];
    int k = tok_stream_push(&ts, id0, buf, 0);
    int ok = k == 0 || k == -1;
    if (k == -1)
        k = tok_stream_push(&ts, id0, buf, sizeof buf);
    CHECK(ok && k >= 0, "stream push with cap 0");
    free(ids);
}

/* ==== 5. chat templates ==== */

static void test_chat(void)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/models/qwen3-mini-Q8_0.gguf", t_fixtures());
    if (!t_need(path))
        return;
    loaded m;
    if (load_model(&m, path)) {
        CHECK(0, "cannot load %s", path);
        return;
    }
    char err[256] = "";
    enum chat_format fmt = chat_detect(m.g, err, sizeof err);
    CHECK(fmt == CHAT_CHATML, "qwen3 template should be ChatML (%s)", err);
    chat_msg msgs[2] = {
        { "system", "You are a helpful assistant that answers briefly." },
        { "user", "What is the boiling point of water at sea level, in Celsius?" },
    };
    char *p = chat_render(CHAT_CHATML, msgs, 2, 1);
    CHECK(p != NULL, "chat_render");
    /* the golden ChatML prompt */
    snprintf(path, sizeof path, "%s/golden/visible/qwen3-mini-Q8_0.jsonl", t_fixtures());
    FILE *f = fopen(path, "r");
    char *line = NULL;
    size_t cap = 0;
    int found = 0;
    while (f && p && getline(&line, &cap, f) > 0) {
        json_t *o = json_loads(line, 0, NULL);
        const char *name = json_string_value(json_object_get(o, "name"));
        if (name && strstr(name, "chat")) {
            found = 1;
            const char *want = json_string_value(json_object_get(o, "prompt"));
            CHECK(want && strcmp(p, want) == 0, "ChatML render differs from golden:\n%s", p);
            int64_t n;
            int32_t *ids = encode(m.t, p, strlen(p), 1, 1, &n);
            CHECK(ids_equal_json(ids, n, json_object_get(o, "prompt_ids")), "ChatML ids differ from golden");
            free(ids);
        }
        json_decref(o);
    }
    CHECK(found, "no chat prompt in %s", path);
    free(line);
    if (f)
        fclose(f);
    free(p);
    p = chat_render(CHAT_CHATML, msgs + 1, 1, 0);
    CHECK(p && strcmp(p, "<|im_start|>user\nWhat is the boiling point of water at sea level, in Celsius?<|im_end|>\n") == 0,
          "ChatML without generation prompt");
    free(p);
    chat_msg l3[2] = { { "system", "Be brief. " }, { "user", "\nHi" } };
    p = chat_render(CHAT_LLAMA3, l3, 2, 1);
    CHECK(p && strcmp(p, "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                         "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\n") == 0, "Llama 3 render: %s", p);
    free(p);
    CHECK(chat_render(CHAT_NONE, msgs, 2, 1) == NULL, "CHAT_NONE renders nothing");
    p = chat_render(CHAT_CHATML, NULL, 0, 1);
    CHECK(p && strcmp(p, "<|im_start|>assistant\n") == 0, "empty conversation");
    free(p);
    CHECK(tokenizer_eot(m.t) == 151645, "qwen eot is <|im_end|>: %d", tokenizer_eot(m.t));
    CHECK(tokenizer_is_eog(m.t, 151643) && tokenizer_is_eog(m.t, 151645) && !tokenizer_is_eog(m.t, 151644),
          "qwen eog set");
    unload(&m);

    /* Llama 3 render through the Llama 3 vocabulary: header tokens are single ids */
    snprintf(path, sizeof path, "%s/vocab/ggml-vocab-llama-bpe.gguf", t_fixtures());
    /* a missing vocabulary is a counted skip (no fixture set) or a failure, never a silent loss */
    if (t_need(path) && load_model(&m, path) == 0) {
        chat_msg u = { "user", "Hi there" };
        p = chat_render(CHAT_LLAMA3, &u, 1, 1);
        int64_t n;
        int32_t *ids = p ? encode(m.t, p, strlen(p), 1, 1, &n) : NULL;
        /* <|start_header_id|> user <|end_header_id|> \n\n Hi  there <|eot_id|> <|start_header_id|> assistant <|end_header_id|> \n\n */
        static const int32_t want[] = { 128006, 882, 128007, 271, 13347, 1070, 128009, 128006, 78191, 128007, 271 };
        int ok = ids && n == 11 && memcmp(ids, want, sizeof want) == 0;
        CHECK(ok, "Llama 3 chat ids");
        if (!ok)
            print_ids("got", ids, n);
        CHECK(tokenizer_eot(m.t) == 128009 && tokenizer_is_eog(m.t, 128009) && tokenizer_is_eog(m.t, 128001),
              "Llama 3 eot/eog");
        free(ids);
        free(p);
        unload(&m);
    }
    t_fixture_path(path, sizeof path, "models/stories260K.gguf");
    if (t_need(path) && load_model(&m, path) == 0) {
        err[0] = 0;
        CHECK(chat_detect(m.g, err, sizeof err) == CHAT_NONE && err[0], "stories has no chat template");
        unload(&m);
    }
}

/* ==== 6. robustness ==== */

static void test_qwen_misc(void)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/models/qwen3-mini-Q8_0.gguf", t_fixtures());
    if (!t_need(path))
        return;
    loaded m;
    if (load_model(&m, path)) {
        CHECK(0, "cannot load %s", path);
        return;
    }
    const tokenizer *t = m.t;
    /* USER_DEFINED <think> is one token even without parse_special; CONTROL is not */
    const char *s = "<think>x</think><|im_start|>";
    int64_t n;
    int32_t *ids = encode(t, s, strlen(s), 0, 0, &n);
    size_t l;
    const char *p0 = ids && n > 0 ? tokenizer_token_str(t, ids[0], &l) : NULL;
    CHECK(p0 && l == 7 && memcmp(p0, "<think>", 7) == 0 && tokenizer_token_type(t, ids[0]) == TOK_USER_DEFINED,
          "<think> should stay one token without parse_special");
    CHECK(n > 4 && ids[n - 1] != 151644, "<|im_start|> must not be special without parse_special");
    free(ids);
    ids = encode(t, s, strlen(s), 0, 1, &n);
    CHECK(n == 4 && ids[3] == 151644, "<|im_start|> special with parse_special");
    free(ids);
    /* invalid UTF-8 is tokenized without crashing and decodes to the same bytes */
    const char bad[] = "ok \xff\xfe\xc3 \xe4\xbd mid\xf0\x9f\x98 end \x80\x80 caf\xc3\xa9";
    ids = encode(t, bad, sizeof bad - 1, 0, 1, &n);
    CHECK(ids && n > 0, "invalid UTF-8 encodes");
    size_t dl;
    char *dec = ids ? decode_all(t, ids, n, 1, &dl) : NULL;
    CHECK(dec && dl == sizeof bad - 1 && memcmp(dec, bad, dl) == 0, "invalid UTF-8 round trip");
    free(dec);
    /* stream with invalid bytes loses nothing */
    char *st = ids ? stream_all(t, ids, n, 0, &dl) : NULL;
    CHECK(st && dl == sizeof bad - 1 && memcmp(st, bad, dl) == 0, "invalid UTF-8 stream keeps bytes");
    free(st);
    free(ids);
    /* cap smaller than the encoding: returns the full count, writes only cap */
    int32_t small[3] = { -7, -7, -7 };
    int64_t r = tokenizer_encode(t, "The quick brown fox", 19, 0, 0, small, 2);
    CHECK(r == 4 && small[0] == 785 && small[2] == -7, "encode with small cap: %lld", (long long)r);
    CHECK(tokenizer_encode(t, "", 0, 1, 1, small, 3) == 0, "empty text, no BOS for qwen");
    CHECK(tokenizer_token_bytes(t, -1, 0, (char *)small, 4) == -1, "bad id");
    CHECK(tokenizer_token_bytes(t, tokenizer_n_vocab(t), 0, (char *)small, 4) == -1, "bad id (n_vocab)");
    CHECK(tokenizer_token_bytes(t, 151645, 0, (char *)small, 4) == 0, "control token renders empty");
    char two[2];
    CHECK(tokenizer_token_bytes(t, 256, 0, two, 2) == 2 && two[0] == ' ' && two[1] == ' ',
          "\"ĠĠ\" decodes to two spaces in a 2-byte buffer");
    CHECK(tokenizer_token_bytes(t, 256, 0, two, 1) == -1, "too small a buffer is an error, not a truncation");
    CHECK(tokenizer_token_bytes(t, 151645, 1, (char *)small, 12) == 10, "control token rendered on request");
    test_stream_split(t);
    /* speed: the long GPL prompt (1338 tokens) in milliseconds */
    snprintf(path, sizeof path, "%s/tokenize/visible.jsonl", t_fixtures());
    size_t len;
    char *all = read_whole(path, &len);
    if (all) {
        char *q = strstr(all, "\"07_long_gpl3\"");
        char *ln = q ? memchr(q, '\n', len - (size_t)(q - all)) : NULL;
        char *start = q;
        while (start && start > all && start[-1] != '\n')
            start--;
        json_t *o = start ? json_loadb(start, (size_t)((ln ? ln : all + len) - start), 0, NULL) : NULL;
        json_t *jt = json_object_get(o, "text");
        if (jt) {
            double t0 = now_ms();
            int64_t cnt = tokenizer_encode(t, json_string_value(jt), json_string_length(jt), 0, 1, NULL, 0);
            double ms = now_ms() - t0;
            printf("long prompt: %lld tokens in %.2f ms\n", (long long)cnt, ms);
            CHECK(cnt == 1338 && ms < 250.0, "long prompt: %lld tokens in %.1f ms", (long long)cnt, ms);
        }
        CHECK(jt != NULL, "long prompt not found");
        json_decref(o);
        free(all);
    }
    unload(&m);
}

/* A GGUF with an unknown pre-tokenizer must be refused with its name. */
static void test_refuse_pre(void)
{
    char path[] = "/tmp/tandem_tok_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    if (fd < 0)
        return;
    close(fd);
    gguf_writer *w = gguf_writer_new(32);
    const char *toks[3] = { "a", "b", "ab" };
    const char *merges[1] = { "a b" };
    int32_t types[3] = { 1, 1, 1 };
    gguf_writer_add_str(w, "general.architecture", "llama");
    gguf_writer_add_str(w, "tokenizer.ggml.model", "gpt2");
    gguf_writer_add_str(w, "tokenizer.ggml.pre", "martian-bpe");
    gguf_writer_add_str_arr(w, "tokenizer.ggml.tokens", toks, NULL, 3);
    gguf_writer_add_str_arr(w, "tokenizer.ggml.merges", merges, NULL, 1);
    gguf_writer_add_arr(w, "tokenizer.ggml.token_type", GGUF_VT_I32, types, 3);
    char err[256] = "";
    int sv = gguf_writer_save(w, path, err, sizeof err);
    gguf_writer_free(w);
    CHECK(sv == 0, "writer: %s", err);
    gguf_file *g = NULL;
    tokenizer *t = NULL;
    if (sv == 0 && gguf_open_file(&g, path, err, sizeof err) == 0) {
        err[0] = 0;
        CHECK(tokenizer_load(&t, g, err, sizeof err) != 0 && strstr(err, "martian-bpe"),
              "unknown pre-tokenizer refused by name: '%s'", err);
        tokenizer_free(t);
        gguf_close(g);
    } else {
        CHECK(0, "reopen: %s", err);
    }
    unlink(path);
}

int main(void)
{
    test_vocab_file("llama-spm");
    test_vocab_file("llama-bpe");
    test_vocab_file("qwen2");
    test_visible();
    test_golden("golden/visible");
    test_golden("golden-mainline/visible");
    test_stories_stream();
    test_chat();
    test_qwen_misc();
    test_refuse_pre();
    return t_done("test_tokenizer");
}
