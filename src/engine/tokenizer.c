/* tokenizer.c - SentencePiece-style and byte-level BPE tokenizers from GGUF.
 *
 * The reference behaviour is llama.cpp's (the project's oracle):
 *  - Special tokens (CONTROL, UNKNOWN when parse_special is on; USER_DEFINED
 *    always) are cut out of the raw text first. They are tried longest text
 *    first; each one splits every remaining text fragment at all its
 *    non-overlapping occurrences, left to right.
 *  - "llama" (SPM): spaces become U+2581, one U+2581 is prepended to a text
 *    fragment that starts the input or follows a special token, then adjacent
 *    symbols (UTF-8 characters at first) are merged greedily: the pair whose
 *    concatenation is the token with the highest score goes first, ties to the
 *    leftmost. Symbols that are not tokens fall back to <0xNN> byte tokens.
 *  - "gpt2" (byte-level BPE): a pre-tokenizer splits the text into words (a
 *    hand-written matcher for each supported regex), each word's bytes are
 *    mapped to GPT-2's printable code points, and adjacent symbols are merged
 *    by merge rank (lowest first, ties to the leftmost). Llama 3 emits a word
 *    that is itself a token directly ("ignore_merges").
 * Invalid UTF-8 never fails: for classification a bad byte is U+FFFD, but the
 * original bytes are what gets tokenized (byte-level BPE can represent every
 * byte; SPM falls back to byte tokens), so decoding gives the input back.
 *
 * This file loads the tokenizer from GGUF (vocabulary, scores, types,
 * merges, special and end-of-generation ids, byte tokens, the GPT-2 byte
 * map) and answers the accessors; tokenizer_encode.c encodes,
 * tokenizer_decode.c decodes; tokenizer_internal.h holds the struct.
 */
#include "engine/tokenizer_internal.h"
#include "base/unicode.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void tok_set_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (!err || !errlen)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* ==== Byte map ==== */

static void tok_build_byte_map(byte_map *mp)
{
    byte_map m;
    int n = 0;
    for (int i = 0; i < 324; i++)
        m.dec[i] = -1;
    for (int b = 0; b < 256; b++) {
        /* Printable Latin-1 bytes map to themselves; the other 68 bytes take
         * code points 256, 257, ... in byte order (GPT-2's bytes_to_unicode). */
        int printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        uint32_t cp = printable ? (uint32_t)b : (uint32_t)(256 + n++);
        char tmp[4];
        int len = unicode_encode(cp, tmp);
        m.enc[b][0] = tmp[0];
        m.enc[b][1] = len > 1 ? tmp[1] : 0;
        m.enc_len[b] = (uint8_t)len;
        m.dec[cp] = (int16_t)b;
    }
    *mp = m;
}

/* ==== String table ==== */

static uint32_t tok_hash(const char *s, size_t n)
{
    /* FNV-1a, then a final avalanche so low bits are usable as a slot index. */
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 16777619u;
    }
    h ^= h >> 15;
    h *= 0x2c1b3c6du;
    h ^= h >> 12;
    return h;
}

int64_t strtab_find(const strtab *t, const char *s, size_t n)
{
    if (!t->slots)
        return -1;
    uint32_t i = tok_hash(s, n) & t->mask;
    for (;;) {
        uint32_t v = t->slots[i];
        if (!v)
            return -1;
        uint32_t k = v - 1;
        if (t->len[k] == n && memcmp(t->arena + t->off[k], s, n) == 0)
            return k;
        i = (i + 1) & t->mask;
    }
}

/* Build the table over keys 0..n-1. keep_last: a later duplicate key replaces
 * an earlier one (vocabulary: the last id wins); otherwise the first stays
 * (merges: the lowest rank wins). */
static int strtab_build(strtab *t, const char *arena, const uint32_t *off, const uint32_t *len,
                        uint32_t n, int keep_last)
{
    uint32_t cap = 16;
    while (cap < n * 2u + 16u)
        cap *= 2;
    t->slots = calloc(cap, sizeof *t->slots);
    if (!t->slots)
        return -1;
    t->arena = arena;
    t->off = off;
    t->len = len;
    t->n = n;
    t->mask = cap - 1;
    for (uint32_t k = 0; k < n; k++) {
        const char *s = arena + off[k];
        uint32_t i = tok_hash(s, len[k]) & t->mask;
        for (;;) {
            uint32_t v = t->slots[i];
            if (!v) {
                t->slots[i] = k + 1;
                break;
            }
            if (len[v - 1] == len[k] && memcmp(arena + off[v - 1], s, len[k]) == 0) {
                if (keep_last)
                    t->slots[i] = k + 1;
                break;
            }
            i = (i + 1) & t->mask;
        }
    }
    return 0;
}

/* ==== Loading ==== */

/* Copy the strings of a GGUF string array into one arena. */
static int tok_copy_strings(const gguf_arr *a, char **arena, uint32_t **off, uint32_t **len,
                            int empty_placeholder, char *err, size_t errlen)
{
    uint64_t total = 0;
    gguf_str s;
    gguf_str_iter it;
    gguf_str_iter_init(&it, a);
    for (uint64_t i = 0; i < a->n; i++) {
        if (gguf_str_iter_next(&it, &s)) {
            tok_set_err(err, errlen, "tokenizer: bad string %llu in array", (unsigned long long)i);
            return -1;
        }
        if (s.len > UINT32_MAX / 2) {
            tok_set_err(err, errlen, "tokenizer: string %llu too long", (unsigned long long)i);
            return -1;
        }
        total += s.len ? s.len : 24;   /* room for an "[EMPTY_<id>]" placeholder */
    }
    if (total > UINT32_MAX - 1) {
        tok_set_err(err, errlen, "tokenizer: string data too large");
        return -1;
    }
    *arena = malloc(total + 1);
    *off = malloc((a->n + 1) * sizeof **off);
    *len = malloc((a->n + 1) * sizeof **len);
    if (!*arena || !*off || !*len) {
        tok_set_err(err, errlen, "tokenizer: out of memory");
        return -1;
    }
    uint32_t pos = 0;
    gguf_str_iter_init(&it, a);
    for (uint64_t i = 0; i < a->n; i++) {
        gguf_str_iter_next(&it, &s);
        (*off)[i] = pos;
        if (s.len == 0 && empty_placeholder) {
            /* llama.cpp renames empty tokens so that they cannot match text. */
            int k = snprintf(*arena + pos, 25, "[EMPTY_%llu]", (unsigned long long)i);
            (*len)[i] = (uint32_t)k;
            pos += (uint32_t)k;
        } else {
            memcpy(*arena + pos, s.ptr, s.len);
            (*len)[i] = (uint32_t)s.len;
            pos += (uint32_t)s.len;
        }
    }
    return 0;
}

static int tok_read_model(tokenizer *t, const gguf_file *f, char *err, size_t errlen)
{
    gguf_str s;
    if (gguf_get_str(f, "tokenizer.ggml.model", &s)) {
        tok_set_err(err, errlen, "tokenizer: tokenizer.ggml.model missing or not a string");
        return -1;
    }
    if (gguf_str_eq(s, "llama")) {
        t->kind = KIND_SPM;
        t->pre = PRE_NONE;
        t->bos = 1;                     /* llama.cpp's defaults for SPM vocabularies */
        t->eos = 2;
        t->unk = 0;
        t->add_bos = 1;
        t->add_space_prefix = 1;
        return 0;
    }
    if (!gguf_str_eq(s, "gpt2")) {
        tok_set_err(err, errlen, "tokenizer: unsupported tokenizer model '%.*s' (need 'llama' or 'gpt2')",
                    (int)(s.len > 64 ? 64 : s.len), s.ptr);
        return -1;
    }
    t->kind = KIND_BPE;
    t->bos = 11;                        /* llama.cpp's (odd) defaults for BPE vocabularies */
    t->eos = 11;
    t->unk = -1;
    int r = gguf_get_str(f, "tokenizer.ggml.pre", &s);
    if (r == -1 || (r == 0 && (gguf_str_eq(s, "default") || gguf_str_eq(s, "gpt-2")))) {
        /* No or the default pre-tokenizer: the plain GPT-2 split is the
         * closest supported behaviour. */
        t->pre = PRE_GPT2;
        return 0;
    }
    if (r) {
        tok_set_err(err, errlen, "tokenizer: tokenizer.ggml.pre is not a string");
        return -1;
    }
    if (gguf_str_eq(s, "llama3") || gguf_str_eq(s, "llama-v3") || gguf_str_eq(s, "llama-bpe") ||
        gguf_str_eq(s, "falcon3") || gguf_str_eq(s, "pixtral")) {
        t->pre = PRE_LLAMA3;
        t->ignore_merges = 1;
        t->add_bos = 1;
        return 0;
    }
    if (gguf_str_eq(s, "qwen2") || gguf_str_eq(s, "deepseek-r1-qwen") || gguf_str_eq(s, "megrez") ||
        gguf_str_eq(s, "stablelm2")) {
        t->pre = PRE_QWEN2;
        return 0;
    }
    /* llama.cpp's SMOLLM group (with starcoder, refact, command-r,
     * codeshell, exaone, minerva): every \p{N} is a piece of its own, then
     * GPT-2's split within what lies between. smollm's detokenizer leaves
     * spaces before punctuation alone (clean_spaces off), as this one does. */
    if (gguf_str_eq(s, "smollm") || gguf_str_eq(s, "starcoder") || gguf_str_eq(s, "refact") ||
        gguf_str_eq(s, "command-r") || gguf_str_eq(s, "codeshell") || gguf_str_eq(s, "exaone") ||
        gguf_str_eq(s, "minerva-7b")) {
        t->pre = PRE_DIGITS_GPT2;
        return 0;
    }
    tok_set_err(err, errlen, "tokenizer: unsupported pre-tokenizer '%.*s' (supported: qwen2, llama-bpe/llama3, smollm/starcoder, default)",
                (int)(s.len > 64 ? 64 : s.len), s.ptr);
    return -1;
}

static int tok_read_vocab(tokenizer *t, const gguf_file *f, char *err, size_t errlen)
{
    gguf_arr a;
    if (gguf_get_arr(f, "tokenizer.ggml.tokens", &a) || a.elem_type != GGUF_VT_STR) {
        tok_set_err(err, errlen, "tokenizer: tokenizer.ggml.tokens missing or not a string array");
        return -1;
    }
    if (a.n == 0 || a.n > INT32_MAX / 2) {
        tok_set_err(err, errlen, "tokenizer: bad vocabulary size %llu", (unsigned long long)a.n);
        return -1;
    }
    t->n_vocab = (int32_t)a.n;
    if (tok_copy_strings(&a, &t->tok_arena, &t->tok_off, &t->tok_len, 1, err, errlen))
        return -1;
    t->scores = calloc((size_t)t->n_vocab, sizeof *t->scores);
    t->type = malloc((size_t)t->n_vocab);
    if (!t->scores || !t->type) {
        tok_set_err(err, errlen, "tokenizer: out of memory");
        return -1;
    }
    memset(t->type, TOK_NORMAL, (size_t)t->n_vocab);
    gguf_arr sc;
    if (gguf_get_arr(f, "tokenizer.ggml.scores", &sc) == 0) {
        if (sc.elem_type != GGUF_VT_F32 || sc.n != a.n) {
            tok_set_err(err, errlen, "tokenizer: tokenizer.ggml.scores must be %llu F32 values",
                        (unsigned long long)a.n);
            return -1;
        }
        memcpy(t->scores, sc.data, (size_t)t->n_vocab * sizeof(float));
    }
    gguf_arr ty;
    if (gguf_get_arr(f, "tokenizer.ggml.token_type", &ty) == 0) {
        if ((ty.elem_type != GGUF_VT_I32 && ty.elem_type != GGUF_VT_U32) || ty.n != a.n) {
            tok_set_err(err, errlen, "tokenizer: tokenizer.ggml.token_type must be %llu I32 values",
                        (unsigned long long)a.n);
            return -1;
        }
        for (int32_t i = 0; i < t->n_vocab; i++) {
            int32_t v;
            memcpy(&v, ty.data + (size_t)i * 4, 4);
            t->type[i] = (uint8_t)((v >= TOK_NORMAL && v <= TOK_BYTE) ? v : 0);
        }
    }
    for (int32_t i = 0; i < t->n_vocab; i++)
        if (t->tok_len[i] > t->max_token_len)
            t->max_token_len = t->tok_len[i];
    if (strtab_build(&t->vocab, t->tok_arena, t->tok_off, t->tok_len, (uint32_t)t->n_vocab, 1)) {
        tok_set_err(err, errlen, "tokenizer: out of memory");
        return -1;
    }
    return 0;
}

static int tok_read_merges(tokenizer *t, const gguf_file *f, char *err, size_t errlen)
{
    gguf_arr a;
    if (gguf_get_arr(f, "tokenizer.ggml.merges", &a) || a.elem_type != GGUF_VT_STR) {
        tok_set_err(err, errlen, "tokenizer: BPE model without tokenizer.ggml.merges string array");
        return -1;
    }
    if (a.n > INT32_MAX / 2) {
        tok_set_err(err, errlen, "tokenizer: too many merges");
        return -1;
    }
    if (tok_copy_strings(&a, &t->merge_arena, &t->merge_off, &t->merge_len, 0, err, errlen))
        return -1;
    if (strtab_build(&t->merges, t->merge_arena, t->merge_off, t->merge_len, (uint32_t)a.n, 0)) {
        tok_set_err(err, errlen, "tokenizer: out of memory");
        return -1;
    }
    return 0;
}

int32_t tok_find(const tokenizer *t, const char *s, size_t n)
{
    return (int32_t)strtab_find(&t->vocab, s, n);
}

static void tok_read_id(const tokenizer *t, const gguf_file *f, const char *key, int32_t *id)
{
    uint32_t v;
    if (gguf_get_u32(f, key, &v) == 0 && v < (uint32_t)t->n_vocab)
        *id = (int32_t)v;
    /* An out-of-range id keeps the default, as llama.cpp does. */
}

static void tok_read_flags(tokenizer *t, const gguf_file *f)
{
    int b;
    tok_read_id(t, f, "tokenizer.ggml.bos_token_id", &t->bos);
    tok_read_id(t, f, "tokenizer.ggml.eos_token_id", &t->eos);
    tok_read_id(t, f, "tokenizer.ggml.eot_token_id", &t->eot);
    tok_read_id(t, f, "tokenizer.ggml.eom_token_id", &t->eom);
    tok_read_id(t, f, "tokenizer.ggml.unknown_token_id", &t->unk);
    tok_read_id(t, f, "tokenizer.ggml.padding_token_id", &t->pad);
    if (gguf_get_bool(f, "tokenizer.ggml.add_bos_token", &b) == 0)
        t->add_bos = b;
    if (gguf_get_bool(f, "tokenizer.ggml.add_eos_token", &b) == 0)
        t->add_eos = b;
    if (gguf_get_bool(f, "tokenizer.ggml.add_space_prefix", &b) == 0)
        t->add_space_prefix = b;
    if (t->bos >= t->n_vocab)
        t->bos = -1;
    if (t->eos >= t->n_vocab)
        t->eos = -1;
    if (t->unk >= t->n_vocab)
        t->unk = -1;
}

static int tok_eog_text(const char *s, size_t n)
{
    /* Token texts llama.cpp treats as end of generation. */
    static const char *const names[] = {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
        "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
        "<|fim_pad|>", "<|fim_repo|>", "<|repo_name|>", "<|file_sep|>",
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strlen(names[i]) == n && memcmp(names[i], s, n) == 0)
            return 1;
    return 0;
}

static void tok_find_eot(tokenizer *t)
{
    /* Preference order when the file names no EOT token. */
    static const char *const names[] = {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "_<EOT>",
        "<end_of_utterance>",
    };
    for (size_t i = 0; t->eot < 0 && i < sizeof names / sizeof names[0]; i++)
        t->eot = tok_find(t, names[i], strlen(names[i]));
    if (t->eom < 0)
        t->eom = tok_find(t, "<|eom_id|>", 10);
}

static int tok_build_eog(tokenizer *t)
{
    t->eog = malloc(sizeof(int32_t) * 32);
    if (!t->eog)
        return -1;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        if (!tok_eog_text(t->tok_arena + t->tok_off[i], t->tok_len[i]))
            continue;
        t->type[i] = TOK_CONTROL;      /* llama.cpp forces these to CONTROL */
        if (t->n_eog < 28)
            t->eog[t->n_eog++] = i;
    }
    int32_t extra[3] = { t->eos, t->eot, t->eom };
    for (int k = 0; k < 3; k++) {
        if (extra[k] < 0 || tokenizer_is_eog(t, extra[k]))
            continue;
        t->eog[t->n_eog++] = extra[k];
    }
    return 0;
}

static int tok_cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : (x > y);
}

static int tok_is_special_type(int ty)
{
    return ty == TOK_CONTROL || ty == TOK_USER_DEFINED || ty == TOK_UNKNOWN;
}

/* Special tokens sorted longest text first (ties: lower id first). */
static int tok_build_specials(tokenizer *t)
{
    int32_t n = 0;
    for (int32_t i = 0; i < t->n_vocab; i++)
        n += tok_is_special_type(t->type[i]);
    uint64_t *keys = malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
    t->specials = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    if (!keys || !t->specials) {
        free(keys);
        return -1;
    }
    for (int32_t i = 0; i < t->n_vocab; i++)
        if (tok_is_special_type(t->type[i]))
            keys[t->n_specials++] = ((uint64_t)(UINT32_MAX - t->tok_len[i]) << 32) | (uint32_t)i;
    qsort(keys, (size_t)t->n_specials, sizeof *keys, tok_cmp_u64);
    for (int32_t k = 0; k < t->n_specials; k++)
        t->specials[k] = (int32_t)(keys[k] & 0xFFFFFFFFu);
    free(keys);
    return 0;
}

static void tok_build_byte_tokens(tokenizer *t)
{
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        int32_t id = tok_find(t, name, 6);
        if (id < 0) {
            char c = (char)b;             /* fall back to the byte as a one-byte token */
            id = tok_find(t, &c, 1);
        }
        t->byte_tok[b] = id;
    }
}

int tokenizer_load(tokenizer **out, const gguf_file *f, char *err, size_t errlen)
{
    if (!out || !f) {
        tok_set_err(err, errlen, "tokenizer: NULL argument");
        return -1;
    }
    *out = NULL;
    tokenizer *t = calloc(1, sizeof *t);
    if (!t) {
        tok_set_err(err, errlen, "tokenizer: out of memory");
        return -1;
    }
    t->eot = t->eom = t->pad = -1;
    if (tok_read_model(t, f, err, errlen) || tok_read_vocab(t, f, err, errlen) ||
        (t->kind == KIND_BPE && tok_read_merges(t, f, err, errlen)))
        goto fail;
    tok_read_flags(t, f);
    tok_find_eot(t);
    if (tok_build_eog(t) || tok_build_specials(t)) {
        tok_set_err(err, errlen, "tokenizer: out of memory");
        goto fail;
    }
    tok_build_byte_tokens(t);
    if (t->add_bos && t->bos < 0) {
        tok_set_err(err, errlen, "tokenizer: the model asks for BOS but has no valid BOS id");
        goto fail;
    }
    if (t->add_eos && t->eos < 0) {
        tok_set_err(err, errlen, "tokenizer: the model asks for EOS but has no valid EOS id");
        goto fail;
    }
    tok_build_byte_map(&t->bmap);
    *out = t;
    return 0;
fail:
    tokenizer_free(t);
    return -1;
}

void tokenizer_free(tokenizer *t)
{
    if (!t)
        return;
    free(t->tok_arena);
    free(t->tok_off);
    free(t->tok_len);
    free(t->scores);
    free(t->type);
    free(t->vocab.slots);
    free(t->merge_arena);
    free(t->merge_off);
    free(t->merge_len);
    free(t->merges.slots);
    free(t->specials);
    free(t->eog);
    free(t);
}

/* ==== Accessors ==== */

int32_t tokenizer_n_vocab(const tokenizer *t) { return t ? t->n_vocab : 0; }
int32_t tokenizer_bos(const tokenizer *t) { return t ? t->bos : -1; }
int32_t tokenizer_eos(const tokenizer *t) { return t ? t->eos : -1; }
int32_t tokenizer_eot(const tokenizer *t) { return t ? t->eot : -1; }
int tokenizer_add_bos(const tokenizer *t) { return t ? t->add_bos : 0; }
size_t tokenizer_max_token_bytes(const tokenizer *t) { return t ? t->max_token_len : 0; }

int tokenizer_is_eog(const tokenizer *t, int32_t id)
{
    if (!t || id < 0)
        return 0;
    for (int32_t i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id)
            return 1;
    return 0;
}

const char *tokenizer_token_str(const tokenizer *t, int32_t id, size_t *len)
{
    if (!t || id < 0 || id >= t->n_vocab)
        return NULL;
    if (len)
        *len = t->tok_len[id];
    return t->tok_arena + t->tok_off[id];
}

int tokenizer_token_type(const tokenizer *t, int32_t id)
{
    if (!t || id < 0 || id >= t->n_vocab)
        return -1;
    return t->type[id];
}
