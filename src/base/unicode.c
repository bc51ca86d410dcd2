/* unicode.c - UTF-8 decoding and character classes for the tokenizers. */
#include "base/unicode.h"

#include <utf8proc.h>

/* ==== Decoding ==== */

size_t unicode_seq_len(unsigned char lead)
{
    /* High nibble 0x0-0xB: one byte (ASCII or a stray continuation byte),
     * 0xC-0xD: two, 0xE: three, 0xF: four. */
    static const unsigned char len_by_nibble[16] = { 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4 };
    return len_by_nibble[lead >> 4];
}

static int unicode_is_cont(unsigned char b) { return (b & 0xC0) == 0x80; }

size_t unicode_decode(const unsigned char *s, size_t n, uint32_t *cp)
{
    unsigned char b = s[0];
    size_t need;
    uint32_t v;
    if (b < 0x80) {
        *cp = b;
        return 1;
    }
    if ((b & 0x40) == 0) {             /* continuation byte where a lead was expected */
        *cp = UNICODE_REPLACEMENT;
        return 1;
    }
    if ((b & 0x20) == 0) {
        need = 2;
        v = b & 0x1F;
    } else if ((b & 0x10) == 0) {
        need = 3;
        v = b & 0x0F;
    } else if ((b & 0x08) == 0) {
        need = 4;
        v = b & 0x07;
    } else {                           /* 0xF8..0xFF never start a sequence */
        *cp = UNICODE_REPLACEMENT;
        return 1;
    }
    if (need > n) {
        *cp = UNICODE_REPLACEMENT;
        return 1;
    }
    for (size_t i = 1; i < need; i++) {
        if (!unicode_is_cont(s[i])) {
            *cp = UNICODE_REPLACEMENT;
            return 1;
        }
        v = (v << 6) | (s[i] & 0x3F);
    }
    *cp = v;
    return need;
}

int unicode_encode(uint32_t cp, char *out)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    if (cp <= 0x10FFFF) {
        out[0] = (char)(0xF0 | (cp >> 18));
        out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[3] = (char)(0x80 | (cp & 0x3F));
        return 4;
    }
    return 0;
}

/* ==== Classes ==== */

int unicode_is_space(uint32_t cp)
{
    /* The White_Space property of the Unicode Character Database. */
    if (cp <= 0x20)
        return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
    if (cp < 0x85)
        return 0;
    return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
           cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

int unicode_class_of(uint32_t cp)
{
    if (cp < 0x80) {   /* fast path for ASCII */
        if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z')
            return UCLASS_LETTER;
        if (cp >= '0' && cp <= '9')
            return UCLASS_NUMBER;
        return unicode_is_space(cp) ? UCLASS_SPACE : UCLASS_OTHER;
    }
    if (unicode_is_space(cp))
        return UCLASS_SPACE;
    if (cp > 0x10FFFF)
        return UCLASS_OTHER;
    switch (utf8proc_category((utf8proc_int32_t)cp)) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO:
        return UCLASS_LETTER;
    case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_NO:
        return UCLASS_NUMBER;
    default:
        return UCLASS_OTHER;
    }
}

/* ==== Stream helpers ==== */

size_t unicode_complete_prefix(const unsigned char *s, size_t n)
{
    /* Look back at most 3 bytes for the lead byte of a final sequence. */
    size_t back = 0;
    while (back < 3 && back < n && unicode_is_cont(s[n - 1 - back]))
        back++;
    if (back == n)
        return n;                      /* only continuation bytes: nothing to wait for */
    size_t lead_at = n - 1 - back;
    unsigned char lead = s[lead_at];
    if (lead < 0xC0 || lead >= 0xF8)
        return n;                      /* ASCII, stray continuation or invalid lead */
    size_t want = unicode_seq_len(lead);
    if (back + 1 < want)
        return lead_at;                /* incomplete: hold it back */
    return n;
}

size_t unicode_strict_seq(const unsigned char *s, size_t n, uint32_t *cp_out)
{
    unsigned char b = s[0];
    if (b < 0x80) {
        *cp_out = b;
        return 1;
    }
    size_t len;
    uint32_t min, cp;
    if (b >= 0xC2 && b <= 0xDF) { len = 2; min = 0x80; cp = b & 0x1F; }
    else if (b >= 0xE0 && b <= 0xEF) { len = 3; min = 0x800; cp = b & 0x0F; }
    else if (b >= 0xF0 && b <= 0xF4) { len = 4; min = 0x10000; cp = b & 0x07; }
    else return 0;
    if (n < len)
        return 0;
    for (size_t k = 1; k < len; k++) {
        if (!unicode_is_cont(s[k]))
            return 0;
        cp = (cp << 6) | (s[k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    *cp_out = cp;
    return len;
}

int unicode_valid_utf8(const unsigned char *s, size_t n)
{
    uint32_t cp;
    for (size_t i = 0, l; i < n; i += l)
        if (!(l = unicode_strict_seq(s + i, n - i, &cp)))
            return 0;
    return 1;
}
