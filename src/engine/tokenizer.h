/* tokenizer.h - tokenizers built from GGUF metadata.
 *
 *   tokenizer.ggml.model = "llama": SentencePiece-style (scores, byte fallback)
 *   tokenizer.ggml.model = "gpt2" : byte-level BPE with pre-tokenizer from
 *                                   tokenizer.ggml.pre ("qwen2", "llama-bpe", ...)
 * Special/added tokens (CONTROL, USER_DEFINED) are matched before the normal
 * algorithm runs when parse_special is set (USER_DEFINED always).
 */
#ifndef TANDEM_TOKENIZER_H
#define TANDEM_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>
#include "engine/gguf.h"

typedef struct tokenizer tokenizer;

/* Token types as in tokenizer.ggml.token_type (a fact of the format). */
enum tok_type { TOK_NORMAL = 1, TOK_UNKNOWN = 2, TOK_CONTROL = 3, TOK_USER_DEFINED = 4,
                TOK_UNUSED = 5, TOK_BYTE = 6 };

int tokenizer_load(tokenizer **out, const gguf_file *f, char *err, size_t errlen);
void tokenizer_free(tokenizer *t);

int32_t tokenizer_n_vocab(const tokenizer *t);
int32_t tokenizer_bos(const tokenizer *t);    /* -1 if none */
int32_t tokenizer_eos(const tokenizer *t);    /* -1 if none */
int32_t tokenizer_eot(const tokenizer *t);    /* end-of-turn (<|eot_id|>, <|im_end|>), -1 if none */
int tokenizer_add_bos(const tokenizer *t);    /* tokenizer.ggml.add_bos_token / model default */
/* 1 if id ends generation (EOS, EOT or another end-of-generation token). */
int tokenizer_is_eog(const tokenizer *t, int32_t id);

/* Encode text (len bytes, any bytes allowed). add_special: prepend BOS (and
 * append EOS) if the model says so. parse_special: CONTROL tokens in the text become single ids.
 * Writes at most cap ids; returns the number of ids the full encoding needs
 * (which may exceed cap: call again with a bigger buffer), or -1 on error. */
int64_t tokenizer_encode(const tokenizer *t, const char *text, size_t len,
                         int add_special, int parse_special, int32_t *ids, int64_t cap);

/* The raw bytes a token stands for (byte-level BPE decoded, SPM '▁' -> ' ',
 * <0xNN> -> byte). Control tokens give "" unless render_special is set.
 * Returns the byte count written (<= cap), or -1 for a bad id or when the
 * bytes do not fit in cap (nothing is truncated). */
int tokenizer_token_bytes(const tokenizer *t, int32_t id, int render_special, char *buf, size_t cap);
/* The GGUF token string ("Ġthe"), or NULL for a bad id. Not NUL-terminated: *len set. */
const char *tokenizer_token_str(const tokenizer *t, int32_t id, size_t *len);
/* The token's type (enum tok_type; 0 for an unknown type value), -1 for a bad id. */
int tokenizer_token_type(const tokenizer *t, int32_t id);
/* Longest token text in bytes: a buffer this big always holds
 * tokenizer_token_bytes() of any token (decoded forms are never longer). */
size_t tokenizer_max_token_bytes(const tokenizer *t);

/* Streaming decoder: feeds token bytes, emits only complete UTF-8 sequences,
 * holding back an incomplete tail (at most 3 bytes) until the next token (or
 * flush, which emits whatever is held). Bytes that can never become valid
 * UTF-8 are emitted as they are rather than dropped, so no data is lost.
 * Control tokens give no text. SPM: the leading space of the first text
 * token of the stream (at_start, also set again by a BOS) is dropped: it is
 * the space the encoder prefixed (llama.cpp's detokenizer strips it too, and
 * llama2.c's reference story starts "Once", not " Once"); set at_start = 0
 * after init, or use tok_stream_init_prompt, when the stream continues text. push/flush return -1 (state unchanged) if the
 * output does not fit in cap; max_token_bytes + 8 always fits. */
typedef struct {
    const tokenizer *t;
    char pending[8];
    int n_pending;
    int at_start;
} tok_stream;
void tok_stream_init(tok_stream *s, const tokenizer *t);
/* Like tok_stream_init, for a stream of tokens generated after prompt ids
 * (which are not pushed): the SPM leading-space rule then applies only if the
 * prompt produced no text (e.g. BOS alone), so "Lily had a" + " big" keeps
 * its space while BOS + " Once" gives "Once". */
void tok_stream_init_prompt(tok_stream *s, const tokenizer *t, const int32_t *ids, int64_t n);
/* Appends complete text to out (cap bytes), returns bytes written or -1. */
int tok_stream_push(tok_stream *s, int32_t id, char *out, size_t cap);
int tok_stream_flush(tok_stream *s, char *out, size_t cap);

/* ==== Chat templates ==== */
enum chat_format { CHAT_NONE = 0, CHAT_CHATML = 1, CHAT_LLAMA3 = 2 };
typedef struct { const char *role; const char *content; } chat_msg;
/* Recognise tokenizer.chat_template. Returns CHAT_NONE with a message if the
 * template is missing or not one we support. */
enum chat_format chat_detect(const gguf_file *f, char *err, size_t errlen);
/* The template chat uses for f's model: an override set by
 * chat_set_template (a node's --chat-template, or its fallback), else the
 * file's tokenizer.chat_template. 0, or -1 when there is neither. */
int chat_template_get(const gguf_file *f, gguf_str *out);
/* Overrides f's template (f must outlive its use; one per open file, at
 * most 8 files). spec: a built-in name ("chatml", "llama3", "llama3.1":
 * Llama 3 with tool calls) or template text that chat_detect recognises.
 * 0, or -1 with a message. */
int chat_set_template(const gguf_file *f, const char *spec, char *err, size_t errlen);
/* Render messages with the generation prompt appended. Returns a malloc'd
 * NUL-terminated string, or NULL on error. */
char *chat_render(enum chat_format fmt, const chat_msg *msgs, int n, int add_generation_prompt);

#endif
