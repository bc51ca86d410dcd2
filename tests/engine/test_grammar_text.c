/* test_grammar_text.c - grammars written as text (src/engine/grammar_text.c):
 * regular expressions, GBNF, choice lists, and the JSON Schema keywords they
 * serve ("pattern", "format", "minLength" alone).
 *
 *  1. handcrafted accepted / refused outputs for each dialect and feature
 *  2. errors: what is refused names itself (and its byte offset); hostile
 *     sizes (long text, deep nesting, huge counts) are refused, not a crash
 *  3. the refused schema keyword and its pointer (grammar_compile_schema_at)
 *  4. masks agree with accept_token on every Qwen2 token in states of
 *     these grammars; random walks over the mask give outputs the grammar
 *     accepts and (for formats) that a hand-written check of the format
 *     accepts
 */
#include "t.h"
#include "engine/gguf.h"
#include "engine/grammar.h"
#include "engine/tokenizer.h"

#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int g_asan;

/* 1 complete, 0 valid prefix, -1 refused. */
static int run_text(const grammar *g, const char *text, size_t n)
{
    grammar_state *s = grammar_state_new(g);
    if (!s) return -2;
    int r = grammar_accept_bytes(s, text, n) ? -1 : grammar_is_complete(s);
    grammar_state_free(s);
    return r;
}

typedef struct {
    int kind;                  /* 'r' regex, 'g' GBNF, 's' schema */
    const char *src;
    const char *ok[8];
    const char *bad[10];
} text_case;

static grammar *build(int kind, const char *src, char *err, size_t errlen)
{
    grammar *g = NULL;
    if (kind == 'r') grammar_compile_regex(&g, src, strlen(src), err, errlen);
    else if (kind == 'g') grammar_compile_gbnf(&g, src, strlen(src), err, errlen);
    else {
        json_error_t je;
        json_t *s = json_loads(src, 0, &je);
        if (!s) { snprintf(err, errlen, "schema does not parse: %s", je.text); return NULL; }
        grammar_compile_schema(&g, s, err, errlen);
        json_decref(s);
    }
    return g;
}

/* ==== 1. Outputs ==== */

static const text_case cases[] = {
    /* regular expressions: the whole output matches */
    { 'r', "[a-z]+@[a-z]+\\.(com|org)", { "a@b.com", "xyz@q.org" }, { "a@b.net", "@b.com", "a@b.comx", "A@b.com", "" } },
    { 'r', "\\d{3}-\\d{4}", { "555-1234" }, { "55-1234", "555-12345", "5551234", "abc-defg" } },
    { 'r', "(ab|cd)*e?", { "", "ab", "abcd", "cdabe", "e" }, { "a", "abc", "ee", "eab" } },
    { 'r', "x{2,4}", { "xx", "xxx", "xxxx" }, { "x", "xxxxx" } },
    { 'r', "a{3,}", { "aaa", "aaaaaaaaaaaa" }, { "aa", "" } },
    { 'r', "[^0-9\\s]+", { "abc", "\xc3\xa9t\xc3\xa9", "\xf0\x9f\x98\x80" }, { "a1", "a b", "", "\xc3" } },
    { 'r', "caf\xc3\xa9|na\\u00efve|\\x41", { "caf\xc3\xa9", "na\xc3\xafve", "A" }, { "cafe", "naive", "a" } },
    { 'r', "[\xce\xb1-\xcf\x89]{2}", { "\xce\xb1\xce\xb2", "\xcf\x89\xcf\x89" }, { "ab", "\xce\xb1", "\xce\x91\xce\xb1" } },
    { 'r', "\\w+(?:\\.\\w+)*", { "a", "a_1.b2.c" }, { ".a", "a.", "a..b" } },
    { 'r', "(?<year>\\d{4})-[01]\\d", { "2024-07", "1999-12" }, { "2024-7", "2024-27" } },
    { 'r', ".", { "a", "\xe2\x82\xac" }, { "\n", "ab", "" } },
    { 'r', "a.*?z", { "az", "a\xe2\x82\xacz", "abzz" }, { "a\nz", "za" } },
    /* GBNF */
    { 'g', "root ::= expr\nexpr ::= term (\"+\" term)*\nterm ::= [0-9]+ | \"(\" expr \")\"\n",
      { "1", "1+2", "(1+2)+30", "((7))" }, { "", "+", "1+", "(1", "1)", "a" } },
    { 'g', "# a comment\nroot   ::= \"yes\" | \"no\"   # trailing\n\n", { "yes", "no" }, { "y", "yesno", "maybe" } },
    { 'g', "root ::= (\n  \"a\"\n  | \"b\"\n)+ [^x]? .\n", { "a\n", "ba!\xe2\x82\xac", "abz\n", "ax" }, { "a", "x", "axx" } },
    { 'g', "root ::= \"\\\"\" [a-c]{2,3} \"\\x21\\u00e9\\n\" w\nw ::= [ \\t]*", { "\"ab!\xc3\xa9\n", "\"abc!\xc3\xa9\n \t " },
      { "\"a!\xc3\xa9\n", "\"abcd!\xc3\xa9\n", "\"ab!e\n" } },
    /* JSON Schema: pattern (searched: a branch without anchors may have anything around it), format, minLength */
    { 's', "{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}[0-9]{3}$\"}", { "\"AB123\"" }, { "\"AB12\"", "\"ab123\"", "\"xAB123\"", "AB123" } },
    { 's', "{\"type\":\"string\",\"pattern\":\"ab\"}", { "\"ab\"", "\"xxabyy\"", "\"\\\"ab\\n\"" }, { "\"a\"", "\"ba\"" } },
    { 's', "{\"type\":\"string\",\"pattern\":\"^a\\\"b\\\\\\\\c\\\\n$\"}", { "\"a\\\"b\\\\c\\n\"" }, { "\"a\"b\\c\\n\"", "\"a\\\"b\\\\c\\u000a\"" } },
    /* a control character a pattern requires is JSON-escaped as \u00XX (lowercase hex, as lowered) */
    { 's', "{\"type\":\"string\",\"pattern\":\"^a\\\\x01\\\\x1fb$\"}", { "\"a\\u0001\\u001fb\"" },
      { "\"a\x01\x1f" "b\"", "\"a\\u0001b\"", "\"ab\"" } },
    { 's', "{\"type\":\"string\",\"format\":\"date\"}", { "\"2024-02-29\"", "\"1999-12-31\"" }, { "\"2024-13-01\"", "\"2024-00-10\"", "\"2024-1-1\"", "\"2024-01-32\"" } },
    { 's', "{\"type\":\"string\",\"format\":\"date-time\"}", { "\"2024-02-29T23:59:59Z\"", "\"2024-02-29T00:00:00.123+05:30\"" },
      { "\"2024-02-29 23:59:59Z\"", "\"2024-02-29T24:00:00Z\"", "\"2024-02-29T23:59:59\"" } },
    { 's', "{\"type\":\"string\",\"format\":\"time\"}", { "\"12:34:56Z\"", "\"12:34:56.5-01:00\"" }, { "\"12:34Z\"", "\"12:60:00Z\"" } },
    { 's', "{\"type\":\"string\",\"format\":\"uuid\"}", { "\"123e4567-e89b-12d3-a456-426614174000\"", "\"123E4567-E89B-12D3-A456-426614174000\"" },
      { "\"123e4567e89b12d3a456426614174000\"", "\"123e4567-e89b-12d3-a456-42661417400g\"" } },
    { 's', "{\"type\":\"string\",\"format\":\"email\"}", { "\"a.b@example.com\"", "\"x+y@mail.co.uk\"" }, { "\"a@b\"", "\"@b.com\"", "\"a b@c.com\"", "\"a..b@c.com\"" } },
    { 's', "{\"type\":\"string\",\"format\":\"uri\"}", { "\"https://example.com/a?b=c#d\"", "\"urn:isbn:0451450523\"" }, { "\"//x\"", "\"https://a b\"", "\"1http://x\"" } },
    { 's', "{\"type\":\"string\",\"format\":\"ipv4\"}", { "\"192.168.0.1\"", "\"255.255.255.255\"" }, { "\"256.1.1.1\"", "\"1.2.3\"", "\"01.2.3.4\"" } },
    { 's', "{\"type\":\"string\",\"minLength\":3}", { "\"abc\"", "\"abcdef\\u00e9\\\"\"" }, { "\"ab\"", "\"\"" } },
    { 's', "{\"type\":\"object\",\"properties\":{\"id\":{\"type\":\"string\",\"format\":\"uuid\"},\"when\":{\"format\":\"date\"}},"
           "\"required\":[\"id\"],\"additionalProperties\":false}",
      { "{\"id\":\"00000000-0000-0000-0000-000000000000\",\"when\":\"2020-01-01\"}" }, { "{\"id\":\"x\"}", "{\"id\":\"00000000-0000-0000-0000-000000000000\",\"when\":1}" } },
};

static void test_outputs(void)
{
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const text_case *c = &cases[i];
        char err[400] = "";
        grammar *g = build(c->kind, c->src, err, sizeof err);
        CHECK(g, "%c %s: %s", c->kind, c->src, err);
        if (!g) continue;
        for (int k = 0; k < 8 && c->ok[k]; k++)
            CHECK(run_text(g, c->ok[k], strlen(c->ok[k])) == 1, "%c %s should accept '%s'", c->kind, c->src, c->ok[k]);
        for (int k = 0; k < 10 && c->bad[k]; k++)
            CHECK(run_text(g, c->bad[k], strlen(c->bad[k])) != 1, "%c %s should refuse '%s'", c->kind, c->src, c->bad[k]);
        grammar_free(g);
    }
    /* choice: exactly one of the strings */
    const char *ch[] = { "positive", "negative", "neutral", "pos" };
    grammar *g = NULL;
    char err[256] = "";
    CHECK(grammar_compile_choice(&g, ch, 4, err, sizeof err) == 0, "choice: %s", err);
    CHECK(g && run_text(g, "positive", 8) == 1 && run_text(g, "pos", 3) == 1 && run_text(g, "neutral", 7) == 1, "choice accepts");
    CHECK(g && run_text(g, "posit", 5) == 0 && run_text(g, "positives", 9) == -1 && run_text(g, "x", 1) == -1, "choice refuses");
    grammar_free(g);
    const char *empty[] = { "a", "" };
    g = NULL;
    CHECK(grammar_compile_choice(&g, empty, 2, err, sizeof err) == -1 && !g && strstr(err, "empty"), "empty choice: %s", err);
    CHECK(grammar_compile_choice(&g, empty, 0, err, sizeof err) == -1 && !g, "no choices");
}

/* ==== 2. Errors ==== */

static void test_errors(void)
{
    static const struct { int kind; const char *src, *want; } bad[] = {
        { 'r', "(a", "missing ')'" },
        { 'r', "a)", "unmatched ')'" },
        { 'r', "[a-", "unterminated '['" },
        { 'r', "(a)\\1", "back-references" },
        { 'r', "a(?=b)", "lookaround" },
        { 'r', "\\bword", "word boundaries" },
        { 'r', "\\p{L}", "Unicode property" },
        { 'r', "a{5,2}", "max below min" },
        { 'r', "a{100000}", "above 1000" },
        { 'r', "*a", "nothing to repeat" },
        { 'r', "a^b", "anchors" },
        { 'r', "a++", "possessive" },
        { 'r', "[z-a]", "out of order" },
        { 'r', "\xc3", "invalid UTF-8" },
        { 'r', "\\q", "unknown escape" },
        { 'r', "(a*)*", "without consuming" },
        { 'g', "expr ::= \"a\"", "no 'root' rule" },
        { 'g', "root ::= x", "'x' is used but not defined" },
        { 'g', "root ::= \"a\"\nroot ::= \"b\"", "defined twice" },
        { 'g', "root ::= root \"a\" | \"b\"", "without consuming" },
        { 'g', "root ::= \"a", "unterminated string" },
        { 'g', "root = \"a\"", "expected '::='" },
        { 'g', "root ::= [a", "unterminated '['" },
        { 'g', "root ::= \"\\q\"", "unknown escape" },
        { 'g', "root ::= \"a\" )", "expected the end of the rule" },
        { 'g', "root ::= \"\\uD800\"", "no Unicode scalar value" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char err[400] = "";
        grammar *g = build(bad[i].kind, bad[i].src, err, sizeof err);
        CHECK(!g && strstr(err, bad[i].want), "%c '%s': error '%s' should contain '%s'", bad[i].kind, bad[i].src, err, bad[i].want);
        CHECK(!g || strstr(err, "(at byte") || bad[i].kind == 's', "%c '%s': error gives the offset: %s", bad[i].kind, bad[i].src, err);
        grammar_free(g);
    }
    /* hostile sizes: deep groups, long text, a NUL, huge unrolls */
    size_t n = 70 * 2 + 1;
    char *deep = malloc(n + 1);
    for (size_t i = 0; i < 70; i++) { deep[i] = '('; deep[70 + 1 + i] = ')'; }
    deep[70] = 'a';
    deep[n] = 0;
    char err[400] = "";
    grammar *g = NULL;
    CHECK(grammar_compile_regex(&g, deep, n, err, sizeof err) == -1 && strstr(err, "nested deeper"), "deep groups: %s", err);
    free(deep);
    size_t big = 70 * 1024;
    char *longt = malloc(big);
    memset(longt, 'a', big);
    CHECK(grammar_compile_regex(&g, longt, big, err, sizeof err) == -1 && strstr(err, "at most"), "long regex: %s", err);
    free(longt);
    CHECK(grammar_compile_regex(&g, "a\0b", 3, err, sizeof err) == -1 && strstr(err, "NUL"), "NUL: %s", err);
    /* nested counts share their body rule (small); 300 distinct unrolled
     * bodies of 1000 copies each pass the element cap */
    const char *nested = "root ::= ((((\"ab\"{1000}){1000}){1000}))";
    CHECK(grammar_compile_gbnf(&g, nested, strlen(nested), err, sizeof err) == 0 && g, "nested counts: %s", err);
    CHECK(g && run_text(g, "abab", 4) == 0, "nested counts: a prefix");
    grammar_free(g);
    g = NULL;
    char *many = malloc(300 * 12 + 1);
    size_t ml = 0;
    for (int i = 0; i < 300; i++) ml += (size_t)snprintf(many + ml, 13, "(a%c){1000}", 'a' + i % 26);
    CHECK(grammar_compile_regex(&g, many, ml, err, sizeof err) == -1 && strstr(err, "too large"), "unroll: %s", err);
    free(many);
    CHECK(!g, "nothing returned on errors");
}

/* ==== 3. The refused keyword and where ==== */

static void test_schema_at(void)
{
    static const struct { const char *schema, *kw, *at; } cases[] = {
        { "{\"type\":\"object\",\"properties\":{\"h\":{\"type\":\"string\",\"format\":\"hostname\"}}}", "format", "#/properties/h" },
        { "{\"properties\":{\"x\":{\"type\":\"string\",\"pattern\":\"(?=a)\"}}}", "pattern", "#/properties/x" },
        { "{\"oneOf\":[{\"type\":\"string\"}]}", "oneOf", "#" },
        { "{\"$defs\":{\"a\":{\"type\":\"number\",\"multipleOf\":2}},\"$ref\":\"#/$defs/a\"}", "multipleOf", "#/$defs/a" },
        { "{\"type\":\"integer\",\"minimum\":3,\"maximum\":1}", "", "" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        json_t *s = json_loads(cases[i].schema, 0, NULL);
        grammar *g = NULL;
        char err[400], kw[48], at[256];
        int rc = grammar_compile_schema_at(&g, s, err, sizeof err, kw, sizeof kw, at, sizeof at);
        CHECK(rc == -1 && !g && !strcmp(kw, cases[i].kw) && !strcmp(at, cases[i].at),
              "%s: keyword '%s' at '%s' (want '%s' at '%s'): %s", cases[i].schema, kw, at, cases[i].kw, cases[i].at, err);
        json_decref(s);
    }
}

/* ==== 4. Masks and walks on a real vocabulary ==== */

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
    if (!t_need(path)) return -1;
    if (gguf_open_file(&vb->f, path, err, sizeof err) || tokenizer_load(&vb->t, vb->f, err, sizeof err)) {
        CHECK(0, "load %s: %s", path, err);
        return -1;
    }
    vb->v = grammar_vocab_new(vb->t, err, sizeof err);
    CHECK(vb->v, "grammar_vocab_new: %s", err);
    if (!vb->v) return -1;
    vb->n = grammar_vocab_n(vb->v);
    return 0;
}

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
        if (ok != m[id]) bad++;
    }
    CHECK(!bad, "%s: %d disagreements between mask and accept_token", what, bad);
    CHECK(count == seen && count > 0, "%s: count %lld", what, (long long)count);
    free(m);
}

static uint64_t rng_state = 0x2545f4914f6cdd1dull;   /* t_rnd_u64's: the walks' choices */

/* Tokens drawn from the mask until complete (stopping at random once it
 * is); the bytes, or NULL if stuck or over cap. */
static char *walk(vocab *vb, const grammar *g, int cap)
{
    grammar_state *s = grammar_state_new(g);
    uint8_t *m = malloc((size_t)vb->n);
    int32_t *ids = malloc((size_t)vb->n * sizeof *ids);
    size_t tcap = 1 << 14, tlen = 0;
    char *text = malloc(tcap);
    int done = 0;
    for (int step = 0; step < cap && !done; step++) {
        grammar_mask(s, vb->v, m);
        int n = 0;
        for (int32_t id = 0; id < vb->n; id++)
            if (m[id] && !tokenizer_is_eog(vb->t, id)) ids[n++] = id;
        if (grammar_is_complete(s) && (!n || t_rnd_u64(&rng_state) % 3 == 0)) { done = 1; break; }
        if (!n) break;
        int32_t id = ids[t_rnd_u64(&rng_state) % (uint64_t)n];
        if (grammar_accept_token(s, vb->v, id)) break;
        int k = tokenizer_token_bytes(vb->t, id, 0, text + tlen, tcap - tlen - 1);
        if (k < 0 || tlen + (size_t)k + 512 > tcap) break;
        tlen += (size_t)k;
    }
    text[tlen] = 0;
    grammar_state_free(s);
    free(m);
    free(ids);
    if (!done) { free(text); return NULL; }
    return text;
}

static int is_date(const char *s)
{
    int y, mo, d, n = 0;
    return sscanf(s, "\"%4d-%2d-%2d\"%n", &y, &mo, &d, &n) == 3 && n == 12 && (int)strlen(s) == 12 && mo >= 1 && mo <= 12 &&
           d >= 1 && d <= 31;
}

static void test_vocab(vocab *vb)
{
    static const struct { int kind; const char *src; const char *prefixes[4]; } st[] = {
        { 'r', "[a-z]+@[a-z]+\\.(com|org)", { "", "ab", "ab@c", "ab@c.co" } },
        { 'g', "root ::= expr\nexpr ::= term (\"+\" term)*\nterm ::= [0-9]+ | \"(\" expr \")\"\n", { "", "(1", "12+", "(3+4)" } },
        { 's', "{\"type\":\"string\",\"format\":\"date-time\"}", { "", "\"2024-0", "\"2024-02-29T1", "\"2024-02-29T10:00:00" } },
        { 's', "{\"type\":\"string\",\"pattern\":\"^[^\\\"]*\\\\d$\"}", { "", "\"ab", "\"\xc3\xa9", "\"a1" } },
    };
    int stride = g_asan ? 61 : 7;   /* every 7th token: ~22,000 per state, a few seconds */
    for (size_t i = 0; i < sizeof st / sizeof *st; i++) {
        char err[400] = "";
        grammar *g = build(st[i].kind, st[i].src, err, sizeof err);
        CHECK(g, "%s: %s", st[i].src, err);
        if (!g) continue;
        for (int k = 0; k < 4; k++) {
            grammar_state *s = grammar_state_new(g);
            const char *p = st[i].prefixes[k];
            CHECK(grammar_accept_bytes(s, p, strlen(p)) == 0, "%s: prefix '%s'", st[i].src, p);
            char what[256];
            snprintf(what, sizeof what, "%s after '%s'", st[i].src, p);
            check_mask_exact(vb, s, what, stride);
            /* mask time (printed, not checked: benchmarks are programs) */
            uint8_t *m = malloc((size_t)vb->n);
            struct timespec a, b;
            clock_gettime(CLOCK_MONOTONIC, &a);
            for (int r = 0; r < 10; r++) grammar_mask(s, vb->v, m);
            clock_gettime(CLOCK_MONOTONIC, &b);
            printf("| %c %.40s | '%s' | %.3f ms |\n", st[i].kind, st[i].src, p,
                   ((double)(b.tv_sec - a.tv_sec) * 1e3 + (double)(b.tv_nsec - a.tv_nsec) / 1e6) / 10);
            free(m);
            grammar_state_free(s);
        }
        grammar_free(g);
    }
    /* walks: every output the mask lets through is accepted in full */
    static const struct { int kind; const char *src; } ws[] = {
        { 's', "{\"type\":\"string\",\"format\":\"date\"}" },
        { 's', "{\"type\":\"object\",\"properties\":{\"id\":{\"type\":\"string\",\"format\":\"uuid\"},\"mail\":{\"type\":\"string\",\"format\":\"email\"}},\"required\":[\"id\",\"mail\"],\"additionalProperties\":false}" },
        { 'g', "root ::= \"<\" [a-z]{1,8} (\" \" [a-z]{1,8}){0,3} \">\"" },
        { 'r', "(yes|no|maybe) \\(\\d{1,3}%\\)" },
    };
    for (size_t i = 0; i < sizeof ws / sizeof *ws; i++) {
        char err[400] = "";
        grammar *g = build(ws[i].kind, ws[i].src, err, sizeof err);
        CHECK(g, "%s: %s", ws[i].src, err);
        for (int w = 0; g && w < (g_asan ? 2 : 8); w++) {
            char *out = walk(vb, g, 400);
            CHECK(out && run_text(g, out, strlen(out)) == 1, "walk %d of %s: %s", w, ws[i].src, out ? out : "(stuck)");
            if (out && i == 0) CHECK(is_date(out), "walk output %s is a date", out);
            if (out && i == 1) {
                json_t *o = json_loads(out, 0, NULL);
                const char *id = json_string_value(json_object_get(o, "id"));
                CHECK(o && id && strlen(id) == 36 && strchr(json_string_value(json_object_get(o, "mail")), '@'),
                      "walk output %s parses with a uuid and an e-mail", out);
                json_decref(o);
            }
            free(out);
        }
        grammar_free(g);
    }
}

int main(void)
{
    g_asan = getenv("TANDEM_ASAN") && atoi(getenv("TANDEM_ASAN"));
    test_outputs();
    test_errors();
    test_schema_at();
    vocab vb;
    if (vocab_load(&vb) == 0) test_vocab(&vb);
    grammar_vocab_free(vb.v);
    tokenizer_free(vb.t);
    gguf_close(vb.f);
    return t_done("test_grammar_text");
}
