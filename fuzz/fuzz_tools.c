/* fuzz_tools.c - libFuzzer target over tools.c: the streaming tool-call
 * parser on model output fed in pieces (both template formats, one or many
 * calls), the chat renderer on a JSON conversation for every template style,
 * and the parser's events rendered as OpenAI chunks and a response. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "api/http_api.h"
#include "api/tools.h"

static void fz_parse(enum chat_format fmt, int max_calls, const uint8_t *d, size_t n, size_t step) {
    tool_parser *p = tool_parser_new(fmt, max_calls);
    tool_evs e = {0};
    if (!p) return;
    for (size_t i = 0; i < n; i += step) tool_parser_feed(p, (const char *)d + i, n - i < step ? n - i : step, &e);
    tool_parser_end(p, &e);
    api_resp_meta m = {.id = "chatcmpl-x", .created = 1, .model = "m"};
    free(api_render_tool_chunks(&m, &e));
    free(api_render_tool_response(&m, &e, "stop", 1, 2));
    tool_evs_clear(&e);
    tool_parser_free(p);
}

static void fz_render(const uint8_t *d, size_t n) {
    json_t *o = json_loadb((const char *)d, n, 0, NULL);
    static const chat_style styles[] = {
        {.fmt = CHAT_CHATML}, {.fmt = CHAT_CHATML, .qwen_think = 1}, {.fmt = CHAT_CHATML, .qwen_default_system = 1},
        {.fmt = CHAT_LLAMA3}, {.fmt = CHAT_LLAMA3, .llama_tools = 1},
    };
    char err[256];
    for (size_t i = 0; o && i < sizeof styles / sizeof styles[0]; i++) {
        json_t *tools = json_object_get(o, "tools");
        free(tools_render(&styles[i], json_object_get(o, "messages"), json_is_array(tools) ? tools : NULL,
                          json_string_value(json_object_get(o, "prefix")), err, sizeof err));
    }
    json_decref(o);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const uint8_t *d = data + 1;
    size_t n = size - 1, step = (size_t)(data[0] >> 3) + 1;
    switch (data[0] & 7) {
    case 0: fz_parse(CHAT_CHATML, 0, d, n, step); break;
    case 1: fz_parse(CHAT_CHATML, 1, d, n, step); break;
    case 2: fz_parse(CHAT_LLAMA3, 0, d, n, step); break;
    default: fz_render(d, n); break;
    }
    return 0;
}
