/* tokenizer_internal.h - between the tokenizer's three files (not part of
 * the interface: tokenizer.h is): tokenizer.c loads the vocabulary, merges
 * and special tokens from GGUF into the struct declared here,
 * tokenizer_encode.c turns text into ids (special-token partition, SPM, the
 * BPE pre-tokenizers and merging), tokenizer_decode.c turns ids back into
 * bytes (one token, and the UTF-8-safe stream). */

#ifndef TANDEM_ENGINE_TOKENIZER_INTERNAL_H
#define TANDEM_ENGINE_TOKENIZER_INTERNAL_H

#include "engine/tokenizer.h"

#include <stddef.h>
#include <stdint.h>

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

/* ==== Shared lookups (tokenizer.c) ==== */

int64_t strtab_find(const strtab *t, const char *s, size_t n);
int32_t tok_find(const tokenizer *t, const char *s, size_t n);

#endif
