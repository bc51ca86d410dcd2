/* extensions.h - request fields beyond OpenAI's that the ecosystem sends
 * (llama.cpp's llama-server, vLLM), the refusal of fields nobody serves,
 * and constrained decoding from a decode node's body.
 *
 * Router side (http_api.c calls these while parsing a request):
 *   every field is known or refused: a field this server does not know is a
 *   400 naming it (param = the field, code "unknown_parameter"), unless the
 *   router runs with --lenient-params;
 *   grammar / guided_grammar (GBNF), guided_regex, guided_choice,
 *   guided_json and json_schema (top level) become the decode node's
 *   "grammar", "regex", "choice" and "response_format"; min_tokens and
 *   stop_token_ids travel as they are. Each is compiled once here, so a
 *   bad one is a 400 naming it before any node is asked; a refused JSON
 *   Schema keyword is named in param ("response_format.json_schema.schema
 *   #/properties/id/format") and code ("unsupported_schema_keyword").
 * Node side: api_constraint_compile reads the node protocol's fields.
 * Pure functions over jansson; no I/O.
 */
#ifndef TANDEM_EXTENSIONS_H
#define TANDEM_EXTENSIONS_H

#include <jansson.h>

#include "api/http_api.h"
#include "engine/grammar.h"

/* stop_token_ids: at most this many ids (vLLM has no limit; 64 is beyond
 * any model's set of end tokens). */
#define API_MAX_STOP_IDS 64

/* 0 if every member of root is a field of this kind of request (or
 * lenient), else -1 with a 400 naming the first unknown one. */
int api_ext_check_fields(json_t *root, enum api_kind kind, int lenient, api_error *e);

/* Reads the extension fields of root into o (the fields the decode node
 * applies; response_format, when root has one, is already in o). 0, or -1
 * with a 400 in e. */
int api_ext_sampling(json_t *root, json_t *o, api_error *e);

/* The constraint of a decode node's request body: "response_format"
 * (text / json_object / json_schema), "grammar" (GBNF text), "regex", or
 * "choice" (array of strings); at most one. *out = NULL when none. 0, or -1
 * with a message for a 400. */
int api_constraint_compile(json_t *o, grammar **out, char *err, size_t errlen);

/* A decode node's "min_tokens" (0..max, EOG and stop ids masked until
 * then; refused beside a constraint) and "stop_token_ids" (ids below
 * n_vocab that end the output, not emitted). 0, or -1 with a message. */
int api_gen_limits(json_t *o, int n_vocab, int *min_tokens, int32_t *ids, int *n_ids, char *err, size_t errlen);

#endif
