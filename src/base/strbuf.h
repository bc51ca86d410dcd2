/* strbuf: a growable, always NUL-terminated string buffer.
 *
 * A zero-initialized strbuf is empty and ready to use. Appends never fail
 * loudly: the first allocation failure (or a size that would overflow
 * size_t) sets the sticky oom flag, and every later append is a no-op, so a
 * caller builds the whole text and checks b.oom once at the end. */
#ifndef TANDEM_STRBUF_H
#define TANDEM_STRBUF_H

#include <stddef.h>

typedef struct strbuf {
    char *p;     /* NULL until the first append; then NUL-terminated */
    size_t len;  /* bytes in p, not counting the NUL */
    size_t cap;  /* bytes allocated at p */
    int oom;     /* sticky: an append failed, the content is incomplete */
} strbuf;

/* Appends n bytes of s (which may contain NULs). 0 or -1 (oom). */
int strbuf_put(strbuf *b, const void *s, size_t n);
/* Appends the C string s. 0 or -1 (oom). */
int strbuf_puts(strbuf *b, const char *s);
/* Appends one byte. 0 or -1 (oom). */
int strbuf_putc(strbuf *b, char c);
/* Appends printf-formatted text, whatever its length. 0 or -1 (oom or a
 * format error, which also sets oom). */
int strbuf_printf(strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Hands the string to the caller (free() it) and leaves b empty. NULL when
 * b is oom (the partial text is freed); "" for a buffer never appended to.
 * len, if not NULL, receives the string's length. */
char *strbuf_take(strbuf *b, size_t *len);
/* Empties b (and clears oom) but keeps its storage for reuse. */
void strbuf_reset(strbuf *b);
/* Frees the storage and leaves b empty (oom cleared). */
void strbuf_free(strbuf *b);

#endif
