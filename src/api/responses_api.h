/* responses_api.h - the OpenAI Responses API (POST /v1/responses) as a
 * translation onto chat completions, pure functions over bytes (no I/O,
 * no globals; fuzz/fuzz_responses.c). docs/router.md, "/v1/responses".
 *
 * A request's life: api_responses_parse (the Responses body -> a chat
 * completions body for api_parse_request, plus what the answer needs);
 * api_responses_start (its id, time and model); then either
 * api_responses_reply (the chat completion's JSON -> the Response object),
 * or api_responses_begin_stream, api_responses_feed with each piece of the
 * chat SSE stream, api_responses_finish at its end, the events collected in
 * api_responses_out. */
#ifndef TANDEM_RESPONSES_API_H
#define TANDEM_RESPONSES_API_H

#include <stddef.h>

#include "api/http_api.h"
#include "base/strbuf.h"

typedef struct api_responses api_responses;

/* Checks a Responses body and rewrites it as a chat completions body
 * (*chat_body, malloc'd) with its state (*out, api_responses_free). 0, or
 * -1 with e filled: 400 naming the field (unknown_parameter for a field
 * the API does not have, unsupported_parameter / unsupported_value for
 * what the router cannot honour, invalid_type / invalid_value /
 * missing_required_parameter), 500 out of memory. */
int api_responses_parse(const char *body, size_t len, char **chat_body, api_responses **out, api_error *e);
/* An error of api_parse_request about the chat body, its param (and the
 * name quoted in its message) as the Responses body spells it: messages ->
 * input, response_format -> text.format, max_tokens -> max_output_tokens,
 * tools[i].function.x -> tools[i].x. */
void api_responses_fix_error(api_error *e);
void api_responses_free(api_responses *rs);

/* The response's id ("resp_..."), creation time (unix s) and model. */
void api_responses_start(api_responses *rs, const char *id, long long created, const char *model);
/* Prompt tokens the decode node already held: usage.input_tokens_details.cached_tokens. */
void api_responses_set_cached(api_responses *rs, long long cached);

/* The Response object (malloc'd JSON) from a chat completion's JSON (one
 * choice), or NULL (out of memory). */
char *api_responses_reply(api_responses *rs, const char *chat);

/* The stream: response.created and response.in_progress into the events. */
void api_responses_begin_stream(api_responses *rs);
/* Whole chat SSE events ("data: {...}\n\n" each, [DONE] ignored) into
 * Responses events: items added, text and argument deltas, items done. */
void api_responses_feed(api_responses *rs, const char *sse, size_t n);
/* The chat stream ended: ok (it finished) or an error event came (fed):
 * the open items close and response.completed / response.incomplete, or an
 * "error" event and response.failed. Neither (the client left): nothing. */
void api_responses_finish(api_responses *rs, int ok);
/* The events so far ("event: TYPE\ndata: {...}\n\n" each); the caller takes
 * and resets them. oom set: the stream cannot go on. */
strbuf *api_responses_out(api_responses *rs);

#endif
