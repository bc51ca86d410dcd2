/* gguf.h - bounds-checked GGUF (v2, v3) reader over mmap, and a small writer.
 *
 * The reader never trusts the file: every count, string length, array length,
 * tensor shape, offset and size is checked against the mapped bytes before it
 * is used. Strings returned point into the mapping and are NOT NUL-terminated
 * (gguf_str carries the length). A gguf_file is immutable after open, so it may
 * be shared by threads.
 */
#ifndef TANDEM_GGUF_H
#define TANDEM_GGUF_H

#include <stddef.h>
#include <stdint.h>

/* ==== Tensor element types (ggml's numbering, a fact of the format) ==== */
enum ggml_type {
    GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1, GGML_TYPE_Q4_0 = 2, GGML_TYPE_Q4_1 = 3,
    GGML_TYPE_Q5_0 = 6, GGML_TYPE_Q5_1 = 7, GGML_TYPE_Q8_0 = 8, GGML_TYPE_Q8_1 = 9,
    GGML_TYPE_Q2_K = 10, GGML_TYPE_Q3_K = 11, GGML_TYPE_Q4_K = 12, GGML_TYPE_Q5_K = 13,
    GGML_TYPE_Q6_K = 14, GGML_TYPE_Q8_K = 15, GGML_TYPE_IQ2_XXS = 16, GGML_TYPE_IQ2_XS = 17,
    GGML_TYPE_IQ3_XXS = 18, GGML_TYPE_IQ1_S = 19, GGML_TYPE_IQ4_NL = 20, GGML_TYPE_IQ3_S = 21,
    GGML_TYPE_IQ2_S = 22, GGML_TYPE_IQ4_XS = 23, GGML_TYPE_I8 = 24, GGML_TYPE_I16 = 25,
    GGML_TYPE_I32 = 26, GGML_TYPE_I64 = 27, GGML_TYPE_F64 = 28, GGML_TYPE_IQ1_M = 29,
    GGML_TYPE_BF16 = 30, GGML_TYPE_TQ1_0 = 34, GGML_TYPE_TQ2_0 = 35,
    GGML_TYPE_MXFP4 = 39,      /* 32 elements: 1 shared-exponent byte + 16 bytes */
    GGML_TYPE_COUNT = 40
};

/* Block geometry of a type: elements per block and bytes per block.
 * Returns 0 (and sets nothing) for a type number this reader does not know. */
int gguf_type_geometry(uint32_t type, uint32_t *block_elems, uint32_t *block_bytes);
const char *gguf_type_name(uint32_t type); /* "Q4_K", or "unknown" */
/* Bytes of one row of n elements; 0 if n is not a multiple of the block size
 * or the type is unknown. */
uint64_t gguf_row_bytes(uint32_t type, uint64_t n);

/* ==== Metadata value types ==== */
enum gguf_vtype {
    GGUF_VT_U8 = 0, GGUF_VT_I8 = 1, GGUF_VT_U16 = 2, GGUF_VT_I16 = 3, GGUF_VT_U32 = 4,
    GGUF_VT_I32 = 5, GGUF_VT_F32 = 6, GGUF_VT_BOOL = 7, GGUF_VT_STR = 8, GGUF_VT_ARR = 9,
    GGUF_VT_U64 = 10, GGUF_VT_I64 = 11, GGUF_VT_F64 = 12
};

typedef struct { const char *ptr; uint64_t len; } gguf_str;   /* not NUL-terminated */

/* Limits enforced by the reader and the writer (bytes, excluding any NUL). */
#define GGUF_MAX_KEY_LEN      1024u
#define GGUF_MAX_TENSOR_NAME  256u

/* A metadata array. Fixed-size elements lie at data[i * elem_size]
 * (little-endian, possibly unaligned: read with memcpy). String arrays are
 * read with gguf_arr_str(). Nested arrays are rejected at open. */
typedef struct {
    uint32_t elem_type;        /* enum gguf_vtype */
    uint64_t n;
    const uint8_t *data;       /* fixed-size types: n * elem_size bytes */
    const uint64_t *str_off;   /* string arrays: offset of every GGUF_STR_STRIDE-th string */
    const uint8_t *base;       /* string arrays: str_off is relative to base */
} gguf_arr;

/* A string array indexes one string in 256: gguf_arr_str walks at most 255
 * length prefixes from the nearest, and the index of a 151,936-token
 * vocabulary is 4.6 KiB, not the 1.2 MiB of one offset per string that every
 * process held for the vocabulary and again for the merges (a slice node of
 * Qwen3-0.6B holds 112 MiB of weights: each MiB is 1% of it). Whole arrays
 * are read in order with gguf_str_iter, one step per string. */
#define GGUF_STR_STRIDE 256u

typedef struct {
    gguf_str name;
    uint32_t n_dims;           /* 1..4 */
    uint64_t ne[4];            /* ne[0] = elements per row (contiguous); unused dims are 1 */
    uint32_t type;             /* enum ggml_type */
    uint64_t offset;           /* relative to the data section */
    uint64_t nbytes;
    const void *data;          /* into the mapping, checked in bounds */
} gguf_tensor;

typedef struct gguf_file gguf_file;

/* ==== Open / close ==== */
/* 0 on success; otherwise -1 with a message in err naming what is wrong. */
int gguf_open_file(gguf_file **out, const char *path, char *err, size_t errlen);
/* Parse a buffer the caller keeps alive (fuzzing, tests). No copy. */
int gguf_open_memory(gguf_file **out, const void *data, size_t size, char *err, size_t errlen);
void gguf_close(gguf_file *f);

uint32_t gguf_get_version(const gguf_file *f);
uint64_t gguf_get_alignment(const gguf_file *f);
const void *gguf_get_base(const gguf_file *f);      /* whole file */
uint64_t gguf_get_size(const gguf_file *f);
uint64_t gguf_get_data_offset(const gguf_file *f);   /* start of the data section */

/* ==== Metadata ==== */
int64_t gguf_count_kv(const gguf_file *f);
int64_t gguf_find_kv(const gguf_file *f, const char *key);   /* index or -1 */
gguf_str gguf_kv_key(const gguf_file *f, int64_t i);         /* {"", 0} if i is out of range */
uint32_t gguf_kv_type(const gguf_file *f, int64_t i);        /* UINT32_MAX if i is out of range */

/* Typed getters. Return 0 on success, -1 if the key is absent, -2 if it has
 * an incompatible type or an out-of-range value. Integer getters accept any
 * integer type whose value fits; float getters accept F32 and F64. */
int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out);
int gguf_get_i64(const gguf_file *f, const char *key, int64_t *out);
int gguf_get_f32(const gguf_file *f, const char *key, float *out);
int gguf_get_bool(const gguf_file *f, const char *key, int *out);
int gguf_get_str(const gguf_file *f, const char *key, gguf_str *out);
int gguf_get_arr(const gguf_file *f, const char *key, gguf_arr *out);
/* Element i of a string array (checked); returns 0 or -1. */
int gguf_arr_str(const gguf_arr *a, uint64_t i, gguf_str *out);
/* The elements of a string array in order: init, then each next gives
 * element it->i (0, 1, ...) and returns 0, or -1 past the last (or if a is
 * not a string array). it keeps a pointer to a. */
typedef struct { const gguf_arr *a; uint64_t i, off; } gguf_str_iter;
void gguf_str_iter_init(gguf_str_iter *it, const gguf_arr *a);
int gguf_str_iter_next(gguf_str_iter *it, gguf_str *out);
/* Compare a gguf_str with a C string. */
int gguf_str_eq(gguf_str s, const char *c);

/* ==== Tensors ==== */
int64_t gguf_count_tensors(const gguf_file *f);
const gguf_tensor *gguf_get_tensor(const gguf_file *f, int64_t i);
const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name); /* NULL if absent */

/* ==== Writer ==== */
/* Builds a GGUF v3 file in memory-light fashion: metadata and tensor infos are
 * collected, then gguf_writer_save() streams header, padding and tensor data
 * (supplied by the caller as pointers that must stay valid until save).
 * Keys and tensor names must be unique (adds return -1 otherwise). Tensors are
 * laid out in the order added, each padded to the alignment. alignment 0 means
 * 32, any other must be a power of two >= 8 (new() returns NULL otherwise);
 * a `general.alignment` kv (U32 power of two >= 8, via add_u32 or copy_kv) sets
 * the alignment; if none was added and the alignment is not 32, save() writes
 * one itself. Array data is taken as little-endian (the host order here). */
typedef struct gguf_writer gguf_writer;
gguf_writer *gguf_writer_new(uint32_t alignment);
void gguf_writer_free(gguf_writer *w);
int gguf_writer_add_u32(gguf_writer *w, const char *key, uint32_t v);
int gguf_writer_add_i32(gguf_writer *w, const char *key, int32_t v);
int gguf_writer_add_f32(gguf_writer *w, const char *key, float v);
int gguf_writer_add_bool(gguf_writer *w, const char *key, int v);
int gguf_writer_add_str(gguf_writer *w, const char *key, const char *v);
/* Arrays: elem_type one of the fixed-size vtypes; data holds n elements. */
int gguf_writer_add_arr(gguf_writer *w, const char *key, uint32_t elem_type, const void *data, uint64_t n);
int gguf_writer_add_str_arr(gguf_writer *w, const char *key, const char *const *v, const uint64_t *lens, uint64_t n);
/* Copy a metadata key/value (any type, arrays included) from a reader. */
int gguf_writer_copy_kv(gguf_writer *w, const gguf_file *src, int64_t i);
/* ne[0] is the row length. data must hold gguf_row_bytes(type, ne[0]) * rows bytes. */
int gguf_writer_add_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                           const uint64_t *ne, const void *data);
int gguf_writer_save(gguf_writer *w, const char *path, char *err, size_t errlen);

#endif
