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
 */
#include "engine/tokenizer.h"
#include "base/strbuf.h"
#include "base/unicode.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== Types ==== */

enum tok_kind { KIND_SPM = 1, KIND_BPE = 2 };
enum tok_pre { PRE_NONE = 0, PRE_GPT2 = 1, PRE_LLAMA3 = 2, PRE_QWEN2 = 3, PRE_DIGITS_GPT2 = 4 };

/* GPT-2 byte <-> code point mapping (a pure function of the byte). */
typedef struct {
    char enc[256][2];
    uint8_t enc_len[256];
    int16_t dec[324];            /* code point (< 324) -> byte, -1 if not a mapped code point */
} byte_map;

/* Open-addressing hash set of strings kept in an arena; slots hold index + 1. */
typedef struct {
    const char *arena;
    const uint32_t *off, *len;
    uint32_t n;
    uint32_t *slots;
    uint32_t mask;
} strtab;

struct tokenizer {
    int kind, pre;
    int32_t n_vocab;
    char *tok_arena;
    uint32_t *tok_off, *tok_len;
    float *scores;
    uint8_t *type;               /* enum tok_type; 0 = undefined */
    strtab vocab;
    char *merge_arena;
    uint32_t *merge_off, *merge_len;
    strtab merges;
    int32_t bos, eos, eot, eom, unk, pad;
    int add_bos, add_eos, add_space_prefix, ignore_merges;
    int32_t *specials;           /* CONTROL / USER_DEFINED / UNKNOWN, longest text first */
    int32_t n_specials;
    int32_t *eog;                /* end-of-generation ids */
    int32_t n_eog;
    int32_t byte_tok[256];       /* SPM byte-fallback tokens, -1 if absent */
    uint32_t max_token_len;
    byte_map bmap;               /* built at load: the tokenizer is immutable afterwards */
};


static void tok_set_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (!err || !errlen)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* ==== Growable int vector ==== */

typedef struct {
    int32_t *v;
    size_t n, cap;
    int oom;
} ivec;

static void ivec_push(ivec *a, int32_t x)
{
    if (a->oom)
        return;
    if (a->n == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 64;
        int32_t *nv = realloc(a->v, nc * sizeof *nv);
        if (!nv) {
            a->oom = 1;
            return;
        }
        a->v = nv;
        a->cap = nc;
    }
    a->v[a->n++] = x;
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

static int64_t strtab_find(const strtab *t, const char *s, size_t n)
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

static int32_t tok_find(const tokenizer *t, const char *s, size_t n)
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

/* ==== Heap of candidate merges ==== */

/* A candidate merge of symbols left and right; key is the priority (the SPM
 * score, or minus the BPE rank); size is the byte length the two symbols had
 * when it was queued, which detects stale entries. */
typedef struct {
    double key;
    int32_t left, right;
    uint32_t size;
} bigram;

typedef struct {
    bigram *h;
    size_t n, cap;
    int oom;
} bheap;

static int bigram_before(const bigram *a, const bigram *b)
{
    return a->key > b->key || (a->key == b->key && a->left < b->left);
}

static void bheap_push(bheap *q, bigram x)
{
    if (q->oom)
        return;
    if (q->n == q->cap) {
        size_t nc = q->cap ? q->cap * 2 : 64;
        bigram *nh = realloc(q->h, nc * sizeof *nh);
        if (!nh) {
            q->oom = 1;
            return;
        }
        q->h = nh;
        q->cap = nc;
    }
    size_t i = q->n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!bigram_before(&x, &q->h[p]))
            break;
        q->h[i] = q->h[p];
        i = p;
    }
    q->h[i] = x;
}

static bigram bheap_pop(bheap *q)
{
    bigram top = q->h[0];
    bigram last = q->h[--q->n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= q->n)
            break;
        if (c + 1 < q->n && bigram_before(&q->h[c + 1], &q->h[c]))
            c++;
        if (!bigram_before(&q->h[c], &last))
            break;
        q->h[i] = q->h[c];
        i = c;
    }
    if (q->n)
        q->h[i] = last;
    return top;
}

/* ==== Symbols (shared by SPM and BPE merging) ==== */

typedef struct {
    uint32_t off, n;     /* bytes within the session text; n == 0 once merged away */
    int32_t prev, next;
} symbol;

typedef struct {
    symbol *s;
    size_t n, cap;
    int oom;
} symvec;

static void symvec_push(symvec *v, symbol x)
{
    if (v->oom)
        return;
    if (v->n == v->cap) {
        size_t nc = v->cap ? v->cap * 2 : 64;
        symbol *ns = realloc(v->s, nc * sizeof *ns);
        if (!ns) {
            v->oom = 1;
            return;
        }
        v->s = ns;
        v->cap = nc;
    }
    v->s[v->n++] = x;
}

/* Scratch state of one encode call. */
typedef struct {
    const tokenizer *t;
    ivec out;
    symvec sym;
    bheap heap;
    strbuf text;           /* SPM escaped text or BPE mapped word */
    strbuf key;            /* merge lookup key */
    uint32_t *cp;        /* BPE: code points of the fragment */
    uint8_t *cls;        /* BPE: their classes */
    uint32_t *cpoff;     /* BPE: byte offset of each code point (n + 1 entries) */
    size_t ncp_cap;
    int oom;
} session;

static int session_failed(const session *ss)
{
    return ss->oom || ss->out.oom || ss->sym.oom || ss->heap.oom || ss->text.oom || ss->key.oom;
}

/* Split text[0..n) into UTF-8 symbols (length from the lead byte, clipped)
 * and link them. */
static void session_split_symbols(session *ss, const char *text, size_t n)
{
    ss->sym.n = 0;
    size_t off = 0;
    int32_t idx = 0;
    while (off < n) {
        size_t len = unicode_seq_len((unsigned char)text[off]);
        if (len > n - off)
            len = n - off;
        symbol y = { (uint32_t)off, (uint32_t)len, idx - 1, off + len == n ? -1 : idx + 1 };
        symvec_push(&ss->sym, y);
        off += len;
        idx++;
    }
}

/* Merge the bigram if it is still current; returns 1 when merged. */
static int session_apply(session *ss, const bigram *b)
{
    symbol *l = &ss->sym.s[b->left], *r = &ss->sym.s[b->right];
    if (l->n == 0 || r->n == 0 || l->n + r->n != b->size)
        return 0;
    l->n += r->n;
    r->n = 0;
    l->next = r->next;
    if (r->next >= 0)
        ss->sym.s[r->next].prev = b->left;
    return 1;
}

/* ==== SPM ==== */

static void spm_try_bigram(session *ss, int32_t left, int32_t right)
{
    if (left < 0 || right < 0)
        return;
    const symbol *l = &ss->sym.s[left], *r = &ss->sym.s[right];
    int32_t id = tok_find(ss->t, ss->text.p + l->off, l->n + r->n);
    if (id < 0)
        return;
    bigram b = { ss->t->scores[id], left, right, l->n + r->n };
    bheap_push(&ss->heap, b);
}

static void spm_emit_symbol(session *ss, const symbol *y)
{
    const tokenizer *t = ss->t;
    int32_t id = tok_find(t, ss->text.p + y->off, y->n);
    if (id >= 0) {
        ivec_push(&ss->out, id);
        return;
    }
    /* Not a token: one byte token per byte (the unknown token if the
     * vocabulary lacks byte tokens). */
    for (uint32_t k = 0; k < y->n; k++) {
        int32_t bt = t->byte_tok[(unsigned char)ss->text.p[y->off + k]];
        if (bt < 0)
            bt = t->unk;
        if (bt >= 0)
            ivec_push(&ss->out, bt);
    }
}

static void spm_encode_fragment(session *ss, const char *s, size_t n, int prefix_space)
{
    static const char lower_block[3] = { (char)0xE2, (char)0x96, (char)0x81 };   /* U+2581 */
    ss->text.len = 0;
    if (prefix_space)
        strbuf_put(&ss->text, lower_block, 3);
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ')
            strbuf_put(&ss->text, lower_block, 3);
        else
            strbuf_put(&ss->text, s + i, 1);
    }
    if (session_failed(ss) || ss->text.len == 0)
        return;
    session_split_symbols(ss, ss->text.p, ss->text.len);
    ss->heap.n = 0;
    for (size_t i = 1; i < ss->sym.n; i++)
        spm_try_bigram(ss, (int32_t)i - 1, (int32_t)i);
    while (ss->heap.n && !session_failed(ss)) {
        bigram b = bheap_pop(&ss->heap);
        if (!session_apply(ss, &b))
            continue;
        spm_try_bigram(ss, ss->sym.s[b.left].prev, b.left);
        spm_try_bigram(ss, b.left, ss->sym.s[b.left].next);
    }
    if (session_failed(ss))
        return;
    for (int32_t i = 0; i != -1; i = ss->sym.s[i].next)
        spm_emit_symbol(ss, &ss->sym.s[i]);
}

/* ==== BPE pre-tokenizers ==== */

/* Each matcher returns the code-point length (>= 1) of the word starting at
 * i in cp[0..n), following the leftmost-first alternation of its regex. */

static size_t pre_space_run(const uint8_t *cls, size_t i, size_t n)
{
    size_t j = i;
    while (j < n && cls[j] == UCLASS_SPACE)
        j++;
    return j - i;
}

/* Contractions 's 't 're 've 'm 'll 'd; fold: ASCII case-insensitive. */
static size_t pre_contraction(const uint32_t *cp, size_t i, size_t n, int fold)
{
    if (cp[i] != '\'' || i + 1 >= n)
        return 0;
    uint32_t a = cp[i + 1], b = i + 2 < n ? cp[i + 2] : 0;
    if (fold) {
        if (a >= 'A' && a <= 'Z')
            a += 32;
        if (b >= 'A' && b <= 'Z')
            b += 32;
    }
    if (a == 's' || a == 't' || a == 'm' || a == 'd')
        return 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
        return 3;
    return 0;
}

/* Whitespace alternatives shared by all patterns: \s+(?!\S) then \s+. */
static size_t pre_trailing_space(size_t run, size_t i, size_t n)
{
    if (run > 1 && i + run < n)
        return run - 1;        /* leave the last space to prefix the next word */
    return run;
}

/* Qwen2 (max_digits 1) and Llama 3 (max_digits 3):
 * (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,D}|
 *  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
static size_t pre_match_llama3(const uint32_t *cp, const uint8_t *cls, size_t i, size_t n, size_t max_digits)
{
    size_t k = pre_contraction(cp, i, n, 1);
    if (k)
        return k;
    int c = cls[i];
    if (c != UCLASS_NUMBER && cp[i] != '\r' && cp[i] != '\n') {
        size_t j = i;
        if (c != UCLASS_LETTER && i + 1 < n && cls[i + 1] == UCLASS_LETTER)
            j = i + 1;
        if (cls[j] == UCLASS_LETTER) {
            while (j < n && cls[j] == UCLASS_LETTER)
                j++;
            return j - i;
        }
    }
    if (c == UCLASS_NUMBER) {
        size_t j = i;
        while (j < n && j - i < max_digits && cls[j] == UCLASS_NUMBER)
            j++;
        return j - i;
    }
    size_t s = (cp[i] == ' ' && i + 1 < n && cls[i + 1] == UCLASS_OTHER) ? i + 1 : i;
    if (cls[s] == UCLASS_OTHER) {
        size_t j = s;
        while (j < n && cls[j] == UCLASS_OTHER)
            j++;
        while (j < n && (cp[j] == '\r' || cp[j] == '\n'))
            j++;
        return j - i;
    }
    size_t run = pre_space_run(cls, i, n);
    size_t last_nl = 0;
    for (size_t j = i; j < i + run; j++)
        if (cp[j] == '\r' || cp[j] == '\n')
            last_nl = j + 1;
    if (last_nl)
        return last_nl - i;
    return run ? pre_trailing_space(run, i, n) : 1;
}

/* GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static size_t pre_match_gpt2(const uint32_t *cp, const uint8_t *cls, size_t i, size_t n)
{
    size_t k = pre_contraction(cp, i, n, 0);
    if (k)
        return k;
    size_t s = (cp[i] == ' ' && i + 1 < n) ? i + 1 : i;
    int c = cls[s];
    if (c != UCLASS_SPACE) {
        size_t j = s;
        while (j < n && cls[j] == c)
            j++;
        return j - i;
    }
    size_t run = pre_space_run(cls, i, n);
    return run ? pre_trailing_space(run, i, n) : 1;
}

/* SmolLM and the StarCoder family: \p{N} | (GPT-2's regex between numbers).
 * llama.cpp applies the two regexes one after the other, the second within
 * the pieces the first left, so a space before a digit is a piece by itself
 * and GPT-2's \s+(?!\S) sees the end of the piece as the end of the text. */
static size_t pre_match_digits_gpt2(const uint32_t *cp, const uint8_t *cls, size_t i, size_t n)
{
    if (cls[i] == UCLASS_NUMBER)
        return 1;
    size_t e = i;
    while (e < n && cls[e] != UCLASS_NUMBER)
        e++;
    return pre_match_gpt2(cp, cls, i, e);
}

/* ==== BPE ==== */

static int64_t bpe_rank(session *ss, const char *l, size_t ln, const char *r, size_t rn)
{
    /* Merges are stored as "left right", split at the first space after the
     * first byte; a left part containing a later space can never match. */
    if (ln > 1 && memchr(l + 1, ' ', ln - 1))
        return -1;
    ss->key.len = 0;
    strbuf_put(&ss->key, l, ln);
    strbuf_put(&ss->key, " ", 1);
    strbuf_put(&ss->key, r, rn);
    if (ss->key.oom)
        return -1;
    return strtab_find(&ss->t->merges, ss->key.p, ss->key.len);
}

static void bpe_try_bigram(session *ss, int32_t left, int32_t right)
{
    if (left < 0 || right < 0)
        return;
    const symbol *l = &ss->sym.s[left], *r = &ss->sym.s[right];
    int64_t rank = bpe_rank(ss, ss->text.p + l->off, l->n, ss->text.p + r->off, r->n);
    if (rank < 0)
        return;
    bigram b = { -(double)rank, left, right, l->n + r->n };
    bheap_push(&ss->heap, b);
}

static void bpe_emit_symbol(session *ss, const symbol *y)
{
    const char *p = ss->text.p + y->off;
    int32_t id = tok_find(ss->t, p, y->n);
    if (id >= 0) {
        ivec_push(&ss->out, id);
        return;
    }
    for (uint32_t k = 0; k < y->n; k++) {    /* llama.cpp: try each byte alone */
        id = tok_find(ss->t, p + k, 1);
        if (id >= 0)
            ivec_push(&ss->out, id);
    }
}

/* Encode one pre-tokenized word (original bytes s[0..n)). */
static void bpe_encode_word(session *ss, const char *s, size_t n)
{
    const byte_map *m = &ss->t->bmap;
    ss->text.len = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char b = (unsigned char)s[i];
        strbuf_put(&ss->text, m->enc[b], m->enc_len[b]);
    }
    if (ss->text.oom)
        return;
    if (ss->t->ignore_merges) {
        int32_t id = tok_find(ss->t, ss->text.p, ss->text.len);
        if (id >= 0) {
            ivec_push(&ss->out, id);
            return;
        }
    }
    session_split_symbols(ss, ss->text.p, ss->text.len);
    ss->heap.n = 0;
    for (size_t i = 1; i < ss->sym.n; i++)
        bpe_try_bigram(ss, (int32_t)i - 1, (int32_t)i);
    while (ss->heap.n && !session_failed(ss)) {
        bigram b = bheap_pop(&ss->heap);
        if (!session_apply(ss, &b))
            continue;
        bpe_try_bigram(ss, ss->sym.s[b.left].prev, b.left);
        bpe_try_bigram(ss, b.left, ss->sym.s[b.left].next);
    }
    if (session_failed(ss))
        return;
    for (int32_t i = 0; i != -1; i = ss->sym.s[i].next)
        bpe_emit_symbol(ss, &ss->sym.s[i]);
}

/* Decode the fragment's code points; returns their count in *ncp. */
static int session_decode_cps(session *ss, const char *s, size_t n, size_t *ncp)
{
    if (n + 1 > ss->ncp_cap) {
        size_t nc = n + 1;
        uint32_t *cp = realloc(ss->cp, nc * sizeof *cp);
        if (cp)
            ss->cp = cp;
        uint8_t *cls = realloc(ss->cls, nc);
        if (cls)
            ss->cls = cls;
        uint32_t *off = realloc(ss->cpoff, nc * sizeof *off);
        if (off)
            ss->cpoff = off;
        if (!cp || !cls || !off) {
            ss->oom = 1;
            return -1;
        }
        ss->ncp_cap = nc;
    }
    size_t i = 0, k = 0;
    while (i < n) {
        uint32_t c;
        size_t len = unicode_decode((const unsigned char *)s + i, n - i, &c);
        ss->cp[k] = c;
        ss->cls[k] = (uint8_t)unicode_class_of(c);
        ss->cpoff[k] = (uint32_t)i;
        k++;
        i += len;
    }
    ss->cpoff[k] = (uint32_t)n;
    *ncp = k;
    return 0;
}

static void bpe_encode_fragment(session *ss, const char *s, size_t n)
{
    if (n > UINT32_MAX / 4) {
        ss->oom = 1;
        return;
    }
    size_t ncp = 0, i = 0;
    if (session_decode_cps(ss, s, n, &ncp))
        return;
    while (i < ncp && !session_failed(ss)) {
        size_t len;
        if (ss->t->pre == PRE_GPT2)
            len = pre_match_gpt2(ss->cp, ss->cls, i, ncp);
        else if (ss->t->pre == PRE_DIGITS_GPT2)
            len = pre_match_digits_gpt2(ss->cp, ss->cls, i, ncp);
        else
            len = pre_match_llama3(ss->cp, ss->cls, i, ncp, ss->t->pre == PRE_LLAMA3 ? 3 : 1);
        uint32_t b0 = ss->cpoff[i], b1 = ss->cpoff[i + len];
        bpe_encode_word(ss, s + b0, b1 - b0);
        i += len;
    }
}

/* ==== Special-token partition ==== */

typedef struct {
    size_t off, len;
    int32_t tok;         /* >= 0: a special token; -1: raw text */
} frag;

typedef struct {
    frag *f;
    size_t n, cap;
    int oom;
} fragvec;

static void fragvec_push(fragvec *v, frag x)
{
    if (v->oom)
        return;
    if (v->n == v->cap) {
        size_t nc = v->cap ? v->cap * 2 : 16;
        frag *nf = realloc(v->f, nc * sizeof *nf);
        if (!nf) {
            v->oom = 1;
            return;
        }
        v->f = nf;
        v->cap = nc;
    }
    v->f[v->n++] = x;
}

/* Split every raw fragment of *cur at each occurrence of special token id. */
static void tok_split_special(const tokenizer *t, const char *text, int32_t id, fragvec *cur, fragvec *tmp)
{
    const char *pat = t->tok_arena + t->tok_off[id];
    size_t plen = t->tok_len[id];
    tmp->n = 0;
    for (size_t k = 0; k < cur->n; k++) {
        frag fr = cur->f[k];
        if (fr.tok >= 0) {
            fragvec_push(tmp, fr);
            continue;
        }
        size_t pos = fr.off, end = fr.off + fr.len;
        while (pos < end) {
            const char *hit = memmem(text + pos, end - pos, pat, plen);
            if (!hit)
                break;
            size_t at = (size_t)(hit - text);
            if (at > pos)
                fragvec_push(tmp, (frag){ pos, at - pos, -1 });
            fragvec_push(tmp, (frag){ at, plen, id });
            pos = at + plen;
        }
        if (pos < end)
            fragvec_push(tmp, (frag){ pos, end - pos, -1 });
    }
    fragvec sw = *cur;
    *cur = *tmp;
    *tmp = sw;
}

static int tok_partition(const tokenizer *t, const char *text, size_t len, int parse_special, fragvec *out)
{
    fragvec tmp = { 0 };
    out->n = 0;
    if (len)
        fragvec_push(out, (frag){ 0, len, -1 });
    for (int32_t k = 0; k < t->n_specials && len; k++) {
        int32_t id = t->specials[k];
        int ty = t->type[id];
        if (!parse_special && (ty == TOK_CONTROL || ty == TOK_UNKNOWN))
            continue;
        size_t plen = t->tok_len[id];
        if (plen == 0 || plen > len || !memmem(text, len, t->tok_arena + t->tok_off[id], plen))
            continue;
        tok_split_special(t, text, id, out, &tmp);
    }
    free(tmp.f);
    return (out->oom || tmp.oom) ? -1 : 0;
}

/* ==== Encode ==== */

static void session_free(session *ss)
{
    free(ss->out.v);
    free(ss->sym.s);
    free(ss->heap.h);
    strbuf_free(&ss->text);
    strbuf_free(&ss->key);
    free(ss->cp);
    free(ss->cls);
    free(ss->cpoff);
}

static void tok_encode_fragments(session *ss, const char *text, const fragvec *fv)
{
    const tokenizer *t = ss->t;
    int prev_special = 1;     /* SPM: the first text fragment gets the space prefix */
    for (size_t k = 0; k < fv->n && !session_failed(ss); k++) {
        const frag *fr = &fv->f[k];
        if (fr->tok >= 0) {
            ivec_push(&ss->out, fr->tok);
            prev_special = 1;
        } else if (t->kind == KIND_SPM) {
            spm_encode_fragment(ss, text + fr->off, fr->len, t->add_space_prefix && prev_special);
            prev_special = 0;
        } else {
            bpe_encode_fragment(ss, text + fr->off, fr->len);
        }
    }
}

int64_t tokenizer_encode(const tokenizer *t, const char *text, size_t len,
                         int add_special, int parse_special, int32_t *ids, int64_t cap)
{
    if (!t || (!text && len) || cap < 0 || (!ids && cap > 0))
        return -1;
    session ss = { 0 };
    ss.t = t;
    fragvec fv = { 0 };
    if (tok_partition(t, text, len, parse_special, &fv)) {
        free(fv.f);
        return -1;
    }
    if (add_special && t->add_bos)
        ivec_push(&ss.out, t->bos);
    tok_encode_fragments(&ss, text, &fv);
    if (add_special && t->add_eos)
        ivec_push(&ss.out, t->eos);
    free(fv.f);
    int64_t n = -1;
    if (!session_failed(&ss)) {
        n = (int64_t)ss.out.n;
        int64_t m = n < cap ? n : cap;
        if (m > 0)
            memcpy(ids, ss.out.v, (size_t)m * sizeof *ids);
    }
    session_free(&ss);
    return n;
}

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
