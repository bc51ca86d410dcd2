/* tokenizer_encode.c - text to token ids (tokenizer_encode), following
 * llama.cpp (tokenizer.c's top comment has the rules): special tokens cut
 * out first, then each text fragment is SPM-merged by score, or split into
 * words by a BPE pre-tokenizer and merged by rank. The merge heap and the
 * symbol list are shared by both; a session holds one call's scratch state.
 */
#include "engine/tokenizer_internal.h"
#include "base/strbuf.h"
#include "base/unicode.h"

#include <stdlib.h>
#include <string.h>

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
