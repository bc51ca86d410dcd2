/* http_api.h - the OpenAI-compatible face of the router, as pure functions.
 *
 * Parsing and validating /v1/chat/completions and /v1/completions bodies,
 * building the body the router sends to a decode node (POST /v1/generate),
 * reading a decode node's NDJSON lines, and rendering OpenAI responses,
 * stream chunks (SSE) and errors. No I/O and no globals here, so that the
 * whole request path can be unit-tested and fuzzed (fuzz/fuzz_http_api.c).
 * All strings returned as char * are malloc'd; the caller frees them.
 * http_api.c parses requests, http_api_upstream.c builds the decode node's
 * body and reads its lines, http_api_render.c renders responses.
 */
#ifndef TANDEM_HTTP_API_H
#define TANDEM_HTTP_API_H

#include <stddef.h>
#include <stdint.h>

enum api_kind { API_CHAT = 0, API_COMPLETION = 1 };

/* An OpenAI-shaped error: HTTP status plus the four fields of "error". */
typedef struct {
    int status;                 /* 400, 401, 404, 405, 413, 429, 500, 502, 503, 504 */
    const char *type;           /* "invalid_request_error", "server_error", ... (static) */
    const char *code;           /* static string or NULL (rendered as null) */
    char param[192];            /* offending field, "" = null (a schema keyword: field#pointer/keyword) */
    char message[320];
} api_error;

/* Limits the parser enforces (the router's config). */
typedef struct {
    int max_tokens_limit;       /* largest accepted max_tokens */
    int default_max_tokens;     /* used when the request gives none; 0 = until the end of the context */
    size_t max_prompt_bytes;    /* prompt (or all messages' content) in bytes: the router does not tokenize */
    int max_prompt_tokens;      /* a token-id prompt's length */
    int max_messages;
    int max_stop;               /* OpenAI allows up to 4 stop sequences */
    int lenient;                /* 1: unknown request fields are ignored (--lenient-params), else refused */
} api_limits;

/* Largest "n" (choices per request) the router accepts: each choice is a
 * sequence in its own decode-node slot, so more would crowd out other
 * requests (a node also refuses n above its --parallel slots). */
#define API_MAX_N 8

/* /v1/completions with several prompts: at most this many prompts, and at
 * most API_MAX_CHOICES choices in all (prompts x n). Each prompt is a
 * request of its own to a decode node (the router runs them at once). */
#define API_MAX_PROMPTS 16
#define API_MAX_CHOICES 32

/* One chat message. tool_calls: an assistant turn's calls as a JSON array
 * text [{"id", "type", "function": {"name", "arguments"}}], or NULL;
 * tool_call_id: a tool result's call id, or NULL. */
typedef struct { char *role; char *content; char *tool_calls; char *tool_call_id; } api_msg;

enum api_tool_choice { API_TOOLS_AUTO = 0, API_TOOLS_NONE, API_TOOLS_REQUIRED, API_TOOLS_NAMED };

/* max_tokens sent to a decode node for "until the end of the context": the
 * node's own largest max_tokens, which its context always caps first. */
#define API_MAX_TOKENS_UNTIL_CONTEXT 1000000

typedef struct {
    enum api_kind kind;
    char *model;
    /* completions: prompt text, or token ids */
    char *prompt;
    int32_t *tokens;
    int n_tokens;
    int n_prompts;              /* several prompts (> 1): prompt and tokens are unset; the
                                 * router parses one child request per prompt */
    int prompts_have_ids;       /* one of several prompts is token ids */
    /* chat */
    api_msg *messages;
    int n_messages;
    int max_tokens;             /* 0 = until the end of the context */
    int max_tokens_given;       /* the client set it: a prompt plus it beyond the context is a 400 */
    double temperature;         /* OpenAI default 1 */
    double top_p;               /* OpenAI default 1 */
    int has_seed;
    int64_t seed;
    char **stop;
    int n_stop;
    int n;                      /* choices: 1..API_MAX_N (siblings share the prompt's KV) */
    int stream;
    int include_usage;          /* stream_options.include_usage */
    int echo;                   /* completions: echo the prompt (only with a text prompt) */
    int logprobs;               /* 0: off; 1 + k: log-probabilities with k alternatives
                                 * (chat: logprobs true + top_logprobs k; completions:
                                 * logprobs k) */
    char *sampling;             /* JSON object text of the fields the decode node applies
                                 * itself (response_format, penalties, logit_bias, top_k,
                                 * min_p), checked for shape here, or NULL */
    int ignore_eos;             /* extension (as vLLM's): generate max_tokens even past end-of-generation */
    size_t prompt_bytes;        /* bytes of prompt text / message contents */
    /* chat tools */
    char *tools;                /* the "tools" array as JSON text, or NULL */
    int n_tools;
    int tool_choice;            /* enum api_tool_choice */
    char *tool_name;            /* API_TOOLS_NAMED, or the only tool under "required" */
    int tool_args_fixed;        /* that function's schema admits only {} as arguments */
    char *tool_args_format;     /* that function's arguments as a decode node's "response_format"
                                 * (JSON text): its "parameters" schema when the grammar
                                 * supports it, else (unless "strict") any JSON object; NULL
                                 * when no single function is forced or its arguments are fixed */
    int parallel_tool_calls;    /* OpenAI default true */
    /* set by the router per attempt, from the decode node's template */
    char *assistant_prefix;     /* the assistant turn starts with this (a forced call) */
    int prefix_complete;        /* the prefix is a whole call: nothing to generate */
    const char *call_stop;      /* static stop string ending a single call, or NULL */
    const char *call_suffix;    /* static text closing a forced call whose arguments the node
                                 * constrained (tool_args_format): the node stops when they are
                                 * complete, the router's parser reads this after them; or NULL */
} api_request;

void api_limits_default(api_limits *l);

/* Fills e (status, type, code, param, printf-style message). */
void api_error_set(api_error *e, int status, const char *type, const char *code,
                   const char *param, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

/* A 400 invalid_request_error naming param, with code and a printf-style
 * message; returns -1 (the request parsers' "refused"). */
int api_error_bad(api_error *e, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Parses and validates a request body. 0 on success (free with
 * api_request_free), -1 with e filled (status 400 or 413). */
int api_parse_request(enum api_kind kind, const char *body, size_t len, const api_limits *lim,
                      api_request *r, api_error *e);
void api_request_free(api_request *r);

/* The n child requests of a request with several prompts, into out[0..n):
 * child k is the same body with "prompt" set to its k-th element, parsed as
 * a request of its own (the body is read once for all of them). 0, or -1
 * with e filled (param "prompt[k]" for that prompt's faults) and nothing
 * left to free. */
int api_parse_prompt_children(enum api_kind kind, const char *body, size_t len, const api_limits *lim, int n,
                              api_request *out, api_error *e);

/* {"error": {"message", "type", "param", "code"}} */
char *api_error_json(const api_error *e);

/* ==== Decode node protocol ==== */
/* The POST /v1/generate body for a decode node. prefill_mode is "auto",
 * "remote" or "local"; prefill_node "host:port" or NULL. */
char *api_upstream_body(const api_request *r, const char *prefill_mode, const char *prefill_node);

/* One parsed NDJSON line (or the whole non-stream reply) from a decode node. */
typedef struct {
    int index;                  /* choice ("index" member; 0 when absent, i.e. n = 1) */
    int is_token;               /* {"token": id, "text": ...} */
    int token;
    char *text;                 /* token text, or full text of a non-stream reply */
    char *logprob;              /* token line with logprobs: {"logprob","token_text",
                                 * "top_logprobs"} as JSON text, else NULL */
    int is_done;                /* final line / non-stream object */
    char finish_reason[16];     /* "stop", "length", "error" */
    int prompt_tokens, completion_tokens;
    /* prefill figures */
    char prefill_mode[16];      /* "remote" / "local" / "" */
    char prefill_node[128];
    int computed_remote, computed_local, positions_received;
    int start_pos;                       /* prompt positions the decode node already held (prefix reuse) */
    double kv_bytes, wire_bytes, prefill_ms, ttft_ms;
    double transfer_ms;         /* exposed transfer: "transfer_tail_ms" if reported, else -1 */
    double remote_prefill_ms;   /* compute time on the prefill node (split only) */
    double handoff_ms;          /* request sent -> last KV frame in the cache (split only) */
    double queue_ms;            /* waited in the decode node's queue: "queue_ms", or -1 */
    char fallback_reason[256];
    /* speculative decoding ("speculative": {"source","drafted","accepted"}), or "" / 0 */
    char spec_source[16];
    int spec_drafted, spec_accepted;
    char error[320];            /* "error" member (string or object with message) */
} api_upstream_line;

/* 0 on success, -1 if the line is not a JSON object of the protocol. */
int api_parse_upstream_line(const char *line, size_t len, api_upstream_line *u);
void api_upstream_line_free(api_upstream_line *u);
/* Error message in a decode node's 4xx/5xx body (any of the shapes
 * {"error":"..."}, {"error":{"message":"..."}}), or the body's start. */
void api_upstream_error_message(const char *body, size_t len, char *out, size_t outlen);

/* ==== OpenAI responses ==== */
typedef struct {
    const char *id;             /* "chatcmpl-..." / "cmpl-..." */
    long long created;          /* unix seconds */
    const char *model;
    const char *logprobs;       /* the choice's OpenAI "logprobs" object as JSON text, or NULL */
    int index;                  /* the choice's "index" (0..n-1) */
    int cached_tokens;          /* usage.prompt_tokens_details.cached_tokens: prompt positions
                                 * the decode node did not compute (its slots, KV store) */
} api_resp_meta;

/* The OpenAI "logprobs" object for n tokens, from the decode node's
 * per-token entries (api_upstream_line.logprob): chat {"content": [{"token",
 * "logprob", "bytes", "top_logprobs": [...]}]}; completions {"tokens",
 * "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}
 * (offsets from text_offset0). JSON text, or NULL. */
char *api_render_logprobs(enum api_kind kind, char *const *entries, int n, size_t text_offset0);

/* 1 if the model's output is parsed for tool calls (tools given, tool_choice not "none"). */
int api_tools_active(const api_request *r);

/* A complete non-stream response. */
char *api_render_response(enum api_kind kind, const api_resp_meta *m, const char *text,
                          const char *finish_reason, int prompt_tokens, int completion_tokens);
/* One response of n choices from n single-choice responses (each rendered
 * with its meta's index): their choices in order, usage computed once from
 * the figures given (the prompt counts once, completions summed; cached
 * tokens summed over the bodies, so render a prompt's cached tokens in one
 * of its choices only). Frees
 * nothing; NULL on out of memory or malformed input. */
char *api_merge_responses(char *const *bodies, int n, int prompt_tokens, int completion_tokens);
/* One SSE event "data: {...}\n\n" carrying a chunk: text (may be NULL),
 * finish_reason (NULL = null). For chat, first != 0 adds the assistant role delta. */
char *api_render_chunk(enum api_kind kind, const api_resp_meta *m, const char *text,
                       const char *finish_reason, int first);
/* The final usage chunk (stream_options.include_usage): empty choices + usage. */
char *api_render_usage_chunk(enum api_kind kind, const api_resp_meta *m, int prompt_tokens,
                             int completion_tokens);
/* "data: {"error": {...}}\n\n" - an error after the stream started. */
char *api_render_error_event(const api_error *e);
/* a then b as one string (both freed; NULL if either is NULL or out of memory):
 * rendered chunks are joined with it. */
char *api_concat(char *a, char *b);
/* GET /v1/models: {"object":"list","data":[{"id","object":"model","created","owned_by"}]} */
char *api_render_models(const char *const *ids, int n, long long created);
/* GET /v1/models/{id}: {"id","object":"model","created","owned_by"} */
char *api_render_model(const char *id, long long created);

/* ==== Tool calls in responses ==== */
/* Parser events (tools.h) as SSE chunks: content deltas and delta.tool_calls
 * (first chunk of a call: index, id, type, name, arguments ""; then argument
 * fragments). Call ids are "call_" + the response id's suffix + "_" + index.
 * Returns "" when there is nothing to send, NULL on out of memory. */
struct tool_evs;
char *api_render_tool_chunks(const api_resp_meta *m, const struct tool_evs *evs);
/* A complete chat response from parser events: content (null when empty
 * and calls were made) and message.tool_calls. */
char *api_render_tool_response(const api_resp_meta *m, const struct tool_evs *evs, const char *finish_reason,
                               int prompt_tokens, int completion_tokens);

#endif
