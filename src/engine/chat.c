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

enum chat_format chat_detect(const gguf_file *f, char *err, size_t errlen)
{
    gguf_str tpl;
    if (!f || gguf_get_str(f, "tokenizer.chat_template", &tpl) != 0) {
        if (err && errlen)
            snprintf(err, errlen, "chat: the model has no tokenizer.chat_template");
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
