/* chat.c - the two chat prompt formats tandem supports.
 *
 * We do not run Jinja: the model's tokenizer.chat_template is only used to
 * recognise its family, and the prompt is then rendered by fixed code.
 *   ChatML (Qwen):  <|im_start|>{role}\n{content}<|im_end|>\n ... <|im_start|>assistant\n
 *   Llama 3:        <|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|> ...
 *                   <|start_header_id|>assistant<|end_header_id|>\n\n
 * Llama 3's "<|begin_of_text|>" is NOT rendered: it is the model's BOS, which
 * the tokenizer adds (add_special) because Llama 3 vocabularies set add_bos;
 * rendering it too would give two BOS tokens. Llama 3 content is trimmed of
 * leading/trailing whitespace, as its template (and llama.cpp) does; ChatML
 * content is used verbatim.
 */
#include "base/strbuf.h"
#include "engine/tokenizer.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== Detection ==== */

static int chat_contains(gguf_str s, const char *needle)
{
    size_t n = strlen(needle);
    return s.len >= n && memmem(s.ptr, s.len, needle, n) != NULL;
}

/* ==== Overrides (--chat-template) ==== */

/* Open model files with an overriding template: a node serves one model,
 * tests open a few. */
#define CHAT_MAX_OVERRIDES 8

/* The built-in templates by name: the markers chat_detect and
 * tools_style_detect recognise (the rendering is fixed code). */
static const struct { const char *name, *text; } chat_builtin[] = {
    { "chatml", "<|im_start|>{{ role }}\n{{ content }}<|im_end|>\n" },
    { "llama3", "<|start_header_id|>{{ role }}<|end_header_id|>\n\n{{ content }}<|eot_id|>" },
    { "llama3.1", "<|start_header_id|>{{ role }}<|end_header_id|>\n\nEnvironment: ipython\n{{ content }}<|eot_id|>" },
};

static pthread_mutex_t chat_mu = PTHREAD_MUTEX_INITIALIZER;
static struct { const gguf_file *f; char *text; } chat_over[CHAT_MAX_OVERRIDES];

int chat_template_get(const gguf_file *f, gguf_str *out)
{
    int found = 0;
    pthread_mutex_lock(&chat_mu);
    for (int i = 0; i < CHAT_MAX_OVERRIDES && f; i++)
        if (chat_over[i].f == f) {
            out->ptr = chat_over[i].text;
            out->len = strlen(chat_over[i].text);
            found = 1;
        }
    pthread_mutex_unlock(&chat_mu);
    if (found) return 0;
    return f && gguf_get_str(f, "tokenizer.chat_template", out) == 0 ? 0 : -1;
}

int chat_set_template(const gguf_file *f, const char *spec, char *err, size_t errlen)
{
    const char *text = spec;
    for (size_t i = 0; i < sizeof chat_builtin / sizeof chat_builtin[0]; i++)
        if (!strcmp(spec, chat_builtin[i].name)) text = chat_builtin[i].text;
    gguf_str s = { text, strlen(text) };
    if (!chat_contains(s, "<|im_start|>") && !chat_contains(s, "<|start_header_id|>")) {
        snprintf(err, errlen, "chat template: not a built-in name (chatml, llama3, llama3.1) nor a ChatML or Llama 3 "
                 "template (tandem renders those two families)");
        return -1;
    }
    char *copy = strdup(text);
    if (!copy) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    int slot = -1;
    pthread_mutex_lock(&chat_mu);
    for (int i = 0; i < CHAT_MAX_OVERRIDES && slot < 0; i++)
        if (chat_over[i].f == f || !chat_over[i].f) slot = i;
    if (slot >= 0) {
        free(chat_over[slot].text);
        chat_over[slot].f = f;
        chat_over[slot].text = copy;
    }
    pthread_mutex_unlock(&chat_mu);
    if (slot < 0) {
        free(copy);
        snprintf(err, errlen, "chat template: more than %d overridden models", CHAT_MAX_OVERRIDES);
        return -1;
    }
    return 0;
}

enum chat_format chat_detect(const gguf_file *f, char *err, size_t errlen)
{
    gguf_str tpl;
    if (!f || chat_template_get(f, &tpl) != 0) {
        if (err && errlen)
            snprintf(err, errlen, "chat: the model has no tokenizer.chat_template (a node takes --chat-template "
                     "chatml|llama3|FILE)");
        return CHAT_NONE;
    }
    if (chat_contains(tpl, "<|im_start|>"))
        return CHAT_CHATML;
    if (chat_contains(tpl, "<|start_header_id|>"))
        return CHAT_LLAMA3;
    if (err && errlen)
        snprintf(err, errlen, "chat: unsupported chat template (only ChatML and Llama 3 are supported)");
    return CHAT_NONE;
}

/* ==== Rendering ==== */

static int chat_is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

static void chat_put_trimmed(strbuf *b, const char *s)
{
    size_t n = strlen(s), i = 0;
    while (i < n && chat_is_ws(s[i]))
        i++;
    while (n > i && chat_is_ws(s[n - 1]))
        n--;
    strbuf_put(b, s + i, n - i);
}

static void chat_render_chatml(strbuf *b, const chat_msg *m, int n, int gen)
{
    for (int i = 0; i < n; i++) {
        strbuf_puts(b, "<|im_start|>");
        strbuf_puts(b, m[i].role);
        strbuf_puts(b, "\n");
        strbuf_puts(b, m[i].content);
        strbuf_puts(b, "<|im_end|>\n");
    }
    if (gen)
        strbuf_puts(b, "<|im_start|>assistant\n");
}

static void chat_render_llama3(strbuf *b, const chat_msg *m, int n, int gen)
{
    for (int i = 0; i < n; i++) {
        strbuf_puts(b, "<|start_header_id|>");
        strbuf_puts(b, m[i].role);
        strbuf_puts(b, "<|end_header_id|>\n\n");
        chat_put_trimmed(b, m[i].content);
        strbuf_puts(b, "<|eot_id|>");
    }
    if (gen)
        strbuf_puts(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

char *chat_render(enum chat_format fmt, const chat_msg *msgs, int n, int add_generation_prompt)
{
    if ((fmt != CHAT_CHATML && fmt != CHAT_LLAMA3) || n < 0 || (n > 0 && !msgs))
        return NULL;
    for (int i = 0; i < n; i++)
        if (!msgs[i].role || !msgs[i].content)
            return NULL;
    strbuf b = { 0 };
    if (fmt == CHAT_CHATML)
        chat_render_chatml(&b, msgs, n, add_generation_prompt);
    else
        chat_render_llama3(&b, msgs, n, add_generation_prompt);
    return strbuf_take(&b, NULL);     /* an empty conversation still yields "" */
}
