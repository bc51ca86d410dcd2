/* logsafe.h - one escaping rule for everything a server logs.
 *
 * Log lines carry text that came from the network (addresses a request
 * named, model names a node registered, error strings another node sent).
 * Written raw, a newline forges a second log line and an ESC sequence
 * rewrites the operator's terminal. logsafe_escape makes any byte string a
 * single, inert line:
 *   \n \r \t      -> \n \r \t (two characters)
 *   backslash     -> \\        (so an escape in the output is unambiguous)
 *   other C0, DEL -> \xNN      (ESC 0x1b included)
 *   invalid UTF-8 -> \xNN per byte
 *   C1 controls (U+0080..U+009F), U+2028/U+2029 (line/paragraph separator)
 *   and the bidi controls U+202A..U+202E, U+2066..U+2069 -> \u{XXXX}
 *   all other valid UTF-8 is kept.
 * The output is always NUL-terminated and truncated at a whole escape. */
#ifndef TANDEM_LOGSAFE_H
#define TANDEM_LOGSAFE_H

#include <stddef.h>

/* Escapes src[0..n) into dst (dstlen bytes, > 0). Returns strlen(dst). */
size_t logsafe_escape(char *dst, size_t dstlen, const char *src, size_t n);

#endif
