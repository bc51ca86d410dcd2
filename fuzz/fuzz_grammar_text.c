/* fuzz_grammar_text.c - libFuzzer target: grammars written as text, which
 * are attacker input (a request's "grammar", "guided_grammar",
 * "guided_regex", a schema's "pattern"). The first byte picks the dialect
 * (even: GBNF, odd: regular expression); the bytes up to the next NUL are
 * the grammar; the bytes after it are fed to the compiled grammar (a
 * refused byte is skipped, so long inputs reach deep states), and the
 * state is cloned, hashed and compared on the way. A third of the inputs
 * also go through a JSON Schema {"type": "string", "pattern": ...}.
 *   make fuzz && build/fuzz_grammar_text -max_total_time=60
 */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/grammar.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    int gbnf = !(data[0] & 1), schema = data[0] % 3 == 0;
    data++;
    size--;
    const uint8_t *nul = memchr(data, 0, size);
    size_t glen = nul ? (size_t)(nul - data) : size;
    const uint8_t *rest = nul ? nul + 1 : data + size;
    size_t rlen = (size_t)(data + size - rest);
    grammar *g = NULL;
    char err[400];
    int rc = gbnf ? grammar_compile_gbnf(&g, (const char *)data, glen, err, sizeof err)
                  : grammar_compile_regex(&g, (const char *)data, glen, err, sizeof err);
    if (rc) {
        if (g || !err[0]) abort();   /* a refusal returns nothing and says why */
    } else {
        grammar_state *s = grammar_state_new(g);
        for (size_t i = 0; s && i < rlen; i++) {
            grammar_accept_bytes(s, (const char *)rest + i, 1);
            if (i % 64 == 0) {
                grammar_state *c = grammar_state_clone(s);
                if (c && (!grammar_state_equal(s, c) || grammar_state_hash(s) != grammar_state_hash(c))) abort();
                grammar_state_free(c);
            }
            (void)grammar_is_complete(s);
        }
        grammar_state_free(s);
        grammar_free(g);
    }
    if (schema && !gbnf) {
        char *pat = malloc(glen + 1);
        if (!pat) return 0;
        memcpy(pat, data, glen);
        pat[glen] = 0;
        json_t *sch = json_pack("{s:s, s:s}", "type", "string", "pattern", pat);   /* NULL for invalid UTF-8 */
        free(pat);
        grammar *h = NULL;
        char kw[48], at[256];
        if (sch && grammar_compile_schema_at(&h, sch, err, sizeof err, kw, sizeof kw, at, sizeof at) == 0) {
            grammar_state *s = grammar_state_new(h);
            if (s) grammar_accept_bytes(s, (const char *)rest, rlen);
            grammar_state_free(s);
        }
        grammar_free(h);
        json_decref(sch);
    }
    return 0;
}
