/* test_grammar.c - constrained decoding (src/engine/grammar.c).
 *
 *  1. compile errors name the refused keyword and its JSON pointer
 *  2. handcrafted valid / invalid outputs per schema feature
 *  3. masks agree with accept_token on every token of the Qwen2 vocabulary
 *     (151,936 tokens) in states of every kind (the string fast path included)
 *  4. random walks: tokens drawn from the mask until complete; the text must
 *     parse with jansson and validate (a small validator of the subset below);
 *     end-of-generation is allowed exactly when the output is complete
 *  5. termination: a bounded schema reaches "only EOG allowed" without EOG
 *  6. mask time per step by state kind (printed; a loose bound is checked)
 * SHOW=1 prints the random walks' outputs.
 */
#include "t.h"
#include "engine/gguf.h"
#include "engine/grammar.h"
#include "engine/tokenizer.h"

#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

static int g_asan;

/* ==== Helpers ==== */

static grammar *compile(const char *schema_text)
{
    json_error_t je;
    json_t *s = json_loads(schema_text, JSON_DECODE_ANY, &je);
    CHECK(s, "schema does not parse: %s: %s", schema_text, je.text);
    if (!s) return NULL;
    grammar *g = NULL;
    char err[256] = "";
    int rc = grammar_compile_schema(&g, s, err, sizeof err);
    CHECK(rc == 0 && g, "compile %s: %s", schema_text, err);
    json_decref(s);
    return g;
}

/* 1 if text is a complete valid output, 0 if a valid prefix only, -1 if rejected. */
static int run_text(const grammar *g, const char *text)
{
    grammar_state *s = grammar_state_new(g);
    if (!s) return -2;
    int r = grammar_accept_bytes(s, text, strlen(text)) ? -1 : grammar_is_complete(s);
    grammar_state_free(s);
    return r;
}

static void expect_ok(const grammar *g, const char *schema, const char *text)
{
    CHECK(run_text(g, text) == 1, "schema %s should accept %s (got %d)", schema, text, run_text(g, text));
}

static void expect_bad(const grammar *g, const char *schema, const char *text)
{
    CHECK(run_text(g, text) != 1, "schema %s should refuse %s", schema, text);
}

/* ==== A validator for the supported subset ==== */

static const json_t *v_resolve(const json_t *root, const char *ref)
{
    if (ref[0] != '#') return NULL;
    const json_t *cur = root;
    const char *p = ref + 1;
    while (*p == '/') {
        char seg[256];
        size_t n = 0;
        for (p++; *p && *p != '/' && n + 1 < sizeof seg; p++) seg[n++] = *p;
        seg[n] = 0;
        cur = json_object_get(cur, seg);
        if (!cur) return NULL;
    }
    return cur;
}

static int v_type(const json_t *v, const char *t)
{
    if (!strcmp(t, "object")) return json_is_object(v);
    if (!strcmp(t, "array")) return json_is_array(v);
    if (!strcmp(t, "string")) return json_is_string(v);
    if (!strcmp(t, "integer")) return json_is_integer(v) || (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)));
    if (!strcmp(t, "number")) return json_is_number(v);
    if (!strcmp(t, "boolean")) return json_is_boolean(v);
    if (!strcmp(t, "null")) return json_is_null(v);
    return 0;
}

static int validate(const json_t *root, const json_t *s, const json_t *v)
{
    if (json_is_true(s)) return 1;
    if (!json_is_object(s)) return 0;
    const json_t *x;
    if ((x = json_object_get(s, "$ref"))) return validate(root, v_resolve(root, json_string_value(x)), v);
    if ((x = json_object_get(s, "allOf"))) return validate(root, json_array_get(x, 0), v);
    if ((x = json_object_get(s, "anyOf"))) {
        size_t i;
        const json_t *sub;
        json_array_foreach(x, i, sub) if (validate(root, sub, v)) return 1;
        return 0;
    }
    if ((x = json_object_get(s, "const")) && !json_equal(x, v)) return 0;
    if ((x = json_object_get(s, "enum"))) {
        size_t i;
        const json_t *e;
        int found = 0;
        json_array_foreach(x, i, e) found |= json_equal(e, v);
        if (!found) return 0;
    }
    if ((x = json_object_get(s, "type"))) {
        int ok = 0;
        if (json_is_string(x)) ok = v_type(v, json_string_value(x));
        size_t i;
        const json_t *t;
        if (json_is_array(x)) json_array_foreach(x, i, t) ok |= v_type(v, json_string_value(t));
        if (!ok) return 0;
    }
    if (json_is_object(v)) {
        const json_t *props = json_object_get(s, "properties"), *addl = json_object_get(s, "additionalProperties");
        const char *k;
        const json_t *val;
        json_object_foreach((json_t *)v, k, val) {
            const json_t *ps = props ? json_object_get(props, k) : NULL;
            if (ps) {
                if (!validate(root, ps, val)) return 0;
            } else if (json_is_false(addl) || (json_is_object(addl) && !validate(root, addl, val))) {
                return 0;
            }
        }
        size_t i;
        const json_t *r;
        json_array_foreach(json_object_get(s, "required"), i, r) if (!json_object_get(v, json_string_value(r))) return 0;
    }
    if (json_is_array(v)) {
        const json_t *items = json_object_get(s, "items");
        size_t i;
        const json_t *e;
        if (items) json_array_foreach(v, i, e) if (!validate(root, items, e)) return 0;
        if ((x = json_object_get(s, "minItems")) && json_array_size(v) < (size_t)json_integer_value(x)) return 0;
        if ((x = json_object_get(s, "maxItems")) && json_array_size(v) > (size_t)json_integer_value(x)) return 0;
    }
    if (json_is_number(v)) {
        double d = json_number_value(v);
        if ((x = json_object_get(s, "minimum")) && d < json_number_value(x)) return 0;
        if ((x = json_object_get(s, "maximum")) && d > json_number_value(x)) return 0;
        if ((x = json_object_get(s, "exclusiveMinimum")) && d <= json_number_value(x)) return 0;
        if ((x = json_object_get(s, "exclusiveMaximum")) && d >= json_number_value(x)) return 0;
    }
    return 1;
}

/* ==== 1. Compile errors ==== */

static void test_errors(void)
{
    static const struct { const char *schema, *want; } cases[] = {
        { "{\"type\":\"string\",\"pattern\":\"^(?!a)b\"}", "pattern at #/pattern: lookaround" },
        { "{\"type\":\"object\",\"properties\":{\"id\":{\"type\":\"string\",\"format\":\"hostname\"}}}", "'format' (\"hostname\") at #/properties/id" },
        { "{\"type\":\"object\",\"properties\":{\"a/b\":{\"type\":\"string\",\"minLength\":2,\"pattern\":\"a\"}}}", "'minLength' beside 'pattern' at #/properties/a~1b" },
        { "{\"type\":\"integer\",\"format\":\"int64\"}", "'format' on type 'integer'" },
        { "{\"oneOf\":[{\"type\":\"string\"}]}", "'oneOf' at #" },
        { "{\"type\":\"array\",\"items\":{\"not\":{}}}", "'not' at #/items" },
        { "{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"integer\",\"multipleOf\":3}]}", "'multipleOf' at #/anyOf/1" },
        { "{\"type\":\"array\",\"uniqueItems\":true}", "'uniqueItems' at #" },
        { "{\"$ref\":\"#/$defs/missing\"}", "'#/$defs/missing'" },
        { "{\"$ref\":\"http://example.com/s.json\"}", "does not resolve" },
        { "{\"$ref\":\"#\"}", "left-recursive" },
        { "{\"$defs\":{\"a\":{\"anyOf\":[{\"$ref\":\"#/$defs/a\"},{\"type\":\"null\"}]}},\"$ref\":\"#/$defs/a\"}", "left-recursive" },
        { "{\"type\":\"object\",\"anyOf\":[{\"type\":\"object\"}]}", "'type' beside 'anyOf'" },
        { "{\"type\":\"array\",\"maxItems\":100000}", "'maxItems' at # above" },
        { "{\"type\":\"array\",\"minItems\":3,\"maxItems\":2}", "minItems > maxItems" },
        { "{\"type\":\"array\",\"items\":[{\"type\":\"string\"}]}", "'items' (tuple form)" },
        { "{\"type\":\"integer\",\"minimum\":5,\"maximum\":4}", "no integer" },
        { "{\"type\":\"number\",\"exclusiveMinimum\":1,\"exclusiveMaximum\":1}", "no number" },
        { "{\"type\":\"strng\"}", "unknown type 'strng'" },
        { "{\"type\":\"object\",\"required\":[\"x\"],\"additionalProperties\":false}", "'x'" },
        { "false", "accepts nothing" },
        { "{\"enum\":[1,2],\"type\":\"string\"}", "no value of the given type" },
        { "{\"type\":\"object\",\"properties\":{\"a\":{\"$ref\":\"#/definitions/x\",\"minimum\":1}},\"definitions\":{\"x\":{}}}",
          "'minimum' beside '$ref' at #/properties/a" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        json_t *s = json_loads(cases[i].schema, JSON_DECODE_ANY, NULL);
        grammar *g = NULL;
        char err[256] = "";
        int rc = grammar_compile_schema(&g, s, err, sizeof err);
        CHECK(rc == -1 && !g, "schema %s should be refused", cases[i].schema);
        CHECK(strstr(err, cases[i].want), "schema %s: error '%s' should contain '%s'", cases[i].schema, err, cases[i].want);
        grammar_free(g);
        json_decref(s);
    }
    /* a huge schema hits the size cap, not memory exhaustion */
    json_t *big = json_object(), *props = json_object();
    for (int i = 0; i < 300; i++) {
        char name[16];
        snprintf(name, sizeof name, "p%d", i);
        json_object_set_new(props, name, json_pack("{s:s,s:i,s:i}", "type", "array", "minItems", 1000, "maxItems", 1000));
    }
    json_object_set_new(big, "properties", props);
    grammar *g = NULL;
    char err[256] = "";
    CHECK(grammar_compile_schema(&g, big, err, sizeof err) == -1 && strstr(err, "too large"), "size cap: %s", err);
    json_decref(big);
}

/* ==== 2. Handcrafted outputs ==== */

typedef struct {
    const char *schema;
    const char *ok[8];
    const char *bad[10];
} accept_case;

static const accept_case accept_cases[] = {
    { "{\"type\":\"string\"}",
      { "\"\"", "\"hi there\"", "\"a\\\"b\\\\c\\/\\b\\f\\n\\r\\t\"", "\"\\u00e9\\uD83D\\uDE00\"", "\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"" },
      { "\"", "\"a", "hi", "\"a\nb\"", "\"\\x\"", "\"\\u0000\"", "\"\\uDE00\"", "\"\\uD83D\"", "\"\xc0\xaf\"", "\"\xed\xa0\x80\"" } },
    { "{\"type\":\"integer\"}",
      { "0", "-7", "123456789012345678" },
      { "01", "1.5", "1e3", "-", "+1", "1234567890123456789", "" } },
    { "{\"type\":\"number\"}",
      { "0", "-0.5", "3.25e-7", "1E+10", "12.0", "123456789012345678.5e99" },
      { ".5", "1.", "1e", "--1", "0x10", "NaN", "1e308", "1234567890123456789" } },
    { "{\"type\":\"integer\",\"minimum\":-15,\"maximum\":120}",
      { "-15", "-9", "0", "7", "99", "100", "120" },
      { "-16", "-150", "121", "200", "1000", "-0", "007" } },
    { "{\"type\":\"integer\",\"exclusiveMinimum\":0,\"exclusiveMaximum\":10}",
      { "1", "9" },
      { "0", "10", "-1" } },
    { "{\"type\":\"number\",\"minimum\":-1.5,\"maximum\":2.25}",
      { "-1.5", "-1.49", "-1", "0", "0.75", "2", "2.25", "2.2499" },
      { "-1.51", "-2", "2.26", "2.3", "3", "2.250001", "1e0" } },
    { "{\"type\":\"number\",\"exclusiveMinimum\":0,\"maximum\":1}",
      { "0.001", "0.5", "1", "1.000" },
      { "0", "0.0", "-0.1", "1.001", "-0" } },
    { "{\"type\":\"boolean\"}", { "true", "false" }, { "True", "1", "null", "tru" } },
    { "{\"type\":\"null\"}", { "null" }, { "nul", "\"null\"" } },
    { "{\"type\":[\"string\",\"null\"]}", { "null", "\"x\"" }, { "1", "true" } },
    { "{\"enum\":[\"red\",\"green\",42,null,{\"a\":[1]}]}",
      { "\"red\"", "\"green\"", "42", "null", "{\"a\":[1]}" },
      { "\"blue\"", "\"re\"", "41", "{\"a\":[2]}" } },
    { "{\"const\":\"fixed\"}", { "\"fixed\"" }, { "\"fixe\"", "\"fixed2\"" } },
    { "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"}},"
      "\"required\":[\"name\"],\"additionalProperties\":false}",
      { "{\"name\":\"a\"}", "{\"name\":\"a\",\"age\":3}", "{ \"name\" : \"a\" , \"age\" : 3 }", "{\n  \"name\": \"a\",\n  \"age\": 3\n}" },
      { "{}", "{\"age\":3}", "{\"age\":3,\"name\":\"a\"}", "{\"name\":\"a\",\"x\":1}", "{\"name\":1}", "{\"name\":\"a\",}",
        "{\"name\":\"a\"}}", "{\"name\":\"a\"  }" } },
    { "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"integer\"},\"c\":{\"type\":\"integer\"}}}",
      { "{}", "{\"a\":1}", "{\"b\":2}", "{\"c\":3}", "{\"a\":1,\"c\":3}", "{\"a\":1,\"b\":2,\"c\":3}" },
      { "{\"c\":3,\"a\":1}", "{,\"a\":1}", "{\"a\":1,,\"b\":2}", "{\"a\":1 \"b\":2}" } },
    { "{\"properties\":{\"a\":false,\"b\":{\"type\":\"null\"}}}", { "{}", "{\"b\":null}" }, { "{\"a\":1}" } },
    { "{\"type\":\"object\",\"additionalProperties\":{\"type\":\"integer\"}}",
      { "{}", "{\"x\":1}", "{\"x\":1,\"y\":-2}" },
      { "{\"x\":\"1\"}", "{\"x\":1,}" } },
    { "{\"type\":\"object\"}",
      { "{}", "{\"a\":[1,{\"b\":null}],\"c\":\"d\"}" },
      { "[]", "{\"a\"}", "{\"a\":}" } },
    { "{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":2,\"maxItems\":3}",
      { "[1,2]", "[1, 2, 3]", "[ 1 , 2 ]" },
      { "[]", "[1]", "[1,2,3,4]", "[1,2,]", "[1,\"a\"]" } },
    { "{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"minItems\":1}",
      { "[\"a\"]", "[\"a\",\"b\",\"c\",\"d\",\"e\"]" },
      { "[]", "[\"a\",]" } },
    { "{\"type\":\"array\",\"maxItems\":0}", { "[]", "[ ]" }, { "[1]" } },
    { "{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"object\",\"properties\":{\"k\":{\"const\":1}},\"required\":[\"k\"]}]}",
      { "5", "{\"k\":1}" },
      { "\"5\"", "{\"k\":2}", "{}" } },
    { "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},"
      "\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"}}},\"required\":[\"v\"]}},\"$ref\":\"#/$defs/node\"}",
      { "{\"v\":1}", "{\"v\":1,\"kids\":[]}", "{\"v\":1,\"kids\":[{\"v\":2,\"kids\":[{\"v\":3}]},{\"v\":4}]}" },
      { "{\"v\":1,\"kids\":[{}]}", "{\"kids\":[]}" } },
    { "{\"definitions\":{\"s\":{\"type\":\"string\"}},\"type\":\"array\",\"items\":{\"$ref\":\"#/definitions/s\"}}",
      { "[\"a\",\"b\"]" }, { "[1]" } },
    { "{\"allOf\":[{\"type\":\"boolean\"}],\"description\":\"d\"}", { "true" }, { "1" } },
    { "true", { "1", "\"s\"", "[{}]" }, { "}" } },
};

static void test_accept(void)
{
    for (size_t i = 0; i < sizeof accept_cases / sizeof accept_cases[0]; i++) {
        const accept_case *c = &accept_cases[i];
        grammar *g = compile(c->schema);
        if (!g) continue;
        for (int k = 0; k < 8 && c->ok[k]; k++) expect_ok(g, c->schema, c->ok[k]);
        for (int k = 0; k < 10 && c->bad[k]; k++) expect_bad(g, c->schema, c->bad[k]);
        grammar_free(g);
    }
    /* json_object mode: any object, nothing else; whitespace bounded */
    grammar *g = NULL;
    char err[256];
    CHECK(grammar_compile_json_object(&g, err, sizeof err) == 0, "json_object: %s", err);
    const char *ok[] = { "{}", "{\"a\":1}", "{\"a\":{\"b\":[true,false,null,-1.5e3,\"\\u00e9\"]}}", "{\n\t\"x\": []\n}" };
    const char *bad[] = { "[]", "1", "\"s\"", " {}", "{\"a\":1}x", "{\"a\" 1}", "{\"a\":01}",
                          "{\"a\":                                   1}" };
    for (size_t k = 0; k < sizeof ok / sizeof *ok; k++) expect_ok(g, "json_object", ok[k]);
    for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) expect_bad(g, "json_object", bad[k]);
    /* a failed accept leaves the state as it was */
    grammar_state *s = grammar_state_new(g);
    CHECK(grammar_accept_bytes(s, "{\"a\"", 4) == 0, "prefix");
    uint64_t h = grammar_state_hash(s);
    grammar_state *copy = grammar_state_clone(s);
    CHECK(grammar_accept_bytes(s, ":]", 2) == -1, "bad continuation");
    CHECK(grammar_state_hash(s) == h && grammar_state_equal(s, copy), "state unchanged after a refused byte");
    CHECK(grammar_accept_bytes(s, ":1}", 3) == 0 && grammar_is_complete(s) && grammar_is_finished(s), "complete");
    /* nesting deeper than the stack cap is refused, not a crash */
    char deep[4096];
    memset(deep, '[', sizeof deep);
    grammar_state *d = grammar_state_new(g);
    CHECK(grammar_accept_bytes(d, "{\"a\":", 5) == 0 && grammar_accept_bytes(d, deep, sizeof deep) == -1, "deep nesting refused");
    grammar_state_free(d);
    grammar_state_free(s);
    grammar_state_free(copy);
    grammar_free(g);
}

/* ==== Vocabulary ==== */

typedef struct {
    gguf_file *f;
    tokenizer *t;
    grammar_vocab *v;
    int32_t n;
} vocab;

static int vocab_load(vocab *vb)
{
    char path[1024], err[256] = "";
    snprintf(path, sizeof path, "%s/vocab/ggml-vocab-qwen2.gguf", t_fixtures());
    memset(vb, 0, sizeof *vb);
    if (!t_need(path))
        return -1;
    if (gguf_open_file(&vb->f, path, err, sizeof err) || tokenizer_load(&vb->t, vb->f, err, sizeof err)) {
        CHECK(0, "load %s: %s", path, err);
        return -1;
    }
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    vb->v = grammar_vocab_new(vb->t, err, sizeof err);
    clock_gettime(CLOCK_MONOTONIC, &b);
    CHECK(vb->v, "grammar_vocab_new: %s", err);
    if (!vb->v) return -1;
    vb->n = grammar_vocab_n(vb->v);
    printf("grammar_vocab_new: %d tokens in %.1f ms\n", vb->n,
           (double)(b.tv_sec - a.tv_sec) * 1e3 + (double)(b.tv_nsec - a.tv_nsec) / 1e6);
    return 0;
}

/* ==== 3. Masks agree with accept_token ==== */

/* Every token (or every stride-th) in state s: mask bit == accept_token works. */
static void check_mask_exact(vocab *vb, grammar_state *s, const char *what, int stride)
{
    uint8_t *m = malloc((size_t)vb->n);
    int64_t count = grammar_mask(s, vb->v, m), seen = 0;
    int bad = 0;
    for (int32_t id = 0; id < vb->n; id++) {
        seen += m[id];
        if (id % stride) continue;
        grammar_state *c = grammar_state_clone(s);
        int ok = grammar_accept_token(c, vb->v, id) == 0;
        grammar_state_free(c);
        if (ok != m[id] && bad++ < 3) {
            char buf[256];
            int k = tokenizer_token_bytes(vb->t, id, 1, buf, sizeof buf - 1);
            buf[k > 0 ? k : 0] = 0;
            CHECK(0, "%s: token %d '%s': mask %d, accept %d", what, id, buf, m[id], ok);
        }
    }
    CHECK(!bad, "%s: %d disagreements", what, bad);
    CHECK(count == seen && count > 0, "%s: count %lld", what, (long long)count);
    free(m);
}

static const char *k_person =
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":150},"
    "\"email\":{\"type\":\"string\"},\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"b\",\"vip\"]},\"maxItems\":3},"
    "\"score\":{\"type\":\"number\",\"minimum\":-1,\"maximum\":1},\"active\":{\"type\":\"boolean\"}},"
    "\"required\":[\"name\",\"age\",\"active\"],\"additionalProperties\":false}";

static void test_mask_exact(vocab *vb)
{
    grammar *g = NULL, *p = compile(k_person);
    char err[256];
    grammar_compile_json_object(&g, err, sizeof err);
    static const char *prefixes[] = {
        "", "{", "{\"", "{\"ab", "{\"a\":", "{\"a\": \"x", "{\"a\":\"x\\", "{\"a\":\"x\\u00", "{\"a\":\"\xe2\x82",
        "{\"a\":\"\\ud83d", "{\"a\":1", "{\"a\":[1,", "{\"a\":[{\"b\":null}", "{\"a\":1}", "{\"a\":\n  ", "{\"a\":t",
    };
    int stride = g_asan ? 13 : 1;
    for (size_t i = 0; i < sizeof prefixes / sizeof *prefixes; i++) {
        grammar_state *s = grammar_state_new(g);
        CHECK(grammar_accept_bytes(s, prefixes[i], strlen(prefixes[i])) == 0, "prefix %s", prefixes[i]);
        char what[128];
        snprintf(what, sizeof what, "json_object after '%s'", prefixes[i]);
        check_mask_exact(vb, s, what, stride);
        grammar_state_free(s);
    }
    static const char *pp[] = { "{\"name\":\"Al", "{\"name\":\"Al\",\"age\":1", "{\"name\":\"Al\",\"age\":15",
                                "{\"name\":\"\",\"age\":0,\"tags\":[\"a\",", "{\"name\":\"\",\"age\":0,\"score\":-0.",
                                "{\"name\":\"\",\"age\":0,\"active\":false" };
    for (size_t i = 0; i < sizeof pp / sizeof *pp; i++) {
        grammar_state *s = grammar_state_new(p);
        CHECK(grammar_accept_bytes(s, pp[i], strlen(pp[i])) == 0, "prefix %s", pp[i]);
        char what[128];
        snprintf(what, sizeof what, "person after '%s'", pp[i]);
        check_mask_exact(vb, s, what, stride);
        grammar_state_free(s);
    }
    grammar_free(g);
    grammar_free(p);
}

/* ==== 4. Random walks ==== */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Draws allowed tokens until EOG (taken with probability 1/2 when allowed).
 * To keep walks short, half the draws prefer tokens holding a closing
 * character. Returns the text (malloc'd) or NULL if the cap was hit. */
static char *walk(vocab *vb, const grammar *g, int cap, int never_eog, int *steps_out, int *eog_ok)
{
    grammar_state *s = grammar_state_new(g);
    uint8_t *m = malloc((size_t)vb->n);
    int32_t *ids = malloc((size_t)vb->n * sizeof *ids), *closers = malloc((size_t)vb->n * sizeof *ids);
    size_t tcap = 1 << 16, tlen = 0;
    char *text = malloc(tcap);
    int32_t eos = tokenizer_eos(vb->t) >= 0 ? tokenizer_eos(vb->t) : tokenizer_eot(vb->t);
    int steps = 0, done = 0;
    *eog_ok = 1;
    for (; steps < cap && !done; steps++) {
        grammar_mask(s, vb->v, m);
        int n = 0, nc = 0;
        for (int32_t id = 0; id < vb->n; id++) {
            if (!m[id] || tokenizer_is_eog(vb->t, id)) continue;
            ids[n++] = id;
            char b[64];
            int k = tokenizer_token_bytes(vb->t, id, 0, b, sizeof b);
            for (int j = 0; j < k; j++)
                if (b[j] == '"' || b[j] == '}' || b[j] == ']') {
                    closers[nc++] = id;
                    break;
                }
        }
        int complete = grammar_is_complete(s);
        if (eos >= 0 && m[eos] != complete) *eog_ok = 0;
        if (complete && (!n || (!never_eog && rng() % 2))) {
            done = 1;
            break;
        }
        if (!n) break;   /* stuck: reported by the caller */
        int32_t id = nc && rng() % 2 ? closers[rng() % (uint64_t)nc] : ids[rng() % (uint64_t)n];
        if (grammar_accept_token(s, vb->v, id)) {
            CHECK(0, "allowed token %d refused by accept_token", id);
            break;
        }
        int k = tokenizer_token_bytes(vb->t, id, 0, text + tlen, tcap - tlen - 1);
        if (k < 0) break;
        tlen += (size_t)k;
        if (tlen + 1024 > tcap) break;
    }
    text[tlen] = 0;
    *steps_out = steps;
    grammar_state_free(s);
    free(m);
    free(ids);
    free(closers);
    if (!done) {
        free(text);
        return NULL;
    }
    return text;
}

static const char *walk_schemas[] = {
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"n\":{\"type\":\"integer\",\"minimum\":-5,\"maximum\":5000}},"
    "\"required\":[\"name\",\"n\"],\"additionalProperties\":false}",
    NULL,   /* k_person */
    "{\"type\":\"array\",\"items\":{\"anyOf\":[{\"type\":\"number\",\"exclusiveMinimum\":-2.5,\"maximum\":7.125},"
    "{\"enum\":[\"x\",true,null]},{\"type\":\"object\",\"properties\":{\"k\":{\"type\":\"boolean\"}}}]},\"minItems\":1,\"maxItems\":4}",
    "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},\"kids\":{\"type\":\"array\","
    "\"items\":{\"$ref\":\"#/$defs/node\"},\"maxItems\":2}},\"required\":[\"v\"]}},\"$ref\":\"#/$defs/node\"}",
    "{\"type\":\"object\",\"properties\":{\"calls\":{\"type\":\"array\",\"items\":{\"type\":\"object\",\"properties\":{"
    "\"fn\":{\"const\":\"get_weather\"},\"args\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"},"
    "\"unit\":{\"enum\":[\"c\",\"f\"]}},\"required\":[\"city\"]}},\"required\":[\"fn\",\"args\"]}}},\"required\":[\"calls\"]}",
    "{\"type\":\"object\",\"additionalProperties\":{\"type\":[\"string\",\"null\"]}}",
    "{\"type\":\"object\"}",
};

static void test_walks(vocab *vb)
{
    int per = g_asan ? 2 : 8;
    for (size_t i = 0; i < sizeof walk_schemas / sizeof *walk_schemas; i++) {
        const char *txt = walk_schemas[i] ? walk_schemas[i] : k_person;
        json_t *schema = json_loads(txt, 0, NULL);
        grammar *g = compile(txt);
        if (!g || !schema) continue;
        int finished = 0, total_steps = 0;
        for (int w = 0; w < per; w++) {
            int steps, eog_ok;
            char *out = walk(vb, g, 1500, 0, &steps, &eog_ok);
            total_steps += steps;
            CHECK(eog_ok, "schema %zu walk %d: EOG allowed when not complete or refused when complete", i, w);
            if (!out) continue;
            finished++;
            if (getenv("SHOW")) printf("  %s\n", out);
            json_error_t je;
            json_t *v = json_loads(out, JSON_DECODE_ANY, &je);
            CHECK(v, "schema %zu: output does not parse (%s): %s", i, je.text, out);
            CHECK(v && validate(schema, schema, v), "schema %zu: output does not validate: %s", i, out);
            json_decref(v);
            free(out);
        }
        CHECK(finished >= per - 1, "schema %zu: only %d of %d walks finished", i, finished, per);
        printf("walk schema %zu: %d/%d finished, %.1f tokens per walk\n", i, finished, per, (double)total_steps / per);
        grammar_free(g);
        json_decref(schema);
    }
}

/* ==== 5. Termination ==== */

/* A bounded language (enums, maxItems, integer ranges): never choosing EOG,
 * every walk must still reach a state where EOG is the only choice. */
/* maxLength: a bounded string (printable ASCII, no escapes) always closes,
 * however many tokens would keep a free string open. */
static void test_bounded_strings(vocab *vb)
{
    const char *txt = "{\"type\":\"object\",\"properties\":{\"why\":{\"type\":\"string\",\"maxLength\":12},"
                      "\"code\":{\"type\":\"string\",\"minLength\":2,\"maxLength\":4}},"
                      "\"required\":[\"why\",\"code\"],\"additionalProperties\":false}";
    grammar *g = compile(txt);
    if (!g) return;
    expect_ok(g, txt, "{\"why\":\"short\",\"code\":\"ab\"}");
    expect_ok(g, txt, "{\"why\":\"exactly 12 c\",\"code\":\"abcd\"}");
    expect_bad(g, txt, "{\"why\":\"thirteen char\",\"code\":\"ab\"}");
    expect_bad(g, txt, "{\"why\":\"x\",\"code\":\"a\"}");
    expect_bad(g, txt, "{\"why\":\"a\\\"b\",\"code\":\"ab\"}");
    expect_bad(g, txt, "{\"why\":\"\u00e9\",\"code\":\"ab\"}");
    json_t *schema = json_loads(txt, 0, NULL);
    for (int w = 0; w < (g_asan ? 2 : 6); w++) {
        int steps, eog_ok;
        char *out = walk(vb, g, 200, 1, &steps, &eog_ok);
        CHECK(out, "bounded strings: no end after %d tokens", steps);
        if (!out) continue;
        json_t *v = json_loads(out, 0, NULL);
        const char *why = json_string_value(json_object_get(v, "why"));
        CHECK(v && validate(schema, schema, v) && why && strlen(why) <= 12, "bounded strings output invalid: %s", out);
        json_decref(v);
        free(out);
    }
    grammar_free(g);
    json_decref(schema);
    /* refused: minLength beyond one counter, maxLength beyond one counter
     * (minLength alone is served: test_grammar_text) */
    const char *bad[] = { "{\"type\":\"string\",\"minLength\":300}", "{\"type\":\"string\",\"maxLength\":300}" };
    for (int i = 0; i < 2; i++) {
        json_t *sj = json_loads(bad[i], 0, NULL);
        grammar *gb = NULL;
        char err[256] = "";
        CHECK(grammar_compile_schema(&gb, sj, err, sizeof err) != 0 && strstr(err, "Length"), "%s: %s", bad[i], err);
        grammar_free(gb);
        json_decref(sj);
    }
}

static void test_termination(vocab *vb)
{
    const char *txt = "{\"type\":\"object\",\"properties\":{\"xs\":{\"type\":\"array\",\"items\":{\"type\":\"integer\","
                      "\"minimum\":0,\"maximum\":999},\"maxItems\":3},\"ok\":{\"type\":\"boolean\"},"
                      "\"c\":{\"enum\":[\"red\",\"green\"]}},\"required\":[\"xs\",\"ok\",\"c\"],\"additionalProperties\":false}";
    json_t *schema = json_loads(txt, 0, NULL);
    grammar *g = compile(txt);
    for (int w = 0; w < (g_asan ? 2 : 6) && g; w++) {
        int steps, eog_ok;
        char *out = walk(vb, g, 400, 1, &steps, &eog_ok);
        CHECK(out, "bounded schema: no end after %d tokens", steps);
        if (!out) continue;
        json_t *v = json_loads(out, 0, NULL);
        CHECK(v && validate(schema, schema, v), "bounded schema output invalid: %s", out);
        grammar_state *s = grammar_state_new(g);
        CHECK(grammar_accept_bytes(s, out, strlen(out)) == 0 && grammar_is_finished(s), "finished: %s", out);
        grammar_state_free(s);
        json_decref(v);
        free(out);
    }
    grammar_free(g);
    json_decref(schema);
}

/* ==== 6. Mask time ==== */

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static void test_timing(vocab *vb)
{
    grammar *obj = NULL, *p = compile(k_person);
    char err[256];
    grammar_compile_json_object(&obj, err, sizeof err);
    static const struct { int person; const char *prefix, *kind; } cases[] = {
        { 0, "", "start (json_object: '{' only)" },
        { 0, "{", "json_object: after '{' (key or '}')" },
        { 0, "{\"na", "json_object: inside a key" },
        { 0, "{\"a\":", "json_object: value position" },
        { 0, "{\"a\":\"hello wor", "json_object: inside a string value" },
        { 0, "{\"a\":12", "json_object: inside a number" },
        { 0, "{\"a\":[1,{\"b\":[true", "json_object: nested, after a literal" },
        { 1, "", "schema: start" },
        { 1, "{\"name\":\"Ali", "schema: inside a string value" },
        { 1, "{\"name\":\"Alice\"", "schema: after a string (',' or '}')" },
        { 1, "{\"name\":\"Alice\",", "schema: key position (fixed names)" },
        { 1, "{\"name\":\"Alice\",\"age\":", "schema: integer 0..150" },
        { 1, "{\"name\":\"Alice\",\"age\":1,\"tags\":[", "schema: enum items" },
        { 1, "{\"name\":\"Alice\",\"age\":1,\"score\":0.", "schema: bounded number fraction" },
    };
    int reps = g_asan ? 3 : 50;
    uint8_t *m = malloc((size_t)vb->n);
    float *logits = malloc((size_t)vb->n * sizeof *logits);
    double worst = 0;
    printf("| state | allowed | mask ms |\n|---|---|---|\n");
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        grammar_state *s = grammar_state_new(cases[i].person ? p : obj);
        CHECK(grammar_accept_bytes(s, cases[i].prefix, strlen(cases[i].prefix)) == 0, "timing prefix %s", cases[i].prefix);
        int64_t n = grammar_mask(s, vb->v, m);
        double t0 = now_ms();
        for (int r = 0; r < reps; r++) {
            for (int32_t k = 0; k < vb->n; k++) logits[k] = 0;
            grammar_mask_logits(s, vb->v, logits);
        }
        double ms = (now_ms() - t0) / reps;
        int64_t finite = 0;
        for (int32_t k = 0; k < vb->n; k++) finite += isfinite(logits[k]);
        CHECK(finite == n, "mask_logits keeps %lld, mask allows %lld", (long long)finite, (long long)n);
        if (ms > worst) worst = ms;
        printf("| %s | %lld | %.3f |\n", cases[i].kind, (long long)n, ms);
        grammar_state_free(s);
    }
    /* loose: a regression to a full per-token walk would take far longer */
    if (!g_asan) CHECK(worst < 20, "slowest mask %.2f ms", worst);
    free(m);
    free(logits);
    grammar_free(obj);
    grammar_free(p);
}

int main(void)
{
    g_asan = getenv("TANDEM_ASAN") && atoi(getenv("TANDEM_ASAN"));
    test_errors();
    test_accept();
    vocab vb;
    if (vocab_load(&vb) == 0) {
        test_mask_exact(&vb);
        test_walks(&vb);
        test_bounded_strings(&vb);
        test_termination(&vb);
        test_timing(&vb);
    }
    grammar_vocab_free(vb.v);
    tokenizer_free(vb.t);
    gguf_close(vb.f);
    return t_done("test_grammar");
}
