/* grammar_match.c - the runtime of grammar.c's grammars (grammar.c's opening
 * comment describes the design): the string lexer, sets of stacks, states
 * fed bytes and tokens, the vocabulary trie and the token masks. */
#include "engine/grammar_internal.h"


#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* ==== String lexer ==== */

/* States of E_STR (the sub-state of its stack entry). */
enum {
    S_NORM, S_ESC, S_U1, S_UD, S_U0, S_U00, S_U000, S_H3, S_H2, S_H1,
    S_HS2, S_HS1, S_LBS, S_LU, S_LD, S_LC,
    S_C1, S_C2, S_C3, S_E0, S_ED, S_F0, S_F4,
    S_COUNT
};
#define S_DEAD 0xff
#define S_CLOSE 0xfe

static uint8_t str_tab[S_COUNT][256];
static pthread_once_t str_once = PTHREAD_ONCE_INIT;

static int is_hex(int c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

static uint8_t str_step_slow(int q, int c)
{
    switch (q) {
    case S_NORM:
        if (c == '"') return S_CLOSE;
        if (c == '\\') return S_ESC;
        if (c < 0x20) return S_DEAD;
        if (c < 0x80) return S_NORM;
        if (c >= 0xc2 && c <= 0xdf) return S_C1;
        if (c == 0xe0) return S_E0;
        if (c == 0xed) return S_ED;
        if (c >= 0xe1 && c <= 0xef) return S_C2;
        if (c == 0xf0) return S_F0;
        if (c >= 0xf1 && c <= 0xf3) return S_C3;
        if (c == 0xf4) return S_F4;
        return S_DEAD;
    case S_ESC:
        if (c && strchr("\"\\/bfnrt", c)) return S_NORM;
        return c == 'u' ? S_U1 : S_DEAD;
    case S_U1:   /* first hex digit of \uXXXX */
        if (c == 'd' || c == 'D') return S_UD;
        if (c == '0') return S_U0;
        return is_hex(c) ? S_H3 : S_DEAD;
    case S_UD:   /* \uD?: 0-7 plain, 8-B high surrogate, C-F lone low surrogate */
        if (c >= '0' && c <= '7') return S_H2;
        if (c == '8' || c == '9' || (c >= 'a' && c <= 'b') || (c >= 'A' && c <= 'B')) return S_HS2;
        return S_DEAD;
    case S_U0: return c == '0' ? S_U00 : is_hex(c) ? S_H2 : S_DEAD;
    case S_U00: return c == '0' ? S_U000 : is_hex(c) ? S_H1 : S_DEAD;
    case S_U000: return c == '0' ? S_DEAD : is_hex(c) ? S_NORM : S_DEAD;   /* no \u0000 */
    case S_H3: return is_hex(c) ? S_H2 : S_DEAD;
    case S_H2: return is_hex(c) ? S_H1 : S_DEAD;
    case S_H1: return is_hex(c) ? S_NORM : S_DEAD;
    case S_HS2: return is_hex(c) ? S_HS1 : S_DEAD;
    case S_HS1: return is_hex(c) ? S_LBS : S_DEAD;
    case S_LBS: return c == '\\' ? S_LU : S_DEAD;
    case S_LU: return c == 'u' ? S_LD : S_DEAD;
    case S_LD: return c == 'd' || c == 'D' ? S_LC : S_DEAD;
    case S_LC: return (c >= 'c' && c <= 'f') || (c >= 'C' && c <= 'F') ? S_H2 : S_DEAD;
    case S_C1: return c >= 0x80 && c <= 0xbf ? S_NORM : S_DEAD;
    case S_C2: return c >= 0x80 && c <= 0xbf ? S_C1 : S_DEAD;
    case S_C3: return c >= 0x80 && c <= 0xbf ? S_C2 : S_DEAD;
    case S_E0: return c >= 0xa0 && c <= 0xbf ? S_C1 : S_DEAD;   /* no overlong */
    case S_ED: return c >= 0x80 && c <= 0x9f ? S_C1 : S_DEAD;   /* no surrogates */
    case S_F0: return c >= 0x90 && c <= 0xbf ? S_C2 : S_DEAD;
    case S_F4: return c >= 0x80 && c <= 0x8f ? S_C2 : S_DEAD;   /* <= U+10FFFF */
    }
    return S_DEAD;
}

static void str_tab_init(void)
{
    for (int q = 0; q < S_COUNT; q++)
        for (int c = 0; c < 256; c++)
            str_tab[q][c] = str_step_slow(q, c);
}


void grammar_lexer_init(void)
{
    pthread_once(&str_once, str_tab_init);
}

/* ==== Stack sets ==== */

typedef struct {
    uint32_t *d;        /* per stack: len, then entries bottom..top */
    uint32_t n, cap;    /* words used in d */
    uint32_t *off;      /* where each stack starts in d */
    uint32_t *h;        /* hash of each stack (merging duplicates) */
    uint32_t ns, cap_s;
    int overflow;
} sset;

typedef struct {
    uint32_t *d;
    uint32_t n, cap;
} u32buf;

static void sset_free(sset *s)
{
    free(s->d);
    free(s->off);
    free(s->h);
    memset(s, 0, sizeof *s);
}

static inline void sset_clear(sset *s)
{
    s->n = s->ns = 0;
    s->overflow = 0;
}

static inline uint32_t stack_hash(const uint32_t *st, uint32_t len)
{
    uint32_t h = 2166136261u ^ len;
    for (uint32_t i = 0; i < len; i++) h = (h ^ st[i]) * 16777619u;
    return h;
}

/* Add a stack unless present. -1 on overflow or allocation failure. */
static int sset_add(sset *s, const uint32_t *st, uint32_t len)
{
    uint32_t h = stack_hash(st, len);
    for (uint32_t i = 0; i < s->ns; i++)
        if (s->h[i] == h && s->d[s->off[i]] == len && !memcmp(s->d + s->off[i] + 1, st, len * sizeof *st)) return 0;
    if (s->ns >= G_MAX_STACKS) {
        s->overflow = 1;
        return -1;
    }
    if (grow((void **)&s->d, &s->cap, s->n + len + 1, sizeof *s->d)) {
        s->overflow = 1;
        return -1;
    }
    if (s->ns == s->cap_s) {   /* off and h share one capacity */
        uint32_t nc = s->cap_s ? s->cap_s * 2 : 16;
        uint32_t *off = realloc(s->off, nc * sizeof *off);
        if (off) s->off = off;
        uint32_t *h = off ? realloc(s->h, nc * sizeof *h) : NULL;
        if (!h) {
            s->overflow = 1;
            return -1;
        }
        s->h = h;
        s->cap_s = nc;
    }
    s->off[s->ns] = s->n;
    s->h[s->ns++] = h;
    s->d[s->n++] = len;
    memcpy(s->d + s->n, st, len * sizeof *st);
    s->n += len;
    return 0;
}

static int sset_copy(sset *dst, const sset *src)
{
    sset_clear(dst);
    for (uint32_t i = 0; i < src->ns; i++)
        if (sset_add(dst, src->d + src->off[i] + 1, src->d[src->off[i]])) return -1;
    return 0;
}

/* Expand a stack until every resulting stack has a terminal on top (or is
 * empty) and add them to out. work: scratch for pending alternatives. */
static int expand(const grammar *g, sset *out, u32buf *work, const uint32_t *st, uint32_t len)
{
    uint32_t cur[G_MAX_DEPTH];
    uint32_t base = work->n, steps = 0;
    if (len > G_MAX_DEPTH) return 0;
    if (grow((void **)&work->d, &work->cap, work->n + len + 1, sizeof *work->d)) return -1;
    memcpy(work->d + work->n, st, len * sizeof *st);
    work->n += len;
    work->d[work->n++] = len;
    while (work->n > base) {
        len = work->d[--work->n];
        work->n -= len;
        memcpy(cur, work->d + work->n, len * sizeof *cur);
        for (;;) {
            if (++steps > G_MAX_EXPAND) {
                work->n = base;
                return -1;
            }
            if (len == 0) {
                sset_add(out, cur, 0);
                break;
            }
            uint32_t pos = cur[len - 1] & POS_MASK, sub = cur[len - 1] >> SUB_SHIFT;
            const gelem *e = &g->el[pos];
            if (e->type == E_END) {
                len--;   /* the entry below is the return position */
                continue;
            }
            if (e->type == E_SET || e->type == E_STR) {
                sset_add(out, cur, len);
                break;
            }
            if (e->type == E_REP) {
                if (sub < e->max) sset_add(out, cur, len);
                if (sub < e->min) break;
                cur[len - 1] = pos + 1;
                continue;
            }
            /* E_REF: the return position replaces the top (dropped in tail
             * position), then each alternative is entered */
            const grule *r = &g->rule[e->arg];
            if (g->el[pos + 1].type == E_END) len--;
            else cur[len - 1] = pos + 1;
            if (len + 1 > G_MAX_DEPTH || r->n == 0) break;   /* too deep: this path dies */
            if (grow((void **)&work->d, &work->cap, work->n + (r->n - 1) * (len + 2), sizeof *work->d)) {
                work->n = base;
                return -1;
            }
            for (uint32_t a = 1; a < r->n; a++) {
                memcpy(work->d + work->n, cur, len * sizeof *cur);
                work->n += len;
                work->d[work->n++] = g->alt[r->first + a];
                work->d[work->n++] = len + 1;
            }
            cur[len++] = g->alt[r->first];
        }
    }
    return out->overflow ? -1 : 0;
}

/* out = the stacks of in advanced by byte ch. -1 if none survives. */
static int sset_advance(const grammar *g, const sset *in, uint8_t ch, sset *out, u32buf *work)
{
    uint32_t cur[G_MAX_DEPTH];
    sset_clear(out);
    for (uint32_t i = 0; i < in->ns; i++) {
        const uint32_t *st = in->d + in->off[i] + 1;
        uint32_t len = in->d[in->off[i]];
        if (!len) continue;
        uint32_t pos = st[len - 1] & POS_MASK, sub = st[len - 1] >> SUB_SHIFT;
        const gelem *e = &g->el[pos];
        uint32_t top;
        int direct = 0;
        if (e->type == E_STR) {
            uint8_t ns = str_tab[sub][ch];
            if (ns == S_DEAD) continue;
            if (ns == S_CLOSE) {
                top = pos + 1;
            } else {
                top = pos | (uint32_t)ns << SUB_SHIFT;
                direct = 1;   /* still inside the string: already a terminal */
            }
        } else if (!(g->set[e->arg][ch >> 6] >> (ch & 63) & 1)) {
            continue;
        } else if (e->type == E_SET) {
            top = pos + 1;
        } else {   /* E_REP, sub < max holds for every stored stack */
            top = pos | (sub + 1) << SUB_SHIFT;
        }
        memcpy(cur, st, (len - 1) * sizeof *cur);
        cur[len - 1] = top;
        if (direct) sset_add(out, cur, len);
        else expand(g, out, work, cur, len);
        if (out->overflow) return -1;
    }
    return out->ns ? 0 : -1;
}

/* ==== States ==== */

typedef struct {
    uint32_t n_node;
    uint32_t max_depth;
    struct tnode *node;
    int32_t *tok;
    uint32_t n_tok;
    int32_t *root_tok;   /* tokens with an empty byte string (closing tries) */
    uint32_t n_root;
} trie;

typedef struct {
    sset a, b;           /* accept_bytes ping-pong */
    sset rest, close;    /* mask: non-string stacks, the state after a closing quote */
    sset *lv;            /* trie walk: the set at each depth */
    uint32_t n_lv;
    u32buf work;
    uint64_t *bits;
    uint32_t n_words;
} gscratch;

struct grammar_state {
    const grammar *g;
    sset cur;
    gscratch *sc;
};

static gscratch *state_scratch(grammar_state *s)
{
    if (!s->sc) s->sc = calloc(1, sizeof *s->sc);
    return s->sc;
}

grammar_state *grammar_state_new(const grammar *g)
{
    grammar_state *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->g = g;
    u32buf work = { 0 };
    uint32_t st = g->start;
    if (expand(g, &s->cur, &work, &st, 1) || !s->cur.ns) {
        free(work.d);
        grammar_state_free(s);
        return NULL;
    }
    free(work.d);
    return s;
}

grammar_state *grammar_state_clone(const grammar_state *s)
{
    grammar_state *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->g = s->g;
    if (sset_copy(&c->cur, &s->cur)) {
        grammar_state_free(c);
        return NULL;
    }
    return c;
}

static void scratch_free(gscratch *sc)
{
    if (!sc) return;
    sset_free(&sc->a);
    sset_free(&sc->b);
    sset_free(&sc->rest);
    sset_free(&sc->close);
    for (uint32_t i = 0; i < sc->n_lv; i++) sset_free(&sc->lv[i]);
    free(sc->lv);
    free(sc->work.d);
    free(sc->bits);
    free(sc);
}

void grammar_state_free(grammar_state *s)
{
    if (!s) return;
    sset_free(&s->cur);
    scratch_free(s->sc);
    free(s);
}

int grammar_accept_bytes(grammar_state *s, const char *bytes, size_t n)
{
    if (!n) return 0;
    gscratch *sc = state_scratch(s);
    if (!sc) return -1;
    const sset *in = &s->cur;
    sset *out = &sc->a, *spare = &sc->b;
    for (size_t i = 0; i < n; i++) {
        if (sset_advance(s->g, in, (uint8_t)bytes[i], out, &sc->work)) return -1;
        in = out;
        sset *t = out;
        out = spare;
        spare = t;
    }
    /* in is the result (one of sc->a/b): swap it into cur */
    sset *res = (sset *)in, tmp = s->cur;
    s->cur = *res;
    *res = tmp;
    return 0;
}

int grammar_is_complete(const grammar_state *s)
{
    for (uint32_t i = 0; i < s->cur.ns; i++)
        if (s->cur.d[s->cur.off[i]] == 0) return 1;
    return 0;
}

int grammar_is_finished(const grammar_state *s)
{
    return s->cur.ns == 1 && s->cur.d[s->cur.off[0]] == 0;
}

uint64_t grammar_state_hash(const grammar_state *s)
{
    uint64_t h = s->cur.ns;
    for (uint32_t i = 0; i < s->cur.ns; i++) {
        uint64_t x = s->cur.h[i] * 0x9e3779b97f4a7c15ull;
        h += x ^ (x >> 29);   /* sum: independent of the order of stacks */
    }
    return h;
}

int grammar_state_equal(const grammar_state *a, const grammar_state *b)
{
    if (a->g != b->g || a->cur.ns != b->cur.ns) return 0;
    for (uint32_t i = 0; i < a->cur.ns; i++) {
        const uint32_t *x = a->cur.d + a->cur.off[i];
        uint32_t j = 0;
        for (; j < b->cur.ns; j++) {
            const uint32_t *y = b->cur.d + b->cur.off[j];
            if (x[0] == y[0] && !memcmp(x + 1, y + 1, x[0] * sizeof *x)) break;
        }
        if (j == b->cur.ns) return 0;
    }
    return 1;
}

/* ==== Vocabulary ==== */

/* Trie nodes in preorder; a node's subtree ends at index end. */
struct tnode {
    uint32_t end;
    uint32_t tok_first, tok_n;
    uint16_t depth;   /* bytes from the root to this node inclusive */
    uint8_t byte;
};

enum { TK_NONE = 0, TK_TEXT = 1, TK_EOG = 2 };

struct grammar_vocab {
    int32_t n_vocab;
    uint8_t *kind;
    uint32_t *off;     /* token bytes: bytes[off[i] .. off[i+1]) */
    char *bytes;
    int32_t *eog;
    uint32_t n_eog;
    uint32_t n_words;  /* bitset words */
    trie all;
    uint64_t *stay[S_COUNT];   /* tokens that stay inside a string from each lexer state */
    trie close[S_COUNT];       /* tails after the closing quote, per lexer state */
};

typedef struct {
    const char *p;
    uint32_t len;
    int32_t id;
} titem;

static int titem_cmp(const void *a, const void *b)
{
    const titem *x = a, *y = b;
    uint32_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->p, y->p, n);
    if (c) return c;
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

typedef struct {
    trie *t;
    uint32_t cap_node, cap_tok;
    int failed;
} tbuild;

/* Items [lo, hi) share their first depth bytes; those of exactly depth bytes
 * belong to the parent node (skipped here). */
static void trie_build_range(tbuild *b, titem *it, uint32_t lo, uint32_t hi, uint32_t depth)
{
    trie *t = b->t;
    uint32_t i = lo;
    while (i < hi && it[i].len == depth) i++;
    while (i < hi && !b->failed) {
        uint8_t byte = (uint8_t)it[i].p[depth];
        uint32_t j = i;
        while (j < hi && (uint8_t)it[j].p[depth] == byte) j++;
        if (grow((void **)&t->node, &b->cap_node, t->n_node + 1, sizeof *t->node)) {
            b->failed = 1;
            return;
        }
        uint32_t me = t->n_node++;
        uint32_t k = i;
        uint32_t first = t->n_tok;
        while (k < j && it[k].len == depth + 1) {
            if (grow((void **)&t->tok, &b->cap_tok, t->n_tok + 1, sizeof *t->tok)) {
                b->failed = 1;
                return;
            }
            t->tok[t->n_tok++] = it[k++].id;
        }
        if (depth + 1 > t->max_depth) t->max_depth = depth + 1;
        t->node[me] = (struct tnode){ 0, first, t->n_tok - first, (uint16_t)(depth + 1), byte };
        trie_build_range(b, it, i, j, depth + 1);
        t->node[me].end = t->n_node;
        i = j;
    }
}

static int trie_build(trie *t, titem *it, uint32_t n)
{
    memset(t, 0, sizeof *t);
    qsort(it, n, sizeof *it, titem_cmp);
    uint32_t r = 0;
    while (r < n && it[r].len == 0) r++;
    if (r) {
        t->root_tok = malloc(r * sizeof *t->root_tok);
        if (!t->root_tok) return -1;
        for (uint32_t i = 0; i < r; i++) t->root_tok[i] = it[i].id;
        t->n_root = r;
    }
    tbuild b = { t, 0, 0, 0 };
    trie_build_range(&b, it, 0, n, 0);
    return b.failed ? -1 : 0;
}

static void trie_free(trie *t)
{
    free(t->node);
    free(t->tok);
    free(t->root_tok);
}

/* Token bytes longer than this are not allowed under a grammar (no real
 * vocabulary has them; the trie depth is a uint16). */
#define G_MAX_TOKEN_BYTES 1024

static int vocab_string_tables(grammar_vocab *v)
{
    titem *it = malloc((size_t)v->n_vocab * sizeof *it);
    if (!it) return -1;
    for (int q = 0; q < S_COUNT; q++) {
        v->stay[q] = calloc(v->n_words, sizeof(uint64_t));
        if (!v->stay[q]) goto fail;
        uint32_t n = 0;
        for (int32_t id = 0; id < v->n_vocab; id++) {
            if (v->kind[id] != TK_TEXT) continue;
            const uint8_t *p = (const uint8_t *)v->bytes + v->off[id];
            uint32_t len = v->off[id + 1] - v->off[id], k = 0;
            uint8_t st = (uint8_t)q;
            for (; k < len; k++) {
                st = str_tab[st][p[k]];
                if (st >= S_CLOSE) break;
            }
            if (k == len) v->stay[q][id >> 6] |= 1ull << (id & 63);
            else if (st == S_CLOSE) it[n++] = (titem){ (const char *)p + k + 1, len - k - 1, id };
        }
        if (trie_build(&v->close[q], it, n)) goto fail;
    }
    free(it);
    return 0;
fail:
    free(it);
    return -1;
}

grammar_vocab *grammar_vocab_new(const tokenizer *t, char *err, size_t errlen)
{
    pthread_once(&str_once, str_tab_init);
    grammar_vocab *v = calloc(1, sizeof *v);
    int32_t n = tokenizer_n_vocab(t);
    size_t cap = tokenizer_max_token_bytes(t) + 1;
    char *buf = malloc(cap);
    titem *it = malloc((size_t)(n > 0 ? n : 1) * sizeof *it);
    if (!v || !buf || !it || n <= 0) goto oom;
    v->n_vocab = n;
    v->n_words = (uint32_t)((n + 63) / 64);
    v->kind = calloc((size_t)n, 1);
    v->off = calloc((size_t)n + 1, sizeof *v->off);
    v->eog = malloc((size_t)n * sizeof *v->eog);
    if (!v->kind || !v->off || !v->eog) goto oom;
    size_t total = 0, cap_bytes = 0;
    for (int32_t id = 0; id < n; id++) {
        int type = tokenizer_token_type(t, id);
        int len = 0;
        v->off[id] = (uint32_t)total;
        if (tokenizer_is_eog(t, id)) {
            v->kind[id] = TK_EOG;
            v->eog[v->n_eog++] = id;
        } else if (type == TOK_NORMAL || type == TOK_USER_DEFINED || type == TOK_BYTE) {
            len = tokenizer_token_bytes(t, id, 0, buf, cap);
            if (len > 0 && len <= G_MAX_TOKEN_BYTES) v->kind[id] = TK_TEXT;
            else len = 0;
        }
        if (total + (size_t)len > cap_bytes) {
            cap_bytes = (total + (size_t)len) * 2 + 4096;
            char *nb = realloc(v->bytes, cap_bytes);
            if (!nb) goto oom;
            v->bytes = nb;
        }
        if (len) memcpy(v->bytes + total, buf, (size_t)len);
        total += (size_t)len;
        if (total > UINT32_MAX / 2) goto oom;
    }
    v->off[n] = (uint32_t)total;
    uint32_t m = 0;
    for (int32_t id = 0; id < n; id++)
        if (v->kind[id] == TK_TEXT) it[m++] = (titem){ v->bytes + v->off[id], v->off[id + 1] - v->off[id], id };
    if (trie_build(&v->all, it, m) || vocab_string_tables(v)) goto oom;
    free(buf);
    free(it);
    return v;
oom:
    snprintf(err, errlen, n <= 0 ? "empty vocabulary" : "out of memory building the grammar vocabulary");
    free(buf);
    free(it);
    grammar_vocab_free(v);
    return NULL;
}

void grammar_vocab_free(grammar_vocab *v)
{
    if (!v) return;
    free(v->kind);
    free(v->off);
    free(v->bytes);
    free(v->eog);
    trie_free(&v->all);
    for (int q = 0; q < S_COUNT; q++) {
        free(v->stay[q]);
        trie_free(&v->close[q]);
    }
    free(v);
}

int32_t grammar_vocab_n(const grammar_vocab *v) { return v->n_vocab; }

int grammar_accept_token(grammar_state *s, const grammar_vocab *v, int32_t id)
{
    if (id < 0 || id >= v->n_vocab) return -1;
    if (v->kind[id] == TK_EOG) return grammar_is_complete(s) ? 0 : -1;
    if (v->kind[id] != TK_TEXT) return -1;
    return grammar_accept_bytes(s, v->bytes + v->off[id], v->off[id + 1] - v->off[id]);
}

/* ==== Masks ==== */

/* Depth-first walk of trie t from the stacks in start, setting the bit of
 * every token whose bytes keep some stack alive. */
static int trie_walk(const grammar *g, const trie *t, const sset *start, gscratch *sc, uint64_t *bits)
{
    if (!start->ns) return 0;
    for (uint32_t i = 0; i < t->n_root; i++) bits[t->root_tok[i] >> 6] |= 1ull << (t->root_tok[i] & 63);
    if (t->max_depth + 1 > sc->n_lv) {
        sset *lv = realloc(sc->lv, (t->max_depth + 1) * sizeof *lv);
        if (!lv) return -1;
        memset(lv + sc->n_lv, 0, (t->max_depth + 1 - sc->n_lv) * sizeof *lv);
        sc->lv = lv;
        sc->n_lv = t->max_depth + 1;
    }
    for (uint32_t i = 0; i < t->n_node;) {
        const struct tnode *nd = &t->node[i];
        const sset *parent = nd->depth == 1 ? start : &sc->lv[nd->depth - 1];
        if (sset_advance(g, parent, nd->byte, &sc->lv[nd->depth], &sc->work)) {
            i = nd->end;   /* dead: skip the subtree */
            continue;
        }
        for (uint32_t k = 0; k < nd->tok_n; k++) {
            int32_t id = t->tok[nd->tok_first + k];
            bits[id >> 6] |= 1ull << (id & 63);
        }
        i++;
    }
    return 0;
}

/* The allowed tokens as a bitset in sc->bits. */
static int mask_bits(grammar_state *s, const grammar_vocab *v)
{
    gscratch *sc = state_scratch(s);
    if (!sc) return -1;
    if (sc->n_words < v->n_words) {
        free(sc->bits);
        sc->bits = malloc(v->n_words * sizeof *sc->bits);
        if (!sc->bits) {
            sc->n_words = 0;
            return -1;
        }
        sc->n_words = v->n_words;
    }
    uint64_t *bits = sc->bits;
    memset(bits, 0, v->n_words * sizeof *bits);
    const grammar *g = s->g;
    const sset *cur = &s->cur;
    uint32_t stk[G_MAX_DEPTH];
    sset_clear(&sc->rest);
    for (uint32_t i = 0; i < cur->ns; i++) {
        const uint32_t *st = cur->d + cur->off[i] + 1;
        uint32_t len = cur->d[cur->off[i]];
        if (!len) continue;
        uint32_t pos = st[len - 1] & POS_MASK, q = st[len - 1] >> SUB_SHIFT;
        if (g->el[pos].type != E_STR) {
            sset_add(&sc->rest, st, len);
            continue;
        }
        /* inside a string: the precomputed tokens that stay in it, then the
         * tails of the tokens that close it, from the state after the quote */
        const uint64_t *stay = v->stay[q];
        for (uint32_t w = 0; w < v->n_words; w++) bits[w] |= stay[w];
        memcpy(stk, st, len * sizeof *stk);
        stk[len - 1] = pos + 1;
        sset_clear(&sc->close);
        expand(g, &sc->close, &sc->work, stk, len);
        if (trie_walk(g, &v->close[q], &sc->close, sc, bits)) return -1;
    }
    if (trie_walk(g, &v->all, &sc->rest, sc, bits)) return -1;
    if (grammar_is_complete(s))
        for (uint32_t i = 0; i < v->n_eog; i++) bits[v->eog[i] >> 6] |= 1ull << (v->eog[i] & 63);
    return 0;
}

int64_t grammar_mask(grammar_state *s, const grammar_vocab *v, uint8_t *allowed)
{
    if (mask_bits(s, v)) {
        memset(allowed, 0, (size_t)v->n_vocab);
        return 0;
    }
    const uint64_t *bits = s->sc->bits;
    int64_t count = 0;
    for (int32_t i = 0; i < v->n_vocab; i++) {
        allowed[i] = (uint8_t)(bits[i >> 6] >> (i & 63) & 1);
        count += allowed[i];
    }
    return count;
}

int64_t grammar_mask_logits(grammar_state *s, const grammar_vocab *v, float *logits)
{
    if (mask_bits(s, v)) {
        for (int32_t i = 0; i < v->n_vocab; i++) logits[i] = -INFINITY;
        return 0;
    }
    const uint64_t *bits = s->sc->bits;
    int64_t count = 0;
    for (uint32_t w = 0; w < v->n_words; w++) {
        uint64_t x = bits[w];
        int32_t base = (int32_t)w * 64, lim = v->n_vocab - base < 64 ? v->n_vocab - base : 64;
        if (x == ~0ull && lim == 64) {
            count += 64;
            continue;
        }
        for (int32_t b = 0; b < lim; b++) {
            if (x >> b & 1) count++;
            else logits[base + b] = -INFINITY;
        }
    }
    return count;
}
