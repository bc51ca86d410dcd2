/* tok_api.h - a decode node's POST /v1/tokenize and POST /v1/detokenize,
 * in llama-server's shapes (the router forwards its /tokenize and
 * /detokenize here):
 *   tokenize   {"content": str, "add_special": bool (false), "parse_special":
 *              bool (true), "with_pieces": bool (false)} -> {"tokens": [id...]}
 *              or, with pieces, {"tokens": [{"id", "piece"}...]} where a piece
 *              is a string, or its byte values when they are not valid UTF-8
 *   detokenize {"tokens": [id...]} -> {"content": str} (special tokens
 *              written as their text; invalid UTF-8 bytes become U+FFFD)
 * Pure functions: the node hands the body and its tokenizer. */
#ifndef TANDEM_TOK_API_H
#define TANDEM_TOK_API_H

#include <stddef.h>

#include "engine/tokenizer.h"

#define TOKAPI_MAX_TOKENS (1 << 20)   /* ids per detokenize request: far above any context */

/* Both return the HTTP status: 200 with *out the malloc'd JSON body, or
 * 400/500 with err filled. */
int tokapi_tokenize(const tokenizer *t, const char *body, size_t len, char **out, char *err, size_t errlen);
int tokapi_detokenize(const tokenizer *t, const char *body, size_t len, char **out, char *err, size_t errlen);

#endif
