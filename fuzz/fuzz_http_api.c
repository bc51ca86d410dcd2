/* fuzz_http_api.c - libFuzzer target over the router's request path:
 * OpenAI body parsing/validation for both endpoints, the decode-node body
 * built from a parsed request, the decode node's NDJSON lines and error
 * bodies, and rendering of responses and chunks from what was parsed
 * (n choices merged into one response), and the child request of each
 * prompt of a request with several. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "api/http_api.h"

static void fz_render(const api_request *r) {
    char *up = api_upstream_body(r, "auto", "127.0.0.1:1");
    free(up);
    if (r->tool_args_format) {   /* a forced call's constrained arguments (set per attempt by the router) */
        api_request c = *r;
        c.call_suffix = "}";
        free(api_upstream_body(&c, "local", NULL));
    }
    api_resp_meta m = {.id = "x", .created = 1, .model = r->model};
    const char *text = r->prompt ? r->prompt : r->n_messages ? r->messages[0].content : "";
    free(api_render_chunk(r->kind, &m, text, NULL, 1));
    char *one = api_render_response(r->kind, &m, text, "stop", 1, 2);
    m.index = r->n - 1;   /* the last of n choices, merged after the first */
    char *last = api_render_response(r->kind, &m, text, "length", 1, 2);
    char *both[2] = {one, last};
    free(api_merge_responses(both, 2, 1, 4));
    free(one);
    free(last);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    api_limits lim;
    api_limits_default(&lim);
    lim.max_prompt_bytes = 4096;
    const char *body = (const char *)data + 1;
    size_t len = size - 1;
    api_request r;
    api_error e;
    switch (data[0] % 3) {
    case 0:
    case 1:
        if (api_parse_request(data[0] % 3 ? API_COMPLETION : API_CHAT, body, len, &lim, &r, &e) == 0) {
            fz_render(&r);
            if (r.n_prompts > 1) {
                api_request kids[API_MAX_PROMPTS];
                /* every prompt of a parsed request makes a child request */
                if (api_parse_prompt_children(r.kind, body, len, &lim, r.n_prompts, kids, &e)) __builtin_trap();
                for (int k = 0; k < r.n_prompts; k++) {
                    fz_render(&kids[k]);
                    api_request_free(&kids[k]);
                }
            }
            api_request_free(&r);
        } else {
            free(api_error_json(&e));
            free(api_render_error_event(&e));
        }
        break;
    default: {
        api_upstream_line u;
        if (api_parse_upstream_line(body, len, &u) == 0) api_upstream_line_free(&u);
        char msg[128];
        api_upstream_error_message(body, len, msg, sizeof msg);
        break;
    }
    }
    return 0;
}
