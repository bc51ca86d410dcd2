/* logsafe.c - escaping of network-derived text for log lines (logsafe.h). */
#include "base/logsafe.h"

#include <stdio.h>
#include <string.h>

#include "base/unicode.h"

/* A valid UTF-8 sequence at s: its length and code point, or 0. */
static size_t ls_utf8(const unsigned char *s, size_t n, unsigned *cp_out) {
    uint32_t cp = 0;
    size_t len = unicode_strict_seq(s, n, &cp);
    *cp_out = cp;
    return len;
}

/* Code points that move the cursor, start terminal sequences or reorder
 * the text a reader sees, although they are valid UTF-8. */
static int ls_hidden(unsigned cp) {
    return (cp >= 0x80 && cp <= 0x9F) || cp == 0x2028 || cp == 0x2029 ||
           (cp >= 0x202A && cp <= 0x202E) || (cp >= 0x2066 && cp <= 0x2069);
}

size_t logsafe_escape(char *dst, size_t dstlen, const char *src, size_t n) {
    size_t o = 0;
    if (!dstlen) return 0;
    const unsigned char *s = (const unsigned char *)(src ? src : "");
    if (!src) n = 0;
    for (size_t i = 0; i < n;) {
        char esc[16];
        const char *out = esc;
        size_t ol, adv = 1;
        unsigned cp = 0;
        unsigned c = s[i];
        if (c == '\n') out = "\\n";
        else if (c == '\r') out = "\\r";
        else if (c == '\t') out = "\\t";
        else if (c == '\\') out = "\\\\";
        else if (c < 0x20 || c == 0x7F) snprintf(esc, sizeof esc, "\\x%02x", c);
        else if (c < 0x80) { esc[0] = (char)c; esc[1] = 0; }
        else if (!(adv = ls_utf8(s + i, n - i, &cp))) { adv = 1; snprintf(esc, sizeof esc, "\\x%02x", c); }
        else if (ls_hidden(cp)) snprintf(esc, sizeof esc, "\\u{%04x}", cp);
        else out = (const char *)s + i;
        ol = out == (const char *)s + i ? adv : strlen(out);
        if (o + ol + 1 > dstlen) break;   /* whole escapes only */
        memcpy(dst + o, out, ol);
        o += ol;
        i += adv;
    }
    dst[o] = 0;
    return o;
}
