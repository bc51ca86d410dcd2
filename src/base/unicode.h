/* unicode.h - the few Unicode facts the tokenizers need.
 *
 * Decoding is deliberately lenient in the way llama.cpp's is (a lead byte and
 * the right number of continuation bytes make a code point; overlong forms are
 * not rejected), because pre-tokenizer splits must agree with it. A byte that
 * does not start a well-formed sequence decodes to U+FFFD and consumes one byte.
 * Character classes come from utf8proc's general categories.
 */
#ifndef TANDEM_UNICODE_H
#define TANDEM_UNICODE_H

#include <stddef.h>
#include <stdint.h>

/* Coarse classes used by the BPE pre-tokenizers (exactly one is set). */
enum unicode_class {
    UCLASS_LETTER = 1,   /* \p{L}: Lu Ll Lt Lm Lo */
    UCLASS_NUMBER = 2,   /* \p{N}: Nd Nl No */
    UCLASS_SPACE  = 4,   /* \s: the Unicode White_Space property */
    UCLASS_OTHER  = 8    /* everything else (punctuation, symbols, marks, controls, unassigned) */
};

#define UNICODE_REPLACEMENT 0xFFFDu

/* Bytes of the sequence a lead byte announces (1..4, from its high nibble). */
size_t unicode_seq_len(unsigned char lead);
/* Decode the code point at s (n > 0 bytes available). Returns the bytes consumed
 * (>= 1); *cp is U+FFFD when the bytes are not a well-formed sequence. */
size_t unicode_decode(const unsigned char *s, size_t n, uint32_t *cp);
/* Encode cp as UTF-8 into out (4 bytes room); returns the length, 0 if cp > 0x10FFFF. */
int unicode_encode(uint32_t cp, char *out);
int unicode_class_of(uint32_t cp);
int unicode_is_space(uint32_t cp);
/* Length of the longest prefix of s[0..n) that does not end inside a sequence
 * which is still incomplete (a valid lead byte followed by too few valid
 * continuation bytes at the very end). Invalid bytes count as complete. */
size_t unicode_complete_prefix(const unsigned char *s, size_t n);
/* Length of the strictly valid UTF-8 sequence at s (n > 0 bytes left) and its
 * code point, or 0 (overlong, surrogate, > U+10FFFF, truncated, stray byte). */
size_t unicode_strict_seq(const unsigned char *s, size_t n, uint32_t *cp);
/* 1 if s[0..n) is strictly valid UTF-8 (no overlongs, surrogates or > U+10FFFF). */
int unicode_valid_utf8(const unsigned char *s, size_t n);

#endif
