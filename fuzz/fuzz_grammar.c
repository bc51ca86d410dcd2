/* fuzz_grammar.c - libFuzzer target: a JSON Schema (any bytes up to the
 * first NUL) through grammar_compile_schema, then the bytes after the NUL
 * fed to the compiled grammar (json_object mode when the schema does not
 * parse or is refused). A refused byte is skipped, so long inputs reach deep
 * states; the token mask is computed at a few points with the Qwen2 vocab
 * when the fixtures are there. Sizes are bounded by the grammar's caps.
 *   make fuzz && build/fuzz_grammar -max_total_time=60
 */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/gguf.h"
#include "engine/grammar.h"
#include "engine/tokenizer.h"

static gguf_file *vf;
static tokenizer *vt;
static grammar_vocab *vv;
static uint8_t *mask;
static int loaded;

static void fuzz_load(void)
{
    loaded = 1;
    const char *dir = getenv("TANDEM_FIXTURES");
    char path[1024], err[256];
    snprintf(path, sizeof path, "%s/vocab/ggml-vocab-qwen2.gguf", dir ? dir : "../shared/fixtures");
    if (gguf_open_file(&vf, path, err, sizeof err)) return;
    if (tokenizer_load(&vt, vf, err, sizeof err)) return;
    vv = grammar_vocab_new(vt, err, sizeof err);
    if (vv) mask = malloc((size_t)grammar_vocab_n(vv));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!loaded) fuzz_load();
    const uint8_t *nul = memchr(data, 0, size);
    size_t slen = nul ? (size_t)(nul - data) : size;
    const char *feed = nul ? (const char *)nul + 1 : "";
    size_t flen = nul ? size - slen - 1 : 0;
    char err[256];
    grammar *g = NULL;
    json_t *schema = json_loadb((const char *)data, slen, JSON_DECODE_ANY, NULL);
    if (!schema || grammar_compile_schema(&g, schema, err, sizeof err)) {
        if (grammar_compile_json_object(&g, err, sizeof err)) abort();   /* cannot fail */
    }
    json_decref(schema);
    grammar_state *s = grammar_state_new(g);
    if (!s) abort();
    for (size_t i = 0; i < flen; i++) {
        if (grammar_accept_bytes(s, feed + i, 1)) continue;
        if (vv && (i == flen / 2 || i + 1 == flen)) {
            grammar_state *c = grammar_state_clone(s);
            int64_t n = grammar_mask(c, vv, mask);
            int complete = grammar_is_complete(c);
            if (n == 0 && complete) abort();   /* EOG must be allowed when complete */
            for (int32_t id = 0; id < grammar_vocab_n(vv) && n > 0; id++) {
                if (!mask[id]) continue;
                /* the first allowed token must be accepted */
                if (grammar_accept_token(c, vv, id)) abort();
                break;
            }
            grammar_state_free(c);
        }
    }
    grammar_is_complete(s);
    grammar_state_hash(s);
    grammar_state_free(s);
    grammar_free(g);
    return 0;
}
