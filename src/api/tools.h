/* tools.h - tool calls as the model's own chat template writes them.
 *
 * Rendering (decode node): an OpenAI conversation - messages with
 * `tool_calls` and `tool` roles, plus the `tools` array - turned into the
 * prompt text the model's template would produce, for the two template
 * families tandem supports:
 *   ChatML (Qwen2.5 / Qwen3): "# Tools" system block with <tools></tools>,
 *     calls as <tool_call>{"name", "arguments"}</tool_call>, results as
 *     user-role <tool_response></tool_response> blocks.
 *   Llama 3.1+: "Environment: ipython" system block, tools in the first user
 *     message, calls as {"name", "parameters"} JSON, results in ipython turns.
 * Parsing (router): a streaming parser that splits the model's output into
 * content and tool calls (name, then argument fragments), so the router can
 * stream OpenAI `delta.tool_calls`.
 * Pure functions over jansson; no I/O. docs/router.md describes the rules.
 */
#ifndef TANDEM_TOOLS_H
#define TANDEM_TOOLS_H

#include <stddef.h>

#include <jansson.h>

#include "engine/gguf.h"
#include "engine/model.h"
#include "engine/tokenizer.h"

/* ==== Template style ==== */

/* The template family plus the variations inside it that change the text. */
typedef struct {
    enum chat_format fmt;
    int qwen_default_system;    /* Qwen2.5: a default system prompt when none is given */
    const char *default_system; /* that prompt's text (Qwen2.5's, SmolLM2's), or NULL */
    int qwen_think;             /* Qwen3: <think> handling of assistant turns, string arguments verbatim */
    int llama_tools;            /* Llama 3.1+: system block and ipython tool turns */
} chat_style;

/* Reads tokenizer.chat_template. 0, or -1 with a message (no/unknown template). */
int tools_style_detect(const gguf_file *f, chat_style *st, char *err, size_t errlen);
/* "chatml", "llama3", "llama3.1" or "none": what a decode node reports in /health. */
const char *tools_style_name(const chat_style *st);
/* The format behind a reported name (CHAT_NONE if unknown). */
enum chat_format tools_format_from_name(const char *name);

/* ==== Rendering ==== */

/* messages: array of {"role", "content" (string), "tool_calls"?: [{"id",
 * "type", "function": {"name", "arguments" (string)}}], "tool_call_id"?}
 * (roles system, user, assistant, tool). tools: the OpenAI tools array, or
 * NULL when no tools are rendered. prefix: text the assistant turn starts
 * with after the generation prompt (a forced tool call), or NULL.
 * Returns the malloc'd prompt, or NULL with a message (bad shape, or a
 * conversation the template refuses). */
char *tools_render(const chat_style *st, json_t *messages, json_t *tools, const char *prefix,
                   char *err, size_t errlen);

/* ==== Forcing a call ==== */

/* What the assistant turn is prefilled with for tool_choice "required"
 * (name NULL) or a named function: the opening of a call in the template's
 * format, ending on a token boundary. When args_fixed, the function's
 * schema admits only {} as arguments and the whole call is the prefix.
 * Returns a malloc'd string, or NULL (out of memory / no format). */
char *tools_prefix(enum chat_format fmt, const char *name, int args_fixed);

/* 1 if a function's "parameters" schema admits only the empty object
 * (absent, or an object schema without properties and with
 * additionalProperties false). */
int tools_args_fixed_empty(json_t *parameters);

/* ==== Parsing the model's output ==== */

enum tool_ev_kind { TOOL_EV_CONTENT = 0, TOOL_EV_CALL = 1, TOOL_EV_ARGS = 2 };

typedef struct {
    int kind;                   /* enum tool_ev_kind */
    int index;                  /* call index (CALL, ARGS) */
    char *text;                 /* content, function name (CALL) or arguments fragment (ARGS) */
} tool_ev;

typedef struct tool_evs {
    tool_ev *v;
    int n, cap;
} tool_evs;

typedef struct tool_parser tool_parser;

/* max_calls: calls kept (1 for parallel_tool_calls false or a forced call);
 * text after the last kept call is dropped. NULL on out of memory. */
tool_parser *tool_parser_new(enum chat_format fmt, int max_calls);
void tool_parser_free(tool_parser *p);
/* Feeds output text; appends events to out. 0, or -1 on out of memory. */
int tool_parser_feed(tool_parser *p, const char *s, size_t n, tool_evs *out);
/* End of output: flushes held-back text. 0 or -1. */
int tool_parser_end(tool_parser *p, tool_evs *out);
/* Calls started so far. */
int tool_parser_calls(const tool_parser *p);
/* 1 once max_calls calls are complete (the rest of the output is dropped). */
int tool_parser_done(const tool_parser *p);
void tool_evs_clear(tool_evs *e);

/* The prompt's token ids: text chat-wrapped first when chat is set (the
 * model's chat format), BOS added as the vocabulary asks. malloc'd, count in
 * *n_out; NULL with a message. */
int32_t *tools_tokenize_prompt(model *m, const char *text, int chat, int *n_out, char *err, size_t errlen);

#endif
