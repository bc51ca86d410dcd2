/* fuzz_responses.c - libFuzzer target over POST /v1/responses
 * (api/responses_api.c), both directions: a hostile Responses body through
 * the translation, the chat body it makes through api_parse_request (an
 * error renamed as the router does) and the Response object rendered from
 * a chat completion; and hostile chat output (the decode node's answer as
 * the router renders it) through the non-stream reply and the event
 * stream, fed in two pieces, ended as finished or failed.
 * First byte: bit 0 selects the direction, bit 1 the stream's ending,
 * the rest the split point of the stream. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "api/http_api.h"
#include "api/responses_api.h"

static void fz_request(const char *body, size_t len) {
    api_limits lim;
    api_limits_default(&lim);
    lim.max_prompt_bytes = 4096;
    char *chat = NULL;
    api_responses *rs = NULL;
    api_error e;
    if (api_responses_parse(body, len, &chat, &rs, &e)) return;
    api_request r;
    if (api_parse_request(API_CHAT, chat, strlen(chat), &lim, &r, &e)) {
        api_responses_fix_error(&e);
    } else {
        api_responses_start(rs, "resp_1", 1, r.model);
        api_resp_meta m = {.id = "chatcmpl-1", .created = 1, .model = r.model};
        char *c = api_render_response(API_CHAT, &m, r.n_messages ? r.messages[0].content : "", "length", 3, 4);
        if (c) free(api_responses_reply(rs, c));
        free(c);
        api_request_free(&r);
    }
    free(chat);
    api_responses_free(rs);
}

static void fz_answer(const uint8_t *data, size_t size, int ok, size_t split) {
    static const char body[] = "{\"model\":\"m\",\"input\":\"x\",\"stream\":true}";
    char *chat = NULL;
    api_responses *rs = NULL;
    api_error e;
    if (api_responses_parse(body, sizeof body - 1, &chat, &rs, &e)) abort();   /* a valid body must pass */
    free(chat);
    api_responses_start(rs, "resp_1", 1, "m");
    api_responses_set_cached(rs, 2);
    char *s = malloc(size + 1);
    if (!s) { api_responses_free(rs); return; }
    memcpy(s, data, size);
    s[size] = 0;
    free(api_responses_reply(rs, s));
    api_responses_begin_stream(rs);
    if (split > size) split = size;
    api_responses_feed(rs, s, split);
    api_responses_feed(rs, s + split, size - split);
    api_responses_finish(rs, ok);
    strbuf_reset(api_responses_out(rs));
    free(s);
    api_responses_free(rs);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    if (data[0] & 1) fz_request((const char *)data + 1, size - 1);
    else fz_answer(data + 1, size - 1, (data[0] >> 1) & 1, (size_t)(data[0] >> 2) * 16);
    return 0;
}
