/* strbuf: growable string buffer shared by the modules that render text
 * (metrics exposition, chat templates, grade reports). See strbuf.h. */
#include "base/strbuf.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== Growth ==== */

/* First allocation: big enough for a typical prompt or report line, small
 * enough that many short-lived buffers cost little. */
#define STRBUF_MIN_CAP 256

/* Makes room for n more bytes plus the NUL. Doubles the capacity so that
 * many small appends cost amortized O(1); refuses sizes that would overflow
 * size_t instead of wrapping around. */
static int strbuf_grow(strbuf *b, size_t n) {
    if (b->oom) return -1;
    if (n > SIZE_MAX - 1 - b->len) { b->oom = 1; return -1; }
    size_t need = b->len + n + 1;
    if (need <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : STRBUF_MIN_CAP;
    while (cap < need) cap = cap > SIZE_MAX / 2 ? need : cap * 2;
    char *p = realloc(b->p, cap);
    if (!p) { b->oom = 1; return -1; }
    b->p = p;
    b->cap = cap;
    return 0;
}

/* ==== Appending ==== */

int strbuf_put(strbuf *b, const void *s, size_t n) {
    if (strbuf_grow(b, n)) return -1;
    if (n) memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
    return 0;
}

int strbuf_puts(strbuf *b, const char *s) { return strbuf_put(b, s, strlen(s)); }

int strbuf_putc(strbuf *b, char c) { return strbuf_put(b, &c, 1); }

/* The first vsnprintf measures, the second writes straight into the buffer:
 * no temporary and no truncation. */
int strbuf_printf(strbuf *b, const char *fmt, ...) {
    if (b->oom) return -1;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) { b->oom = 1; return -1; }
    if (strbuf_grow(b, (size_t)n)) return -1;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
    return 0;
}

/* ==== Ownership ==== */

char *strbuf_take(strbuf *b, size_t *len) {
    if (!b->oom && !b->p) strbuf_put(b, "", 0);
    char *p = b->oom ? NULL : b->p;
    size_t n = b->len;
    if (!p) free(b->p);
    *b = (strbuf){0};
    if (p && len) *len = n;
    return p;
}

void strbuf_reset(strbuf *b) {
    b->len = 0;
    b->oom = 0;
    if (b->p) b->p[0] = 0;
}

void strbuf_free(strbuf *b) {
    free(b->p);
    *b = (strbuf){0};
}
