/* tokenizer_decode.c - token ids back to bytes: one token's text
 * (tokenizer_token_bytes: the GPT-2 byte map undone for BPE, U+2581 and
 * <0xNN> byte tokens undone for SPM) and the streaming decoder (tok_stream),
 * which holds back an incomplete UTF-8 sequence until the next token
 * completes it and drops SPM's leading space as llama.cpp does.
 */
#include "engine/tokenizer_internal.h"
#include "base/unicode.h"

#include <stdlib.h>
#include <string.h>

/* ==== Decode ==== */

/* Byte-level BPE text back to bytes; code points outside the map are copied
 * as their UTF-8 (llama.cpp would print a marker instead). */
static size_t bpe_unmap(const byte_map *m, const char *s, size_t n, char *out)
{
    size_t i = 0, o = 0;
    while (i < n) {
        uint32_t c;
        size_t len = unicode_decode((const unsigned char *)s + i, n - i, &c);
        if (c < 324 && m->dec[c] >= 0) {
            out[o++] = (char)m->dec[c];
        } else {
            memcpy(out + o, s + i, len);
            o += len;
        }
        i += len;
    }
    return o;
}

/* SPM: U+2581 back to spaces. */
static size_t spm_unescape(const char *s, size_t n, char *out)
{
    size_t i = 0, o = 0;
    while (i < n) {
        if (i + 3 <= n && (unsigned char)s[i] == 0xE2 && (unsigned char)s[i + 1] == 0x96 &&
            (unsigned char)s[i + 2] == 0x81) {
            out[o++] = ' ';
            i += 3;
        } else {
            out[o++] = s[i++];
        }
    }
    return o;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

/* Decode token id into out (room for its whole text); returns the length. */
static size_t tok_decode_into(const tokenizer *t, int32_t id, int render_special, char *out)
{
    const char *s = t->tok_arena + t->tok_off[id];
    size_t n = t->tok_len[id];
    int ty = t->type[id];
    if (ty == TOK_CONTROL || ty == TOK_UNKNOWN) {
        if (!render_special)
            return 0;
        ty = TOK_USER_DEFINED;     /* rendered as its text */
    }
    if (ty == TOK_USER_DEFINED) {
        memcpy(out, s, n);
        return n;
    }
    if (ty == TOK_NORMAL)
        return t->kind == KIND_SPM ? spm_unescape(s, n, out) : bpe_unmap(&t->bmap, s, n, out);
    if (ty == TOK_BYTE && t->kind == KIND_SPM && n == 6 && memcmp(s, "<0x", 3) == 0) {
        int hi = hexval(s[3]), lo = hexval(s[4]);
        if (hi < 0 || lo < 0)
            return 0;
        out[0] = (char)(hi * 16 + lo);
        return 1;
    }
    return 0;                      /* unused and undefined tokens have no text */
}

/* Decoded length without render_special (0 for control and unused tokens). */
static size_t tok_text_len(const tokenizer *t, int32_t id)
{
    int ty = t->type[id];
    if (ty == TOK_CONTROL || ty == TOK_UNKNOWN || ty == TOK_UNUSED || ty == 0)
        return 0;
    if (ty == TOK_BYTE && t->kind == KIND_BPE)
        return 0;
    return t->tok_len[id];        /* nonzero: every other token has text */
}

int tokenizer_token_bytes(const tokenizer *t, int32_t id, int render_special, char *buf, size_t cap)
{
    if (!t || id < 0 || id >= t->n_vocab || (!buf && cap))
        return -1;
    size_t n = t->tok_len[id];
    if (n <= cap)                  /* decoded forms are never longer than the text */
        return (int)tok_decode_into(t, id, render_special, buf);
    char stackbuf[256];
    char *tmp = n <= sizeof stackbuf ? stackbuf : malloc(n);
    if (!tmp)
        return -1;
    size_t k = tok_decode_into(t, id, render_special, tmp);
    int ret = -1;
    if (k <= cap) {
        if (k)
            memcpy(buf, tmp, k);
        ret = (int)k;
    }
    if (tmp != stackbuf)
        free(tmp);
    return ret;
}

/* ==== Streaming decode ==== */

void tok_stream_init(tok_stream *s, const tokenizer *t)
{
    memset(s, 0, sizeof *s);
    s->t = t;
    s->at_start = 1;
}

void tok_stream_init_prompt(tok_stream *s, const tokenizer *t, const int32_t *ids, int64_t n)
{
    tok_stream_init(s, t);
    if (!t || !ids)
        return;
    for (int64_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (t->bos >= 0 && id == t->bos)
            s->at_start = 1;
        else if (id >= 0 && id < t->n_vocab && tok_text_len(t, id) > 0)
            s->at_start = 0;
    }
}

/* Emits pending + piece up to the last complete UTF-8 sequence; an incomplete
 * tail (at most 3 bytes) stays pending. Invalid bytes are emitted as they are
 * (never dropped), so the output is valid UTF-8 whenever the tokens' bytes are. */
int tok_stream_push(tok_stream *s, int32_t id, char *out, size_t cap)
{
    if (!s || !s->t || (!out && cap) || s->n_pending < 0 || s->n_pending > 3)
        return -1;
    const tokenizer *t = s->t;
    size_t need = t->max_token_len + sizeof s->pending;
    char stackbuf[512];
    char *buf = need <= sizeof stackbuf ? stackbuf : malloc(need);
    if (!buf)
        return -1;
    size_t np = (size_t)s->n_pending;
    memcpy(buf, s->pending, np);
    int k = tokenizer_token_bytes(t, id, 0, buf + np, need - np);
    int at_start = s->at_start, ret = -1;
    if (k < 0)
        goto done;
    size_t total = np + (size_t)k;
    if (t->bos >= 0 && id == t->bos) {
        at_start = 1;              /* a BOS (re)starts the text */
    } else if (k > 0 && at_start) {
        if (t->kind == KIND_SPM && t->add_space_prefix && buf[np] == ' ') {
            memmove(buf + np, buf + np + 1, (size_t)k - 1);   /* the space the encoder added */
            total--;
        }
        at_start = 0;
    }
    size_t emit = unicode_complete_prefix((const unsigned char *)buf, total);
    if (emit > cap)
        goto done;
    memcpy(out, buf, emit);
    s->n_pending = (int)(total - emit);
    memcpy(s->pending, buf + emit, (size_t)s->n_pending);
    s->at_start = at_start;
    ret = (int)emit;
done:
    if (buf != stackbuf)
        free(buf);
    return ret;
}

int tok_stream_flush(tok_stream *s, char *out, size_t cap)
{
    if (!s || (!out && cap))
        return -1;
    size_t n = (size_t)s->n_pending;
    if (n > cap)
        return -1;
    memcpy(out, s->pending, n);
    s->n_pending = 0;
    return (int)n;
}
