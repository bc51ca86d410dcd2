/* logsafe.c - escaping of network-derived text for log lines (logsafe.h). */
#include "logsafe.h"

#include <stdio.h>
#include <string.h>

/* Length of a valid UTF-8 sequence at s (n bytes left) and its code point,
 * or 0 when the bytes are not valid UTF-8 (overlongs and surrogates too). */
static size_t ls_utf8(const unsigned char *s, size_t n, unsigned *cp_out) {
    unsigned c = s[0], cp;
    size_t len;
    if (c < 0x80) { *cp_out = c; return 1; }
    if (c >= 0xC2 && c <= 0xDF) { len = 2; cp = c & 0x1F; }
    else if (c >= 0xE0 && c <= 0xEF) { len = 3; cp = c & 0x0F; }
    else if (c >= 0xF0 && c <= 0xF4) { len = 4; cp = c & 0x07; }
    else return 0;
    if (n < len) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if ((len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
        return 0;
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
