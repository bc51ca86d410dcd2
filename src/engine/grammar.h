/* grammar.h - constrained decoding: JSON and a JSON Schema subset compiled to
 * a byte-level grammar, and per-step token masks over a vocabulary.
 *
 *   grammar        compiled once per request (immutable: may be shared by threads)
 *   grammar_state  where one output stands (one per sequence; cheap to clone)
 *   grammar_vocab  the token bytes of one tokenizer as a byte trie, plus the
 *                  precomputed string tables (built once per tokenizer; immutable)
 *
 * Each step: grammar_mask_logits(state, vocab, logits) sets the logits of
 * tokens that cannot continue a valid output to -INFINITY, the sampler picks
 * a token, grammar_accept_token(state, vocab, id) advances the state. An
 * end-of-generation token is allowed exactly when grammar_is_complete().
 * See docs/architecture.md "Constrained decoding" for what is enforced.
 */
#ifndef TANDEM_GRAMMAR_H
#define TANDEM_GRAMMAR_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include "engine/tokenizer.h"

typedef struct grammar grammar;
typedef struct grammar_state grammar_state;
typedef struct grammar_vocab grammar_vocab;

/* ==== Compiling ==== */

/* response_format json_schema: the output is one JSON value valid against
 * schema. Unsupported keywords are refused: returns -1 with err naming the
 * keyword and its JSON pointer ("unsupported keyword 'pattern' at
 * #/properties/id"), fit for a 400. */
int grammar_compile_schema(grammar **out, const json_t *schema, char *err, size_t errlen);
/* The same, also giving a refused keyword ("format", "" for other errors)
 * and the JSON pointer of the schema holding it ("#/properties/id"), so a
 * 400 can name them in its param and code. */
int grammar_compile_schema_at(grammar **out, const json_t *schema, char *err, size_t errlen, char *kw,
                              size_t kwlen, char *at, size_t atlen);
/* Grammars written as text (grammar_text.c): the whole output matches.
 *   regex: an ECMA-262 regular expression (classes, groups, alternation,
 *          * + ? {n,m}; no back-references, lookaround or \b), vLLM's guided_regex
 *   gbnf:  llama.cpp's GBNF (rules "name ::= ...", a "root" rule, literals,
 *          classes, groups, * + ? {m,n}, comments), llama.cpp's grammar and
 *          vLLM's guided_grammar
 *   choice: exactly one of n non-empty strings (vLLM's guided_choice)
 * -1 with a message giving what is wrong and its byte offset. */
int grammar_compile_regex(grammar **out, const char *pattern, size_t len, char *err, size_t errlen);
int grammar_compile_gbnf(grammar **out, const char *text, size_t len, char *err, size_t errlen);
int grammar_compile_choice(grammar **out, const char *const *choices, int n, char *err, size_t errlen);
/* response_format json_object: any JSON object. */
int grammar_compile_json_object(grammar **out, char *err, size_t errlen);
void grammar_free(grammar *g);
/* Size of the compiled grammar in elements (diagnostics, tests). */
size_t grammar_size(const grammar *g);

/* ==== Running ==== */

/* NULL on allocation failure. The grammar must outlive its states. */
grammar_state *grammar_state_new(const grammar *g);
grammar_state *grammar_state_clone(const grammar_state *s);
void grammar_state_free(grammar_state *s);
/* Feed output bytes. 0: still a valid prefix; -1: not (the state is left
 * unchanged, so a caller may try something else). */
int grammar_accept_bytes(grammar_state *s, const char *bytes, size_t n);
/* 1 if the bytes so far form a complete valid output (generation may end). */
int grammar_is_complete(const grammar_state *s);
/* 1 if no byte can follow (complete and nothing more allowed). */
int grammar_is_finished(const grammar_state *s);
/* Order-independent hash and equality of the logical state. */
uint64_t grammar_state_hash(const grammar_state *s);
int grammar_state_equal(const grammar_state *a, const grammar_state *b);

/* ==== Vocabulary masks ==== */

grammar_vocab *grammar_vocab_new(const tokenizer *t, char *err, size_t errlen);
void grammar_vocab_free(grammar_vocab *v);
int32_t grammar_vocab_n(const grammar_vocab *v);
/* Advance by a token: its bytes, or for an end-of-generation token, 0 iff
 * the state is complete (the state is unchanged). -1: not allowed here
 * (state unchanged); control tokens are never allowed. */
int grammar_accept_token(grammar_state *s, const grammar_vocab *v, int32_t id);
/* allowed[i] = 1 for each token that keeps the output a valid prefix (EOG
 * tokens iff complete), 0 otherwise. Returns the number allowed (0 means the
 * state is stuck: only possible when a size cap was hit, see the doc).
 * Uses scratch buffers in s (hence not const); the logical state is unchanged. */
int64_t grammar_mask(grammar_state *s, const grammar_vocab *v, uint8_t *allowed);
/* Same, writing -INFINITY into logits[i] of every disallowed token. */
int64_t grammar_mask_logits(grammar_state *s, const grammar_vocab *v, float *logits);

#endif
